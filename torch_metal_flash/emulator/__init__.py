"""The emulator: run unmodified Metal compute kernels on the CPU with GPU semantics.

    from torch_metal_flash import emulator
    lib = emulator.compile_shader(Path("kernels.metal"))
    stats = lib.my_kernel(x, y, grid=(n,), threadgroup=(256,))

Each GPU thread is a fiber; simdgroups of 32 lanes run independently and meet
at simd collectives, simdgroup-matrix operations and threadgroup barriers.
Checked mode (the default) instruments every load and store to count device
bytes exactly and to find out-of-bounds accesses and data races.
``with emulator.recording() as launches:`` collects the LaunchStats of every
launch in the block (the package's own plans included).  See
docs/emulator.md.  Importing this module has no side effects; the compiler is
looked for on first use.
"""
from .compiler import compile_seconds, find_compiler
from .config import MATH_MODES, default_checked, set_default_checked, settings
from .errors import (CompileError, CompilerNotFoundError, DataRaceError, DivergentBarrierError, EmulatorError,
                     KernelCrashError, KernelTimeoutError, LaunchError, MisalignedAccessError, OutOfBoundsError,
                     SimdgroupMatrixDivergenceError, ThreadgroupMemoryError)
from .library import KernelFunction, LaunchStats, Library, compile_shader
from .recorder import recording

__all__ = [
    "MATH_MODES", "CompileError", "CompilerNotFoundError", "DataRaceError", "DivergentBarrierError", "EmulatorError",
    "KernelCrashError", "KernelFunction", "KernelTimeoutError", "LaunchError", "LaunchStats", "Library",
    "MisalignedAccessError",
    "OutOfBoundsError", "SimdgroupMatrixDivergenceError", "ThreadgroupMemoryError", "compile_seconds",
    "compile_shader", "default_checked", "find_compiler", "recording", "set_default_checked", "settings",
]
