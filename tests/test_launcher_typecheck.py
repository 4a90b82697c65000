"""Type-check the Objective-C++ Metal launcher on Linux.

It cannot be built without the macOS SDK, but clang can parse it as
Objective-C++ (ARC, blocks) against the real torch 2.13 headers and the small
stub Apple headers in csrc/metal/typecheck_stubs/, which declare exactly the
Metal/Foundation API the launcher uses (with the signatures from Apple's
documentation).  This catches C++/torch API errors and misspelled selectors;
it cannot catch Apple-SDK mismatches the stubs do not model.
"""
import os
import subprocess
import sysconfig

import torch

from torch_metal_flash import emulator
from torch_metal_flash._paths import csrc_dir


def test_launcher_typechecks():
    compiler = emulator.find_compiler()  # clang >= 17; raises (fails the test) when missing
    torch_include = os.path.join(os.path.dirname(torch.__file__), "include")
    cmd = [*compiler.argv, "-x", "objective-c++", "-std=c++17", "-fobjc-arc", "-fblocks",
           "-fobjc-runtime=macosx-14.0", "-fsyntax-only", "-Wall", "-Wextra", "-Werror",
           "-Wno-unused-parameter", "-Wno-missing-field-initializers",
           "-isystem", str(csrc_dir() / "metal" / "typecheck_stubs"),
           "-isystem", torch_include, "-isystem", os.path.join(torch_include, "torch", "csrc", "api", "include"),
           "-isystem", sysconfig.get_paths()["include"],
           "-DTORCH_EXTENSION_NAME=_C", "-DTORCH_API_INCLUDE_EXTENSION_H",
           str(csrc_dir() / "metal" / "launcher.mm")]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, f"launcher.mm does not type-check:\n{result.stderr[-4000:]}"
