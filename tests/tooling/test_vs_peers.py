"""bench/vs_peers.py's machinery on a tiny problem, with a naive Metal kernel of ours standing in for
a peer (the real peers' sources come from wheels CI does not have)."""
from __future__ import annotations

import dataclasses
import struct
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import vs_peers  # noqa: E402
from torch_metal_flash import emulator  # noqa: E402

# One thread per (query row, head): every visible key and value row read from device memory once per row.
NAIVE = """
#include <metal_stdlib>
using namespace metal;
struct Params { int L; int D; int causal; float scale; };
kernel void naive_attention(device const half* q [[buffer(0)]], device const half* k [[buffer(1)]],
                            device const half* v [[buffer(2)]], device half* o [[buffer(3)]],
                            constant Params& p [[buffer(4)]], uint2 pos [[thread_position_in_grid]]) {
  const int row = pos.x, head = pos.y;
  if (row >= p.L) return;
  const long base = long(head) * p.L * p.D;
  float qr[64], acc[64];
  for (int d = 0; d < p.D; ++d) { qr[d] = float(q[base + row * p.D + d]) * p.scale; acc[d] = 0.0f; }
  float m = -INFINITY, l = 0.0f;
  const int end = p.causal ? row + 1 : p.L;
  for (int j = 0; j < end; ++j) {
    float s = 0.0f;
    for (int d = 0; d < p.D; ++d) s += qr[d] * float(k[base + j * p.D + d]);
    const float mn = max(m, s), c = exp(m - mn), e = exp(s - mn);
    l = l * c + e;
    for (int d = 0; d < p.D; ++d) acc[d] = acc[d] * c + e * float(v[base + j * p.D + d]);
    m = mn;
  }
  for (int d = 0; d < p.D; ++d) o[base + row * p.D + d] = half(acc[d] / l);
}
"""


def naive_peer(p: vs_peers.Problem) -> vs_peers.Kernel:
    lib = emulator.compile_shader(NAIVE)

    def run(q, k, v, scale, causal):
        o = q.new_zeros(q.shape)
        L, H = q.shape[2], q.shape[1]
        st = lib.naive_attention(q, k, v, o, struct.pack("<3if", L, q.shape[3], int(causal), scale),
                                 grid=(L, H), threadgroup=(32, 1))
        return o, [st]

    return vs_peers.Kernel("naive", "one thread per row", run, (1, 1), (4,))


@pytest.mark.parametrize("causal", [False, True])
def test_counters_of_every_kernel_on_a_tiny_problem(causal):
    p = vs_peers.Problem(seqlen=64, head_dim=64, causal=causal, dtype="f16", heads=2)
    rows = vs_peers.run_problem(p, [naive_peer], heads=1, log=lambda *_: None)
    ours, (naive,) = rows[:-1], rows[-1:]
    assert all(r["ok"] for r in rows), [(r["kernels"], r["err"]) for r in rows]

    # the naive kernel's traffic, counted by hand for both heads
    row_bytes, pairs = 64 * 2, p.visible_pairs()
    assert naive["tensors"] == {"Q": 2 * 64 * row_bytes, "K": pairs * row_bytes, "V": pairs * row_bytes,
                                "O": 2 * 64 * row_bytes}
    assert naive["device_ratio"] == pytest.approx(naive["device"] / p.compulsory_bytes())
    assert naive["mma"] == 0 and naive["barriers"] == 0 and naive["tg_memory"] == 0
    assert naive["threadgroups"] == 2 * 2 and naive["barriers_per_block"] == 0

    # ours: every listed variant really ran, each read Q, K, V at least once and wrote O and the LSE once
    listed = vs_peers.our_kernels(p)
    assert [r["kernels"] for r in ours] == [[k.label] for k in listed]
    for r in ours:
        assert r["tensors"]["O"] == 2 * 64 * row_bytes and r["tensors"]["LSE"] == 2 * 64 * 4
        assert r["device_ratio"] > 1 and r["mma_ratio"] >= 1 and r["mma"] > 0
        assert r["barriers_per_block"] > 0 and 0 < r["tg_memory"] <= 32 * 1024

    v = vs_peers.verdict(p, rows)
    assert v["peer_bytes"] is naive and v["bytes"] < 1  # the naive kernel re-reads K and V per row
    text = vs_peers.render([(p, rows)], ["synthetic"], "pytest", [], 0.0, heads=1)
    assert p.name in text and "naive_attention" in text and "M4 Max" in text


def test_counts_scale_exactly_with_the_heads_emulated():
    p = vs_peers.Problem(seqlen=48, head_dim=64, causal=True, dtype="f16", heads=2)
    one, two = (vs_peers.run_problem(p, [naive_peer], heads=h, log=lambda *_: None) for h in (1, 2))
    keys = ("device", "tensors", "barriers", "mma", "threadgroups", "tg_memory", "device_ratio", "mma_ratio",
            "barriers_per_block", "kernels")
    for a, b in zip(one, two):
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}


def test_rows_are_checked():
    assert [p.name for p in vs_peers.select("1K-d64-causal-f16", False)] == ["1K-d64-causal-f16"]
    assert {p.seqlen for p in vs_peers.select(None, True) if not p.decode} == {1024}
    assert [p.name for p in vs_peers.select(None, True) if p.decode] == ["decode1x4K-d64-gqa32:8-f16",
                                                                          "decode1x4K-d128-gqa32:8-f16"]
    assert len(vs_peers.PROBLEMS) == 18
    with pytest.raises(SystemExit, match="unknown problem"):
        vs_peers.select("2K-d64-causal-f16", False)


def test_saved_runs_render_into_one_report(tmp_path):
    import json
    p = vs_peers.Problem(seqlen=32, head_dim=64, causal=True, dtype="f16", heads=1)
    rows = vs_peers.run_problem(p, [naive_peer], log=lambda *_: None)
    saved = tmp_path / "run.jsonl"
    saved.write_text(json.dumps(dict(problem=vars(p), rows=rows, sources=["synthetic"], command="`x`", heads=1,
                                     minutes=0.5)) + "\n")
    out = tmp_path / "report.md"
    assert vs_peers.main(["--render", str(saved), "--out", str(out)]) == 0
    text = out.read_text()
    assert p.name in text and "naive_attention" in text and "Not measured: 1K-d64-full-f16" in text


def test_tensor_op_work_counts_in_simdgroup_multiplies():
    from types import SimpleNamespace
    st = SimpleNamespace(simdgroup_matrix_multiplies=3, tensor_matmul_macs=2 * 16 * 16 * 16)
    assert vs_peers.SIMDGROUP_MMA_MACS == 512
    assert vs_peers.mma_equivalents(st) == 3 + 16  # one 16x16x16 tensor op = eight 8x8x8 multiplies


@pytest.mark.parametrize("causal", [False, True])
def test_apple10_runs_every_accelerator_and_simdgroup_variant(causal):
    p = vs_peers.Problem(seqlen=64, head_dim=64, causal=causal, dtype="f16", heads=1, family="apple10")
    rows = vs_peers.run_problem(p, [naive_peer], log=lambda *_: None)
    ours, naive = rows[:-1], rows[-1]
    assert all(r["ok"] for r in rows), [(r["kernels"], r["err"]) for r in rows]
    import torch
    import torch_metal_flash as tmf
    listed = tmf.tuning.variants("fwd", dtype=torch.float16, head_dim=64, family="apple10")
    assert [r["kernels"] for r in ours] == [[v] for v in listed]
    nax = [r for r in ours if "_nax_" in r["kernels"][0]]
    simd = [r for r in ours if "_nax_" not in r["kernels"][0]]
    assert nax and simd
    for r in nax:  # accelerator work only, in the simdgroup unit
        assert r["simdgroup_mma"] == 0 and r["tensor_matmuls"] > 0
        assert r["mma"] == r["tensor_macs"] / 512 and r["mma_ratio"] >= 1
    for r in simd:
        assert r["tensor_macs"] == 0 and r["mma"] == r["simdgroup_mma"] > 0
    # the same BQ x BK blocking does the same matrix work on either unit, in the shared unit
    simd_work = {tuple(r["blocks"]): r["mma"] for r in simd}
    shared = [r for r in nax if tuple(r["blocks"]) in simd_work]
    assert shared and all(r["mma"] == simd_work[tuple(r["blocks"])] for r in shared)
    assert naive["mma"] == 0 and naive["tensor_macs"] == 0

    v = vs_peers.verdict(p, rows)
    assert v["default"] is not None and "_nax_" in v["default"]["kernels"][0]  # apple10's plan: an accelerator tile
    text = vs_peers.render([(p, rows)], ["synthetic"], "pytest", [], 0.0, heads=1)
    assert "on apple10" in text and "MMA-equivalents" in text and "tensor ops" in text
    assert "Roofline" not in text  # the peaks tabulated are the M1-M4 Max's


def test_family_selects_the_peer_and_the_results_file():
    assert vs_peers.mlx_peer("apple10")[0] is vs_peers.mlx_nax_kernel
    assert "attention_nax" in vs_peers.mlx_peer("apple10")[1]
    assert vs_peers.mlx_peer(None)[0] is vs_peers.mlx_kernel
    assert vs_peers.results_file(None) == vs_peers.RESULTS
    assert vs_peers.results_file("apple10").name == "vs_peers_apple10.md"
    assert {p.family for p in vs_peers.select(None, True, "apple10")} == {"apple10"}
    assert {p.family for p in vs_peers.select("1K-d64-causal-f16", False)} == {None}
    with pytest.raises(SystemExit):
        vs_peers.main(["--family", "apple11"])


def _row(side, kernel, barriers_per_block, tg_memory, device):
    return dict(side=side, kernels=[kernel], barriers_per_block=barriers_per_block, barriers=1, tg_memory=tg_memory,
                device=device)


def test_barrier_reason_names_a_peer_without_threadgroup_tiles():
    ours = _row("ours", "a", 2.0, 9216, 100)
    peer = _row("MLX", "b", 0.25, 0, 400)
    why = vs_peers.barrier_reason(ours, peer)
    assert why.startswith("barriers / key block 2.00 vs 0.25") and "4.0x the device bytes of `a`" in why
    assert vs_peers.barrier_reason(peer, ours) is None
    assert vs_peers.barrier_reason(ours, None) is None
    assert vs_peers.best_barriers([ours, peer, _row("x", "c", None, 0, 1)]) is peer


def test_saved_runs_of_different_families_are_not_mixed(tmp_path):
    import json
    saved = tmp_path / "run.jsonl"
    lines = [json.dumps(dict(problem=vars(vs_peers.Problem(32, 64, True, "f16", 1, fam)), rows=[], sources=[],
                             command="`x`", heads=1, minutes=0.0)) for fam in (None, "apple10")]
    saved.write_text("\n".join(lines) + "\n")
    with pytest.raises(SystemExit, match="different GPU families"):
        vs_peers.main(["--render", str(saved), "--out", str(tmp_path / "r.md")])


def test_decode_problems_count_grouped_heads():
    p = vs_peers.Problem(4096, 128, False, "f16", heads=32, query_len=1, kv_heads=8)
    assert p.compulsory_bytes() == (2 * 32 * 1 + 2 * 8 * 4096) * 128 * 2
    assert p.visible_pairs() == 32 * 4096
    sub = p.with_heads(4)
    assert (sub.heads, sub.hk, sub.ql) == (4, 1, 1)
    with pytest.raises(ValueError, match="whole K/V groups"):
        p.with_heads(2)
    q, k, v = vs_peers.inputs(dataclasses.replace(sub, seqlen=64))
    assert q.shape == (1, 4, 1, 128) and k.shape == v.shape == (1, 1, 64, 128)
