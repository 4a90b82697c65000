"""compile_shader() and the kernel objects it returns."""
from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import hashlib
import re
import threading
import time
from pathlib import Path
from typing import Optional, Union

from ..caches import LRU
import torch_metal_flash.emulator.compiler as compiler
import torch_metal_flash.emulator.config as config
import torch_metal_flash.emulator.prepass as prepass
import torch_metal_flash.emulator.recorder as recorder
import torch_metal_flash.emulator.rules as rules
from .binding import bind_arguments
from .compiler import find_compiler, preprocess
from .errors import (CompileError, DataRaceError, DivergentBarrierError, EmulatorError, KernelCrashError,
                     KernelTimeoutError, LaunchError, MisalignedAccessError, OutOfBoundsError,
                     SimdgroupMatrixDivergenceError, ThreadgroupMemoryError)
import torch_metal_flash.emulator.runtime as rt


@dataclasses.dataclass
class LaunchStats:
    """What one launch did.  Byte counts are exact in checked mode and None in fast mode."""

    kernel: str
    grid: tuple
    threadgroup: tuple
    threadgroups: int
    threads: int
    checked: bool
    order: str
    device_bytes_read: Optional[int]
    device_bytes_written: Optional[int]
    bytes_read: Optional[dict]  # {buffer index: bytes}
    bytes_written: Optional[dict]
    threadgroup_bytes_read: Optional[int]
    threadgroup_bytes_written: Optional[int]
    threadgroup_memory: int  # peak bytes of threadgroup memory per threadgroup
    barriers: int  # completed threadgroup barriers, summed over threadgroups
    simd_collectives: int  # completed simd collectives, summed over simdgroups
    simdgroup_barriers: int
    simdgroup_matrix_multiplies: int  # 8x8 multiplies, summed over simdgroups
    tensor_matmuls: int  # tensor-op matmul2d runs (Metal 4), summed over simdgroups
    tensor_matmul_macs: int  # their multiply-adds (m * n * k per run)
    atomics: int
    fiber_switches: int
    seconds: float

    @property
    def device_bytes(self) -> Optional[int]:
        if self.device_bytes_read is None:
            return None
        return self.device_bytes_read + self.device_bytes_written

    @property
    def mma(self) -> int:
        return self.simdgroup_matrix_multiplies


_ERRORS = {
    rt.E_DIVERGENT_BARRIER: DivergentBarrierError,
    rt.E_MMA_DIVERGENCE: SimdgroupMatrixDivergenceError,
    rt.E_OUT_OF_BOUNDS: OutOfBoundsError,
    rt.E_TG_MEMORY: ThreadgroupMemoryError,
    rt.E_UNBOUND: LaunchError,
    rt.E_RACE: DataRaceError,
    rt.E_TIMEOUT: KernelTimeoutError,
    rt.E_CRASH: KernelCrashError,
    rt.E_FPE: KernelCrashError,
    rt.E_BAD_LAUNCH: LaunchError,
    rt.E_MISALIGNED: MisalignedAccessError,
}


class _Build:
    """One compiled kernel library (shared object), loaded."""

    def __init__(self, path: Path, pre: prepass.Result):
        self.path = path
        self.pre = pre
        rt.runtime_library()
        self.dll = ctypes.CDLL(str(path))
        # Function-constant globals are per loaded library, and loading one path twice (two
        # threads building at once, or again after a cache eviction) gives the same one.
        self.lock = _library_lock(path)
        self.entries = {}  # host name -> (entry address, param infos, Kernel)
        for i, k in enumerate(pre.built):
            fn = getattr(self.dll, f"__mtl_kernel_{i}")
            kinfo = getattr(self.dll, f"__mtl_kinfo_{i}")
            kinfo.restype = ctypes.c_int
            arr = (rt.ParamInfo * max(1, len(k.params) + 8))()
            n = kinfo(arr)
            self.entries[k.host_name] = (ctypes.cast(fn, ctypes.c_void_p).value, [arr[j] for j in range(n)], k)
        self.set_fcs = getattr(self.dll, "__mtl_set_fcs")
        self.set_fcs.restype = None


_library_locks: dict = {}
_library_locks_guard = threading.Lock()


def _library_lock(path: Path) -> threading.Lock:
    with _library_locks_guard:
        return _library_locks.setdefault(str(path), threading.Lock())


# Process-wide caches: each pre-processed source is checked once and its kernels built once per mode.
_pre_cache = LRU("emulator.sources", 64)
_check_cache = LRU("emulator.checks", 64)
_build_cache = LRU("emulator.builds", 64)  # (source, checked, math mode) -> _Builds
_cache_lock = threading.Lock()
# A kernel is compiled when it is first launched, on its own, while few of its source's kernels
# are built in that mode (most modes touch a handful of a file's instantiations); past a fifth
# of them, the whole file is compiled at once, in parallel pieces (in its main mode a file's
# kernels all run sooner or later: one build per piece parses the source once, where a kernel
# on its own costs about twice its share of a whole build).  Either way a build's text does
# not depend on the order kernels are met in, so every process shares it through the disk cache.
LAZY_FRACTION = 5


class _Builds:
    """The kernels of one source built so far in one mode: host name -> _Build."""

    def __init__(self):
        self.entries: dict = {}
        self.lock = threading.Lock()


def _norm_defines(defines) -> tuple:
    if not defines:
        return ()
    if isinstance(defines, dict):
        return tuple(sorted((str(k), None if v is None else str(v)) for k, v in defines.items()))
    return tuple(sorted((str(d), None) for d in defines))


def _chunks(names: list) -> list:
    """Split a file's kernels into pieces compiled in parallel (one per CPU core;
    a build of a big kernel file is dominated by optimising its instantiations)."""
    n = max(1, min(config.default_workers(), len(names) // 3))
    return [names[i::n] for i in range(n)]


class _Checked:
    """What the rules and analysis passes found out about one pre-processed source."""

    def __init__(self, name: str, pre_text: str, pre: prepass.Result):
        comp = find_compiler()
        names = {fc.name for fc in pre.constants}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            # the analysis of the source as it is runs alongside the rules passes (used when nothing is wrapped)
            analysis = pool.submit(compiler.analyze, comp, pre.text + pre.glue, name)
            verdict = compiler.check_rules(comp, pre.text, name, names)
            self.copies = verdict["copies"]  # copies out of constant memory, for rules.apply_copies
            self.warnings = verdict["warnings"]
            self.bool_lanes = verdict.get("bool_lanes", False)  # vec<bool, N>: bool arguments as byte lanes
            facts = compiler.analyze(comp, self.text(pre), name) \
                if self.copies or self.bool_lanes else analysis.result()
        self.kernels = {k.host_name: facts["kernels"][str(i)] for i, k in enumerate(pre.kernels)}

    def text(self, pre: prepass.Result) -> str:
        """The build's translation unit: the pre-pass output as the rules passes accepted it, and the glue."""
        if not self.bool_lanes:
            return rules.apply_copies(pre.text, self.copies) + pre.glue
        return rules.apply_copies(prepass.bool_type_arguments(pre.text), self.copies) + \
            prepass.bool_type_arguments(pre.glue)


class Library:
    """A compiled .metal source.  Kernels are attributes: ``lib.my_kernel(...)``."""

    def __init__(self, name: str, pre_text: str, pre: prepass.Result, function_constants: dict, math_mode: str,
                 checked: "_Checked"):
        self._name = name
        self._pre_text = pre_text
        self._pre = pre
        self._kernels = {k.host_name: k for k in pre.kernels}
        self._fc_values = function_constants  # {index: value}
        self._checked = checked
        self.math_mode = math_mode
        self.kernel_names = [k.host_name for k in pre.kernels]
        self.function_constants = {fc.name: fc.index for fc in pre.constants}
        self.warnings = checked.warnings  # the compiler's warnings about the source

    def __repr__(self):
        return f"<emulator.Library {self._name} ({self.math_mode} math): {', '.join(self.kernel_names)}>"

    def __dir__(self):
        return list(super().__dir__()) + self.kernel_names

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        kernels = self.__dict__.get("_kernels", {})
        if name in kernels:
            return KernelFunction(self, name)
        raise AttributeError(f"{self._name} has no kernel named {name!r}; kernels: {', '.join(self.kernel_names)}")

    def __getitem__(self, name: str) -> "KernelFunction":
        if name not in self._kernels:
            raise KeyError(f"{self._name} has no kernel named {name!r}; kernels: {', '.join(self.kernel_names)}")
        return KernelFunction(self, name)

    def build(self, checked: Optional[bool] = None) -> "Library":
        """Compile now (for ``checked``, default: the current setting) instead of at the first launch."""
        self._build(config.default_checked() if checked is None else bool(checked))
        return self

    def pipeline_info(self, kernel_name: str) -> dict:
        """Limits of a kernel's pipeline, with the keys of Metal's
        MTLComputePipelineState (and the Metal launcher's ``pipeline_info``)."""
        if kernel_name not in self._kernels:
            raise KeyError(f"{self._name} has no kernel named {kernel_name!r}; kernels: {', '.join(self.kernel_names)}")
        facts = self._checked.kernels[kernel_name]
        return {"max_total_threads_per_threadgroup": facts["max_total_threads_per_threadgroup"],
                "thread_execution_width": 32,
                "static_threadgroup_memory_length": facts["static_threadgroup_memory_length"],
                "max_threadgroup_memory_length": 32 * 1024}

    def _builds(self, checked: bool) -> _Builds:
        key = (hashlib.sha256(self._pre_text.encode()).hexdigest(), checked, self.math_mode)
        with _cache_lock:
            builds = _build_cache.get(key)
            if builds is None:
                builds = _Builds()
                _build_cache.put(key, builds)
        return builds

    def prebuild(self, names, checked: Optional[bool] = None) -> _Builds:
        """Build kernels ``names`` now, those not built yet each on its own, or the whole file
        once few would not be left out (see LAZY_FRACTION)."""
        checked = config.default_checked() if checked is None else bool(checked)
        builds = self._builds(checked)
        with builds.lock:
            missing = [n for n in dict.fromkeys(names) if n not in builds.entries]
            if missing:
                whole = len(builds.entries) + len(missing) > max(4, len(self.kernel_names) // LAZY_FRACTION)
                self._compile(builds, [self.kernel_names] if whole else [[n] for n in missing], checked)
        return builds

    def _build_of(self, name: str, checked: bool) -> "_Build":
        """The build holding kernel ``name``."""
        return self.prebuild([name], checked).entries[name]

    def _build(self, checked: bool) -> dict:
        """{host name: _Build} of every kernel, for this mode (function constants are set at launch)."""
        return dict(self.prebuild(self.kernel_names, checked).entries)

    def _compile(self, builds: _Builds, groups: list, checked: bool) -> None:
        """Compile each group of kernels (a list of host names: one kernel, or the whole file
        in parallel pieces) into ``builds``."""
        comp = find_compiler()

        def build_chunk(chunk):
            pre = self._pre if len(chunk) == len(self.kernel_names) else prepass.run(
                self._pre_text, default_file=self._name, syntax=_syntax(comp), only=set(chunk))
            path = compiler.build_kernel_library(comp, self._checked.text(pre), self._name, checked, self.math_mode)
            return _Build(path, pre)

        chunks = [c for names in groups for c in (_chunks(names) if len(names) > 1 else [names])]
        if len(chunks) <= 1:
            parts = [build_chunk(c) for c in chunks]
        else:
            with concurrent.futures.ThreadPoolExecutor(min(len(chunks), config.default_workers())) as pool:
                parts = list(pool.map(build_chunk, chunks))
        for b in parts:
            builds.entries.update({name: b for name in b.entries})


def _syntax(comp):
    """The pre-pass's parser: clang's AST of its view of the source."""
    return lambda view: compiler.syntax_facts(comp, view)


class KernelFunction:
    def __init__(self, lib: Library, name: str):
        self.lib = lib
        self.name = name
        self.kernel = lib._kernels[name]

    def __repr__(self):
        return f"<emulator kernel {self.name} ({self.kernel.file}:{self.kernel.line})>"

    def __call__(self, *args, grid, threadgroup, threadgroup_memory=None, order=None, seed=None, buffers=None,
                 checked=None, timeout=None) -> LaunchStats:
        return launch(self, args, grid=grid, threadgroup=threadgroup, threadgroup_memory=threadgroup_memory,
                      order=order, seed=seed, buffers=buffers, checked=checked, timeout=timeout)


def _dims(v, what: str) -> tuple:
    if isinstance(v, int):
        v = (v,)
    v = tuple(int(x) for x in v)
    if not 1 <= len(v) <= 3:
        raise LaunchError(f"{what} must be an int or a 1-, 2- or 3-tuple, got {v!r}")
    v = v + (1,) * (3 - len(v))
    if any(x < 0 or x >= 2 ** 32 for x in v):
        raise LaunchError(f"{what} must be in [0, 2**32), got {v!r}")
    return v


def launch(fn: KernelFunction, args, *, grid, threadgroup, threadgroup_memory, order, seed, buffers, checked,
           timeout) -> LaunchStats:
    lib = fn.lib
    kname = fn.name
    grid = _dims(grid, "grid")
    tg = _dims(threadgroup, "threadgroup")
    checked = config.default_checked() if checked is None else bool(checked)
    order = config.default_order() if order is None else config.check_order(order)
    seed = config.default_seed() if seed is None else int(seed)
    timeout = config.default_timeout() if timeout is None else float(timeout)
    limit = lib.pipeline_info(kname)["max_total_threads_per_threadgroup"]
    if tg[0] * tg[1] * tg[2] == 0 or tg[0] * tg[1] * tg[2] > limit:
        raise LaunchError(f"{kname}: threadgroup {tg} must have 1..{limit} threads (the pipeline's "
                          f"max_total_threads_per_threadgroup)")
    stats_kwargs = dict(kernel=kname, grid=grid, threadgroup=tg, checked=checked, order=order)
    if 0 in grid:
        return _recorded(LaunchStats(threadgroups=0, threads=0, device_bytes_read=0 if checked else None,
                           device_bytes_written=0 if checked else None, bytes_read={} if checked else None,
                           bytes_written={} if checked else None, threadgroup_bytes_read=None,
                           threadgroup_bytes_written=None, threadgroup_memory=0, barriers=0, simd_collectives=0,
                           simdgroup_barriers=0, simdgroup_matrix_multiplies=0, tensor_matmuls=0,
                           tensor_matmul_macs=0, atomics=0, fiber_switches=0,
                           seconds=0.0, **stats_kwargs))
    build = lib._build_of(kname, checked)
    entry, infos, kernel = build.entries[kname]
    fc_values = lib._fc_values
    fc_by_name = {fc.name: fc for fc in build.pre.constants}

    def gate_on(p) -> bool:
        if not p.gate:
            return True
        fc = fc_by_name.get(p.gate)
        if fc is None:
            return True
        return bool(fc_values.get(fc.index, False))

    binds, keep = bind_arguments(kname, kernel, infos, args, buffers or {}, gate_on)
    tg_bytes = (ctypes.c_uint64 * rt.MTL_MAX_TG_PARAMS)()
    for k, v in (threadgroup_memory or {}).items():
        if not 0 <= int(k) < rt.MTL_MAX_TG_PARAMS:
            raise LaunchError(f"{kname}: threadgroup_memory index {k} out of range")
        tg_bytes[int(k)] = int(v)
    for p in kernel.params:
        if p.kind == prepass.P_THREADGROUP and not tg_bytes[p.index]:
            raise LaunchError(f"{kname}: parameter '{p.name}' [[threadgroup({p.index})]] needs "
                              f"threadgroup_memory={{{p.index}: nbytes}}")
        if p.kind <= 0:
            raise LaunchError(f"{kname}: parameter '{p.name}' [[{p.attr}]] is not supported by the emulator "
                              "(compute kernels with buffers, threadgroup memory and thread-position built-ins)")

    nb = len(binds)
    barr = (rt.Binding * max(1, nb))(*binds)
    st = rt.Stats()
    err = rt.Error()
    d = rt.Launch()
    d.entry = entry
    d.grid[:] = grid
    d.tg[:] = tg
    d.order = config.ORDERS.index(order)
    d.checked = int(checked)
    d.seed = seed & 0xFFFFFFFFFFFFFFFF
    d.timeout_s = timeout
    d.nbind = nb
    d.binds = barr
    d.tg_param_bytes = tg_bytes
    d.max_workers = 1 if checked else config.default_workers()
    d.stats = ctypes.pointer(st)
    d.err = ctypes.pointer(err)
    d.tensor_layout = config.tensor_layout()
    t0 = time.perf_counter()
    with build.lock:
        if build.pre.constants:
            n = len(build.pre.constants)
            iv = (ctypes.c_long * n)()
            dv = (ctypes.c_float * n)()  # Metal has no double: float (half) constants
            df = (ctypes.c_int * n)()
            for i, fc in enumerate(build.pre.constants):
                v = fc_values.get(fc.index)
                df[i] = v is not None
                if v is not None:
                    if isinstance(v, float):
                        dv[i] = v
                        iv[i] = int(v)
                    else:
                        iv[i] = int(v)
                        dv[i] = float(v)
            build.set_fcs(iv, dv, df)
        code = rt.runtime_library().mtl_launch(ctypes.byref(d))
    seconds = time.perf_counter() - t0
    del keep
    if code:
        if code == rt.E_UNBOUND:  # name the argument
            p = next((p for p in kernel.params if p.kind == prepass.P_BUFFER and p.index == err.buffer), None)
            if p is not None:
                err.msg = (f"{err.msg.decode(errors='replace')}: the kernel uses parameter '{p.name}' "
                           f"[[buffer({p.index})]], so it must be bound (pass it as positional argument {p.index} "
                           f"or buffers={{{p.index}: ...}})").encode()[:2047]
        raise _make_error(build, kname, err, code)
    return _recorded(LaunchStats(
        threadgroups=st.threadgroups, threads=st.threads,
        device_bytes_read=st.device_read if checked else None,
        device_bytes_written=st.device_written if checked else None,
        bytes_read={b.index: st.buf_read[b.index] for b in binds} if checked else None,
        bytes_written={b.index: st.buf_written[b.index] for b in binds} if checked else None,
        threadgroup_bytes_read=st.tg_read if checked else None,
        threadgroup_bytes_written=st.tg_written if checked else None,
        threadgroup_memory=st.tg_peak, barriers=st.barriers, simd_collectives=st.simd_collectives,
        simdgroup_barriers=st.simd_barriers, simdgroup_matrix_multiplies=st.mma, tensor_matmuls=st.tensor_matmuls,
        tensor_matmul_macs=st.tensor_macs, atomics=st.atomics,
        fiber_switches=st.switches, seconds=seconds, **stats_kwargs))


def _recorded(stats: LaunchStats) -> LaunchStats:
    recorder.record(stats)
    return stats


def _make_error(build: _Build, kname: str, err: rt.Error, code: int) -> EmulatorError:
    msg = err.msg.decode(errors="replace")
    file = err.file.decode(errors="replace") or None
    line = err.line or None
    comp = find_compiler()
    if not file and err.pc_offset:
        loc = rt.symbolize(str(build.path), err.pc_offset, comp.symbolizer)
        if loc:
            file, line = loc
    other = None
    if err.pc2_offset:
        other = rt.symbolize(str(build.path), err.pc2_offset, comp.symbolizer)
    if not file:  # no better location: the kernel's definition
        k = next((k for k in build.pre.kernels if k.host_name == kname), None)
        if k is not None:
            file, line = k.file, k.line
    tgp = tuple(err.tg)
    thr = tuple(err.thread_pos) if err.has_thread else None
    where = f"{file}:{line}" if file else "unknown location"
    text = f"kernel '{kname}' at {where}, threadgroup {tgp}"
    if thr is not None:
        text += f", thread {thr}"
    text += f": {msg}"
    if other:
        text += f" (the other access is at {other[0]}:{other[1]})"
    cls = _ERRORS.get(code, EmulatorError)
    return cls(text, kernel=kname, file=file, line=line, threadgroup=tgp, thread=thr,
               buffer=err.buffer if err.buffer >= 0 else None)


def compile_shader(source: Union[str, Path], *, include_dirs=(), defines=None, function_constants=None,
                   name: Optional[str] = None, math_mode: str = "fast",
                   language_version: Optional[str] = None) -> Library:
    """Compile the text of a .metal file (or a pathlib.Path to one) for the emulator.

    The source must be valid Metal: it is preprocessed without host headers
    and checked against Metal's rules (address spaces, language
    restrictions ...) right away; a :class:`CompileError` names the file:line
    and the rule.  ``function_constants`` maps ``[[function_constant(i)]]``
    names or indices to values.  ``math_mode`` is Metal's ``MTLMathMode``:
    "fast" (the default of ``newLibraryWithSource``), "relaxed" or "safe".
    ``language_version`` is MTLCompileOptions' languageVersion ("3.0", "3.1",
    "3.2", "4.0"): it sets ``__METAL_VERSION__``, and Metal 4's tensor ops
    (<MetalPerformancePrimitives/MetalPerformancePrimitives.h>) need "4.0" (a
    source that includes them under an older version is a CompileError).
    None (the default): "3.1", the version the package's launcher compiles
    with, or "4.0" for a source that includes the tensor ops (Metal's own
    default is the newest version the OS has).
    A kernel is built when first launched (a file's first few kernels each on
    its own, then the whole file: LAZY_FRACTION), per checked / fast mode,
    cached in memory and on disk.
    """
    math_mode = config.check_math_mode(math_mode)
    if language_version is not None:
        language_version = compiler.check_language_version(language_version)
    path = None
    if isinstance(source, Path):
        path = source.resolve()
        text = path.read_text()
        include_dirs = (path.parent,) + tuple(include_dirs)
        name = name or str(path)
    else:
        text = str(source)
        name = name or "<source>.metal"
    include_dirs = tuple(str(Path(d).resolve()) for d in include_dirs)
    key = (text, str(path), name, include_dirs, _norm_defines(defines), language_version)
    with _cache_lock:
        cached = _pre_cache.get(key)
    if cached is None:
        comp = find_compiler()
        args = (comp, text, name, path, include_dirs, dict(_norm_defines(defines)))
        try:
            pre_text = preprocess(*args, language_version or compiler.DEFAULT_LANGUAGE_VERSION)
        except CompileError as e:
            if language_version is not None or e.rule != "language-version":
                raise
            pre_text = preprocess(*args, "4.0")  # the version the source needs
        pre = prepass.run(pre_text, default_file=name, syntax=_syntax(comp))
        cached = (pre_text, pre)
        with _cache_lock:
            _pre_cache.put(key, cached)
    pre_text, pre = cached
    with _cache_lock:
        checked = _check_cache.get(pre_text)
    if checked is None:
        checked = _Checked(name, pre_text, pre)
        with _cache_lock:
            _check_cache.put(pre_text, checked)
    fcs = {}
    by_name = {fc.name: fc.index for fc in pre.constants}
    types = {fc.index: fc.type for fc in pre.constants}
    for k, v in (function_constants or {}).items():
        if isinstance(k, str):
            if k not in by_name:
                raise LaunchError(f"{name}: no function constant named {k!r} (known: {', '.join(by_name) or 'none'})")
            k = by_name[k]
        k = int(k)
        t = types.get(k, "")
        if isinstance(v, bool) or re.fullmatch(r"bool", t):
            v = bool(v)
        elif t in ("float", "half", "bfloat"):
            v = float(v)
        elif not isinstance(v, float):
            v = int(v)
        fcs[k] = v
    return Library(name, pre_text, pre, fcs, math_mode, checked)
