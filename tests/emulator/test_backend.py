"""The emulator backend executes plans: same Launch objects as the Metal backend."""
from __future__ import annotations

import math

import pytest
import torch

from emu_helpers import KERNELS, ORDERS
from torch_metal_flash import emulator
from torch_metal_flash.backends import emulator as backend_mod
from torch_metal_flash.planner.plan import Launch, Plan
from test_attention import AttnParams, _reference


@pytest.fixture
def backend(monkeypatch):
    monkeypatch.setattr(backend_mod, "shaders_dir", lambda: KERNELS)
    return backend_mod.EmulatorBackend()


def _attention_plan(q, k, v, o, lse, causal):
    H, L, d = q.shape
    S = k.shape[1]
    p = AttnParams(L, S, L * d, S * d, S * d, L * d, d, d, d, d, math.log2(math.e) / math.sqrt(d))
    return Plan(launches=(Launch(source="attention.metal", kernel=f"attention_float16_bq16_bk8_d{d}",
                                 threadgroups=((L + 15) // 16, H, 1), threadgroup=(64, 1, 1),
                                 buffers={0: q, 1: k, 2: v, 3: o, 4: lse, 5: bytes(p)},
                                 function_constants={300: False, 301: causal}),))


def test_backend_runs_a_plan_in_every_order(backend):
    torch.manual_seed(0)
    H, L, S, d = 2, 37, 29, 64
    q, k, v = (torch.randn(H, n, d).half() for n in (L, S, S))
    ref, ref_lse, _ = _reference(q, k, v, 1 / math.sqrt(d), True, None)
    outs = []
    for order in ORDERS:
        o, lse = torch.zeros(H, L, d).half(), torch.zeros(H, L)
        with emulator.settings(order=order, checked=order != "random", seed=5):
            backend.run(_attention_plan(q, k, v, o, lse, causal=True))
        assert backend.last_stats[0].order == order
        assert backend.last_stats[0].checked == (order != "random")
        assert (o.double() - ref).abs().max() < 5e-3
        outs.append(o)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    assert backend.name == "emulator"


def test_backend_binds_views_at_their_storage_offset(backend):
    torch.manual_seed(1)
    H, L, d = 1, 16, 32
    big = torch.randn(3, H, L, d).half()
    q, k, v = big[0], big[1], big[2]  # views into one storage, non-zero offsets
    o_store = torch.zeros(2, H, L, d).half()
    o, lse = o_store[1], torch.zeros(H, L)
    plan = _attention_plan(q, k, v, o, lse, causal=False)
    plan = Plan(launches=(Launch(**{**plan.launches[0].__dict__, "kernel": "attention_float16_bq16_bk16_d32"}),))
    backend.run(plan)
    ref, _, _ = _reference(q, k, v, 1 / math.sqrt(d), False, None)
    assert (o.double() - ref).abs().max() < 5e-3
    assert o_store[0].eq(0).all()


def test_settings_nest_and_environment(monkeypatch):
    from torch_metal_flash.emulator import config
    monkeypatch.setenv("TORCH_METAL_FLASH_EMULATOR_ORDER", "reverse")
    monkeypatch.setenv("TORCH_METAL_FLASH_EMULATOR_CHECKED", "0")
    monkeypatch.setattr(config, "_default_checked", None)
    assert config.default_order() == "reverse" and config.default_checked() is False
    with emulator.settings(order="random", checked=True):
        assert config.default_order() == "random" and config.default_checked() is True
        with emulator.settings(order="forward"):
            assert config.default_order() == "forward" and config.default_checked() is True
    assert config.default_order() == "reverse"
    emulator.set_default_checked(True)
    assert config.default_checked() is True
    monkeypatch.setattr(config, "_default_checked", None)
    with pytest.raises(ValueError, match="unknown schedule order"):
        with emulator.settings(order="sideways"):
            pass
