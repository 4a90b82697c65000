"""Finding clang, the compiler passes over a kernel source, the disk cache.

A kernel source goes through clang five times (docs/emulator.md):
1. ``preprocess``: ``clang -E`` as C++17 with ``-nostdinc``: only the shim's
   ``<metal_*>`` headers and the caller's include directories are reachable.
2. ``syntax_facts``: the pre-pass's view of it parsed syntax-only, its AST
   dumped as JSON (the shim as a precompiled header): where its casts and
   threadgroup variables are (syntax.py).
3. ``check_rules``: syntax-only C++ for OpenCL 2021, where Metal's address
   spaces are clang's OpenCL address spaces: once with a generic address
   space (every rule but one; copies out of constant memory are wrapped and
   the pass repeated) and once without (the `this` of member functions).
   Errors are mapped to the MSL rule they break (rules.py).
4. ``analyze``: the build translation unit at -O0 as LLVM IR: recursion,
   vector casts the pre-pass missed, threadgroup memory per kernel, thread
   limits (analysis.py).
5. ``build_kernel_library``: -O2 shared library, per checked/unchecked build
   and math mode.

Compiler: ``TORCH_METAL_FLASH_CXX``, then ``clang++-19`` ... ``clang++-17`` /
``clang++`` (version >= 17) on PATH, then the ``ziglang`` package
(``python -m ziglang c++`` for the runtime, ``python -m ziglang clang`` for the
Metal sources: zig's C++ driver does not compile OpenCL).

Cache: ``TORCH_METAL_FLASH_CACHE_DIR`` or ``~/.cache/torch_metal_flash/emulator``;
each result is keyed by a hash of everything that affects it (the
pre-processed source, flags, compiler identity, shim and runtime sources).
Writes go to a temporary name and are renamed into place, so concurrent
processes are safe.
"""
from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import json
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

import torch_metal_flash.progress as progress
import torch_metal_flash.emulator.analysis as analysis
import torch_metal_flash.emulator.prepass as prepass
import torch_metal_flash.emulator.rules as rules
import torch_metal_flash.emulator.syntax as syntax
from .errors import CompileError, CompilerNotFoundError

PREPASS_VERSION = "13"  # bump when the pre-pass, glue or pass flags change

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
        # What compiles the Metal sources (C++ for OpenCL): zig's `c++` driver rejects `-x clcpp`,
        # the clang it ships takes it.  The host runtime is built with `argv` (a C++ library).
        self.metal_argv = argv[:-1] + ["clang"] if self.is_zig and argv[-1] in ("c++", "cc") else argv

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

# Metal's MTLMathMode: fast (newLibraryWithSource's default) may assume no
# infinities / NaNs, reassociate and contract; relaxed does the same but
# honours Inf / NaN; safe is IEEE.  Float denormals are flushed to zero in
# every mode (the runtime sets FTZ/DAZ in its worker threads).
MATH_FLAGS = {"fast": ["-ffast-math"], "relaxed": ["-ffast-math", "-fno-finite-math-only"], "safe": ["-fno-fast-math"]}

OPENCL = ["-x", "clcpp", "-cl-std=clc++2021", "-cl-no-stdinc", "-nostdinc"]
# Warnings that flag code whose behaviour on the GPU is undefined are errors.
ERROR_WARNINGS = ["return-type", "uninitialized", "array-bounds", "division-by-zero", "return-stack-address"]
# The rules passes: no program-scope globals, device enqueue or fp64 (clang reports them); function
# pointers parse (a function as a template argument is valid Metal; one used at run time is found
# in the IR, analysis.py).
_PASS_EXTENSIONS = "-__opencl_c_program_scope_global_variables,-__opencl_c_device_enqueue,-cl_khr_fp64,-__opencl_c_fp64," \
              "+__cl_clang_function_pointers"
RULES_FLAGS = OPENCL + ["-fsyntax-only", "-D__MTL_RULES__", "-ferror-limit=0", "-fdiagnostics-print-source-range-info",
                        "-Xclang", "-cl-ext=" + _PASS_EXTENSIONS] + \
    [f"-Werror={w}" for w in ERROR_WARNINGS]
THIS_FLAGS = OPENCL + ["-fsyntax-only", "-D__MTL_RULES__", "-D__MTL_RULES_THIS__", "-ferror-limit=0", "-w", "-Xclang",
                       "-cl-ext=-__opencl_c_generic_address_space,-__opencl_c_pipes," + _PASS_EXTENSIONS]
# No fp64 in the build either: an unsuffixed literal is a float, as in Metal and the rules pass
# (`0.5 * x` computes in float, and `0.5 * v` with a float4 v is valid).
BUILD_FLAGS = OPENCL + ["-Xclang", "-cl-ext=+__cl_clang_function_pointers,-cl_khr_fp64,-__opencl_c_fp64",
                        "-fno-convergent-functions", "-fPIC",
                        "-fno-strict-aliasing", "-fvisibility=hidden", "-gline-tables-only", "-w"]
if platform.machine().lower() in ("x86_64", "amd64"):
    BUILD_FLAGS.append("-fstack-clash-protection")  # large frames probe the guard page below each fiber stack
# Checked builds: a callback for every load and store (nothing hidden in
# memcpy / wide vector operations), and alignment checks of typed accesses.
CHECKED_FLAGS = ["-fsanitize-coverage=inline-8bit-counters,trace-loads,trace-stores", "-fno-builtin-memset",
                 "-fno-builtin-memcpy", "-fno-builtin-memmove", "-fno-vectorize", "-fno-slp-vectorize",
                 "-fsanitize=alignment", "-fno-sanitize-recover=alignment"]
# What Apple's compiler predefines on macOS (and __METAL_VERSION__ for the language version).
PREPROCESS_DEFINES = ["-D__MTL_PREPASS__", "-D__METAL__=1", "-D__METAL_MACOS__", "-D__HAVE_BFLOAT__=1",
                      "-D__METAL_EMULATOR__=1"]
# MSL language versions (MTLLanguageVersion, -std=metal3.1 ...) and their __METAL_VERSION__.
LANGUAGE_VERSIONS = {"3.0": 300, "3.1": 310, "3.2": 320, "4.0": 400}
DEFAULT_LANGUAGE_VERSION = "3.1"


def check_language_version(version) -> str:
    v = str(version)
    if v not in LANGUAGE_VERSIONS:
        raise ValueError(f"language_version must be one of {', '.join(LANGUAGE_VERSIONS)}, got {version!r}")
    return v


def _run(argv: list, input_text: Optional[str] = None) -> subprocess.CompletedProcess:
    t0 = time.perf_counter()
    try:
        return subprocess.run(argv, input=input_text, capture_output=True, text=True)
    finally:
        _add_time(time.perf_counter() - t0)


def _fail(what: str, stderr: str) -> CompileError:
    """An emulator-side failure (the source passed the rules)."""
    diag = stderr[:20000]
    m = re.search(r"^(.+?):(\d+):(?:\d+:)? (?:fatal )?error:", diag, re.M)
    return CompileError(f"{what} failed:\n{diag}", file=m.group(1) if m else None, line=int(m.group(2)) if m else None)


def shim_header() -> Path:
    return csrc_emulator_dir() / "shim" / "mtl_shim.h"


def preprocess(comp: Compiler, source: str, name: str, path: Optional[Path], include_dirs, defines,
               language_version: str = DEFAULT_LANGUAGE_VERSION) -> str:
    """clang -E: macros expanded, line markers kept; no host headers."""
    argv = list(comp.metal_argv) + ["-E", "-x", "c++", "-std=c++17", "-nostdinc"] + PREPROCESS_DEFINES
    argv.append(f"-D__METAL_VERSION__={LANGUAGE_VERSIONS[language_version]}")
    argv += ["-I", str(csrc_emulator_dir() / "include")]
    for d in include_dirs:
        argv += ["-I", str(d)]
    for k, v in (defines or {}).items():
        argv.append(f"-D{k}" if v is None else f"-D{k}={v}")
    argv.append(str(path) if path is not None else "-")
    proc = _run(argv, None if path is not None else source)
    if proc.returncode != 0:
        raise rules.compile_error(proc.stderr if path is not None else proc.stderr.replace("<stdin>:", name + ":"),
                                  name)
    out = proc.stdout
    if path is None:
        out = out.replace('"<stdin>"', '"' + name.replace("\\", "\\\\").replace('"', '\\"') + '"')
    return out


# ---------------------------------------------------------------- the cache


def _hash(*parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else str(p).encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


def runtime_sources_hash() -> str:
    d = csrc_emulator_dir()
    files = sorted(list(d.glob("*.cpp")) + list(d.glob("*.h")) + [f for f in (d / "include").rglob("*") if f.is_file()] +
                   list((d / "shim").glob("*")) + list((d / "runtime").glob("*")))
    return _hash(*[str(f.relative_to(d)).encode() + f.read_bytes() for f in files])


@functools.lru_cache(maxsize=None)
def _source_of(module) -> bytes:
    """A module whose code decides a cached verdict is part of its cache key."""
    return Path(module.__file__).read_bytes()


_build_locks: dict = {}
_build_locks_guard = threading.Lock()


def _lock_for(key: str) -> threading.Lock:
    with _build_locks_guard:
        return _build_locks.setdefault(key, threading.Lock())


_STEPS = {"rules": "checking a kernel source's MSL rules", "analysis": "analysing a kernel source",
          "syntax": "parsing a kernel source", "shim": "precompiling the emulator's header",
          "libmtlrt": "building the emulator's runtime", "tmf_core": "compiling the C++ op core"}


def _atomic_write(target: Path, build) -> Path:
    """Produce target through a temporary file next to it, then rename (safe across processes)."""
    if target.exists():
        return target
    with _lock_for(str(target)):
        if target.exists():
            return target
        fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=str(target.parent))
        os.close(fd)
        try:
            # a first use waits on clang for seconds: say so (later processes read the file)
            what = target.name.split("-")[0]
            with progress.bar(None, f"{_STEPS.get(what, f'compiling {what}')} (first use, cached)"):
                build(tmp)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target


def _shared_flags() -> list:
    return ["-shared", "-undefined", "dynamic_lookup"] if sys.platform == "darwin" else ["-shared"]


def _compile(comp: Compiler, flags: list, text: str, tmp: str, *extra) -> subprocess.CompletedProcess:
    """Compiles `text` (the pre-pass output) with the shim included first."""
    src = Path(tmp).with_suffix(".cl.cpp")
    src.write_text(text)
    try:
        return _run(list(comp.metal_argv) + flags + ["-include", str(shim_header()), str(src)] + list(extra))
    finally:
        src.unlink(missing_ok=True)


# ---------------------------------------------------------------- clang's AST of the pre-pass view

# The view is parsed as the build parses it (no fp64, function pointers), without warnings.
# A precompiled header records its inputs' paths and mtimes: checked by content instead of mtime
# (a checkout touched or re-cloned keeps its PCH), and keyed by the shim's folder (each copy of
# the package -- checkout, installed, another clone -- has its own; clang needs the files there).
SYNTAX_FLAGS = OPENCL + ["-Xclang", "-cl-ext=+__cl_clang_function_pointers,-cl_khr_fp64,-__opencl_c_fp64", "-w",
                         "-fpch-validate-input-files-content"]


def shim_pch(comp: Compiler) -> Path:
    """The shim (and shim/mtl_syntax.h) as a precompiled header, one per compiler, shim and shim
    folder: the AST dump of a source then holds the source's declarations only, and parsing skips
    the shim."""
    key = _hash("shim-pch", runtime_sources_hash(), str(shim_header().parent.resolve()), comp.ident,
                " ".join(SYNTAX_FLAGS))
    target = cache_dir() / f"shim-{key}.pch"

    def build(tmp):
        proc = _run(list(comp.metal_argv) + SYNTAX_FLAGS + ["-x", "cl-header", str(shim_header().with_name("mtl_syntax.h")),
                                                      "-o", tmp])
        if proc.returncode != 0:
            raise _fail("precompiling the shim", proc.stderr)

    return _atomic_write(target, build)


_syntax_cache: dict = {}


def syntax_facts(comp: Compiler, view: str) -> dict:
    """syntax.facts of the pre-pass view: clang -fsyntax-only -ast-dump=json with the shim
    precompiled (cached in memory and on disk; errors in the view do not matter here, the
    rules passes report them)."""
    key = _hash("syntax", PREPASS_VERSION, runtime_sources_hash(), _source_of(syntax), comp.ident, view)
    if key in _syntax_cache:
        return _syntax_cache[key]
    target = cache_dir() / f"syntax-{key}.json"

    def run(tmp):
        src = Path(tmp).with_suffix(".view.cl.cpp")
        src.write_text(view)
        try:
            argv = list(comp.metal_argv) + SYNTAX_FLAGS + ["-fsyntax-only", "-ferror-limit=0", "-include-pch",
                                                     str(shim_pch(comp)), "-Xclang", "-ast-dump=json", str(src)]
            proc = _run(argv)
            if not proc.stdout.startswith("{"):
                raise _fail("parsing the source for the pre-pass", proc.stderr)
            result = syntax.facts(json.loads(proc.stdout), view, str(src))
        finally:
            src.unlink(missing_ok=True)
        Path(tmp).write_text(json.dumps(result))

    result = json.loads(_atomic_write(target, run).read_text())
    if len(_syntax_cache) >= 64:  # the pieces of one source ask for the same view; a few sources at a time
        _syntax_cache.clear()
    _syntax_cache[key] = result
    return result


# ---------------------------------------------------------------- the passes


def check_rules(comp: Compiler, text: str, name: str, constants: set) -> dict:
    """The rules passes over the pre-pass output (no glue).  Raises a
    CompileError naming the broken MSL rule; returns {"copies": rounds of
    rules.wrap_copies for the build, "warnings": str, "bool_lanes": whether the
    build takes prepass.bool_type_arguments of the text} (cached on disk)."""
    key = _hash("rules", PREPASS_VERSION, runtime_sources_hash(), _source_of(rules), _source_of(prepass), comp.ident,
                text)
    target = cache_dir() / f"rules-{key}.json"

    def passes(tmp, text, bool_lanes):
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            # the pass without a generic address space runs alongside the first round
            this = pool.submit(_compile, comp, THIS_FLAGS, text, tmp + "-this.tmp")
            rounds, src = [], text
            for _ in range(4):  # copies out of constant memory nested in copies: one more round each
                stderr = _compile(comp, RULES_FLAGS, src, tmp).stderr
                if not bool_lanes and rules.BOOL_VECTOR in stderr:
                    return None
                result = rules.judge_generic(stderr, name, constants)
                if "error" in result or not result["copies"]:
                    break
                rounds.append(result["copies"])
                src = rules.wrap_copies(src, result["copies"])
            else:
                result = {"error": f"{name}: emulator limitation: cannot copy objects out of constant memory "
                                   f"here (line {result['copies'][0][0]} of the pre-pass output)", "rule": "c++"}
            if "error" not in result:
                this_pass = this.result() if not rounds else _compile(comp, THIS_FLAGS, src, tmp + "-this.tmp")
                result = rules.judge_this(this_pass.stderr, name) or {"copies": rounds, "warnings": result["warnings"],
                                                                      "bool_lanes": bool_lanes}
        return result

    def run(tmp):
        # vec<bool, N> formed through a template: again with bool template arguments as byte lanes
        result = passes(tmp, text, False) or passes(tmp, prepass.bool_type_arguments(text), True)
        Path(tmp).write_text(json.dumps(result))

    result = json.loads(_atomic_write(target, run).read_text())
    if result.get("error"):
        raise CompileError(result["error"], file=result.get("file"), line=result.get("line"), rule=result.get("rule"))
    return result


def analyze(comp: Compiler, text: str, name: str) -> dict:
    """The build translation unit (source + glue) at -O0 as LLVM IR: raises a
    CompileError on recursion; returns {host entry index: {"static_threadgroup_memory_length",
    "max_total_threads_per_threadgroup"}} (cached on disk)."""
    flags = BUILD_FLAGS + ["-O0", "-S", "-emit-llvm"]
    key = _hash("analysis", PREPASS_VERSION, runtime_sources_hash(), _source_of(analysis), _source_of(rules),
                comp.ident, " ".join(flags), text)
    target = cache_dir() / f"analysis-{key}.json"

    def run(tmp):
        ll = tmp + ".ll"
        try:
            proc = _compile(comp, flags, text, tmp, "-o", ll)
            if proc.returncode != 0:  # the glue's checks of the kernels' signatures
                raise rules.compile_error(proc.stderr, name)
            result = analysis.analyze_ir(Path(ll).read_text())
        finally:
            if os.path.exists(ll):
                os.unlink(ll)
        Path(tmp).write_text(json.dumps(result))

    result = json.loads(_atomic_write(target, run).read_text())
    if result.get("recursion"):
        r = result["recursion"]
        raise CompileError(f"{r['file']}:{r['line']}: {rules.RECURSION}\n{r['cycle']}", file=r["file"],
                           line=r["line"], rule="recursion")
    if result.get("function_pointer"):
        r = result["function_pointer"]
        raise CompileError(f"{r['file']}:{r['line']}: {rules.FUNCTION_POINTERS}", file=r["file"], line=r["line"],
                           rule="function-pointers")
    if result.get("vector_cast"):
        r = result["vector_cast"]
        raise CompileError(f"{r['file']}:{r['line']}: {rules.VECTOR_CAST}", file=r["file"], line=r["line"],
                           rule="vector-cast")
    return result


def build_runtime(comp: Compiler) -> Path:
    src = csrc_emulator_dir() / "runtime.cpp"
    key = _hash("runtime", runtime_sources_hash(), comp.ident, sys.platform, os.uname().machine)
    target = cache_dir() / f"libmtlrt-{key}.so"

    def build(tmp):
        argv = list(comp.argv) + ["-std=c++20", "-O2", "-fPIC", "-fvisibility=hidden", "-U_FORTIFY_SOURCE",
                                  "-D_FORTIFY_SOURCE=0", "-w", "-g1", str(src), "-o", tmp] + _shared_flags()
        if sys.platform != "darwin":
            argv += ["-lpthread", "-ldl"]
        proc = _run(argv)
        if proc.returncode != 0:
            raise _fail("building the emulator runtime", proc.stderr)

    return _atomic_write(target, build)


def build_kernel_library(comp: Compiler, text: str, name: str, checked: bool, math_mode: str) -> Path:
    flags = BUILD_FLAGS + ["-O2"] + MATH_FLAGS[math_mode] + (CHECKED_FLAGS if checked else [])
    key = _hash("kernel", PREPASS_VERSION, runtime_sources_hash(), comp.ident, " ".join(flags), text)
    stem = re.sub(r"[^\w.-]", "_", Path(name).stem)[:40]
    target = cache_dir() / f"{stem}-{'checked' if checked else 'fast'}-{math_mode}-{key}.so"

    def build(tmp):
        extra = ["-x", "none", "-o", tmp] + _shared_flags() + ([comp.builtins_lib] if comp.builtins_lib else [])
        proc = _compile(comp, flags, text, tmp, *extra)
        if os.environ.get("TORCH_METAL_FLASH_EMULATOR_KEEP_CPP"):
            target.with_suffix(".cpp").write_text(text)
        if proc.returncode != 0:
            raise _fail(f"compiling {name}", proc.stderr)

    return _atomic_write(target, build)
