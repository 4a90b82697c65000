"""Purpose-broken kernels are caught with the right exception, naming kernel,
file:line, threadgroup and thread; their fixed twins pass (no false alarms);
nothing crashes or hangs the Python process."""
from __future__ import annotations

import platform
import re

import pytest
import torch

from emu_helpers import KERNELS, ORDERS, lib
from torch_metal_flash import emulator

CHECKS = "checks.metal"


def _line_of(text: str) -> int:
    """Line number in checks.metal of the first line containing text."""
    for i, line in enumerate((KERNELS / CHECKS).read_text().splitlines(), 1):
        if text in line:
            return i
    raise AssertionError(text)


def _assert_located(err: emulator.EmulatorError, kernel: str, *line_texts: str):
    """The error names the kernel, checks.metal and one of the lines (races: the other one too)."""
    assert err.kernel == kernel
    assert err.file and err.file.endswith(CHECKS), err
    lines = [_line_of(t) for t in line_texts]
    assert err.line in lines, (err.line, str(err))
    for other in lines:
        if other != err.line:
            assert f"the other access is at {err.file}:{other}" in str(err)
    assert err.threadgroup is not None
    assert f"kernel '{kernel}'" in str(err) and f"{CHECKS}:{err.line}" in str(err)


def test_missing_barrier_is_a_race_in_checked_mode():
    x, y = torch.randn(256), torch.zeros(256)
    with pytest.raises(emulator.DataRaceError) as ei:
        lib(CHECKS).missing_barrier(x, y, grid=256, threadgroup=256)
    _assert_located(ei.value, "missing_barrier", "tile[tid] = x[gid];", "y[gid] = tile[n - 1 - tid];")
    assert ei.value.thread is not None
    assert "threadgroup memory" in str(ei.value)
    for order in ORDERS:
        lib(CHECKS).with_barrier(x, y, grid=256, threadgroup=256, order=order)
        torch.testing.assert_close(y, x.flip(0))


def test_missing_barrier_shows_poison_in_fast_mode_under_some_order():
    x = torch.randn(256)
    outs = {}
    for order in ORDERS:
        y = torch.zeros(256)
        lib(CHECKS).missing_barrier(x, y, grid=256, threadgroup=256, order=order, checked=False)
        outs[order] = y
    # threadgroup memory is poisoned with NaN: whichever simdgroups run first read it
    assert any(torch.isnan(y).any() for y in outs.values())
    assert torch.isnan(outs["forward"][:32]).all() and not torch.isnan(outs["reverse"][:32]).any()


def test_simd_synchronised_exchange_is_not_a_race():
    x, y = torch.randn(64), torch.zeros(64)
    for order in ORDERS:
        lib(CHECKS).simd_exchange(x, y, grid=64, threadgroup=64, order=order)
        torch.testing.assert_close(y, x.view(2, 32).flip(1).reshape(-1))


@pytest.mark.parametrize("checked", [True, False])
def test_divergent_barrier(checked):
    y = torch.zeros(64)
    with pytest.raises(emulator.DivergentBarrierError) as ei:
        lib(CHECKS).divergent_barrier(y, grid=64, threadgroup=64, checked=checked)
    assert ei.value.kernel == "divergent_barrier" and ei.value.file.endswith(CHECKS)
    assert ei.value.line in (_line_of("if (tid < 40) {") + 1, _line_of("} else {") + 1)
    assert ei.value.thread is not None
    lib(CHECKS).early_exit(y, grid=64, threadgroup=64, checked=checked)
    assert y[:40].tolist() == list(range(39, -1, -1))


@pytest.mark.parametrize("checked", [True, False])
def test_mma_under_divergence(checked):
    with pytest.raises(emulator.SimdgroupMatrixDivergenceError) as ei:
        lib(CHECKS).mma_divergent(torch.zeros(64), grid=32, threadgroup=32, checked=checked)
    _assert_located(ei.value, "mma_divergent", "if (lane < 16) simdgroup_multiply(c, a, a);")
    assert "16 of 32 lanes" in str(ei.value)


@pytest.mark.parametrize("checked", [True, False])
def test_out_of_bounds_read_and_write(checked):
    x, y = torch.randn(256), torch.zeros(256)
    with pytest.raises(emulator.OutOfBoundsError) as ei:
        lib(CHECKS).read_past_end(x, y, grid=256, threadgroup=64, checked=checked)
    _assert_located(ei.value, "read_past_end", "y[i] = x[i + 1];")
    assert ei.value.buffer == 0 and "read" in str(ei.value) and "byte offset 1024" in str(ei.value)
    assert ei.value.threadgroup == (3, 0, 0) and ei.value.thread == (63, 0, 0)
    with pytest.raises(emulator.OutOfBoundsError) as ei:
        lib(CHECKS).write_past_end(y, grid=256, threadgroup=64, checked=checked)
    _assert_located(ei.value, "write_past_end", "y[i + 1] = 1.0f;")
    assert "write" in str(ei.value)
    if checked:  # (fast mode only catches overruns that reach a guard page)
        with pytest.raises(emulator.OutOfBoundsError, match="byte offset -4"):
            lib(CHECKS).write_before_start(y, grid=256, threadgroup=64, checked=checked)


def test_read_past_the_end_of_a_view_inside_a_bigger_allocation():
    base = torch.randn(1024)
    y = torch.zeros(256)
    with pytest.raises(emulator.OutOfBoundsError, match=r"buffer\(0\), which is 1024 bytes long"):
        lib(CHECKS).read_past_end(base[100:356], y, grid=256, threadgroup=64)
    # a strided view: the bound extent runs from its first to its last element
    lib(CHECKS).read_past_end(base[:600:2], y, grid=256, threadgroup=64)
    torch.testing.assert_close(y, base[1:257])
    with pytest.raises(emulator.OutOfBoundsError, match="which is 996 bytes long"):
        lib(CHECKS).read_past_end(base[:250:2], y, grid=256, threadgroup=64)


def test_threadgroup_array_overflow():
    with pytest.raises(emulator.OutOfBoundsError, match="threadgroup memory") as ei:
        lib(CHECKS).tg_overflow(torch.zeros(64), grid=64, threadgroup=64)
    _assert_located(ei.value, "tg_overflow", "t[tid] = 1.0f;")


def test_write_write_race_between_threadgroups():
    with pytest.raises(emulator.DataRaceError, match="different threadgroups") as ei:
        lib(CHECKS).cross_tg_race(torch.zeros(1), grid=256, threadgroup=64)
    _assert_located(ei.value, "cross_tg_race", "if (tid == 0) y[0] = float(tg);")
    counter = torch.zeros(1, dtype=torch.int32)
    lib(CHECKS).cross_tg_atomic(counter, grid=256, threadgroup=64)
    assert counter.item() == 4


def test_read_modify_write_race_within_a_threadgroup():
    with pytest.raises(emulator.DataRaceError, match="device memory"):
        lib(CHECKS).rmw_race(torch.zeros(64), grid=128, threadgroup=128)


@pytest.mark.parametrize("checked", [True, False])
def test_threadgroup_memory_over_32k(checked):
    with pytest.raises(emulator.ThreadgroupMemoryError, match="32768") as ei:
        lib(CHECKS).too_much_tg(torch.zeros(64), grid=64, threadgroup=64, checked=checked)
    assert ei.value.kernel == "too_much_tg" and ei.value.file.endswith(CHECKS)
    with pytest.raises(emulator.ThreadgroupMemoryError):
        lib("language.metal").tg_param(torch.zeros(64), torch.zeros(64), grid=64, threadgroup=64,
                                       threadgroup_memory={0: 32768, 1: 16})


@pytest.mark.parametrize("checked", [True, False])
def test_infinite_loop_times_out(checked):
    with pytest.raises(emulator.KernelTimeoutError) as ei:
        lib(CHECKS).spin_forever(torch.zeros(2), grid=32, threadgroup=32, checked=checked, timeout=0.5)
    assert ei.value.kernel == "spin_forever"


def test_faults_in_kernel_code_become_exceptions():
    with pytest.raises(emulator.KernelCrashError, match="division"):
        lib(CHECKS).divide_by_zero(torch.zeros(32, dtype=torch.int32), grid=32, threadgroup=32, checked=False)
    if platform.machine().lower() in ("x86_64", "amd64"):  # needs -fstack-clash-protection
        with pytest.raises(emulator.KernelCrashError, match="stack overflow"):
            lib(CHECKS).deep_recursion_stack(torch.zeros(32), grid=32, threadgroup=32, checked=False)
    # the process and the emulator are fine afterwards
    y = torch.zeros(64)
    lib(CHECKS).early_exit(y, grid=64, threadgroup=64)
    assert y[0] == 39


def test_compile_errors_name_the_metal_file_and_line(tmp_path):
    src = tmp_path / "broken.metal"
    src.write_text("#include <metal_stdlib>\nusing namespace metal;\n\nkernel void k(device float* y [[buffer(0)]]) {\n"
                   "  y[0] = undefined_name;\n}\n")
    with pytest.raises(emulator.CompileError) as ei:
        emulator.compile_shader(src)._build(True)
    assert "broken.metal:5" in str(ei.value)
    assert ei.value.file.endswith("broken.metal") and ei.value.line == 5


def test_missing_compiler_is_a_clear_error(monkeypatch):
    from torch_metal_flash.emulator import compiler
    monkeypatch.setattr(compiler, "_compiler", None)
    monkeypatch.setattr(compiler.shutil, "which", lambda name: None)
    monkeypatch.delenv("TORCH_METAL_FLASH_CXX", raising=False)
    import builtins
    real_import = builtins.__import__

    def no_zig(name, *a, **kw):
        if name == "ziglang":
            raise ImportError(name)
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_zig)
    with pytest.raises(emulator.CompilerNotFoundError, match=re.escape("no clang >= 17 found; install clang-19")):
        compiler.find_compiler()


def test_misaligned_vector_accesses_in_checked_mode():
    x, y = torch.arange(64.0), torch.zeros(8)
    lib(CHECKS).misaligned_device(x, y, 4, grid=8, threadgroup=8)  # 16-byte aligned: fine
    assert y.tolist() == [4.0 * (i + 1) for i in range(8)]
    with pytest.raises(emulator.MisalignedAccessError, match="float4.*device buffer 0.*16-byte alignment") as ei:
        lib(CHECKS).misaligned_device(x, y, 1, grid=8, threadgroup=8)
    _assert_located(ei.value, "misaligned_device", "misaligned device load")
    assert ei.value.buffer == 0
    lib(CHECKS).misaligned_threadgroup(y, 2, grid=8, threadgroup=8)
    with pytest.raises(emulator.MisalignedAccessError, match="float2.*threadgroup memory.*8-byte alignment") as ei:
        lib(CHECKS).misaligned_threadgroup(y, 1, grid=8, threadgroup=8)
    _assert_located(ei.value, "misaligned_threadgroup", "misaligned threadgroup load")
    lib(CHECKS).packed_device(x, y, 1, grid=8, threadgroup=8)  # packed vectors need only float alignment
    assert y.tolist() == [1.0 + 4 * i for i in range(8)]


def test_precompiled_shim_follows_the_shim_folder(tmp_path, monkeypatch):
    """The pre-pass parses with the shim precompiled; clang reads the shim's files where the PCH was
    built.  Each copy of the package (a checkout, an installed copy, another clone) gets its own,
    and a copy whose files were touched (same content, new mtime) keeps working."""
    import os
    import shutil

    from torch_metal_flash import _paths
    from torch_metal_flash.emulator import compiler
    monkeypatch.setenv("TORCH_METAL_FLASH_CACHE_DIR", str(tmp_path / "cache"))
    comp = compiler.find_compiler()
    view = "kernel void k(device float* x) { x[0] = (float)1; }\n"
    pchs, original = [], compiler.csrc_emulator_dir()
    for copy in ("a", "b"):
        csrc = tmp_path / copy / "csrc"
        shutil.copytree(original, csrc / "emulator")
        monkeypatch.setattr(_paths, "csrc_dir", lambda csrc=csrc: csrc)
        compiler._syntax_cache.clear()
        pchs.append(compiler.shim_pch(comp))
        assert compiler.syntax_facts(comp, view + f"// {copy}\n") is not None
        if copy == "a":
            shutil.rmtree(tmp_path / "a")  # gone: copy b must not use a's PCH
    assert pchs[0] != pchs[1]
    for f in (tmp_path / "b" / "csrc" / "emulator" / "shim").iterdir():
        os.utime(f, (1_000_000_000, 1_000_000_000))
    compiler._syntax_cache.clear()
    assert compiler.syntax_facts(comp, view + "// touched\n") is not None


@pytest.mark.parametrize("checked", [True, False])
def test_same_value_store_by_one_simdgroup_is_one_simd_store(checked):
    for order in ORDERS:
        o = torch.zeros(1)
        lib(CHECKS).simd_same_value(o, grid=64, threadgroup=64, order=order, checked=checked)
        assert o.item() == 1.0
        o, y = torch.zeros(1), torch.zeros(32)
        lib(CHECKS).simd_same_value_then_read(o, y, grid=64, threadgroup=64, order=order, checked=checked)
        assert (y == 2.0).all()
        o = torch.zeros(32)
        lib(CHECKS).threadgroup_same_value(o, grid=64, threadgroup=64, order=order, checked=checked)
        assert (o == 3.0).all()


def test_different_values_from_one_simdgroup_are_a_race():
    with pytest.raises(emulator.DataRaceError, match="different values") as ei:
        lib(CHECKS).simd_different_values(torch.zeros(1), grid=64, threadgroup=64)
    _assert_located(ei.value, "simd_different_values", "if (sg == 0) o[0] = float(lane);")


def test_same_value_from_two_simdgroups_is_a_race():
    with pytest.raises(emulator.DataRaceError) as ei:
        lib(CHECKS).two_simdgroups_same_value(torch.zeros(1), grid=64, threadgroup=64)
    _assert_located(ei.value, "two_simdgroups_same_value", "o[0] = 1.0f;  // the same value, but from two")
    with pytest.raises(emulator.DataRaceError, match="different threadgroups"):
        lib(CHECKS).two_simdgroups_same_value(torch.zeros(1), grid=64, threadgroup=32)


@pytest.mark.parametrize("checked", [True, False])
def test_unbound_buffers_fail_only_when_accessed(checked):
    y = torch.zeros(64)
    lib(CHECKS).unread_buffer(y, grid=64, threadgroup=32, checked=checked)
    assert torch.equal(y, torch.arange(64.0))
    with pytest.raises(emulator.LaunchError, match=r"parameter 'x' \[\[buffer\(1\)\]\]") as ei:
        lib(CHECKS).read_buffer(torch.zeros(64), grid=64, threadgroup=32, checked=checked)
    assert "read through buffer(1), which is not bound" in str(ei.value)
    x = torch.randn(64)
    lib(CHECKS).read_buffer(y, x, grid=64, threadgroup=32, checked=checked)
    assert torch.equal(y, x)
