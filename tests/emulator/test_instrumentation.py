"""Audit of the checked build: every load and store of kernel code reports to the
runtime (SanitizerCoverage callbacks), none hides in memcpy/memset or wide
vector operations the callbacks never see."""
from __future__ import annotations

import re
import subprocess

from emu_helpers import KERNELS
from torch_metal_flash import emulator
from torch_metal_flash.emulator import compiler


def test_every_load_and_store_has_a_callback(tmp_path):
    comp = emulator.find_compiler()
    for name in ("language.metal", "matrix.metal"):
        lib = emulator.compile_shader(KERNELS / name)
        cpp = tmp_path / (name + ".cpp")
        cpp.write_text(lib._pre.text + lib._pre.glue)
        ll = tmp_path / (name + ".ll")
        flags = [f for f in compiler.BUILD_FLAGS + ["-O2"] + compiler.MATH_FLAGS["fast"] + compiler.CHECKED_FLAGS
                 if not f.startswith("-g")]
        subprocess.run(comp.argv + flags + ["-include", str(compiler.shim_header()), str(cpp), "-S", "-emit-llvm",
                                            "-o", str(ll)], check=True, capture_output=True)
        text = ll.read_text()
        # collective completions run in the scheduler on lane-private data, uninstrumented on purpose
        exempt = set(re.findall(r"^attributes (#\d+) = \{[^}]*nosanitize_coverage", text, re.M))
        accesses, missing, after_callback, skip = 0, [], False, False
        for line in text.splitlines():
            s = line.strip()
            if s.startswith("define "):
                skip = any(re.search(rf"{g}\b", s) for g in exempt) and "__mtl" in s
            if skip:
                continue
            if re.search(r"call void @__sanitizer_cov_(load|store)\d+\(", s):
                after_callback = True
                continue
            if re.match(r"(%\S+ = )?(load|store) ", s) and "!nosanitize" not in s:
                accesses += 1
                if not after_callback:
                    missing.append(s)
                after_callback = False
            assert not re.search(r"call .*@(llvm\.)?mem(cpy|set|move)", s), s
        assert accesses > 100 and not missing, missing[:5]
