"""``flex_attention``: torch's FlexAttention API on the fused kernels.

One call: check the arguments (errors name them), lower the mods
(:mod:`.lowering`), walk the BlockMask (:mod:`.blocks`), run the flex plans
(:mod:`.kernels`) forward and, through :class:`_FlexAttention`, backward.
What the kernels cannot take (an unsupported mod, a dtype, a device without
a kernel backend) runs the dense definition (:mod:`.reference`, O(L * S)
memory, differentiable) after the one-time fallback warning -- or raises
:class:`~torch_metal_flash.UnsupportedError` in strict mode.

Gradients of captured floating tensors (a learned bias table, per-head
slopes) come from a second pass in PyTorch: per chunk of query rows the scores
are rebuilt, the mod applied with autograd, and ``dS = P (dP - delta)`` pulled
back onto the captured tensors; chunks are summed in a fixed order, so the
result is deterministic (no atomics) with memory bounded by the chunk.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import torch
from torch import Tensor
from torch.nn.attention import flex_attention as torch_flex

from .. import backends
from ..planner.plan import Unsupported
from ..problem.layout import empty_in_layout
from ..problem.spec import aux_width, make_spec
from . import kernels, lowering
from .blocks import KernelBlocks, check_block_mask, kernel_blocks
from .lowering import LoweredMods
from .reference import dense_flex_attention

# The kernels' largest query / key tiles: block sizes are remapped to multiples of these.
TILE_MULTIPLE = 64
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Score elements per chunk of the captured-gradient pass.
_CHUNK_ELEMENTS = 1 << 22


def _check(query, key, value, score_mod, block_mask, scale, enable_gqa) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor):
            raise TypeError(f"flex_attention: {name} must be a Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"flex_attention: {name} must be 4-D (B, H, L, D), got shape {tuple(t.shape)}")
    if not (query.device == key.device == value.device):
        raise ValueError(f"flex_attention: query, key and value must be on one device, got {query.device}, "
                         f"{key.device}, {value.device}")
    if not (query.dtype == key.dtype == value.dtype):
        raise ValueError(f"flex_attention: query, key and value must have one dtype, got {query.dtype}, "
                         f"{key.dtype}, {value.dtype}")
    if not query.dtype.is_floating_point:
        raise ValueError(f"flex_attention: query must be a floating-point tensor, got {query.dtype}")
    B, Hq, _, D = query.shape
    if key.shape[0] != B or value.shape[0] != B:
        raise ValueError(f"flex_attention: key and value must have the batch of query ({B}), got "
                         f"{key.shape[0]} and {value.shape[0]}")
    if key.shape[:3] != value.shape[:3]:
        raise ValueError(f"flex_attention: key and value must agree in (B, H, L), got {tuple(key.shape)} and "
                         f"{tuple(value.shape)}")
    if key.shape[3] != D:
        raise ValueError(f"flex_attention: key's head dim ({key.shape[3]}) must equal query's ({D})")
    Hkv = key.shape[1]
    if enable_gqa:
        if Hkv == 0 or Hq % Hkv:
            raise ValueError(f"flex_attention: with enable_gqa, query heads ({Hq}) must be a multiple of key "
                             f"heads ({Hkv})")
    elif Hkv != Hq:
        raise ValueError(f"flex_attention: query has {Hq} heads and key {Hkv}: pass enable_gqa=True for GQA")
    if score_mod is not None and not callable(score_mod):
        raise TypeError(f"flex_attention: score_mod must be callable or None, got {type(score_mod).__name__}")
    if block_mask is not None and not isinstance(block_mask, torch_flex.BlockMask):
        raise TypeError("flex_attention: block_mask must be a torch.nn.attention.flex_attention.BlockMask "
                        f"(create_block_mask) or None, got {type(block_mask).__name__}")
    if scale is not None and not isinstance(scale, (int, float)):
        raise TypeError(f"flex_attention: scale must be a float or None, got {type(scale).__name__}")
    if block_mask is not None:
        check_block_mask(block_mask, B, Hq, query.shape[2], key.shape[2])


def _kernel_reason(query, key, value) -> Optional[str]:
    if query.dtype not in _DTYPES:
        return f"FlexAttention: dtype {query.dtype} is not supported by the kernels (float32, float16, bfloat16)"
    return None


def _reference(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse):
    out, lse = dense_flex_attention(query, key, value, score_mod, block_mask.mask_mod if block_mask else None,
                                    scale, enable_gqa)
    return (out, lse.float()) if return_lse else out


def flex_attention(query: Tensor, key: Tensor, value: Tensor, score_mod=None, block_mask=None,
                   scale: Optional[float] = None, enable_gqa: bool = False, return_lse: bool = False):
    """``torch.nn.attention.flex_attention.flex_attention`` on the fused kernels (see docs/flex.md).

    ``score_mod(score, b, h, q_idx, kv_idx)`` and the BlockMask's ``mask_mod(b, h,
    q_idx, kv_idx)`` are traced and compiled into the forward, dQ and dK/dV
    kernels; blocks the BlockMask leaves out are never loaded.  Returns the
    output (B, Hq, L, Dv) in query's dtype, and with ``return_lse`` the natural-log
    logsumexp (B, Hq, L) float32 (-inf for rows that see no key, whose output is 0).
    """
    _check(query, key, value, score_mod, block_mask, scale, enable_gqa)
    backend, reason = backends.select(query.device)
    if backend is not None:
        reason = _kernel_reason(query, key, value)
    mods = None
    if backend is not None and reason is None:
        try:
            mods = lowering.lower(score_mod, block_mask.mask_mod if block_mask is not None else None)
        except backends.UnsupportedError as e:
            reason = str(e)
    if mods is None:
        if reason is not None:
            backends.fallback(reason)
        return _reference(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse)
    D = query.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    B, Hq, L, _ = q.shape
    blocks = kernel_blocks(block_mask, B, Hq, L, k.shape[2], TILE_MULTIPLE, TILE_MULTIPLE, q.device)
    trainable = tuple(t for t in mods.captured if t.requires_grad and t.dtype.is_floating_point)
    problem = _Problem(backend, mods, score_mod, block_mask.mask_mod if block_mask is not None else None, blocks,
                       scale)
    out, lse = _FlexAttention.apply(problem, q, k, v, *trainable)
    if return_lse:
        return out, lse
    return out


@dataclasses.dataclass(frozen=True)
class _Problem:
    """What a call's forward and backward share besides tensors."""

    backend: object
    mods: LoweredMods
    score_mod: Optional[Callable]
    mask_mod: Optional[Callable]
    blocks: KernelBlocks
    scale: float


def _run(backend, plan) -> None:
    if isinstance(plan, Unsupported):
        raise RuntimeError(f"torch_metal_flash: FlexAttention planning failed: {plan}")
    backend.run(plan)


class _FlexAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, problem: _Problem, q, k, v, *trainable):
        backend = problem.backend
        spec = make_spec(q, k, v, scale=problem.scale)
        needs_grad = any(ctx.needs_input_grad[1:])
        out = empty_in_layout(q, v.shape[-1])
        lse = q.new_empty(q.shape[:3], dtype=torch.float32)
        aux = q.new_empty((*q.shape[:3], aux_width(q.dtype, v.shape[-1])), dtype=torch.float32) if needs_grad \
            else None
        _run(backend, kernels.forward_plan(backend, spec, out, lse, aux, problem.mods, problem.blocks))
        lse = torch.where(lse == math.inf, -math.inf, lse)  # the kernels' empty rows: torch's -inf
        ctx.set_materialize_grads(False)
        ctx.problem = problem
        if needs_grad:
            ctx.save_for_backward(q, k, v, out, aux, lse, *trainable)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, aux, lse, *trainable = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dout = dout if dout.stride(-1) == 1 else dout.contiguous()
        if dlse is not None:
            dlse = torch.where(torch.isfinite(lse), dlse, 0.0).float().contiguous()
        problem = ctx.problem
        spec = make_spec(q, k, v, scale=problem.scale)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _run(problem.backend, kernels.backward_plan(problem.backend, spec, dout, out, aux, dlse, dq, dk, dv,
                                                    problem.mods, problem.blocks))
        grads = [None] * len(trainable)
        if trainable and any(ctx.needs_input_grad[4:]):
            grads = list(_captured_grads(problem, q, k, v, out, dout, lse, dlse, trainable))
        return (None, dq, dk, dv, *grads)


def _captured_grads(problem: _Problem, q, k, v, out, dout, lse, dlse, trainable):
    """d loss / d each trainable captured tensor: dS = P (dP - delta) through the mods, chunk by chunk."""
    B, Hq, L, _ = q.shape
    S, G = k.shape[2], Hq // k.shape[1]
    kf = k.float().repeat_interleave(G, dim=1)
    vf = v.float().repeat_interleave(G, dim=1)
    delta = (dout.float() * out.float()).sum(-1)
    if dlse is not None:
        delta = delta - dlse
    scale = problem.scale
    mask_mod = problem.mask_mod or torch_flex.noop_mask
    score_mod = problem.score_mod or (lambda s, b, h, qi, ki: s)
    dev = q.device
    b_idx, h_idx = torch.arange(B, device=dev), torch.arange(Hq, device=dev)
    kv_idx = torch.arange(S, device=dev)
    vmap_score = torch_flex._vmap_for_bhqkv(score_mod, prefix=(0,))
    vmap_mask = torch_flex._vmap_for_bhqkv(mask_mod, prefix=())
    chunk = max(1, _CHUNK_ELEMENTS // max(1, B * Hq * S))
    totals = [torch.zeros_like(t, dtype=torch.float32) for t in trainable]
    for r0 in range(0, L, chunk):
        rows = slice(r0, min(L, r0 + chunk))
        q_idx = torch.arange(rows.start, rows.stop, device=dev)
        raw = (q[:, :, rows].float() * scale) @ kf.transpose(-1, -2)
        with torch.enable_grad():
            s = vmap_score(raw, b_idx, h_idx, q_idx, kv_idx)
        visible = vmap_mask(b_idx, h_idx, q_idx, kv_idx) & (s.detach() > -math.inf)
        row_lse = lse[:, :, rows, None]
        p = torch.where(visible & torch.isfinite(row_lse), torch.exp(s.detach() - row_lse), 0.0)
        dp = dout[:, :, rows].float() @ vf.transpose(-1, -2)
        ds = p * (dp - delta[:, :, rows, None])
        if not s.requires_grad:  # the trainable tensors only enter mask_mod (no gradient)
            break
        parts = torch.autograd.grad(s, trainable, ds, allow_unused=True)
        for total, part in zip(totals, parts):
            if part is not None:
                total += part.float()
    return tuple(t.to(x.dtype) for t, x in zip(totals, trainable))
