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

The values are starting points sized to keep threadgroup memory under ~18 KiB
(so at least one more threadgroup fits next to it in 32 KiB); they are meant
to be tuned on Macs per family.  A new entry needs a matching
``FLASH_FWD_INSTANTIATE`` line in the shader (a test checks).
"""
from __future__ import annotations

import dataclasses

import torch

HEAD_DIM_BUCKETS = (32, 64, 80, 96, 128, 160, 192, 256)
MAX_HEAD_DIM = HEAD_DIM_BUCKETS[-1]
FAMILIES = ("apple7", "apple8", "apple9")  # M1, M2, M3/M4

DTYPE_NAMES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
_ELEM_SIZE = {"f32": 4, "f16": 2, "bf16": 2}


@dataclasses.dataclass(frozen=True)
class ForwardTile:
    dtype: str  # "f32" | "f16" | "bf16"
    bd: int
    bq: int
    bk: int
    shared_kv: bool = False

    @property
    def simdgroups(self) -> int:
        return self.bq // 8

    @property
    def threads(self) -> int:
        return 32 * self.simdgroups

    @property
    def kernel(self) -> str:
        return f"flash_fwd_{self.dtype}_d{self.bd}_q{self.bq}_k{self.bk}{'_s' if self.shared_kv else ''}"

    @property
    def row_pad(self) -> int:
        """Elements of padding per threadgroup tile row (16 bytes)."""
        return 16 // _ELEM_SIZE[self.dtype]

    @property
    def threadgroup_memory(self) -> int:
        """Bytes of threadgroup memory per threadgroup (K and V tiles)."""
        tiles = 1 if self.shared_kv else 2
        return tiles * self.bk * (self.bd + self.row_pad) * _ELEM_SIZE[self.dtype]


# (dtype, bucket) -> (BQ, BK, shared_kv); the same for every family until tuned
# on hardware.
_BASE = {
    "f32": {32: (32, 32, False), 64: (32, 32, False), 80: (32, 32, True), 96: (32, 32, True),
            128: (32, 32, True), 160: (32, 16, True), 192: (32, 16, True), 256: (32, 16, True)},
    "f16": {32: (32, 64, False), 64: (32, 64, False), 80: (32, 32, False), 96: (32, 32, False),
            128: (32, 32, False), 160: (32, 32, True), 192: (32, 32, True), 256: (32, 32, True)},
}
_BASE["bf16"] = dict(_BASE["f16"])

FORWARD_TILES: dict[str, dict[str, dict[int, tuple[int, int, bool]]]] = {
    family: {dt: dict(rows) for dt, rows in _BASE.items()} for family in FAMILIES
}


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


def forward_tile(dtype: torch.dtype, head_dim: int, family: str = "apple8") -> ForwardTile:
    """The tile for ``dtype`` and ``head_dim`` (max of D and Dv); raises KeyError/ValueError."""
    dt = DTYPE_NAMES[dtype]
    bd = head_dim_bucket(head_dim)
    if bd is None:
        raise ValueError(f"head dim {head_dim} > {MAX_HEAD_DIM}")
    table = FORWARD_TILES[table_family(family)]
    bq, bk, shared = table[dt][bd]
    return ForwardTile(dt, bd, bq, bk, shared)


def forward_candidates(dtype: torch.dtype, head_dim: int, family: str = "apple8") -> list[ForwardTile]:
    """The tiles the planner may use for ``head_dim``, preferred first: the table's,
    then those of larger buckets (head dim zero-padded) that need fewer threads or
    less threadgroup memory, for pipelines whose limits the first exceeds."""
    first = forward_tile(dtype, head_dim, family)
    larger = (forward_tile(dtype, bd, family) for bd in HEAD_DIM_BUCKETS if bd > first.bd)
    return [first] + [t for t in larger
                      if t.threads < first.threads or t.threadgroup_memory < first.threadgroup_memory]


def forward_variants() -> list[ForwardTile]:
    """Every distinct instantiation the table can select."""
    seen = {}
    for table in FORWARD_TILES.values():
        for dt, rows in table.items():
            for bd, (bq, bk, shared) in rows.items():
                t = ForwardTile(dt, bd, bq, bk, shared)
                seen[t.kernel] = t
    return sorted(seen.values(), key=lambda t: (t.dtype, t.bd))
