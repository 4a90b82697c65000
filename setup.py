"""Build: on macOS, the Objective-C++ Metal launcher (torch_metal_flash._C) and
precompiled shader libraries; elsewhere a pure-Python package.

The shaders and the emulator's C++ runtime ship as package data, from the
repo's shaders/ and csrc/ folders.  On macOS:

* ``_C`` runs only with the torch minor it was built against, so an ordinary
  (isolated) install builds none: torch is no build requirement, and the
  package builds ``_C`` at first use against the torch that runs
  (torch_metal_flash/native/build.py).  A build that can import torch
  (``--no-build-isolation``: the release wheels, the rebuild command) prebuilds
  ``_C`` against it when that torch has MPS, and records its version; a
  prebuilt ``_C`` is refused by any other torch minor.
* ``shaders/<stem>.metallib`` is compiled from each ``shaders/<stem>.metal``
  when ``xcrun -sdk macosx metal`` works (Xcode with its Metal toolchain):
  MSL 3.1 for macOS 14 (the minimum: ``bfloat`` needs MSL 3.1, and torch's MPS
  backend needs macOS 14), every ``host_name`` in the file, function constants
  left to pipeline creation; the neural-accelerator sources (``*_nax.metal``)
  as MSL 4.0 for macOS 26.2, when the SDK has it (else at run time).  The launcher loads it instead of compiling the
  source.  With Command Line Tools only there is no ``metal`` and nothing is
  precompiled: the launcher compiles the sources at first use.
  ``TORCH_METAL_FLASH_METALLIB=0`` skips this step, ``=1`` makes a missing
  toolchain an error.

``_build_info.json`` in the package records what was built (printed by
``python -m torch_metal_flash doctor``).
"""
import concurrent.futures
import json
import os
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

PACKAGE_DATA_DIRS = {name: folder for name, folder in
                     {"torch_metal_flash.shaders": "shaders", "torch_metal_flash._csrc": "csrc"}.items()
                     if os.path.isdir(folder)}
HERE = os.path.dirname(os.path.abspath(__file__))
XCRUN = ["xcrun", "-sdk", "macosx"]
METAL_STD = "metal3.1"
MACOS_MIN = "14.0"
# The neural-accelerator kernels (shaders/*_nax.metal): MSL 4.0, for macOS 26.2+ (docs/metal_launcher.md).
NAX_SUFFIX = "_nax.metal"
NAX_METAL_STD = "metal4.0"
NAX_MACOS_MIN = "26.2"
# The one math mode of the package: safe, as the launcher's run-time compiles on
# every macOS (csrc/metal/launcher.mm, docs/metal_launcher.md).
MATH_MODE, MATH_FLAGS = "safe", ["-fno-fast-math"]


def _targets():
    """torch_metal_flash/native/targets.py, loaded by path: the package itself imports torch."""
    return runpy.run_path(os.path.join(HERE, "torch_metal_flash", "native", "targets.py"), run_name="tmf_targets")


def macos_extension_args() -> dict:
    """What ``CppExtension`` gets for ``_C`` on macOS (paths relative to this folder): the
    launcher target of torch_metal_flash/native/targets.py, which the build at first use
    compiles too.  No ``-std``: cpp_extension's default is the one torch's headers need.
    bench/macos_cross_build.py cross-builds the same target on Linux
    (tests/tooling/test_cross_build.py)."""
    target = _targets()["launcher"](Path(HERE, "csrc"))
    return dict(sources=[f"csrc/{s}" for s in target.sources],
                extra_compile_args={"cxx": list(target.compile_flags)},
                extra_link_args=list(target.link_flags))


def extension():
    """``(ext_modules, cmdclass, torch version, note)``: the launcher on macOS with an MPS torch."""
    if sys.platform != "darwin":
        return [], {}, None, f"not built on {sys.platform} (macOS only)"
    try:
        import torch
    except ImportError:
        return [], {}, None, ("not prebuilt (no torch at build time): built at first use against the torch "
                              "that runs")
    oldest, newest, minor = (_targets()[k] for k in ("TORCH_OLDEST", "TORCH_NEWEST", "torch_minor"))
    if not oldest <= minor(torch.__version__) <= newest:
        raise RuntimeError(f"torch_metal_flash: building _C against torch {torch.__version__}, outside the supported "
                           f"{_targets()['TORCH_REQUIREMENT']}")
    if not torch.backends.mps.is_built():
        return [], {}, torch.__version__, f"torch {torch.__version__} was built without MPS"
    from torch.utils.cpp_extension import BuildExtension, CppExtension
    ext = CppExtension("torch_metal_flash._C", **macos_extension_args())
    return [ext], {"build_ext": BuildExtension}, torch.__version__, True


def _run(cmd):
    return subprocess.run(cmd, capture_output=True, text=True)


def metal_toolchain():
    """The first line of ``metal --version``, or None when ``xcrun -sdk macosx metal`` cannot run."""
    try:
        result = _run([*XCRUN, "metal", "--version"])
    except OSError:
        return None
    return (result.stdout.strip().splitlines() or ["metal"])[0] if result.returncode == 0 else None


def compile_metallibs(shader_dir: Path, out_dir: Path) -> dict:
    """``out_dir/<stem>.metallib`` for every ``shader_dir/<stem>.metal``; returns the build record.

    ``*_nax.metal`` sources are compiled as MSL 4.0 for macOS 26.2 when this compiler takes
    ``-std=metal4.0`` (an SDK from 26 on), and otherwise left to the launcher, which compiles
    them at run time where the neural-accelerator path is active.
    """
    sources = sorted(shader_dir.glob("*.metal"))
    nax_sources = [s for s in sources if s.name.endswith(NAX_SUFFIX)]
    with tempfile.TemporaryDirectory() as tmp:
        probe = Path(tmp, "probe.metal")
        probe.write_text("kernel void probe(device float* x [[buffer(0)]]) { x[0] = 1.0f; }\n")

        def probe_fails(*flags) -> bool:
            """Whether this compiler rejects ``flags`` -- the very flags a real compile uses."""
            return bool(_run([*XCRUN, "metal", *flags, "-c", str(probe), "-o", str(probe.with_suffix(".air"))])
                        .returncode)
        math_mode, math_flags = MATH_MODE, MATH_FLAGS
        flags = [f"-std={METAL_STD}", f"-mmacosx-version-min={MACOS_MIN}"]
        nax_flags = [f"-std={NAX_METAL_STD}", f"-mmacosx-version-min={NAX_MACOS_MIN}"]
        nax_precompiled = bool(nax_sources) and not probe_fails(*nax_flags, *math_flags)

        def compile_one(source: Path) -> str:
            air = Path(tmp, source.stem + ".air")
            library = out_dir / (source.stem + ".metallib")
            for cmd in ([*XCRUN, "metal", *(nax_flags if source in nax_sources else flags), *math_flags,
                         "-I", str(shader_dir), "-c", str(source), "-o", str(air)],
                        [*XCRUN, "metallib", str(air), "-o", str(library)]):
                result = _run(cmd)
                if result.returncode:
                    raise RuntimeError(f"torch_metal_flash: `{' '.join(cmd)}` failed:\n{result.stderr}\n"
                                       "Set TORCH_METAL_FLASH_METALLIB=0 to skip the precompiled shaders "
                                       "(the launcher then compiles the sources at first use).")
            return library.name

        compiled = [s for s in sources if s not in nax_sources or nax_precompiled]
        with concurrent.futures.ThreadPoolExecutor() as pool:  # one compiler process per file
            files = dict(zip(compiled, pool.map(compile_one, compiled)))
    nax = {"files": [files[s] for s in nax_sources], "std": NAX_METAL_STD, "macos_min": NAX_MACOS_MIN} \
        if nax_precompiled or not nax_sources else \
        f"not precompiled: this Metal compiler does not take {' '.join(nax_flags)} (an SDK before macOS 26); " \
        "the launcher compiles them at run time"
    return {"files": [files[s] for s in sources if s not in nax_sources], "std": METAL_STD, "macos_min": MACOS_MIN,
            "math_mode": math_mode, "nax": nax}


def metallib_step(shader_dir: Path, out_dir: Path):
    """The ``metallib`` entry of the build record: what was compiled, or why nothing."""
    choice = os.environ.get("TORCH_METAL_FLASH_METALLIB", "auto").strip().lower() or "auto"
    if choice not in ("auto", "0", "1"):
        raise ValueError(f"TORCH_METAL_FLASH_METALLIB must be auto, 0 or 1, got {choice!r}")
    if sys.platform != "darwin":
        return f"not built on {sys.platform} (macOS only)"
    if choice == "0":
        return "skipped (TORCH_METAL_FLASH_METALLIB=0)"
    compiler = metal_toolchain()
    if compiler is None:
        why = "`xcrun -sdk macosx metal` is not available (Command Line Tools only, or no Metal toolchain)"
        if choice == "1":
            raise RuntimeError(f"torch_metal_flash: TORCH_METAL_FLASH_METALLIB=1 but {why}")
        return why
    return dict(compile_metallibs(shader_dir, out_dir), compiler=compiler)


class BuildPy(build_py):
    """build_py, then the precompiled shaders and the build record next to the package."""

    torch_version = None
    extension_note = None

    def run(self):
        super().run()
        if self.dry_run or getattr(self, "editable_mode", False):
            return  # an editable install runs from the checkout: shaders compile at first use
        package = Path(self.build_lib, "torch_metal_flash")
        shaders = package / "shaders"
        record = {"platform": sys.platform, "torch": self.torch_version, "extension": self.extension_note,
                  "metallib": metallib_step(shaders, shaders) if shaders.is_dir() else "no shaders folder"}
        (package / "_build_info.json").write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    modules, cmdclass, BuildPy.torch_version, BuildPy.extension_note = extension()
    setup(
        packages=find_packages(include=["torch_metal_flash", "torch_metal_flash.*"]) + list(PACKAGE_DATA_DIRS),
        package_dir={name: folder for name, folder in PACKAGE_DATA_DIRS.items()},
        package_data={
            "torch_metal_flash.shaders": ["*.metal", "*.h"],
            "torch_metal_flash._csrc": ["**/*"],
        },
        ext_modules=modules,
        cmdclass={**cmdclass, "build_py": BuildPy},
    )
