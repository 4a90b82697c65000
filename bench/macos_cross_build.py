"""Cross-build ``torch_metal_flash._C`` for arm64 macOS on Linux, and audit its link.

What a Mac builds (``setup.py``'s ``macos_extension_args()``: the launcher target of
``torch_metal_flash/native/targets.py``, which the build at first use compiles too: the
launcher and the C++ op core, with its flags), compiled by clang for
``arm64-apple-macos14.0`` against Apple's macOS SDK headers and a torch macOS
wheel's headers, with the flags ``torch.utils.cpp_extension`` adds (that
wheel's default ``-std``, its include folders as ``-I``, ``TORCH_EXTENSION_NAME``)
and ``-DNDEBUG`` (every Mac Python's CFLAGS have it).  Then:

* ``-Wall -Wextra -Wunguarded-availability-new``: no warning may point into our
  files (torch's headers warn too; those are not ours to fix);
* the objects are linked by ld64.lld into a Mach-O bundle against the wheel's
  dylibs (as ``.tbd`` stubs made from them) and the SDK's frameworks, as
  cpp_extension links it (``-bundle -undefined dynamic_lookup``);
* every symbol left to dynamic lookup must be one something on a Mac
  provides: the Python C API (this interpreter's libpython exports: same
  version as the wheel's), a libSystem/libc++ symbol that the wheel's own
  dylibs import (the SDK subset has no ``.tbd`` for those two), a symbol of
  the C++ runtime (``std``, ``__cxxabiv1``, ``operator new``...: libc++'s, whose
  availability the SDK's libc++ headers check at compile time), or a
  compiler-rt builtin Apple's clang links (``___isPlatformVersionAtLeast``,
  behind ``@available``).  Anything else -- a torch symbol the wheel does not
  export, one of ours never defined -- fails, named.  Symbols that ld64.lld bound
  to a dylib or framework were checked by it against their exports.

Inputs: the SDK folder (``TORCH_METAL_FLASH_MACOS_SDK``, default
``../shared/macos-sdk`` next to the checkout; a subset without
MetalPerformanceShaders, whose few classes torch's ``MPSStream.h`` names come
from ``csrc/metal/typecheck_stubs``), clang/ld64.lld/llvm 19 (``apt-get install
clang-19 lld-19 llvm-19``), and the torch macOS wheel of this Python's version:
found in ``TORCH_METAL_FLASH_WHEEL_DIR`` or downloaded once by pip, and extracted
(headers, dylib stubs, ``cpp_extension.py``) under
``~/.cache/torch_metal_flash/macos-cross``.

    python bench/macos_cross_build.py [--torch 2.13.0] [--plant nil|unguarded|unguarded26|missing]

``--plant`` adds a translation unit with a defect the build must catch (the
tests do the same: ``tests/tooling/test_cross_build.py``).  Exit status 1 names what failed.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import os
import re
import runpy
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET = "arm64-apple-macos14.0"
CACHE = Path.home() / ".cache" / "torch_metal_flash" / "macos-cross"
CACHE_FORMAT = "1"  # bump when the extracted layout changes
INSTALL_HINT = "apt-get install clang-19 lld-19 llvm-19"
OUR_WARNINGS = ["-Wall", "-Wextra", "-Wunguarded-availability-new"]
# Builtins of compiler-rt's libclang_rt.osx.a, which Apple's clang links into every binary (not on Linux).
COMPILER_RT = {"___isPlatformVersionAtLeast", "___isOSVersionAtLeast"}
# Mangled names of the C++ runtime (libc++ / libc++abi): std:: (and its std::__1 ABI namespace),
# __cxxabiv1, operator new/delete, the Itanium EH entry points, type_info of fundamental types.
CXX_RUNTIME = re.compile(r"^(__Z[NK]*(TV|TI|TS|TT)?N?K?St|__ZSt|__ZTVN10__cxxabiv1|__Zn[wa]|__Zd[la]|___cxa_|"
                         r"___gxx_personality_v0$|___dynamic_cast$|__Unwind_|__ZTI(P?K?)[a-z]$)")


class CrossBuildError(RuntimeError):
    """A stage of the cross-build failed; ``stage`` is one of tools, sdk, wheel, compile, warnings, link, symbols."""

    def __init__(self, stage: str, message: str):
        super().__init__(f"{stage}: {message}")
        self.stage = stage


# ------------------------------------------------------------------------------------------- inputs

@dataclass(frozen=True)
class Tools:
    clang: str
    ld64: str
    nm: str
    readtapi: str
    cxxfilt: str

    @staticmethod
    def find() -> "Tools":
        found, missing = {}, []
        for key, name in (("clang", "clang"), ("ld64", "ld64.lld"), ("nm", "llvm-nm"), ("readtapi", "llvm-readtapi"),
                          ("cxxfilt", "llvm-cxxfilt")):
            path = shutil.which(f"{name}-19") or shutil.which(f"/usr/lib/llvm-19/bin/{name}")
            if path is None:
                missing.append(f"{name}-19")
            found[key] = path
        if missing:
            raise CrossBuildError("tools", f"{', '.join(missing)} not found ({INSTALL_HINT})")
        return Tools(**found)


def sdk_path() -> Path:
    """The macOS SDK folder (``MacOSX*.sdk`` inside ``TORCH_METAL_FLASH_MACOS_SDK`` or ``../shared/macos-sdk``)."""
    base = Path(os.environ.get("TORCH_METAL_FLASH_MACOS_SDK") or ROOT.parent / "shared" / "macos-sdk")
    candidates = [base] if base.name.endswith(".sdk") else sorted(base.glob("MacOSX*.sdk"))
    if not candidates or not (candidates[-1] / "System" / "Library" / "Frameworks" / "Metal.framework").is_dir():
        raise CrossBuildError("sdk", f"no macOS SDK with Metal.framework in {base} (set TORCH_METAL_FLASH_MACOS_SDK "
                                     "to a folder holding MacOSX<version>.sdk)")
    return candidates[-1]


def python_tag() -> str:
    return f"cp{sys.version_info.major}{sys.version_info.minor}"


def _wheel_glob(version: str) -> str:
    return f"torch-{version}-*{python_tag()}-*-macosx_*_arm64.whl"  # 2.10.0 has a build tag: torch-2.10.0-2-cp311-none-...


def find_wheel(version: str) -> Path:
    """The torch ``version`` macOS arm64 wheel for this Python: in ``TORCH_METAL_FLASH_WHEEL_DIR``, the cache, or pip's."""
    dirs = [Path(d) for d in os.environ.get("TORCH_METAL_FLASH_WHEEL_DIR", "").split(os.pathsep) if d]
    dirs.append(CACHE / "wheels")
    for d in dirs:
        hits = sorted(d.glob(_wheel_glob(version)))
        if hits:
            return hits[-1]
    (CACHE / "wheels").mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--platform",
           "macosx_14_0_arm64", "--python-version", f"{sys.version_info.major}.{sys.version_info.minor}",
           f"torch=={version}", "-d", str(CACHE / "wheels")]
    # One exact wheel for another platform: a site constraint file capping installable torch releases
    # (pip's `constraint` setting) is not meant for it.
    result = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PIP_CONSTRAINT=os.devnull))
    hits = sorted((CACHE / "wheels").glob(_wheel_glob(version)))
    if result.returncode or not hits:
        raise CrossBuildError("wheel", f"`{' '.join(cmd)}` failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
    return hits[-1]


def _atomic_dir(final: Path, fill) -> Path:
    """``final``, made by ``fill(tmp)`` in a temporary folder renamed into place (safe across processes)."""
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=final.name + ".", dir=final.parent))
    try:
        fill(tmp)
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


@dataclass(frozen=True)
class TorchTree:
    """A torch macOS wheel's build inputs: ``include/``, ``lib/`` (link stubs), ``cpp_extension.py``."""
    version: str
    root: Path

    @property
    def include(self) -> Path:
        return self.root / "include"

    @property
    def lib(self) -> Path:
        return self.root / "lib"

    def default_std(self) -> str:
        """The ``-std=`` cpp_extension appends when an extension gives none (c++17 up to torch 2.11, c++20 since)."""
        targets = runpy.run_path(str(ROOT / "torch_metal_flash" / "native" / "targets.py"), run_name="tmf_targets")
        try:  # the parser the first-use build reads the running torch with
            return targets["cxx_standard"]((self.root / "cpp_extension.py").read_text())
        except LookupError as exc:
            raise CrossBuildError("wheel", f"torch {self.version}: {exc}") from None

    def imports(self) -> set:
        """What the wheel's dylibs import from libSystem and libc++ (they load on every Mac this torch runs on)."""
        return set((self.root / "system_imports.txt").read_text().split())


def torch_tree(version: str, tools: Tools) -> TorchTree:
    """The extracted wheel of torch ``version`` (extracted once into the cache)."""
    final = CACHE / f"torch-{version}-{python_tag()}-macos-arm64-v{CACHE_FORMAT}"

    def fill(tmp: Path):
        wheel = find_wheel(version)
        with zipfile.ZipFile(wheel) as z:
            names = [n for n in z.namelist() if n.startswith("torch/include/") or n == "torch/utils/cpp_extension.py"
                     or (n.startswith("torch/lib/") and n.endswith(".dylib"))]
            z.extractall(tmp, names)
        shutil.move(str(tmp / "torch" / "include"), tmp / "include")
        shutil.move(str(tmp / "torch" / "utils" / "cpp_extension.py"), tmp / "cpp_extension.py")
        (tmp / "lib").mkdir()
        imports = set()
        for dylib in sorted((tmp / "torch" / "lib").glob("*.dylib")):
            nm = _run([tools.nm, "-m", str(dylib)])
            imports |= set(re.findall(r"\(undefined\) external (\S+) \(from (?:libSystem|libc\+\+)\)", nm.stdout))
            stub = tmp / "lib" / (dylib.stem + ".tbd")
            if _run([tools.readtapi, "--stubify", str(dylib), "-o", str(stub)]).returncode:
                # readtapi cannot stub a dylib that exports nothing (libtorch.dylib): keep it, it is small
                stub.unlink(missing_ok=True)
                shutil.copy(dylib, tmp / "lib" / dylib.name)
        (tmp / "system_imports.txt").write_text("\n".join(sorted(imports)) + "\n")
        shutil.rmtree(tmp / "torch")

    return TorchTree(version, _atomic_dir(final, fill))


def link_sdk(sdk: Path) -> Path:
    """A symlink copy of the SDK's link stubs in which each framework also has the ``Versions/<X>`` its install
    name says (the packaged SDK only has ``Versions/Current``; re-exports are found by install name)."""
    stubs = sorted(p.relative_to(sdk) for p in sdk.rglob("*.tbd"))
    key = hashlib.sha256(("\n".join(map(str, stubs)) + str(sdk)).encode()).hexdigest()[:16]

    def fill(tmp: Path):
        for rel in stubs:
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).symlink_to(sdk / rel)
            match = re.search(r"install-name:\s*'?([^'\n]+)", (sdk / rel).read_text())
            version = re.search(r"/Versions/([^/]+)/[^/]+$", match.group(1)) if match else None
            if version and rel.parent.name == "Current":
                link = tmp / rel.parent.parent / version.group(1)
                if not link.exists():
                    link.symlink_to("Current")

    return _atomic_dir(CACHE / f"sdk-link-{key}", fill)


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)


# ------------------------------------------------------------------------------------------- build

def extension_args() -> dict:
    """setup.py's ``macos_extension_args()``: sources (relative to the checkout), compile and link flags."""
    return runpy.run_path(str(ROOT / "setup.py"), run_name="tmf_setup")["macos_extension_args"]()


@dataclass
class Build:
    """One cross-build configuration: the torch tree, the SDK, the flags; compile and link with it."""
    torch: TorchTree
    sdk: Path
    tools: Tools
    work: Path
    args: dict = field(default_factory=extension_args)
    bound: list = field(default_factory=list)  # (symbol, library) ld64.lld bound, after link()
    dynamic: list = field(default_factory=list)  # symbols left to dynamic lookup (all audited), after link()

    def __post_init__(self):
        mps = self.work / "mps_headers"  # MetalPerformanceShaders(Graph) stubs only: the rest is the real SDK
        mps.mkdir(parents=True, exist_ok=True)
        for name in ("MetalPerformanceShaders", "MetalPerformanceShadersGraph"):
            if not (mps / name).exists():
                (mps / name).symlink_to(ROOT / "csrc" / "metal" / "typecheck_stubs" / name)
        self._mps = mps

    def compile_flags(self) -> list:
        """setup.py's flags plus what cpp_extension adds (its -std default and defines), as clang gets them."""
        flags = list(self.args["extra_compile_args"]["cxx"])
        flags += ["-DTORCH_API_INCLUDE_EXTENSION_H", "-DTORCH_EXTENSION_NAME=_C"]  # BuildExtension
        if not any(f.startswith("-std=") for f in flags):
            flags.append(self.torch.default_std())
        includes = [self.torch.include, self.torch.include / "torch" / "csrc" / "api" / "include",
                    sysconfig.get_paths()["include"]]  # CppExtension's include_dirs, then Python's
        return ["-target", TARGET, "-isysroot", str(self.sdk), "-isystem", str(self._mps), "-fPIC", "-O0", "-DNDEBUG",
                *OUR_WARNINGS, *flags, *(f"-I{d}" for d in includes)]

    def compile(self, source: Path, extra_includes=()) -> Path:
        """``source`` compiled to an object in ``work``; raises on an error or on a warning in our files."""
        obj = self.work / (source.stem + ".o")
        cmd = [self.tools.clang, *self.compile_flags(), *(f"-I{d}" for d in extra_includes), "-c", str(source),
               "-o", str(obj)]
        result = _run(cmd)
        ours = our_diagnostics(result.stderr, exclude=[self.torch.root, Path(sysconfig.get_paths()["include"])])
        if result.returncode:
            raise CrossBuildError("compile", f"{source.name} does not compile for {TARGET}:\n"
                                             f"{ours or result.stderr[-6000:]}")
        if ours:
            raise CrossBuildError("warnings", f"{source.name} has warnings in our files:\n{ours}")
        return obj

    def compile_all(self, sources) -> list:
        """All ``sources`` (in parallel, one clang per core)."""
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(len(sources), os.cpu_count() or 1))) as pool:
            return list(pool.map(self.compile, sources))

    def link(self, objects, name="_C.so") -> Path:
        """A Mach-O bundle from ``objects``, linked as cpp_extension links ``_C``; raises naming unresolved symbols."""
        out = self.work / name
        libraries = ["c10", "torch", "torch_cpu", "torch_python"]  # CppExtension's
        cmd = [self.tools.clang, "-target", TARGET, "-isysroot", str(link_sdk(self.sdk)), "-fuse-ld=lld",
               f"--ld-path={self.tools.ld64}", "-bundle", "-undefined", "dynamic_lookup",
               "-nostdlib",  # no libSystem/libc++ stubs in the SDK subset: their symbols are audited below
               *map(str, objects), f"-L{self.torch.lib}", *(f"-l{lib}" for lib in libraries),
               *self.args["extra_link_args"], "-o", str(out)]
        result = _run(cmd)
        if result.returncode:
            raise CrossBuildError("link", f"ld64.lld failed:\n{result.stderr[-6000:]}")
        self.audit(out, objects)
        return out

    def audit(self, bundle: Path, objects) -> None:
        """Every symbol left to dynamic lookup must be provided on a Mac (module docstring)."""
        listing = _run([self.tools.nm, "-m", str(bundle)]).stdout
        bound = re.findall(r"\(undefined\) external (\S+) \(from (\S+)\)", listing)
        dynamic = re.findall(r"\(undefined\) external (\S+) \(dynamically looked up\)", listing)
        python, system = python_exports(self.tools), self.torch.imports()
        unresolved = [s for s in dynamic if not (s[1:] in python or s in system or s in COMPILER_RT
                                                 or CXX_RUNTIME.match(s))]
        if unresolved:
            users = {}
            for obj in objects:
                for sym in _run([self.tools.nm, "-u", "-j", str(obj)]).stdout.split():
                    users.setdefault(sym, []).append(Path(obj).name)
            names = _run([self.tools.cxxfilt, "-_", *unresolved]).stdout.splitlines() or unresolved
            lines = [f"  {mangled} ({plain}) used by {', '.join(users.get(mangled, ['?']))}"
                     for mangled, plain in zip(unresolved, names)]
            raise CrossBuildError("symbols", f"{len(unresolved)} undefined symbol(s) that nothing on a Mac provides "
                                             "(not exported by the torch wheel, the SDK's frameworks, Python, "
                                             "libSystem/libc++ or compiler-rt):\n" + "\n".join(lines))
        self.bound = bound
        self.dynamic = dynamic


def our_diagnostics(stderr: str, exclude) -> str:
    """The diagnostics (with their notes) whose location is in none of the ``exclude`` trees or the SDK."""
    blocks, current = [], None
    for line in stderr.splitlines():
        match = re.match(r"^(.+?):\d+:\d+: (warning|error|fatal error|note): ", line)
        if match and match.group(2) != "note":
            path = os.path.realpath(match.group(1))
            theirs = any(path.startswith(os.path.realpath(t) + os.sep) for t in exclude) or ".sdk/" in path
            current = None if theirs else [line]
            if current is not None:
                blocks.append(current)
        elif current is not None and not line.startswith("In file included from"):
            current.append(line)
    return "\n".join("\n".join(b) for b in blocks)


_PYTHON_EXPORTS: set | None = None


def python_exports(tools: Tools) -> set:
    """The C API this interpreter's libpython (or executable) exports: the wheel is for the same Python version."""
    global _PYTHON_EXPORTS
    if _PYTHON_EXPORTS is None:
        lib = Path(sysconfig.get_config_var("LIBDIR") or "", sysconfig.get_config_var("LDLIBRARY") or "")
        binary = lib if lib.suffix == ".so" or ".so." in lib.name else Path(os.path.realpath(sys.executable))
        listing = _run([tools.nm, "-D", "--defined-only", "-j", str(binary)]).stdout
        _PYTHON_EXPORTS = set(listing.split())
        if not any(s.startswith("Py_") for s in _PYTHON_EXPORTS):
            raise CrossBuildError("tools", f"no Python C API exports found in {binary}")
    return _PYTHON_EXPORTS


def sources(args: dict | None = None) -> list:
    return [ROOT / s for s in (args or extension_args())["sources"]]


# ------------------------------------------------------------------------------------------- defects

# Translation units with one defect each, compiled with the same flags and linked with the real objects.
PLANTED = {
    "nil": ("planted_nil.mm", """
#import <Foundation/Foundation.h>
#import <Metal/Metal.h>
id<MTLLibrary> planted_nil(id<MTLDevice> device) {
  return [device newLibraryWithSource:nil options:nil error:nil];  // the source is nonnull
}
"""),
    "unguarded": ("planted_unguarded.mm", """
#import <Foundation/Foundation.h>
#import <Metal/Metal.h>
#include "metal/macos15_api.h"
void planted_unguarded(MTLCompileOptions* options) {
  options.mathMode = MTLMathModeRelaxed;  // macOS 15 API outside @available
}
"""),
    "unguarded26": ("planted_unguarded26.mm", """
#import <Foundation/Foundation.h>
#import <Metal/Metal.h>
#include "metal/macos26_api.h"
void planted_unguarded26(MTLCompileOptions* options) {
  options.languageVersion = MTLLanguageVersion4_0;  // MSL 4.0 (macOS 26) outside @available
}
"""),
    "missing": ("planted_missing.cpp", """
namespace at { namespace mps { void planted_missing_symbol(); } }
void planted_missing() { at::mps::planted_missing_symbol(); }
"""),
}


def plant(build: Build, defect: str) -> Path:
    """The object of the planted ``defect`` (compiling it may already raise)."""
    name, text = PLANTED[defect]
    source = build.work / name
    source.write_text(text.lstrip())
    return build.compile(source, extra_includes=[ROOT / "csrc"])


# ------------------------------------------------------------------------------------------- main

def cross_build(version: str, work: Path, planted=()) -> Build:
    """Compile and link ``_C`` (plus any ``planted`` defects) against torch ``version``; raises CrossBuildError."""
    tools = Tools.find()
    sdk = sdk_path()
    build = Build(torch_tree(version, tools), sdk, tools, work)
    objects = build.compile_all(sources(build.args))
    objects += [plant(build, d) for d in planted]
    build.link(objects)
    return build


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--torch", default="2.13.0", help="torch version of the macOS wheel (default 2.13.0)")
    parser.add_argument("--plant", choices=sorted(PLANTED), action="append", default=[],
                        help="add a translation unit with this defect (the build must then fail)")
    opts = parser.parse_args(argv)
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="tmf-macos-cross-") as work:
        try:
            build = cross_build(opts.torch, Path(work), opts.plant)
        except CrossBuildError as exc:
            print(f"FAILED ({time.time() - start:.0f} s) {exc}", file=sys.stderr)
            return 1
    print(f"ok: _C for {TARGET} against torch {opts.torch} compiled and linked ({time.time() - start:.0f} s); "
          f"{len(build.bound)} symbols bound to dylibs/frameworks, {len(build.dynamic)} left to dynamic lookup, "
          "all provided")
    return 0


if __name__ == "__main__":
    sys.exit(main())
