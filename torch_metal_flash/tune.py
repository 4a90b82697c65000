"""``python -m torch_metal_flash tune``: time the variants on this Mac and keep the winners.

    python -m torch_metal_flash tune              # the grid below, on the GPU; writes the cache
    python -m torch_metal_flash tune --quick      # one length per problem (under 2 minutes on an M1)
    python -m torch_metal_flash tune --ops fwd,bwd --dtypes float16 --head-dims 64,128
    python -m torch_metal_flash tune --list       # the variant space (any machine)
    python -m torch_metal_flash tune --verify     # every variant in the emulator vs the float64 oracle
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

import torch_metal_flash.progress as progress
from torch_metal_flash.planner.tiles import FAMILIES, HEAD_DIM_BUCKETS
from torch_metal_flash.tuning import cache_path, tune, variants
from torch_metal_flash.tuning.space import OPS

DTYPE_FLAGS = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def grid(ops, dtypes, head_dims, quick: bool) -> list[dict]:
    """The problems ``tune`` times: B 1, 16 query heads (decode: 32 over 8 KV heads)."""
    lengths = (1024,) if quick else (1024, 4096)
    decode_lengths = (4096,) if quick else (4096, 16384)
    out = []
    for op in ops:
        for dtype in dtypes:
            for d in head_dims:
                if op == "decode":
                    out += [dict(op=op, dtype=dtype, head_dim=d, seqlen_q=1, seqlen_k=n, causal=True, heads=32,
                                 kv_heads=8) for n in decode_lengths]
                else:
                    out += [dict(op=op, dtype=dtype, head_dim=d, seqlen_q=n, seqlen_k=n, causal=c, heads=16)
                            for n in lengths for c in (True, False)]
    return out


def rate(result: dict, seconds: float) -> str:
    """TFLOP/s of the matrix work (forward 4 L_q L_k D per head, halved when causal; the
    backward 2.5 x that, as flash-attn counts), or GB/s of K/V read for decode."""
    h, lq, lk, d = result.get("heads", 8), result["seqlen_q"], result["seqlen_k"], result["head_dim"]
    if result["op"] == "decode":
        nbytes = 2 * result.get("kv_heads", h) * lk * d * torch.empty(0, dtype=result["dtype"]).element_size()
        return f"{nbytes / seconds / 1e9:.1f} GB/s"
    flops = 4 * h * lq * lk * d * (0.5 if result["causal"] else 1.0) * (2.5 if result["op"] == "bwd" else 1.0)
    return f"{flops / seconds / 1e12:.2f} TFLOP/s"


def progress_reporter(description: str = "tuning"):
    """A ``progress(i, n, text)`` for :func:`tune` drawing a bar on stderr (torch_metal_flash.progress)."""
    state = {"bar": None, "i": 0}

    def report(i: int, n: int, text: str) -> None:
        if state["bar"] is None:
            state["bar"] = progress.Bar(n, description, "run")
        state["bar"].update(i - state["i"], text)
        state["i"] = i
        if i >= n:
            state["bar"].close()
    return report


def size(nbytes) -> str:
    """Bytes as a person reads them (KiB under 1 MiB)."""
    if nbytes is None:
        return "—"
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 1024:.1f} KiB"


def route_rows(results: list) -> list:
    """One row per problem class with a stock verdict: (op, dtype, D, L_q x L_k, causal, best
    kernel, its ms, torch's ms, speed-up of the kernels over torch, kernels' and torch's peak memory,
    route)."""
    rows, seen = [], {}
    for r in results:
        if not r.get("stock"):
            continue
        key = (r["op"], str(r["dtype"]), r["head_dim"], r["seqlen_q"], r["seqlen_k"], r["causal"])
        if key in seen:
            seen[key][5] += f" + {r['variant']}"
            continue
        v = r["stock"]
        t = v["torch_seconds"]
        row = [r["op"] if r["op"] != "bwd" else "fwd+bwd", str(r["dtype"])[6:], r["head_dim"],
               f"{r['seqlen_q']} x {r['seqlen_k']}", r["causal"], r["variant"], f"{v['kernels_seconds'] * 1e3:.3f}",
               "—" if t is None else f"{t * 1e3:.3f}",
               "—" if t is None else f"{t / v['kernels_seconds']:.2f}x", size(v["kernels_peak_bytes"]),
               size(v["torch_peak_bytes"]), "torch" if v["route"] == "torch" else "kernels"]
        seen[key] = row
        rows.append(row)
    return rows


ROUTE_HEADER = ("op", "dtype", "D", "L_q x L_k", "causal", "best kernel", "kernel ms", "torch ms",
                "speed-up (torch ms / kernel ms)", "kernel peak", "torch peak", "route")


def markdown(header, rows) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def route_table(results: list) -> str:
    """The per-class table ``tune`` ends with: the best kernel against torch's own SDPA, and the route."""
    return markdown(ROUTE_HEADER, route_rows(results))


def table(results: list) -> str:
    lines = ["| op | part | dtype | D | L_q x L_k | causal | variant | time (ms) | rate | |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for name, s in r["seconds"].items():
            mark = "winner" + (f", {r['speedup']:.2f}x the default" if name != r["default"] else " (the default)") \
                if name == r["variant"] else ("default" if name == r["default"] else "")
            lines.append(f"| {r['op']} | {r['part']} | {str(r['dtype'])[6:]} | {r['head_dim']} | "
                         f"{r['seqlen_q']} x {r['seqlen_k']} | {r['causal']} | {name} | {s * 1e3:.3f} | "
                         f"{rate(r, s)} | {mark} |")
        for name, why in r.get("rejected", {}).items():  # wrong results on this GPU: never chosen
            lines.append(f"| {r['op']} | {r['part']} | {str(r['dtype'])[6:]} | {r['head_dim']} | "
                         f"{r['seqlen_q']} x {r['seqlen_k']} | {r['causal']} | {name} | — | — | "
                         f"REJECTED: {why.splitlines()[0]} |")
    return "\n".join(lines)


def list_space(ops, dtypes, head_dims, family) -> str:
    lines = [f"variant space (family {family or 'of this device'}; the default first):"]
    for op in ops:
        for dtype in dtypes:
            for d in head_dims:
                names = variants(op, dtype=dtype, head_dim=d, family=family)
                if names:
                    lines.append(f"  {op:6} {str(dtype)[6:]:8} d{d:<4} " + ", ".join(names))
    return "\n".join(lines)


def verify(ops, dtypes, head_dims, report=print) -> int:
    """Run every variant in the emulator (checked, two schedule orders) against the float64
    oracle, forward for fwd/decode, the gradients for bwd; returns the number of failures."""
    import torch_metal_flash as tmf
    from torch_metal_flash import emulator
    from torch_metal_flash.backends.emulator import EmulatorBackend
    from torch_metal_flash.problem.spec import make_spec
    from torch_metal_flash.testing import check_backward, check_forward
    from torch_metal_flash.tuning import use

    names_seen = []
    encode = EmulatorBackend.encode

    def recording(self, launches):
        names_seen.extend(p[1] for p, _ in launches)
        encode(self, launches)

    failures = 0
    done = set()
    EmulatorBackend.encode = recording
    try:
        for op in ops:
            for dtype in dtypes:
                for d in head_dims:
                    for family, name in ((f, n) for f in FAMILIES for n in variants(op, dtype=dtype, head_dim=d,
                                                                                 family=f)):
                        if name in done:
                            continue  # a smaller head dim of the same bucket ran it
                        done.add(name)
                        start = time.perf_counter()
                        try:
                            lq, lk, hq, hkv = (1, 300, 4, 2) if op == "decode" else \
                                (40, 72 if op == "fwd" else 40, 2, 1)
                            g = torch.Generator().manual_seed(d)
                            q, k, v = (torch.randn(1, L, H, d, generator=g).to(dtype).requires_grad_(op == "bwd")
                                       for L, H in ((lq, hq), (lk, hkv), (lk, hkv)))
                            spec = make_spec(*(t.detach().transpose(1, 2) for t in (q, k, v)), scale=d ** -0.5,
                                             diag_offset=lk - lq, window_right=0)
                            dout = torch.randn(q.shape, generator=g).to(dtype)
                            for order in ("forward", "reverse"):
                                names_seen.clear()
                                with emulator.settings(order=order, checked=True, family=family), \
                                        use(op, name), tmf.backend("emulator", strict=True):
                                    out, lse, _ = tmf.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
                                    if op == "bwd":
                                        grads = torch.autograd.grad(out, (q, k, v), dout)
                                if name not in names_seen:
                                    raise AssertionError(f"launched {names_seen}, not {name}")
                                if op == "bwd":
                                    check_backward(spec, dout.transpose(1, 2), None,
                                                   (*(x.transpose(1, 2) for x in grads), None, None))
                                else:
                                    check_forward(spec, out.detach().transpose(1, 2), lse)
                            verdict = "ok"
                        except Exception as exc:  # a wrong result, or an emulator error (race, bounds ...)
                            failures += 1
                            verdict = f"FAIL: {exc}"
                        report(f"  {op:6} {str(dtype)[6:]:8} d{d:<4} {name:40} {verdict} "
                            f"({time.perf_counter() - start:.1f} s)")
    finally:
        EmulatorBackend.encode = encode
    report(f"{len(done)} variants run")
    return failures


def _csv(text: str, allowed=None, convert=str) -> list:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if allowed is not None:
        bad = [x for x in items if x not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"{', '.join(bad)} not in {', '.join(allowed)}")
    return [convert(x) for x in items]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_metal_flash tune", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one length per problem (under 2 minutes on an M1)")
    parser.add_argument("--ops", type=lambda s: _csv(s, OPS), default=list(OPS), help="fwd,bwd,decode")
    parser.add_argument("--dtypes", type=lambda s: _csv(s, DTYPE_FLAGS, DTYPE_FLAGS.get),
                        default=None, help="float16,bfloat16,float32 (default float16,bfloat16)")
    parser.add_argument("--head-dims", type=lambda s: _csv(s, None, int), default=None,
                        help="head dims (default 64,128; --list/--verify: every head-dim bucket)")
    parser.add_argument("--family", help="--list: the family whose defaults come first (default: this device's)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--list", action="store_true", help="print the variant space")
    mode.add_argument("--verify", action="store_true", help="run every variant in the emulator against the oracle")
    args = parser.parse_args(argv)
    dtypes = args.dtypes or [torch.float16, torch.bfloat16]
    if args.list:
        print(list_space(args.ops, args.dtypes or list(DTYPE_FLAGS.values()),
                         args.head_dims or HEAD_DIM_BUCKETS, args.family))
        return 0
    if args.verify:
        dims = args.head_dims or HEAD_DIM_BUCKETS
        failures = verify(args.ops, args.dtypes or list(DTYPE_FLAGS.values()), dims)
        print("verify: " + ("every variant matches the oracle" if not failures else f"{failures} FAILED"))
        return 1 if failures else 0
    if not torch.backends.mps.is_available():
        print("tune times the kernels on an Apple GPU (MPS), which this machine does not have; "
              "`tune --list` prints the variant space, `tune --verify` checks it in the emulator.", file=sys.stderr)
        return 2
    problems = grid(args.ops, dtypes, args.head_dims or (64, 128), args.quick)
    start = time.perf_counter()
    results = tune(problems, progress=progress_reporter())
    print(table(results))
    print("\nPer problem class: the best kernel against torch's own SDPA (forward; fwd+bwd: forward + backward), "
          "peak memory of each, the route taken (docs/tuning.md, the memory rule):\n")
    print(route_table(results))
    print(f"\n{len(results)} choices in {time.perf_counter() - start:.0f} s, written to {cache_path()}")
    return 0
