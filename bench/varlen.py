"""Packed sequences and dropout on the kernels: host time, allocator bytes, host syncs.

    python bench/varlen.py [--quick] [--iters N] [--json]

1. **Packed fine-tuning step** -- 32 sequences of lengths 64..2048 (seeded), H=16,
   D=128, fp16, causal: forward + backward of ``flash_attn_varlen_func`` (one op
   call each way, the kernels read ``cu_seqlens`` on the GPU) against the
   per-sequence loop it replaces (read ``cu_seqlens`` on the host, one
   ``flash_attn_func`` call per sequence on views, ``torch.cat`` of the outputs:
   what a caller without varlen kernels does).  The kernels run nowhere: the C++ op
   core plans, allocates and binds as always, its emulator encoder is replaced by
   the stub encoder (``core.use_stub_encoder``), so the figures are the host path
   an MPS call takes to its Metal encoder, and what torch's allocator hands out on
   the way (the kernels themselves allocate nothing).  Inputs are ``torch.empty``
   (never read).  Reported: host µs per forward + backward (median of interleaved
   rounds, on the same sequences at 1/64 of their lengths: see ``--shrink``), host
   synchronisations (reads of device values on the host: each one drains the GPU
   queue on MPS), and at the full shape the bytes allocated in total and the peak
   beyond the inputs (torch.profiler memory events, replayed in time order).
2. **Dropout extra memory vs L** -- forward + backward of ``flash_attn_func`` with
   ``dropout_p=0.1`` against ``dropout_p=0``, running the kernels in the emulator
   (B=1, H=2, D=32, bf16, causal): the allocator's peak beyond the inputs, minus
   out/dq/dk/dv.  Dropout stores no mask (the backward regenerates it from the
   (seed, offset) pair), so both grow like L; torch's ``F.scaled_dot_product_attention``
   with dropout under the MATH backend (what MPS runs for it) is shown for scale.

Writes bench/results/varlen.md; ``--json`` prints one JSON object as the last line.
"""
from __future__ import annotations

import contextlib
import json
import time

import torch
import torch.nn.functional as F

import harness

import torch_metal_flash as tmf
from torch_metal_flash import backends, core, emulator

H, D = 16, 128


def packed_lengths(n: int, lo: int, hi: int) -> list[int]:
    g = torch.Generator().manual_seed(15)
    return torch.randint(lo, hi + 1, (n,), generator=g).tolist()


def per_sequence_loop(q, k, v, cu_q, cu_k, max_q, max_k, causal=True):
    """A caller without varlen kernels: host-read bounds, a call per sequence, a cat."""
    bq, bk = cu_q.tolist(), cu_k.tolist()  # a host synchronisation on MPS
    outs = [tmf.flash_attn_func(q[None, a:b], k[None, c:d], v[None, c:d], causal=causal)[0]
            for a, b, c, d in zip(bq, bq[1:], bk, bk[1:])]
    return torch.cat(outs)


@contextlib.contextmanager
def count_host_syncs():
    """Counts Tensor.item / tolist / __bool__ and copies to the host (the calls that sync on MPS)."""
    counter = {"n": 0}
    names = ("item", "tolist", "__bool__", "cpu", "numpy")
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def wrap(fn):
        def counted(self, *a, **kw):
            counter["n"] += 1
            return fn(self, *a, **kw)
        return counted

    for n, fn in saved.items():
        setattr(torch.Tensor, n, wrap(fn))
    try:
        yield counter
    finally:
        for n, fn in saved.items():
            setattr(torch.Tensor, n, fn)


def _inputs(lens):
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    q, k, v = (torch.empty(sum(lens), H, D, dtype=torch.float16).requires_grad_() for _ in range(3))
    return q, k, v, cu, torch.empty(sum(lens), H, D, dtype=torch.float16)


def _steps(lens) -> dict:
    """name -> a forward + backward of the varlen face / the per-sequence loop on empty inputs."""
    q, k, v, cu, dout = _inputs(lens)

    def step(face):
        def run():
            out = face(q, k, v, cu, cu, max(lens), max(lens))
            out.backward(dout)
            q.grad = k.grad = v.grad = None
        return run

    return {"varlen": step(lambda *a: tmf.flash_attn_varlen_func(*a, causal=True)), "loop": step(per_sequence_loop)}


def packed_step(n_seqs: int, lo: int, hi: int, iters: int, shrink: int) -> dict:
    torch.set_num_threads(1)
    lens = packed_lengths(n_seqs, lo, hi)
    core.configure_plan_cache(verify=False)
    emu = backends.instance("emulator")
    core.use_stub_encoder(True)
    emu.encode = lambda launches: None  # plan runs outside the core (none expected)
    try:
        with tmf.backend("emulator", strict=True):
            res = {}
            for name, fn in _steps(lens).items():
                fn()  # warm the plan cache
                tmf.run_counts(reset=True)
                with count_host_syncs() as syncs:
                    fn()
                res[name] = dict(launches=sum(tmf.run_counts(reset=True).values()), syncs=syncs["n"])
                res[name]["peak"], res[name]["total"] = harness.allocations(fn)
            # Host time on the same sequences at 1/shrink of their lengths: the host path depends
            # on the number of sequences, not on their lengths, and at full lengths this CPU would
            # itself do the loop's zero-fills, sums and copies (GPU work on a Mac).
            us = harness.per_call_us(_steps([-(-n // shrink) for n in lens]), iters, warmup=1)
            for name in res:
                res[name]["us"] = us[name]
            runs = tmf.run_counts(reset=True)
    finally:
        core.use_stub_encoder(False)
        del emu.encode
    assert "reference" not in runs, f"a measured call fell back to the reference path: {runs}"
    res["shape"] = dict(n=n_seqs, lo=min(lens), hi=max(lens), total=sum(lens), input_bytes=3 * sum(lens) * H * D * 2,
                        shrink=shrink)
    return res


def dropout_memory(lengths) -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    B, Hd, Dd = 1, 2, 32
    rows = []
    g = torch.Generator().manual_seed(1)
    for L in lengths:
        q, k, v = (torch.randn(B, L, Hd, Dd, generator=g).to(torch.bfloat16).requires_grad_() for _ in range(3))
        dout = torch.randn(B, L, Hd, Dd, generator=g).to(torch.bfloat16)
        results = 4 * q.numel() * q.element_size()  # out, dq, dk, dv

        def ours(p):
            def run():
                with tmf.backend("emulator", strict=True), emulator.settings(checked=False):
                    tmf.flash_attn_func(q, k, v, dropout_p=p, causal=True).backward(dout)
            return run

        def torch_math():
            with sdpa_kernel([SDPBackend.MATH]):
                qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
                F.scaled_dot_product_attention(qt, kt, vt, dropout_p=0.1, is_causal=True).backward(
                    dout.transpose(1, 2))

        row = dict(L=L)
        for name, fn in (("p0", ours(0.0)), ("p0.1", ours(0.1)), ("torch_math_p0.1", torch_math)):
            start = time.time()
            row[name] = harness.allocations(fn)[0] - results
            row[name + "_s"] = time.time() - start
            q.grad = k.grad = v.grad = None
        rows.append(row)
    return rows


def main() -> None:
    ap = harness.parser(__doc__, results=True, json_summary=True)
    ap.add_argument("--quick", action="store_true", help="8 sequences of 16..256, dropout up to L=256")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--shrink", type=int, default=64, help="host time on lengths / SHRINK (default 64)")
    args = ap.parse_args()
    n, lo, hi = (8, 16, 256) if args.quick else (32, 64, 2048)
    step = packed_step(n, lo, hi, args.iters, args.shrink)
    drop = dropout_memory((128, 256) if args.quick else (256, 512, 1024, 2048))

    s = step["shape"]
    mib = lambda b: f"{b / 2 ** 20:.1f}"  # noqa: E731
    lines = [f"## Packed fine-tuning step: {s['n']} sequences of {s['lo']}..{s['hi']} tokens ({s['total']} in all), "
             f"H={H}, D={D}, fp16, causal, forward + backward\n",
             f"Kernel launches stubbed; inputs q, k, v {mib(s['input_bytes'])} MiB. Host µs: the same sequences at "
             f"1/{s['shrink']} of their lengths (the host path depends on the number of sequences, not their "
             "lengths; at full lengths this CPU would itself run the loop's zero-fills, sums and copies, GPU work "
             "on a Mac). Bytes: the full shape.\n",
             *harness.table_head("path", "host µs per fwd+bwd", "op calls (fwd+bwd)", "host syncs",
                                 "allocated in total MiB", "peak beyond inputs MiB", right=(1, 2, 3, 4, 5))]
    for name, label in (("varlen", "`flash_attn_varlen_func` (kernels read cu_seqlens)"),
                        ("loop", "per-sequence loop")):
        r = step[name]
        lines.append(harness.row(label, f"{r['us']:.0f}", r["launches"], r["syncs"], mib(r["total"]), mib(r["peak"])))
    lines += ["", f"Host time: the loop takes {step['loop']['us'] / step['varlen']['us']:.1f}× the varlen call's; "
              f"bytes allocated: {step['loop']['total'] / step['varlen']['total']:.1f}× (the loop's backward "
              "builds a full-size zero gradient per sequence slice and sums them, and its forward copies the "
              "outputs into one tensor); the varlen call allocates its results (out, lse, the backward's row "
              "state, dq/dk/dv) and nothing else.", "",
              "## Dropout: extra memory vs L (forward + backward, emulator, B=1, H=2, D=32, bf16, causal)\n",
              "Allocator peak beyond the inputs, minus out/dq/dk/dv.\n",
              *harness.table_head("L", "ours p=0: bytes", "ours p=0.1: bytes", "p=0.1 / (B·H·L)",
                                  "torch SDPA MATH p=0.1: bytes", "MATH / (B·H·L²)", right=range(6))]
    for r in drop:
        L = r["L"]
        lines.append(f"| {L} | {r['p0']} | {r['p0.1']} | {r['p0.1'] / (2 * L):.1f} | {r['torch_math_p0.1']} "
                     f"({mib(r['torch_math_p0.1'])} MiB) | {r['torch_math_p0.1'] / (2 * L * L):.1f} |")
    table = "\n".join(lines)
    print(table)
    cmd = "python bench/varlen.py" + (" --quick" if args.quick else "") + f" --iters {args.iters}" + \
        (f" --shrink {args.shrink}" if args.shrink != 64 else "")
    harness.write_result("varlen.md", f"# Packed sequences and dropout on the kernels\n\nGenerated by `{cmd}` "
                                      f"({torch.get_num_threads()} torch thread(s), a shared 2-core machine).\n\n"
                                      f"{table}\n", args.results)
    if args.json:
        print(json.dumps({"varlen": step["varlen"], "loop": step["loop"], "shape": s, "dropout": drop}))


if __name__ == "__main__":
    main()
