"""``flex_attention``: torch's FlexAttention API on the fused kernels.

One call: check the arguments (errors name them), then torch's flex_attention
op with the call marked as ours (:mod:`.hop`): the mods are traced by Dynamo as
torch traces them, lowered to Metal and run by ``metal_flash::flex_fwd`` /
``flex_bwd`` -- the same path in eager mode, under ``torch.compile`` and
inside ``torch.compile(fullgraph=True)`` models.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor
from torch.nn.attention import flex_attention as torch_flex

import torch_metal_flash.flex.hop as hop
from .blocks import check_block_mask

_LN2 = math.log(2.0)


def _identity(score, b, h, q_idx, kv_idx):
    return score


def _captured_names(*fns) -> dict:
    """{id(tensor): name} of the tensors the functions capture: closure variables, globals, the
    parameters and buffers of captured modules, through nested functions (and_masks ...)."""
    names: dict = {}
    seen: set = set()

    def visit(value, name: str, depth: int) -> None:
        if id(value) in seen or depth > 4:
            return
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            names.setdefault(id(value), name)
        elif isinstance(value, torch.nn.Module):
            for n, t in list(value.named_parameters()) + list(value.named_buffers()):
                names.setdefault(id(t), f"{name}.{n}")
        elif isinstance(value, (tuple, list)):
            for i, item in enumerate(value):
                visit(item, f"{name}[{i}]", depth + 1)
        elif callable(value) and hasattr(value, "__code__"):
            code = value.__code__
            for var, cell in zip(code.co_freevars, value.__closure__ or ()):
                try:
                    visit(cell.cell_contents, var, depth + 1)
                except ValueError:  # an empty cell
                    pass
            for var in code.co_names:
                if var in value.__globals__:
                    visit(value.__globals__[var], var, depth + 1)

    for fn in fns:
        if fn is not None:
            visit(fn, getattr(fn, "__name__", "mod"), 0)
    return names


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
        if block_mask.kv_num_blocks.device != query.device:
            raise ValueError(f"flex_attention: block_mask is on {block_mask.kv_num_blocks.device}, query on "
                             f"{query.device}: create it with device={str(query.device)!r}")


def flex_attention(query: Tensor, key: Tensor, value: Tensor, score_mod=None, block_mask=None,
                   scale: Optional[float] = None, enable_gqa: bool = False, return_lse: bool = False):
    """``torch.nn.attention.flex_attention.flex_attention`` on the fused kernels (see docs/flex.md).

    ``score_mod(score, b, h, q_idx, kv_idx)`` and the BlockMask's ``mask_mod(b, h,
    q_idx, kv_idx)`` are compiled into the forward, dQ and dK/dV kernels; blocks the
    BlockMask leaves out are never loaded.  Returns the output (B, Hq, L, Dv) in
    query's dtype, and with ``return_lse`` the natural-log logsumexp (B, Hq, L)
    float32 (-inf for rows that see no key, whose output is 0).  Gradients flow to
    query, key, value and to captured floating tensors that require grad.
    """
    _check(query, key, value, score_mod, block_mask, scale, enable_gqa)
    if block_mask is None:
        block_mask = torch_flex._create_empty_block_mask(query, key)
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    args = (query, key, value, score_mod or _identity, block_mask.as_tuple(), float(scale))
    if torch.compiler.is_dynamo_compiling():
        out, lse = hop.call(*args)
    else:
        names = hop.captured_names.set(_captured_names(score_mod, block_mask.mask_mod))
        try:
            out, lse = hop.call(*args)
        finally:
            hop.captured_names.reset(names)
    if return_lse:
        return out, lse * _LN2
    return out
