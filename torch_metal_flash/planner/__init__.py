"""Planners: op arguments -> :class:`~torch_metal_flash.plan.Plan` or :class:`~torch_metal_flash.plan.Unsupported`.

Pure and backend-agnostic.  The prefill forward lives in :mod:`.forward`
(tile table :mod:`.tiles`, params mirror :mod:`.params`), the backward in
:mod:`.backward`, the split-K decode kernels in :mod:`.decode`, the KV-cache op
(append + decode) in :mod:`.kvcache`.  Each checks its launches against the
backend's pipeline limits before anything runs (:mod:`.limits`).
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from ..plan import Plan, Unsupported
from ..spec import AttentionSpec
from . import decode
from .backward import plan_backward
from .forward import plan_forward as plan_prefill
from .limits import PipelineInfo
from .tiles import FAMILIES, ForwardTile, forward_tile, forward_variants

__all__ = ["plan_forward", "plan_backward", "plan_prefill", "forward_tile", "forward_variants", "ForwardTile",
           "FAMILIES"]


def plan_forward(spec: AttentionSpec, out: torch.Tensor, lse: torch.Tensor, aux: Optional[torch.Tensor] = None,
                 family: str = "apple8", pipeline_info: Optional[PipelineInfo] = None) -> Union[Plan, Unsupported]:
    """Decode-shaped problems (few query rows per KV head, long keys) take the
    split-K decode kernels, which read each K/V row once per GQA group; all
    others, whatever those decline, and every call that keeps ``aux`` for a
    backward (the backward kernels recompute the prefill kernel's scores bit
    for bit), the prefill kernels.  ``pipeline_info``: the backend's pipeline
    limits (:mod:`.limits`)."""
    if aux is None and decode.route_reason(spec) is None:
        plan = decode.plan_decode_spec(spec, out, lse, pipeline_info=pipeline_info)
        if not isinstance(plan, Unsupported):
            return plan
    return plan_prefill(spec, out, lse, aux, family, pipeline_info)
