"""``python -m torch_metal_flash doctor`` on the emulator: it passes here, a
planted failure makes it exit nonzero, and the pipelines it compiles are the
ones the planners emit."""
import itertools

import pytest
import torch

from torch_metal_flash import doctor
from torch_metal_flash.backends import metal
from torch_metal_flash.backends.emulator import EmulatorBackend
from torch_metal_flash.problem.layout import empty_in_layout
from torch_metal_flash.planner.plan import Unsupported
from torch_metal_flash.planner import backward, forward, kvcache, variants
from torch_metal_flash.problem.spec import aux_width, make_spec


def test_doctor_passes_and_reports(tmp_path, capsys):
    report = tmp_path / "report.md"
    assert doctor.main(["--report", str(report)]) == 0
    text = report.read_text()
    for heading in ("# torch_metal_flash doctor", "## Pipelines", "## Probes", "## Kernel faults", "## Timing",
                    "**PASS**"):
        assert heading in text
    assert "failed to compile: injected fault" in text and "the emulator kernels run again" in text
    for kind in ("forward", "backward", "decode"):
        assert f"| {kind} " in text
    for source in variants.kernels():
        assert f"| {source} | " in text
    assert "FAIL" not in text and text in capsys.readouterr().out


def test_planted_wrong_result_fails(monkeypatch, capsys):
    encode = EmulatorBackend.encode
    dtypes = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}

    def corrupting_encode(self, launches):  # every emulator launch passes here (the op core's and run()'s)
        encode(self, launches)
        for (_, kernel, *_), buffers in launches:  # prepared: (source, kernel name, ...)
            if kernel.startswith("flash_fwd"):
                out = buffers[forward.BUF_O]  # raw memory from the op core, a tensor from run()
                if not isinstance(out, torch.Tensor):
                    out = torch.frombuffer(out, dtype=dtypes[kernel.split("_")[2]])
                out.add_(0.5)
    monkeypatch.setattr(EmulatorBackend, "encode", corrupting_encode)
    assert doctor.main(["--skip", "compile,timing"]) == 1
    out = capsys.readouterr().out
    assert "**FAIL**" in out and "- probe forward float16 B1 Lq37 Lk129 d64" in out
    assert "ok   decode" in out, "only what was planted fails"


def test_planted_compile_failure_fails(monkeypatch, capsys):
    info = EmulatorBackend.pipeline_info

    def failing(self, source, kernel, constants):
        if kernel == "flash_bwd_dsinks":
            raise RuntimeError("Compiler encountered an internal error")
        return info(self, source, kernel, constants)
    monkeypatch.setattr(EmulatorBackend, "pipeline_info", failing)
    assert doctor.main(["--skip", "probes,timing"]) == 1
    out = capsys.readouterr().out
    assert "| flash_bwd.metal | 325 | 5 |" in out
    assert "- compile flash_bwd_dsinks" in out and "internal error" in out


def test_a_fault_that_does_not_fall_back_fails(monkeypatch, capsys):
    from torch_metal_flash.backends import faults
    monkeypatch.setattr(faults, "check", lambda backend, source, kernel: None)  # injected faults never fire
    assert doctor.main(["--skip", "compile,probes,timing"]) == 1
    assert "an injected compile fault in flash_fwd_* did not fall back" in capsys.readouterr().out


def test_metal_asked_for_where_it_cannot_run_fails_with_the_reason(capsys):
    assert doctor.main(["--backend", "metal", "--skip", "compile,probes,timing"]) == 1
    assert "- no metal backend: torch_metal_flash._C (the Metal launcher) is not built" in capsys.readouterr().out


def test_mps_without_working_metal_kernels_fails(monkeypatch, capsys):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert doctor.main(["--skip", "compile,probes,timing"]) == 1
    assert "- MPS is available but the Metal kernels cannot run: torch_metal_flash._C" in capsys.readouterr().out


def test_macos_before_14_fails(monkeypatch):
    monkeypatch.setattr(doctor.platform, "mac_ver", lambda: ("13.6.1", ("", "", ""), "arm64"))
    rows, failures = doctor.machine_rows("emulator", None, "test")
    assert ("machine", f"macOS 13.6.1, {metal.chip_name()}") in rows
    assert failures == ["macOS 13.6.1: torch_metal_flash needs macOS 14 or newer (Metal Shading Language 3.1 for "
                        "bfloat; torch's MPS backend)"]


def test_neural_accelerator_row_says_whether_the_path_is_active_and_why_not():
    from torch_metal_flash import emulator
    rows, _ = doctor.machine_rows("emulator", EmulatorBackend(), "test")
    assert ("neural accelerators", "inactive: the emulator plans as apple8") in rows
    with emulator.settings(family="apple10"):
        rows, _ = doctor.machine_rows("emulator", EmulatorBackend(), "test")
    assert ("neural accelerators", "active (apple10 tables; *_nax.metal kernels compiled as MSL 4.0)") in rows


def test_nax_pipelines_are_listed_not_compiled_where_the_path_is_inactive(monkeypatch):
    nax = variants.Variant("flash_fwd_nax.metal", "flash_fwd_nax_f16_d128", ())
    monkeypatch.setattr(variants, "covering_variants", lambda: [nax])
    monkeypatch.setattr(variants, "planned_threads", lambda: {nax.kernel: 128})
    rows, notes, failures = doctor.compile_pipelines(EmulatorBackend(), False, out=lambda *_: None)
    assert failures == [] and notes == []
    assert rows == [("flash_fwd_nax.metal", 1, 0,
                     "- (not compiled: neural accelerators inactive: the emulator plans as apple8)", "-")]


def test_unknown_section_is_an_error():
    with pytest.raises(SystemExit):
        doctor.main(["--skip", "probe"])


# ---------------------------------------------------------------------------
# The variant list follows the planners.
# ---------------------------------------------------------------------------

def _key(launch):
    return variants.Variant(launch.source, launch.kernel, tuple(sorted(launch.function_constants.items())))


def _specs():
    """Small problems over dtypes, head dims (aligned or not) and every feature the kernels take."""
    g = torch.Generator().manual_seed(0)
    masks = [None, torch.bool, torch.float32, torch.float16, torch.bfloat16]
    for i, (dtype, D, mask, band, extras) in enumerate(itertools.product(
            (torch.float32, torch.float16, torch.bfloat16), (32, 72, 256), masks, (False, True),
            ((), ("alibi",), ("sinks", "softcap")))):
        q, k, v = (torch.randn(1, H, L, D, generator=g).to(dtype) for H, L in ((4, 9), (2, 11), (2, 11)))
        m = None if mask is None else (torch.rand(1, 1, 9, 11, generator=g) > 0.3).to(mask)
        yield make_spec(q, k, v, m, torch.rand(4, generator=g) if "alibi" in extras else None,
                        torch.randn(4, generator=g) if "sinks" in extras else None, scale=0.3,
                        window_left=3 if band else -1, window_right=0 if band else -1,
                        softcap=5.0 if "softcap" in extras else 0.0), i


def _kvcache_plan(spec, i):
    """flash_attn_with_kvcache's plan (append + decode) on the spec's tensors, features varied by ``i``."""
    q, kc, vc = spec.q.transpose(1, 2), spec.k.transpose(1, 2), spec.v.transpose(1, 2)
    D, dt = q.shape[-1], q.dtype
    table = torch.arange(11, dtype=torch.int32)[None] if i % 7 == 0 else None
    if table is not None:  # paged, one position per page
        kc, vc = kc.reshape(11, 1, 2, D), vc.reshape(11, 1, 2, D)
    new = torch.zeros(1, 2, 2, D, dtype=dt) if i % 2 else None
    rope = torch.zeros(11, D // 2, dtype=torch.float32 if i % 4 == 1 else dt) if i % 4 in (1, 3) else None
    lengths = torch.full((1,), 9, dtype=torch.int32) if i % 3 else None
    problem = kvcache.KvCacheProblem(
        q, kc, vc, new, new, rope, rope, lengths, torch.zeros(1, dtype=torch.int32) if i % 5 == 0 and table is None
        else None, torch.zeros(1, dtype=torch.int32) if i % 3 == 1 else None, table, spec.alibi_slopes, 9, 0.3,
        spec.window_left, spec.window_right, spec.softcap, i % 8 < 4, 1 + i % 2)
    return kvcache.plan_kvcache(problem, torch.empty(q.shape, dtype=dt), torch.empty(1, 4, 9))


def test_every_planned_launch_is_a_listed_variant_within_its_planned_threads():
    listed = set(variants.all_variants())
    threads = variants.planned_threads()
    assert set(variants.covering_variants()) <= listed
    seen = set()
    for spec, i in _specs():
        out = empty_in_layout(spec.q, spec.head_dim_v)
        lse = torch.empty(spec.q.shape[:3])
        aux = torch.empty(*lse.shape, aux_width(spec.q.dtype, spec.head_dim_v))
        plans = [forward.plan_forward(spec, out, lse, aux if i % 3 else None)]
        dbias = torch.empty(1, 4, 9, 11) if spec.mask is not None and spec.mask.is_floating_point() else None
        plans.append(backward.plan_backward(spec, out, out, aux, torch.randn(lse.shape) if i % 2 else None,
                                            *(empty_in_layout(t) for t in (spec.q, spec.k, spec.v)), dbias,
                                            torch.empty(4) if spec.sinks is not None else None))
        plans.append(_kvcache_plan(spec, i))
        for plan in plans:
            assert not isinstance(plan, Unsupported), plan
            for launch in plan.launches:
                key = _key(launch)
                assert key in listed, f"planned but not listed for the doctor: {key}"
                assert launch.threadgroup[0] <= threads[launch.kernel]
                seen.add(key.kernel)
    assert len(seen) > 30
