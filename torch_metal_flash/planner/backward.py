"""Planner for the fused backward kernels in ``shaders/flash_bwd.metal``.

``plan_backward`` turns an :class:`~torch_metal_flash.problem.spec.AttentionSpec`, the
saved forward results (``out`` and the row state ``aux``, see
:mod:`torch_metal_flash.problem.spec`) and the preallocated gradients into an ordered
plan:

1. ``flash_bwd_pre_<dt>``: ``delta = rowsum(dO * O) - dlse`` (O from aux for
   fp16/bf16: the float32 output before rounding) and ``stats = (m, 1 / l)``
   (``(0, 0)`` for rows that pass no gradient) into float32 scratch of
   3 * B*Hq*Lq elements: the only extra memory of the backward, O(B*H*L).
2. ``flash_bwd_dq_*``: dQ (and dbias = dS when requested) per query block.
3. ``flash_bwd_dkv_*``: dK and dV per key block and KV head, looping over
   the query heads of the GQA group and the query blocks of the band (one
   fused kernel, or a dK and a dV kernel for head dims above 64).
4. ``flash_bwd_dsinks`` when the spec has sinks.

Varlen problems take the same launches, the dQ and dK/dV grids covering
``max_seqlen_q`` / ``max_seqlen_k`` rows of every sequence (the kernels read
cu_seqlens on the GPU); dropout regenerates the forward's mask from
``rng_state`` in the dQ and dK/dV kernels.

No atomics anywhere: every output element has one writer and every
reduction runs in a fixed order, so results are bitwise reproducible.
Tensors are bound as they are (no copies of q/k/v/out/mask): ``dout`` must
have a contiguous last dim and ``dlse`` be contiguous float32 (the autograd
formula in :mod:`torch_metal_flash.ops` makes them so); delta and stats are
the plan's scratch.
"""
from __future__ import annotations

import ctypes
from typing import Optional, Union

import torch

import torch_metal_flash.problem.philox as philox
from ..problem.spec import AttentionSpec
import torch_metal_flash.planner.choice as choice
from .backward_tiles import (DSINKS_KERNEL, DSINKS_THREADS, PRE_ROWS_PER_GROUP, PRE_THREADS, BackwardTiles,
                             backward_candidates, backward_tiles)
from .forward import (MASK_KINDS, _last_dim_contiguous, check_aux, check_problem, effective_band, max_seqlens,
                      score_scale)
from .limits import PipelineInfo, first_fitting
from .params import FlashFwdParams
from .plan import Launch, Plan, Unsupported
from .shader_constants import BWD as FC

SOURCE = "flash_bwd.metal"

# [[buffer(i)]] indices
# preprocess
BUF_PRE_DOUT, BUF_PRE_OUT, BUF_PRE_AUX, BUF_PRE_DLSE, BUF_PRE_DELTA, BUF_PRE_STATS, BUF_PRE_PARAMS = range(7)
# dq / dkv
BUF_Q, BUF_K, BUF_V, BUF_DOUT, BUF_STATS, BUF_DELTA, BUF_PARAMS, BUF_MASK, BUF_ALIBI = range(9)
BUF_DQ, BUF_DBIAS = 9, 10
BUF_DK, BUF_DV = 9, 10
BUF_CU_Q, BUF_CU_K, BUF_SEQUSED_K, BUF_RNG = 11, 12, 13, 14
# dsinks
BUF_S_STATS, BUF_S_DELTA, BUF_S_SINKS, BUF_S_DSINKS, BUF_S_PARAMS = 0, 1, 2, 3, 6

_I64 = ctypes.c_int64
_I32 = ctypes.c_int32
_F32 = ctypes.c_float


class FlashBwdParams(ctypes.Structure):
    """ctypes mirror of ``shaders/flash_bwd_params.h``."""

    _fields_ = [
        ("f", FlashFwdParams),
        ("do_stride_b", _I64), ("do_stride_h", _I64), ("do_stride_l", _I64),
        ("dq_stride_b", _I64), ("dq_stride_h", _I64), ("dq_stride_l", _I64),
        ("dk_stride_b", _I64), ("dk_stride_h", _I64), ("dk_stride_l", _I64),
        ("dv_stride_b", _I64), ("dv_stride_h", _I64), ("dv_stride_l", _I64),
        ("db_stride_b", _I64), ("db_stride_h", _I64), ("db_stride_q", _I64),
        ("rows", _I32), ("num_k_blocks", _I32), ("scale", _F32), ("pad_i", _I32),
    ]

    def to_bytes(self) -> bytes:
        return bytes(self)


def _set(struct: ctypes.Structure, **fields) -> None:
    """Assign struct fields, refusing names the struct does not have (ctypes
    would silently add a plain Python attribute)."""
    known = {name for name, _ in type(struct)._fields_}
    for name, value in fields.items():
        if name not in known:
            raise AttributeError(f"{type(struct).__name__} has no field {name!r} (params header changed?)")
        setattr(struct, name, value)


def _check(spec: AttentionSpec, dout, out, aux, dlse, dq, dk, dv, dbias, dsinks) -> Optional[str]:
    reason = check_problem(spec)
    if reason is not None:
        return reason
    q = spec.q
    B, Hq, Lq, _ = q.shape
    Lk, Dv = spec.seqlen_k, spec.head_dim_v
    for name, t, ref in (("dq", dq, q), ("dk", dk, spec.k), ("dv", dv, spec.v)):
        if tuple(t.shape) != tuple(ref.shape) or t.dtype != ref.dtype:
            return f"{name} must be {ref.dtype} of shape {tuple(ref.shape)}"
    for name, t in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        if not _last_dim_contiguous(t):
            return f"{name} last dim is not contiguous (stride {t.stride(-1)})"
    if tuple(out.shape) != (B, Hq, Lq, Dv) or out.dtype != q.dtype:
        return f"out must be {q.dtype} of shape {(B, Hq, Lq, Dv)}"
    if tuple(dout.shape) != (B, Hq, Lq, Dv) or dout.dtype != q.dtype:
        return f"dout must be {q.dtype} of shape {(B, Hq, Lq, Dv)}"
    reason = check_aux(spec, aux)
    if reason is not None:
        return reason
    if not _last_dim_contiguous(dout):
        return f"dout last dim is not contiguous (stride {dout.stride(-1)})"
    if dlse is not None and (tuple(dlse.shape) != (B, Hq, Lq) or dlse.dtype != torch.float32
                             or not dlse.is_contiguous()):
        return f"dlse must be contiguous float32 (B, Hq, Lq), got {dlse.dtype} {tuple(dlse.shape)}"
    if dbias is not None and dbias.numel() > 0:
        if tuple(dbias.shape) != (B, Hq, Lq, Lk) or dbias.dtype != torch.float32 or dbias.stride(-1) != 1:
            return "dbias must be float32 (B, Hq, Lq, Lk) with a contiguous last dim"
    if spec.sinks is not None:
        if dsinks is None or tuple(dsinks.shape) != (Hq,) or dsinks.dtype != torch.float32 \
                or not dsinks.is_contiguous():
            return "dsinks must be contiguous float32 (Hq,)"
    return None


def plan_backward(spec: AttentionSpec, dout: torch.Tensor, out: torch.Tensor, aux: torch.Tensor,
                  dlse: Optional[torch.Tensor], dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
                  dbias: Optional[torch.Tensor], dsinks: Optional[torch.Tensor],
                  family: str = "apple8", pipeline_info: Optional[PipelineInfo] = None) -> Union[Plan, Unsupported]:
    """The backward launches; with ``pipeline_info`` (the backend's) the table's tiles
    are checked against their pipelines' limits and those of a larger bucket taken
    when they do not fit (:mod:`.limits`)."""
    reason = _check(spec, dout, out, aux, dlse, dq, dk, dv, dbias, dsinks)
    if reason is not None:
        return Unsupported(reason)
    from .forward import features, is_causal, max_seqlens
    max_q, max_k = max_seqlens(spec)
    try:
        chosen = [choice.planned("bwd", part, spec.q.dtype, spec.head_dim, spec.head_dim_v, family=family,
                                 seqlen_q=max_q, seqlen_k=max_k, causal=is_causal(spec), features=features(spec))
                  for part in ("dq", "dkv")]
        candidates = backward_candidates(spec.q.dtype, max(spec.head_dim, spec.head_dim_v), family, *chosen)
    except (KeyError, ValueError) as e:
        return Unsupported(str(e))
    if spec.varlen is not None and spec.varlen.block_table is not None:
        return Unsupported("block_table: the backward kernels take packed K/V (metal_flash.fwd's autograd "
                           "gathers paged K/V first)")
    if spec.varlen is None and (spec.batch == 0 or spec.heads == 0 or spec.seqlen_q == 0 or spec.seqlen_k == 0):
        return Unsupported("empty problem (the reference fills the zeros)")
    return first_fitting((_plan_tiles(spec, dout, out, aux, dlse, dq, dk, dv, dbias, dsinks, tiles)
                          for tiles in candidates), pipeline_info)


def function_constants(mask_kind: int, alibi: bool, sinks: bool, softcap: bool, band: bool, dims_aligned: bool,
                       dbias: bool, dlse: bool, varlen: bool = False, seqused_k: bool = False,
                       dropout: bool = False) -> dict:
    """The ``[[function_constant]]`` values of ``flash_bwd.metal`` for these features."""
    return {
        FC.is_varlen: varlen,
        FC.has_seqused_k: varlen and seqused_k,
        FC.has_dropout: dropout,
        FC.has_mask: mask_kind != 0,
        FC.mask_kind: mask_kind,
        FC.has_alibi: alibi,
        FC.has_sinks: sinks,
        FC.has_softcap: softcap,
        FC.has_band: band,
        FC.dims_aligned: dims_aligned,
        FC.has_dbias: dbias,
        FC.has_dlse: dlse,
    }


# Every value plan_backward can pass to function_constants() (the doctor enumerates the variants from these).
FEATURE_VALUES = {"mask_kind": (0, *MASK_KINDS.values()), "alibi": (False, True), "sinks": (False, True),
                  "softcap": (False, True), "band": (False, True), "dims_aligned": (False, True),
                  "dbias": (False, True), "dlse": (False, True), "varlen": (False, True), "seqused_k": (False, True),
                  "dropout": (False, True)}


def _plan_tiles(spec: AttentionSpec, dout, out, aux, dlse, dq, dk, dv, dbias, dsinks, tiles: BackwardTiles) -> Plan:
    q, k, v = spec.q, spec.k, spec.v
    B, Hq, Lq, D = q.shape
    Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
    compute_dbias = dbias is not None and dbias.numel() > 0

    wl, wr, has_band = effective_band(spec)
    has_softcap = spec.softcap > 0
    qk_scale, softcap = score_scale(spec)
    max_q, max_k = max_seqlens(spec)
    vl, drop = spec.varlen, spec.dropout

    p = FlashBwdParams()
    f = p.f
    _set(f, q_stride_b=q.stride(0), q_stride_h=q.stride(1), q_stride_l=q.stride(2),
         k_stride_b=k.stride(0), k_stride_h=k.stride(1), k_stride_l=k.stride(2),
         v_stride_b=v.stride(0), v_stride_h=v.stride(1), v_stride_l=v.stride(2),
         o_stride_b=out.stride(0), o_stride_h=out.stride(1), o_stride_l=out.stride(2),
         batch=B, heads=Hq, kv_heads=Hkv, gqa=Hq // Hkv, seqlen_q=Lq, seqlen_k=Lk, head_dim=D, head_dim_v=Dv,
         diag_offset=spec.diag_offset, window_left=wl, window_right=wr,
         num_q_blocks=-(-max_q // tiles.dq.bq), qk_scale=qk_scale, softcap=softcap, pack=1,
         num_seqs=spec.num_seqs, max_seqlen_q=max_q, max_seqlen_k=max_k)
    if drop is not None:
        _set(f, dropout_threshold=philox.threshold(drop.p), dropout_scale=philox.keep_scale(drop.p))
    _set(p, do_stride_b=dout.stride(0), do_stride_h=dout.stride(1), do_stride_l=dout.stride(2),
         dq_stride_b=dq.stride(0), dq_stride_h=dq.stride(1), dq_stride_l=dq.stride(2),
         dk_stride_b=dk.stride(0), dk_stride_h=dk.stride(1), dk_stride_l=dk.stride(2),
         dv_stride_b=dv.stride(0), dv_stride_h=dv.stride(1), dv_stride_l=dv.stride(2),
         rows=B * Hq * Lq, num_k_blocks=-(-max_k // tiles.dkv[0].bk), scale=spec.scale)
    if compute_dbias:
        _set(p, db_stride_b=dbias.stride(0), db_stride_h=dbias.stride(1), db_stride_q=dbias.stride(2))

    mask_kind = 0
    shared: dict = {}
    if spec.mask is not None:
        m = spec.mask
        mask_kind = MASK_KINDS[m.dtype]
        _set(f, m_stride_b=m.stride(0), m_stride_h=m.stride(1), m_stride_q=m.stride(2), m_stride_k=m.stride(3))
        shared[BUF_MASK] = m
    if spec.alibi_slopes is not None:
        a = spec.alibi_slopes
        _set(f, a_stride_b=a.stride(0), a_stride_h=a.stride(1))
        shared[BUF_ALIBI] = a
    if vl is not None:
        shared[BUF_CU_Q], shared[BUF_CU_K] = vl.cu_seqlens_q, vl.cu_seqlens_k
        if vl.seqused_k is not None:
            shared[BUF_SEQUSED_K] = vl.seqused_k
    if drop is not None:
        shared[BUF_RNG] = drop.rng_state
    params = p.to_bytes()

    constants = function_constants(mask_kind, spec.alibi_slopes is not None, spec.sinks is not None, has_softcap,
                                   has_band, D == tiles.dq.bd and Dv == tiles.dq.bd, compute_dbias, dlse is not None,
                                   vl is not None, vl is not None and vl.seqused_k is not None, drop is not None)

    # The only scratch: delta and (m, 1 / l) per row, float32.
    delta = torch.empty((B, Hq, Lq), dtype=torch.float32, device=q.device)
    stats = torch.empty((B, Hq, Lq, 2), dtype=torch.float32, device=q.device)

    launches = []
    pre_bufs = {BUF_PRE_DOUT: dout, BUF_PRE_OUT: out, BUF_PRE_AUX: aux, BUF_PRE_DELTA: delta,
                BUF_PRE_STATS: stats, BUF_PRE_PARAMS: params}
    if dlse is not None:
        pre_bufs[BUF_PRE_DLSE] = dlse
    launches.append(Launch(source=SOURCE, kernel=tiles.pre_kernel,
                           threadgroups=(-(-p.rows // PRE_ROWS_PER_GROUP), 1, 1),
                           threadgroup=(PRE_THREADS, 1, 1), buffers=pre_bufs,
                           function_constants=dict(constants)))

    common = {BUF_Q: q, BUF_K: k, BUF_V: v, BUF_DOUT: dout, BUF_STATS: stats, BUF_DELTA: delta,
              BUF_PARAMS: params, **shared}
    dq_bufs = dict(common)
    dq_bufs[BUF_DQ] = dq
    if compute_dbias:
        dq_bufs[BUF_DBIAS] = dbias
    launches.append(Launch(source=tiles.dq.source, kernel=tiles.dq.kernel,
                           threadgroups=(f.num_q_blocks, Hq, spec.num_seqs), threadgroup=(tiles.dq.threads, 1, 1),
                           buffers=dq_bufs, function_constants=dict(constants)))
    for t in tiles.dkv:
        bufs = dict(common)
        bufs[BUF_DK] = dk
        bufs[BUF_DV] = dv
        launches.append(Launch(source=t.source, kernel=t.kernel,
                               threadgroups=(-(-max_k // t.bk), Hkv, spec.num_seqs), threadgroup=(t.threads, 1, 1),
                               buffers=bufs, function_constants=dict(constants)))
    if spec.sinks is not None:
        launches.append(Launch(source=SOURCE, kernel=DSINKS_KERNEL, threadgroups=(Hq, 1, 1),
                               threadgroup=(DSINKS_THREADS, 1, 1),
                               buffers={BUF_S_STATS: stats, BUF_S_DELTA: delta, BUF_S_SINKS: spec.sinks,
                                        BUF_S_DSINKS: dsinks, BUF_S_PARAMS: params},
                               function_constants=dict(constants)))
    # An empty grid (varlen without rows or sequences) is no launch.
    launches = [launch for launch in launches if 0 not in launch.threadgroups]
    return Plan(launches=tuple(launches), scratch=(delta, stats))


def backward_tiles_for(spec: AttentionSpec, family: str = "apple8") -> BackwardTiles:
    """The tiles ``plan_backward`` would use (for reports)."""
    return backward_tiles(spec.q.dtype, max(spec.head_dim, spec.head_dim_v), family)


def scratch_bytes(spec: AttentionSpec) -> int:
    """Bytes the plan allocates beyond the gradients (the delta and stats scratch)."""
    return 4 * spec.batch * spec.heads * spec.seqlen_q * 3
