# The two commands: `make demo` and `make test`. Both set everything up first.
SHELL := /bin/bash
PY := .venv/bin/python

.PHONY: env demo test lint bench
env:
	bash scripts/bootstrap.sh

demo: env
	$(PY) examples/demo.py

test: env
	$(PY) -m ruff check .
	$(PY) -m pytest -q

bench: env
	$(PY) bench/overhead_bench.py
