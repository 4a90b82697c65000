"""Fixtures of the tuning tests: a tuning cache of the test's own."""
import pytest

from torch_metal_flash import tuning


@pytest.fixture
def tuning_cache(tmp_path, monkeypatch):
    path = tmp_path / "tuning.json"
    monkeypatch.setenv("TORCH_METAL_FLASH_TUNING_CACHE", str(path))
    tuning.reload()
    yield path
    monkeypatch.delenv("TORCH_METAL_FLASH_TUNING_CACHE")
    tuning.reload()
