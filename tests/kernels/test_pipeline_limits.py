"""Pipeline limits are checked before anything is encoded (planner/limits.py).

Through the emulator backend, with its ``pipeline_info`` lowered for chosen
kernels (as Apple's compiler lowers ``maxTotalThreadsPerThreadgroup`` for
register-heavy kernels): the planners pick a variant that fits, or the op
falls back with the one-time warning before any launch of the plan ran.
"""
import types

import pytest
import torch

import torch_metal_flash as tmf
from torch_metal_flash import backends, core
from torch_metal_flash.backends.emulator import EmulatorBackend
from torch_metal_flash.planner.plan import Launch, Plan, Unsupported
from torch_metal_flash.planner import limits
from torch_metal_flash.problem.spec import make_spec
from torch_metal_flash.testing import check_backward, check_forward

ROOMY = {"max_total_threads_per_threadgroup": 1024, "thread_execution_width": 32,
         "static_threadgroup_memory_length": 0, "max_threadgroup_memory_length": 32768}


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(backends, "_warned", set())
    monkeypatch.delenv("TORCH_METAL_FLASH_STRICT", raising=False)


@pytest.fixture
def lowered(monkeypatch, request):
    """``lowered({kernel prefix: {key: value}})``: the emulator reports those limits;
    returns the list of plans the backend ran (each with its launches' kernel and grid)."""
    ran = []
    original_encode = EmulatorBackend.encode
    original_info = EmulatorBackend.pipeline_info

    def encode(self, launches):  # what the C++ core's emulator encoder calls, per plan
        ran.append(types.SimpleNamespace(launches=[
            types.SimpleNamespace(kernel=kernel, threadgroup=tg, threadgroups=tuple(g // t for g, t in zip(grid, tg)))
            for (_, kernel, _, grid, tg, _), _ in launches]))
        return original_encode(self, launches)

    def install(overrides):
        def pipeline_info(self, source, kernel, function_constants):
            info = dict(original_info(self, source, kernel, function_constants))
            for prefix, values in overrides.items():
                if kernel.startswith(prefix):
                    info.update(values)
            return info
        monkeypatch.setattr(EmulatorBackend, "pipeline_info", pipeline_info)
        monkeypatch.setattr(EmulatorBackend, "encode", encode)
        core.plan_cache_clear()  # plans are made (and limits checked) on plan-cache misses
        request.addfinalizer(core.plan_cache_clear)
        return ran
    return install


def _launch(threads=256, tg_memory=None):
    return Launch("x.metal", "k", (1, 1, 1), (threads, 1, 1), {}, {}, tg_memory or {})


def test_launch_misfit_threads_and_memory():
    assert limits.launch_misfit(_launch(1024), ROOMY) is None
    why = limits.launch_misfit(_launch(256), dict(ROOMY, max_total_threads_per_threadgroup=192))
    assert "needs 256 threads per threadgroup, its pipeline allows 192" in why
    info = dict(ROOMY, static_threadgroup_memory_length=30000)
    assert limits.launch_misfit(_launch(tg_memory={0: 2768}), info) is None
    # dynamic lengths count rounded up to 16 bytes, as the launcher sets them
    assert "needs 32784 bytes of threadgroup memory (30000 static)" in limits.launch_misfit(
        _launch(tg_memory={0: 2769}), info)


def test_first_fitting_tries_candidates_in_order_and_stops_at_unsupported():
    built = []

    def candidates(*threads):
        for t in threads:
            built.append(t)
            yield Plan((_launch(t),))
    info = dict(ROOMY, max_total_threads_per_threadgroup=128)
    plan = limits.first_fitting(candidates(512, 256, 128, 64), lambda *a: info)
    assert plan.launches[0].threadgroup[0] == 128 and built == [512, 256, 128], "candidates are built lazily"
    assert limits.first_fitting(candidates(512), None).launches[0].threadgroup[0] == 512, "no limits known"
    none = limits.first_fitting(candidates(512, 256), lambda *a: info)
    assert isinstance(none, Unsupported) and "needs 512 threads" in none.reason
    assert limits.first_fitting(iter([Unsupported("bad input")]), lambda *a: info).reason == "bad input"


def _qkv(B, Hq, Hkv, Lq, Lk, D, dtype, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, L, H, D, generator=g).to(dtype).requires_grad_(requires_grad)
            for L, H in ((Lq, Hq), (Lk, Hkv), (Lk, Hkv))]


def _spec(q, k, v, causal):
    Lq, Lk = q.shape[1], k.shape[1]
    return make_spec(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=q.shape[-1] ** -0.5,
                     diag_offset=Lk - Lq, window_right=0 if causal else -1)


def test_forward_takes_a_tile_that_fits_the_threadgroup_memory(lowered):
    ran = lowered({"flash_fwd_f32_d64_": {"static_threadgroup_memory_length": 17408,
                                          "max_threadgroup_memory_length": 16384}})
    q, k, v = _qkv(1, 2, 2, 45, 70, 64, torch.float32)
    with tmf.backend("emulator", strict=True):
        out, lse, _ = tmf.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    (plan,) = ran
    assert [launch.kernel for launch in plan.launches] == ["flash_fwd_f32_d80_q32_k32_s"]
    check_forward(_spec(q, k, v, causal=True), out.transpose(1, 2), lse)


def test_forward_falls_back_before_any_launch_when_nothing_fits(lowered):
    ran = lowered({"flash_fwd_f16_": {"max_total_threads_per_threadgroup": 64}})
    q, k, v = _qkv(1, 2, 2, 20, 20, 64, torch.float16)
    with tmf.backend("emulator", strict=True):
        with pytest.raises(tmf.UnsupportedError, match="its pipeline allows 64"):
            tmf.flash_attn_func(q, k, v)
    with tmf.backend("emulator"):
        with pytest.warns(tmf.FallbackWarning, match="no kernel variant fits the pipeline limits"):
            out = tmf.flash_attn_func(q, k, v)
    assert ran == []
    with tmf.backend("reference"):
        torch.testing.assert_close(out, tmf.flash_attn_func(q, k, v))


def _grads(q, k, v, causal, backend, strict=True):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    with tmf.backend(backend, strict=strict):
        out = tmf.flash_attn_func(q, k, v, causal=causal)
        g = torch.Generator().manual_seed(7)
        out.backward(torch.randn(out.shape, generator=g).to(out.dtype))
    return q.grad, k.grad, v.grad


def test_backward_takes_the_tiles_of_a_larger_bucket_when_its_own_need_too_many_threads(lowered):
    q, k, v = _qkv(1, 4, 2, 33, 40, 64, torch.float16, seed=3)
    ran = lowered({"flash_bwd_dq_f16_d64_": {"max_total_threads_per_threadgroup": 192}})
    fitted = _grads(q, k, v, True, "emulator")
    kernels = [launch.kernel for launch in ran[-1].launches]
    # d80 is the first bucket whose tiles need less (its fused dK/dV kernel owns 32 key rows: 128
    # threads); its dQ kernel is not the lowered one
    assert kernels == ["flash_bwd_pre_f16", "flash_bwd_dq_f16_d80_q64_k32", "flash_bwd_dkv_f16_d80_k32_q16_m0"], kernels
    # The oracle's rule (the forward ran the d64 tile: the backward's d160 scores are still the forward's).
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(7)).to(q.dtype)  # as _grads draws it
    check_backward(_spec(q, k, v, True), dout.transpose(1, 2), None,
                   (*(g.transpose(1, 2) for g in fitted), None, None))


@pytest.mark.parametrize("allowed,forward,backward", [
    (256, "flash_fwd_f16_d512_q16_k16_s_ds4",
     ["flash_bwd_dq_f16_d512_q16_k8_ds4", "flash_bwd_dkv_f16_d512_k16_q8_m0_ds4"]),
    (128, "flash_fwd_f16_d512_q32_k16_s",
     ["flash_bwd_dq_f16_d512_q32_k8", "flash_bwd_dkv_f16_d512_k32_q8_m1", "flash_bwd_dkv_f16_d512_k32_q8_m2"]),
])
def test_head_dim_splits_give_way_to_the_buckets_tiles_with_fewer_threads(lowered, allowed, forward, backward):
    """The widest bucket has no larger one to fall back to: where a pipeline allows fewer threads than
    a head-dim split's 512, the split with half the rows, then the undivided kernels run."""
    ran = lowered({prefix: {"max_total_threads_per_threadgroup": allowed}
                   for prefix in ("flash_fwd_f16_d512_", "flash_bwd_dq_f16_d512_", "flash_bwd_dkv_f16_d512_")})
    q, k, v = _qkv(1, 2, 1, 19, 23, 512, torch.float16, seed=5)
    fitted = _grads(q, k, v, True, "emulator")
    assert [launch.kernel for launch in ran[0].launches] == [forward]
    assert [launch.kernel for launch in ran[-1].launches][1:] == backward
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(7)).to(q.dtype)  # as _grads draws it
    check_backward(_spec(q, k, v, True), dout.transpose(1, 2), None,
                   (*(g.transpose(1, 2) for g in fitted), None, None))


def test_backward_falls_back_whole_when_a_late_launch_cannot_fit(lowered):
    # below every dK/dV tile's threads (the fewest: one simdgroup, float32's fused kernel from d128)
    ran = lowered({"flash_bwd_dkv_f32_": {"max_total_threads_per_threadgroup": 16}})
    q, k, v = _qkv(1, 2, 2, 17, 17, 32, torch.float32, seed=4)
    with tmf.backend("emulator", strict=True):
        out = tmf.flash_attn_func(*(t.detach().requires_grad_(True) for t in (q, k, v)))
        with pytest.raises(tmf.UnsupportedError, match="flash_bwd_dkv_f32_d32_k64_q32_m0 needs 256 threads"):
            out.sum().backward()
    assert [p.launches[0].kernel for p in ran] == ["flash_fwd_f32_d32_q32_k32"], "no backward launch ran"
    with pytest.warns(tmf.FallbackWarning, match="no kernel variant fits the pipeline limits"):
        grads = _grads(q, k, v, False, "emulator", strict=False)
    expected = _grads(q, k, v, False, "reference", strict=False)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want)


def test_decode_takes_fewer_rows_per_threadgroup_when_its_pipeline_allows_fewer_threads(lowered):
    # GQA 16:1 with one query row: 16 rows per KV head -> planned as 4 simdgroups (128 threads).
    ran = lowered({"flash_decode_f16_": {"max_total_threads_per_threadgroup": 64}})
    q, k, v = _qkv(1, 16, 1, 1, 300, 64, torch.float16, seed=5)
    with tmf.backend("emulator", strict=True):
        out, lse, _ = tmf.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    decode = ran[-1].launches[0]
    assert decode.kernel.startswith("flash_decode_f16_d64") and decode.threadgroup == (64, 1, 1)
    assert decode.threadgroups[1] == 1 * 1, "16 rows in one row block of two simdgroups"
    check_forward(_spec(q, k, v, causal=True), out.transpose(1, 2), lse)
