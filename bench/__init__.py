"""Benchmarks: run from the repo root as ``python -m bench.<name>``."""
