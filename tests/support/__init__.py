"""Helpers the tests share: case matrices, problem builders and the independent float64 oracles.

Imported as ``from support import forward_cases`` (tests/conftest.py puts tests/ on sys.path)."""
