"""The variant space: which kernels the tuner may choose for a problem.

Every variant is a ``[[host_name]]`` instantiation of the shipped kernel
templates, listed by the planners' tile tables (``planner/tiles.py``,
``planner/backward_tiles.py``, ``planner/decode.py``).  Ops and the parts of
each op that take a tile of their own:

* ``"fwd"``: the prefill forward kernel (part ``"fwd"``);
* ``"bwd"``: the dQ kernel (part ``"dq"``) and the dK/dV kernel (part
  ``"dkv"``; where dK and dV are two kernels, the dK kernel's name stands for
  the pair and the dV kernel of the same tile follows it);
* ``"decode"``: the split-K decode kernel (part ``"decode"``; q and the
  caches in one dtype).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

OPS = ("fwd", "bwd", "decode")
PARTS = {"fwd": ("fwd",), "bwd": ("dq", "dkv"), "decode": ("decode",)}
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def check_op(op: str) -> str:
    if op not in OPS:
        raise ValueError(f"op must be one of {', '.join(map(repr, OPS))}, got {op!r}")
    return op


def as_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in (torch.float32, torch.float16, torch.bfloat16):
        return dtype
    if isinstance(dtype, str) and dtype.replace("torch.", "") in _DTYPES:
        return _DTYPES[dtype.replace("torch.", "")]
    raise ValueError(f"dtype must be torch.float32, torch.float16 or torch.bfloat16, got {dtype!r}")


def check_family(family: str) -> str:
    from ..planner.tiles import FAMILIES
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {family!r}")
    return family


def part_variants(op: str, part: str, dtype: torch.dtype, head_dim: int, head_dim_v: Optional[int],
                  family: str) -> list[str]:
    """The kernels ``part`` of ``op`` may run for this problem, the family's default first
    ([] when the kernels do not take it)."""
    return list(_part_variants(op, part, dtype, int(head_dim), int(head_dim_v or head_dim), family))


@functools.lru_cache(maxsize=4096)
def _part_variants(op, part, dtype, head_dim, head_dim_v, family) -> tuple:
    import torch_metal_flash.planner.backward_tiles as backward_tiles
    import torch_metal_flash.planner.decode as decode
    import torch_metal_flash.planner.tiles as tiles
    width = max(head_dim, head_dim_v)
    if width < 1 or width > tiles.MAX_HEAD_DIM:
        return ()
    if part == "fwd":
        return tuple(t.kernel for t in tiles.tile_variants(dtype, width, family))
    if part == "dq":
        return tuple(t.kernel for t in backward_tiles.dq_variants(dtype, width, family))
    if part == "dkv":
        return tuple(pair[0].kernel for pair in backward_tiles.dkv_variants(dtype, width, family))
    if part == "decode":
        if head_dim != head_dim_v or head_dim > decode.MAX_HEAD_DIM:
            return ()
        return tuple(t.kernel for t in decode.tile_variants(dtype, head_dim))
    raise ValueError(f"{op} has no part {part!r}")


def accepts(op: str, part: str, kernel: str, dtype: torch.dtype, head_dim: int, head_dim_v: Optional[int],
            family: str) -> bool:
    """Whether ``kernel`` (a variant name, or the dV kernel of a listed dK/dV pair) applies here."""
    names = _part_variants(op, part, dtype, int(head_dim), int(head_dim_v or head_dim), family)
    return kernel in names or (part == "dkv" and kernel.endswith("_m2") and kernel[:-1] + "1" in names)


@functools.lru_cache(maxsize=None)
def catalog(op: str) -> dict:
    """Every variant name of ``op`` over dtypes, head-dim buckets and families -> its part
    (the dV kernels of split dK/dV pairs included)."""
    from ..planner.tiles import FAMILIES, HEAD_DIM_BUCKETS
    out = {}
    for part in PARTS[op]:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            for bd in HEAD_DIM_BUCKETS:
                for family in FAMILIES:
                    for name in _part_variants(op, part, dtype, bd, bd, family):
                        out[name] = part
                        if part == "dkv" and name.endswith("_m1"):
                            out[name[:-1] + "2"] = part
    return out
