"""The C++ op core: plan cache (hits, misses, key completeness, LRU, verify mode),
templates (arguments, outputs, scratch), backend routing mirrored per thread,
the stub encoder and the Python body's hand-over."""
import threading

import pytest
import torch

import torch_metal_flash as tmf
from torch_metal_flash import backends, core, emulator, ops, reference
from torch_metal_flash.backends.emulator import EmulatorBackend
from torch_metal_flash.planner.plan import Launch, Plan
from torch_metal_flash.problem.spec import make_spec

fwd = torch.ops.metal_flash.fwd


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch):
    monkeypatch.delenv("TORCH_METAL_FLASH_BACKEND", raising=False)
    core.plan_cache_clear()
    tmf.run_counts(reset=True)
    yield
    core.plan_cache_clear()


def _qkv(B=1, H=2, L=9, D=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, L, D, generator=g).to(dtype) for _ in range(3))


def _args(q, k, v, scale=0.3, window_right=0, softcap=0.0, mask=None):
    # fwd's arguments, the optional dropout / varlen ones at their defaults (core.python_body takes them all)
    return (q, k, v, mask, None, None, scale, 0, -1, window_right, softcap, False, 0.0, None, None, None, None, None,
            0, 0)


def _check(out, lse, aux, args):
    ref_out, ref_lse = reference.forward(make_spec(*args[:6], scale=args[6], diag_offset=args[7],
                                                   window_left=args[8], window_right=args[9], softcap=args[10]))
    torch.testing.assert_close(out, ref_out.to(out.dtype), atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse, ref_lse, atol=2e-3, rtol=2e-3)


def test_hit_replays_the_template():
    q, k, v = _qkv()
    with tmf.backend("emulator", strict=True):
        for i in range(3):
            _check(*fwd(*_args(q, k, v)), _args(q, k, v))
    info = core.plan_cache_info()
    assert (info["misses"], info["hits"], info["size"]) == (1, 2, 1)
    assert tmf.run_counts(reset=True).get("emulator") == 3


def test_key_covers_what_the_plan_depends_on():
    """Each variation below changes the plan (params, constants or bindings): a miss, and a right answer."""
    q, k, v = _qkv(L=12)
    buf = torch.randn(2 * 12 * 16 + 8)
    offset_k = buf[1:1 + 2 * 12 * 16].view(1, 2, 12, 16)  # storage offset 1: not vec4-aligned
    variants = [
        _args(q, k, v),
        _args(q, k, v, scale=0.25),  # a scalar in params
        _args(q, k, v, softcap=5.0),  # a scalar that flips a function constant
        _args(q, k, v, window_right=-1),
        _args(q, k, v, mask=torch.ones(12, 12, dtype=torch.bool)),  # None-ness, then dtype
        _args(q, k, v, mask=torch.zeros(12, 12)),
        _args(q.transpose(1, 2).contiguous().transpose(1, 2), k, v),  # strides
        _args(*(t.to(torch.float16) for t in (q, k, v))),  # dtype
        _args(q[:, :, :7], k, v),  # sizes
        _args(q, offset_k, v),  # alignment class of the storage offset
        _args(q, q, q),  # aliasing
        (*_args(q, k, v)[:11], True),  # return_aux: the backward's row state written too
    ]
    with tmf.backend("emulator", strict=True):
        for n, args in enumerate(variants, 1):
            _check(*fwd(*args), args)
            assert core.plan_cache_info()["misses"] == n, f"variant {n - 1} hit another variant's template"
        for args in variants:  # all cached now
            _check(*fwd(*args), args)
    info = core.plan_cache_info()
    assert (info["misses"], info["hits"]) == (len(variants), len(variants))


def test_lru_bounds_the_cache():
    q, k, v = _qkv()
    info = core.plan_cache_info()
    core.configure_plan_cache(capacity=2)
    try:
        with tmf.backend("emulator"):
            for scale in (0.1, 0.2, 0.3, 0.1):
                fwd(*_args(q, k, v, scale=scale))
        info2 = core.plan_cache_info()
        assert info2["size"] == 2 and info2["evictions"] == 2 and info2["misses"] == 4
    finally:
        core.configure_plan_cache(capacity=info["capacity"])


def test_verify_mode_catches_an_incomplete_key(monkeypatch):
    """A planner that depends on something outside the key is caught on the next hit."""
    calls = []
    plan_forward = ops.attention.planner.plan_forward

    def drifting(spec, out, lse, aux, family, pipeline_info):
        calls.append(1)
        return plan_forward(spec, out, lse, family=family) if len(calls) == 1 else plan_forward(
            make_spec(spec.q, spec.k, spec.v, scale=spec.scale * 2), out, lse, family=family)
    monkeypatch.setattr(ops.attention, "planner", type("P", (), {"plan_forward": staticmethod(drifting)}))
    verify = core.plan_cache_info()["verify"]
    core.configure_plan_cache(verify=True)
    q, k, v = _qkv()
    try:
        with tmf.backend("emulator"):
            fwd(*_args(q, k, v, window_right=-1))
            with pytest.raises(RuntimeError, match="differs from a fresh plan"):
                fwd(*_args(q, k, v, window_right=-1))
    finally:
        core.configure_plan_cache(verify=verify)


def test_planners_must_not_derive_tensors(monkeypatch):
    def deriving(spec, out, lse, aux, family, pipeline_info):
        return Plan((Launch("flash_fwd.metal", "k", (1, 1, 1), (32, 1, 1), {0: spec.q.clone(), 3: out}),))
    monkeypatch.setattr(ops.attention, "planner", type("P", (), {"plan_forward": staticmethod(deriving)}))
    q, k, v = _qkv()
    with tmf.backend("emulator"), pytest.raises(RuntimeError, match="neither an argument of the op"):
        fwd(*_args(q, k, v))


def test_scratch_and_filled_scratch_on_hits():
    """The backward's delta/stats scratch and the decode route's filled seqlens vector are fresh per call."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 1, 32, generator=g)
    k, v = (torch.randn(1, 2, 300, 32, generator=g) for _ in range(2))  # decode-shaped: split-K kernels
    args = (q, k, v, None, None, None, 0.2, 299, -1, 0, 0.0, False)
    with tmf.backend("emulator", strict=True):
        for _ in range(2):
            _check(*fwd(*args), args)
        assert backends.instance("emulator").last_stats[0].kernel.startswith("flash_decode")
        q2, k2, v2 = (t.requires_grad_() for t in _qkv(L=10))
        sinks = torch.randn(2, generator=g, requires_grad=True)
        for _ in range(2):
            out, lse, _ = fwd(q2, k2, v2, None, None, sinks, 0.3, 0, -1, 0, 0.0, True)
            grads = torch.autograd.grad(out.sum(), (q2, k2, v2, sinks))
    with tmf.backend("reference"):
        out, _, _ = fwd(q2, k2, v2, None, None, sinks, 0.3, 0, -1, 0, 0.0, True)
        want = torch.autograd.grad(out.sum(), (q2, k2, v2, sinks))
    for a, b in zip(grads, want):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-4)


def test_backend_choice_is_per_thread_and_follows_the_environment(monkeypatch):
    q, k, v = _qkv()
    tmf.run_counts(reset=True)
    seen = {}

    def worker():
        with tmf.backend("emulator"):
            fwd(*_args(q, k, v))
        seen["worker"] = True

    with tmf.backend("reference"):
        t = threading.Thread(target=worker)
        t.start()
        t.join()
        fwd(*_args(q, k, v))
    assert seen and tmf.run_counts(reset=True) == {"emulator": 1, "reference": 1}
    monkeypatch.setenv("TORCH_METAL_FLASH_BACKEND", "emulator")
    fwd(*_args(q, k, v))
    monkeypatch.setenv("TORCH_METAL_FLASH_BACKEND", "nonsense")
    with pytest.raises(ValueError, match="TORCH_METAL_FLASH_BACKEND"):
        fwd(*_args(q, k, v))
    assert tmf.run_counts(reset=True) == {"emulator": 1}


def test_stub_encoder_runs_nothing():
    q, k, v = _qkv()
    core.use_stub_encoder(True)
    try:
        with tmf.backend("emulator"):
            out, lse, _ = fwd(*_args(q, k, v))
    finally:
        core.use_stub_encoder(False)
    assert out.shape == q.shape and tmf.run_counts(reset=True) == {"stub": 1}


def test_emulator_errors_keep_their_type(monkeypatch):
    def failing(self, launches):
        raise emulator.OutOfBoundsError("kernel 'k': out of bounds", kernel="k")
    monkeypatch.setattr(EmulatorBackend, "encode", failing)
    q, k, v = _qkv()
    with tmf.backend("emulator"), pytest.raises(emulator.OutOfBoundsError, match="out of bounds"):
        fwd(*_args(q, k, v))


def test_probe_is_answered_from_the_cache():
    q, k, v = _qkv()
    with tmf.backend("emulator"):
        assert ops.unsupported_reason(*_args(q, k, v)[:11]) is None
        assert ops.unsupported_reason(*_args(q, k, v)[:11]) is None
        assert "head dim" in ops.unsupported_reason(*_args(*_qkv(D=600))[:11])
    info = core.plan_cache_info()
    assert (info["misses"], info["hits"]) == (2, 1)


def test_python_body_hands_calls_over():
    """The op's Python body (devices the core does not serve yet) runs the core's body or the reference."""
    q, k, v = _qkv()
    with tmf.backend("emulator"):
        out, lse, aux = core.python_body(ops.FWD, _args(q, k, v))
    _check(out, lse, aux, _args(q, k, v))
    with tmf.backend("reference"):
        out2, _, _ = core.python_body(ops.FWD, _args(q, k, v))
    assert tmf.run_counts(reset=True) == {"emulator": 1, "reference": 1}
    torch.testing.assert_close(out, out2, atol=2e-3, rtol=2e-3)


def test_concurrent_calls():
    q, k, v = _qkv()
    errors = []

    def worker(scale):
        try:
            with tmf.backend("emulator"):
                for _ in range(20):
                    fwd(*_args(q, k, v, scale=scale))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    core.use_stub_encoder(True)
    try:
        threads = [threading.Thread(target=worker, args=(s,)) for s in (0.1, 0.2, 0.1, 0.2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        info = core.plan_cache_info()
    finally:
        core.use_stub_encoder(False)  # (drops the cache)
    assert not errors and tmf.run_counts(reset=True) == {"stub": 80}
    assert info["size"] == 2 and info["hits"] + info["misses"] == 80


def test_mutating_op_bumps_the_versions_of_what_it_writes():
    """A call of a mutating op that needs no graph skips torch.library's (Python)
    ADInplaceOrView kernel: the core bumps the written arguments' versions itself."""
    g = torch.Generator().manual_seed(9)
    k_cache, v_cache = torch.zeros(1, 8, 1, 16), torch.zeros(1, 8, 1, 16)
    q, k, v = (torch.randn(1, 1, h, 16, generator=g) for h in (2, 1, 1))
    versions = k_cache._version, v_cache._version
    with tmf.backend("emulator", strict=True), torch.no_grad():
        tmf.flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=torch.tensor([3], dtype=torch.int32))
    assert k_cache._version > versions[0] and v_cache._version > versions[1]
    assert torch.equal(k_cache[0, 3], k[0, 0]) and torch.equal(v_cache[0, 3], v[0, 0])
    assert tmf.run_counts(reset=True) == {"emulator": 1}


@pytest.mark.parametrize("native", [True, False], ids=["cpp", "python"])
def test_call_signature_keys_exactly_what_the_checks_read(native, monkeypatch):
    """The faces' memo key: equal for calls the checks cannot tell apart (other values, same
    layout), different when a dtype, device, size, last-dim contiguity, scalar type or value differs."""
    from torch_metal_flash.problem import checks
    core.load()
    assert checks._native_signature is not None  # the loaded core provides it
    if not native:
        monkeypatch.setattr(checks, "_native_signature", None)
    sig = checks.call_signature
    t = torch.zeros(2, 3, 4)
    args = (t, None, 0.5, True, 1, (-1, 0))
    base = sig(*args)
    assert sig(torch.randn(2, 3, 4), None, 0.5, True, 1, (-1, 0)) == base
    assert sig(torch.zeros(3, 2, 4).transpose(0, 1), *args[1:]) == base  # other strides, last dim contiguous
    variants = [
        (t.half(), *args[1:]), (torch.zeros(2, 3, 5), *args[1:]), (torch.zeros(2, 4, 3).transpose(1, 2), *args[1:]),
        (torch.zeros(2, 3, 4, 1), *args[1:]), (t, t, *args[2:]), (t, None, 0.25, *args[3:]),
        (t, None, 1.0, True, 1, (-1, 0)), (t, None, 1, True, 1, (-1, 0)),  # float vs int
        (t, None, 0.5, 1, 1, (-1, 0)), (t, None, 0.5, False, 1, (-1, 0)),  # bool vs int, other bool
        (t, None, 0.5, True, 2, (-1, 0)), (t, None, 0.5, True, 1, (0, -1)), (t, None, 0.5, True, 1, (-1,)),
    ]
    keys = [sig(*a) for a in variants]
    assert base not in keys and len(set(keys)) == len(keys)
    with pytest.raises(TypeError):  # not keyable: the faces then check every call
        hash(sig(t, [1, 2]))
