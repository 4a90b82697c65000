"""Planner for ``metal_flash::fwd_kvcache`` (``flash_attn_with_kvcache``): append, then decode.

``plan_kvcache(problem, out, lse)`` returns, in order:

1. when there are new rows (or q to rotate), ``kvcache_append_<dtype>_r<rotary dtype>[_q<q dtype>]``
   (``shaders/kvcache_append.metal``): one threadgroup per (b, t, h) row of the new
   k/v and, with rotary, per (b, i, h) row of q, one thread per feature.  It
   rotates the new k and writes k/v into the cache (through the block table when
   paged, at ``cache_batch_idx`` rows otherwise) -- quantizing the rows when the
   caches are :class:`~torch_metal_flash.problem.quant.QuantizedTensor` -- and writes the
   rotated q to a scratch tensor that the decode kernel then reads;
2. the split-K decode launches of :func:`.decode.plan_decode` over the updated cache.

Every index tensor is bound as given and read on the GPU (``shaders/kvcache_index.h``
defines what out-of-range values do); the plan depends only on shapes, dtypes,
strides and scalars.  Bound tensors are the op's arguments (or views of them),
its outputs, and scratch allocated here.
"""
from __future__ import annotations

import ctypes
from typing import NamedTuple, Optional, Union

import torch

from ..problem.quant import QuantizedTensor, flat_format
import torch_metal_flash.planner.kvformat as kvformat
from .decode import DTYPE_NAMES, DecodeProblem, plan_decode
from .limits import PipelineInfo, first_fitting
from .plan import Launch, Plan, Unsupported
from .shader_constants import APPEND as FC

SOURCE = "kvcache_append.metal"
# [[buffer(i)]] indices
(BUF_K, BUF_V, BUF_K_CACHE, BUF_V_CACHE, BUF_PARAMS, BUF_SEQLENS, BUF_BATCH_IDX, BUF_BLOCK_TABLE, BUF_COS, BUF_SIN,
 BUF_Q, BUF_Q_ROT, BUF_K_SCALES, BUF_K_BIASES, BUF_V_SCALES, BUF_V_BIASES, BUF_K_SCALES_SYM,
 BUF_V_SCALES_SYM) = range(18)
_INT32_MAX = 2**31 - 1
MAX_THREADS = 576  # [[max_total_threads_per_threadgroup]] of kvcache_append: one thread per element of a row


def append_kernel(dtype: str, rotary_dtype: str, q_dtype: str = "") -> str:
    """The append kernel for cache dtype ``f32|f16|bf16``, rotary table dtype (the same or
    ``f32``) and q dtype (the cache's, or ``f32`` over a float16 / bfloat16 cache)."""
    q = f"_q{q_dtype}" if q_dtype and q_dtype != dtype else ""
    return f"kvcache_append_{dtype}_r{rotary_dtype}{q}"


def append_kernels() -> list[str]:
    """Every instantiation in kvcache_append.metal."""
    same = [append_kernel(dt, rdt) for dt in DTYPE_NAMES.values() for rdt in sorted({dt, "f32"})]
    return same + [append_kernel(DTYPE_NAMES[dt], "f32", "f32") for dt in kvformat.MIXED_KV_DTYPES]


def function_constants(paged: bool, seqlens: bool, batch_idx: bool, rotary: bool, interleaved: bool,
                       kv_format: str = "plain") -> dict:
    """The ``[[function_constant]]`` values of ``kvcache_append.metal`` for these features."""
    return {FC.paged: paged, FC.has_seqlens: seqlens, FC.has_batch_idx: batch_idx, FC.has_rotary: rotary,
            FC.rotary_interleaved: interleaved, FC.kv_affine: kv_format == "affine",
            FC.kv_symmetric: kv_format == "symmetric"}


# Every value plan_kvcache can pass to function_constants() (the doctor enumerates the variants from these).
FEATURE_VALUES = {**{name: (False, True) for name in ("paged", "seqlens", "batch_idx", "rotary", "interleaved")},
                  "kv_format": kvformat.FORMATS}


class AppendParams(ctypes.Structure):
    """ctypes mirror of ``AppendParams`` in shaders/kvcache_append.metal."""

    _fields_ = [(n, ctypes.c_int64) for n in (
        "k_stride_b", "k_stride_l", "k_stride_h", "v_stride_b", "v_stride_l", "v_stride_h",
        "kc_stride_b", "kc_stride_l", "kc_stride_h", "vc_stride_b", "vc_stride_l", "vc_stride_h",
        "q_stride_b", "q_stride_l", "q_stride_h", "qr_stride_b", "qr_stride_l", "qr_stride_h",
        "bt_stride_b", "cos_stride", "sin_stride")] + [(n, ctypes.c_int32) for n in (
            "batch", "seqlen_new", "seqlen_q", "heads", "kv_heads", "head_dim", "rotary_dim", "seqlen_ro",
            "page_size", "capacity", "cache_rows", "seqlen_fixed", "kv_rows", "q_local", "kv_bits", "kv_group_size",
            "head_dim_v", "pad_i")]


class KvCacheProblem(NamedTuple):
    """The arguments of ``metal_flash::fwd_kvcache``, in schema order (see ops.py):
    ``torch.ops.metal_flash.fwd_kvcache(*problem)``.  With quantized caches
    (QuantizedTensor fields) the op is ``metal_flash::fwd_kvcache_quantized``:
    ``op, args = problem.op_call()``."""

    q: torch.Tensor  # (B, Lq, Hq, D)
    # (B_cache, L_max, Hkv, D) or paged (num_blocks, page_size, Hkv, D); tensors or QuantizedTensors;
    # v_cache (and v) with their own head dim Dv
    k_cache: Union[torch.Tensor, QuantizedTensor]
    v_cache: Union[torch.Tensor, QuantizedTensor]
    k: Optional[torch.Tensor]  # (B, Lnew, Hkv, D)
    v: Optional[torch.Tensor]
    rotary_cos: Optional[torch.Tensor]  # (seqlen_ro, rotary_dim / 2)
    rotary_sin: Optional[torch.Tensor]
    cache_seqlens: Optional[torch.Tensor]  # (B,) int32
    cache_batch_idx: Optional[torch.Tensor]  # (B,) int32
    cache_leftpad: Optional[torch.Tensor]  # (B,) int32
    block_table: Optional[torch.Tensor]  # (B, max_blocks) int32
    alibi_slopes: Optional[torch.Tensor]  # (Hq,) or (B, Hq) float32
    seqlen: int  # cache_seqlens of every row when the tensor is None
    scale: float
    window_left: int
    window_right: int
    softcap: float
    rotary_interleaved: bool
    num_splits: int

    def op_call(self):
        """``(op, args)``: ``fwd_kvcache`` with these arguments, or ``fwd_kvcache_quantized``
        with the caches' packed data in their place and their scales, biases and format after."""
        if not isinstance(self.k_cache, QuantizedTensor):
            return torch.ops.metal_flash.fwd_kvcache, tuple(self)
        kc, vc = self.k_cache, self.v_cache
        args = self._replace(k_cache=kc.data, v_cache=vc.data)
        return torch.ops.metal_flash.fwd_kvcache_quantized, (*args, kc.scales, kc.biases, vc.scales, vc.biases,
                                                             *flat_format(kc))


def _check(pb: KvCacheProblem) -> Optional[str]:
    q, kc = pb.q, pb.k_cache
    if q.dtype not in DTYPE_NAMES:
        return f"dtype {q.dtype} is not supported by the decode kernels (float32, float16, bfloat16)"
    reason = kvformat.dtype_reason(q.dtype, kc, pb.v_cache)
    if reason is not None:
        return reason
    if q.dim() != 4 or kc.dim() != 4:
        return "q and the caches must be 4-D"
    B, Lq, Hq, D = q.shape
    Dv = pb.v_cache.shape[-1]
    if max(D, Dv) > MAX_THREADS:
        return f"head dim {D} (v's {Dv}) beyond the append kernel's {MAX_THREADS}"
    if (pb.k is None) != (pb.v is None) or (pb.rotary_cos is None) != (pb.rotary_sin is None):
        return "k and v (and rotary_cos and rotary_sin) come in pairs"
    if pb.rotary_cos is not None and pb.k is None:
        return "rotary needs k and v"
    for name, t, width in (("k", pb.k, D), ("v", pb.v, Dv)):
        if t is not None and (t.dtype != kc.dtype or t.shape != (B, pb.k.shape[1], kc.shape[2], width)
                              or (width > 1 and t.stride(-1) != 1)):
            return (f"{name} must be (B, seqlen_new, Hkv, {width}) in the caches' dtype with a contiguous "
                    f"last dim")
    cos = pb.rotary_cos
    if cos is not None:
        # The table in the caches' dtype or float32; float32 when q is float32.
        table_dtypes = (torch.float32,) if q.dtype != kc.dtype else (q.dtype, torch.float32)
        for name, t in (("rotary_cos", cos), ("rotary_sin", pb.rotary_sin)):
            if t.dtype not in table_dtypes or t.dim() != 2 or t.shape != cos.shape:
                return f"{name} must be 2-D in q's dtype or float32 (got {t.dtype})"
            if t.shape[1] > 1 and t.stride(1) != 1:
                return f"{name} last dim is not contiguous"
        if not (1 <= cos.shape[0] <= _INT32_MAX and 2 <= 2 * cos.shape[1] <= D):
            return "rotary table shape out of range"
    rows = B * (0 if pb.k is None else pb.k.shape[1]) * pb.k_cache.shape[2]
    if pb.rotary_cos is not None:
        rows += B * Lq * Hq
    if rows > _INT32_MAX:
        return "too many rows to append"
    return None


def plan_kvcache(pb: KvCacheProblem, out: torch.Tensor, lse: torch.Tensor, family: str = "apple8",
                 pipeline_info: Optional[PipelineInfo] = None) -> Union[Plan, Unsupported]:
    """The append (when needed) and decode launches of one call; ``out`` (B, Lq, Hq, Dv),
    ``lse`` (B, Hq, Lq) float32.  ``family`` is unused (one tile table for every GPU);
    ``pipeline_info``: the backend's pipeline limits (:mod:`.limits`)."""
    reason = _check(pb)
    if reason is not None:
        return Unsupported(reason)
    q, kc, vc = pb.q, pb.k_cache, pb.v_cache
    B, Lq, Hq, D = q.shape
    Hkv, Dv = kc.shape[2], vc.shape[-1]
    Lnew = 0 if pb.k is None else pb.k.shape[1]
    rotary = pb.rotary_cos is not None
    paged = pb.block_table is not None
    # The decode kernel reads the rotated q from scratch, else q itself.
    q_rot = q.new_empty(q.shape) if rotary else None
    alibi = pb.alibi_slopes.expand(B, Hq) if pb.alibi_slopes is not None else None
    decode = DecodeProblem(
        q=(q_rot if rotary else q).transpose(1, 2), k_cache=kc, v_cache=vc, out=out.transpose(1, 2), lse=lse,
        seqlens=pb.cache_seqlens, seqlen_fixed=pb.seqlen, leftpad=pb.cache_leftpad, batch_idx=pb.cache_batch_idx,
        block_table=pb.block_table, alibi_slopes=alibi, scale=pb.scale, window_left=pb.window_left,
        window_right=pb.window_right, softcap=pb.softcap, seqlen_new=Lnew)
    attend = plan_decode(decode, num_splits=pb.num_splits, pipeline_info=pipeline_info)
    if isinstance(attend, Unsupported):
        return attend
    kv_rows = B * Lnew * Hkv
    rows = kv_rows + (B * Lq * Hq if rotary else 0)
    if rows == 0:
        return attend

    p = AppendParams()
    if pb.k is not None:
        p.k_stride_b, p.k_stride_l, p.k_stride_h = pb.k.stride()[:3]
        p.v_stride_b, p.v_stride_l, p.v_stride_h = pb.v.stride()[:3]
    # Element strides, or row strides of quantized caches (kvformat).
    p.kc_stride_b, p.kc_stride_l, p.kc_stride_h = kvformat.row_strides(kc)
    p.vc_stride_b, p.vc_stride_l, p.vc_stride_h = kvformat.row_strides(vc)
    p.kv_bits, p.kv_group_size = kvformat.format_params(kc)
    p.batch, p.seqlen_new, p.seqlen_q, p.heads, p.kv_heads, p.head_dim = B, Lnew, Lq, Hq, Hkv, D
    p.head_dim_v = Dv
    p.page_size = kc.shape[1] if paged else 0
    p.capacity, p.cache_rows = decode.capacity, kc.shape[0]
    p.seqlen_fixed = min(max(pb.seqlen, 0), decode.capacity)  # clamped as the kernel clamps
    p.kv_rows = kv_rows
    p.q_local = int(pb.window_left >= 0 or pb.window_right >= 0)
    buffers: dict = {}
    kvformat.bind(buffers, kc, BUF_K_CACHE, BUF_K_SCALES, BUF_K_BIASES, BUF_K_SCALES_SYM)
    kvformat.bind(buffers, vc, BUF_V_CACHE, BUF_V_SCALES, BUF_V_BIASES, BUF_V_SCALES_SYM)
    if pb.k is not None:
        buffers[BUF_K], buffers[BUF_V] = pb.k, pb.v
    if pb.cache_seqlens is not None:
        buffers[BUF_SEQLENS] = pb.cache_seqlens
    if pb.cache_batch_idx is not None and not paged:
        buffers[BUF_BATCH_IDX] = pb.cache_batch_idx
    if paged:
        buffers[BUF_BLOCK_TABLE] = pb.block_table
        p.bt_stride_b = pb.block_table.stride(0)
    if rotary:
        cos, sin = pb.rotary_cos, pb.rotary_sin
        p.rotary_dim, p.seqlen_ro = 2 * cos.shape[1], cos.shape[0]
        p.cos_stride, p.sin_stride = cos.stride(0), sin.stride(0)
        p.q_stride_b, p.q_stride_l, p.q_stride_h = q.stride()[:3]
        p.qr_stride_b, p.qr_stride_l, p.qr_stride_h = q_rot.stride()[:3]
        buffers.update({BUF_COS: cos, BUF_SIN: sin, BUF_Q: q, BUF_Q_ROT: q_rot})
    buffers[BUF_PARAMS] = bytes(p)
    dt = DTYPE_NAMES[kc.dtype]
    rdt = DTYPE_NAMES[pb.rotary_cos.dtype] if rotary else DTYPE_NAMES[q.dtype]
    append = Launch(
        source=SOURCE, kernel=append_kernel(dt, rdt, DTYPE_NAMES[q.dtype]), threadgroups=(rows, 1, 1),
        threadgroup=(32 * -(-max(D, Dv) // 32), 1, 1), buffers=buffers,
        function_constants=function_constants(paged, pb.cache_seqlens is not None,
                                              pb.cache_batch_idx is not None and not paged, rotary,
                                              rotary and bool(pb.rotary_interleaved), kvformat.kv_format(kc)))
    scratch = attend.scratch + ((q_rot,) if rotary else ())
    return first_fitting([Plan(launches=(append,) + attend.launches, scratch=scratch)], pipeline_info)
