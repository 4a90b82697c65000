"""Metal's compile-time rules: every kernel in kernels/rejected/ breaks one.

Each file names the rule in its first line (``// expect: <rule>``) and marks
the line the error must point at with ``// error``.  The emulator must reject
it like Apple's compiler, with a CompileError naming the file, the line and
the MSL rule.
"""
import re
from pathlib import Path

import pytest
import torch

from torch_metal_flash import emulator
from torch_metal_flash.emulator import rules

REJECTED = sorted((Path(__file__).parent / "kernels" / "rejected").glob("*.metal"))


def test_every_rule_has_a_rejected_kernel():
    assert len(REJECTED) >= 30
    expected = {re.search(r"// expect: (\S+)", p.read_text()).group(1) for p in REJECTED}
    named = {r for r, _, _ in rules.RULES} | {"recursion", "function-constant"}
    assert expected <= named
    # rules without a kernel here are covered elsewhere or cannot be written portably
    assert named - expected == {"bool-vector"}  # a limitation, tested below


@pytest.mark.parametrize("path", REJECTED, ids=lambda p: p.stem)
def test_rejected(path):
    text = path.read_text()
    rule = re.search(r"// expect: (\S+)", text).group(1)
    line = next(i for i, l in enumerate(text.splitlines(), 1) if l.rstrip().endswith("// error"))
    version = re.search(r"// language_version: (\S+)", text)  # a kernel that states the version it is compiled as
    with pytest.raises(emulator.CompileError) as ei:
        emulator.compile_shader(path, language_version=version.group(1) if version else None)
    e = ei.value
    assert (e.rule, Path(e.file).name, e.line) == (rule, path.name, line), str(e)
    head = str(e).splitlines()[0]
    assert any(head == f"{e.file}:{line}: {text}" for text in rules.explanations(rule)), head


def test_vec_of_bool_through_a_template_compiles_a_direct_bool_vector_is_a_named_limitation():
    # vec<bool, N> through a template compiles with one-byte lanes (kernels/bool_fragments.metal runs it);
    # a vector of bool written with the attribute itself cannot (C++ for OpenCL has no bool vectors)
    src = """#include <metal_stdlib>
using namespace metal;
template <typename T> struct Frag { vec<T, 2> v; };
kernel void k(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  Frag<bool> f;
  f.v = vec<bool, 2>(true, i > 0);
  out[i] = f.v.y ? 1.0f : 0.0f;
}
"""
    out = torch.full((2,), 5.0)
    emulator.compile_shader(src, name="bools.metal").k(out, grid=2, threadgroup=2)
    assert out.tolist() == [0.0, 1.0]
    direct = """#include <metal_stdlib>
using namespace metal;
typedef bool flags2 __attribute__((ext_vector_type(2)));
kernel void k(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  flags2 f = flags2(true);
  out[i] = f.x ? 1.0f : 0.0f;
}
"""
    with pytest.raises(emulator.CompileError, match="emulator limitation: a vector of bool") as ei:
        emulator.compile_shader(direct, name="bools.metal")
    assert (ei.value.rule, ei.value.file, ei.value.line) == ("bool-vector", "bools.metal", 3)


def test_a_call_that_returns_a_pointer_is_not_a_function_pointer():
    """`call ptr @f(...)` in the IR is a direct call whose return type is a pointer (here a member
    function returning a device pointer, kept out of line at -O0), not a function's address."""
    src = """#include <metal_stdlib>
using namespace metal;
struct Rows {
  const device float* head;
  long stride;
  const device float* row(int key) const { return head + long(key) * stride; }
};
kernel void k(const device float* x [[buffer(0)]], device float* y [[buffer(1)]],
              uint i [[thread_position_in_grid]]) {
  const Rows rows{x, 2};
  y[i] = *rows.row(int(i));
}
"""
    y = torch.zeros(4)
    emulator.compile_shader(src, name="rows.metal").k(torch.arange(8.0), y, grid=4, threadgroup=4)
    assert y.tolist() == [0.0, 2.0, 4.0, 6.0]


def test_the_prepass_is_its_named_steps_in_order():
    """prepass.run runs prepass.STEPS, each a named function over one _Source, in this order."""
    from torch_metal_flash.emulator import prepass
    names = [name for name, _ in prepass.STEPS]
    assert names == ["unroll pragmas and half literals", "function references", "syntax rewrites",
                     "kernel instantiations", "kernel definitions", "function constants", "remaining attributes"]
    assert all(callable(step) and step.__doc__ for _, step in prepass.STEPS)
