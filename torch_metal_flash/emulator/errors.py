"""The emulator's exceptions.  Every error raised while running a kernel names
the kernel, the source file and line (of the original .metal, when known),
and the threadgroup and thread."""
from __future__ import annotations

from typing import Optional


class EmulatorError(RuntimeError):
    """Base class of everything the emulator raises."""

    def __init__(self, message: str, *, kernel: Optional[str] = None, file: Optional[str] = None,
                 line: Optional[int] = None, threadgroup: Optional[tuple] = None, thread: Optional[tuple] = None,
                 buffer: Optional[int] = None):
        super().__init__(message)
        self.kernel = kernel
        self.file = file
        self.line = line
        self.threadgroup = threadgroup
        self.thread = thread
        self.buffer = buffer


class CompilerNotFoundError(EmulatorError):
    """No usable clang (>= 17) was found."""


class CompileError(EmulatorError):
    """The kernel source does not compile, as Metal's compiler would refuse it:
    the message names the original file:line and the MSL rule (`rule`, a short
    id such as "address-space", "recursion", "host-header"; "c++" for plain
    C++ errors), then clang's diagnostics."""

    def __init__(self, message: str, *, rule: Optional[str] = None, **kw):
        super().__init__(message, **kw)
        self.rule = rule


class LaunchError(EmulatorError):
    """Bad launch arguments (grid, threadgroup size, unbound buffers ...)."""


class DivergentBarrierError(EmulatorError):
    """Threads of one threadgroup wait at different threadgroup_barrier calls."""


class SimdgroupMatrixDivergenceError(EmulatorError):
    """A simdgroup-matrix operation executed by fewer than all 32 lanes."""


class OutOfBoundsError(EmulatorError):
    """A device (or threadgroup) memory access outside the bound buffer."""


class ThreadgroupMemoryError(EmulatorError):
    """More than 32 KiB of threadgroup memory in one threadgroup."""


class MisalignedAccessError(EmulatorError):
    """An access of a (vector) type at an address that is not a multiple of its
    alignment: x86 tolerates it, Apple GPUs do not (checked mode)."""


class DataRaceError(EmulatorError):
    """Two unordered accesses to the same memory, at least one a write."""


class KernelTimeoutError(EmulatorError):
    """The kernel did not finish in time (infinite loop or spinning on other threads)."""


class KernelCrashError(EmulatorError):
    """The kernel code faulted (stack overflow, arithmetic fault, trap)."""
