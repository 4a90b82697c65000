"""Our forward kernels next to MLX's and PyTorch's own Metal attention kernels, on identical
problems in the emulator (checked mode: every device and threadgroup byte is counted exactly).

    python bench/vs_peers.py --mlx DIR --pytorch DIR [--rows 1K-d64-causal-f16,...] [--quick] [--heads N]
                             [--family apple10] [--json FILE] [--out FILE]
    python bench/vs_peers.py --render FILE... [--out FILE]

--mlx DIR      an mlx-metal wheel unpacked (or its mlx/include): MLX's steel attention
--pytorch VERSION|DIR  a torch release (its macOS wheel downloaded once by pip, the kernel headers extracted) or
               a torch macOS wheel unpacked (or its torch/include): ATen/native/mps/kernels/PrefillAttention.h and,
               from 2.15, DecodeAttention.h and MppAttention.h (the tensor-op peer, with --family apple10)
--family F     the GPU family to plan and run on (default: the emulator's, apple8).  apple10 (M5) lists
               our neural-accelerator variants (Metal 4 tensor ops) before the simdgroup ones, and
               MLX's peer becomes the kernel its host picks there: attention_nax
               (steel_attention_nax.h, MSL 4.0) instead of steel attention

Nothing is fetched and no third-party code is in this repository (bench/peer_kernels.py launches
the peers' kernels from your folders).  Problems: B 1, H 8, L 1K and 4K (Lq = Lk), D 64 and 128,
causal and not, float16 and bfloat16.  Ours: every forward variant ``tmf.tuning.variants`` lists
for the problem, each forced with ``tmf.tuning.use`` (the default plan alone where the package
has no ``tuning`` module), run through ``tmf.scaled_dot_product_attention`` on the emulator
backend and captured with ``emulator.recording()``.  Every output is checked against a float64
reference.  Columns (the params structs in constant memory are left out of device bytes, as in
bench/forward_bytes.py):

* device B / compulsory: bytes read + written in device memory over Q + K + V read once and O
  written once (extra outputs, such as our log-sum-exp, count against the kernel);
* TG B / out: threadgroup-memory bytes read + written per output element;
* barriers / key block: threadgroup barriers over the (threadgroup, key block) pairs the
  kernel's own BQ x BK blocking must visit (key blocks wholly above the causal diagonal skipped);
* MMA / needed: matrix-unit work in 8x8x8 simdgroup multiplies (512 multiply-adds each) x 512
  over the QK^T and PV multiply-adds of the visible (query, key) pairs.  Tensor-op (neural
  accelerator) matmuls count as their multiply-adds / 512 (m * n * k per run, the emulator's
  ``tensor_matmul_macs``), so accelerator and simdgroup kernels share the unit: "MMA-equivalents";
* threadgroups, threadgroup memory per threadgroup.

Emulation cost grows like L^2 x D: the 4K rows dominate (tens of minutes each with every variant
on the shared 2-core machine).  --rows or --quick (the 1K rows) run a subset; --heads 1 emulates
one of the 8 heads and scales the counts, which is exact (every head runs the same code on the
same shapes; tests/tooling/test_vs_peers.py checks it); --json FILE saves each problem's counters and
--render FILE... writes one report from several runs (split a long table over processes).  A full
run with both peers writes bench/results/vs_peers.md (re-written after each problem); a full
--family F run with --mlx writes bench/results/vs_peers_F.md.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import re
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch

import harness

import torch_metal_flash as tmf
from torch_metal_flash import emulator
from torch_metal_flash.planner import FAMILIES
from torch_metal_flash.planner.forward import BUF_LSE, BUF_PARAMS
from torch_metal_flash.testing import randn

import peer_kernels as pk

RESULTS = harness.RESULTS / "vs_peers.md"

DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16}
BATCH, HEADS = 1, 8
TENSORS = {0: "Q", 1: "K", 2: "V", 3: "O"}  # every kernel here binds Q, K, V, O at buffers 0-3
DECODE_OUT = 103  # torch's two-pass decode writes O at buffer 3 of its second pass (pytorch_kernel)
SIMDGROUP_MMA_MACS = 8 * 8 * 8  # multiply-adds of one simdgroup_multiply_accumulate: the MMA column's unit

# Published peaks of the largest GPU of each Max chip.  FP16 runs at the FP32 rate on these GPUs
# (one FMA per ALU per clock), so the FP32 figure is the matrix peak too.  Where sources differ
# the larger figure is used, so that the time below stays a lower bound.
MACS = [
    ("M1 Max (32-core GPU)", 10.62e12, 400e9,
     "4096 ALUs x 2 x 1.296 GHz: hmc-tech.com/gpu/apple-8-core-m4-fl-vs-apple-24-core-m1-max (24-core: 3072 "
     "ALUs, 1296 MHz, 7.96 TFLOPS) scaled to 32 cores",
     "400 GB/s: Apple's announcement, as reported by mybroadband.co.za/news/hardware/"
     "418862-apple-m1-pro-and-m1-max-new-chips-powering-the-macbook-pro.html"),
    ("M2 Max (38-core GPU)", 13.6e12, 400e9,
     "13.6 TFLOPS: hmc-tech.com/gpu/apple-9-core-m3-fl-vs-apple-38-core-m2-max",
     "400 GB/s: trustedreviews.com/explainer/what-is-the-apple-m2-max-4295791"),
    ("M3 Max (40-core GPU)", 16.4e12, 400e9,
     "16.4 TFLOPS: radargit.com/2025/03/15/apple-m3-max-gpu-40-core-benchmark-and-specs "
     "(hmc-tech.com/gpu/apple-32-core-m4-max-vs-apple-40-core-m3-max gives 14.32)",
     "400 GB/s: macmegasite.com/2024/10/30/m4-max-chip-has-16-core-cpu-40-core-gpu-and-35-increase-in-memory-"
     "bandwidth (radargit: 409.6)"),
    ("M4 Max (40-core GPU)", 17.18e12, 546e9,
     "5120 ALUs x 2 x 1.678 GHz: hmc-tech.com/gpu/apple-32-core-m4-max-vs-apple-40-core-m3-max (32-core: 4096 "
     "ALUs, 1678 MHz, 13.74 TFLOPS) scaled to 40 cores",
     "546 GB/s: macrumors.com/2024/10/30/apple-announces-m4-max-chip/"),
]


@dataclasses.dataclass(frozen=True)
class Problem:
    seqlen: int  # keys (and queries, unless query_len is set)
    head_dim: int
    causal: bool
    dtype: str  # "f16" | "bf16"
    heads: int = HEADS
    family: Optional[str] = None  # the GPU family planned and emulated (None: the emulator's default)
    query_len: int = 0  # decode problems: the query rows (0: seqlen)
    kv_heads: int = 0  # grouped K/V heads (0: heads)

    @property
    def decode(self) -> bool:
        return bool(self.query_len)

    @property
    def ql(self) -> int:
        return self.query_len or self.seqlen

    @property
    def hk(self) -> int:
        return self.kv_heads or self.heads

    @property
    def name(self) -> str:
        length = f"{self.seqlen // 1024}K" if self.seqlen % 1024 == 0 else str(self.seqlen)
        if self.decode:
            return f"decode{self.ql}x{length}-d{self.head_dim}-gqa{self.heads}:{self.hk}-{self.dtype}"
        return f"{length}-d{self.head_dim}-{'causal' if self.causal else 'full'}-{self.dtype}"

    def with_heads(self, heads: int) -> "Problem":
        """The same problem on ``heads`` query heads (and their share of the K/V heads)."""
        if self.heads % heads or (self.kv_heads and heads * self.kv_heads % self.heads):
            raise ValueError(f"heads={heads} must divide the problem's {self.heads} heads into whole K/V groups")
        return dataclasses.replace(self, heads=heads, kv_heads=heads * self.kv_heads // self.heads)

    def visible_pairs(self) -> int:
        L = self.seqlen
        return BATCH * self.heads * (L * (L + 1) // 2 if self.causal else self.ql * L)

    def compulsory_bytes(self) -> int:
        rows = 2 * self.heads * self.ql + 2 * self.hk * self.seqlen  # Q and O, K and V
        return BATCH * rows * self.head_dim * DTYPES[self.dtype].itemsize

    def flops(self) -> int:
        return 4 * self.visible_pairs() * self.head_dim  # QK^T and PV, 2 FLOPs per multiply-add

    def key_blocks(self, bq: int, bk: int) -> int:
        """(threadgroup, key block) pairs a BQ x BK blocking visits."""
        L = self.seqlen
        per_head = sum(-(-(min(L, (b + 1) * bq) if self.causal else L) // bk) for b in range(-(-L // bq)))
        return BATCH * self.heads * per_head


# The 1K problems first, then 4K in float16, then bfloat16 (a partial run still covers each shape).
PROBLEMS = [Problem(L, D, causal, dt) for L, dts in ((1024, None), (4096, ("f16",)), (4096, ("bf16",)))
            for D in (64, 128) for causal in (False, True) for dt in (dts or ("f16", "bf16"))]
# Decode: one query row over a grouped 4K cache (32 query heads, 8 K/V heads), as a Llama-style model runs it.
PROBLEMS += [Problem(4096, D, False, "f16", heads=32, query_len=1, kv_heads=8) for D in (64, 128)]


@dataclasses.dataclass
class Kernel:
    """One kernel to measure: ``run(q, k, v, scale, causal) -> (out, [LaunchStats])``."""
    side: str  # "ours" or the peer's name
    label: str
    run: Callable
    blocks: Optional[tuple]  # (BQ, BK), None if unknown
    param_buffers: tuple  # constant-memory params structs, left out of device bytes
    extra_tensors: dict = dataclasses.field(default_factory=dict)  # names of buffers past Q, K, V, O


# ---------------------------------------------------------------- ours

def _tuning():
    try:
        return importlib.import_module("torch_metal_flash.tuning")
    except ImportError:
        return None


def our_blocks(kernel_name: str) -> Optional[tuple]:
    m = re.search(r"_q(\d+)_k(\d+)", kernel_name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def our_kernels(p: Problem) -> list[Kernel]:
    """Every forward variant the package lists for the problem on its family (the default plan alone
    without tmf.tuning); measure() runs them inside ``emulator.settings(family=p.family)``."""
    tuning = _tuning()
    op = "decode" if p.decode else "fwd"
    variants = [None] if tuning is None else list(tuning.variants(op, dtype=DTYPES[p.dtype], head_dim=p.head_dim,
                                                                  family=p.family))

    def runner(variant):
        def run(q, k, v, scale, causal):
            forced = contextlib.nullcontext() if variant is None else tuning.use(op, variant)
            with tmf.backend("emulator"), forced, emulator.recording() as launches:
                out = tmf.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
            if not launches:  # a fallback to the reference path launches nothing
                raise RuntimeError(f"ours ({variant or 'default'}): no emulator launch recorded")
            if variant is not None and variant not in [s.kernel for s in launches]:
                raise RuntimeError(f"forced variant {variant} did not run: {[s.kernel for s in launches]}")
            return out, launches
        return run

    return [Kernel("ours", v or "default plan", runner(v), our_blocks(v) if v else None, (BUF_PARAMS,),
                   {BUF_LSE: "LSE"}) for v in variants]


# ---------------------------------------------------------------- peers

def mlx_kernel(inc: Path, p: Problem) -> Optional[Kernel]:
    if p.decode:
        return None
    def run(q, k, v, scale, causal):
        out, st = pk.run_mlx_steel(inc, q, k, v, scale, causal=causal, checked=True)
        return out, [st]
    return Kernel("MLX", "steel attention", run, pk.mlx_steel_blocks(p.head_dim), pk.MLX_PARAM_BUFFERS)


def mlx_nax_kernel(inc: Path, p: Problem) -> Optional[Kernel]:
    """MLX's accelerator attention, the kernel its host picks on apple10 (M5) parts."""
    if p.decode:
        return None
    def run(q, k, v, scale, causal):
        out, st = pk.run_mlx_nax_attention(inc, q, k, v, scale, causal=causal, checked=True)
        return out, [st]
    return Kernel("MLX", "attention_nax", run, pk.MLX_NAX_BLOCKS[:2], pk.MLX_PARAM_BUFFERS)


def pytorch_kernel(inc: Path, p: Problem) -> Kernel:
    """The kernel torch's host runs for ``p`` without the tensor ops: sdpa_vector for a decode problem (in two
    passes where the host takes them), the prefill kernel otherwise."""
    if p.decode:
        two = pk.pytorch_decode_two_pass(torch.empty(1, p.heads, p.ql, 1), torch.empty(1, p.hk, p.seqlen, 1))

        def run(q, k, v, scale, causal):
            out, launches = pk.run_pytorch_decode(inc, q, k, v, scale, causal=causal, checked=True)
            if two:  # the second pass's buffers by the first's indices (0-2: partials, sums, maxs), O apart
                where = {0: 3, 1: 4, 2: 5, 3: DECODE_OUT}
                st = launches[1]
                launches[1] = dataclasses.replace(st, bytes_read={where[i]: b for i, b in st.bytes_read.items()},
                                                  bytes_written={where[i]: b for i, b in st.bytes_written.items()})
            return out, launches
        if two:
            return Kernel("PyTorch", "sdpa_vector (two passes)", run, None, (6, 7, 8, 9, 10, 12, 13),
                          {3: "partials", 4: "sums", 5: "maxs", DECODE_OUT: "O"})
        return Kernel("PyTorch", "sdpa_vector (one pass)", run, None, (4, 5, 6, 7, 8, 10, 11))

    def run(q, k, v, scale, causal):
        out, st = pk.run_pytorch_prefill(inc, q, k, v, scale, causal=causal, checked=True)
        return out, [st]
    return Kernel("PyTorch", "prefill attention", run, pk.pytorch_prefill_blocks(p.head_dim)[:2],
                  pk.PYTORCH_PARAM_BUFFERS)


def pytorch_tensor_op_kernel(inc: Path, p: Problem) -> Optional[Kernel]:
    """torch's Metal 4 tensor-op prefill (MppAttention.h), the kernel its host runs on an M5 with macOS 26.2+."""
    if p.decode or p.head_dim not in (64, 96, 128, 256) or not (inc / pk.MPP_HEADER).is_file():
        return None

    def run(q, k, v, scale, causal):
        out, st = pk.run_pytorch_prefill(inc, q, k, v, scale, causal=causal, mpp="a10", checked=True)
        return out, [st]
    return Kernel("PyTorch", "tensor-op prefill (a10)", run, pk.pytorch_prefill_blocks(p.head_dim, mpp=True)[:2],
                  pk.PYTORCH_PARAM_BUFFERS)


# ---------------------------------------------------------------- measuring

def inputs(p: Problem, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(BATCH, p.heads, p.ql, p.head_dim)] + [(BATCH, p.hk, p.seqlen, p.head_dim)] * 2
    return tuple(randn(*shape, generator=g).to(DTYPES[p.dtype]) for shape in shapes)


def reference(p: Problem, q, k, v, scale) -> torch.Tensor:
    """float64 attention, one head at a time (a 4K x 4K float64 score matrix per head)."""
    g = p.heads // p.hk
    return torch.cat([pk.attention_reference(q[:, h:h + 1], k[:, h // g:h // g + 1], v[:, h // g:h // g + 1], scale,
                                             causal=p.causal) for h in range(q.shape[1])], 1)


def mma_equivalents(st) -> float:
    """Matrix-unit work of one launch in 8x8x8 simdgroup multiplies: those it ran plus its tensor-op
    multiply-adds / 512 (exact for the tensor ops here, whose m, n and k are multiples of 8)."""
    return st.simdgroup_matrix_multiplies + st.tensor_matmul_macs / SIMDGROUP_MMA_MACS


def _whole(x: float):
    return int(x) if float(x).is_integer() else x


def measure(kernel: Kernel, p: Problem, q, k, v, ref, scale, full: Optional[Problem] = None) -> dict:
    """Counters of one kernel on ``p``; absolute counts are given for ``full`` (the same problem
    with more heads: every head runs the same code on the same shapes, so they scale exactly)."""
    full = full or p
    times = full.heads // p.heads
    t0 = time.perf_counter()
    with emulator.settings(checked=True, family=p.family):
        out, launches = kernel.run(q, k, v, scale, p.causal)
    seconds = time.perf_counter() - t0
    err, ok = pk.max_error(out, ref)
    per_tensor = {}
    for st in launches:
        for i in set(st.bytes_read) | set(st.bytes_written):
            if i not in kernel.param_buffers:
                per_tensor[i] = per_tensor.get(i, 0) + st.bytes_read.get(i, 0) + st.bytes_written.get(i, 0)
    device = sum(per_tensor.values())
    blocks = kernel.blocks
    names = [st.kernel for st in launches]
    if blocks is None and len(names) == 1:
        blocks = our_blocks(names[0])
    barriers = sum(st.barriers for st in launches)
    mma = _whole(sum(mma_equivalents(st) for st in launches))
    simdgroup_mma = sum(st.simdgroup_matrix_multiplies for st in launches)
    tensor_macs = sum(st.tensor_matmul_macs for st in launches)
    tensor_names = {**TENSORS, **kernel.extra_tensors}
    return dict(
        problem=p.name, side=kernel.side, label=kernel.label, kernels=names, ok=ok, err=err, heads=p.heads,
        device=device * times, device_ratio=device / p.compulsory_bytes(),
        tensors={tensor_names.get(i, f"buffer {i}"): b * times for i, b in sorted(per_tensor.items()) if b},
        tg_per_out=sum(st.threadgroup_bytes_read + st.threadgroup_bytes_written for st in launches) / out.numel(),
        blocks=blocks, barriers=barriers * times,
        barriers_per_block=barriers / p.key_blocks(*blocks) if blocks and not p.decode else None,
        mma=mma * times, mma_ratio=mma * SIMDGROUP_MMA_MACS / (p.visible_pairs() * 2 * p.head_dim),
        simdgroup_mma=simdgroup_mma * times, tensor_macs=tensor_macs * times,
        tensor_matmuls=sum(st.tensor_matmuls for st in launches) * times,
        threadgroups=sum(st.threadgroups for st in launches) * times,
        tg_memory=max(st.threadgroup_memory for st in launches), seconds=seconds)


def run_problem(p: Problem, peers: list[Callable[[Problem], Kernel]], heads: Optional[int] = None,
                log=print) -> list[dict]:
    """Every kernel on ``p``, emulating its first ``heads`` heads (all by default)."""
    sub = p.with_heads(max(heads or p.heads, p.heads // p.hk))  # decode: at least one whole K/V group
    q, k, v = inputs(sub)
    scale = p.head_dim ** -0.5
    ref = reference(sub, q, k, v, scale)
    rows = []
    for kernel in our_kernels(p) + [k for k in (make(p) for make in peers) if k is not None]:
        r = measure(kernel, sub, q, k, v, ref, scale, full=p)
        rows.append(r)
        log(f"{p.name:20s} {r['side']:8s} {','.join(r['kernels']):60s} ok={r['ok']} bytes/comp "
            f"{r['device_ratio']:.4f} MMA/needed {r['mma_ratio']:.3f} ({r['seconds']:.0f} s)")
    return rows


# ---------------------------------------------------------------- verdicts and tables

def best(rows: list[dict], key: str) -> dict:
    return min(rows, key=lambda r: (r[key], r["mma"] if key == "device" else r["device"]))


def best_barriers(rows: list[dict]) -> Optional[dict]:
    """The row with the fewest barriers per key block its blocking visits (None: no row knows its blocks)."""
    known = [r for r in rows if r["barriers_per_block"] is not None]
    return min(known, key=lambda r: (r["barriers_per_block"], r["barriers"])) if known else None


def verdict(p: Problem, rows: list[dict], peer: Optional[str] = None) -> dict:
    """Our best variant against the best peer (or the best kernel of side ``peer``), on device bytes,
    MMA work and barriers, and why where worse."""
    ours = [r for r in rows if r["side"] == "ours" and r["ok"]]
    peers = [r for r in rows if r["side"] != "ours" and r["ok"] and peer in (None, r["side"])]
    if not ours or not peers:
        return dict(bytes="n/a", mma="n/a", why="no passing kernel on one side")
    ob, pb = best(ours, "device"), best(peers, "device")
    om = best(ours, "mma")
    mma_peers = [r for r in peers if r["mma"]]  # a scalar kernel does no matrix-unit work to compare
    pm = best(mma_peers, "mma") if mma_peers else None
    why = reasons(p, ob, pb, om, pm)
    obar, pbar = best_barriers(ours), best_barriers(peers)
    bwhy = barrier_reason(obar, pbar)
    if bwhy:
        why = bwhy if why == "--" else f"{why}; {bwhy}"
    both = [r for r in ours if r["device"] <= pb["device"] and (pm is None or r["mma"] <= pm["mma"])]
    default = default_variant(p)
    dflt = next((r for r in ours if r["kernels"][0] == default), None)
    twhy = memory_reason(dflt or ob, ours, peers)
    if twhy:
        why = twhy if why == "--" else f"{why}; {twhy}"
    if dflt is not None and dflt is not ob:
        dwhy = reasons(p, dflt, pb, dflt, pm)
        if dwhy != "--":
            why = (why if why != "--" else "best variant: --") + f"; default plan: {dwhy}"
    return dict(ours_bytes=ob, peer_bytes=pb, ours_mma=om, peer_mma=pm, bytes=ob["device"] / pb["device"],
                ours_barriers=obar, peer_barriers=pbar,
                mma=om["mma"] / pm["mma"] if pm is not None else None, why=why,
                both=both[0]["kernels"][0] if both else None, default=dflt,
                default_bytes=dflt["device"] / pb["device"] if dflt else None,
                default_mma=dflt["mma"] / pm["mma"] if dflt and pm is not None else None)


def reasons(p: Problem, ob: dict, pb: dict, om: dict, pm: Optional[dict]) -> str:
    """Why ``ob`` moves more device bytes than ``pb`` and ``om`` does more MMA work than ``pm``."""
    why = []
    if ob["device"] > pb["device"]:
        for t in list(ob["tensors"]) + [t for t in pb["tensors"] if t not in ob["tensors"]]:
            d = ob["tensors"].get(t, 0) - pb["tensors"].get(t, 0)
            if d > 0:
                what = {"LSE": "LSE: our log-sum-exp (fp32 per query row, kept for the backward pass)"}.get(t, t)
                if t in ("K", "V") and p.causal and ob["blocks"] and pb["blocks"] and ob["blocks"][1] > pb["blocks"][1]:
                    what = (f"{t}: BK {ob['blocks'][1]} vs {pb['blocks'][1]} -- more of each diagonal key block "
                            "lies past the causal edge and is still loaded")
                why.append(f"+{d:,} B {what}")
    if pm is not None and om["mma"] > pm["mma"]:
        if p.causal and om["blocks"] and pm["blocks"] and om["blocks"][1] > pm["blocks"][1]:
            why.append(f"MMA x{om['mma'] / pm['mma']:.3f}: diagonal blocks are multiplied whole, BK "
                       f"{om['blocks'][1]} vs {pm['blocks'][1]}")
        else:
            why.append(f"MMA x{om['mma'] / pm['mma']:.3f}")
    return "; ".join(why) or "--"


def barrier_reason(ours: Optional[dict], peer: Optional[dict]) -> Optional[str]:
    """Why our fewest barriers per key block are more than the peer's fewest (None: they are not)."""
    if ours is None or peer is None or ours["barriers_per_block"] <= peer["barriers_per_block"]:
        return None
    why = f"barriers / key block {ours['barriers_per_block']:.2f} vs {peer['barriers_per_block']:.2f}"
    if peer["tg_memory"] == 0 and ours["tg_memory"] > 0:
        why += (f": {peer['side']} `{peer['kernels'][0]}` stages no tile in threadgroup memory (each simdgroup "
                "loads its own K and V from device memory"
                + (f", {peer['device'] / ours['device']:.1f}x the device bytes of `{ours['kernels'][0]}`)"
                   if peer["device"] > ours["device"] else ")"))
    return why


def memory_reason(ours: dict, variants: list[dict], peers: list[dict]) -> Optional[str]:
    """Why ``ours`` (the default plan) uses more threadgroup memory per threadgroup than the leanest peer that
    stages tiles there, and which of our variants does not (None: it uses no more)."""
    staged = [r for r in peers if r["tg_memory"]]
    if not staged:
        return None
    peer = min(staged, key=lambda r: r["tg_memory"])
    if ours["tg_memory"] <= peer["tg_memory"]:
        return None
    why = (f"threadgroup memory {ours['tg_memory']:,} B (`{ours['kernels'][0]}`) vs {peer['tg_memory']:,} B "
           f"({peer['side']} `{peer['kernels'][0]}`)")
    if ours["blocks"] and peer["blocks"] and ours["blocks"] != peer["blocks"]:
        why += f": tiles {ours['blocks'][0]} x {ours['blocks'][1]} vs {peer['blocks'][0]} x {peer['blocks'][1]}"
    lean = [r for r in variants if r["tg_memory"] <= peer["tg_memory"]]
    if lean:
        r = min(lean, key=lambda r: (r["device"], r["tg_memory"]))
        why += f"; `{r['kernels'][0]}` in the tuning space uses {r['tg_memory']:,} B"
    else:
        why += "; no variant of ours at or below it"
    return why


def default_variant(p: Problem) -> Optional[str]:
    """The forward variant the planner picks for ``p`` on its family without a tuning cache entry."""
    tuning = _tuning()
    if tuning is None:
        return None
    try:
        with emulator.settings(family=p.family):
            variant, _ = tuning.choice("decode" if p.decode else "fwd", dtype=DTYPES[p.dtype], head_dim=p.head_dim,
                                       seqlen_q=p.ql, seqlen_k=p.seqlen, causal=p.causal)
    except ValueError:
        return None
    return variant


def _kernel_cell(r: dict) -> str:
    return f"{r['side']}: " + ", ".join(f"`{k}`" for k in r["kernels"])


def family_of(done: list[tuple]) -> Optional[str]:
    """The one GPU family the problems of a report ran on (None: the emulator's default)."""
    families = {p.family for p, _ in done}
    if len(families) > 1:
        raise ValueError(f"one report per GPU family; got {sorted(map(str, families))}")
    return families.pop() if families else None


def _ratio_cell(v: dict, ours: str, peer: str, key: str, fmt: str) -> str:
    if v[ours] is None or v[peer] is None or not v[peer][key]:
        return "n/a"
    return f"{v[ours][key] / v[peer][key]:{fmt}} (`{v[ours]['kernels'][0]}` vs {v[peer]['side']})"


def _matrix_cell(r: dict) -> str:
    """How a kernel's MMA-equivalents split between simdgroup multiplies and tensor ops."""
    tensor = r.get("tensor_macs", 0)
    if not tensor:
        return f"{r.get('simdgroup_mma', r['mma']):,} simdgroup"
    cell = f"{r['tensor_matmuls']:,} tensor ops, {tensor:,} MACs = {_whole(tensor / SIMDGROUP_MMA_MACS):,}"
    return cell + (f" + {r['simdgroup_mma']:,} simdgroup" if r.get("simdgroup_mma") else "")


def headline(done: list[tuple], peer: Optional[str] = None) -> list[str]:
    """The headline table's lines: ours against the best peer, or the best kernel of side ``peer``."""
    lines = ["| problem | device bytes, ours / best peer | MMA work, ours / best peer | barriers per key block, "
             "ours / best peer | one variant at or below both bytes and MMA | default plan: bytes, MMA / best "
             "peer | where ours is above, why |",
             "|---|---|---|---|---|---|---|"]
    if peer is not None:
        lines[0] = lines[0].replace("best peer", peer)
    for p, rows in done:
        v = verdict(p, rows, peer)
        if "ours_bytes" not in v:
            lines.append(f"| {p.name} | n/a | n/a | n/a | n/a | n/a | {v['why']} |")
            continue
        mma = "n/a (no peer uses the matrix units)" if v["mma"] is None else \
            f"{v['mma']:.3f} (`{v['ours_mma']['kernels'][0]}` vs {v['peer_mma']['side']})"
        bar = _ratio_cell(v, "ours_barriers", "peer_barriers", "barriers_per_block", ".2f")
        both = f"`{v['both']}`" if v["both"] else "none"
        if v["default"] is None:
            dflt = "n/a"
        else:
            dflt = f"`{v['default']['kernels'][0]}`: {v['default_bytes']:.4f}, " + \
                ("n/a" if v["default_mma"] is None else f"{v['default_mma']:.3f}")
        lines.append(f"| {p.name} | {v['bytes']:.4f} (`{v['ours_bytes']['kernels'][0]}` vs "
                     f"{v['peer_bytes']['side']}) | {mma} | {bar} | {both} | {dflt} | {v['why']} |")
    return lines


def render(done: list[tuple], sources: list[str], command: str, missing: list[str], minutes: float,
           heads: int = HEADS) -> str:
    """The markdown report; ``missing``: names of problems of the table not measured (yet)."""
    family = family_of(done)
    tensor = any(r.get("tensor_macs") for _, rows in done for r in rows)
    title = "# Our forward kernels next to MLX's and PyTorch's Metal attention (emulator counters)" if family is None \
        else f"# Our forward kernels next to the peers' on {family} (emulator counters)"
    lines = [title, "",
             f"Generated by {command} (checked mode: exact byte counts; {minutes:.0f} min of emulation on the shared "
             "2-core machine)." + ("" if not missing else f" **Not measured: {', '.join(missing)}** (`--rows` "
                                   "measures them)."),
             "", "Sources (not in the repository; folders passed to the script):", ""]
    lines += [f"- {s}" for s in sources]
    lines += ["", "Problems: B 1, H 8, Lq = Lk = L, D = head dim, (B, H, L, D) contiguous, scale D^-1/2; decode "
              "problems: one query row of 32 heads over a 4K cache of 8 K/V heads (`decodeQxL-dD-gqaH:Hkv`); every "
              "output checked against a float64 reference (tolerance 2e-2 of the largest output, half and bfloat). "
              "Column definitions: the docstring of `bench/vs_peers.py`." + (
                  "" if heads == HEADS else f" The run emulated the first {heads} of the {HEADS} heads (`--heads`): "
                  "every head runs the same code on the same shapes, so byte, barrier, MMA and threadgroup counts "
                  f"are those x {HEADS // heads} and the ratios are the same (tests/tooling/test_vs_peers.py checks the "
                  "scaling exactly)."), ""]
    if family is not None:
        lines += [f"Every kernel planned and ran inside `emulator.settings(family=\"{family}\")`: ours are every "
                  f"variant `tmf.tuning.variants(\"fwd\", ..., family=\"{family}\")` lists.", ""]
    if tensor:
        lines += ["MMA work is counted in 8x8x8 simdgroup multiplies (512 multiply-adds each): a tensor-op "
                  "(neural accelerator) matmul counts as its m x n x k multiply-adds / 512, so the accelerator and "
                  "simdgroup kernels share one unit (\"MMA-equivalents\"; the *matrix work* column of the kernel "
                  "table shows the split).", ""]
    lines += ["Device bytes are the kernels' device-memory requests: on the GPU many of the K and V re-reads "
              "(once per query block) hit the cache, so they bound DRAM traffic from above; a kernel with taller "
              "query blocks (BQ 64) requests half as many.", "",
              "## Headline: our best variant against the best peer", ""]
    lines += headline(done)
    peer_sides = {}  # side -> its kernels' labels, in table order
    for _, rows in done:
        for r in rows:
            if r["side"] != "ours":
                peer_sides.setdefault(r["side"], dict.fromkeys([]))[r["label"]] = None
    for side, labels in peer_sides.items() if len(peer_sides) > 1 else []:
        lines += ["", f"## Headline: our best variant against {side} ({', '.join(labels)})", ""] + headline(done, side)
    lines += ["", "## Every kernel", "",
              "| problem | kernel | max err (ok) | device B / compulsory | per tensor (B) | TG B / out | BQ x BK "
              "| barriers / key block | MMA / needed | " + ("matrix work (MMA-equivalents) | " if tensor else "") +
              "threadgroups | TG mem / TG (B) | emulator s |",
              "|---|---|---|---|---|---|---|---|---|" + ("---|" if tensor else "") + "---|---|---|"]
    for p, rows in done:
        for r in rows:
            tens = ", ".join(f"{t} {b:,}" for t, b in r["tensors"].items())
            blocks = f"{r['blocks'][0]} x {r['blocks'][1]}" if r["blocks"] else "?"
            bpb = f"{r['barriers_per_block']:.2f}" if r["barriers_per_block"] is not None else "?"
            lines.append(f"| {p.name} | {_kernel_cell(r)} | {r['err']:.1e} ({'ok' if r['ok'] else 'FAIL'}) | "
                         f"{r['device_ratio']:.4f} | {tens} | {r['tg_per_out']:.1f} | {blocks} | {bpb} | "
                         f"{r['mma_ratio']:.3f} | " + (f"{_matrix_cell(r)} | " if tensor else "") +
                         f"{r['threadgroups']} | {r['tg_memory']} | {r['seconds']:.0f} |")
    if family is not None:
        # the peaks below are the M1-M4 Max's; no published matrix peak of the M5's accelerators is tabulated
        return "\n".join(lines) + "\n"
    lines += ["", "## Roofline lower bound of the time", "",
              "max(FLOPs / peak, compulsory bytes / bandwidth) for the problem itself (QK^T and PV FLOPs of the "
              "visible pairs; Q, K, V, O once), on each chip's largest GPU; whichever kernel runs can only be "
              "slower.", "",
              "| problem | GFLOP | compulsory MB | " + " | ".join(m[0] for m in MACS) + " |",
              "|---|---|---|" + "---|" * len(MACS)]
    for p, _ in done:
        cells = []
        for _, peak, bw, _, _ in MACS:
            tc, tm = p.flops() / peak, p.compulsory_bytes() / bw
            cells.append(f"{max(tc, tm) * 1e6:.0f} µs ({'compute' if tc >= tm else 'memory'})")
        lines.append(f"| {p.name} | {p.flops() / 1e9:.2f} | {p.compulsory_bytes() / 1e6:.1f} | " + " | ".join(cells)
                     + " |")
    lines += ["", "| chip | peak FLOP/s (fp16 = fp32 rate) | source | bandwidth | source |", "|---|---|---|---|---|"]
    for name, peak, bw, fsrc, bsrc in MACS:
        lines.append(f"| {name} | {peak / 1e12:.2f} T | {fsrc} | {bw / 1e9:.0f} GB/s | {bsrc} |")
    return "\n".join(lines) + "\n"


def results_file(family: Optional[str]) -> Path:
    """Where a full run writes its report: vs_peers.md on the default family, vs_peers_<family>.md otherwise."""
    return RESULTS if family is None else harness.RESULTS / f"vs_peers_{family}.md"


def select(rows_arg: Optional[str], quick: bool, family: Optional[str] = None) -> list[Problem]:
    problems = [p for p in PROBLEMS if p.seqlen == 1024 or p.decode] if quick else PROBLEMS
    if rows_arg:
        wanted = [w.strip() for w in rows_arg.split(",") if w.strip()]
        known = {p.name: p for p in PROBLEMS}
        bad = [w for w in wanted if w not in known]
        if bad:
            raise SystemExit(f"--rows: unknown problem(s) {', '.join(bad)}; known: {', '.join(known)}")
        problems = [known[w] for w in wanted]
    return [dataclasses.replace(p, family=family) for p in problems]


def mlx_peer(family: Optional[str]) -> tuple[Callable, str]:
    """(Kernel maker, source line) of the MLX kernel its host runs on ``family``'s GPUs: attention_nax
    where the neural accelerators are (apple10), steel attention elsewhere."""
    if family == "apple10":
        return mlx_nax_kernel, ("MLX attention_nax (`steel_attention_nax.h`, Metal 4 tensor ops, compiled as MSL "
                                "4.0, launched as `sdpa_full_self_attention_nax`: BQ 64, BK 32, 4 simdgroups of 16 "
                                "query rows): `--mlx DIR`, an mlx-metal 0.32.4 wheel (`pip download mlx-metal==0.32.4 "
                                "--no-deps --platform macosx_14_0_arm64`, unzipped).  It keeps no tile in threadgroup "
                                "memory: each simdgroup loads its Q rows and the whole K and V block from device memory "
                                "at every key block, and its few threadgroup barriers fence no memory (at D 128 one "
                                "per key block, inside the PV product)")
    return mlx_kernel, ("MLX steel attention (`steel_attention.h`): `--mlx DIR`, an mlx-metal 0.32.4 wheel "
                        "(`pip download mlx-metal==0.32.4 --no-deps --platform macosx_14_0_arm64`, unzipped)")


def main(argv=None) -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--mlx", type=Path, help="mlx-metal wheel unpacked, or its mlx/include")
    ap.add_argument("--pytorch", help="a torch release (e.g. 2.15.0: its macOS wheel's kernel headers), or a torch "
                                      "macOS wheel unpacked, or its torch/include")
    ap.add_argument("--rows", help="comma-separated problem names (e.g. 1K-d64-causal-f16)")
    ap.add_argument("--quick", action="store_true", help="the L = 1K problems only")
    ap.add_argument("--heads", type=int, default=HEADS,
                    help=f"emulate the first N of the {HEADS} heads and scale the counts (exact: every head runs "
                         "the same code on the same shapes; ratios do not depend on it)")
    ap.add_argument("--family", choices=FAMILIES,
                    help="GPU family to plan and emulate on (default: the emulator's); apple10 adds our "
                         "neural-accelerator variants and makes MLX's peer attention_nax")
    ap.add_argument("--json", type=Path, help="append each problem's raw counters to this file (JSON lines)")
    ap.add_argument("--render", type=Path, nargs="+", metavar="JSON",
                    help="run nothing: write the report of the problems in these --json files")
    ap.add_argument("--out", type=Path, help=f"markdown output (default: {RESULTS.relative_to(harness.ROOT)} for a "
                                              "full run with both peers, vs_peers_F.md for a full --family F run "
                                              "with --mlx, none otherwise)")
    args = ap.parse_args(argv)
    if args.render:
        return render_saved(args.render, args.out)
    problems = select(args.rows, args.quick, args.family)
    peers, sources = [], []
    if args.mlx:
        inc = args.mlx / "mlx" / "include" if (args.mlx / "mlx" / "include").is_dir() else args.mlx
        make, source = mlx_peer(args.family)
        peers.append(lambda p, inc=inc, make=make: make(inc, p))
        sources.append(source)
    if args.pytorch:
        if re.fullmatch(r"\d+\.\d+\.\d+", args.pytorch):
            inc, what = pk.pytorch_wheel_include(args.pytorch), f"torch {args.pytorch}'s macOS wheel (pip downloads it)"
        else:
            inc, what = pk.pytorch_include(Path(args.pytorch)), f"`{args.pytorch}`"
        peers.append(lambda p, inc=inc: pytorch_kernel(inc, p))
        sources.append(f"PyTorch's MPS attention kernels from {what}, launched as its host (`Attention.mm`) binds "
                       f"them: prefill (`{pk.PREFILL_HEADER}`) and the sdpa_vector decode in one or two passes as "
                       f"the host picks (`{pk.DECODE_HEADER}`), params structs packed as the header declares them")
        if args.family == "apple10" and (inc / pk.MPP_HEADER).is_file():
            peers.append(lambda p, inc=inc: pytorch_tensor_op_kernel(inc, p))
            sources.append(f"PyTorch's Metal 4 tensor-op prefill (`{pk.MPP_HEADER}`, its `a10` kernel, MSL 4.0): "
                           "what torch runs on an M5 with macOS 26.2+")
    tuning = _tuning()
    sources.append("ours: " + ("every variant of `tmf.tuning.variants('fwd', ...)`, forced with `tmf.tuning.use`"
                               if tuning else "the default plan (this checkout has no `tmf.tuning`)"))
    out = args.out
    if out is None and not args.rows and not args.quick and args.mlx and (args.pytorch or args.family):
        out = results_file(args.family)
    command = "`python bench/vs_peers.py" + (" --mlx DIR" if args.mlx else "") + \
(f" --pytorch {args.pytorch}" if args.pytorch and re.fullmatch(r"\d+\.\d+\.\d+", args.pytorch) else
         " --pytorch DIR" if args.pytorch else "") + (f" --rows {args.rows}" if args.rows else "") + \
        (" --quick" if args.quick else "") + (f" --heads {args.heads}" if args.heads != HEADS else "") + \
        (f" --family {args.family}" if args.family else "") + "`"
    t0 = time.time()
    done, failed = [], []
    for p in problems:
        t1 = time.time()
        rows = run_problem(p, peers, heads=args.heads)
        done.append((p, rows))
        failed += [f"{r['problem']} {r['side']} {','.join(r['kernels'])}" for r in rows if not r["ok"]]
        if args.json is not None:
            with open(args.json, "a") as f:
                f.write(json.dumps(dict(problem=dataclasses.asdict(p), rows=rows, sources=sources, command=command,
                                        heads=args.heads, minutes=(time.time() - t1) / 60)) + "\n")
        if out is not None:
            out.write_text(render(done, sources, command, [q.name for q in problems[len(done):]],
                                  (time.time() - t0) / 60, args.heads))
    print(render(done, sources, command, [], (time.time() - t0) / 60, args.heads))
    if failed:
        print("FAILED against the reference: " + "; ".join(failed))
    return 1 if failed else 0


def render_saved(files: list[Path], out: Optional[Path] = None) -> int:
    """The report of the problems saved by --json runs (several runs may share the table); ``out``
    defaults to the results file of the runs' family."""
    saved, families = {}, set()
    for path in files:
        for line in path.read_text().splitlines():
            if line.strip():
                entry = json.loads(line)
                p = Problem(**entry["problem"])
                saved[p.name] = entry
                families.add(p.family)
    if not saved:
        raise SystemExit(f"--render: no problems in {', '.join(map(str, files))}")
    if len(families) != 1:
        raise SystemExit(f"--render: runs on different GPU families ({', '.join(sorted(map(str, families)))}); "
                         "render each family's runs separately")
    out = out or results_file(families.pop())
    order = [p.name for p in PROBLEMS if p.name in saved] + [n for n in saved if n not in {p.name for p in PROBLEMS}]
    entries = [saved[n] for n in order]
    heads = {e["heads"] for e in entries}
    if len(heads) != 1:
        raise SystemExit(f"--render: runs emulated different numbers of heads ({sorted(heads)})")
    commands = list(dict.fromkeys(e["command"] for e in entries))
    command = ", ".join(commands) + ", then `python bench/vs_peers.py --render JSON...`"
    done = [(Problem(**e["problem"]), e["rows"]) for e in entries]
    missing = [p.name for p in PROBLEMS if p.name not in saved]
    sources = list(dict.fromkeys(s for e in entries for s in e["sources"]))
    out.write_text(render(done, sources, command, missing, sum(e["minutes"] for e in entries), heads.pop()))
    print(f"wrote {out} ({len(done)} problems" + (f"; not measured: {', '.join(missing)})" if missing else ")"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
