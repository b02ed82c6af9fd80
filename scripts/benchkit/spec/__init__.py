"""The pieces of scripts/bench_spec.py (speculative decoding of the default model), one job per module.

- configs: what runs (the methods and K settings, their labels and descriptions);
- cost: c(T), the target forward over T new tokens as a multiple of the one-token forward;
- runner: runs a configuration on a workload's prompts (compiled first, then timed) and summarises the run;
- checks: comparisons between runs (speedups over `none`, greedy equality, how extractive outputs are) and
  the issue's targets;
- overhead: the proposer's and rejection sampling's own cost, standalone, at the real shapes;
- peers: transformers' plain and prompt-lookup decoding on the same prompts;
- report: the markdown tables and the acceptance-against-position plot.
"""
