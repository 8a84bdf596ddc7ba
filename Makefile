# The two commands: `make demo` and `make test`. Both set everything up first.
SHELL := /bin/bash
PY := .venv/bin/python

.PHONY: env demo test lint bench
env:
	bash scripts/bootstrap.sh

demo: env
	$(PY) -m examples.demo

test: env
	$(PY) -m ruff check .
	$(PY) -m pytest -q

# A short run of every area: a check that each runs end to end, not a figure (the full
# commands: bench/README.md). Into out/bench, so the committed results stay as they are.
SHORT := CROSSOVER_BENCH_RESULTS=$(CURDIR)/out/bench $(PY) -m
bench: env
	$(SHORT) bench.overhead.handoff --cycles 300 --reps 1 --pipeline-reps 1
	$(SHORT) bench.colocation.makespan --one-host --mbit '' --workloads mlp --reps 1 --steps 20
	$(SHORT) bench.robustness.scale --nodes 64 --steps 20 --churn 20
	$(SHORT) bench.pipeline.compare --quick --models chain --real-ranks 2 --pairs 1 \
	  --peer-reps 1 --sim-scale '' --calibration $(CURDIR)/out/bench/pipeline-runtime.json
	$(SHORT) bench.freeze.tracker_cost --reps 1 --steps 40 --pairs 1
	bash bench/device_suite.sh --dry-run --parts ddp
	@echo "make bench: every area ran; results in out/bench"
