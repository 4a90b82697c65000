"""Backend selection, the planner/backend seam, fallback warnings and strict mode."""
import types
import warnings

import pytest
import torch

import torch_metal_flash as tmf
from torch_metal_flash import backends, ops
from torch_metal_flash.plan import Plan, Unsupported


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


class RecordingBackend:
    """Executes nothing; records the plans it is handed."""
    name = "recording"

    def __init__(self):
        self.plans = []

    def run(self, plan):
        self.plans.append(plan)
        for launch in plan.launches:
            launch.buffers[3].fill_(1.0)  # pretend the kernel wrote out
            launch.buffers[4].fill_(0.0)


def _seam(monkeypatch, answer):
    backend = RecordingBackend()
    calls = []

    def plan_forward(spec, out, lse, aux, family):
        calls.append(spec)
        return answer(spec, out, lse)
    monkeypatch.setattr(backends, "resolve", lambda device: backend)
    monkeypatch.setattr(ops, "planner", types.SimpleNamespace(plan_forward=plan_forward))
    return backend, calls


def test_seam_runs_the_plan_on_the_backend(monkeypatch):
    from torch_metal_flash.plan import Launch

    def answer(spec, out, lse):
        return Plan((Launch("flash_fwd.metal", "k", (1, 1, 1), (32, 1, 1), {3: out, 4: lse}),))
    backend, calls = _seam(monkeypatch, answer)
    q, k, v = _qkv()
    out, lse, _ = tmf.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert len(backend.plans) == 1 and len(calls) == 1
    spec = calls[0]
    assert (spec.diag_offset, spec.window_left, spec.window_right) == (3, -1, 0)
    assert spec.q.data_ptr() == q.data_ptr(), "the flash-attn layout reaches the planner without a copy"
    assert torch.equal(out, torch.ones_like(out)) and torch.equal(lse, torch.zeros_like(lse))


def test_unsupported_plan_falls_back_with_its_reason(monkeypatch):
    backend, _ = _seam(monkeypatch, lambda spec, out, lse: Unsupported("head dim 300 > 256"))
    q, k, v = _qkv()
    with pytest.warns(tmf.FallbackWarning, match="head dim 300 > 256"):
        out = tmf.flash_attn_func(q, k, v)
    assert backend.plans == []
    monkeypatch.undo()
    torch.testing.assert_close(out, tmf.flash_attn_func(q, k, v))


def test_unsupported_reason_probe(monkeypatch):
    q, k, v = (t.transpose(1, 2) for t in _qkv())
    args = (q, k, v, None, None, None, 0.3, 0, -1, 0, 0.0)
    assert ops.unsupported_reason(*args) == "the reference backend is selected"
    with tmf.backend("metal"):
        assert "metal backend runs on MPS tensors" in ops.unsupported_reason(*args)
    _seam(monkeypatch, lambda spec, out, lse: Unsupported("head dim 300 > 256"))
    monkeypatch.setattr(backends, "select", lambda device: (RecordingBackend(), None))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a probe never warns
        assert ops.unsupported_reason(*args) == "head dim 300 > 256"
