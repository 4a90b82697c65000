"""Fixtures of the tuning tests: the kernels launched, a tuning cache of the test's own."""
import pytest

from torch_metal_flash import tuning
from torch_metal_flash.backends.emulator import EmulatorBackend


@pytest.fixture
def launched(monkeypatch):
    """The kernel names of every emulator launch made while the test runs."""
    names = []
    encode = EmulatorBackend.encode

    def recording_encode(self, launches):
        names.extend(prepared[1] for prepared, _ in launches)  # prepared: (source, kernel, ...)
        encode(self, launches)

    monkeypatch.setattr(EmulatorBackend, "encode", recording_encode)
    return names


@pytest.fixture
def tuning_cache(tmp_path, monkeypatch):
    path = tmp_path / "tuning.json"
    monkeypatch.setenv("TORCH_METAL_FLASH_TUNING_CACHE", str(path))
    tuning.reload()
    yield path
    monkeypatch.delenv("TORCH_METAL_FLASH_TUNING_CACHE")
    tuning.reload()
