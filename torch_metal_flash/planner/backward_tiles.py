"""The backward tile table: tile sizes per head-dim bucket, dtype and GPU family.

Two tiled kernels of ``shaders/flash_bwd.metal`` per problem:

* dQ kernel ``flash_bwd_dq_<dt>_d<BD>_q<BQ>_k<BK>``: ``BQ`` query rows per
  threadgroup (8 per simdgroup), K and V tiles of ``BK x (BD + pad)``
  elements in threadgroup memory.
* dK/dV kernel ``flash_bwd_dkv_<dt>_d<BD>_k<BK>_q<BQ>_m<MODE>``: ``BK`` key
  rows per threadgroup (8 per simdgroup), Q and dO tiles of
  ``BQ x (BD + pad)`` elements plus ``3 * BQ`` floats (row stats m, 1/l and delta).
  ``MODE`` 0 computes dK and dV in one kernel, 1 only dK, 2 only dV.  Up to head
  dim 64 the fused kernel holds K, V and both accumulators in registers; above, it
  stages its K and V rows in threadgroup memory (``2 * BK`` more tile rows) and keeps
  only the dK and dV accumulators in registers, so it computes FlashAttention-2's
  four dK/dV-side products once at every head dim up to 256 (:data:`FUSED_MAX_BD`).
  The split pair (a dK and a dV kernel, each recomputing S) stays among the variants.
* Head dims 384 and 512 split the head dim (``_ds4``, :data:`_SPLIT_DQ`, :data:`_SPLIT_DKV`): four
  simdgroups per 8 rows, each holding a quarter of the row's fragments (Q, dO, dQ; or K, V, dK, dV),
  their partial S and dP summed through threadgroup memory, so the fused dK/dV kernel fits a
  thread's registers there too.  The undivided kernels (dQ, and the split pair, where two
  head-dim-wide accumulators no longer fit) stay among the variants, and are float32's default at
  512, whose streamed tiles leave no room for the partials.

On GPUs with neural accelerators (family apple10) half/bfloat problems run the
accelerator kernels of ``shaders/flash_bwd_nax.metal`` where the register budget
allows (:data:`NAX_DQ`, :data:`NAX_DKV`): ``flash_bwd_dq_nax_<dt>_d<BD>_q<BQ>_k<BK>[_s]``
(``_s``: K and V take turns in one buffer) and
``flash_bwd_dkv_nax_<dt>_d<BD>_k<BK>_q<BQ>_m<MODE>``, 16 rows per simdgroup
(``BQ / 16`` resp. ``BK / 16`` simdgroups).  The simdgroup tiles stay among the variants there.

Plus two fixed kernels: ``flash_bwd_pre_<dt>`` (8 rows per threadgroup of
256 threads) and ``flash_bwd_dsinks`` (one threadgroup of 256 per head,
1 KiB of threadgroup memory).

The table's values (the default of every family, not measured; sources:
docs/tuning.md) keep the dQ and split dK/dV tiles at or under ~17.5 KiB of threadgroup
memory up to head dim 256 (``threads`` = 4 x the owned block: 256 for 64-row blocks), the
fused dK/dV tiles that stage K and V within 32 KiB (:data:`_DKV_FUSED`); the wide
buckets 384 and 512 take 8-row streamed tiles (the head-dim splits add their partials, up
to 29 KiB), which float32 at 512 fills to the 32 KiB with unpadded rows (its dK/dV kernel
then reads the row statistics from device memory instead of staging them).  The tuner
(:mod:`torch_metal_flash.tuning`) chooses the dQ and the dK/dV tile among
:func:`dq_variants` / :func:`dkv_variants`: the table's plus half-height owned
blocks (:data:`EXTRA_BUCKETS`) and, up to head dim 256, the split dK/dV pair, instantiated in
``shaders/flash_bwd_variants.metal`` (the same templates).  A new entry needs
matching ``FLASH_BWD_*_INSTANTIATE`` lines in the shader (a test checks).
"""
from __future__ import annotations

import dataclasses

import torch

from .tiles import (DTYPE_NAMES, FAMILIES, HEAD_DIM_BUCKETS, MAX_HEAD_DIM, NAX_FAMILY, head_dim_bucket, score_slices,
                    table_family)

_ELEM_SIZE = {"f32": 4, "f16": 2, "bf16": 2}
PRE_THREADS = 256
PRE_ROWS_PER_GROUP = 8
DSINKS_THREADS = 256
DSINKS_KERNEL = "flash_bwd_dsinks"
FUSED_MAX_BD = 256  # the fused dK/dV kernel is the default up to this head dim
REGISTER_KV_MAX_BD = 64  # above, the fused kernel stages K and V in threadgroup memory
THREADGROUP_BYTES = 32768  # every Apple GPU's maxThreadgroupMemoryLength
SOURCE = "flash_bwd.metal"
VARIANTS_SOURCE = "flash_bwd_variants.metal"
NAX_SOURCE = "flash_bwd_nax.metal"
# Buckets with a second dQ and dK/dV tile for the tuner: the owned block halved (half the
# threads, twice the threadgroups: better for short problems and small GPUs; the same
# threadgroup memory, as the streamed tiles do not depend on the owned block).
EXTRA_BUCKETS = (64, 128, 384, 512)


def tile_ld(dtype: str, bd: int, rows: int) -> int:
    """The row stride of ``rows`` threadgroup tile rows (``flash::TileLD`` of flash_loader.h): padded by
    16 bytes against bank conflicts while the padded rows fit in threadgroup memory."""
    padded = bd + 16 // _ELEM_SIZE[dtype]
    return padded if rows * padded * _ELEM_SIZE[dtype] <= THREADGROUP_BYTES else bd


@dataclasses.dataclass(frozen=True)
class DQTile:
    dtype: str
    bd: int
    bq: int
    bk: int
    nax: bool = False  # the neural-accelerator kernel (16 rows per simdgroup)
    shared_kv: bool = False  # (nax) K and V take turns in one tile buffer
    ds: int = 1  # simdgroups that share 8 query rows, each holding a slice of the head dim

    @property
    def threads(self) -> int:
        return (2 if self.nax else 4) * self.bq * self.ds

    @property
    def kernel(self) -> str:
        return (f"flash_bwd_dq_{'nax_' if self.nax else ''}{self.dtype}_d{self.bd}_q{self.bq}_k{self.bk}"
                f"{'_s' if self.shared_kv else ''}{_split_suffix(self.ds)}")

    @property
    def source(self) -> str:
        if self.nax:
            return NAX_SOURCE
        return SOURCE if self == _table_tiles(self.dtype, self.bd, FAMILIES[0]).dq else VARIANTS_SOURCE

    @property
    def threadgroup_memory(self) -> int:
        tiles = 1 if self.shared_kv else 2
        partials = 2 * self.ds * self.bq * self.bk * 4 if self.ds > 1 else 0  # each row group's S and dP slices
        return tiles * self.bk * tile_ld(self.dtype, self.bd, tiles * self.bk) * _ELEM_SIZE[self.dtype] + partials


@dataclasses.dataclass(frozen=True)
class DKVTile:
    dtype: str
    bd: int
    bk: int
    bq: int
    mode: int  # 0 fused dK+dV, 1 dK only, 2 dV only
    nax: bool = False  # the neural-accelerator kernel (16 rows per simdgroup)
    ds: int = 1  # simdgroups that share 8 key rows, each holding a slice of the head dim

    @property
    def threads(self) -> int:
        return (2 if self.nax else 4) * self.bk * self.ds

    @property
    def kernel(self) -> str:
        return (f"flash_bwd_dkv_{'nax_' if self.nax else ''}{self.dtype}_d{self.bd}_k{self.bk}_q{self.bq}"
                f"_m{self.mode}{_split_suffix(self.ds)}")

    @property
    def source(self) -> str:
        if self.nax:
            return NAX_SOURCE
        return SOURCE if self in _table_tiles(self.dtype, self.bd, FAMILIES[0]).dkv else VARIANTS_SOURCE

    @property
    def stages_kv(self) -> bool:
        """The undivided fused kernel above head dim 64 reads its K and V rows from threadgroup memory."""
        return self.mode == 0 and self.bd > REGISTER_KV_MAX_BD and not self.nax and self.ds == 1

    @property
    def threadgroup_memory(self) -> int:
        rows = 2 * self.bq + (2 * self.bk if self.stages_kv else 0)
        tiles = rows * tile_ld(self.dtype, self.bd, rows) * _ELEM_SIZE[self.dtype]
        tiles += 2 * self.ds * self.bq * self.bk * 4 if self.ds > 1 else 0  # each row group's S^T and dP^T slices
        stats = 3 * self.bq * 4
        return tiles + stats if tiles + stats <= THREADGROUP_BYTES else tiles  # else read from device


@dataclasses.dataclass(frozen=True)
class BackwardTiles:
    dq: DQTile
    dkv: tuple[DKVTile, ...]  # one fused kernel, or the dK and the dV kernel

    @property
    def pre_kernel(self) -> str:
        return f"flash_bwd_pre_{self.dq.dtype}"


# (dtype, bucket) -> dQ (BQ, BK), dK/dV (BK, BQ).  64-row blocks (8 simdgroups)
# up to head dim 128 halve the K/V re-reads of the dQ kernel and the Q/dO
# re-reads of the dK/dV kernel against 32-row blocks, at the same threadgroup
# memory (the streamed tiles do not depend on the owned block).
_DQ = {
    "f32": {32: (64, 32), 64: (64, 32), 80: (64, 16), 96: (64, 16), 128: (64, 16),
            160: (32, 8), 192: (32, 8), 256: (32, 8), 384: (32, 8), 512: (32, 8)},
    "f16": {32: (64, 32), 64: (64, 32), 80: (64, 32), 96: (64, 32), 128: (64, 32),
            160: (32, 16), 192: (32, 16), 256: (32, 16), 384: (32, 8), 512: (32, 8)},
}
_DQ["bf16"] = dict(_DQ["f16"])
_DKV = {
    "f32": {32: (64, 32), 64: (64, 32), 80: (64, 16), 96: (64, 16), 128: (64, 16),
            160: (32, 8), 192: (32, 8), 256: (32, 8), 384: (32, 8), 512: (32, 8)},
    "f16": {32: (64, 32), 64: (64, 32), 80: (64, 32), 96: (64, 32), 128: (64, 32),
            160: (32, 16), 192: (32, 16), 256: (32, 16), 384: (32, 8), 512: (32, 8)},
}
_DKV["bf16"] = dict(_DKV["f16"])
# The fused dK/dV kernel above head dim 64: its K and V rows (2 * BK) and the streamed Q and dO
# tiles (2 * BQ) share the threadgroup memory.  BK is half the split pair's key rows, so that the
# one kernel streams Q and dO as often as the pair (which streams them twice), where that fits
# 32 KiB next to 8-row Q/dO tiles (else the most that do: float32 from 128); BQ is 16 where the
# whole stays under 20 KiB, else 8.  float32 at 256 fills the 32 KiB with unpadded rows and reads
# the row statistics from device memory.
_DKV_FUSED = {
    "f32": {80: (32, 8), 96: (32, 8), 128: (16, 8), 160: (16, 8), 192: (8, 8), 256: (8, 8)},
    "f16": {80: (32, 16), 96: (32, 16), 128: (32, 8), 160: (16, 8), 192: (16, 8), 256: (16, 8)},
}
_DKV_FUSED["bf16"] = dict(_DKV_FUSED["f16"])

# The head-dim split of the wide buckets (tiles.score_slices simdgroups per 8 rows, each holding its
# slice of Q, dO and dQ, or of K, V, dK and dV; partial S and dP summed through threadgroup memory):
# dQ (BQ, BK) and fused dK/dV (BK, BQ), the default where the streamed tiles leave room for the
# partials.  Float32 at 512 keeps the undivided kernels: its 8-row K/V (Q/dO) tiles alone fill 32 KiB.
_SPLIT_DQ = {"f32": {384: (16, 8)}, "f16": {384: (32, 8), 512: (32, 8)}}
_SPLIT_DQ["bf16"] = dict(_SPLIT_DQ["f16"])
_SPLIT_DKV = {"f32": {384: (16, 8)}, "f16": {384: (32, 8), 512: (32, 8)}}
_SPLIT_DKV["bf16"] = dict(_SPLIT_DKV["f16"])

# (BK, BQ) per dK/dV mode: the fused kernel's (up to head dim 64 the same tiles as the pair's), the pair's
_DKV_BY_MODE = {0: {dt: {**_DKV[dt], **_DKV_FUSED[dt]} for dt in _DKV}, 1: _DKV, 2: _DKV}

BACKWARD_TILES = {family: {"dq": _DQ} for family in FAMILIES}

# The neural-accelerator tiles of apple10 (shaders/flash_bwd_nax.metal) per bucket, half and
# bfloat alike, the default first.  dQ (BQ, BK, shared_kv): 64 query rows (4 simdgroups of 16),
# 32 keys per step, K and V taking turns in one buffer from head dim 160 (about 17 KiB); dK/dV
# (BK, BQ): 64 key rows, 32 queries per step, up to head dim 128 (the register budget of 16 key
# rows per simdgroup: flash_bwd_nax.metal's header), split into dK and dV above 64 as the
# simdgroup kernels.  The bucket 80 (not a multiple of 32), float32 and the buckets past these
# keep the simdgroup kernels, which stay among the variants.
NAX_DQ = {32: [(64, 32, False)], 64: [(64, 32, False), (32, 32, False)], 96: [(64, 32, False)],
          128: [(64, 32, False), (32, 32, False)], 160: [(32, 32, True)], 192: [(32, 32, True)],
          256: [(32, 32, True), (64, 32, True)]}
NAX_DKV = {32: [(64, 32)], 64: [(64, 32), (32, 32)], 96: [(64, 32)], 128: [(64, 32), (32, 32)]}
NAX_DTYPES = ("f16", "bf16")


def _nax_dq(dt: str, bd: int, family: str) -> list[DQTile]:
    if table_family(family) != NAX_FAMILY or dt not in NAX_DTYPES:
        return []
    return [DQTile(dt, bd, bq, bk, nax=True, shared_kv=s) for bq, bk, s in NAX_DQ.get(bd, ())]


def _nax_dkv(dt: str, bd: int, family: str) -> list[tuple[DKVTile, ...]]:
    if table_family(family) != NAX_FAMILY or dt not in NAX_DTYPES:
        return []
    return [tuple(DKVTile(dt, bd, bk, bq, m, nax=True) for m in _modes(bd, nax=True))
            for bk, bq in NAX_DKV.get(bd, ())]


def _modes(bd: int, nax: bool = False) -> tuple[int, ...]:
    """The dK/dV kernels of a tile: the fused one, or the split pair (the accelerator kernels fuse only
    up to head dim 64, where K, V and both accumulators fit their registers)."""
    return (0,) if bd <= (REGISTER_KV_MAX_BD if nax else FUSED_MAX_BD) else (1, 2)


def _dkv_tiles(dt: str, bd: int, modes: tuple[int, ...]) -> tuple[DKVTile, ...]:
    return tuple(DKVTile(dt, bd, *_DKV_BY_MODE[m][dt][bd], m) for m in modes)


def _split_suffix(ds: int) -> str:
    return f"_ds{ds}" if ds > 1 else ""


def dq_variants(dtype: torch.dtype, head_dim: int, family: str = "apple8") -> list[DQTile]:
    """The dQ tiles the tuner may choose, the family's default first."""
    first = backward_tiles(dtype, head_dim, family).dq
    simd = _table_tiles(first.dtype, first.bd, family).dq
    undivided = _undivided_tiles(first.dtype, first.bd, family).dq
    out = [first, *_nax_dq(first.dtype, first.bd, family)]
    for t in dict.fromkeys((simd, undivided)):
        out.append(t)
        if first.bd in EXTRA_BUCKETS:
            out.append(dataclasses.replace(t, bq=t.bq // 2))
    return list({t.kernel: t for t in out}.values())


def dkv_variants(dtype: torch.dtype, head_dim: int, family: str = "apple8") -> list[tuple[DKVTile, ...]]:
    """The dK/dV tiles (one fused kernel, or the dK and the dV kernel) the tuner may choose,
    the family's default first."""
    first = backward_tiles(dtype, head_dim, family).dkv
    dt, bd = first[0].dtype, first[0].bd
    simd = _table_tiles(dt, bd, family).dkv
    out = [first, *_nax_dkv(dt, bd, family), simd]
    if simd[0].stages_kv:
        out.append(_dkv_tiles(dt, bd, (1, 2)))  # the split pair, for Macs where it wins
    owned = [simd]  # tiles that also come with half the owned key rows
    if simd[0].ds > 1:
        owned.append(_undivided_tiles(dt, bd, family).dkv)
        out.append(owned[-1])
    for tiles in owned:
        if bd in EXTRA_BUCKETS and tiles[0].bk >= 16:
            out.append(tuple(dataclasses.replace(x, bk=x.bk // 2) for x in tiles))
    return list({pair[0].kernel: pair for pair in out}.values())


def _undivided_tiles(dt: str, bd: int, family: str) -> BackwardTiles:
    """The family table's simdgroup tiles with each simdgroup holding the whole head dim."""
    # appleN newer than the tables -> the newest table; no simdgroup matrices -> ValueError.
    bq, bk = BACKWARD_TILES[table_family(family)]["dq"][dt][bd]
    return BackwardTiles(DQTile(dt, bd, bq, bk), _dkv_tiles(dt, bd, _modes(bd)))


def _table_tiles(dt: str, bd: int, family: str) -> BackwardTiles:
    """The family table's simdgroup tiles: the undivided ones, or the head-dim splits where they fit."""
    tiles = _undivided_tiles(dt, bd, family)
    if bd in _SPLIT_DQ[dt]:
        tiles = dataclasses.replace(tiles, dq=DQTile(dt, bd, *_SPLIT_DQ[dt][bd], ds=score_slices(bd)))
    if bd in _SPLIT_DKV[dt]:
        tiles = dataclasses.replace(tiles, dkv=(DKVTile(dt, bd, *_SPLIT_DKV[dt][bd], 0, ds=score_slices(bd)),))
    return tiles


def backward_tiles(dtype: torch.dtype, head_dim: int, family: str = "apple8", dq_variant: str | None = None,
                   dkv_variant: str | None = None) -> BackwardTiles:
    """Tiles for ``dtype`` and ``head_dim`` (max of D and Dv), the table's or the named
    variants (a dQ kernel name; a dK/dV kernel name, either of a split pair); raises
    KeyError/ValueError."""
    dt = DTYPE_NAMES[dtype]
    bd = head_dim_bucket(head_dim)
    if bd is None:
        raise ValueError(f"head dim {head_dim} > {MAX_HEAD_DIM}")
    tiles = _table_tiles(dt, bd, family)
    accel_dq, accel_dkv = _nax_dq(dt, bd, family), _nax_dkv(dt, bd, family)
    tiles = BackwardTiles(accel_dq[0] if accel_dq else tiles.dq, accel_dkv[0] if accel_dkv else tiles.dkv)
    if dq_variant is not None:
        tiles = dataclasses.replace(tiles, dq=next(
            x for x in dq_variants(dtype, head_dim, family) if x.kernel == dq_variant))
    if dkv_variant is not None:
        tiles = dataclasses.replace(tiles, dkv=next(
            x for x in dkv_variants(dtype, head_dim, family) if dkv_variant in (y.kernel for y in x)))
    return tiles


def backward_candidates(dtype: torch.dtype, head_dim: int, family: str = "apple8", dq_variant: str | None = None,
                        dkv_variant: str | None = None) -> list[BackwardTiles]:
    """The tiles the planner may use for ``head_dim``, preferred first: the table's
    (or the named variants, see :func:`backward_tiles`), after a head-dim split the
    split with half the owned rows and the bucket's undivided kernels,
    then those of larger buckets (head dim zero-padded) whose dQ or dK/dV kernels
    need fewer threads or less threadgroup memory, for pipelines whose limits the
    first exceeds.  (Zero columns leave the scores' chains unchanged, so a larger bucket
    rebuilds the forward's scores bit for bit, except across 256 -> 384 and 384 -> 512, whose
    score slices differ: there they agree to rounding.)"""
    first = backward_tiles(dtype, head_dim, family, dq_variant, dkv_variant)

    def needs(t: BackwardTiles) -> tuple[int, int, int, int]:
        return (t.dq.threads, max(x.threads for x in t.dkv), t.dq.threadgroup_memory,
                max(x.threadgroup_memory for x in t.dkv))

    same = []
    if first.dq.ds > 1 or first.dkv[0].ds > 1:
        # A head-dim split needs 4x the threads of the bucket's undivided kernels (and the widest bucket
        # has no larger one): the split with half the owned rows, then the undivided kernels.
        halved = BackwardTiles(dataclasses.replace(first.dq, bq=first.dq.bq // 2),
                               tuple(dataclasses.replace(x, bk=x.bk // 2) for x in first.dkv))
        undivided = _undivided_tiles(first.dq.dtype, first.dq.bd, family)
        built = {t.kernel for t in dq_variants(dtype, head_dim, family)} | {
            t.kernel for pair in dkv_variants(dtype, head_dim, family) for t in pair}
        same = [t for t in (halved, undivided) if {x.kernel for x in (t.dq, *t.dkv)} <= built]
    larger = (backward_tiles(dtype, bd, family) for bd in HEAD_DIM_BUCKETS if bd > first.dq.bd)
    return [first] + [t for t in (*same, *larger) if any(a < b for a, b in zip(needs(t), needs(first)))]


def backward_variants() -> list:
    """Every distinct tiled instantiation the table and the tuner can select."""
    seen = {}
    for family in FAMILIES:
        for dt in ("f32", "f16", "bf16"):
            for bd in HEAD_DIM_BUCKETS:
                dtype = {v: k for k, v in DTYPE_NAMES.items()}[dt]
                t = backward_tiles(dtype, bd, family)
                for x in (t.dq, *t.dkv, *dq_variants(dtype, bd, family),
                          *(y for pair in dkv_variants(dtype, bd, family) for y in pair)):
                    seen[x.kernel] = x
    return sorted(seen.values(), key=lambda t: (type(t).__name__, t.nax, t.dtype, t.bd, getattr(t, "mode", 0), t.bq,
                                                t.bk))
