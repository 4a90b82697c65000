"""Finding clang, building the runtime and kernel libraries, the disk cache.

Compiler: ``TORCH_METAL_FLASH_CXX``, then ``clang++-19`` ... ``clang++-17`` /
``clang++`` (version >= 17) on PATH, then the ``ziglang`` package
(``python -m ziglang c++``).

Cache: ``TORCH_METAL_FLASH_CACHE_DIR`` or ``~/.cache/torch_metal_flash/emulator``;
each library is keyed by a hash of everything that affects the build (the
pre-processed source, flags, compiler identity, runtime sources).  Writes go
to a temporary name and are renamed into place, so concurrent processes are
safe.
"""
from __future__ import annotations

import functools
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

from .errors import CompileError, CompilerNotFoundError

PREPASS_VERSION = "7"  # bump when the pre-pass or glue changes

_compile_seconds = 0.0
_compile_lock = threading.Lock()


def compile_seconds() -> float:
    """Total wall time this process spent compiling (pre-processing included)."""
    return _compile_seconds


def _add_time(t: float) -> None:
    global _compile_seconds
    with _compile_lock:
        _compile_seconds += t


def csrc_emulator_dir() -> Path:
    from .._paths import csrc_dir
    return csrc_dir() / "emulator"


def cache_dir() -> Path:
    d = os.environ.get("TORCH_METAL_FLASH_CACHE_DIR")
    path = Path(d) if d else Path.home() / ".cache" / "torch_metal_flash" / "emulator"
    path.mkdir(parents=True, exist_ok=True)
    return path


# ---------------------------------------------------------------- compiler discovery


class Compiler:
    def __init__(self, argv: list, version: str, ident: str):
        self.argv = argv  # command prefix, e.g. ["clang++-19"] or [python, -m, ziglang, c++]
        self.version = version
        self.ident = ident  # first line of --version (part of cache keys)
        self.is_zig = "ziglang" in " ".join(argv)

    @functools.cached_property
    def builtins_lib(self) -> Optional[str]:
        """compiler-rt builtins (bf16 conversions such as __truncsfbf2)."""
        if self.is_zig:
            return None  # zig links its own compiler-rt
        try:
            out = subprocess.run(self.argv + ["--print-libgcc-file-name", "--rtlib=compiler-rt"],
                                 capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None
        return out if out and os.path.exists(out) else None

    @functools.cached_property
    def symbolizer(self) -> Optional[str]:
        if not self.is_zig:
            exe = shutil.which(self.argv[0]) or self.argv[0]
            real = os.path.realpath(exe)
            cand = os.path.join(os.path.dirname(real), "llvm-symbolizer")
            if os.path.exists(cand):
                return cand
            m = re.search(r"-(\d+)$", self.argv[0])
            if m and shutil.which(f"llvm-symbolizer-{m.group(1)}"):
                return shutil.which(f"llvm-symbolizer-{m.group(1)}")
        return shutil.which("llvm-symbolizer") or shutil.which("addr2line")


def _version_of(argv: list) -> Optional[tuple]:
    try:
        out = subprocess.run(argv + ["--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    text = out.stdout + out.stderr
    m = re.search(r"clang version (\d+)\.(\d+)", text)
    if not m:
        return None
    return int(m.group(1)), text.strip().splitlines()[0]


_compiler: Optional[Compiler] = None


def find_compiler() -> Compiler:
    global _compiler
    if _compiler is not None:
        return _compiler
    tried = []
    env = os.environ.get("TORCH_METAL_FLASH_CXX")
    candidates = []
    if env:
        candidates.append(env.split())
    for v in (19, 18, 17, 20, 21, 22):
        candidates.append([f"clang++-{v}"])
    candidates.append(["clang++"])
    for argv in candidates:
        if not shutil.which(argv[0]):
            tried.append(argv[0])
            continue
        got = _version_of(argv)
        if got and got[0] >= 17:
            _compiler = Compiler(argv, str(got[0]), got[1])
            return _compiler
        tried.append(f"{argv[0]} (version {got[0] if got else '?'})")
        if env and argv == env.split():
            raise CompilerNotFoundError(f"TORCH_METAL_FLASH_CXX={env} is not a clang >= 17")
    try:
        import ziglang  # noqa: F401
        argv = [sys.executable, "-m", "ziglang", "c++"]
        got = _version_of(argv)
        if got and got[0] >= 17:
            _compiler = Compiler(argv, str(got[0]), got[1])
            return _compiler
    except ImportError:
        tried.append("ziglang (not installed)")
    raise CompilerNotFoundError("no clang >= 17 found; install clang-19 (apt-get install clang-19) or "
                                f"pip install ziglang (tried: {', '.join(tried)})")


# ---------------------------------------------------------------- flags

COMMON_FLAGS = ["-std=c++20", "-O2", "-fPIC", "-fno-strict-aliasing", "-fexcess-precision=16", "-fno-math-errno",
                "-fno-exceptions", "-fno-rtti", "-fvisibility=hidden", "-gline-tables-only", "-w"]
if platform.machine().lower() in ("x86_64", "amd64"):
    COMMON_FLAGS.append("-fstack-clash-protection")  # large frames probe the guard page below each fiber stack
CHECKED_FLAGS = ["-fsanitize-coverage=inline-8bit-counters,trace-loads,trace-stores", "-fno-builtin-memset",
                 "-fno-builtin-memcpy", "-fno-builtin-memmove", "-fno-vectorize", "-fno-slp-vectorize"]
PREPROCESS_DEFINES = ["-D__MTL_PREPASS__", "-D__METAL_VERSION__=310", "-D__METAL_MACOS__", "-D__HAVE_BFLOAT__=1",
                      "-D__METAL_EMULATOR__=1", "-DMETAL_3_1"]


def _run(argv: list, what: str, input_text: Optional[str] = None, cwd: Optional[str] = None) -> str:
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(argv, input=input_text, capture_output=True, text=True, cwd=cwd)
    finally:
        _add_time(time.perf_counter() - t0)
    if proc.returncode != 0:
        diag = _clean_diagnostics(proc.stderr)
        m = re.search(r"^(.+?):(\d+):(?:\d+:)? (?:fatal )?error:", diag, re.M)
        raise CompileError(f"{what} failed:\n{diag}", file=m.group(1) if m else None,
                           line=int(m.group(2)) if m else None)
    return proc.stdout


def _clean_diagnostics(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if "warning: " not in ln or "error" in ln]
    text = "\n".join(lines)
    return text[:20000]


def preprocess(comp: Compiler, source: str, name: str, path: Optional[Path], include_dirs, defines) -> str:
    """clang -E with the stub metal headers: macros expanded, line markers kept."""
    argv = list(comp.argv) + ["-E", "-x", "c++", "-std=c++20"] + PREPROCESS_DEFINES
    argv += ["-I", str(csrc_emulator_dir() / "include")]
    for d in include_dirs:
        argv += ["-I", str(d)]
    for k, v in (defines or {}).items():
        argv.append(f"-D{k}" if v is None else f"-D{k}={v}")
    if path is not None:
        argv.append(str(path))
        return _run(argv, f"preprocessing {name}")
    argv.append("-")
    out = _run(argv, f"preprocessing {name}", input_text=source)
    return out.replace('"<stdin>"', '"' + name.replace("\\", "\\\\").replace('"', '\\"') + '"')


# ---------------------------------------------------------------- building


def _hash(*parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else str(p).encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


def runtime_sources_hash() -> str:
    d = csrc_emulator_dir()
    files = sorted(list(d.glob("*.cpp")) + list(d.glob("*.h")) + list((d / "include").glob("*")))
    return _hash(*[f.name.encode() + f.read_bytes() for f in files])


_build_locks: dict = {}
_build_locks_guard = threading.Lock()


def _lock_for(key: str) -> threading.Lock:
    with _build_locks_guard:
        return _build_locks.setdefault(key, threading.Lock())


def _atomic_build(target: Path, build) -> Path:
    """Build into a temporary file next to target, then rename (safe across processes)."""
    if target.exists():
        return target
    with _lock_for(str(target)):
        if target.exists():
            return target
        fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=str(target.parent))
        os.close(fd)
        try:
            build(tmp)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target


def _shared_flags() -> list:
    return ["-shared", "-undefined", "dynamic_lookup"] if sys.platform == "darwin" else ["-shared"]


def build_runtime(comp: Compiler) -> Path:
    src = csrc_emulator_dir() / "runtime.cpp"
    key = _hash("runtime", runtime_sources_hash(), comp.ident, sys.platform, os.uname().machine)
    target = cache_dir() / f"libmtlrt-{key}.so"

    def build(tmp):
        argv = list(comp.argv) + ["-std=c++20", "-O2", "-fPIC", "-fvisibility=hidden", "-U_FORTIFY_SOURCE",
                                  "-D_FORTIFY_SOURCE=0", "-w", "-g1", str(src), "-o", tmp] + _shared_flags()
        if sys.platform != "darwin":
            argv += ["-lpthread", "-ldl"]
        _run(argv, "building the emulator runtime")

    return _atomic_build(target, build)


def build_kernel_library(comp: Compiler, text: str, name: str, checked: bool) -> Path:
    flags = COMMON_FLAGS + (CHECKED_FLAGS if checked else [])
    key = _hash("kernel", PREPASS_VERSION, runtime_sources_hash(), comp.ident, " ".join(flags), text)
    stem = re.sub(r"[^\w.-]", "_", Path(name).stem)[:40]
    target = cache_dir() / f"{stem}-{'checked' if checked else 'fast'}-{key}.so"

    def build(tmp):
        cpp = Path(tmp).with_suffix(".cpp")
        cpp.write_text(text)
        try:
            argv = list(comp.argv) + flags + ["-I", str(csrc_emulator_dir() / "include"), "-include", "mtl_shim.h",
                                              "-x", "c++", str(cpp), "-x", "none", "-o", tmp] + _shared_flags()
            if comp.builtins_lib:
                argv.append(comp.builtins_lib)
            _run(argv, f"compiling {name}")
        finally:
            keep = os.environ.get("TORCH_METAL_FLASH_EMULATOR_KEEP_CPP")
            if keep:
                shutil.copy(cpp, target.with_suffix(".cpp"))
            cpp.unlink(missing_ok=True)

    return _atomic_build(target, build)
