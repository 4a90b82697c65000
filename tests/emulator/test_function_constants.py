"""Function constants by name or index, optional buffers, derived constants,
is_function_constant_defined; one build serves every value when possible."""
from __future__ import annotations

import pytest
import torch

from emu_helpers import KERNELS
from torch_metal_flash import emulator


@pytest.mark.parametrize("checked", [True, False])
def test_launch_time_constants_behave_like_compile_time_ones(checked):
    x = torch.randn(64)
    bias = torch.randn(64)
    builds = set()
    cases = [
        (dict(has_bias=False, scale=2.0, mode=0), (), x * 2),
        ({0: True, 1: 3.0, 2: 0}, (bias,), x * 3 + bias),
        ({"has_bias": True, 2: 2}, (bias,), -(x + bias) + 2000),  # scale undefined -> 1
        (dict(has_bias=False, mode=5), (), x + 5000),
    ]
    for fcs, extra, ref in cases:
        lib = emulator.compile_shader(KERNELS / "constants.metal", function_constants=fcs)
        y = torch.zeros(64)
        lib.fc_kernel(x, y, *extra, grid=64, threadgroup=32, checked=checked)
        torch.testing.assert_close(y, ref)
        builds.add(id(lib._build_of("fc_kernel", checked)))
    assert len(builds) == 1  # one shared build for all four combinations
    lib = emulator.compile_shader(KERNELS / "constants.metal", function_constants=dict(has_bias=True, mode=0))
    assert lib.function_constants == {"has_bias": 0, "scale": 1, "mode": 2}
    with pytest.raises(emulator.LaunchError, match="bias"):
        lib.fc_kernel(x, torch.zeros(64), grid=64, threadgroup=32)  # has_bias: the optional buffer is required
    with pytest.raises(emulator.LaunchError, match="no function constant named"):
        emulator.compile_shader(KERNELS / "constants.metal", function_constants={"nope": 1})


def test_constants_are_launch_time_values_as_call_arguments():
    src = """
    #include <metal_stdlib>
    using namespace metal;
    constant bool flag [[function_constant(0)]];
    float pick(float x, bool f, float s) { return f ? x * s : x; }
    kernel void k(device float* y [[buffer(0)]], uint i [[thread_position_in_grid]]) { y[i] = pick(y[i], flag, 2.0f); }
    """
    builds = set()
    for value in (False, True):
        lib = emulator.compile_shader(src, function_constants={"flag": value})
        y = torch.ones(32)
        lib.k(y, grid=32, threadgroup=32)
        assert torch.all(y == (2.0 if value else 1.0))
        builds.add(id(lib._build_of("k", emulator.default_checked())))
    assert len(builds) == 1


@pytest.mark.parametrize("use", ["return pick<flag>(x);", "return pick2<float, flag>(x);",
                                 "if constexpr (flag) return 2.0f * x; else return x;"])
def test_constants_in_constant_expressions_are_rejected(use):
    # Metal specialises function constants when the pipeline is created: C++
    # constant expressions cannot see them (and the emulator builds a kernel once, not per value).
    src = """
    #include <metal_stdlib>
    using namespace metal;
    constant bool flag [[function_constant(0)]];
    template <bool F> float pick(float x) { return F ? 2.0f * x : x; }
    template <typename T, bool F> T pick2(T x) { return F ? 2.0f * x : x; }
    float apply(float x) { USE }
    kernel void k(device float* y [[buffer(0)]], uint i [[thread_position_in_grid]]) { y[i] = apply(y[i]); }
    """.replace("USE", use)
    with pytest.raises(emulator.CompileError, match="function constants .* not constant expressions") as ei:
        emulator.compile_shader(src, name="fc.metal", function_constants={"flag": True})
    assert ei.value.rule == "function-constant" and ei.value.file == "fc.metal" and ei.value.line == 7
