"""Long runs: many calls with varying shapes, faces and backends; process memory and
every cache of the package (``torch_metal_flash.cache_info()``) must stay bounded.

    python bench/long_run.py                 # 100,000 calls -> bench/results/long_run.md
    python bench/long_run.py --calls 2000    # what CI runs (tests/core/test_long_run.py)

The calls run on the emulator (fast mode: unchecked, the launch itself is the same)
and the reference backend: forward of every face, forward + backward every 8th
call, a decode step (every other one over an 8-bit quantized cache), and every 25th call a head dim the
kernels do not cover (a fallback with a new reason each time, so the warning
registry is exercised).  Memory is the resident set size (/proc/self/status).
"""
from __future__ import annotations

import random
import sys
import time
import warnings
from pathlib import Path

import torch

import harness

import torch_metal_flash as tmf
from torch_metal_flash import emulator

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def rss_mib() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # peak, where /proc is missing


def one_call(rng: random.Random, n: int) -> None:
    dtype = rng.choice(DTYPES)
    B, H = rng.randint(1, 2), rng.choice((1, 2, 4))
    Lq, Lk = rng.randint(1, 24), rng.randint(1, 40)
    D = rng.choice((8, 16, 24, 40, 64)) if n % 25 else 513 + n // 25 % 512  # a new fallback reason
    kind = n % 4
    grad = n % 8 == 0
    q = torch.randn(B, Lq, H, D, dtype=dtype, requires_grad=grad)
    k = torch.randn(B, Lk, H, D, dtype=dtype, requires_grad=grad)
    if kind == 0:
        out = tmf.flash_attn_func(q, k, k, causal=bool(n % 3), window_size=(rng.randint(-1, 8), -1))
    elif kind == 1:
        mask = torch.rand(Lq, Lk) > 0.2
        out = tmf.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), k.transpose(1, 2),
                                               attn_mask=mask)
    elif kind == 2:  # a decode step; every other one over an 8-bit quantized cache
        cache = torch.randn(B, Lk + 4, H, D, dtype=dtype)
        if n % 8 == 6 and D <= 256:
            cache = tmf.quantize(cache, bits=8, group_size=32)
        out = tmf.flash_attn_with_kvcache(q.detach()[:, :1], cache, cache, k=k.detach()[:, :1],
                                          v=k.detach()[:, :1], cache_seqlens=torch.full((B,), Lk, dtype=torch.int32))
        grad = False
    else:
        lens = [rng.randint(1, Lq) for _ in range(B)]
        cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(B)], dtype=torch.int32)
        qv = torch.randn(int(cu[-1]), H, D, dtype=dtype, requires_grad=grad)
        out = tmf.flash_attn_varlen_func(qv, qv, qv, cu, cu, max(lens), max(lens))
        q = qv
    if grad:
        out.float().sum().backward()


def run(calls: int, seed: int = 0, samples: int = 20, checked: bool = False) -> list[dict]:
    """Make ``calls`` calls; returns ``samples`` snapshots (call count, RSS, cache sizes, time).
    ``checked`` runs the emulator's checked builds (CI has them compiled already)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    every = max(1, calls // samples)
    snaps = []
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tmf.FallbackWarning)
        for n in range(calls):
            backend = "emulator" if n % 2 == 0 else "reference"
            with tmf.backend(backend), emulator.settings(checked=checked):
                one_call(rng, n)
            if (n + 1) % every == 0 or n + 1 == calls:
                snaps.append({"calls": n + 1, "rss_mib": rss_mib(), "seconds": time.perf_counter() - t0,
                              "caches": {k: v["size"] for k, v in tmf.cache_info().items()},
                              "maxsizes": {k: v["maxsize"] for k, v in tmf.cache_info().items()}})
    return snaps


def bounded(snaps: list[dict], rss_growth_mib: float) -> list[str]:
    """Problems: a cache above its size, or memory growing after the first quarter of the run."""
    problems = []
    for s in snaps:
        for name, size in s["caches"].items():
            if size > s["maxsizes"][name]:
                problems.append(f"{name}: {size} entries > {s['maxsizes'][name]} after {s['calls']} calls")
    warm = snaps[len(snaps) // 4]["rss_mib"]
    grown = max(s["rss_mib"] for s in snaps) - warm
    if grown > rss_growth_mib:
        problems.append(f"resident memory grew by {grown:.0f} MiB after {snaps[len(snaps) // 4]['calls']} calls")
    return problems


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--calls", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(harness.RESULTS / "long_run.md"))
    args = ap.parse_args()
    snaps = run(args.calls, args.seed)
    problems = bounded(snaps, rss_growth_mib=64)
    lines = [f"# Long run: {args.calls} calls", "",
             f"Command: `python bench/long_run.py --calls {args.calls}` (seed {args.seed}); "
             f"{snaps[-1]['seconds']:.0f} s.", "",
             *harness.table_head("calls", "RSS MiB", *snaps[-1]["caches"])]
    for s in snaps:
        lines.append(harness.row(s["calls"], f"{s['rss_mib']:.0f}", *s["caches"].values()))
    lines += ["", "Cache sizes (max): " + ", ".join(f"{k} {v}" for k, v in snaps[-1]["maxsizes"].items()), "",
              "Verdict: " + ("bounded" if not problems else "NOT bounded: " + "; ".join(problems))]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
