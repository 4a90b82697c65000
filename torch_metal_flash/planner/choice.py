"""Which tuning variant a planner uses for one part of an op.

The planners ask :func:`planned` on a plan-cache miss.  The tuning layer, which
sits above the planners (it runs ops to time them), installs its answer with
:func:`install` when it loads; until then, and in a planner used on its own,
every part takes its family table's tile (None).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch


def _table_default(op: str, part: str, dtype: torch.dtype, head_dim: int, head_dim_v: Optional[int], *,
                   family: Optional[str] = None, seqlen_q: int, seqlen_k: int, causal: bool,
                   features: dict) -> Optional[str]:
    return None


_planned: Callable[..., Optional[str]] = _table_default


def install(planned_fn: Callable[..., Optional[str]]) -> None:
    """Route :func:`planned` to ``planned_fn`` (same signature)."""
    global _planned
    _planned = planned_fn


def planned(op: str, part: str, dtype: torch.dtype, head_dim: int, head_dim_v: Optional[int], *,
            family: Optional[str] = None, seqlen_q: int, seqlen_k: int, causal: bool,
            features: dict) -> Optional[str]:
    """The variant (kernel host name) for ``part`` of ``op``, or None for the family table's."""
    return _planned(op, part, dtype, head_dim, head_dim_v, family=family, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                    causal=causal, features=features)
