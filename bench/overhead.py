"""Host overhead per call, as ratios to torch's whole ``F.scaled_dot_product_attention``
call on the same tiny tensors, measured in one run.

The kernels run nowhere: the C++ op core plans and binds as always, but its
emulator encoder is replaced by the stub encoder (``core.use_stub_encoder``),
so what is timed is the host path of a call on CPU tensors with the emulator
backend selected -- the same C++ path an MPS call takes to its Metal encoder.
Measured: the op on a plan-cache hit and on a miss (cache cleared before each
call), each public face (``scaled_dot_product_attention``, ``flash_attn_func``,
the SDPA override), the backward op on a hit, and one ``flash_attn_with_kvcache``
decode step (whatever path it takes; plan runs that bypass the core are
stubbed too).

    python bench/overhead.py [--iters N] [--json]

Writes bench/results/overhead.md; ``--json`` prints one JSON object as the last line.
Targets, as ratios to the op on a plan-cache hit: every face <= 2.5, the override <= 3,
one decode step <= 3.
Timings are medians of 7 interleaved rounds (load shifts all rows alike); read the ratios.
"""
from __future__ import annotations

import json

import torch
import torch.nn.functional as F

import harness

import torch_metal_flash as tmf
from torch_metal_flash import backends, core, ops


def measure(iters: int) -> tuple[float, dict]:
    torch.set_num_threads(1)  # tiny tensors: one thread is torch's fastest, and steadier on a shared machine
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 64, generator=g, dtype=torch.float32).to(torch.float16) for _ in range(3))
    qf, kf, vf = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # flash-attn layout (B, L, H, D)
    # the ops as a user calls them (the packets), positionally: the names are checked against the schema once
    fwd, bwd = torch.ops.metal_flash.fwd, torch.ops.metal_flash.bwd
    fwd_kw = dict(q=q, k=k, v=v, attn_mask=None, alibi_slopes=None, sinks=None, scale=0.125, diag_offset=0,
                  window_left=-1, window_right=0, softcap=0.0, return_aux=False)
    ops.fwd_call.prefix(*fwd_kw)
    fwd_args = tuple(fwd_kw.values())

    # decode: one new token appended to a 64-row cache, GQA 2:1
    k_cache = torch.randn(1, 64, 1, 64, generator=g).to(torch.float16)
    v_cache = torch.randn(1, 64, 1, 64, generator=g).to(torch.float16)
    q1 = torch.randn(1, 1, 2, 64, generator=g).to(torch.float16)
    k1 = torch.randn(1, 1, 1, 64, generator=g).to(torch.float16)
    v1 = torch.randn(1, 1, 1, 64, generator=g).to(torch.float16)
    lens = torch.tensor([40], dtype=torch.int32)

    core.configure_plan_cache(verify=False)  # (the test suite's verify mode re-plans every hit)
    emulator = backends.instance("emulator")
    core.use_stub_encoder(True)
    emulator.encode = lambda launches: None  # plan runs outside the core (none for these calls)
    try:
        with tmf.backend("emulator"):
            out, _, aux = ops.fwd_call(**{**fwd_kw, "return_aux": True})
            dout = torch.randn(out.shape, generator=g).to(out.dtype)
            bwd_kw = dict(dout=dout, q=q, k=k, v=v, out=out, aux=aux, dlse=None, attn_mask=None, alibi_slopes=None,
                          sinks=None, scale=0.125, diag_offset=0, window_left=-1, window_right=0, softcap=0.0,
                          compute_dbias=False)
            ops.bwd_call.prefix(*bwd_kw)
            bwd_args = tuple(bwd_kw.values())
            sdpa = (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), None)
            calls = {
                "torch_sdpa": (*sdpa, None),
                "op_hit": (lambda: fwd(*fwd_args), None, None),
                "op_miss": (lambda: fwd(*fwd_args), lambda: core.plan_cache_clear(reset_counters=False), None),
                "scaled_dot_product_attention": (lambda: tmf.scaled_dot_product_attention(q, k, v, is_causal=True),
                                                 None, None),
                "flash_attn_func": (lambda: tmf.flash_attn_func(qf, kf, vf, causal=True), None, None),
                "sdpa_override": (*sdpa, tmf.sdpa_override),  # routes CPU calls while the emulator is selected
                "backward": (lambda: bwd(*bwd_args), None, None),
                "decode": (lambda: tmf.flash_attn_with_kvcache(q1, k_cache, v_cache, k=k1, v=v1, cache_seqlens=lens,
                                                                causal=True), None, None),
            }
            results = harness.per_call_us(calls, iters)
            runs = tmf.run_counts(reset=True)
    finally:
        core.use_stub_encoder(False)
        del emulator.encode
    assert "reference" not in runs, f"a measured call fell back to the reference path: {runs}"
    return results["torch_sdpa"], results


ROWS = (
    ("op_hit", "`torch.ops.metal_flash.fwd`, plan-cache hit"),
    ("op_miss", "`torch.ops.metal_flash.fwd`, plan-cache miss (plans in Python)"),
    ("scaled_dot_product_attention", "`tmf.scaled_dot_product_attention`"),
    ("flash_attn_func", "`tmf.flash_attn_func`"),
    ("sdpa_override", "`F.scaled_dot_product_attention` with `tmf.sdpa_override()`"),
    ("backward", "`torch.ops.metal_flash.bwd`, plan-cache hit"),
    ("decode", "`tmf.flash_attn_with_kvcache`, one decode step"),
)


def main() -> None:
    parser = harness.parser(__doc__, results=True, json_summary=True)
    parser.add_argument("--iters", type=int, default=2000)
    args = parser.parse_args()

    base, r = measure(args.iters)
    hit = r["op_hit"]
    lines = harness.table_head("call", "µs per call", "× torch SDPA call", "× the op on a plan-cache hit",
                               right=(1, 2, 3))
    lines.append(harness.row("torch `F.scaled_dot_product_attention` (whole call, CPU)", f"{base:.1f}", "1.00",
                             f"{base / hit:.2f}"))
    lines += [harness.row(label, f"{r[key]:.1f}", f"{r[key] / base:.2f}", f"{r[key] / hit:.2f}") for key, label in ROWS]
    table = "\n".join(lines)
    print(table)
    harness.write_result("overhead.md", (
        "# Host overhead per call (kernel launches stubbed)\n\n"
        f"`python bench/overhead.py --iters {args.iters}`: q, k, v (1, 2, 8, 64) fp16 causal on the CPU, "
        "emulator backend with the C++ core's stub encoder (everything but the kernels runs); decode: one token "
        f"against a 64-row cache, GQA 2:1. {torch.get_num_threads()} torch threads.\n\n{table}\n"), args.results)
    if args.json:
        summary = {
            "torch_sdpa_us": round(base, 2),
            "op_hit_ratio": round(r["op_hit"] / base, 3),
            "op_miss_ratio": round(r["op_miss"] / base, 3),
            "faces": {name: round(r[name] / base, 3)
                      for name in ("scaled_dot_product_attention", "flash_attn_func", "sdpa_override")},
            "backward_ratio": round(r["backward"] / base, 3),
            "decode_ratio": round(r["decode"] / base, 3),
            "vs_op_hit": {name: round(r[name] / r["op_hit"], 3)
                          for name in ("scaled_dot_product_attention", "flash_attn_func", "sdpa_override", "decode")},
        }
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
