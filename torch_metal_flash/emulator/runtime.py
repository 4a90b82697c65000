"""ctypes mirror of csrc/emulator/mtl_abi.h and the loaded runtime library."""
from __future__ import annotations

import ctypes
import os
import subprocess
import threading
from typing import Optional

from ..caches import LRU

MTL_MAX_BUFFERS = 64
MTL_MAX_TG_PARAMS = 32
MTL_ABI_VERSION = 6
B_COUNT = 16


class ParamInfo(ctypes.Structure):
    _fields_ = [("is_pointer", ctypes.c_int32), ("is_reference", ctypes.c_int32), ("type_code", ctypes.c_int32),
                ("size", ctypes.c_int32), ("is_const", ctypes.c_int32)]


class Binding(ctypes.Structure):
    _fields_ = [("host", ctypes.c_void_p), ("nbytes", ctypes.c_uint64), ("index", ctypes.c_int32),
                ("writable", ctypes.c_int32)]


class Stats(ctypes.Structure):
    _fields_ = [("buf_read", ctypes.c_uint64 * MTL_MAX_BUFFERS), ("buf_written", ctypes.c_uint64 * MTL_MAX_BUFFERS),
                ("device_read", ctypes.c_uint64), ("device_written", ctypes.c_uint64),
                ("tg_read", ctypes.c_uint64), ("tg_written", ctypes.c_uint64), ("tg_peak", ctypes.c_uint64),
                ("barriers", ctypes.c_uint64), ("simd_collectives", ctypes.c_uint64),
                ("simd_barriers", ctypes.c_uint64), ("mma", ctypes.c_uint64), ("atomics", ctypes.c_uint64),
                ("switches", ctypes.c_uint64), ("threadgroups", ctypes.c_uint64), ("threads", ctypes.c_uint64),
                ("loads", ctypes.c_uint64), ("stores", ctypes.c_uint64), ("tensor_matmuls", ctypes.c_uint64),
                ("tensor_macs", ctypes.c_uint64)]


class Error(ctypes.Structure):
    _fields_ = [("code", ctypes.c_int32), ("msg", ctypes.c_char * 2048), ("tg", ctypes.c_uint32 * 3),
                ("thread_pos", ctypes.c_uint32 * 3), ("has_thread", ctypes.c_int32), ("pc_offset", ctypes.c_uint64),
                ("pc2_offset", ctypes.c_uint64), ("file", ctypes.c_char * 512), ("line", ctypes.c_int32),
                ("buffer", ctypes.c_int32)]


class Launch(ctypes.Structure):
    _fields_ = [("entry", ctypes.c_void_p), ("grid", ctypes.c_uint32 * 3), ("tg", ctypes.c_uint32 * 3),
                ("order", ctypes.c_int32), ("checked", ctypes.c_int32), ("seed", ctypes.c_uint64),
                ("timeout_s", ctypes.c_double), ("nbind", ctypes.c_int32), ("binds", ctypes.POINTER(Binding)),
                ("tg_param_bytes", ctypes.c_uint64 * MTL_MAX_TG_PARAMS), ("max_workers", ctypes.c_int32),
                ("stats", ctypes.POINTER(Stats)), ("err", ctypes.POINTER(Error)), ("tensor_layout", ctypes.c_int32)]


# cooperative-tensor layouts of tensor ops (MtlTensorLayout)
LAYOUT_APPLE10, LAYOUT_APPLE8 = 0, 1


E_OK, E_GENERIC, E_DIVERGENT_BARRIER, E_MMA_DIVERGENCE, E_OUT_OF_BOUNDS, E_TG_MEMORY, E_RACE, E_TIMEOUT, \
    E_CRASH, E_BAD_LAUNCH, E_FPE, E_COLLECTIVE, E_MISALIGNED, E_UNBOUND = range(14)

_rt = None
_rt_lock = threading.Lock()


def runtime_library():
    """The runtime shared library, loaded once with RTLD_GLOBAL so kernel
    libraries resolve the SanitizerCoverage callbacks and __mtl_rt_* to it."""
    global _rt
    if _rt is not None:
        return _rt
    with _rt_lock:
        if _rt is None:
            from .compiler import build_runtime, find_compiler
            path = build_runtime(find_compiler())
            lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
            lib.mtl_launch.argtypes = [ctypes.POINTER(Launch)]
            lib.mtl_launch.restype = ctypes.c_int
            lib.mtl_abi_version.restype = ctypes.c_int
            if lib.mtl_abi_version() != MTL_ABI_VERSION:
                raise RuntimeError("emulator runtime ABI mismatch; clear the emulator cache")
            _rt = lib
    return _rt


_sym_cache = LRU("emulator.symbols", 1024)


def symbolize(lib_path: str, offset: int, symbolizer: Optional[str]) -> Optional[tuple]:
    """(file, line) of a code offset in a kernel library, skipping frames inside
    the emulator's own headers (so errors point at the kernel's line)."""
    if not offset or not symbolizer:
        return None
    key = (lib_path, offset)
    if key in _sym_cache:
        return _sym_cache.get(key)
    addr = hex(max(offset - 1, 0))
    try:
        if os.path.basename(symbolizer).startswith("addr2line"):
            out = subprocess.run([symbolizer, "-i", "-e", lib_path, addr], capture_output=True, text=True,
                                 timeout=30).stdout
            frames = [ln.strip() for ln in out.splitlines() if ln.strip()]
        else:
            out = subprocess.run([symbolizer, "--inlining", f"--obj={lib_path}", addr], capture_output=True,
                                 text=True, timeout=30).stdout
            frames = [ln.strip() for i, ln in enumerate(out.splitlines()) if ln.strip() and i % 2 == 1]
    except (OSError, subprocess.SubprocessError):
        return None
    result = None
    for fr in frames:
        parts = fr.rsplit(":", 2)
        if len(parts) < 2:
            continue
        if len(parts) == 3 and parts[1].isdigit():
            file, line = parts[0], int(parts[1])
        elif parts[-1].isdigit():
            file, line = ":".join(parts[:-1]), int(parts[-1])
        else:
            continue
        if file.startswith("??") or line == 0:
            continue
        base = os.path.basename(file)
        if base.startswith("mtl_") or base == "<emulator glue>":
            if result is None:
                result = (file, line)
            continue
        result = (file, line)
        break
    _sym_cache.put(key, result)
    return result
