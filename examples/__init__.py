"""Example training scripts, each run as a script; a package so that the benchmarks can
import their models (`from examples.ddp_mlp import MLP`)."""
