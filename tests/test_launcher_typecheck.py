"""Type-check the Objective-C++ Metal launcher on Linux.

The launcher cannot be built without the macOS SDK, but clang can parse it as
Objective-C++ (ARC, blocks) against the real torch 2.13 headers and the small
stub Apple headers in csrc/metal/typecheck_stubs/, which declare exactly the
Metal/Foundation API the launcher uses (with the signatures from Apple's
documentation), as declared before and from the macOS 15 SDK.  This catches
C++/torch API errors, misspelled selectors and a Metal encoder that no longer
implements the core's Encoder interface; it cannot catch Apple-SDK mismatches
the stubs do not model.  (The C++ op core it is the
Metal encoder of is built for real on Linux: the suite runs through it.)
"""
import os
import subprocess
import sysconfig

import pytest
import torch

from torch_metal_flash import emulator
from torch_metal_flash._paths import csrc_dir

TORCH_INCLUDE = os.path.join(os.path.dirname(torch.__file__), "include")
COMMON = ["-fsyntax-only", "-Wall", "-Wextra", "-Werror", "-Wno-unused-parameter",
          "-Wno-missing-field-initializers", "-isystem", TORCH_INCLUDE,
          "-isystem", os.path.join(TORCH_INCLUDE, "torch", "csrc", "api", "include"),
          "-isystem", sysconfig.get_paths()["include"], "-DTORCH_EXTENSION_NAME=_C", "-DTORCH_API_INCLUDE_EXTENSION_H",
          f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]


@pytest.mark.parametrize("sdk", [["-std=c++17"], ["-std=c++20", "-DSTUB_SDK15", "-D__MAC_15_0=150000"]],
                         ids=["sdk14-c++17", "sdk15-c++20"])
def test_launcher_typechecks(sdk):
    compiler = emulator.find_compiler()  # clang >= 17; raises (fails the test) when missing
    cmd = [*compiler.argv, "-x", "objective-c++", *sdk, "-fobjc-arc", "-fblocks", "-fobjc-runtime=macosx-14.0", *COMMON,
           "-isystem", str(csrc_dir() / "metal" / "typecheck_stubs"), str(csrc_dir() / "metal" / "launcher.mm")]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, f"launcher.mm does not type-check:\n{result.stderr[-4000:]}"
