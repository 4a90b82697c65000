"""The forward kernel matrix, shared by tests/kernels/test_forward_kernels.py
(a fixed-seed sample) and bench/sweep_forward.py (the full sweep).

A case is a plain dict; ``build_spec`` makes the tensors (deterministically
from the case), ``run_forward`` plans and runs it on the emulator backend,
``check`` applies the acceptance rule (oracle.py) against the float64 oracle.
"""
from __future__ import annotations

import itertools
import random
import zlib
from typing import Iterator, Optional

import torch

from torch_metal_flash.planner.plan import Plan
from torch_metal_flash.planner.forward import plan_forward
from torch_metal_flash.problem.spec import make_spec
from torch_metal_flash.testing.oracle import check_forward, randn

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
HEAD_DIMS = (32, 64, 80, 96, 128, 256, 72, 40)
ODD_HEAD_DIMS = (1, 3, 8, 13, 100, 200)
SEQ_PAIRS = ((1, 1), (1, 239), (3, 799), (113, 203), (128, 217), (127, 512), (1000, 1000),
             (257, 129), (17, 17), (3, 17), (17, 3), (255, 257))
SMALL_SEQ_PAIRS = ((1, 1), (1, 39), (3, 17), (17, 3), (17, 17), (29, 65), (40, 33), (9, 100))
MASKING = ("none", "causal_tl", "causal_br", "window", "window_sym", "diag_neg")
GQA = ((2, 2), (4, 1), (4, 2), (6, 3))
FEATURES = ("none", "softcap", "alibi_h", "alibi_bh", "sinks", "bias_full", "bias_bcast",
            "bias_f32_rows", "bool_full", "bool_bcast", "bool_keys", "all")
LAYOUTS = ("bhld", "blhd")


def case_id(c: dict) -> str:
    return (f"{c['dtype']}-d{c['d']}{'' if c.get('dv', c['d']) == c['d'] else 'v' + str(c['dv'])}"
            f"-{c['lq']}x{c['lk']}-{c['masking']}-h{c['hq']}:{c['hkv']}-{c['feature']}-{c['layout']}"
            f"-b{c.get('batch', 1)}")


def full_matrix(every_combination: bool = False) -> Iterator[dict]:
    """The sweep: every dtype x head dim x (Lq, Lk) pair x masking, with the
    GQA ratio, the extra feature and the layout rotated through all their
    values (1,728 cases); ``every_combination`` crosses those too (165,888)."""
    rot = list(itertools.product(GQA, FEATURES, LAYOUTS))
    i = 0
    for dt, d, (lq, lk), masking in itertools.product(DTYPES, HEAD_DIMS, SEQ_PAIRS, MASKING):
        combos = rot if every_combination else [rot[(i * 7) % len(rot)]]
        i += 1
        for (hq, hkv), feature, layout in combos:
            yield dict(dtype=dt, d=d, lq=lq, lk=lk, masking=masking, hq=hq, hkv=hkv, feature=feature,
                       layout=layout, batch=1 if lq * lk > 20000 else 2)


def sample_cases(n: int, seed: int, seq_pairs=SMALL_SEQ_PAIRS, head_dims=HEAD_DIMS + ODD_HEAD_DIMS) -> list[dict]:
    """``n`` cases drawn with a fixed seed, covering every value of every axis
    at least once (round-robin over each axis, shuffled independently)."""
    rng = random.Random(seed)
    axes = {
        "dtype": list(DTYPES), "d": list(head_dims), "seq": list(seq_pairs), "masking": list(MASKING),
        "gqa": list(GQA), "feature": list(FEATURES), "layout": list(LAYOUTS), "batch": [1, 2],
    }
    columns = {}
    for name, values in axes.items():
        col = []
        while len(col) < n:
            chunk = values[:]
            rng.shuffle(chunk)
            col.extend(chunk)
        columns[name] = col[:n]
    cases = []
    for i in range(n):
        lq, lk = columns["seq"][i]
        hq, hkv = columns["gqa"][i]
        cases.append(dict(dtype=columns["dtype"][i], d=columns["d"][i], lq=lq, lk=lk,
                          masking=columns["masking"][i], hq=hq, hkv=hkv, feature=columns["feature"][i],
                          layout=columns["layout"][i], batch=columns["batch"][i]))
    return cases


def _band(c: dict) -> dict:
    lq, lk, m = c["lq"], c["lk"], c["masking"]
    if m == "none":
        return {}
    if m == "causal_tl":
        return dict(window_right=0)
    if m == "causal_br":
        return dict(window_right=0, diag_offset=lk - lq)
    if m == "window":
        return dict(window_left=max(1, lk // 4), window_right=0, diag_offset=lk - lq)
    if m == "window_sym":
        return dict(window_left=5, window_right=3, diag_offset=(lk - lq) // 2)
    if m == "diag_neg":  # causal with the diagonal moved up: leading rows see nothing
        return dict(window_right=0, diag_offset=-min(lq, 7))
    raise ValueError(m)


def build_spec(c: dict, seed: int = 0):
    """The spec of a case (tensors drawn from ``seed``); a flash-attn layout
    enters as a transposed view, masks as broadcast views."""
    g = torch.Generator().manual_seed(seed)
    dt = DTYPES[c["dtype"]]
    B, Hq, Hkv, Lq, Lk, D = c.get("batch", 1), c["hq"], c["hkv"], c["lq"], c["lk"], c["d"]
    Dv = c.get("dv", D)
    scale = c.get("scale", D ** -0.5)
    amp = c.get("amplitude", 1.0)

    def rnd(*shape):
        return (randn(*shape, generator=g) * amp).to(dt)

    if c["layout"] == "blhd":
        q = rnd(B, Lq, Hq, D).transpose(1, 2)
        k = rnd(B, Lk, Hkv, D).transpose(1, 2)
        v = rnd(B, Lk, Hkv, Dv).transpose(1, 2)
    else:
        q, k, v = rnd(B, Hq, Lq, D), rnd(B, Hkv, Lk, D), rnd(B, Hkv, Lk, Dv)
    mask = alibi = sinks = None
    softcap = 0.0
    f = c["feature"]
    if f in ("softcap", "all"):
        softcap = 5.0
    if f in ("alibi_h", "all"):
        alibi = torch.rand(Hq, generator=g) * 0.3  # per head: broadcast over batch
    if f == "alibi_bh":
        alibi = torch.rand(B, Hq, generator=g) * 0.3
    if f in ("sinks", "all"):
        sinks = randn(Hq, generator=g)
    if f == "bias_full":
        mask = randn(B, Hq, Lq, Lk, generator=g).to(dt)
    if f == "bias_bcast":
        mask = randn(1, Hq, 1, Lk, generator=g).to(dt)
    if f == "bias_f32_rows":  # float32 bias with fp16/bf16 inputs, broadcast over keys
        mask = randn(Lq, 1, generator=g)
    if f in ("bool_full", "all"):
        mask = torch.rand(B, Hq, Lq, Lk, generator=g) > 0.25
    if f == "bool_bcast":
        mask = torch.rand(B, 1, Lq, Lk, generator=g) > 0.5
    if f == "bool_keys":  # key padding mask
        mask = torch.arange(Lk) < max(1, Lk - 3)
    return make_spec(q, k, v, mask=mask, alibi_slopes=alibi, sinks=sinks, scale=scale,
                     softcap=softcap, **_band(c))


def outputs_for(spec):
    """Preallocated ``out`` (q's layout) and ``lse``."""
    q = spec.q
    if spec.head_dim_v == spec.head_dim:
        out = torch.empty_like(q)
    else:
        from torch_metal_flash.problem.layout import empty_in_layout
        out = empty_in_layout(q, spec.head_dim_v)
    lse = torch.empty(q.shape[:3], dtype=torch.float32)
    return out, lse


def plan_case(spec, family: str = "apple8"):
    out, lse = outputs_for(spec)
    plan = plan_forward(spec, out, lse, family=family)  # the prefill planner: always flash_fwd.metal
    assert isinstance(plan, Plan), f"unsupported: {plan}"
    return plan, out, lse


_BACKEND = None


def backend():
    """One emulator backend for the process (it caches compiled libraries)."""
    global _BACKEND
    if _BACKEND is None:
        from torch_metal_flash.backends.emulator import EmulatorBackend
        _BACKEND = EmulatorBackend()
    return _BACKEND


def run_forward(spec, order: str = "forward", checked: bool = True, family: str = "apple8"):
    from torch_metal_flash import emulator

    plan, out, lse = plan_case(spec, family)
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    with emulator.settings(order=order, checked=checked, family=family):
        backend().run(plan)
    return out, lse


def check(spec, out, lse) -> None:
    check_forward(spec, out, lse)


def run_and_check(c: dict, orders=("forward", "reverse"), checked: bool = True, seed: Optional[int] = None,
                  family: str = "apple8"):
    spec = build_spec(c, seed=zlib.crc32(case_id(c).encode()) if seed is None else seed)
    first = None
    for order in orders:
        out, lse = run_forward(spec, order=order, checked=checked, family=family)
        check(spec, out, lse)
        if first is None:
            first = (out.clone(), lse.clone())
        else:  # the schedule must not change a single bit
            assert torch.allclose(out.float(), first[0].float(), rtol=0, atol=0, equal_nan=True), \
                f"output depends on schedule order ({order})"
            assert torch.allclose(lse, first[1], rtol=0, atol=0, equal_nan=True), \
                f"lse depends on schedule order ({order})"
    return spec


def tile_family(tile) -> str:
    """A family whose backend runs ``tile``'s kernel (the accelerator kernels need apple10)."""
    from torch_metal_flash.planner.tiles import NAX_FAMILY
    return NAX_FAMILY if tile.nax else "apple8"


def tile_for(spec, family: str = "apple8"):
    from torch_metal_flash.planner.forward import forward_tile_for
    return forward_tile_for(spec, family)


def launch_stats(launch, order: str = "forward", checked: bool = True):
    """Run one Launch through the emulator backend and return its LaunchStats."""
    from torch_metal_flash import emulator
    from torch_metal_flash.planner.plan import Plan as _Plan

    with emulator.settings(order=order, checked=checked):
        backend().run(_Plan(launches=(launch,)))
    return backend().last_stats[0]


def stats_dict(stats) -> dict:
    """The emulator's stats object as a plain dict."""
    if isinstance(stats, dict):
        return dict(stats)
    if hasattr(stats, "_asdict"):
        return dict(stats._asdict())
    if hasattr(stats, "__dataclass_fields__"):
        import dataclasses
        return dataclasses.asdict(stats)
    return {k: getattr(stats, k) for k in dir(stats) if not k.startswith("_") and not callable(getattr(stats, k))}


def build_stats_for(spec, checked: bool = True, order: str = "forward", family: str = "apple8") -> dict:
    plan, out, lse = plan_case(spec, family)
    (launch,) = plan.launches
    return stats_dict(launch_stats(launch, order=order, checked=checked))
