"""The pieces of scripts/bench_serve.py (the OpenAI-compatible server under load), one job per module.

- results: what a request and a level (one mode at one concurrency) measured, and their summary statistics;
- client: the load generator (streaming completions over httpx) and the scrape of the server's counters;
- servers: starting, waiting for, and stopping the servers under test;
- sweep: the benchmark itself: warm-up, then every mode at every concurrency level;
- report: ratios between modes, the targets, the markdown tables, the plot and the output files.
"""
