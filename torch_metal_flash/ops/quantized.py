"""``fwd_quantized``: ``fwd`` over quantized K/V (inference only)."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor

import torch_metal_flash.core as core
import torch_metal_flash.planner as planner
import torch_metal_flash.reference as reference
from ..problem.quant import from_flat
from ..problem.spec import AttentionSpec
from .arguments import check_args, problem_spec
from .attention import _fwd_buffers


def _quantized_args(q, k, v, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left, window_right, softcap,
                    k_scales, k_biases, v_scales, v_biases, kv_bits, kv_group_size, kv_dtype) -> tuple:
    """fwd's arguments, K/V as QuantizedTensors."""
    return (q, from_flat(k, k_scales, k_biases, kv_bits, kv_group_size, kv_dtype),
            from_flat(v, v_scales, v_biases, kv_bits, kv_group_size, kv_dtype), attn_mask, alibi_slopes, sinks,
            scale, diag_offset, window_left, window_right, softcap)


def _quantized_spec(*args) -> AttentionSpec:
    return problem_spec(*_quantized_args(*args))


def _quantized_outputs(*args):
    plain = _quantized_args(*args)
    check_args(*plain)
    return _fwd_buffers(plain[0], plain[2], False)[:2]


def _quantized_plan(backend, args: tuple, outputs: tuple):
    spec = _quantized_spec(*args)
    if spec.q.numel() == 0 or spec.seqlen_k == 0:
        return None
    return planner.plan_forward(spec, *outputs, family=backend.family, pipeline_info=backend.pipeline_info)


def _quantized_reference(*args):
    out, lse = _quantized_outputs(*args)
    spec = _quantized_spec(*args)
    ref_out, ref_lse = reference.forward(dataclasses.replace(spec, k=spec.k.dequantize(), v=spec.v.dequantize()))
    out.copy_(ref_out)
    lse.copy_(ref_lse)
    return out, lse


def _quantized_no_backward(ctx, *grads):
    raise RuntimeError("metal_flash::fwd_quantized is inference-only: quantized K/V have no gradient (run under "
                       "torch.no_grad(), or attend to dequantize()d tensors to train)")


@torch.library.custom_op("metal_flash::fwd_quantized", mutates_args=())
def fwd_quantized(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], alibi_slopes: Optional[Tensor],
                  sinks: Optional[Tensor], scale: float, diag_offset: int, window_left: int, window_right: int,
                  softcap: float, k_scales: Tensor, k_biases: Optional[Tensor], v_scales: Tensor,
                  v_biases: Optional[Tensor], kv_bits: int, kv_group_size: int,
                  kv_dtype: int) -> tuple[Tensor, Tensor]:
    """:func:`fwd` over quantized K/V: ``k``/``v`` are the packed data of (B, Hkv, Lk, D)
    QuantizedTensors (see the module doc).  The kernels dequantize in registers (every
    query length takes the decode kernels); the reference path dequantizes first."""
    return core.python_body(FWD_QUANTIZED, (q, k, v, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left,
                                          window_right, softcap, k_scales, k_biases, v_scales, v_biases, kv_bits,
                                          kv_group_size, kv_dtype))


fwd_quantized.register_fake(_quantized_outputs)


FWD_QUANTIZED = core.register(core.CoreOp(
    "metal_flash::fwd_quantized", outputs=_quantized_outputs, plan=_quantized_plan, reference=_quantized_reference,
    setup_context=lambda ctx, inputs, output: None, backward=_quantized_no_backward))
