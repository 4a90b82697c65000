"""The seam between the planner and the backends.

A planner turns op arguments into a :class:`Plan`: an ordered list of kernel
launches, each fully described (shader file, kernel host name, function
constants, bound buffers, grid, threadgroup size).  A backend only executes
plans: the Metal backend encodes them on the MPS stream, the emulator runs the
same ``.metal`` sources on the CPU.  Nothing kernel-specific lives in a backend.

When the kernels do not cover a configuration, a planner returns an
:class:`Unsupported` with a human-readable reason instead of a plan.

Every tensor a launch binds is an argument of the op (or a view of one at the
same storage offset), an output the op allocated, or a :class:`Scratch` buffer
the plan asks for.  That is what lets the C++ core replay a plan as a template
(``csrc/core``): on a plan-cache hit it binds the new call's arguments and
outputs and allocates fresh scratch, without calling the planner.  A planner
therefore never derives tensors (``.to()``, ``.contiguous()``, ``torch.full``):
the faces convert small vectors before calling the op, and the planner returns
:class:`Unsupported` for what it cannot bind as given.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch


@dataclasses.dataclass(frozen=True, eq=False)
class Scratch:
    """A device buffer a plan uses internally, allocated for every run (left
    uninitialised, or filled with ``fill``).  The same object bound in several
    launches of a plan is one buffer."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    fill: Optional[Union[int, float]] = None

    def allocate(self) -> torch.Tensor:
        if self.fill is None:
            return torch.empty(self.shape, dtype=self.dtype, device=self.device)
        return torch.full(self.shape, self.fill, dtype=self.dtype, device=self.device)


Bindable = Union[torch.Tensor, Scratch, bytes]


@dataclasses.dataclass(frozen=True)
class Launch:
    """One ``dispatchThreadgroups`` of one kernel.

    Conventions both backends follow (the Metal launcher checks them):

    * ``function_constants`` values are typed by their Python type: ``bool`` ->
      ``constant bool``, ``int`` (32-bit) -> ``constant int``, ``float`` ->
      ``constant float``.
    * ``buffers`` indices run 0..30.  A tensor (or :class:`Scratch`) is bound at
      ``storage_offset * element_size`` of its storage; declare it as a ``device``
      pointer (macOS wants 256-byte aligned offsets for ``constant`` buffers).
      ``bytes`` (1..4096 of them, e.g. a packed params struct) are bound by value.
    * ``threadgroup_memory`` lengths are rounded up to a multiple of 16 bytes.
    * Threads per threadgroup must not exceed the pipeline's limit, nor
      threadgroup memory the device's (32 KiB): planners check both against
      ``backend.pipeline_info`` before a plan runs (``planner/limits.py``), and
      both backends raise at launch otherwise.
    """

    source: str  # shader file name under shaders/, e.g. "flash_fwd.metal"
    kernel: str  # [[host_name]] of the instantiation
    threadgroups: tuple[int, int, int]  # threadgroups per grid
    threadgroup: tuple[int, int, int]  # threads per threadgroup
    # [[buffer(i)]] -> tensor (bound at storage_offset * element_size) or packed bytes
    buffers: dict[int, Bindable]
    # [[function_constant(i)]] -> value
    function_constants: dict[int, Union[bool, int, float]] = dataclasses.field(default_factory=dict)
    # [[threadgroup(i)]] -> bytes of dynamically sized threadgroup memory
    threadgroup_memory: dict[int, int] = dataclasses.field(default_factory=dict)

    @property
    def grid_threads(self) -> tuple[int, int, int]:
        """The grid in threads (dispatchThreads convention)."""
        return tuple(g * t for g, t in zip(self.threadgroups, self.threadgroup))


@dataclasses.dataclass(frozen=True)
class Plan:
    launches: tuple[Launch, ...]

    def bound_launches(self) -> list[Launch]:
        """The launches with each :class:`Scratch` replaced by a tensor allocated
        for this run (one per Scratch object), for backends that run a plan as is."""
        scratch: dict = {}
        out = []
        for launch in self.launches:
            buffers = dict(launch.buffers)
            for index, b in buffers.items():
                if isinstance(b, Scratch):
                    if b not in scratch:
                        scratch[b] = b.allocate()
                    buffers[index] = scratch[b]
            out.append(dataclasses.replace(launch, buffers=buffers))
        return out


@dataclasses.dataclass(frozen=True)
class Unsupported:
    """Why the kernels cannot run a configuration (shown in the fallback warning)."""

    reason: str

    def __str__(self) -> str:
        return self.reason
