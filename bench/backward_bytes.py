"""Backward kernels: device bytes moved, threadgroup memory, extra memory vs L.

    python bench/backward_bytes.py            # all three tables (a few minutes, emulator)
    python bench/backward_bytes.py --quick    # smaller shapes
    python bench/backward_bytes.py --mma-only # only table 0 (about a minute)

Writes markdown tables to stdout and to bench/results/backward.md.

0. **Matrix work against FlashAttention-2** -- the 8x8 multiplies the emulator
   counts for the whole backward (float16, non-causal, L 256, B = H = 1, GPU
   family apple8's tiles) times their 512 FMAs, divided by the FMAs of
   FlashAttention-2's five products (QK^T, dO V^T, P^T dO, dS^T Q, dS K): per
   head dim and per dK/dV variant of the tuning space, the default first.  The
   fused dK/dV kernel recomputes S and dP once (7/5), the split pair twice for S
   and once for dP in the dK kernel (8/5).
1. **Bytes moved** -- exact device bytes read + written by every launch of the
   backward plan (emulator, checked mode: every load and store is counted),
   divided by the compulsory minimum: read q, k, v, dO, the forward's row state
   aux (row max and sum; for fp16/bf16 also the float32 output) and, for
   float32, out once, write dq, dk, dv once.  FlashAttention-2's backward re-reads K/V once per query
   block (dQ kernel) and Q/dO once per key block (dK/dV kernel), so the ratio
   grows like L / block; on a GPU most of those re-reads hit the L2 cache.
2. **Threadgroup memory per variant** -- from the tile table, and the peak the
   emulator measured for the variants the shapes above ran.
3. **Extra memory vs L** -- peak bytes the *allocator* hands out during
   forward + backward beyond the inputs, minus the results themselves (out,
   dq, dk, dv), measured with ``torch.profiler`` memory events (every CPU
   allocation and free, replayed in time order to get the running peak).  Ours
   runs the kernels in the emulator (fast mode); the kernels themselves
   allocate nothing, so this is what the op and the plan allocate: lse and
   aux (kept from the forward for the backward: 8 bytes per row, plus the
   float32 output row, 4 * Dv bytes, for fp16/bf16 inputs), delta and the row
   stats (12 bytes per row of scratch during the backward).
   It is compared with ``F.scaled_dot_product_attention`` on CPU with
   gradients under the MATH backend -- the composite path PyTorch's MPS SDPA
   takes as soon as a gradient is needed -- and under CPU's default choice
   (its own fused flash kernel).  The emulator's staging copies of bound
   tensors are made by its C++ runtime outside the torch allocator and are
   not counted (they do not exist on the Metal backend).
"""
from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

import harness

from torch_metal_flash import backends, emulator, tuning
from torch_metal_flash.planner.backward_tiles import DSINKS_THREADS, backward_tiles, backward_variants, dkv_variants
from torch_metal_flash.problem.spec import make_spec
from support import backward_cases as bk

PARAMS_INDEX = {"pre": 6, "dq": 6, "dkv": 6, "dsinks": 6}
DT = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def bytes_table(quick: bool) -> tuple[str, dict]:
    rows = []
    peaks = {}
    configs = [
        # dtype, B, Hq, Hkv, L, D, masking
        ("f16", 1, 4, 4, 256, 64, "none"),
        ("f16", 1, 4, 4, 256, 64, "causal"),
        ("f16", 1, 8, 2, 256, 64, "causal"),
        ("f16", 1, 4, 4, 256, 128, "none"),
        ("f32", 1, 4, 4, 256, 64, "none"),
        ("f16", 1, 4, 4, 128, 64, "none"),
    ]
    if not quick:
        configs += [("f16", 1, 4, 4, 512, 64, "none"), ("f16", 1, 4, 4, 1024, 64, "causal"),
                    ("bf16", 1, 4, 1, 512, 128, "causal")]
    configs += [("f16", 1, 2, 2, 128, 320, "none"), ("f16", 1, 2, 1, 128, 512, "causal"),
                ("f32", 1, 2, 2, 128, 512, "none")]
    g = torch.Generator().manual_seed(0)
    for dt, B, Hq, Hkv, L, D, masking in configs:
        dtype = DT[dt]
        q = torch.randn(B, Hq, L, D, generator=g).to(dtype)
        k = torch.randn(B, Hkv, L, D, generator=g).to(dtype)
        v = torch.randn(B, Hkv, L, D, generator=g).to(dtype)
        kw = dict(window_right=0) if masking == "causal" else {}
        spec = make_spec(q, k, v, scale=D ** -0.5, **kw)
        out, aux = bk.saved_forward(spec)
        dout = torch.randn(out.shape, generator=g).to(dtype)
        t0 = time.time()
        _, stats = bk.run_backward(spec, dout, out, aux, checked=True)
        secs = time.time() - t0
        es = dtype.itemsize
        o_read = out.numel() if dtype == torch.float32 else 0  # fp16/bf16: O comes from aux
        minimum = es * (q.numel() * 2 + k.numel() * 2 + v.numel() * 2 + o_read + dout.numel()) + 4 * aux.numel()
        # Device buffers only: the params struct is in the constant address
        # space (cached and broadcast on the GPU), but the emulator counts
        # every thread's read of it.
        def moved(s):
            return sum(n for i, n in s.bytes_read.items() if i != PARAMS_INDEX[s.kernel.split("_")[2]]) + \
                sum(n for i, n in s.bytes_written.items() if i != PARAMS_INDEX[s.kernel.split("_")[2]])
        total = sum(moved(s) for s in stats)
        names = {"m0": "dkv", "m1": "dk", "m2": "dv"}
        per = {names.get(s.kernel.split("_")[-1], s.kernel.split("_")[2]): moved(s) for s in stats}
        for s in stats:
            peaks[s.kernel] = max(peaks.get(s.kernel, 0), s.threadgroup_memory)
        mma = sum(s.mma for s in stats)
        pairs = B * Hq * (L * (L + 1) // 2 if masking == "causal" else L * L)  # visible (i, j)
        # FMAs of the products: FlashAttention-2's five (S, dP, dV, dK, dQ), and the ones our
        # kernels compute (S again in the dK/dV kernel, and dP and S once more when dK and dV split)
        fa2 = pairs * (3 * D + 2 * D)
        ours = pairs * ((2 * D + D) + (2 * D + 2 * D) if "m0" in per_modes(stats) else
                        (2 * D + D) + (2 * D + D) + (D + D))
        rows.append(f"| {dt} | {B}x{Hq}:{Hkv}x{L}x{D} | {masking} | {_mib(minimum)} | {_mib(total)} | "
                    f"**{total / minimum:.2f}** | " + " / ".join(f"{k} {v / minimum:.2f}" for k, v in per.items())
                    + f" | {mma} | {mma * 512 / ours:.2f} | {mma * 512 / fa2:.2f} | {secs:.1f} |")
    head = ("| dtype | B x Hq:Hkv x L x D | mask | minimum MiB | moved MiB | ratio | per kernel (x minimum) "
            "| 8x8 MMAs | MMA FMAs / our products' FMAs | MMA FMAs / FA2's five products | emulator s |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|")
    return head + "\n" + "\n".join(rows), peaks


MMA_HEAD_DIMS = (32, 64, 80, 96, 128, 160, 192, 256, 384, 512)


def mma_table(L: int = 256) -> str:
    rows = []
    g = torch.Generator().manual_seed(0)
    for D in MMA_HEAD_DIMS:
        q, k, v = (torch.randn(1, 1, L, D, generator=g).half() for _ in range(3))
        spec = make_spec(q, k, v, scale=D ** -0.5)
        out, aux = bk.saved_forward(spec)
        dout = torch.randn(out.shape, generator=g).half()
        fa2 = L * L * 5 * D
        dq = backward_tiles(torch.float16, D).dq.kernel
        for i, pair in enumerate(dkv_variants(torch.float16, D)):
            with tuning.use("bwd", pair[0].kernel):
                _, stats = bk.run_backward(spec, dout, out, aux, checked=False)
            ran = [s.kernel for s in stats if "_dkv_" in s.kernel]
            assert ran == [t.kernel for t in pair], (ran, pair)
            mma = sum(s.mma for s in stats)
            kind = "fused" if pair[0].mode == 0 else "dK + dV pair"
            kind += f", head dim over {pair[0].ds} simdgroups" if pair[0].ds > 1 else ""
            rows.append(f"| {D} | {' + '.join(f'`{t.kernel}`' for t in pair)} | {kind}{' (default)' if i == 0 else ''} "
                        f"| `{dq}` | {mma} | **{mma * 512 / fa2:.3f}** |")
    head = (f"float16, non-causal, B = H = 1, L = {L}, apple8's tiles; ratio = 8x8 MMAs x 512 / FMAs of "
            "FlashAttention-2's five products.\n\n"
            "| head dim | dK/dV kernels | kind | dQ kernel | 8x8 MMAs | ratio to FA2 |\n|---|---|---|---|---|---|")
    return head + "\n" + "\n".join(rows)


def per_modes(stats) -> set:
    """The dK/dV kernels' mode suffixes of a plan's launches (``m0`` fused, ``m1``/``m2`` split)."""
    return {s.kernel.split("_")[-1] for s in stats if "_dkv_" in s.kernel}


def tgmem_table(peaks: dict) -> str:
    rows = []
    for t in backward_variants():
        kind = "dQ" if t.kernel.startswith("flash_bwd_dq") else \
            {0: "dK+dV", 1: "dK", 2: "dV"}[t.mode]
        meas = peaks.get(t.kernel)
        rows.append(f"| `{t.kernel}` | {kind} | {t.threads} | {t.threadgroup_memory} "
                    f"({t.threadgroup_memory / 1024:.1f} KiB) | {'' if meas is None else meas} |")
    for name, size in (("flash_bwd_pre_*", 0), ("flash_bwd_dsinks", 4 * DSINKS_THREADS)):
        rows.append(f"| `{name}` | {'preprocess' if 'pre' in name else 'dsinks'} | 256 | {size} | "
                    f"{peaks.get(name, '')} |")
    head = ("| kernel | computes | threads | threadgroup bytes (table) | measured peak (emulator) |\n"
            "|---|---|---|---|---|")
    return head + "\n" + "\n".join(rows)


def memory_table(quick: bool, D: int = 32) -> str:
    import torch_metal_flash as tmf
    from torch.nn.attention import SDPBackend, sdpa_kernel

    B, H = 1, 2
    lengths = (128, 256, 512) if quick or D > 128 else (128, 256, 512, 1024, 2048)
    rows = []
    g = torch.Generator().manual_seed(1)
    for L, dtype in ((L, dt) for L in lengths for dt in (torch.float32, torch.bfloat16)):
        q, k, v = (torch.randn(B, H, L, D, generator=g).to(dtype).requires_grad_() for _ in range(3))
        dout = torch.randn(B, H, L, D, generator=g).to(dtype)
        results = 4 * dtype.itemsize * q.numel()  # out, dq, dk, dv

        def ours():
            with backends.backend("emulator", strict=True), emulator.settings(checked=False):
                o = tmf.scaled_dot_product_attention(q, k, v, is_causal=True)
                o.backward(dout)

        def sdpa(kind):
            def run():
                with sdpa_kernel([kind]):
                    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                    o.backward(dout)
            return run

        t0 = time.time()
        ours_b = harness.allocations(ours)[0] - results
        t_ours = time.time() - t0
        math_b = harness.allocations(sdpa(SDPBackend.MATH))[0] - results
        flash_b = harness.allocations(sdpa(SDPBackend.FLASH_ATTENTION))[0] - results
        bhl = B * H * L
        rows.append(f"| {L} | {str(dtype)[6:]} | {ours_b} | {ours_b / bhl:.1f} | {math_b} ({_mib(math_b)} MiB) | "
                    f"{math_b / (B * H * L * L):.1f} | {flash_b} | {t_ours:.1f} |")
        for t in (q, k, v):
            t.grad = None
    head = (f"B={B}, H={H}, D={D}, causal, forward + backward.\n\n"
            "| L | dtype | ours: extra bytes | ours / (B·H·L) | SDPA MATH (MPS training path): extra bytes "
            "| MATH / (B·H·L²) | SDPA CPU flash: extra bytes | ours emulator s |\n|---|---|---|---|---|---|---|---|")
    return head + "\n" + "\n".join(rows)


def main() -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--mma-only", action="store_true", help="only the matrix-work table (backward_mma.md)")
    args = ap.parse_args()
    mma = ["# Backward matrix work against FlashAttention-2, per head dim and dK/dV variant\n",
           "Generated by `python bench/backward_bytes.py --mma-only` (also part of the full run).\n", mma_table(), ""]
    harness.write_result("backward_mma.md", "\n".join(mma) + "\n")
    print("\n".join(mma))
    if args.mma_only:
        return 0
    parts = ["# Backward kernels: bytes moved, threadgroup memory, extra memory\n",
             "Generated by `python bench/backward_bytes.py" + (" --quick" if args.quick else "") + "`.\n"]
    table, peaks = bytes_table(args.quick)
    parts += ["## Device bytes moved vs the compulsory minimum (emulator, checked mode)\n",
              "Minimum = read q, k, v, dO, aux (and out for float32) once + write dq, dk, dv once.  Moved = "
              "every device buffer the kernels read or write (the delta/stats scratch included), not the params "
              "struct (constant address space, cached on the GPU; the emulator counts each thread's read of it).\n",
              table, ""]
    parts += ["## Threadgroup memory per variant\n", tgmem_table(peaks), ""]
    if not args.no_memory:
        parts += ["## Extra memory vs sequence length (torch allocator peak, fwd + bwd, minus out/dq/dk/dv)\n",
                  memory_table(args.quick), "", memory_table(args.quick, D=512), ""]
    text = "\n".join(parts)
    print(text)
    harness.write_result("backward.md", text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
