"""Planner for the fused forward kernels in ``shaders/flash_fwd.metal``.

``plan_forward`` turns an :class:`~torch_metal_flash.problem.spec.AttentionSpec` plus
preallocated ``out`` / ``lse`` (and ``aux``, the backward's row state, when
gradients are needed) into one launch: the tile from the table
(:mod:`.tiles`), the grid ``(ceil(pack * Lq / BQ), Hq / pack, B)`` (``pack``
query heads of a GQA group share a threadgroup when their rows are short),
the function constants that switch features on, and the params struct with
every stride.  A varlen problem (cu_seqlens) is one launch too: the grid covers
``max_seqlen_q`` rows of every sequence and the kernel reads the sequence
boundaries on the GPU; dropout regenerates its mask from ``rng_state`` (no
stored mask).  Tensors are
bound as they are (no copies of q/k/v/mask; a broadcast mask is read through
its 0 strides).  The per-head vectors (ALiBi slopes, sinks) must arrive as
float32 (the faces convert them); the planner derives no tensors (see
:mod:`torch_metal_flash.planner.plan`).
"""
from __future__ import annotations

import math
from typing import Optional, Union

import torch

import torch_metal_flash.problem.philox as philox
from ..problem.spec import AttentionSpec, aux_width
import torch_metal_flash.planner.choice as choice
from .limits import PipelineInfo, first_fitting
from .params import FlashFwdParams
from .plan import Launch, Plan, Unsupported
from .shader_constants import FWD as FC
from .tiles import DTYPE_NAMES, MAX_HEAD_DIM, ForwardTile, forward_candidates, forward_tile

SOURCE = "flash_fwd.metal"

MASK_KINDS = {torch.bool: 1, torch.float32: 2, torch.float16: 3, torch.bfloat16: 4}

# [[buffer(i)]] indices
(BUF_Q, BUF_K, BUF_V, BUF_O, BUF_LSE, BUF_PARAMS, BUF_MASK, BUF_ALIBI, BUF_SINKS, BUF_AUX, BUF_CU_Q, BUF_CU_K,
 BUF_SEQUSED_K, BUF_BLOCK_TABLE, BUF_RNG, BUF_PROBS) = range(16)

_INT32_MAX = 2**31 - 1
# Positions, offsets and windows are 32-bit ints in the kernel; with sizes and
# the diagonal offset below 2^28 (and windows wider than the problem dropped),
# i + diag_offset +- window never leaves int32.
_POS_LIMIT = 2**28


def _last_dim_contiguous(t: torch.Tensor) -> bool:
    # (an empty tensor is never read: the gradient of a sum over an empty output has stride 0)
    return t.numel() == 0 or t.shape[-1] <= 1 or t.stride(-1) == 1


def check_problem(spec: AttentionSpec) -> Optional[str]:
    """Why the kernels cannot take ``spec`` (shared by the forward and backward planners), or None."""
    q, k, v = spec.q, spec.k, spec.v
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "q, k, v must be 4-D (B, H, L, D) views"
    if q.dtype not in DTYPE_NAMES:
        return f"dtype {q.dtype} is not supported by the kernels (float32, float16, bfloat16)"
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})"
    B, Hq, Lq, D = q.shape
    _, Hkv, Lk, _ = k.shape
    Dv = v.shape[3]
    paged = spec.varlen is not None and spec.varlen.block_table is not None
    if (not paged and (k.shape[0] != B or v.shape[0] != B)) or v.shape[0] != k.shape[0] or v.shape[1] != Hkv \
            or v.shape[2] != Lk or k.shape[3] != D:
        return f"inconsistent shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if Hkv == 0 or Hq % Hkv != 0:
        return f"query heads {Hq} not a multiple of KV heads {Hkv}"
    if D < 1 or Dv < 1:
        return "head dim 0"
    if max(D, Dv) > MAX_HEAD_DIM:
        return f"head dim {max(D, Dv)} > {MAX_HEAD_DIM} (largest kernel tile)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not _last_dim_contiguous(t):
            return f"{name} last dim is not contiguous (stride {t.stride(-1)})"
    if max(Lq, Lk, B, Hq) > _POS_LIMIT:
        return "sizes beyond 2^28 (32-bit positions in the kernel)"
    if abs(spec.diag_offset) > _POS_LIMIT:
        return "diagonal offset beyond 2^28 (32-bit positions in the kernel)"
    if B * Hq * Lq > _INT32_MAX:
        return "too many query rows for 32-bit row indices"
    if spec.mask is not None:
        m = spec.mask
        if m.dtype not in MASK_KINDS:
            return f"mask dtype {m.dtype} not supported (bool, float32, float16, bfloat16)"
        if tuple(m.shape) != (B, Hq, Lq, Lk):
            return f"mask must be a (B, Hq, Lq, Lk) broadcast view, got {tuple(m.shape)}"
    if spec.alibi_slopes is not None:
        if tuple(spec.alibi_slopes.shape) != (spec.num_seqs, Hq):
            return f"alibi_slopes must be a (B, Hq) view, got {tuple(spec.alibi_slopes.shape)}"
        if spec.alibi_slopes.dtype != torch.float32:
            return f"alibi_slopes must be float32 for the kernels, got {spec.alibi_slopes.dtype}"
    if spec.sinks is not None:
        s = spec.sinks
        if tuple(s.shape) != (Hq,):
            return f"sinks must be (Hq,), got {tuple(s.shape)}"
        if s.dtype != torch.float32 or not s.is_contiguous():
            return f"sinks must be a contiguous float32 vector for the kernels, got {s.dtype}, strides {s.stride()}"
    if not (math.isfinite(spec.scale) and math.isfinite(spec.softcap)) or spec.softcap < 0:
        return "scale and softcap must be finite (softcap >= 0)"
    return _check_dropout(spec) or _check_varlen(spec)


def _int32_vector(name: str, t: torch.Tensor, shape: tuple) -> Optional[str]:
    if t.dtype != torch.int32 or tuple(t.shape) != shape or not t.is_contiguous():
        return f"{name} must be a contiguous int32 tensor of shape {shape} for the kernels, got {t.dtype} " \
               f"{tuple(t.shape)}"
    return None


def _check_dropout(spec: AttentionSpec) -> Optional[str]:
    d = spec.dropout
    if d is None:
        return None
    if not 0.0 < d.p <= 1.0:
        return f"dropout_p must be in (0, 1], got {d.p}"
    r = d.rng_state
    if r is None or r.dtype != torch.int64 or tuple(r.shape) != (2,) or not r.is_contiguous():
        return "rng_state must be a contiguous int64 (seed, offset) pair for the kernels"
    return None


def _check_varlen(spec: AttentionSpec) -> Optional[str]:
    vl = spec.varlen
    if vl is None:
        return None
    n = vl.num_seqs
    if spec.q.shape[0] != 1 or (vl.block_table is None and spec.k.shape[0] != 1):
        return "varlen q/k/v must be (1, H, total, D) views"
    if spec.mask is not None:
        return "attn_mask is not supported with cu_seqlens"
    for name, t, shape in (("cu_seqlens_q", vl.cu_seqlens_q, (n + 1,)), ("cu_seqlens_k", vl.cu_seqlens_k, (n + 1,)),
                           ("seqused_k", vl.seqused_k, (n,))):
        if t is not None:
            reason = _int32_vector(name, t, shape)
            if reason is not None:
                return reason
    bt = vl.block_table
    if bt is not None and (bt.dtype != torch.int32 or bt.dim() != 2 or bt.shape[0] != n
                           or not _last_dim_contiguous(bt)):
        return f"block_table must be int32 ({n}, max_blocks) with a contiguous last dim, got {bt.dtype} " \
               f"{tuple(bt.shape)}"
    if not 0 <= vl.max_seqlen_q <= _POS_LIMIT or not 0 <= vl.max_seqlen_k <= _POS_LIMIT:
        return "max_seqlen_q / max_seqlen_k must be in [0, 2^28]"
    if bt is not None and bt.shape[1] * spec.k.shape[2] > _POS_LIMIT:
        return "paged capacity beyond 2^28 keys"
    return None


def check_aux(spec: AttentionSpec, aux: torch.Tensor) -> Optional[str]:
    """Why ``aux`` is not the row state the kernels read and write, or None."""
    B, Hq, Lq, _ = spec.q.shape
    shape = (B, Hq, Lq, aux_width(spec.q.dtype, spec.head_dim_v))
    if tuple(aux.shape) != shape or aux.dtype != torch.float32 or not aux.is_contiguous():
        return f"aux must be contiguous float32 {shape}, got {aux.dtype} {tuple(aux.shape)}"
    return None


def _check(spec: AttentionSpec, out: torch.Tensor, lse: torch.Tensor,
           aux: Optional[torch.Tensor]) -> Optional[str]:
    reason = check_problem(spec)
    if reason is not None:
        return reason
    B, Hq, Lq, _ = spec.q.shape
    Dv = spec.v.shape[3]
    if not _last_dim_contiguous(out):
        return f"out last dim is not contiguous (stride {out.stride(-1)})"
    if tuple(out.shape) != (B, Hq, Lq, Dv) or out.dtype != spec.q.dtype:
        return f"out must be {spec.q.dtype} of shape {(B, Hq, Lq, Dv)}"
    if tuple(lse.shape) != (B, Hq, Lq) or lse.dtype != torch.float32 or not lse.is_contiguous():
        return "lse must be contiguous float32 (B, Hq, Lq)"
    return None if aux is None else check_aux(spec, aux)


def score_scale(spec: AttentionSpec) -> tuple[float, float]:
    """(qk_scale, softcap) of FlashFwdParams: q is multiplied by qk_scale when
    loaded (scale, or scale / softcap with softcap: the tanh argument).  The
    backward kernels compute the scores with the same values."""
    if spec.softcap > 0:
        return spec.scale / spec.softcap, spec.softcap
    return spec.scale, 0.0


def _vec4_aligned(t: torch.Tensor) -> bool:
    """Rows start on 4-element (vector) boundaries: the buffer is bound at
    storage_offset * element_size of its storage, whose start is aligned (an
    MTLBuffer's always; a CPU storage's checked, for the emulator)."""
    es = t.element_size()
    base_ok = t.device.type != "cpu" or t.untyped_storage().data_ptr() % 16 == 0
    return (base_ok and (t.storage_offset() * es) % (4 * es) == 0
            and all(t.stride(i) % 4 == 0 for i in range(3) if t.shape[i] > 1))


def gqa_pack(gqa: int, seqlen_q: int, bq: int) -> int:
    """Query heads per threadgroup: the whole GQA group when packing their
    rows needs fewer threadgroups (so fewer K/V tile reads) than one head per
    threadgroup, e.g. decode (Lq = 1) or short queries; else 1."""
    if gqa > 1 and gqa * seqlen_q <= _POS_LIMIT and -(-(gqa * seqlen_q) // bq) < gqa * -(-seqlen_q // bq):
        return gqa
    return 1


def effective_band(spec: AttentionSpec) -> tuple[int, int, bool]:
    """(window_left, window_right, has_band) for the kernels: a window side wider
    than every (i, j) distance constrains nothing and becomes -1."""
    if spec.varlen is not None:  # per sequence: diag_offset + Lk_b - Lq_b
        reach = 2 * (spec.varlen.max_seqlen_q + spec.varlen.max_seqlen_k) + abs(spec.diag_offset) + 1
    else:
        reach = spec.seqlen_q + spec.seqlen_k + abs(spec.diag_offset) + 1
    wl, wr = (-1 if w < 0 or w >= reach else w for w in (spec.window_left, spec.window_right))
    return wl, wr, wl >= 0 or wr >= 0


def plan_forward(spec: AttentionSpec, out: torch.Tensor, lse: torch.Tensor, aux: Optional[torch.Tensor] = None,
                 family: str = "apple8", pipeline_info: Optional[PipelineInfo] = None,
                 probs: Optional[torch.Tensor] = None, pack_heads: bool = True) -> Union[Plan, Unsupported]:
    """The ``flash_fwd.metal`` launch for the op's forward (the prefill kernel).

    ``aux`` (see :mod:`torch_metal_flash.problem.spec`), when given, receives the row
    state the backward kernels need.  ``torch_metal_flash.planner.plan_forward``
    sends decode-shaped problems without ``aux`` to the split-K decode kernels
    first and everything else here.  With ``pipeline_info`` (the backend's),
    the table's tile is checked against its pipeline's limits and a fitting
    one of larger buckets taken when it does not fit (:mod:`.limits`).
    ``probs`` (debug: flash-attn's ``S_dmask``, (num_seqs, Hq, max_seqlen_q,
    max_seqlen_k) in q's dtype) receives every element's ``exp(s - m)`` with the
    row's final max ``m``, its sign bit set when dropout drops it.  ``pack_heads=False``
    keeps one query head per threadgroup (FlexAttention's block lists are per head).
    """
    reason = _check(spec, out, lse, aux) or _check_probs(spec, probs)
    if reason is not None:
        return Unsupported(reason)
    max_q, max_k = max_seqlens(spec)
    try:
        variant = choice.planned("fwd", "fwd", spec.q.dtype, spec.head_dim, spec.head_dim_v, family=family,
                                 seqlen_q=max_q, seqlen_k=max_k, causal=is_causal(spec), features=features(spec))
        # the accelerator kernel writes no probs (the debug output): the simdgroup kernel does
        tiles = forward_candidates(spec.q.dtype, max(spec.head_dim, spec.head_dim_v), family, variant,
                                   nax=probs is None)
    except (KeyError, ValueError) as e:
        return Unsupported(str(e))
    if spec.num_seqs == 0 or spec.heads == 0 or spec.seqlen_q == 0 or max_q == 0:
        return Plan(launches=())
    return first_fitting((_plan_tile(spec, out, lse, aux, tile, probs, pack_heads) for tile in tiles),
                         pipeline_info)


def is_causal(spec: AttentionSpec) -> bool:
    """Whether the tuner files ``spec`` under causal problems (no key right of the diagonal)."""
    return spec.window_right == 0


def features(spec: AttentionSpec) -> dict:
    """The features that set a problem's tuning class (:func:`torch_metal_flash.tuning.choice`)."""
    return {"mask": spec.mask is not None, "dropout": spec.dropout is not None, "varlen": spec.varlen is not None}


def max_seqlens(spec: AttentionSpec) -> tuple[int, int]:
    """The longest query and key lengths the grids cover (the sizes, or varlen's maxima)."""
    if spec.varlen is not None:
        return spec.varlen.max_seqlen_q, spec.varlen.max_seqlen_k
    return spec.seqlen_q, spec.seqlen_k


def probs_shape(spec: AttentionSpec) -> tuple[int, int, int, int]:
    return (spec.num_seqs, spec.heads, *max_seqlens(spec))


def _check_probs(spec: AttentionSpec, probs: Optional[torch.Tensor]) -> Optional[str]:
    if probs is not None and (tuple(probs.shape) != probs_shape(spec) or probs.dtype != spec.q.dtype
                              or not probs.is_contiguous()):
        return f"probs must be contiguous {spec.q.dtype} {probs_shape(spec)}"
    return None


def function_constants(mask_kind: int, alibi: bool, sinks: bool, softcap: bool, band: bool, dims_aligned: bool,
                       kv_vec_aligned: bool, aux: bool, varlen: bool = False, seqused_k: bool = False,
                       paged: bool = False, dropout: bool = False, probs: bool = False) -> dict:
    """The ``[[function_constant]]`` values of ``flash_fwd.metal`` for these features."""
    return {
        FC.is_varlen: varlen,
        FC.has_seqused_k: varlen and seqused_k,
        FC.is_paged: varlen and paged,
        FC.has_dropout: dropout,
        FC.has_probs: probs,
        FC.has_mask: mask_kind != 0,
        FC.mask_kind: mask_kind,
        FC.has_alibi: alibi,
        FC.has_sinks: sinks,
        FC.has_softcap: softcap,
        FC.has_band: band,
        FC.dims_aligned: dims_aligned,
        FC.kv_vec_aligned: dims_aligned and kv_vec_aligned,
        FC.has_aux: aux,
    }


# Every value plan_forward can pass to function_constants() (the doctor enumerates the variants from these).
FEATURE_VALUES = {"mask_kind": (0, *MASK_KINDS.values()), "alibi": (False, True), "sinks": (False, True),
                  "softcap": (False, True), "band": (False, True), "dims_aligned": (False, True),
                  "kv_vec_aligned": (False, True), "aux": (False, True), "varlen": (False, True),
                  "seqused_k": (False, True), "paged": (False, True), "dropout": (False, True),
                  "probs": (False, True)}


def _plan_tile(spec: AttentionSpec, out: torch.Tensor, lse: torch.Tensor, aux: Optional[torch.Tensor],
               tile: ForwardTile, probs: Optional[torch.Tensor] = None, pack_heads: bool = True) -> Plan:
    q, k, v = spec.q, spec.k, spec.v
    B, Hq, Lq, D = q.shape
    Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
    max_q, max_k = max_seqlens(spec)
    wl, wr, has_band = effective_band(spec)
    has_softcap = spec.softcap > 0

    p = FlashFwdParams()
    p.q_stride_b, p.q_stride_h, p.q_stride_l = q.stride(0), q.stride(1), q.stride(2)
    p.k_stride_b, p.k_stride_h, p.k_stride_l = k.stride(0), k.stride(1), k.stride(2)
    p.v_stride_b, p.v_stride_h, p.v_stride_l = v.stride(0), v.stride(1), v.stride(2)
    p.o_stride_b, p.o_stride_h, p.o_stride_l = out.stride(0), out.stride(1), out.stride(2)
    p.batch, p.heads, p.kv_heads, p.gqa = B, Hq, Hkv, Hq // Hkv
    p.seqlen_q, p.seqlen_k, p.head_dim, p.head_dim_v = Lq, Lk, D, Dv
    p.diag_offset, p.window_left, p.window_right = spec.diag_offset, wl, wr
    G = Hq // Hkv
    # (the probs pass writes unpacked rows)
    p.pack = gqa_pack(G, max_q, tile.bq) if probs is None and pack_heads else 1
    p.num_q_blocks = -(-(p.pack * max_q) // tile.bq)
    p.num_seqs, p.max_seqlen_q, p.max_seqlen_k = spec.num_seqs, max_q, max_k
    p.qk_scale, p.softcap = score_scale(spec)

    buffers: dict = {BUF_Q: q, BUF_K: k, BUF_V: v, BUF_O: out, BUF_LSE: lse}
    if aux is not None:
        buffers[BUF_AUX] = aux
    if probs is not None:
        buffers[BUF_PROBS] = probs
    vl = spec.varlen
    if vl is not None:
        buffers[BUF_CU_Q], buffers[BUF_CU_K] = vl.cu_seqlens_q, vl.cu_seqlens_k
        if vl.seqused_k is not None:
            buffers[BUF_SEQUSED_K] = vl.seqused_k
        if vl.block_table is not None:
            buffers[BUF_BLOCK_TABLE] = vl.block_table
            p.bt_stride_b = vl.block_table.stride(0)
            p.page_size, p.num_blocks, p.max_blocks = Lk, k.shape[0], vl.block_table.shape[1]
    if spec.dropout is not None:
        buffers[BUF_RNG] = spec.dropout.rng_state
        p.dropout_threshold = philox.threshold(spec.dropout.p)
        p.dropout_scale = philox.keep_scale(spec.dropout.p)
    mask_kind = 0
    if spec.mask is not None:
        m = spec.mask
        mask_kind = MASK_KINDS[m.dtype]
        p.m_stride_b, p.m_stride_h, p.m_stride_q, p.m_stride_k = m.stride()
        buffers[BUF_MASK] = m
    if spec.alibi_slopes is not None:
        p.a_stride_b, p.a_stride_h = spec.alibi_slopes.stride()
        buffers[BUF_ALIBI] = spec.alibi_slopes
    if spec.sinks is not None:
        buffers[BUF_SINKS] = spec.sinks
    buffers[BUF_PARAMS] = p.to_bytes()

    dims_aligned = D == tile.bd and Dv == tile.bd
    constants = function_constants(mask_kind, spec.alibi_slopes is not None, spec.sinks is not None, has_softcap,
                                   has_band, dims_aligned, dims_aligned and _vec4_aligned(k) and _vec4_aligned(v),
                                   aux is not None, vl is not None, vl is not None and vl.seqused_k is not None,
                                   vl is not None and vl.block_table is not None, spec.dropout is not None,
                                   probs is not None)
    launch = Launch(
        source=tile.source,
        kernel=tile.kernel,
        threadgroups=(p.num_q_blocks, Hq // p.pack, spec.num_seqs),
        threadgroup=(tile.threads, 1, 1),
        buffers=buffers,
        function_constants=constants,
    )
    return Plan(launches=(launch,))


def forward_tile_for(spec: AttentionSpec, family: str = "apple8") -> ForwardTile:
    """The tile ``plan_forward`` would use (for reports)."""
    return forward_tile(spec.q.dtype, max(spec.head_dim, spec.head_dim_v), family)
