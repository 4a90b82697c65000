"""The forward tile table: tile sizes per head-dim bucket, dtype and GPU family.

Each entry is a template instantiation of ``shaders/flash_fwd.metal`` named
``flash_fwd_<dtype>_d<BD>_q<BQ>_k<BK>``:

* ``BD``  head-dim tile width (the bucket; head dims up to BD run on it, the
  tail is zero-padded),
* ``BQ``  query rows per threadgroup (8 per simdgroup, so ``BQ / 8``
  simdgroups and ``4 * BQ`` threads),
* ``BK``  key rows per step (K and V tiles of ``BK x (BD + pad)`` elements in
  threadgroup memory),
* ``_s``  (``shared_kv``) K and V take turns in one tile buffer: half the
  threadgroup memory for two more barriers per step, used to keep 32 keys
  per step at large head dims and in float32.
* ``_ds<DS>`` (``ds``, the buckets 384 and 512) the head dim split over ``DS``
  simdgroups per 8 query rows (``DS * BQ / 8`` simdgroups), each holding
  ``BD / DS`` columns of Q and O: a quarter of the undivided kernel's registers
  for ``DS * 8 * BK`` floats of partial scores per 8 rows in threadgroup memory
  and one more barrier per step.  The default at those buckets; the undivided
  tiles stay among the variants.

On GPUs with neural accelerators (family apple10, where the launcher enables
them) half/bfloat problems run ``shaders/flash_fwd_nax.metal`` instead,
``flash_fwd_nax_<dtype>_d<BD>_q<BQ>_k<BK>``: the same algorithm with 16x16
accelerator fragments, 16 query rows per simdgroup (``BQ / 16`` simdgroups),
head-dim buckets that are multiples of 32 and 32 or 64 keys per step
(:data:`NAX_TILES`).  The simdgroup tiles stay among the tuner's variants there.

The family tables are the defaults of an untuned machine (their sources:
docs/tuning.md); the table of apple7/apple8 keeps threadgroup memory under
~18 KiB (so at least one more threadgroup fits next to it in 32 KiB) up to head
dim 256; the head-dim splits of 384 and 512 take up to ~25 KiB for registers.  The
tuner (:mod:`torch_metal_flash.tuning`) chooses among :func:`tile_variants`:
the family tables' tiles plus :data:`EXTRA_TILES`.  Tiles of the apple8 table
are instantiated in ``shaders/flash_fwd.metal``, all others in
``shaders/flash_fwd_variants.metal`` (the same template; a separate file, so
that the common kernels' library does not grow with the tuning space).  A new
entry needs a matching ``FLASH_FWD_INSTANTIATE`` line there (a test checks).
"""
from __future__ import annotations

import dataclasses

import torch

HEAD_DIM_BUCKETS = (32, 64, 80, 96, 128, 160, 192, 256, 384, 512)
MAX_HEAD_DIM = HEAD_DIM_BUCKETS[-1]
FAMILIES = ("apple7", "apple8", "apple9", "apple10")  # M1, M2, M3/M4, M5
SOURCE = "flash_fwd.metal"
VARIANTS_SOURCE = "flash_fwd_variants.metal"
NAX_SOURCE = "flash_fwd_nax.metal"
NAX_FAMILY = "apple10"

DTYPE_NAMES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
_ELEM_SIZE = {"f32": 4, "f16": 2, "bf16": 2}


@dataclasses.dataclass(frozen=True)
class ForwardTile:
    dtype: str  # "f32" | "f16" | "bf16"
    bd: int
    bq: int
    bk: int
    shared_kv: bool = False
    ds: int = 1  # simdgroups that share 8 query rows, each holding a slice of the head dim
    nax: bool = False  # the neural-accelerator kernel (16 rows per simdgroup)
    direct: bool = False  # (nax) K/V fragments read from device memory, no threadgroup tiles

    @property
    def rows_per_simdgroup(self) -> int:
        return 16 if self.nax else 8

    @property
    def simdgroups(self) -> int:
        return self.bq // self.rows_per_simdgroup * self.ds

    @property
    def threads(self) -> int:
        return 32 * self.simdgroups

    @property
    def kernel(self) -> str:
        return (f"flash_fwd_{'nax_' if self.nax else ''}{self.dtype}_d{self.bd}_q{self.bq}_k{self.bk}"
                f"{'_s' if self.shared_kv else ''}{'_r' if self.direct else ''}"
                f"{f'_ds{self.ds}' if self.ds > 1 else ''}")

    @property
    def source(self) -> str:
        """The shader file that instantiates this tile."""
        if self.nax:
            return NAX_SOURCE
        return SOURCE if self.kernel in _PRIMARY else VARIANTS_SOURCE

    @property
    def row_pad(self) -> int:
        """Elements of padding per threadgroup tile row (16 bytes)."""
        return 16 // _ELEM_SIZE[self.dtype]

    @property
    def threadgroup_memory(self) -> int:
        """Bytes of threadgroup memory per threadgroup (K and V tiles and a split's partial
        scores; a direct tile's 16-byte placeholder)."""
        if self.direct:
            return 16
        tiles = 1 if self.shared_kv else 2
        partials = self.simdgroups * 8 * self.bk * 4 if self.ds > 1 else 0
        return tiles * self.bk * (self.bd + self.row_pad) * _ELEM_SIZE[self.dtype] + partials


def score_slices(bd: int) -> int:
    """The slices of the head dim whose score chains every kernel of bucket ``bd`` adds in order
    (``flash::ScoreSlices`` of flash_frag.h), so the backward rebuilds the forward's scores bit for
    bit; a head-dim split gives each its own simdgroup."""
    return 4 if bd > 256 else 1


# (dtype, bucket) -> (BQ, BK, shared_kv[, ds]): the package's starting point (not measured).  The wide
# buckets split the head dim, which keeps a simdgroup's Q and O at d96 / d128's size.
_BASE = {
    "f32": {32: (32, 32, False), 64: (32, 32, False), 80: (32, 32, True), 96: (32, 32, True),
            128: (32, 32, True), 160: (32, 16, True), 192: (32, 16, True), 256: (32, 16, True),
            384: (32, 8, True, 4), 512: (32, 8, True, 4)},
    "f16": {32: (32, 64, False), 64: (32, 64, False), 80: (32, 32, False), 96: (32, 32, False),
            128: (32, 32, False), 160: (32, 32, True), 192: (32, 32, True), 256: (32, 32, True),
            384: (32, 16, True, 4), 512: (32, 16, True, 4)},
}
_BASE["bf16"] = dict(_BASE["f16"])
# MLX's steel attention block choice for half/bfloat (32 query rows, 32 keys per step below
# head dim 128, 16 from 128), where it is one of our tiles; float32 keeps the base table.
_MLX = {"f32": dict(_BASE["f32"]),
        "f16": {**_BASE["f16"], 64: (32, 32, False), 128: (32, 16, False), 160: (32, 16, False),
                192: (32, 16, False), 256: (32, 16, False)}}
_MLX["bf16"] = dict(_MLX["f16"])
# MLX's blocks where its neural-accelerator path runs (GPU generation 17, M5): 64 query rows,
# 32 keys per step, at the head dims it takes that path for (K/V share a buffer at 256 to fit).
_MLX_NAX = {"f32": dict(_BASE["f32"]),
            "f16": {**_MLX["f16"], 64: (64, 32, False), 96: (64, 32, False), 128: (64, 32, False),
                    256: (64, 32, True)}}
_MLX_NAX["bf16"] = dict(_MLX_NAX["f16"])

FORWARD_TILES: dict[str, dict[str, dict[int, tuple[int, int, bool]]]] = {
    "apple7": _BASE, "apple8": _BASE, "apple9": _MLX, "apple10": _MLX_NAX,
}
_PRIMARY = {ForwardTile(dt, bd, *row).kernel for dt, rows in _BASE.items() for bd, row in rows.items()}

# Further tiles the tuner times, per (dtype, bucket >= 64): 64 query rows per threadgroup (each
# K/V tile feeds 8 simdgroups: half the K/V reads per query row), 16 (more threadgroups for
# short problems), or another key-block size.  Each stays within 32 KiB of threadgroup memory.
# The wide buckets (384, 512) add the undivided tiles (head-dim-wide accumulators per simdgroup, as
# every other bucket) and a split with 16 query rows (half the threads).
EXTRA_TILES: dict[str, dict[int, list[tuple[int, int, bool]]]] = {
    "f32": {64: [(64, 32, False)], 80: [(64, 32, True)], 96: [(64, 32, True)], 128: [(64, 32, True)],
            160: [(64, 16, True)], 192: [(64, 16, True)], 256: [(64, 16, True)],
            384: [(32, 8, True), (64, 8, True), (16, 8, True), (16, 8, True, 4)],
            512: [(32, 8, True), (64, 8, True), (16, 8, True), (16, 8, True, 4)]},
    "f16": {64: [(64, 32, False)], 80: [(64, 32, False), (16, 32, False)], 96: [(64, 32, False), (16, 32, False)],
            128: [(64, 32, False)], 160: [(64, 32, True)], 192: [(64, 32, True)], 256: [(64, 32, True)],
            384: [(32, 16, True), (64, 16, True), (16, 16, True), (16, 16, True, 4)],
            512: [(32, 16, True), (64, 16, True), (16, 16, True), (16, 16, True, 4)]},
}
EXTRA_TILES["bf16"] = {bd: list(rows) for bd, rows in EXTRA_TILES["f16"].items()}

# The neural-accelerator tiles of apple10 per (dtype, bucket), its default first: 64 query rows
# (4 simdgroups of 16) and 32 keys per step as MLX's accelerator attention runs, K/V sharing a
# buffer from head dim 160 (to stay near 17 KiB); variants with 32 or 128 rows, or 64 keys, and
# the direct one (`_r`: every simdgroup reads its K/V fragments from device memory, no tiles and
# no barriers, as MLX's kernel does: the caches share the block instead).
# Float32 and the buckets 80, 384 and 512 keep the simdgroup kernels (the multiplies take 32
# head-dim columns at a time; 384+ wide accumulators of 16 rows do not fit the registers).
_NAX_TILED = {32: [(64, 32, False), (64, 64, False)],
              64: [(64, 32, False), (32, 32, False), (128, 32, False), (64, 64, False)],
              96: [(64, 32, False), (32, 32, False), (128, 32, False)],
              128: [(64, 32, False), (32, 32, False), (128, 32, False)],
              160: [(64, 32, True), (32, 32, True)],
              192: [(64, 32, True), (32, 32, True)],
              256: [(64, 32, True), (32, 32, True)]}
# (BQ, BK, shared_kv, direct): the tiled ones, then the direct one
_NAX_ROWS = {bd: [(*row, False) for row in rows] + [(64, 32, False, True)] for bd, rows in _NAX_TILED.items()}
NAX_TILES: dict[str, dict[int, list[tuple[int, int, bool, bool]]]] = {"f16": _NAX_ROWS, "bf16": _NAX_ROWS}


def head_dim_bucket(head_dim: int) -> int | None:
    for bd in HEAD_DIM_BUCKETS:
        if head_dim <= bd:
            return bd
    return None


def table_family(family: str) -> str:
    """The tile-table family for a Metal GPU family name (``gpu_family()`` of
    the launcher): newer Apple families use the newest table; families without
    simdgroup matrices (before Apple7, Intel/AMD ``mac2``) raise ValueError."""
    family = (family or "").strip().lower()
    if family in FAMILIES:
        return family
    if family.startswith("apple") and family[5:].isdigit():
        n = int(family[5:])
        if n > int(FAMILIES[-1][5:]):
            return FAMILIES[-1]
        raise ValueError(f"GPU family {family} has no simdgroup-matrix support (Apple7 / M1 or newer needed)")
    raise ValueError(f"GPU family {family!r} is not supported by the kernels (Apple7 / M1 or newer needed)")


def _nax_tiles(dt: str, bd: int, family: str) -> list[ForwardTile]:
    """The neural-accelerator tiles of ``family`` for (dtype name, bucket), default first."""
    if table_family(family) != NAX_FAMILY:
        return []
    return [ForwardTile(dt, bd, bq, bk, shared, nax=True, direct=direct)
            for bq, bk, shared, direct in NAX_TILES.get(dt, {}).get(bd, ())]


def forward_tile(dtype: torch.dtype, head_dim: int, family: str = "apple8", nax: bool = True) -> ForwardTile:
    """The tile for ``dtype`` and ``head_dim`` (max of D and Dv); raises KeyError/ValueError.
    ``nax=False``: the simdgroup kernel's even where the family has neural accelerators."""
    dt = DTYPE_NAMES[dtype]
    bd = head_dim_bucket(head_dim)
    if bd is None:
        raise ValueError(f"head dim {head_dim} > {MAX_HEAD_DIM}")
    accel = _nax_tiles(dt, bd, family) if nax else []
    if accel:
        return accel[0]
    return ForwardTile(dt, bd, *FORWARD_TILES[table_family(family)][dt][bd])


def tile_variants(dtype: torch.dtype, head_dim: int, family: str = "apple8") -> list[ForwardTile]:
    """Every tile the tuner may choose for ``dtype`` and ``head_dim``: the family's
    default first, then its other neural-accelerator tiles (apple10), the families'
    simdgroup tables and :data:`EXTRA_TILES`."""
    first = forward_tile(dtype, head_dim, family)
    seen = {first.kernel: first}
    for t in _nax_tiles(first.dtype, first.bd, family):
        seen.setdefault(t.kernel, t)
    for table in FORWARD_TILES.values():
        t = ForwardTile(first.dtype, first.bd, *table[first.dtype][first.bd])
        seen.setdefault(t.kernel, t)
    for row in EXTRA_TILES[first.dtype].get(first.bd, ()):
        t = ForwardTile(first.dtype, first.bd, *row)
        seen.setdefault(t.kernel, t)
    return list(seen.values())


def forward_candidates(dtype: torch.dtype, head_dim: int, family: str = "apple8",
                       variant: str | None = None, nax: bool = True) -> list[ForwardTile]:
    """The tiles the planner may use for ``head_dim``, preferred first: ``variant``
    (a kernel name of :func:`tile_variants`) or the table's, then (after a head-dim
    split) the bucket's tiles with fewer threads, then those of larger
    buckets (head dim zero-padded) that need fewer threads or less threadgroup
    memory, for pipelines whose limits the first exceeds.  ``nax=False`` (a feature
    the accelerator kernel lacks): simdgroup tiles only, a forced accelerator
    variant replaced by the family's simdgroup tile."""
    first = forward_tile(dtype, head_dim, family, nax)
    if variant is not None:
        forced = next(t for t in tile_variants(dtype, head_dim, family) if t.kernel == variant)
        first = forced if nax or not forced.nax else first
    # A head-dim split needs 4x the threads of the bucket's other tiles (and the widest bucket has no
    # larger one): the same bucket's tiles with fewer threads come next, splits first.
    same = [t for t in tile_variants(dtype, head_dim, family)
            if first.ds > 1 and not t.nax and t.threads < first.threads]
    larger = (forward_tile(dtype, bd, family, nax) for bd in HEAD_DIM_BUCKETS if bd > first.bd)
    return [first] + sorted(same, key=lambda t: -t.ds) + [
        t for t in larger if t.threads < first.threads or t.threadgroup_memory < first.threadgroup_memory]


def forward_variants() -> list[ForwardTile]:
    """Every distinct instantiation the tables and the tuner can select."""
    seen = {}
    for dtype, dt in DTYPE_NAMES.items():
        for bd in HEAD_DIM_BUCKETS:
            for family in FAMILIES:
                for t in tile_variants(dtype, bd, family):
                    seen[t.kernel] = t
    return sorted(seen.values(), key=lambda t: (t.nax, t.dtype, t.bd, t.bq, t.bk, t.shared_kv, t.ds, t.direct))
