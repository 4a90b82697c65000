"""The stock route (docs/tuning.md): the tuner times torch's own SDPA next to the kernels (a fake
timer here), routes a class to torch when it is faster within the memory rule; the SDPA face and
override then call torch's original (bitwise torch's output, counted as "torch"), in this process
and a fresh one; a forced route is per thread; a verdict of another torch version is not used."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F

import torch_metal_flash as tmf
from torch_metal_flash import tuning
from torch_metal_flash.tuning import cache as tuning_cache_module, stock

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLASS = dict(dtype=torch.float16, head_dim=64, seqlen_q=48, seqlen_k=48)
WINS = {**CLASS, "op": "fwd", "causal": True, "heads": 2}  # torch faster
LOSES = {**CLASS, "op": "fwd", "causal": False, "heads": 2}  # the kernels faster


def torch_wins(variant, run):
    return 0.1 if variant == "torch" else 1.0


def torch_loses(variant, run):
    return 10.0 if variant == "torch" else 1.0


@pytest.fixture
def tuned(tuning_cache):
    """One class where torch won, one where the kernels did."""
    with tmf.backend("emulator"):
        won = tuning.tune([WINS], timer=torch_wins)
        lost = tuning.tune([LOSES], timer=torch_loses)
    return tuning_cache, won[0], lost[0]


def _qkv(causal_shape=(1, 2, 48, 64), seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(causal_shape, generator=g).half() for _ in range(3))


def test_routing_through_the_face_and_the_override(tuned, launched):
    _, won, lost = tuned
    assert won["stock"]["route"] == "torch" and lost["stock"]["route"] == "kernels"
    assert won["stock"]["torch_seconds"] == 0.1 and won["stock"]["kernels_seconds"] == 1.0
    assert won["stock"]["torch_peak_bytes"] > 0 and won["stock"]["kernels_peak_bytes"] > 0
    assert tuning.choice("fwd", **CLASS, causal=True) == ("torch", "tuned")
    assert tuning.choice("fwd", **CLASS, causal=False) == (lost["variant"], "tuned")
    assert "torch" not in tuning.variants("fwd", dtype=torch.float16, head_dim=64)
    q, k, v = _qkv()
    tmf.run_counts(reset=True)
    with tmf.backend("emulator", strict=True):  # strict mode allows a tuned route
        face = tmf.scaled_dot_product_attention(q, k, v, is_causal=True)
        with tmf.sdpa_override():
            override = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert launched == [] and tmf.run_counts()["torch"] == 2
        kernels = tmf.scaled_dot_product_attention(q, k, v)
        flash = tmf.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.equal(face, expected) and torch.equal(override, expected)
    assert launched == [lost["variant"], won["variant"]]  # the other class, and the flash-attn face
    assert tmf.run_counts()["torch"] == 2 and kernels.shape == q.shape and flash.shape == (1, 48, 2, 64)


def test_a_fresh_process_reads_the_routes(tuned):
    path, won, lost = tuned
    code = (
        "import torch, torch.nn.functional as F, torch_metal_flash as tmf\n"
        "from torch_metal_flash.backends.emulator import EmulatorBackend\n"
        "names = []\nencode = EmulatorBackend.encode\n"
        "EmulatorBackend.encode = lambda self, l: (names.extend(p[1] for p, _ in l), encode(self, l))\n"
        "g = torch.Generator().manual_seed(1)\n"
        "q, k, v = (torch.randn(1, 2, 48, 64, generator=g).half() for _ in range(3))\n"
        "with tmf.backend('emulator', strict=True):\n"
        "    a = tmf.scaled_dot_product_attention(q, k, v, is_causal=True)\n"
        "    with tmf.sdpa_override():\n"
        "        b = F.scaled_dot_product_attention(q, k, v, is_causal=True)\n"
        "    tmf.scaled_dot_product_attention(q, k, v, is_causal=False)\n"
        "ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)\n"
        "print(torch.equal(a, ref), torch.equal(b, ref), tmf.run_counts().get('torch'), names)\n")
    env = {**os.environ, "TORCH_METAL_FLASH_TUNING_CACHE": str(path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"True True 2 {[lost['variant']]!r}"


def test_a_backward_class_routes_training_calls(tuning_cache, launched):
    problem = {**CLASS, "op": "bwd", "causal": True, "heads": 2}
    timed = []

    def timer(variant, run):
        timed.append(variant)
        return torch_wins(variant, run)

    with tmf.backend("emulator"):
        results = tuning.tune([problem], timer=timer)
    assert [r["stock"]["route"] for r in results] == ["torch", "torch"] and timed[-2:] == ["kernels", "torch"]
    assert tuning.choice("bwd", **CLASS, causal=True, part="dkv") == ("torch", "tuned")
    assert tuning.choice("fwd", **CLASS, causal=True)[1] == "default"  # inference keeps the kernels
    q, k, v = (t.requires_grad_() for t in _qkv())
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(3)).half()
    tmf.run_counts(reset=True)
    launched.clear()
    with tmf.backend("emulator", strict=True):
        grads = torch.autograd.grad(tmf.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), dout)
    expected = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), dout)
    assert launched == [] and tmf.run_counts()["torch"] == 1
    assert all(torch.equal(a, b) for a, b in zip(grads, expected))


def test_the_memory_rule(tuning_cache, monkeypatch):
    ws = 1 << 30
    assert stock.verdict(1.0, 0.5, ws // 16, ws) == ("torch", "torch is faster, within the memory rule")
    route, why = stock.verdict(1.0, 0.5, ws // 16 + 1, ws)
    assert route == "kernels" and "exceeds 1/16 of the working set (1024 MiB)" in why
    assert stock.verdict(1.0, 1.0, 0, ws)[0] == "kernels"  # a tie keeps the kernels
    # torch faster but over the rule on a machine with little memory: the class keeps the kernels
    monkeypatch.setattr(stock, "working_set_bytes", lambda device: 16 * 1024)
    with tmf.backend("emulator"):
        (r,) = tuning.tune([WINS], timer=torch_wins)
    assert r["stock"]["route"] == "kernels" and "exceeds 1/16" in r["stock"]["why"]
    assert r["stock"]["torch_peak_bytes"] > 1024
    assert tuning.choice("fwd", **CLASS, causal=True) == (r["variant"], "tuned")


def test_peak_bytes_counts_what_the_ops_allocate():
    x = torch.ones(1024)
    assert stock.peak_bytes(lambda: (x * 2) + 1) == 2 * 4096  # x * 2 alive while + runs
    assert stock.peak_bytes(lambda: x.view(32, 32).t()) == 0  # views allocate nothing


def test_a_verdict_of_another_torch_is_not_used(tuned, monkeypatch):
    path, _, _ = tuned
    assert {e["torch"] for e in json.loads(path.read_text())["entries"]} == {torch.__version__}
    monkeypatch.setattr(tuning_cache_module, "torch_version", lambda: "9.9.9")
    tuning.reload()
    with pytest.warns(tuning.TuningCacheWarning, match="another GPU, OS, package or torch version"):
        assert tuning.choice("fwd", **CLASS, causal=True)[1] == "default"
    q, k, v = _qkv()
    tmf.run_counts(reset=True)
    with tmf.backend("emulator", strict=True), warnings.catch_warnings():
        warnings.simplefilter("ignore", tuning.TuningCacheWarning)
        tmf.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert "torch" not in tmf.run_counts()


def test_forcing_the_route_is_per_thread(tuning_cache, launched):
    q, k, v = _qkv()
    other = {}

    def elsewhere():
        with tmf.backend("emulator", strict=True):
            other["out"] = tmf.scaled_dot_product_attention(q, k, v)
        other["choice"] = tuning.choice("fwd", **CLASS, causal=False)

    tmf.run_counts(reset=True)
    with tuning.use("fwd", "torch"), tmf.backend("emulator", strict=True):
        assert tuning.choice("fwd", **CLASS, causal=False) == ("torch", "forced")
        mine = tmf.scaled_dot_product_attention(q, k, v)
        thread = threading.Thread(target=elsewhere)
        thread.start()
        thread.join()
        tmf.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))  # flash-attn: the kernels
    default = tuning.variants("fwd", dtype=torch.float16, head_dim=64)[0]
    assert torch.equal(mine, F.scaled_dot_product_attention(q, k, v)) and tmf.run_counts()["torch"] == 1
    assert other["choice"] == (default, "default") and launched == [default, default]
    with pytest.raises(ValueError, match="'torch' \\(torch's own SDPA\\)"):
        with tuning.use("fwd", "flash"):
            pass


def test_autotune_times_the_stock_route(tuning_cache, monkeypatch):
    monkeypatch.setenv("TORCH_METAL_FLASH_AUTOTUNE", "1")
    monkeypatch.setattr(tuning, "budget_timer", lambda budget: torch_wins)
    q, k, v = _qkv((1, 1, 260, 64))  # a class no other test autotunes (once per class and process)
    tmf.run_counts(reset=True)
    with tmf.backend("emulator", strict=True):
        out = tmf.scaled_dot_product_attention(q, k, v)  # tunes the class first, then routes
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v)) and tmf.run_counts()["torch"] == 1
    assert tuning.choice("fwd", **{**CLASS, "seqlen_q": 260, "seqlen_k": 260}, causal=False) == ("torch", "tuned")


def test_budget_timer_always_times_the_stock_route():
    timer = tuning.budget_timer(0.0, warmup=0, repeats=1)
    ran = []
    timer("a", lambda: ran.append("a"))
    assert timer("b", lambda: ran.append("b")) == float("inf")
    assert timer("torch", lambda: ran.append("torch")) < float("inf") and ran == ["a", "torch"]


def test_tune_ends_with_a_table_per_class(tuned):
    import torch_metal_flash.tune as cli
    _, won, lost = tuned
    header, rule, first, second = cli.route_table([won, lost]).splitlines()
    assert "best kernel" in header and "torch ms" in header and "route" in header
    assert f"| {won['variant']} | 1000.000 | 100.000 | 0.10x |" in first and first.endswith("| torch |")
    assert f"| {lost['variant']} | 1000.000 | 10000.000 | 10.00x |" in second and second.endswith("| kernels |")


def test_the_doctor_prints_the_route_of_its_probes(tuning_cache, capsys):
    from torch_metal_flash import doctor
    with tmf.backend("emulator"):
        tuning.tune([dict(op="fwd", dtype=torch.float16, head_dim=32, seqlen_q=64, seqlen_k=64, causal=True,
                          heads=2)], timer=torch_wins)
    capsys.readouterr()
    assert doctor.main(["--skip", "compile,probes"]) == 0
    out = capsys.readouterr().out
    assert "| case | kernel in force | kernel ms | torch ms | speed-up (torch ms / kernel ms) | kernel peak | " \
           "torch peak | route |" in out
    rows = {line.split(" |")[0][2:]: line for line in out.splitlines() if line.startswith("| forward")}
    assert rows["forward B1 H2/2 Lq64 Lk64 d32 fp16"].endswith("| torch |")  # the tuned class
    assert rows["forward+backward B1 H2/2 Lq64 Lk64 d32 fp16"].endswith("| kernels |")


def test_a_compiled_graph_keeps_the_kernels(tuned):
    q, k, v = _qkv()
    compiled = torch.compile(lambda q, k, v: tmf.scaled_dot_product_attention(q, k, v, is_causal=True),
                             fullgraph=True, backend="eager")
    tmf.run_counts(reset=True)
    with tmf.backend("emulator", strict=True):
        out = compiled(q, k, v)
    assert "torch" not in tmf.run_counts() and tmf.run_counts()["emulator"] == 1 and out.shape == q.shape
