"""The tuning space and tuner (torch_metal_flash.tuning): every variant runs when forced
(its kernel is the one launched) and is within the float64 oracle's budget forward
and backward in checked mode and two schedule orders; the tuner picks the fastest
under a given timer, persists it, a fresh process plans with it; a corrupt or
stale cache is survived with one warning; ``use`` rejects what it cannot force."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

import torch_metal_flash as tmf
from torch_metal_flash import emulator, tuning
from torch_metal_flash.backends.emulator import EmulatorBackend
from torch_metal_flash.planner import backward_tiles, decode, tiles
from torch_metal_flash.problem.spec import make_spec
from torch_metal_flash.testing import check_backward, check_forward

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ORDERS = ("forward", "reverse")


def _inputs(dtype, D, Lq, Lk, Hq=2, Hkv=1, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, L, H, D, generator=g).to(dtype) for L, H in ((Lq, Hq), (Lk, Hkv), (Lk, Hkv)))
    if grad:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    return q, k, v


def _spec(q, k, v, causal):
    Lq, Lk = q.shape[1], k.shape[1]
    return make_spec(*(t.detach().transpose(1, 2) for t in (q, k, v)), scale=q.shape[-1] ** -0.5,
                     diag_offset=Lk - Lq, window_right=0 if causal else -1)


# ----------------------------------------------------------------------------- the space

def test_variant_space_sizes_and_limits():
    backend = EmulatorBackend()
    for family in tiles.FAMILIES:
        for dtype in DTYPES:
            for bd in tiles.HEAD_DIM_BUCKETS:
                fwd = tuning.variants("fwd", dtype=dtype, head_dim=bd, family=family)
                assert fwd[0] == tiles.forward_tile(dtype, bd, family).kernel
                if bd >= 64:
                    assert len(set(fwd)) == len(fwd) >= (2 if dtype == torch.float32 else 3), (family, dtype, bd)
            for bd in backward_tiles.EXTRA_BUCKETS:
                names = tuning.variants("bwd", dtype=dtype, head_dim=bd, family=family)
                assert sum(n.startswith("flash_bwd_dq") for n in names) >= 2
                assert sum(n.startswith("flash_bwd_dkv") for n in names) >= 2
            for bd in decode.DECODE_EXTRA[tiles.DTYPE_NAMES[dtype]]:
                assert len(tuning.variants("decode", dtype=dtype, head_dim=bd, family=family)) >= 2
    # every variant within 32 KiB and the threads its pipeline allows (the limits the planner checks)
    for t in [*tiles.forward_variants(), *backward_tiles.backward_variants()]:
        with emulator.settings(family=fc.tile_family(t)):
            info = backend.pipeline_info(t.source, t.kernel, {})
        assert t.threadgroup_memory == info["static_threadgroup_memory_length"] <= 32 * 1024, t
        assert t.threads <= info["max_total_threads_per_threadgroup"], t
    for t in decode.decode_variants():
        info = backend.pipeline_info(t.source, t.kernel, {})
        assert 32 * decode.row_cap(t.bd) // 8 <= info["max_total_threads_per_threadgroup"], t
        assert info["static_threadgroup_memory_length"] <= 32 * 1024, t


def test_use_rejects_unknown_and_inapplicable_variants():
    with pytest.raises(ValueError,
                       match=r"'flash_fwd_f16_d64_q8_k8' is not a variant of 'fwd'.*flash_fwd_f16_d64_q32_k64"):
        with tuning.use("fwd", "flash_fwd_f16_d64_q8_k8"):
            pass
    with pytest.raises(ValueError, match=r"'flash_bwd_dq_f16_d64_q64_k32' is not a variant of 'fwd'"):
        with tuning.use("fwd", "flash_bwd_dq_f16_d64_q64_k32"):
            pass
    with pytest.raises(ValueError, match="op must be one of"):
        tuning.variants("prefill", dtype=torch.float16, head_dim=64)
    with pytest.raises(ValueError, match="family must be one of"):
        tuning.variants("fwd", dtype=torch.float16, head_dim=64, family="apple6")


def test_emulator_family_setting_plans_as_that_family(launched):
    assert tuning.variants("fwd", dtype=torch.float16, head_dim=128)[0] == "flash_fwd_f16_d128_q32_k32"
    q, k, v = _inputs(torch.float16, 128, 9, 9)
    with tmf.backend("emulator", strict=True):
        tmf.flash_attn_func(q, k, v, causal=True)
        with emulator.settings(family="apple9"):
            assert tuning.variants("fwd", dtype=torch.float16, head_dim=128)[0] == "flash_fwd_f16_d128_q32_k16"
            tmf.flash_attn_func(q, k, v, causal=True)
        tmf.flash_attn_func(q, k, v, causal=True)  # a plan-cache hit of the first call
    assert launched == ["flash_fwd_f16_d128_q32_k32", "flash_fwd_f16_d128_q32_k16", "flash_fwd_f16_d128_q32_k32"]
    with pytest.raises(ValueError, match="unknown GPU family"):
        with emulator.settings(family="m3"):
            pass


# ----------------------------------------------------------------------------- every variant, verified

def _run_forced(op, variant, fn, launched):
    results = []
    for order in ORDERS:
        launched.clear()
        with tuning.use(op, variant), tmf.backend("emulator", strict=True), \
                emulator.settings(order=order, checked=True):
            results.append(fn())
        assert variant in launched, (variant, launched)
    for a, b in zip(*results):  # the schedule must not change a bit
        assert torch.equal(a.float().nan_to_num(), b.float().nan_to_num())
    return results[0]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bd", [b for b in tiles.HEAD_DIM_BUCKETS if b >= 64])
def test_every_forward_variant_runs_and_matches_the_oracle(dtype, bd, launched):
    q, k, v = _inputs(dtype, bd, 40, 72, seed=bd)
    spec = _spec(q, k, v, causal=True)
    for variant in tuning.variants("fwd", dtype=dtype, head_dim=bd):
        out, lse = _run_forced("fwd", variant, lambda: tmf.flash_attn_func(q, k, v, causal=True,
                                                                            return_attn_probs=True)[:2], launched)
        check_forward(spec, out.transpose(1, 2), lse)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bd", backward_tiles.EXTRA_BUCKETS)
def test_every_backward_variant_runs_and_matches_the_oracle(dtype, bd, launched):
    q, k, v = _inputs(dtype, bd, 40, 40, seed=bd, grad=True)
    spec = _spec(q, k, v, causal=False)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(dtype)

    def grads():
        out = tmf.flash_attn_func(q, k, v)
        return torch.autograd.grad(out, (q, k, v), dout)

    for variant in tuning.variants("bwd", dtype=dtype, head_dim=bd):
        dq, dk, dv = _run_forced("bwd", variant, grads, launched)
        check_backward(spec, dout.transpose(1, 2), None, (dq.transpose(1, 2), dk.transpose(1, 2),
                                                          dv.transpose(1, 2), None, None))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bd", (64, 128))
def test_every_decode_variant_runs_and_matches_the_oracle(dtype, bd, launched):
    q, k, v = _inputs(dtype, bd, 1, 300, Hq=4, Hkv=2, seed=bd)
    spec = _spec(q, k, v, causal=True)
    for variant in tuning.variants("decode", dtype=dtype, head_dim=bd):
        out, lse = _run_forced("decode", variant, lambda: tmf.flash_attn_func(q, k, v, causal=True,
                                                                               return_attn_probs=True)[:2], launched)
        check_forward(spec, out.transpose(1, 2), lse)


# ----------------------------------------------------------------------------- the tuner and its cache

PROBLEM = {"op": "fwd", "dtype": torch.float16, "head_dim": 64, "seqlen_q": 48, "seqlen_k": 48, "causal": True,
           "heads": 2}


def test_tuner_picks_the_fastest_persists_and_a_fresh_process_plans_with_it(tuning_cache, launched):
    names = tuning.variants("fwd", dtype=torch.float16, head_dim=64)
    fastest = names[-1]
    timed = []

    def timer(variant, run):
        run()
        timed.append(variant)
        return 1.0 if variant == fastest else 2.0 + names.index(variant) if variant in names else 9.0

    key = dict(PROBLEM)
    del key["op"], key["heads"]
    assert tuning.choice("fwd", **key) == (names[0], "default")
    with tmf.backend("emulator"):
        result = tuning.tune([PROBLEM], timer=timer)
    assert timed == [*names, "torch"] and set(launched) == set(names)  # each variant ran once, as itself
    assert [(r["part"], r["variant"], r["default"]) for r in result] == [("fwd", fastest, names[0])]
    assert result[0]["speedup"] == 2.0
    assert tuning.choice("fwd", **key) == (fastest, "tuned")
    assert tuning.choice("fwd", **{**key, "seqlen_k": 5000})[1] == "default"  # another length class
    entry, = json.loads(tuning_cache.read_text())["entries"]
    assert entry["variant"] == fastest and entry["gpu"] == "emulator-apple8" and entry["op"] == "fwd"
    # this process plans with it (the plan cache keys on the cache's generation) ...
    q, k, v = _inputs(torch.float16, 64, 48, 48)
    launched.clear()
    with tmf.backend("emulator", strict=True):
        tmf.flash_attn_func(q, k, v, causal=True)
    assert launched == [fastest]
    # ... and so does a fresh one
    code = ("import torch, torch_metal_flash as tmf\n"
            "from torch_metal_flash.backends.emulator import EmulatorBackend\n"
            "names = []\nencode = EmulatorBackend.encode\n"
            "EmulatorBackend.encode = lambda self, l: (names.extend(p[1] for p, _ in l), encode(self, l))\n"
            "q = torch.randn(1, 48, 2, 64).half()\n"
            "with tmf.backend('emulator', strict=True):\n    tmf.flash_attn_func(q, q, q, causal=True)\n"
            "print(tmf.tuning.choice('fwd', dtype=torch.float16, head_dim=64, seqlen_q=48, seqlen_k=48, causal=True))\n"
            "print(names)\n")
    env = {**os.environ, "TORCH_METAL_FLASH_TUNING_CACHE": str(tuning_cache)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == [repr((fastest, "tuned")), repr([fastest])]


def test_tuner_never_chooses_a_variant_with_wrong_results(tuning_cache, launched, monkeypatch):
    """The gate runs each variant against the oracle first: one that fails (injected here: the
    emulator runs every variant right) is not timed, not chosen, and reported."""
    from torch_metal_flash.testing import tuning_gate as gate
    import torch_metal_flash.tune as cli

    names = tuning.variants("fwd", dtype=torch.float16, head_dim=64)
    bad = names[-1]
    real = gate.wrong_result

    def gate_with_one_wrong_variant(op, problem, device):
        launched.clear()
        why = real(op, problem, device)
        assert why is None and launched, "the gate runs the forced variant, which matches the oracle"
        return "out: max error 1.0e+00 > allowed 1.0e-03 (injected)" if launched[-1] == bad else None

    monkeypatch.setattr(gate, "wrong_result", gate_with_one_wrong_variant)
    with tmf.backend("emulator"):
        result = tuning.tune([PROBLEM], timer=lambda variant, run: 0.5 if variant == bad else 1.0)
    (r,) = result
    assert r["variant"] != bad and bad not in r["seconds"] and list(r["rejected"]) == [bad]
    assert "REJECTED: out: max error" in cli.table(result)


def test_tuning_on_an_m5_times_the_accelerator_variants(tuning_cache, launched):
    with emulator.settings(family="apple10"):
        names = tuning.variants("fwd", dtype=torch.float16, head_dim=128)
        nax = [n for n in names if "_nax_" in n]
        assert names[0] == nax[0] and len(nax) >= 3
        result = tuning.tune([{**PROBLEM, "head_dim": 128}],
                             timer=lambda variant, run: 0.5 if variant == nax[-1] else 1.0)
        assert result[0]["variant"] == nax[-1] and not result[0]["rejected"]
        assert set(nax) <= set(launched)  # the gate ran each of them
        assert tuning.choice("fwd", dtype=torch.float16, head_dim=128, seqlen_q=48, seqlen_k=48,
                             causal=True) == (nax[-1], "tuned")


@pytest.mark.parametrize("content", ["{not json", json.dumps({"format": 99, "entries": []}),
                                     json.dumps({"format": 1, "entries": [{"op": "fwd"}]})])
def test_corrupt_cache_gives_one_warning_and_the_defaults(tuning_cache, content, launched):
    tuning_cache.write_text(content)
    q, k, v = _inputs(torch.float16, 64, 48, 48)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert tuning.choice("fwd", dtype=torch.float16, head_dim=64, seqlen_q=48, seqlen_k=48,
                                 causal=True)[1] == "default"
        with tmf.backend("emulator", strict=True):
            tmf.flash_attn_func(q, k, v, causal=True)
    ours = [w for w in caught if issubclass(w.category, tuning.TuningCacheWarning)]
    assert len(ours) == 1 and str(tuning_cache) in str(ours[0].message)
    assert launched == [tuning.variants("fwd", dtype=torch.float16, head_dim=64)[0]]


def test_stale_or_wrong_entries_are_not_used(tuning_cache):
    key = dict(op="fwd", part="fwd", dtype="f16", head_dim=64, head_dim_v=64, features="causal", seq="q256_k256")
    machine = dict(gpu="emulator-apple8", os=__import__("platform").system(), package=tmf.__version__,
                   torch=torch.__version__)
    entries = [{**key, **machine, "package": "0.0.1", "variant": "flash_fwd_f16_d64_q64_k32"}]
    tuning_cache.write_text(json.dumps({"format": 1, "entries": entries}))
    with pytest.warns(tuning.TuningCacheWarning, match="another GPU, OS, package or torch version"):
        assert tuning.choice("fwd", dtype=torch.float16, head_dim=64, seqlen_q=48, seqlen_k=48,
                             causal=True)[1] == "default"
    # an entry naming a kernel that does not take the problem is ignored (never a wrong kernel)
    tuning_cache.write_text(json.dumps({"format": 1, "entries": [{**key, **machine,
                                                                   "variant": "flash_fwd_f16_d128_q64_k32"}]}))
    tuning.reload()
    assert tuning.choice("fwd", dtype=torch.float16, head_dim=64, seqlen_q=48, seqlen_k=48,
                         causal=True) == ("flash_fwd_f16_d64_q32_k64", "default")


def test_autotune_tunes_a_class_once_when_first_met(tuning_cache, monkeypatch, launched):
    monkeypatch.setenv("TORCH_METAL_FLASH_AUTOTUNE", "1")
    monkeypatch.setenv("TORCH_METAL_FLASH_AUTOTUNE_BUDGET", "1000")  # time every variant
    names = tuning.variants("fwd", dtype=torch.float16, head_dim=64)
    q, k, v = _inputs(torch.float16, 64, 20, 20)
    with tmf.backend("emulator", strict=True):
        tmf.flash_attn_func(q, k, v)  # tunes the class: every variant runs, then the call itself
        entry, = json.loads(tuning_cache.read_text())["entries"]
        winner = (entry["variant"], "tuned")
        # the class's route: torch's SDPA where it was faster (the flash-attn face keeps the kernels)
        assert tuning.choice("fwd", dtype=torch.float16, head_dim=64, seqlen_q=20, seqlen_k=20, causal=False) == \
            (("torch", "tuned") if entry["stock"]["route"] == "torch" else winner)
        assert set(launched[:-1]) == set(names) and launched[-1] == winner[0]
        launched.clear()
        tmf.flash_attn_func(q, k, v)  # a plan-cache hit: no tuning
        tmf.flash_attn_func(q[:, :17], k, v)  # the same class, another shape: planned with the winner, no tuning
    assert launched == [winner[0], winner[0]]
    entry, = json.loads(tuning_cache.read_text())["entries"]
    assert entry["variant"] == winner[0] and set(entry["seconds"]) == set(names)
    # a backward pass meets the bwd class: tuned inside the backward (the ops are timed directly)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with tmf.backend("emulator", strict=True):
        tmf.flash_attn_func(q, k, v).sum().backward()
    parts = {e["part"]: e for e in json.loads(tuning_cache.read_text())["entries"]}
    assert set(parts) == {"fwd", "dq", "dkv"}
    for part in ("dq", "dkv"):
        assert tuning.choice("bwd", dtype=torch.float16, head_dim=64, seqlen_q=20, seqlen_k=20, causal=False,
                             part=part) == ("torch" if parts[part]["stock"]["route"] == "torch"
                                            else parts[part]["variant"], "tuned")
        assert len(parts[part]["seconds"]) == 2


def test_budget_timer_stops_timing_after_the_budget():
    ran = []
    timer = tuning.budget_timer(0.0, warmup=0, repeats=1)
    assert timer("a", lambda: ran.append("a")) >= 0 and ran == ["a"]  # the default is always timed
    assert timer("b", lambda: ran.append("b")) == float("inf") and ran == ["a"]


def test_cli_list_verify_and_tune_without_a_gpu(capsys):
    import torch_metal_flash.tune as cli
    assert cli.main(["--list", "--ops", "bwd", "--dtypes", "bfloat16", "--head-dims", "128"]) == 0
    text = capsys.readouterr().out
    assert ("flash_bwd_dq_bf16_d128_q64_k32, flash_bwd_dq_bf16_d128_q32_k32, flash_bwd_dkv_bf16_d128_k32_q8_m0, "
            "flash_bwd_dkv_bf16_d128_k64_q32_m1, flash_bwd_dkv_bf16_d128_k16_q8_m0") in text
    assert cli.main(["--verify", "--ops", "decode", "--dtypes", "float16", "--head-dims", "64"]) == 0
    text = capsys.readouterr().out
    assert text.count(" ok (") == 2 and "every variant matches the oracle" in text
    if not torch.backends.mps.is_available():
        assert cli.main([]) == 2 and "tune --list" in capsys.readouterr().err
    grid = cli.grid(["fwd", "decode"], [torch.float16], [64], quick=True)
    assert len(grid) == 3 and {p["op"] for p in grid} == {"fwd", "decode"}
    row = dict(op="fwd", dtype=torch.float16, head_dim=64, seqlen_q=1024, seqlen_k=1024, causal=False, heads=16)
    assert cli.rate(row, 1e-3) == f"{4 * 16 * 1024 * 1024 * 64 / 1e-3 / 1e12:.2f} TFLOP/s"


def test_forced_variants_are_per_thread(launched):
    import threading
    names = tuning.variants("fwd", dtype=torch.float16, head_dim=96)
    q, k, v = _inputs(torch.float16, 96, 12, 12)
    other = []

    def run_elsewhere():
        with tmf.backend("emulator", strict=True):
            tmf.flash_attn_func(q, k, v)
        other.append(tuning.choice("fwd", dtype=torch.float16, head_dim=96, seqlen_q=12, seqlen_k=12, causal=False))

    with tuning.use("fwd", names[2]), tmf.backend("emulator", strict=True):
        assert tuning.choice("fwd", dtype=torch.float16, head_dim=96, seqlen_q=12, seqlen_k=12,
                             causal=False) == (names[2], "forced")
        tmf.flash_attn_func(q, k, v)
        thread = threading.Thread(target=run_elsewhere)
        thread.start()
        thread.join()
        tmf.flash_attn_func(q, k, v)  # a hit of this thread's plan
    assert launched == [names[2], names[0], names[2]] and other == [(names[0], "default")]
    with tmf.backend("emulator", strict=True):
        tmf.flash_attn_func(q, k, v)
    assert launched[-1] == names[0]


# ----------------------------------------------------------------------------- a sampled matrix

from support import backward_cases as bk  # noqa: E402
from support import forward_cases as fc  # noqa: E402

MATRIX_SEED = 20261202


def _forced_cases(cases, op, part, seed):
    """Each case with a variant of its bucket other than the default, drawn with a fixed seed."""
    import random
    rng = random.Random(seed)
    out = []
    for c in cases:
        names = [n for n in tuning.variants(op, dtype=fc.DTYPES[c["dtype"]], head_dim=c["d"])
                 if n.startswith({"fwd": "flash_fwd", "dq": "flash_bwd_dq", "dkv": "flash_bwd_dkv"}[part])]
        out.append((c, names[1 + rng.randrange(len(names) - 1)] if len(names) > 1 else names[0]))
    return out


FWD_MATRIX = _forced_cases(fc.sample_cases(10, MATRIX_SEED, head_dims=(64, 80, 96, 128, 160, 256, 72, 100, 200)),
                           "fwd", "fwd", MATRIX_SEED)
BWD_MATRIX = _forced_cases([dict(c, d=d) for c, d in zip(bk.sample_cases(6, MATRIX_SEED), (64, 40, 128, 100, 64, 128))],
                           "bwd", "dq", MATRIX_SEED)


@pytest.mark.parametrize("i,case,variant", [(i, c, v) for i, (c, v) in enumerate(FWD_MATRIX)],
                         ids=[f"{fc.case_id(c)}-{v}" for c, v in FWD_MATRIX])
def test_sampled_matrix_forward_with_forced_variants(i, case, variant, launched):
    """Features, layouts, GQA, masks and odd head dims on the non-default variants."""
    with tuning.use("fwd", variant):
        fc.run_and_check(case, orders=(ORDERS, ORDERS[::-1])[i % 2], checked=True)
    assert set(launched) == {variant}


@pytest.mark.parametrize("i,case,variant", [(i, c, v) for i, (c, v) in enumerate(BWD_MATRIX)],
                         ids=[f"{fc.case_id(c)}-{v}" for c, v in BWD_MATRIX])
def test_sampled_matrix_backward_with_forced_variants(i, case, variant, launched, monkeypatch):
    """The same for the backward: a non-default dQ variant and (odd cases) a non-default dK/dV one."""
    run_plan = bk.run_plan  # runs the launches' libraries directly, not through the backend

    def recording_run_plan(plan, **kw):
        launched.extend(launch.kernel for launch in plan.launches)
        return run_plan(plan, **kw)

    monkeypatch.setattr(bk, "run_plan", recording_run_plan)
    dtype = fc.DTYPES[case["dtype"]]
    dkv = tuning.variants("bwd", dtype=dtype, head_dim=case["d"])[-1]
    with tuning.use("bwd", variant), tuning.use("bwd", dkv if i % 2 else variant):
        bk.run_and_check(case, orders=(ORDERS, ORDERS[::-1])[i % 2])
    assert variant in launched and (not i % 2 or dkv in launched)


def test_doctor_reports_tuned_or_not_and_the_choices_in_force(tuning_cache):
    from torch_metal_flash import doctor
    tuned, rows = doctor.tuning_rows("apple8")
    assert tuned.startswith("not tuned: the apple8 defaults") and str(tuning_cache) in tuned
    assert all(row[-1] == "default" for row in rows)
    key = dict(op="fwd", part="fwd", dtype="f16", head_dim=64, head_dim_v=64, features="causal", seq="q1K_k1K")
    machine = dict(gpu="emulator-apple8", os=__import__("platform").system(), package=tmf.__version__,
                   torch=torch.__version__)
    tuning_cache.write_text(json.dumps({"format": 1, "entries": [{**key, **machine,
                                                                   "variant": "flash_fwd_f16_d64_q64_k32"}]}))
    tuning.reload()
    tuned, rows = doctor.tuning_rows("apple8")
    assert tuned.startswith("tuned: 1 choices measured on this machine")
    tuned_rows = [row for row in rows if row[-1] == "tuned"]
    assert tuned_rows == [("fwd", "fwd", "float16", 64, "1024 x 1024", True, "flash_fwd_f16_d64_q64_k32", "tuned")]
