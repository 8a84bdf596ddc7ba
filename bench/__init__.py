"""Crossover's benchmarks, by area; each script runs from the repository root as a module
(`python -m bench.<area>.<script>`) and imports only `bench.harness` and the product.
bench/README.md lists each area's commands and what they write to bench/results/<area>/."""
