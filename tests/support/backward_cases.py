"""Backward-kernel cases for the tests and the benches: the forward state a backward starts
from, one backward launch in the emulator (``run_backward``), a case checked against the
float64 oracle in two schedule orders (``run_and_check``), and fixed-seed samples of the
forward matrix (forward_cases.py) with GQA ratios and dlse."""
from __future__ import annotations

import random
import zlib
from typing import Optional

import torch

from torch_metal_flash._paths import shaders_dir
from torch_metal_flash.problem.layout import empty_in_layout
from torch_metal_flash.planner.plan import Plan
from torch_metal_flash.problem.spec import AttentionSpec
import support.forward_cases as fc
from torch_metal_flash.testing.oracle import check_backward, randn

ORDER_PAIRS = (("forward", "reverse"), ("reverse", "random"), ("random", "forward"))
DTYPES = fc.DTYPES
GQA_BWD = ((1, 1), (2, 1), (4, 2), (4, 1), (8, 1), (8, 4), (6, 3))


# ---------------------------------------------------------------------------
# The forward state the backward starts from.
# ---------------------------------------------------------------------------
def saved_forward(spec: AttentionSpec, family: str = "apple8"):
    """What the forward saved for the backward: ``out`` and ``aux`` (row max and
    sum; the float32 output for fp16/bf16), from the forward kernel of ``family``'s
    plan in the emulator (fast mode) -- the backward rebuilds P from the very same scores."""
    from torch_metal_flash import emulator
    from torch_metal_flash.ops.attention import _fwd_buffers
    from torch_metal_flash.planner import plan_forward

    out, lse, aux = _fwd_buffers(spec.q, spec.v, True)
    plan = plan_forward(spec, out, lse, aux, family=family)
    assert isinstance(plan, Plan), f"unsupported: {plan}"
    with emulator.settings(checked=False, family=family):
        fc.backend().run(plan)
    return out, aux


# ---------------------------------------------------------------------------
# Running the plan in the emulator.
# ---------------------------------------------------------------------------
_LIBS: dict = {}


def _library(source: str, constants: dict):
    from torch_metal_flash import emulator
    from torch_metal_flash._paths import shader_language
    from torch_metal_flash.emulator import config
    math_mode = config.backend_math_mode()  # the Metal launcher's, as the emulator backend compiles
    key = (source, tuple(sorted(constants.items())), math_mode)
    lib = _LIBS.get(key)
    if lib is None:
        lib = emulator.compile_shader(shaders_dir() / source, include_dirs=(str(shaders_dir()),),
                                      function_constants=dict(constants), math_mode=math_mode,
                                      language_version=shader_language(source))
        _LIBS[key] = lib
    return lib


def run_plan(plan: Plan, order: str = "forward", checked: bool = True, family: Optional[str] = None) -> list:
    """Run every launch of the plan in order, as the GPU ``family`` it was planned for runs it (its
    tensor ops' cooperative-tensor layout; None: the emulator's current family); returns the
    emulator's stats per launch."""
    from torch_metal_flash import emulator

    stats = []
    with emulator.settings(family=family):
        for launch in plan.launches:
            lib = _library(launch.source, launch.function_constants)
            stats.append(getattr(lib, launch.kernel)(buffers=launch.buffers, grid=launch.grid_threads,
                                                     threadgroup=launch.threadgroup, order=order,
                                                     checked=checked))
    return stats


def grad_buffers(spec: AttentionSpec, compute_dbias: bool, poison: bool = True):
    """Gradients as ops.bwd allocates them (layout-preserving), poisoned with NaN."""
    from torch_metal_flash.ops.attention import _bwd_buffers
    bufs = _bwd_buffers(spec, compute_dbias)
    if poison:
        for b in bufs:
            if b.is_floating_point():
                b.fill_(float("nan"))
    return bufs


def plan_for(spec, dout, out, aux, dlse=None, compute_dbias=False, family="apple8"):
    from torch_metal_flash.planner.backward import plan_backward
    grads = grad_buffers(spec, compute_dbias)
    plan = plan_backward(spec, dout, out, aux, dlse, *grads, family=family)
    assert isinstance(plan, Plan), f"unsupported: {plan}"
    return plan, grads


def run_backward(spec, dout, out, aux, dlse=None, compute_dbias=False, order="forward", checked=True,
                 family="apple8"):
    plan, grads = plan_for(spec, dout, out, aux, dlse, compute_dbias, family)
    stats = run_plan(plan, order=order, checked=checked, family=family)
    return grads, stats


# ---------------------------------------------------------------------------
# Cases.
# ---------------------------------------------------------------------------
def build_case(c: dict, seed: Optional[int] = None, family: str = "apple8"):
    """spec, dout, out, aux, dlse for a case dict (forward_cases' axes plus
    ``dlse`` and ``dbias`` flags), the forward run as ``family`` plans it."""
    seed = zlib.crc32(case_id(c).encode()) if seed is None else seed
    spec = fc.build_spec(c, seed=seed)
    out, aux = saved_forward(spec, family)
    g = torch.Generator().manual_seed(seed + 1)
    dout = empty_in_layout(out).copy_(randn(out.shape, generator=g))
    dlse = randn(aux.shape[:3], generator=g) if c.get("dlse") else None
    return spec, dout, out, aux, dlse


def case_id(c: dict) -> str:
    extra = ("-dlse" if c.get("dlse") else "") + ("-dbias" if c.get("dbias") else "")
    return fc.case_id(c) + extra


def check_grads(spec, dout, dlse, grads, compute_dbias: bool):
    """The rule of torch_metal_flash.testing on dq, dk, dv (and dbias, dsinks)."""
    check_backward(spec, dout, dlse, grads, compute_dbias)


def run_and_check(c: dict, orders=("forward", "reverse"), checked: bool = True, family: str = "apple8"):
    """The case's forward and backward as ``family`` plans them, checked against the oracle,
    bit-identical over ``orders``."""
    spec, dout, out, aux, dlse = build_case(c, family=family)
    compute_dbias = bool(c.get("dbias")) and spec.mask is not None and spec.mask.is_floating_point()
    first = None
    for order in orders:
        grads, _ = run_backward(spec, dout, out, aux, dlse, compute_dbias, order=order, checked=checked,
                                family=family)
        for name, t in zip(("dq", "dk", "dv", "dbias", "dsinks"), grads):
            assert not t.isnan().any(), f"{name} has NaN (unwritten or computed)"
        if first is None:
            check_grads(spec, dout, dlse, grads, compute_dbias)
            first = [t.clone() for t in grads]
        else:  # bitwise deterministic, whatever the schedule
            for name, a, b in zip(("dq", "dk", "dv", "dbias", "dsinks"), first, grads):
                assert torch.equal(a, b), f"{name} differs between schedule orders ({order})"
    return spec


SMALL_SEQ_PAIRS = ((1, 1), (1, 39), (3, 17), (17, 3), (17, 17), (29, 65), (40, 33), (9, 100))


def sample_cases(n: int, seed: int) -> list:
    cases = fc.sample_cases(n, seed, seq_pairs=SMALL_SEQ_PAIRS)
    rng = random.Random(seed + 1)
    gqa = list(GQA_BWD)
    rng.shuffle(gqa)
    for i, c in enumerate(cases):
        c["hq"], c["hkv"] = gqa[i % len(gqa)]
        c["dlse"] = i % 3 == 0
        c["dbias"] = c["feature"].startswith("bias")
    return cases
