"""The emulator runtime's C++ headers are self-contained: each compiles on its own with the
flags the runtime is built with, so none relies on what another file happened to include first."""
import subprocess

import pytest

from torch_metal_flash.emulator import compiler

RUNTIME = compiler.csrc_emulator_dir()
PARTS = ["runtime.cpp"] + sorted(f"runtime/{p.name}" for p in (RUNTIME / "runtime").glob("*.h"))


def _syntax_errors(path):
    argv = list(compiler.find_compiler().argv) + compiler.RUNTIME_FLAGS + ["-fsyntax-only", "-x", "c++", str(path)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    return proc.stderr if proc.returncode else None


def test_the_runtime_parts_are_listed():
    assert {"runtime/scheduler.h", "runtime/race_detector.h", "runtime/signals.h"} <= set(PARTS)


@pytest.mark.parametrize("part", PARTS)
def test_each_runtime_part_compiles_alone(part):
    assert _syntax_errors(RUNTIME / part) is None


def test_a_header_that_needs_another_fails_alone(tmp_path):
    """The check can fail: a header using the runtime's types without including them."""
    header = tmp_path / "needs_state.h"
    header.write_text("#pragma once\nint lanes(Worker* w);\n")
    assert "Worker" in _syntax_errors(header)
    header.write_text(f'#pragma once\n#include "{RUNTIME / "runtime" / "state.h"}"\nint lanes(Worker* w);\n')
    assert _syntax_errors(header) is None
