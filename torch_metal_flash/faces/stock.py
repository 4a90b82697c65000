"""The stock route of the torch-semantics faces: torch's own SDPA where the tuner found it faster.

``tmf.scaled_dot_product_attention`` and the SDPA override ask :func:`takes_torch` per call;
for a problem class routed to torch (the tuning cache's verdict, or ``tmf.tuning.use(op,
"torch")`` on this thread) they call :func:`run_torch`, torch's original kernel, counted in
``tmf.run_counts()["torch"]``.  The flash-attn faces keep the kernels: torch cannot express
their semantics.  The decision is a host-side lookup memoised per call signature and the
tuning state (cache generation, this thread's forced choices), as the plan cache keys: no
device work, no host synchronisation.  While torch.compile traces, the kernels are kept
(a compiled graph holds the op).
"""
from __future__ import annotations

from typing import Optional

import torch

import torch_metal_flash.backends as backends
import torch_metal_flash.ops as ops
import torch_metal_flash.tuning as tuning
from ..planner.decode import DECODE_MAX_GROUP_ROWS, DECODE_MIN_SEQLEN_K
import torch_metal_flash.problem.checks as checks
from ..problem.quant import QuantizedTensor
from ..tuning.stock import STOCK, original_sdpa

_ROUTES = checks.Memo("routes.sdpa")


def _kernels_backend(device: torch.device) -> Optional[str]:
    """The kernels' backend that would serve ``device`` (None: the reference path, which
    the stock verdicts were not measured against)."""
    name = backends.requested()
    if name == "auto":
        name = "metal" if device.type == "mps" else "reference"
    if (name == "metal" and device.type == "mps") or (name == "emulator" and device.type == "cpu"):
        return name
    return None


def op_class(query, key, value, attn_mask, dropout_p, is_causal) -> tuple:
    """The tuning op and class arguments of an SDPA call: ``"bwd"`` when autograd will ask
    for gradients, ``"decode"`` for the shapes the forward op sends to the decode kernels,
    else ``"fwd"``; then (dtype, head dim, value head dim, L_q, L_k, causal, features)."""
    hq, hkv = (query.shape[-3], key.shape[-3]) if query.dim() >= 3 else (1, 1)
    lq, lk = query.shape[-2], key.shape[-2]
    mask, dropout = attn_mask is not None, dropout_p > 0
    if ops.needs_grad(query, key, value, attn_mask):
        op, features = "bwd", {"mask": mask, "dropout": dropout}
    elif not dropout and hkv and hq % hkv == 0 and (hq // hkv) * lq <= DECODE_MAX_GROUP_ROWS \
            and lk >= DECODE_MIN_SEQLEN_K:
        op, features = "decode", {"mask": mask}
    else:
        op, features = "fwd", {"mask": mask, "dropout": dropout}
    return op, (query.dtype, query.shape[-1], value.shape[-1], lq, lk, bool(is_causal), features)


def takes_torch(signature, query, key, value, attn_mask, dropout_p, is_causal) -> bool:
    """Whether this checked SDPA call runs torch's own SDPA (see the module doc)."""
    if torch.compiler.is_compiling() or not tuning.stock_possible() or isinstance(key, QuantizedTensor) \
            or isinstance(value, QuantizedTensor):
        return False
    memo = None if signature is None else (signature, tuning.state_key(), backends.requested(),
                                           ops.needs_grad(query, key, value, attn_mask))
    routed = _ROUTES.get(memo)
    if routed is None:
        routed = False
        if key.dtype == query.dtype == value.dtype and _kernels_backend(query.device) is not None:
            op, args = op_class(query, key, value, attn_mask, dropout_p, is_causal)
            routed = tuning.takes_torch(op, *args)
        if memo is not None:
            _ROUTES.put(memo, routed)
    return routed


def run_torch(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """torch's own SDPA on the call's arguments, counted as a run of ``"torch"``."""
    backends.record_run(STOCK)
    return original_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
