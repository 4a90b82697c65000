"""Every pipeline the planners can emit: (shader file, kernel, function constants).

Kernels come from the tile tables, function constants from each planner's
``function_constants()`` over every value in its ``FEATURE_VALUES``, so this
list follows the planners as they change (a test plans random problems and
checks each launch is listed).  ``python -m torch_metal_flash doctor``
compiles them on the machine at hand.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Iterator

import torch_metal_flash.planner.backward as backward
import torch_metal_flash.planner.decode as decode
import torch_metal_flash.planner.forward as forward
import torch_metal_flash.planner.kvcache as kvcache
import torch_metal_flash.planner.tiles as tiles
import torch_metal_flash.planner.backward_tiles as backward_tiles_module
from .backward_tiles import DSINKS_KERNEL, DSINKS_THREADS, PRE_THREADS, backward_tiles, backward_variants
from .tiles import DTYPE_NAMES, forward_variants


@dataclasses.dataclass(frozen=True)
class Variant:
    source: str
    kernel: str
    function_constants: tuple  # sorted (index, value) pairs

    @property
    def constants(self) -> dict:
        return dict(self.function_constants)


def kernels() -> dict[str, dict[str, int]]:
    """Shader file -> {kernel its planner can launch: the most threads per threadgroup it plans}
    (the tuning variants' files included)."""
    dtypes = list(DTYPE_NAMES)
    out = {forward.SOURCE: {}, backward.SOURCE: {backward_tiles(dt, 32).pre_kernel: PRE_THREADS for dt in dtypes},
           decode.SOURCE: {}}
    for t in forward_variants():
        out.setdefault(t.source, {})[t.kernel] = t.threads
    for t in backward_variants():
        out.setdefault(t.source, {})[t.kernel] = t.threads
    out[backward.SOURCE][DSINKS_KERNEL] = DSINKS_THREADS
    for t in decode.decode_variants():
        out.setdefault(t.source, {})[t.kernel] = 32 * decode.row_cap(t.bd) // 8
    out[decode.SOURCE].update({decode.combine_kernel(DTYPE_NAMES[dt]): 32 * decode.COMBINE_ROWS for dt in dtypes})
    out[kvcache.SOURCE] = {kernel: kvcache.MAX_THREADS for kernel in kvcache.append_kernels()}
    return out


def planned_threads() -> dict[str, int]:
    """Kernel -> the most threads per threadgroup its planner launches it with."""
    return {kernel: threads for group in kernels().values() for kernel, threads in group.items()}


_PLANNERS = {forward.SOURCE: forward, backward.SOURCE: backward, decode.SOURCE: decode, kvcache.SOURCE: kvcache,
             tiles.VARIANTS_SOURCE: forward, backward_tiles_module.VARIANTS_SOURCE: backward,
             tiles.NAX_SOURCE: forward, backward_tiles_module.NAX_SOURCE: backward,
             decode.VARIANTS_SOURCE: decode}


def _constant_sets(module) -> list[tuple]:
    """Every distinct function-constant assignment ``module`` can emit, in a fixed order."""
    names = list(module.FEATURE_VALUES)
    seen = {}
    for values in itertools.product(*module.FEATURE_VALUES.values()):
        constants = tuple(sorted(module.function_constants(**dict(zip(names, values))).items()))
        seen.setdefault(constants, None)
    return list(seen)


def all_variants() -> Iterator[Variant]:
    """Every (source, kernel, constants) the planners can emit (tens of thousands)."""
    for source, names in kernels().items():
        sets = _constant_sets(_PLANNERS[source])
        for kernel in names:
            for constants in sets:
                yield Variant(source, kernel, constants)


def covering_variants() -> list[Variant]:
    """Every kernel, each with enough constant assignments that every feature
    takes each of its values at least once; assignments are staggered per kernel
    so that, across kernels, many combinations of features meet."""
    out = []
    for source, names in kernels().items():
        module = _PLANNERS[source]
        domains = list(module.FEATURE_VALUES.items())
        rows = max(len(values) for _, values in domains)
        for i, kernel in enumerate(names):
            seen = set()
            for r in range(rows):
                features = {name: values[(r + i * (f + 1)) % len(values)]
                            for f, (name, values) in enumerate(domains)}
                constants = tuple(sorted(module.function_constants(**features).items()))
                if constants not in seen:
                    seen.add(constants)
                    out.append(Variant(source, kernel, constants))
    return out
