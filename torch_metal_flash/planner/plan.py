"""The seam between the planner and the backends.

A planner turns op arguments into a :class:`Plan`: an ordered list of kernel
launches, each fully described (shader file, kernel host name, function
constants, bound buffers, grid, threadgroup size).  A backend only executes
plans: the Metal backend encodes them on the MPS stream, the emulator runs the
same ``.metal`` sources on the CPU.  Nothing kernel-specific lives in a backend.

When the kernels do not cover a configuration, a planner returns an
:class:`Unsupported` with a human-readable reason instead of a plan.

Every tensor a launch binds is an argument of the op (or a view of one at the
same storage offset), an output the op allocated, or scratch the plan allocated
and lists in :attr:`Plan.scratch` (or a view of it).  That is what lets the C++
core replay a plan as a template (``csrc/core``): on a plan-cache hit it binds
the new call's arguments and outputs and allocates fresh scratch like the
plan's, without calling the planner.  A planner therefore never derives tensors from its inputs (``.to()``,
``.contiguous()``): the faces convert small vectors before calling the op, and
the planner returns :class:`Unsupported` for what it cannot bind as given.
"""
from __future__ import annotations

import dataclasses
from typing import Union

import torch

Bindable = Union[torch.Tensor, bytes]


@dataclasses.dataclass(frozen=True)
class Launch:
    """One ``dispatchThreadgroups`` of one kernel.

    Conventions both backends follow (the Metal launcher checks them):

    * ``function_constants`` values are typed by their Python type: ``bool`` ->
      ``constant bool``, ``int`` (32-bit) -> ``constant int``, ``float`` ->
      ``constant float``.
    * ``buffers`` indices run 0..30.  A tensor is bound at
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
    # Tensors the plan allocated for its own use (e.g. partial results), uninitialised:
    # fresh ones of the same shape, strides and dtype for every run; launches may bind views.
    scratch: tuple[torch.Tensor, ...] = ()


@dataclasses.dataclass(frozen=True)
class Unsupported:
    """Why the kernels cannot run a configuration (shown in the fallback warning)."""

    reason: str

    def __str__(self) -> str:
        return self.reason
