"""Building the compiled extension at first use, against the torch that runs.

Where no prebuilt extension matches the running torch, :mod:`.targets`' sources are compiled
into one module and cached next to the emulator's builds (same directory, same atomic-rename
scheme), keyed by the sources, flags, compiler, torch and Python: later processes only load
it, and a build can never serve another torch.  Two targets:

* the op core (``csrc/core``) on any platform, behind the emulator and reference backends;
* on macOS the Metal launcher ``_C`` (launcher plus core), with the Command Line Tools' clang.

The C++ standard is the running torch's ``cpp_extension`` default (its headers' need).
The compiler: on macOS ``xcrun clang++``; elsewhere the emulator's clang
(``TORCH_METAL_FLASH_CXX``; it links against torch's libstdc++), or
``TORCH_METAL_FLASH_CORE_CXX`` / ``c++`` when that clang is the ziglang one (libc++ cannot
link with torch).
"""
from __future__ import annotations

import concurrent.futures
import functools
import importlib.util
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch

from .._paths import csrc_dir
import torch_metal_flash.emulator.compiler as emc
from ..emulator.errors import CompilerNotFoundError
import torch_metal_flash.native.targets as targets


def _compiler_argv(target: targets.Target) -> list:
    env = os.environ.get("TORCH_METAL_FLASH_CORE_CXX")
    if env:
        return env.split()
    if sys.platform == "darwin":
        if shutil.which("xcrun"):
            return ["xcrun", "clang++"]
        if shutil.which("clang++"):
            return ["clang++"]
        raise CompilerNotFoundError(f"building torch_metal_flash.{target.module} needs Apple's clang: install the "
                                    "Xcode Command Line Tools (`xcode-select --install`)")
    try:
        comp = emc.find_compiler()
        if not comp.is_zig:
            return list(comp.argv)
    except CompilerNotFoundError:
        pass
    for name in ("c++", "g++", "clang++"):
        if shutil.which(name):
            return [name]
    raise CompilerNotFoundError("the C++ op core needs a C++ compiler that links with torch's libstdc++ "
                                "(clang-19 or g++); set TORCH_METAL_FLASH_CORE_CXX")


@functools.lru_cache(maxsize=None)
def cxx_standard() -> str:
    """The ``-std=`` of the running torch's ``cpp_extension`` (what its headers need)."""
    return targets.cxx_standard((Path(torch.__file__).parent / "utils" / "cpp_extension.py").read_text())


def compile_flags(target: targets.Target) -> list:
    include = Path(torch.__file__).parent / "include"
    return [cxx_standard(), "-O2", "-fPIC", "-DNDEBUG", *targets.DEFINES, f"-DTORCH_EXTENSION_NAME={target.module}",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", *target.compile_flags,
            "-isystem", str(include), "-isystem", str(include / "torch" / "csrc" / "api" / "include"),
            "-isystem", sysconfig.get_paths()["include"]]


def link_flags(target: targets.Target) -> list:
    lib = Path(torch.__file__).parent / "lib"
    shape = ["-bundle", "-undefined", "dynamic_lookup"] if sys.platform == "darwin" else ["-shared"]
    return [*shape, f"-L{lib}", *(f"-l{name}" for name in targets.TORCH_LIBRARIES), f"-Wl,-rpath,{lib}",
            *target.link_flags]


def _run(argv: list, what: str) -> str:
    """stdout of ``argv``; a CompileError naming ``what`` and the compiler's message when it fails."""
    proc = emc._run(argv)
    if proc.returncode != 0:
        raise emc._fail(what, proc.stderr)
    return proc.stdout


def build(target: targets.Target) -> Path:
    """The path of the built module (compiled now when not cached)."""
    argv = _compiler_argv(target)
    flags, link = compile_flags(target), link_flags(target)
    sources = target.source_paths(csrc_dir())
    headers = sorted({h for s in sources for h in s.parent.glob("*.h")})
    ident = " ".join(argv)
    try:
        ident = _run(argv + ["--version"], "querying the C++ compiler").splitlines()[0]
    except Exception:  # noqa: BLE001 - the version only refines the cache key
        pass
    key = emc._hash(target.module, ident, " ".join(flags + link), torch.__version__, sys.version, sys.platform,
                    *[f.name.encode() + f.read_bytes() for f in sources + headers])
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    out = emc.cache_dir() / f"native-{target.module.strip('_')}-{key}{suffix}"

    def compile_all(tmp: str) -> None:
        with tempfile.TemporaryDirectory(dir=str(out.parent)) as objdir:
            def compile_one(src: Path) -> str:
                obj = os.path.join(objdir, src.stem + ".o")
                _run(argv + flags + ["-c", str(src), "-o", obj],
                     f"compiling torch_metal_flash.{target.module} ({src.name}) against torch {torch.__version__}")
                return obj
            with concurrent.futures.ThreadPoolExecutor(max(1, min(len(sources), os.cpu_count() or 1))) as pool:
                objects = list(pool.map(compile_one, sources))
            _run(argv + objects + ["-o", tmp] + link, f"linking torch_metal_flash.{target.module}")

    return emc._atomic_write(out, compile_all)


def load(target: targets.Target, name: str):
    """Build (when needed) and import ``target`` as the module ``name``."""
    path = build(target)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_core():
    """The op core on its own (no Metal encoder)."""
    return load(targets.core(csrc_dir()), targets.core(csrc_dir()).module)


def load_launcher():
    """The Metal launcher, built against the running torch (macOS)."""
    module = load(targets.launcher(csrc_dir()), "torch_metal_flash._C")
    sys.modules["torch_metal_flash._C"] = module
    return module
