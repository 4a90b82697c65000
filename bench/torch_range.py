"""Which torch releases ``_C`` builds against: cross-compile and link the
launcher and the C++ op core (bench/macos_cross_build.py) against the macOS
arm64 wheel of each, and check that the Python APIs the package calls exist in
the oldest (by name, in that wheel's sources).  Not part of CI: a wheel is ~100 MB.

    python bench/torch_range.py [--versions 2.10.0 ... 2.15.0]

Writes bench/results/torch_range.md.  Wheels come from ``TORCH_METAL_FLASH_WHEEL_DIR``
or are downloaded by pip once (cached with their extraction).
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import harness
import macos_cross_build as xb

VERSIONS = ["2.10.0", "2.11.0", "2.12.0", "2.13.0", "2.14.1", "2.15.0"]
# The Python APIs the package calls that are not old torch staples (grep torch_metal_flash/), each with the
# wheel file that defines it and the text that defines it there.
PYTHON_APIS = {
    "torch.library.custom_op": ("torch/_library/custom_ops.py", "def custom_op("),
    "torch.library.register_autograd": ("torch/library.py", "def register_autograd("),
    "torch.library.Library": ("torch/library.py", "class Library"),
    "CustomOpDef.register_fake": ("torch/_library/custom_ops.py", "def register_fake("),
    "OpOverload._op_dk": ("torch/_ops.py", "_op_dk"),
    "torch._C._AutoDispatchBelowAutograd": ("torch/_C/__init__.pyi", "class _AutoDispatchBelowAutograd"),
    "torch._C.DispatchKey.CompositeImplicitAutograd": ("torch/_C/__init__.pyi", "CompositeImplicitAutograd"),
    "torch._native_multi_head_attention": ("torch/_C/_VariableFunctions.pyi", "def _native_multi_head_attention("),
    "torch._transformer_encoder_layer_fwd": ("torch/_C/_VariableFunctions.pyi", "def _transformer_encoder_layer_fwd("),
    "torch.compiler.is_compiling": ("torch/compiler/__init__.py", "def is_compiling("),
    "torch.mps.synchronize": ("torch/mps/__init__.py", "def synchronize("),
    "torch.backends.mps.is_built": ("torch/backends/mps/__init__.py", "def is_built("),
    "torch.utils.weak.WeakIdKeyDictionary": ("torch/utils/weak.py", "class WeakIdKeyDictionary"),
    "torch.overrides.TorchFunctionMode": ("torch/overrides.py", "class TorchFunctionMode"),
    "torch._C.DisableTorchFunction": ("torch/_C/__init__.pyi", "def DisableTorchFunction("),
}


def python_apis(version: str) -> list:
    """The entries of PYTHON_APIS missing from torch ``version``'s wheel."""
    with zipfile.ZipFile(xb.find_wheel(version)) as z:
        names = set(z.namelist())
        return [api for api, (path, needle) in PYTHON_APIS.items()
                if path not in names or needle not in z.read(path).decode()]


def row(version: str) -> str:
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="tmf-torch-range-") as work:
        try:
            build = xb.cross_build(version, Path(work))
            build_result = f"ok ({len(build.bound)} bound, {len(build.dynamic)} dynamic lookups, all provided)"
        except xb.CrossBuildError as exc:
            build_result = f"**{exc.stage} failed**: {' '.join(str(exc).split())[:300]}"
    try:
        std = xb.torch_tree(version, xb.Tools.find()).default_std()
    except xb.CrossBuildError:
        std = "?"
    missing = python_apis(version)
    apis = "all present" if not missing else "missing: " + ", ".join(missing)
    return f"| {version} | {std} | {build_result} | {apis} | {time.time() - start:.0f} |"


def _commit() -> str:
    return subprocess.run(["git", "-C", str(xb.ROOT), "describe", "--always", "--dirty"], capture_output=True,
                          text=True).stdout.strip() or "unknown"


def main(argv=None) -> int:
    parser = harness.parser(__doc__)
    parser.add_argument("--versions", nargs="+", default=VERSIONS)
    opts = parser.parse_args(argv)
    commit = _commit()  # before the builds: what they built
    rows = []
    for version in opts.versions:
        rows.append(row(version))
        print(rows[-1], flush=True)
    out = harness.write_result("torch_range.md", "\n".join([
        "# torch versions `_C` builds against (macOS arm64, cross-compiled)", "",
        f"Command: `python bench/torch_range.py{' --versions ' + ' '.join(opts.versions) if opts.versions != VERSIONS else ''}`"
        f" at commit {commit} (SDK: {xb.sdk_path().name}, target {xb.TARGET}, clang/ld64.lld 19)", "",
        "Each row: the launcher and the C++ op core compiled with setup.py's flags and that wheel's "
        "cpp_extension default `-std`, `-Wall -Wextra -Wunguarded-availability-new` clean in our files, linked "
        "into a Mach-O bundle against the wheel's dylibs, every undefined symbol provided "
        "(bench/macos_cross_build.py); and the Python APIs newer than torch 2.0 that the package calls, looked up "
        "in the wheel's sources. On Linux (kernels in the emulator, CI), 2.13 runs the whole test suite and 2.15 the README's demo and the layers torch's internals reach (.ci/run).", "",
        "| torch | cpp_extension -std | cross-build and link | Python APIs | seconds |", "|---|---|---|---|---|",
        *rows]) + "\n")
    print(f"wrote {out}")
    return 0 if all("failed" not in r and "missing" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
