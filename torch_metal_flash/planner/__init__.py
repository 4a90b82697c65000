"""Planners: op arguments -> :class:`~.plan.Plan` or :class:`~.plan.Unsupported`.

Pure and backend-agnostic.  The prefill forward lives in :mod:`.forward`
(tile table :mod:`.tiles`, params mirror :mod:`.params`), the backward in
:mod:`.backward`, the split-K decode kernels in :mod:`.decode`, the KV-cache op
(append + decode) in :mod:`.kvcache`.  Each checks its launches against the
backend's pipeline limits before anything runs (:mod:`.limits`).
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from ..problem.spec import AttentionSpec
from . import decode
from .backward import plan_backward
from .forward import plan_forward as plan_prefill
from .limits import PipelineInfo
from .plan import Plan, Unsupported
from .tiles import FAMILIES, ForwardTile, forward_tile, forward_variants

__all__ = ["plan_forward", "plan_backward", "plan_prefill", "forward_tile", "forward_variants", "ForwardTile",
           "FAMILIES"]


def plan_forward(spec: AttentionSpec, out: torch.Tensor, lse: torch.Tensor, aux: Optional[torch.Tensor] = None,
                 family: str = "apple8", pipeline_info: Optional[PipelineInfo] = None) -> Union[Plan, Unsupported]:
    """Decode-shaped problems (few query rows per KV head, long keys) take the
    split-K decode kernels, which read each K/V row once per GQA group; all
    others, and whatever those decline, the prefill kernels -- but for K/V only
    the decode kernels read (quantized, or float16/bfloat16 under a float32 q),
    whatever the shape.  A call that keeps ``aux`` for a backward takes the
    prefill kernels (the backward kernels recompute their scores bit for bit;
    a problem they decline falls back to the reference path, which writes aux).
    ``pipeline_info``: the backend's pipeline limits (:mod:`.limits`).  Dropout and
    varlen run on the prefill kernels only."""
    if spec.dropout is not None or spec.varlen is not None:
        if decode.only_decode_kernels(spec):
            return Unsupported("dropout and varlen need K/V in q's dtype (quantized and mixed-precision K/V "
                               "run on the decode kernels only)")
        return plan_prefill(spec, out, lse, aux, family, pipeline_info)
    only_decode = aux is None and decode.only_decode_kernels(spec)
    if only_decode or (aux is None and decode.route_reason(spec) is None):
        plan = decode.plan_decode_spec(spec, out, lse, pipeline_info=pipeline_info)
        if only_decode or not isinstance(plan, Unsupported):
            return plan
    return plan_prefill(spec, out, lse, aux, family, pipeline_info)
