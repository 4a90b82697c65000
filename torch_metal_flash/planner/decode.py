"""Planner for the split-K flash-decoding kernels in ``shaders/flash_decode.metal``.

``plan_decode(problem, num_splits=0)`` turns a :class:`DecodeProblem` (q, the
contiguous or paged K/V cache, per-row key ranges, the band/softcap/ALiBi
parameters, preallocated out/lse) into one or two launches:

1. ``flash_decode_<dtype>[_kv<dtype>]_d<BD>_k<BK>``, grid ``(splits, Hkv * row_blocks, B)``:
   one threadgroup per (split, KV head, batch row) holding all
   ``Hq / Hkv * Lq`` query rows of the GQA group (up to :data:`MAX_ROWS_PER_TG`;
   beyond that the group is cut into ``row_blocks``), so every K/V row is read
   from device memory once per group (and once per row block).
2. when ``splits > 1``, ``flash_decode_combine_<dtype>``: one simdgroup per
   (b, h, i), 8 per threadgroup, merges the partials (float32 scratch of
   ``B * Hq * Lq * splits * (Dv + 2)`` floats, allocated here) with log-sum-exp.

``num_splits=0`` picks the split count from the KV length and the GPU size
(:func:`choose_splits`); ``num_splits > 0`` forces it (capped at
:data:`MAX_SPLITS`).  Configurations the kernels do not cover come back as
:class:`~torch_metal_flash.planner.plan.Unsupported` with the reason.

The caches are in q's dtype, in float16 / bfloat16 under a float32 q (mixed
precision), or :class:`~torch_metal_flash.problem.quant.QuantizedTensor` (affine 4/8-bit,
symmetric int8; the kernel dequantizes each packed word in registers as it
loads a tile): the planner binds the packed words where a plain cache goes,
with strides counted in rows, and the scales (and biases) next to them.
"""
from __future__ import annotations

import ctypes
import dataclasses
import math
import os
from typing import Optional, Union

import torch

from ..problem.quant import QuantizedTensor
from ..problem.spec import AttentionSpec
import torch_metal_flash.planner.choice as choice
import torch_metal_flash.planner.kvformat as kvformat
from .kvformat import MIXED_KV_DTYPES
from .limits import PipelineInfo, first_fitting
from .plan import Launch, Plan, Unsupported
from .shader_constants import DECODE as FC

SOURCE = "flash_decode.metal"
VARIANTS_SOURCE = "flash_decode_variants.metal"  # the tuner's further tiles (the same template)

# [[buffer(i)]] indices
(BUF_Q, BUF_K, BUF_V, BUF_O, BUF_LSE, BUF_PARAMS, BUF_SEQLENS, BUF_LEFTPAD, BUF_BATCH_IDX, BUF_BLOCK_TABLE,
 BUF_ALIBI, BUF_PART_O, BUF_PART_ML, BUF_MASK, BUF_SINKS, BUF_K_SCALES, BUF_K_BIASES, BUF_V_SCALES, BUF_V_BIASES,
 BUF_K_SCALES_SYM, BUF_V_SCALES_SYM) = range(21)

DTYPE_NAMES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
# flash::MaskKind of flash_transforms.h
MASK_KINDS = {torch.bool: 1, torch.float32: 2, torch.float16: 3, torch.bfloat16: 4}
HEAD_DIM_BUCKETS = (32, 64, 96, 128, 192, 256, 384, 512)  # q's, K's and V's head dims in one bucket
MAX_HEAD_DIM = HEAD_DIM_BUCKETS[-1]
# Multi-head latent attention (DeepSeek): 576-wide q and K (512 latent + 64 rotary), 512-wide V.
LATENT_BUCKET, LATENT_V_BUCKET = 576, 512
# (cache dtype, bucket) -> BK (key rows per tile); K+V tiles stay under ~18.5 KiB of threadgroup memory.
DECODE_TILES = {
    "f32": {32: 32, 64: 32, 96: 16, 128: 16, 192: 8, 256: 8, 384: 8, 512: 8, LATENT_BUCKET: 8},
    "f16": {32: 64, 64: 64, 96: 32, 128: 32, 192: 16, 256: 16, 384: 8, 512: 8, LATENT_BUCKET: 8},
    "bf16": {32: 64, 64: 64, 96: 32, 128: 32, 192: 16, 256: 16, 384: 8, 512: 8, LATENT_BUCKET: 8},
}
# Buckets whose float32 K and V tiles take turns in one buffer (two would exceed 32 KiB or the budget).
SHARED_KV_BUCKETS = {"f32": (384, 512, LATENT_BUCKET), "f16": (), "bf16": ()}
# The tuner's second tile for q and caches of one dtype (docs/tuning.md): half the keys per
# tile (twice the steps, half the threadgroup memory, so more threadgroups per core).
DECODE_EXTRA = {dt: {bd: rows[bd] // 2 for bd in (64, 128)} for dt, rows in DECODE_TILES.items()}
# Query rows (GQA group x seqlen_q) per threadgroup: 16 simdgroups (512 threads) up to head-dim
# bucket 128; 8 simdgroups above, where Q and O fragments take ~128 registers per thread and the
# pipeline's maxTotalThreadsPerThreadgroup may drop below 512.
MAX_ROWS_PER_TG = 128
MAX_ROWS_PER_TG_WIDE = 64
# Simdgroups per threadgroup at least (those without query rows only load K/V tiles): more
# loads in flight for small groups (e.g. GQA 4 x 1 row = 4 rows = one computing simdgroup).
MIN_SIMDGROUPS = 4
MAX_SPLITS = 128  # the combine kernel handles up to 128 partials per row
COMBINE_ROWS = 8  # rows (simdgroups) per combine threadgroup (kCombineRows in the shader)
MIN_KEYS_PER_SPLIT = 256
# GPU cores the split heuristic fills (M1/M2 base: 8-10; Pro 14-19; Max 30-40).
DEFAULT_GPU_CORES = int(os.environ.get("TORCH_METAL_FLASH_GPU_CORES", "10") or 10)
THREADGROUPS_PER_CORE = 4
MAX_SPLIT_OVERHEAD = 0.1  # partials + q re-reads, relative to the K/V bytes
_POS_LIMIT = 2**30


class DecodeParams(ctypes.Structure):
    """ctypes mirror of ``DecodeParams`` in shaders/flash_decode.metal."""

    _fields_ = [(n, ctypes.c_int64) for n in (
        "q_stride_b", "q_stride_h", "q_stride_l", "k_stride_b", "k_stride_l", "k_stride_h",
        "v_stride_b", "v_stride_l", "v_stride_h", "o_stride_b", "o_stride_h", "o_stride_l",
        "bt_stride_b", "a_stride_b", "a_stride_h", "m_stride_b", "m_stride_h", "m_stride_q", "m_stride_k")] + [
            (n, ctypes.c_int32) for n in (
            "batch", "heads", "kv_heads", "gqa", "seqlen_q", "head_dim", "page_size", "num_splits",
            "diag_adjust", "window_left", "window_right", "rows_per_tg", "row_blocks", "num_threads",
            "seqlen_fixed", "seqlen_new", "capacity", "cache_rows", "mask_kind", "kv_bits", "kv_group_size",
            "head_dim_v")] + [
        ("qk_scale", ctypes.c_float), ("softcap", ctypes.c_float)]

    def to_bytes(self) -> bytes:
        return bytes(self)


@dataclasses.dataclass
class DecodeProblem:
    """One decode call.  ``q``/``out`` are (B, Hq, Lq, D)-indexed views (any strides, last
    dim contiguous); caches are (B_cache, L_max, Hkv, D) or, with ``block_table``
    (B, max_blocks) int32, paged (num_blocks, page_size, Hkv, D), tensors in q's dtype
    (or float16 / bfloat16 under a float32 q) or QuantizedTensors.  Row ``b`` attends
    cache positions [leftpad[b], seqlens[b] + seqlen_new) (int32 device vectors, read
    and clamped on the GPU: shaders/kvcache_index.h; ``seqlen_fixed`` for every row
    when ``seqlens`` is None); the band is aligned bottom-right per row
    (``diag = seqlens + seqlen_new - leftpad - Lq + diag_adjust``).  ``mask`` (bool or
    float, a (B, Hq, Lq, Lk) view with Lk = the row's key count, any strides) and
    ``sinks`` (float32 (Hq,)) are the general op's."""

    q: torch.Tensor
    k_cache: Union[torch.Tensor, QuantizedTensor]
    v_cache: Union[torch.Tensor, QuantizedTensor]
    out: torch.Tensor
    lse: torch.Tensor
    seqlens: Optional[torch.Tensor]
    seqlen_fixed: int
    leftpad: Optional[torch.Tensor]
    batch_idx: Optional[torch.Tensor]
    block_table: Optional[torch.Tensor]
    alibi_slopes: Optional[torch.Tensor]  # (B, Hq) view, float32
    scale: float
    window_left: int
    window_right: int
    softcap: float
    seqlen_new: int = 0  # rows appended before this call (at seqlens[b])
    diag_adjust: int = 0
    mask: Optional[torch.Tensor] = None
    sinks: Optional[torch.Tensor] = None

    @property
    def capacity(self) -> int:
        """Cache positions per row: L_max, or max_blocks * page_size (a host-known bound of the keys)."""
        if self.block_table is not None:
            return self.block_table.shape[1] * self.k_cache.shape[1]
        return self.k_cache.shape[1]


@dataclasses.dataclass(frozen=True)
class DecodeTile:
    dtype: str  # q's (and out's)
    bd: int     # q's and K's head-dim bucket
    bk: int
    kv_dtype: str = ""  # the caches' (logical) dtype when it differs from q's
    bdv: int = 0        # V's and out's bucket when it differs from bd (latent attention)

    @property
    def shared_kv(self) -> bool:
        return self.bd in SHARED_KV_BUCKETS[self.kv_dtype or self.dtype]

    @property
    def kernel(self) -> str:
        kv = f"_kv{self.kv_dtype}" if self.kv_dtype else ""
        v = f"_v{self.bdv}" if self.bdv else ""
        return f"flash_decode_{self.dtype}{kv}_d{self.bd}{v}_k{self.bk}{'_s' if self.shared_kv else ''}"

    @property
    def source(self) -> str:
        return SOURCE if self.kv_dtype or DECODE_TILES[self.dtype][self.bd] == self.bk else VARIANTS_SOURCE


def combine_kernel(dtype: str) -> str:
    """The kernel that merges the split partials, for dtype name ``f32|f16|bf16``."""
    return f"flash_decode_combine_{dtype}"


def decode_tile(dtype: torch.dtype, head_dim: int, kv_dtype: Optional[torch.dtype] = None,
                variant: Optional[str] = None, head_dim_v: Optional[int] = None) -> DecodeTile:
    """The tile for q of ``dtype`` over caches of (logical) ``kv_dtype`` (default: the same);
    the K/V tiles are in the cache dtype, so its table sets BK.  q/K and V share the
    bucket of the larger head dim, except latent attention's (q/K up to 576, V up to
    512).  ``variant``: a kernel name of :func:`tile_variants` instead of the table's."""
    dt = DTYPE_NAMES[dtype]
    kv = DTYPE_NAMES[kv_dtype or dtype]
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    if MAX_HEAD_DIM < head_dim <= LATENT_BUCKET and head_dim_v <= LATENT_V_BUCKET:
        return DecodeTile(dt, LATENT_BUCKET, DECODE_TILES[kv][LATENT_BUCKET], "" if kv == dt else kv,
                          LATENT_V_BUCKET)
    width = max(head_dim, head_dim_v)
    for bd in HEAD_DIM_BUCKETS:
        if width <= bd:
            tile = DecodeTile(dt, bd, DECODE_TILES[kv][bd], "" if kv == dt else kv)
            if variant is not None and not tile.kv_dtype:
                tile = next(t for t in tile_variants(dtype, width) if t.kernel == variant)
            return tile
    raise ValueError(f"head dim {head_dim} (v's {head_dim_v}) beyond the decode kernels (up to {MAX_HEAD_DIM} for "
                     f"both, or {LATENT_BUCKET} with v's up to {LATENT_V_BUCKET})")


def tile_variants(dtype: torch.dtype, head_dim: int) -> list[DecodeTile]:
    """The tiles the tuner may choose for q and caches of ``dtype``, the table's first."""
    first = decode_tile(dtype, head_dim)
    extra = DECODE_EXTRA[first.dtype].get(first.bd)
    return [first] + ([DecodeTile(first.dtype, first.bd, extra)] if extra else [])


def decode_variants() -> list[DecodeTile]:
    def latent(bd: int) -> int:
        return LATENT_V_BUCKET if bd == LATENT_BUCKET else 0

    same = [DecodeTile(dt, bd, bk, bdv=latent(bd)) for dt, rows in DECODE_TILES.items() for bd, bk in rows.items()]
    same += [DecodeTile(dt, bd, bk) for dt, rows in DECODE_EXTRA.items() for bd, bk in rows.items()]
    mixed = [decode_tile(torch.float32, bd, kv, head_dim_v=latent(bd) or bd)
             for kv in MIXED_KV_DTYPES for bd in (*HEAD_DIM_BUCKETS, LATENT_BUCKET)]
    return same + mixed


def row_cap(bd: int) -> int:
    """Query rows per threadgroup at most, for head-dim bucket ``bd``.  Latent attention keeps
    the whole group of a KV head (16 query heads x up to 8 rows) in one threadgroup, so that
    each 576-wide K row is read once; a pipeline that allows fewer threads gets fewer rows
    (plan_decode's fitting)."""
    return MAX_ROWS_PER_TG if bd <= 128 or bd == LATENT_BUCKET else MAX_ROWS_PER_TG_WIDE


def row_blocking(rows: int, cap: int = MAX_ROWS_PER_TG) -> tuple[int, int]:
    """(rows_per_tg, row_blocks) for ``rows`` query rows per KV head, at most ``cap`` per threadgroup."""
    blocks = max(1, -(-rows // cap))
    return -(-rows // blocks), blocks


def choose_splits(batch: int, kv_heads: int, row_blocks: int, max_seqlen_k: int, bk: int,
                  gpu_cores: int = DEFAULT_GPU_CORES, key_bytes: int = 512, split_bytes: int = 0) -> int:
    """Split count for ``num_splits=0``.

    Enough threadgroups to fill the GPU (``THREADGROUPS_PER_CORE * gpu_cores``, at
    least one per core), within a byte budget: every split of a KV head's rows
    writes and the combine reads back its float32 partials and re-reads q
    (``split_bytes``), and all splits together may cost at most
    ``MAX_SPLIT_OVERHEAD`` of the K/V bytes (``key_bytes`` per key and KV head).
    The budget wins over filling the cores: decode is bandwidth-bound, and wide
    partials (latent attention's 512-wide v over 64 query rows, or a 4-bit cache
    whose keys are small next to them) would otherwise move more than the K/V.
    At least ``MIN_KEYS_PER_SPLIT`` keys and one tile per split, at most ``MAX_SPLITS``.
    """
    base = max(1, batch * kv_heads * row_blocks)
    target = THREADGROUPS_PER_CORE * max(1, gpu_cores)
    if base >= target or max_seqlen_k <= MIN_KEYS_PER_SPLIT:
        return 1
    want = max(-(-target // base), -(-max(1, gpu_cores) // base))
    budget = int(MAX_SPLIT_OVERHEAD * max_seqlen_k * key_bytes // max(1, split_bytes))
    tiles = max(1, -(-max_seqlen_k // bk))
    return max(1, min(want, budget, max_seqlen_k // MIN_KEYS_PER_SPLIT, tiles, MAX_SPLITS))


def split_bytes(q_rows: int, head_dim: int, head_dim_v: int, q_elem_size: int) -> int:
    """Bytes one split adds per KV head: the float32 partials of its ``q_rows`` rows
    (``head_dim_v`` outputs + max and sum) written and read back once, and q re-read."""
    return q_rows * ((head_dim_v + 2) * 4 * 2 + head_dim * q_elem_size)


def _check(pb: DecodeProblem) -> Optional[str]:
    q, kc, vc = pb.q, pb.k_cache, pb.v_cache
    if q.dtype not in DTYPE_NAMES:
        return f"dtype {q.dtype} is not supported by the decode kernels (float32, float16, bfloat16)"
    reason = kvformat.dtype_reason(q.dtype, kc, vc)
    if reason is not None:
        return reason
    if q.dim() != 4 or kc.dim() != 4 or vc.dim() != 4:
        return "q and the caches must be 4-D"
    B, Hq, Lq, D = q.shape
    Hkv, Dv = kc.shape[2], vc.shape[3]
    if kc.shape[:3] != vc.shape[:3] or kc.shape[3] != D:
        return f"cache shapes {tuple(kc.shape)} / {tuple(vc.shape)} do not match q's head dim {D}"
    if Hkv == 0 or Hq % Hkv:
        return f"query heads {Hq} not a multiple of KV heads {Hkv}"
    if D < 1 or Dv < 1:
        return f"head dim {D} (v's {Dv}) must be >= 1"
    try:
        decode_tile(q.dtype, D, head_dim_v=Dv)
    except ValueError as e:
        return str(e)
    for name, t in (("q", q), ("out", pb.out)):
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            return f"{name} last dim is not contiguous"
    for name, t in (("k_cache", kc), ("v_cache", vc)):
        reason = kvformat.layout_reason(name, t)
        if reason is not None:
            return reason
    if tuple(pb.out.shape) != (B, Hq, Lq, Dv) or pb.out.dtype != q.dtype:
        return f"out must be {q.dtype} of shape {(B, Hq, Lq, Dv)}"
    if tuple(pb.lse.shape) != (B, Hq, Lq) or pb.lse.dtype != torch.float32 or not pb.lse.is_contiguous():
        return "lse must be contiguous float32 (B, Hq, Lq)"
    if max(B, Hq, Lq, kc.shape[0], kc.shape[1], pb.capacity, pb.seqlen_new) > _POS_LIMIT:
        return "sizes beyond 2^30 (32-bit positions in the kernel)"
    if pb.seqlen_new < 0:
        return "seqlen_new < 0"
    if max(pb.window_left, pb.window_right, abs(pb.diag_adjust)) > _POS_LIMIT:
        return "window or diagonal beyond 2^30"
    if not (math.isfinite(pb.scale) and math.isfinite(pb.softcap)) or pb.softcap < 0:
        return "scale and softcap must be finite (softcap >= 0)"
    for name, t in (("cache_seqlens", pb.seqlens), ("leftpad", pb.leftpad), ("batch_idx", pb.batch_idx)):
        if t is not None and (t.dtype != torch.int32 or tuple(t.shape) != (B,) or not t.is_contiguous()):
            return f"{name} must be a contiguous int32 ({B},) tensor"
    if pb.block_table is not None:
        bt = pb.block_table
        if bt.dtype != torch.int32 or bt.dim() != 2 or bt.shape[0] != B or (bt.shape[1] > 1 and bt.stride(1) != 1):
            return "block_table must be int32 (B, max_blocks) with contiguous rows"
    if pb.alibi_slopes is not None and (tuple(pb.alibi_slopes.shape) != (B, Hq)
                                        or pb.alibi_slopes.dtype != torch.float32):
        return "alibi_slopes must be a float32 (B, Hq) view"
    if pb.mask is not None:
        if pb.mask.dtype not in MASK_KINDS:
            return f"mask dtype {pb.mask.dtype} not supported (bool, float32, float16, bfloat16)"
        if pb.seqlens is not None or pb.leftpad is not None or pb.seqlen_new:
            return "a mask needs the same keys in every row (no cache_seqlens / leftpad tensor, no append)"
        if tuple(pb.mask.shape) != (B, Hq, Lq, min(max(pb.seqlen_fixed, 0), pb.capacity)):
            return f"mask must be a (B, Hq, Lq, Lk) view, got {tuple(pb.mask.shape)}"
    if pb.sinks is not None and (pb.sinks.dtype != torch.float32 or tuple(pb.sinks.shape) != (Hq,)
                                 or not pb.sinks.is_contiguous()):
        return "sinks must be a contiguous float32 (Hq,) tensor"
    return None


def plan_decode(pb: DecodeProblem, num_splits: int = 0, gpu_cores: int = DEFAULT_GPU_CORES,
                pipeline_info: Optional[PipelineInfo] = None) -> Union[Plan, Unsupported]:
    """Launches for ``pb``; ``num_splits`` 0 = heuristic, n > 0 forces n (capped at MAX_SPLITS).

    With ``pipeline_info`` (the backend's), a decode pipeline that allows fewer
    threads than planned gets fewer query rows (simdgroups) per threadgroup and
    more row blocks (:mod:`.limits`)."""
    reason = _check(pb)
    if reason is not None:
        return Unsupported(reason)
    B, Hq, Lq, D = pb.q.shape
    Dv = pb.v_cache.shape[3]
    if B == 0 or Hq == 0 or Lq == 0:
        return Plan(launches=())
    variant = None
    if pb.k_cache.dtype == pb.q.dtype:
        variant = choice.planned("decode", "decode", pb.q.dtype, D, Dv, seqlen_q=Lq, seqlen_k=pb.capacity,
                                 causal=pb.window_right == 0, features={"mask": pb.mask is not None})
    tile = decode_tile(pb.q.dtype, D, pb.k_cache.dtype, variant, head_dim_v=Dv)
    widest = row_cap(tile.bd)
    caps = [widest >> i for i in range(widest.bit_length()) if widest >> i >= 8]  # halved down to one simdgroup
    return first_fitting((_plan_rows(pb, tile, cap, num_splits, gpu_cores) for cap in caps), pipeline_info)


def _plan_rows(pb: DecodeProblem, tile: DecodeTile, cap: int, num_splits: int, gpu_cores: int) -> Plan:
    """The launches with at most ``cap`` query rows (``cap / 8`` simdgroups) per threadgroup."""
    q, kc, vc = pb.q, pb.k_cache, pb.v_cache
    B, Hq, Lq, D = q.shape
    Hkv, Dv = kc.shape[2], vc.shape[3]
    G = Hq // Hkv
    rows_per_tg, row_blocks = row_blocking(G * Lq, cap)
    if num_splits and num_splits > 0:
        splits = min(int(num_splits), MAX_SPLITS)
    else:
        # The capacity bounds the keys without reading the lengths from the device (as flash-attn).
        splits = choose_splits(B, Hkv, row_blocks, pb.capacity, tile.bk, gpu_cores,
                               key_bytes=kvformat.row_bytes(kc) + kvformat.row_bytes(vc),
                               split_bytes=split_bytes(G * Lq, D, Dv, q.element_size()))

    paged = pb.block_table is not None
    # Window sides wider than any (i, j) distance constrain nothing.
    reach = Lq + pb.capacity + abs(pb.diag_adjust) + 1
    wl = -1 if pb.window_left < 0 or pb.window_left >= reach else pb.window_left
    wr = -1 if pb.window_right < 0 or pb.window_right >= reach else pb.window_right
    has_softcap = pb.softcap > 0

    p = DecodeParams()
    p.q_stride_b, p.q_stride_h, p.q_stride_l = q.stride(0), q.stride(1), q.stride(2)
    # Element strides, or row strides of quantized caches (kvformat).
    p.k_stride_b, p.k_stride_l, p.k_stride_h = kvformat.row_strides(kc)
    p.v_stride_b, p.v_stride_l, p.v_stride_h = kvformat.row_strides(vc)
    p.kv_bits, p.kv_group_size = kvformat.format_params(kc)
    out = pb.out
    p.o_stride_b, p.o_stride_h, p.o_stride_l = out.stride(0), out.stride(1), out.stride(2)
    p.batch, p.heads, p.kv_heads, p.gqa = B, Hq, Hkv, G
    p.seqlen_q, p.head_dim, p.head_dim_v, p.num_splits = Lq, D, Dv, splits
    p.page_size = kc.shape[1] if paged else 0
    p.diag_adjust, p.window_left, p.window_right = pb.diag_adjust, wl, wr
    p.rows_per_tg, p.row_blocks = rows_per_tg, row_blocks
    # seqlen_fixed clamped as the kernel clamps cache_seqlens (kvcache_index.h), so it fits int32.
    p.seqlen_fixed = min(max(pb.seqlen_fixed, 0), pb.capacity)
    p.seqlen_new, p.capacity, p.cache_rows = pb.seqlen_new, pb.capacity, kc.shape[0]
    simdgroups = max(-(-rows_per_tg // 8), min(MIN_SIMDGROUPS, cap // 8))
    p.num_threads = 32 * simdgroups
    if has_softcap:
        p.qk_scale = pb.scale / pb.softcap
        p.softcap = pb.softcap
    else:
        p.qk_scale = pb.scale
        p.softcap = 0.0

    buffers: dict = {BUF_Q: q, BUF_O: out, BUF_LSE: pb.lse}
    kvformat.bind(buffers, kc, BUF_K, BUF_K_SCALES, BUF_K_BIASES, BUF_K_SCALES_SYM)
    kvformat.bind(buffers, vc, BUF_V, BUF_V_SCALES, BUF_V_BIASES, BUF_V_SCALES_SYM)
    if pb.seqlens is not None:
        buffers[BUF_SEQLENS] = pb.seqlens
    if pb.leftpad is not None:
        buffers[BUF_LEFTPAD] = pb.leftpad
    if pb.batch_idx is not None and not paged:
        buffers[BUF_BATCH_IDX] = pb.batch_idx
    if paged:
        buffers[BUF_BLOCK_TABLE] = pb.block_table
        p.bt_stride_b = pb.block_table.stride(0)
    if pb.alibi_slopes is not None:
        p.a_stride_b, p.a_stride_h = pb.alibi_slopes.stride()
        buffers[BUF_ALIBI] = pb.alibi_slopes
    if pb.mask is not None:
        p.m_stride_b, p.m_stride_h, p.m_stride_q, p.m_stride_k = pb.mask.stride()
        p.mask_kind = MASK_KINDS[pb.mask.dtype]
        buffers[BUF_MASK] = pb.mask
    if pb.sinks is not None:
        buffers[BUF_SINKS] = pb.sinks
    use_splits = splits > 1
    scratch: tuple = ()
    if use_splits:
        dev = q.device
        buffers[BUF_PART_O] = torch.empty(B * Hq * Lq * splits * Dv, dtype=torch.float32, device=dev)
        buffers[BUF_PART_ML] = torch.empty(B * Hq * Lq * splits * 2, dtype=torch.float32, device=dev)
        scratch = (buffers[BUF_PART_O], buffers[BUF_PART_ML])
    params = p.to_bytes()
    buffers[BUF_PARAMS] = params
    constants = function_constants(paged, pb.leftpad is not None, pb.batch_idx is not None and not paged,
                                   pb.alibi_slopes is not None, has_softcap, wl >= 0 or wr >= 0, use_splits,
                                   pb.seqlens is not None, pb.mask is not None, pb.sinks is not None,
                                   kvformat.kv_format(kc))
    launches = [Launch(source=tile.source, kernel=tile.kernel, threadgroups=(splits, Hkv * row_blocks, B),
                       threadgroup=(32 * simdgroups, 1, 1), buffers=buffers, function_constants=constants)]
    if use_splits:
        launches.append(Launch(
            source=SOURCE, kernel=combine_kernel(tile.dtype),
            threadgroups=(-(-B * Hq * Lq // COMBINE_ROWS), 1, 1), threadgroup=(32 * COMBINE_ROWS, 1, 1),
            buffers={BUF_O: out, BUF_LSE: pb.lse, BUF_PARAMS: params, BUF_PART_O: buffers[BUF_PART_O],
                     BUF_PART_ML: buffers[BUF_PART_ML]},
            function_constants=constants))
    return Plan(launches=tuple(launches), scratch=scratch)


def function_constants(paged: bool, leftpad: bool, batch_idx: bool, alibi: bool, softcap: bool, band: bool,
                       splits: bool, seqlens: bool, mask: bool = False, sinks: bool = False,
                       kv_format: str = "plain") -> dict:
    """The ``[[function_constant]]`` values of ``flash_decode.metal`` for these features
    (``seqlens``: a lengths tensor is bound, else every row has ``seqlen_fixed``;
    ``kv_format``: ``plain``, ``affine`` or ``symmetric``)."""
    return {FC.paged: paged, FC.has_leftpad: leftpad, FC.has_batch_idx: batch_idx, FC.has_alibi: alibi,
            FC.has_softcap: softcap, FC.has_band: band, FC.use_splits: splits, FC.has_seqlens: seqlens,
            FC.has_mask: mask, FC.has_sinks: sinks, FC.kv_affine: kv_format == "affine",
            FC.kv_symmetric: kv_format == "symmetric"}


# Every value plan_decode can pass to function_constants() (the doctor enumerates the variants from these).
FEATURE_VALUES = {**{name: (False, True) for name in ("paged", "leftpad", "batch_idx", "alibi", "softcap", "band",
                                                     "splits", "seqlens", "mask", "sinks")},
                  "kv_format": kvformat.FORMATS}


def compulsory_bytes(pb: DecodeProblem) -> int:
    """Bytes a decode call must move: q, the visible K and V rows (packed values, scales and
    biases of quantized caches), out, lse (for the bench, without masks; reads the lengths on
    the host)."""
    q = pb.q
    B, Hq, Lq, D = q.shape
    Hkv, Dv = pb.k_cache.shape[2], pb.v_cache.shape[3]
    es = q.element_size()
    seqlens = pb.seqlens.long() if pb.seqlens is not None else torch.full((B,), pb.seqlen_fixed)
    ends = (seqlens.clamp(0, pb.capacity) + pb.seqlen_new).clamp(max=pb.capacity)
    starts = torch.minimum(pb.leftpad.long().clamp(min=0), ends) if pb.leftpad is not None else 0
    keys = int((ends - starts).sum())
    kv = keys * Hkv * (kvformat.row_bytes(pb.k_cache) + kvformat.row_bytes(pb.v_cache))
    return kv + B * Hq * Lq * (D + Dv) * es + B * Hq * Lq * 4


# ---------------------------------------------------------------------------
# Short-query / long-key problems of the general op take these kernels
# (planner.plan_forward asks here first).
# ---------------------------------------------------------------------------

# Query rows per KV head (GQA group size x seqlen_q) up to which a call counts
# as "decode", and the key length from which the split-K kernels pay off.
DECODE_MAX_GROUP_ROWS = 64
DECODE_MIN_SEQLEN_K = 256


def only_decode_kernels(spec: AttentionSpec) -> bool:
    """K/V the prefill kernel cannot read (quantized, or in another dtype than q): every
    shape of such a problem takes the decode kernels (they loop over row blocks)."""
    return isinstance(spec.k, QuantizedTensor) or isinstance(spec.v, QuantizedTensor) or \
        spec.k.dtype != spec.q.dtype or spec.v.dtype != spec.q.dtype


def route_reason(spec: AttentionSpec) -> Optional[str]:
    """None when ``spec`` is a decode-shaped problem these kernels take, else why not (cheap)."""
    Hq, Hkv, Lq, Lk = spec.heads, spec.kv_heads, spec.seqlen_q, spec.seqlen_k
    if Hkv == 0 or Hq % Hkv:
        return "query heads not a multiple of KV heads"
    if (Hq // Hkv) * Lq > DECODE_MAX_GROUP_ROWS:
        return f"{(Hq // Hkv) * Lq} query rows per KV head (decode takes <= {DECODE_MAX_GROUP_ROWS})"
    if Lk < DECODE_MIN_SEQLEN_K:
        return f"key length {Lk} < {DECODE_MIN_SEQLEN_K} (the prefill kernel is as good)"
    return None


def plan_decode_spec(spec: AttentionSpec, out: torch.Tensor, lse: torch.Tensor, num_splits: int = 0,
                     pipeline_info: Optional[PipelineInfo] = None) -> Union[Plan, Unsupported]:
    """The decode launches for the op's general problem: the (B, H, L, D) K/V views
    are a contiguous cache of full length seen as (B, L, H, D) (no copy), and
    the op's band offset becomes the per-row bottom-right adjustment.  Every row has
    all Lk keys: a uniform length in the params, no lengths tensor."""
    Lq, Lk = spec.seqlen_q, spec.seqlen_k
    problem = DecodeProblem(
        q=spec.q, k_cache=spec.k.transpose(1, 2), v_cache=spec.v.transpose(1, 2), out=out, lse=lse,
        seqlens=None, seqlen_fixed=Lk, leftpad=None, batch_idx=None,
        block_table=None, alibi_slopes=spec.alibi_slopes, scale=spec.scale, window_left=spec.window_left,
        window_right=spec.window_right, softcap=spec.softcap, diag_adjust=spec.diag_offset - (Lk - Lq),
        mask=spec.mask, sinks=spec.sinks)
    return plan_decode(problem, num_splits=num_splits, pipeline_info=pipeline_info)
