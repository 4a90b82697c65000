"""Backend selection, the planner/core/encoder seam, fallback warnings and strict mode."""
import types
import warnings

import numpy as np
import pytest
import torch

import torch_metal_flash as tmf
from torch_metal_flash import backends, core, ops
from torch_metal_flash.backends.emulator import EmulatorBackend
from torch_metal_flash.planner.plan import Launch, Plan, Unsupported


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(backends, "_warned", set())
    monkeypatch.delenv("TORCH_METAL_FLASH_BACKEND", raising=False)
    monkeypatch.delenv("TORCH_METAL_FLASH_STRICT", raising=False)


def _qkv():
    torch.manual_seed(0)
    return torch.randn(1, 6, 2, 8), torch.randn(1, 9, 2, 8), torch.randn(1, 9, 2, 8)


def test_selection_order(monkeypatch):
    assert backends.requested() == "auto"
    monkeypatch.setenv("TORCH_METAL_FLASH_BACKEND", "reference")
    assert backends.requested() == "reference"
    with tmf.backend("metal"):
        assert backends.requested() == "metal"
        with tmf.backend("emulator"):
            assert backends.requested() == "emulator"
        assert backends.requested() == "metal"
    assert backends.requested() == "reference"


def test_auto_uses_reference_for_cpu_tensors_silently():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert backends.resolve(torch.device("cpu")) is None


def test_metal_on_cpu_tensors_falls_back_once_with_reason():
    q, k, v = _qkv()
    with tmf.backend("metal"):
        with pytest.warns(tmf.FallbackWarning, match="the metal backend runs on MPS tensors, got cpu"):
            out = tmf.flash_attn_func(q, k, v)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the same reason warns only once
            tmf.flash_attn_func(q, k, v)
    with tmf.backend("reference"):
        torch.testing.assert_close(out, tmf.flash_attn_func(q, k, v))


def test_strict_mode_raises_instead(monkeypatch):
    q, k, v = _qkv()
    with tmf.backend("metal", strict=True):
        with pytest.raises(tmf.UnsupportedError, match="metal backend runs on MPS tensors"):
            tmf.flash_attn_func(q, k, v)
    monkeypatch.setenv("TORCH_METAL_FLASH_STRICT", "1")
    with tmf.backend("metal"):
        with pytest.raises(tmf.UnsupportedError):
            tmf.flash_attn_func(q, k, v)


class RecordingEncoder:
    """Stands in for the emulator's encode (what the C++ core's emulator encoder
    calls): records the bound launches and pretends the kernel wrote out and lse."""

    def __init__(self):
        self.plans = []

    def __call__(self, launches):
        self.plans.append(launches)
        for _, buffers in launches:
            np.frombuffer(buffers[3], dtype=np.float32)[:] = 1.0  # out
            np.frombuffer(buffers[4], dtype=np.float32)[:] = 0.0  # lse


@pytest.fixture
def seam(monkeypatch, request):
    """Plan with a stand-in planner and record what reaches the emulator encoder."""
    def install(answer):
        encoder = RecordingEncoder()
        calls = []

        def plan_forward(spec, out, lse, aux, family, pipeline_info):
            calls.append(spec)
            return answer(spec, out, lse)
        monkeypatch.setattr(ops.attention, "planner", types.SimpleNamespace(plan_forward=plan_forward))
        # (patched on the class: undoing a patch of the instance would leave an instance attribute behind)
        monkeypatch.setattr(EmulatorBackend, "prepare", lambda self, *launch: launch)
        monkeypatch.setattr(EmulatorBackend, "encode", lambda self, launches: encoder(launches))
        core.plan_cache_clear()  # the stand-in planner must see the calls ...
        request.addfinalizer(core.plan_cache_clear)  # ... and its templates must not outlive the test
        return encoder, calls
    return install


def test_seam_runs_the_plan_on_the_backend(seam):
    def answer(spec, out, lse):
        return Plan((Launch("flash_fwd.metal", "k", (1, 1, 1), (32, 1, 1), {3: out, 4: lse}),))
    encoder, calls = seam(answer)
    q, k, v = _qkv()
    with tmf.backend("emulator"):
        out, lse, _ = tmf.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        tmf.flash_attn_func(q, k, v, causal=True)  # a plan-cache hit: encoded without planning
    assert len(encoder.plans) == 2 and len(calls) == 1 + core.plan_cache_info()["verify"]
    spec = calls[0]
    assert (spec.diag_offset, spec.window_left, spec.window_right) == (3, -1, 0)
    assert spec.q.data_ptr() == q.data_ptr(), "the flash-attn layout reaches the planner without a copy"
    assert torch.equal(out, torch.ones_like(out)) and torch.equal(lse, torch.zeros_like(lse))


def test_unsupported_plan_falls_back_with_its_reason(seam):
    encoder, _ = seam(lambda spec, out, lse: Unsupported("head dim 300 > 256"))
    q, k, v = _qkv()
    with tmf.backend("emulator"), pytest.warns(tmf.FallbackWarning, match="head dim 300 > 256"):
        out = tmf.flash_attn_func(q, k, v)
    assert encoder.plans == []
    torch.testing.assert_close(out, tmf.flash_attn_func(q, k, v))


def test_unsupported_reason_probe(seam):
    q, k, v = (t.transpose(1, 2) for t in _qkv())
    args = (q, k, v, None, None, None, 0.3, 0, -1, 0, 0.0)
    assert ops.unsupported_reason(*args) == "the reference backend is selected"
    with tmf.backend("metal"):
        assert "metal backend runs on MPS tensors" in ops.unsupported_reason(*args)
    seam(lambda spec, out, lse: Unsupported("head dim 300 > 256"))
    with tmf.backend("emulator"), warnings.catch_warnings():
        warnings.simplefilter("error")  # a probe never warns
        assert ops.unsupported_reason(*args) == "head dim 300 > 256"
