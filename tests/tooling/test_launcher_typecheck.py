"""Type-check the macOS 15 branch of the Objective-C++ Metal launcher on Linux.

tests/tooling/test_cross_build.py builds the launcher for real against Apple's macOS
14.2 SDK, which does not declare the macOS 15 API the launcher uses behind
``@available(macOS 15.0, *)`` (``MTLCompileOptions.mathMode``...): there
``csrc/metal/macos15_api.h`` declares it.  Here clang parses the launcher as
Objective-C++ (ARC, blocks) against the real torch headers and the stub Apple
headers in csrc/metal/typecheck_stubs/ as the macOS 15 SDK declares that API
(``STUB_SDK15``, ``__MAC_15_0`` defined, so the launcher's own declarations step
aside), with torch 2.13's cpp_extension default ``-std=c++20``.  The stubs
declare exactly the Metal/Foundation API the launcher uses, with the
signatures from Apple's documentation; they cannot catch SDK mismatches they
do not model (the cross-build catches those for the macOS 14 SDK).
"""
import os
import subprocess
import sysconfig

import torch

from torch_metal_flash import emulator
from torch_metal_flash._paths import csrc_dir

TORCH_INCLUDE = os.path.join(os.path.dirname(torch.__file__), "include")
COMMON = ["-fsyntax-only", "-Wall", "-Wextra", "-Werror", "-Wno-unused-parameter",
          "-Wno-missing-field-initializers", "-isystem", TORCH_INCLUDE,
          "-isystem", os.path.join(TORCH_INCLUDE, "torch", "csrc", "api", "include"),
          "-isystem", sysconfig.get_paths()["include"], "-DTORCH_EXTENSION_NAME=_C", "-DTORCH_API_INCLUDE_EXTENSION_H",
          f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]


def test_launcher_typechecks_with_the_macos15_sdk_declarations():
    sdk = ["-std=c++20", "-DSTUB_SDK15", "-D__MAC_15_0=150000"]
    compiler = emulator.find_compiler()  # clang >= 17; raises (fails the test) when missing
    cmd = [*compiler.argv, "-x", "objective-c++", *sdk, "-fobjc-arc", "-fblocks", "-fobjc-runtime=macosx-14.0", *COMMON,
           "-isystem", str(csrc_dir() / "metal" / "typecheck_stubs"), str(csrc_dir() / "metal" / "launcher.mm")]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, f"launcher.mm does not type-check:\n{result.stderr[-4000:]}"
