"""Test-only helpers (``host_syncs``); the case matrices and oracles that the benches share
live in torch_metal_flash.testing.

Imported as ``from support import host_syncs`` (tests/conftest.py puts tests/ on sys.path)."""
