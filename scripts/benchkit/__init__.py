"""What the benchmark scripts (scripts/bench*.py, scripts/demo.py) share, one module per job.

- machine: where and when a run happened (CPU, cores, jax/flax versions, device, date), the header of a report;
- timing: warm-up calls, repeats, runs taking turns side by side, ratios to a baseline;
- tables: markdown tables and number formatting, as the reports print them;
- plots: matplotlib when it is installed (the [bench] extra), a note when it is not;
- workloads: the prompts, one loader per workload (HumanEval free-form and held-out, extractive chat requests);
- acceptance: mean acceptance length over several calls, from the stats objects' own definition;
- peer_hf: the Hugging Face transformers peer;
- peer_vllm: the vLLM peer, a standalone script run in vLLM's own venv (scripts/bench_peer.py drives it);
- page: docs/benchmarks.md's generated blocks (`--write-page`), and the reports' JSON in bench_out/;
- trace: a jax.profiler trace summed by event (benchkit/profile.py);
- verify_cost, mesh: `bench_kernel.py verify-cost` and `bench_kernel.py mesh`.

The two largest benchmarks keep their pieces in subpackages: spec/ (scripts/bench_spec.py) and serve/
(scripts/bench_serve.py; serve/engine.py is `bench_serve.py --engine`). The scripts run as
`python scripts/bench_x.py`, so Python puts scripts/ on sys.path and `import benchkit` finds this package.
"""

import jaxspec.cost

# A timed call must not share the machine with a verify-cost measurement running in the background (the library's
# default, `jaxspec.cost.BACKGROUND`): the benchmarks measure a shape's table before the first call that needs it,
# as a warm-up. scripts/bench_compile.py measures the default itself.
jaxspec.cost.BACKGROUND = False
