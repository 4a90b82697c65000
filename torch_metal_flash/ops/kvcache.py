"""``fwd_kvcache`` and ``fwd_kvcache_quantized``: ``flash_attn_with_kvcache`` as ops (append in place, then attend)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

import torch_metal_flash.core as core
from ..planner.kvcache import KvCacheProblem, plan_kvcache
from ..problem.quant import from_flat
from ..problem.spec import stats_dtype
import torch_metal_flash.reference.kvcache as kvcache_reference


def _kvcache_buffers(q: Tensor, head_dim_v: int):
    B, Lq, Hq, _ = q.shape
    return q.new_empty((B, Lq, Hq, head_dim_v)), q.new_empty((B, Hq, Lq), dtype=stats_dtype(q.dtype))


def _kvcache_outputs(q, k_cache, v_cache, *args):
    return _kvcache_buffers(q, v_cache.shape[-1])


def _kvcache_quantized_outputs(*args):
    return _kvcache_buffers(args[0], _kvcache_quantized_problem(*args).v_cache.shape[-1])


def _kvcache_plan(backend, args: tuple, outputs: tuple):
    return _kvcache_problem_plan(KvCacheProblem(*args), backend, outputs)


def _kvcache_problem_plan(problem: KvCacheProblem, backend, outputs: tuple):
    return plan_kvcache(problem, *outputs, family=backend.family, pipeline_info=backend.pipeline_info)


def _kvcache_debug_check(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                         cache_leftpad, block_table, alibi_slopes, seqlen, scale, window_left, window_right, softcap,
                         rotary_interleaved, num_splits):
    kvcache_reference.host_indices(kvcache_reference.Geometry.of(q, k_cache, k, block_table, window_left, window_right),
                                   cache_seqlens, seqlen, cache_batch_idx, cache_leftpad, block_table, rotary_cos)


def _kvcache_reference(*args):
    return _kvcache_problem_reference(KvCacheProblem(*args))


def _kvcache_problem_reference(problem: KvCacheProblem):
    out, lse = _kvcache_buffers(problem.q, problem.v_cache.shape[-1])
    ref_out, ref_lse = kvcache_reference.forward(*problem[:-1])  # all but num_splits
    out.copy_(ref_out)
    lse.copy_(ref_lse)
    return out, lse


@torch.library.custom_op("metal_flash::fwd_kvcache", mutates_args=("k_cache", "v_cache"))
def fwd_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor], v: Optional[Tensor],
                rotary_cos: Optional[Tensor], rotary_sin: Optional[Tensor], cache_seqlens: Optional[Tensor],
                cache_batch_idx: Optional[Tensor], cache_leftpad: Optional[Tensor], block_table: Optional[Tensor],
                alibi_slopes: Optional[Tensor], seqlen: int, scale: float, window_left: int, window_right: int,
                softcap: float, rotary_interleaved: bool, num_splits: int) -> tuple[Tensor, Tensor]:
    """``flash_attn_with_kvcache`` as an op: rotary of q and the new ``k``, ``k``/``v``
    written into ``k_cache``/``v_cache`` **in place** at ``cache_seqlens`` (``seqlen``
    for every row when None), then q (B, Lq, Hq, D) attends to keys
    [cache_leftpad, cache_seqlens + seqlen_new) of its cache row, with the band
    ``window_left/right`` aligned bottom-right per row (causal: window_right = 0;
    q is rotated per row when a window side is >= 0).  Index tensors are int32;
    on the kernel path they are read on the GPU only, and out-of-range values are
    clamped or ignored (shaders/kvcache_index.h); the reference path, and the
    kernel path in debug mode (``TORCH_METAL_FLASH_DEBUG=1``), validate them on the
    host.  Returns ``out`` (B, Lq, Hq, Dv) and ``lse`` (B, Hq, Lq) (Dv: v_cache's head dim, which may
    differ from q's and k_cache's D)."""
    return core.python_body(FWD_KVCACHE, (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                        cache_batch_idx, cache_leftpad, block_table, alibi_slopes, seqlen, scale,
                                        window_left, window_right, softcap, rotary_interleaved, num_splits))


fwd_kvcache.register_fake(_kvcache_outputs)


# ---------------------------------------------------------------------------
# Quantized caches (inference only)
# ---------------------------------------------------------------------------

def _kvcache_quantized_problem(*args) -> KvCacheProblem:
    *plain, k_scales, k_biases, v_scales, v_biases, kv_bits, kv_group_size, kv_dtype = args
    problem = KvCacheProblem(*plain)
    return problem._replace(k_cache=from_flat(problem.k_cache, k_scales, k_biases, kv_bits, kv_group_size, kv_dtype),
                            v_cache=from_flat(problem.v_cache, v_scales, v_biases, kv_bits, kv_group_size, kv_dtype))


@torch.library.custom_op("metal_flash::fwd_kvcache_quantized",
                         mutates_args=("k_cache", "v_cache", "k_cache_scales", "k_cache_biases", "v_cache_scales",
                                       "v_cache_biases"))
def fwd_kvcache_quantized(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor], v: Optional[Tensor],
                          rotary_cos: Optional[Tensor], rotary_sin: Optional[Tensor], cache_seqlens: Optional[Tensor],
                          cache_batch_idx: Optional[Tensor], cache_leftpad: Optional[Tensor],
                          block_table: Optional[Tensor], alibi_slopes: Optional[Tensor], seqlen: int, scale: float,
                          window_left: int, window_right: int, softcap: float, rotary_interleaved: bool,
                          num_splits: int, k_cache_scales: Tensor, k_cache_biases: Optional[Tensor],
                          v_cache_scales: Tensor, v_cache_biases: Optional[Tensor], kv_bits: int, kv_group_size: int,
                          kv_dtype: int) -> tuple[Tensor, Tensor]:
    """:func:`fwd_kvcache` over quantized caches (``k_cache``/``v_cache`` their packed
    data): the new ``k``/``v`` rows (in the caches' dtype) are quantized by the append
    kernel into the caches in place, and the attention reads the stored values."""
    return core.python_body(FWD_KVCACHE_QUANTIZED, (
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
        alibi_slopes, seqlen, scale, window_left, window_right, softcap, rotary_interleaved, num_splits,
        k_cache_scales, k_cache_biases, v_cache_scales, v_cache_biases, kv_bits, kv_group_size, kv_dtype))


fwd_kvcache_quantized.register_fake(_kvcache_quantized_outputs)


FWD_KVCACHE = core.register(core.CoreOp("metal_flash::fwd_kvcache", outputs=_kvcache_outputs, plan=_kvcache_plan,
                                        reference=_kvcache_reference, debug_check=_kvcache_debug_check))


FWD_KVCACHE_QUANTIZED = core.register(core.CoreOp(
    "metal_flash::fwd_kvcache_quantized", outputs=_kvcache_quantized_outputs,
    plan=lambda backend, args, outputs: _kvcache_problem_plan(_kvcache_quantized_problem(*args), backend, outputs),
    reference=lambda *args: _kvcache_problem_reference(_kvcache_quantized_problem(*args)),
    debug_check=lambda *args: _kvcache_debug_check(*args[:len(KvCacheProblem._fields)])))
