"""Building the C++ op core where no prebuilt extension ships it (Linux; macOS without ``_C``).

``csrc/core/*.cpp`` are compiled against the installed torch into one extension
module at first use and cached next to the emulator's builds (same directory,
same atomic-rename scheme), keyed by the sources, flags, compiler, torch and
Python: later processes only load it.  The compiler is the emulator's clang
(``TORCH_METAL_FLASH_CXX``; it links against torch's libstdc++), or
``TORCH_METAL_FLASH_CORE_CXX`` / ``c++`` when that clang is the ziglang one
(libc++ cannot link with torch).
"""
from __future__ import annotations

import concurrent.futures
import importlib.util
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch

from .._paths import csrc_dir
from ..emulator import compiler as emc
from ..emulator.errors import CompilerNotFoundError

MODULE_NAME = "_tmf_core"


def _compiler_argv() -> list:
    env = os.environ.get("TORCH_METAL_FLASH_CORE_CXX")
    if env:
        return env.split()
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


def _flags() -> list:
    torch_dir = Path(torch.__file__).parent
    include = torch_dir / "include"
    flags = ["-std=c++17", "-O2", "-fPIC", "-w", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
             "-DTORCH_API_INCLUDE_EXTENSION_H", f"-DTORCH_EXTENSION_NAME={MODULE_NAME}",
             "-isystem", str(include), "-isystem", str(include / "torch" / "csrc" / "api" / "include"),
             "-isystem", sysconfig.get_paths()["include"]]
    return flags


def _link_flags() -> list:
    lib = Path(torch.__file__).parent / "lib"
    flags = ["-shared", f"-L{lib}", "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python", f"-Wl,-rpath,{lib}"]
    if sys.platform == "darwin":
        flags += ["-undefined", "dynamic_lookup"]
    return flags


def _run(argv: list, what: str) -> str:
    """stdout of ``argv``; a CompileError naming ``what`` and clang's message when it fails."""
    proc = emc._run(argv)
    if proc.returncode != 0:
        raise emc._fail(what, proc.stderr)
    return proc.stdout


def _sources() -> list[Path]:
    return sorted((csrc_dir() / "core").glob("*.cpp"))


def build() -> Path:
    """The path of the built core module (compiled now when not cached)."""
    argv = _compiler_argv()
    flags, link = _flags(), _link_flags()
    folder = csrc_dir() / "core"
    files = sorted(folder.glob("*.cpp")) + sorted(folder.glob("*.h"))
    ident = " ".join(argv)
    try:
        ident = _run(argv + ["--version"], "querying the C++ compiler").splitlines()[0]
    except Exception:  # noqa: BLE001 - the version only refines the cache key
        pass
    key = emc._hash("core", ident, " ".join(flags + link), torch.__version__, sys.version, sys.platform,
                    *[f.name.encode() + f.read_bytes() for f in files])
    target = emc.cache_dir() / f"tmf_core-{key}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"

    def compile_all(tmp: str) -> None:
        with tempfile.TemporaryDirectory(dir=str(target.parent)) as objdir:
            def compile_one(src: Path) -> str:
                obj = os.path.join(objdir, src.stem + ".o")
                _run(argv + flags + ["-c", str(src), "-o", obj], f"compiling the C++ op core ({src.name})")
                return obj
            with concurrent.futures.ThreadPoolExecutor(max(1, min(len(_sources()), os.cpu_count() or 1))) as pool:
                objects = list(pool.map(compile_one, _sources()))
            _run(argv + objects + ["-o", tmp] + link, "linking the C++ op core")

    return emc._atomic_write(target, compile_all)


def load():
    """Build (when needed) and import the core module."""
    path = build()
    spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
