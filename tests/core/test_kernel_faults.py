"""Kernels that fail to build are survived: remembered for the process, the next variant tried, the
reference path taken with one warning naming the kernel (UnsupportedError in strict mode), never
compiled again; testing.inject_faults makes them fail on purpose; an allocator's out-of-memory error
surfaces as torch's and leaves nothing broken behind."""
from __future__ import annotations

import warnings

import pytest
import torch

import torch_metal_flash as tmf
from torch_metal_flash import emulator, testing
from torch_metal_flash.backends import faults
from torch_metal_flash.backends.metal import build_stage
from torch_metal_flash.planner.limits import KernelBuildError, first_fitting
from torch_metal_flash.planner.plan import Launch, Plan


def qkv(*shape, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return [testing.randn(*shape, generator=g).requires_grad_(requires_grad) for _ in range(3)]


def fallback_messages(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, tmf.FallbackWarning)]


def runs(name: str) -> int:
    return tmf.run_counts().get(name, 0)


@pytest.fixture
def emulated():
    with tmf.backend("emulator"), warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        yield record


def test_a_compile_fault_falls_back_once_naming_the_kernel(emulated):
    q, k, v = qkv(1, 2, 64, 64)
    want = tmf.scaled_dot_product_attention(q, k, v, is_causal=True)
    with testing.inject_faults(compile="flash_fwd_") as f:
        before = runs("reference")
        out = tmf.scaled_dot_product_attention(q, k, v, is_causal=True)
        fired = f.fired
        assert fired >= 1
        again = tmf.scaled_dot_product_attention(q, k, v, is_causal=True)
        other = tmf.scaled_dot_product_attention(*qkv(1, 2, 40, 64, seed=1))  # another plan, same kernels
        assert f.fired == fired  # remembered: nothing compiled or failed again
        assert runs("reference") == before + 3
    messages = fallback_messages(emulated)
    assert len(messages) == 1, messages
    assert "kernel flash_fwd_f32_d64_" in messages[0] and "failed to compile: injected fault" in messages[0]
    torch.testing.assert_close(out, want)
    assert torch.equal(out, again)
    ran = runs("emulator")
    torch.testing.assert_close(tmf.scaled_dot_product_attention(q, k, v, is_causal=True), want)
    assert runs("emulator") == ran + 1  # the kernels again after the context
    assert not any("flash_fwd_" in key[2] for key in faults.failures())


def test_a_pipeline_fault_in_the_backward(emulated):
    q, k, v = qkv(1, 2, 48, 64, requires_grad=True)
    dout = testing.randn(1, 2, 48, 64, generator=torch.Generator().manual_seed(5))
    with tmf.backend("reference"):
        want = torch.autograd.grad(tmf.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), dout)
    with testing.inject_faults(pipeline="flash_bwd_dkv") as f:
        out = tmf.scaled_dot_product_attention(q, k, v, is_causal=True)
        got = torch.autograd.grad(out, (q, k, v), dout)
    assert f.fired >= 1
    messages = fallback_messages(emulated)
    assert len(messages) == 1 and "kernel flash_bwd_dkv_" in messages[0], messages
    assert "failed to build its pipeline" in messages[0]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_strict_mode_names_the_kernel():
    q, k, v = qkv(1, 2, 32, 64)
    with tmf.backend("emulator", strict=True), testing.inject_faults(compile="flash_fwd_"):
        with pytest.raises(tmf.UnsupportedError, match=r"kernel flash_fwd_\w+ failed to compile"):
            tmf.scaled_dot_product_attention(q, k, v)
    with tmf.backend("emulator", strict=True):
        tmf.scaled_dot_product_attention(q, k, v)


def test_compile_and_pipeline_faults_together(emulated):
    """Forward kernels that do not compile and backward kernels whose pipelines do not build."""
    q, k, v = qkv(1, 2, 40, 64, requires_grad=True)
    with testing.inject_faults(compile="flash_fwd_", pipeline="flash_bwd_") as f:
        out = tmf.scaled_dot_product_attention(q, k, v)
        out.sum().backward()
    assert f.fired >= 2
    messages = fallback_messages(emulated)
    assert any("flash_fwd_" in m and "failed to compile" in m for m in messages), messages
    with tmf.backend("reference"):
        q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
        torch.testing.assert_close(out, tmf.scaled_dot_product_attention(q2, k2, v2))
        tmf.scaled_dot_product_attention(q2, k2, v2).sum().backward()
    torch.testing.assert_close(q.grad, q2.grad)


@pytest.mark.parametrize("face", ["decode", "varlen", "flex"])
def test_faults_in_every_face(face, emulated):
    g = torch.Generator().manual_seed(3)
    if face == "decode":
        qd, kc, vc = (testing.randn(*s, generator=g) for s in ((1, 1, 2, 64), (1, 128, 2, 64), (1, 128, 2, 64)))
        lens = torch.tensor([100], dtype=torch.int32)
        call = lambda: tmf.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=lens)  # noqa: E731
        pattern = "flash_decode_"
    elif face == "varlen":
        x = testing.randn(10, 2, 64, generator=g)
        cu = torch.tensor([0, 4, 10], dtype=torch.int32)
        call = lambda: tmf.flash_attn_varlen_func(x, x, x, cu, cu, 6, 6, causal=True)  # noqa: E731
        pattern = "flash_fwd_"
    else:
        x = testing.randn(1, 2, 64, 64, generator=g)
        call = lambda: tmf.flex_attention(x, x, x, score_mod=lambda s, b, h, i, j: s * 0.5)  # noqa: E731
        pattern = "flash_fwd_"
    want = call()
    with testing.inject_faults(compile=pattern) as f:
        got = call()
    assert f.fired >= 1
    messages = fallback_messages(emulated)
    assert len(messages) == 1 and f"kernel {pattern}" in messages[0], messages
    torch.testing.assert_close(got, want)


def test_a_real_compile_failure_is_remembered(monkeypatch, emulated):
    """The emulator's own CompileError (as from a compiler that rejects a kernel): kept with its message,
    never compiled again."""
    from torch_metal_flash.backends import emulator as backend
    calls = []
    real = emulator.compile_shader

    def rejecting(source, **kw):
        calls.append(source)
        raise emulator.CompileError("shaders/flash_fwd.metal:10: error: rejected by this compiler\nmore")

    backend._libraries.clear()
    monkeypatch.setattr(emulator, "compile_shader", rejecting)
    try:
        q, k, v = qkv(1, 2, 32, 64)
        tmf.scaled_dot_product_attention(q, k, v)
        n = len(calls)
        tmf.scaled_dot_product_attention(*qkv(1, 2, 48, 64, seed=2))
        assert len(calls) == n  # not compiled again
        messages = fallback_messages(emulated)
        assert messages and "failed to compile: shaders/flash_fwd.metal:10: error: rejected" in messages[0]
        assert any(reason.endswith("rejected by this compiler") for reason in faults.failures().values())
    finally:
        monkeypatch.setattr(emulator, "compile_shader", real)
        faults.reset()
        backend._libraries.clear()
    tmf.scaled_dot_product_attention(q, k, v)


def test_the_planner_tries_the_next_variant():
    launches = [Launch("a.metal", name, (1, 1, 1), (32, 1, 1), {}, {}) for name in ("k_bad", "k_good")]
    plans = [Plan(launches=(launch,)) for launch in launches]

    def info(source, kernel, constants):
        if kernel == "k_bad":
            raise KernelBuildError(kernel, "pipeline", "no pipeline\nsecond line")
        return {"max_total_threads_per_threadgroup": 1024, "static_threadgroup_memory_length": 0,
                "max_threadgroup_memory_length": 32768}
    assert first_fitting(iter(plans), info) is plans[1]
    why = first_fitting(iter(plans[:1]), info)
    assert why.reason == "no kernel variant can run here: kernel k_bad failed to build its pipeline: no pipeline"


def test_the_launchers_messages_name_the_stage():
    assert build_stage("torch_metal_flash: compiling shaders/flash_fwd.metal with the Metal compiler failed") == \
        "compile"
    assert build_stage("torch_metal_flash: cannot specialise kernel 'k' of shaders/x.metal") == "function"
    assert build_stage("torch_metal_flash: cannot build the pipeline state of kernel 'k'") == "pipeline"


def test_inject_faults_checks_its_arguments():
    with pytest.raises(TypeError, match="compile must be a non-empty str"):
        with testing.inject_faults(compile=""):
            pass


@pytest.mark.parametrize("where", ["outputs", "reference"])
def test_out_of_memory_surfaces_as_torchs_and_the_next_call_runs(where, monkeypatch):
    """An allocation failing inside an op (torch's allocator raising) is torch.OutOfMemoryError, and
    nothing is cached broken: the same call then succeeds."""
    from torch_metal_flash.ops import attention
    q, k, v = qkv(1, 2, 64, 64)
    name = "_fwd_buffers"
    real = getattr(attention, name)
    left = [1]

    def failing(*a, **kw):
        if left[0]:
            left[0] -= 1
            raise torch.OutOfMemoryError("fake allocator: out of memory")
        return real(*a, **kw)

    monkeypatch.setattr(attention, name, failing)
    backend = "emulator" if where == "outputs" else "reference"
    with tmf.backend(backend, strict=True):
        with pytest.raises(torch.OutOfMemoryError, match="fake allocator"):
            tmf.scaled_dot_product_attention(q, k, v)
        out = tmf.scaled_dot_product_attention(q, k, v)
    with tmf.backend("reference"):
        torch.testing.assert_close(out, tmf.scaled_dot_product_attention(q, k, v))
