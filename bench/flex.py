"""FlexAttention's block skipping, measured in the emulator (checked mode counts every device byte).

    python bench/flex.py            # prints markdown; writes bench/results/flex.md
    python bench/flex.py --quick    # smaller problems (a minute)

1. Sliding window (each query sees the 256 keys before it) as a BlockMask at
   L = 8K: the K/V bytes the forward, dQ and dK/dV kernels read against the
   dense problem's (every query block reading every key, the plain kernels'
   traffic: measured on a dense flex run at L = 1K and scaled by L^2 where
   the dense run at 8K would take hours in the emulator), and against
   block density x dense.  Target: at most 1.2 x density x dense.
2. The same at the BlockMask's own block size 32 (a window of 48 keys, causal): the
   kernels walk 32 x 32 blocks as sub-blocks of their 64 instead of coarsening
   the mask to 64, against the mask at 64 and against density (at 32) x dense.
   Target: the forward (32-row query tiles) at most 1.0 x density x dense; the
   backward's 64-row tiles stream the union of their two rows of 32-blocks.
3. Causal as a mask_mod against the plain kernels' causal flag: device bytes
   and 8x8 multiplies of the forward and the backward.  Target: at most 1.15x.
4. Extra memory of a training step (forward and backward, a sliding window and a
   learned relative bias, whose gradient the kernels sum along diagonals) as L
   doubles: the peak of torch's CPU allocator beyond the inputs and the results
   (out, lse and the gradients), against the dense definition (the math of
   torch's eager flex_attention, which has no CPU backward).  Target: O(L) --
   the ratio per doubling stays near 2.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

import harness

import torch_metal_flash as tmf
from torch_metal_flash import emulator
from torch.nn.attention.flex_attention import create_block_mask
from torch_metal_flash.flex.reference import dense_flex_attention

BUF_Q, BUF_K, BUF_V, BUF_DOUT = 0, 1, 2, 3  # buffer indices of the forward and backward kernels


def _run(fn, backward: bool):
    """Stats of the launches of fn() (and of its backward), split into forward and backward."""
    with emulator.recording() as fwd:
        out = fn()
    bwd = []
    if backward:
        with emulator.recording() as bwd:
            out.float().square().sum().backward()
    return list(fwd), list(bwd)


def _kv_bytes(stats) -> int:
    """Bytes the inner loops stream: K/V of the forward and dQ kernels, Q/dO of the dK/dV kernel."""
    return sum(sum(s.bytes_read.get(i, 0) for i in ((BUF_Q, BUF_DOUT) if "_dkv_" in s.kernel else (BUF_K, BUF_V)))
               for s in stats if "_pre_" not in s.kernel)


def _totals(stats) -> tuple[int, int]:
    return sum(s.device_bytes for s in stats), sum(s.mma for s in stats)


def _inputs(L: int, D: int, dtype, grad: bool):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, 1, L, D, generator=g, dtype=torch.float32).to(dtype).requires_grad_(grad)
            for _ in range(3)]


def sliding_window(L: int, window: int, D: int, dtype, L_dense: int) -> list[str]:
    def mask(b, h, q, kv):
        return (q >= kv) & (q - kv < window)

    bm = create_block_mask(mask, 1, 1, L, L, device="cpu")
    density = 1.0 - bm.sparsity() / 100.0
    q, k, v = _inputs(L, D, dtype, True)
    fwd, bwd = _run(lambda: tmf.flex_attention(q, k, v, block_mask=bm), True)
    qd, kd, vd = _inputs(L_dense, D, dtype, True)
    dfwd, dbwd = _run(lambda: tmf.flex_attention(qd, kd, vd), True)
    scale = (L / L_dense) ** 2
    rows = []
    for name, got, dense in (("forward", fwd, dfwd), ("backward (dQ, dK/dV)", bwd, dbwd)):
        dense_bytes = _kv_bytes(dense) * scale
        ratio = _kv_bytes(got) / (density * dense_bytes)
        rows.append(f"| {name} | {L} | {window} | {density:.4f} | {_kv_bytes(got):,} | {dense_bytes:,.0f} | "
                    f"{ratio:.3f} | {'yes' if ratio <= 1.2 else 'NO'} |")
    return rows


def own_block_size(L: int, window: int, D: int, dtype) -> list[str]:
    def mask(b, h, q, kv):
        return (q >= kv) & (q - kv < window)

    q, k, v = _inputs(L, D, dtype, True)
    dense = _run(lambda: tmf.flex_attention(q, k, v), True)
    density = 1.0 - create_block_mask(mask, 1, 1, L, L, device="cpu", BLOCK_SIZE=32).sparsity() / 100.0
    rows = []
    for block in (32, 64):
        q.grad = k.grad = v.grad = None
        bm = create_block_mask(mask, 1, 1, L, L, device="cpu", BLOCK_SIZE=block)
        got = _run(lambda: tmf.flex_attention(q, k, v, block_mask=bm), True)
        for name, g, d in (("forward", got[0], dense[0]), ("backward (dQ, dK/dV)", got[1], dense[1])):
            ratio = _kv_bytes(g) / (density * _kv_bytes(d))
            target = "yes" if ratio <= 1.0 else "NO"
            rows.append(f"| {name} | {block} | {L} | {window} | {density:.4f} | {_kv_bytes(g):,} | {_kv_bytes(d):,} | "
                        f"{_kv_bytes(g) / _kv_bytes(d):.3f} | {ratio:.3f} | "
                        f"{target if block == 32 and name == 'forward' else '-'} |")
    return rows


def causal(L: int, D: int, dtype) -> list[str]:
    bm = create_block_mask(lambda b, h, q, kv: q >= kv, 1, 1, L, L, device="cpu")
    q, k, v = _inputs(L, D, dtype, True)
    flex = _run(lambda: tmf.flex_attention(q, k, v, block_mask=bm), True)
    q2, k2, v2 = _inputs(L, D, dtype, True)
    plain = _run(lambda: tmf.scaled_dot_product_attention(q2, k2, v2, is_causal=True), True)
    rows = []
    for i, name in enumerate(("forward", "backward")):
        fb, fm = _totals(flex[i])
        pb, pm = _totals(plain[i])
        ok = fb <= 1.15 * pb and fm <= 1.15 * pm
        rows.append(f"| {name} | {L} | {fb:,} | {pb:,} | {fb / pb:.3f} | {fm:,} | {pm:,} | {fm / pm:.3f} | "
                    f"{'yes' if ok else 'NO'} |")
    return rows


def _dense(q, k, v, score_mod, block_mask, return_lse):
    """FlexAttention's dense definition (the math of torch's eager flex_attention, which has no CPU backward)."""
    return dense_flex_attention(q, k, v, score_mod, block_mask.mask_mod)


def memory(lengths, window: int, D: int, dtype) -> list[str]:
    H = 2
    rows, last = [], None
    for L in lengths:
        bm = create_block_mask(lambda b, h, q, kv: (q >= kv) & (q - kv < window), 1, 1, L, L, device="cpu")
        q, k, v = _inputs(L, D, dtype, True)
        q, k, v = (t.detach().expand(1, H, L, D).contiguous().requires_grad_() for t in (q, k, v))
        bias = torch.zeros(H, 2 * L - 1, requires_grad=True)

        def score_mod(s, b, h, qi, kv):
            return s + bias[h, qi - kv + L - 1]

        def step(fn):
            def run():
                out, lse = fn(q, k, v, score_mod=score_mod, block_mask=bm, return_lse=True)
                (out.float().square().sum() + lse.sum()).backward()
            return run

        results = sum(t.numel() * t.element_size() for t in (q, k, v, bias)) * 2  # their grads, and out ~ q
        ours = harness.allocations(step(tmf.flex_attention))[0] - results
        dense = harness.allocations(step(_dense))[0] - results
        for t in (q, k, v, bias):
            t.grad = None
        growth = "" if last is None else f"{ours / last:.2f}"
        rows.append(f"| {L} | {ours:,} | {growth} | {dense:,} | {dense / max(ours, 1):.1f} |")
        last = ours
    return rows


def main() -> int:
    ap = harness.parser(__doc__, results=True)
    ap.add_argument("--quick", action="store_true", help="L = 2K window 256 (dense at 512), causal at 512")
    args = ap.parse_args()
    L, L_dense, L_causal = (2048, 512, 512) if args.quick else (8192, 1024, 1024)
    L_memory = (256, 512, 1024) if args.quick else (512, 1024, 2048, 4096)
    D, dtype = 64, torch.float16
    lines = ["# FlexAttention block skipping (emulator byte counts)", "",
             f"`python bench/flex.py{' --quick' if args.quick else ''}`; float16, head dim {D}, B = H = 1, "
             "BlockMask of torch's create_block_mask (128 x 128 blocks).", "",
             "## Sliding window: bytes streamed by the inner loops (K/V; Q/dO for dK/dV)", "",
             "| pass | L | window | block density | flex streamed bytes | dense streamed bytes | flex / (density x dense) "
             "| <= 1.2 |", "|---|---|---|---|---|---|---|---|"]
    with tmf.backend("emulator", strict=True), emulator.settings(checked=True):
        lines += sliding_window(L, 256, D, dtype, L_dense)
        lines += ["", "## Sliding window at the BlockMask's own block size (32): streamed bytes", "",
                  "| pass | BLOCK_SIZE | L | window | density at 32 | flex streamed bytes | dense streamed bytes | "
                  "flex / dense | flex / (density x dense) | forward <= 1.0 |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        lines += own_block_size(L_dense, 48, D, dtype)
        lines += ["", "## Causal: mask_mod against the causal flag", "",
                  "| pass | L | flex bytes | plain bytes | ratio | flex MMAs | plain MMAs | ratio | <= 1.15 |",
                  "|---|---|---|---|---|---|---|---|---|"]
        lines += causal(L_causal, D, dtype)
        lines += ["", f"## Extra memory of a training step (window {128}, learned relative bias, H = 2)", "",
                  "| L | torch_metal_flash bytes | x per doubling | dense definition bytes | ratio |",
                  "|---|---|---|---|---|"]
        lines += memory(L_memory, 128, D, dtype)
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.quick:
        (Path(args.results) / "flex.md").write_text(text)
    return 0 if "| NO |" not in text else 1


if __name__ == "__main__":
    sys.exit(main())
