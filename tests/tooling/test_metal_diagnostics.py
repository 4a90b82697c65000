"""The metal backend says why it cannot run: the real import error of ``_C``
(ABI mismatch, missing symbol), told apart from "not built"; imported once."""
import importlib.abc
import sys

import pytest
import torch

import torch_metal_flash as tmf
from torch_metal_flash import backends
from torch_metal_flash import native
from torch_metal_flash.backends import metal

MPS = torch.device("mps")  # a device object only: nothing is allocated on it


class BrokenExtension(importlib.abc.MetaPathFinder):
    """Makes ``import torch_metal_flash._C`` fail the way a stale build does."""

    def __init__(self, error):
        self.error = error
        self.attempts = 0

    def find_spec(self, name, path=None, target=None):
        if name == "torch_metal_flash._C":
            self.attempts += 1
            raise self.error
        return None


@pytest.fixture
def fresh(monkeypatch):
    native.load_launcher.cache_clear()
    monkeypatch.setattr(backends, "_warned", set())
    monkeypatch.delitem(sys.modules, "torch_metal_flash._C", raising=False)
    yield monkeypatch
    native.load_launcher.cache_clear()


def _break(monkeypatch, error):
    finder = BrokenExtension(error)
    monkeypatch.setattr(sys, "meta_path", [finder] + sys.meta_path)
    return finder


def test_abi_mismatch_is_reported_with_the_import_error_and_imported_once(fresh):
    finder = _break(fresh, ImportError("dlopen(_C.so): Symbol not found: __ZN3c1017RegisterOperatorsD1Ev"))
    fresh.setattr(native, "build_info", lambda: {"torch": "2.13.9"})
    why = metal.unavailable_reason(MPS)
    assert "failed to import: ImportError: dlopen(_C.so): Symbol not found: __ZN3c1017Register" in why
    assert f"built against torch 2.13.9, this process runs torch {torch.__version__}" in why
    assert "--no-build-isolation" in why
    assert metal.unavailable_reason() == why and metal.unavailable_reason(MPS) == why
    assert finder.attempts == 1, "the import is attempted once per process"
    with tmf.backend("metal"):
        with pytest.warns(tmf.FallbackWarning, match="Symbol not found"):
            assert backends.resolve(MPS) is None
    with tmf.backend("metal", strict=True):
        with pytest.raises(tmf.UnsupportedError, match="failed to import"):
            backends.resolve(MPS)


def test_any_failure_inside_the_extension_import_is_reported(fresh):
    _break(fresh, RuntimeError("pybind11: generic_type: type already registered"))
    assert "failed to import: RuntimeError: pybind11: generic_type" in metal.unavailable_reason(MPS)


def test_not_built_is_told_apart_from_a_broken_build(fresh):
    why = metal.unavailable_reason(MPS)  # this install has no _C (Linux)
    assert "is not built" in why and "failed to import" not in why
    fresh.setattr(sys, "platform", "darwin")
    fresh.setattr(native, "build_info", lambda: {"extension": "torch was built without MPS"})
    native.load_launcher.cache_clear()
    why = metal.unavailable_reason(MPS)
    assert "not built in this install (torch was built without MPS)" in why and "--no-build-isolation" in why


def test_device_reason_comes_first():
    assert metal.unavailable_reason(torch.device("cpu")) == "the metal backend runs on MPS tensors, got cpu"
