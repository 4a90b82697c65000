"""Wall-clock and TFLOP/s of forward and forward+backward against torch's SDPA (and MLX's).

On a Mac (the point of it):

    python bench/timing.py                      # MPS: our kernels vs F.scaled_dot_product_attention
    python bench/timing.py --variants           # ... and every forward variant of the tuning space, forced
    python bench/timing.py --commit both        # ... and the effect of the commit after large plans

Each row names the forward and backward kernels in force and why (``tuned``:
the machine's tuning cache, ``default``: the family table; see docs/tuning.md).
With ``mlx`` installed, ``mx.fast.scaled_dot_product_attention`` is timed on the
same problems (forward; MLX's own arrays, evaluated with ``mx.eval``).

Elsewhere it can only exercise the script itself (the reference path on the
CPU times PyTorch, not our kernels), which CI does not do and nobody should quote:

    python bench/timing.py --device cpu --quick

Writes a markdown table to stdout and bench/results/timing_<device>.md, and a
plot bench/results/timing_<device>.png when matplotlib is installed.

``--commit both`` (MPS) also measures the launcher's commit after large plans
(``TORCH_METAL_FLASH_COMMIT``): our forward, forward+backward, and a forward
followed by host work (32 small MPS ops encoded before the sync, where an early
commit lets the GPU start on attention sooner), with the commit off and on.
FLOPs counted as flash-attn does: 4·B·H·Lq·Lk·D forward (halved for causal),
2.5× that for the backward.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

import harness

import torch_metal_flash as tmf

CONFIGS = [  # (B, H, L, D, causal)
    (4, 16, 512, 64, False), (4, 16, 512, 64, True), (2, 16, 1024, 64, True), (1, 16, 2048, 64, True),
    (1, 16, 4096, 64, True), (2, 16, 1024, 128, True), (1, 16, 4096, 128, True), (1, 8, 8192, 128, True),
]
QUICK = [(1, 4, 128, 64, False), (1, 4, 256, 64, True)]


def sync(device: torch.device) -> None:
    if device.type == "mps":
        torch.mps.synchronize()


def seconds(fn, device, repeats: int) -> float:
    fn()
    sync(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def in_force(H, L, D, causal, dtype) -> str:
    """The variants the planner uses for this problem and why (torch_metal_flash.tuning)."""
    cells = []
    for op, part in (("fwd", None), ("bwd", "dq"), ("bwd", "dkv")):
        variant, source = tmf.tuning.choice(op, dtype=dtype, head_dim=D, seqlen_q=L, seqlen_k=L, causal=causal,
                                            part=part)
        cells.append(f"{variant} ({source})")
    return "; ".join(cells)


def mlx_seconds(B, H, L, D, causal, dtype, repeats):
    """MLX's fused attention on the same problem (forward), or None without mlx."""
    try:
        import mlx.core as mx
    except ImportError:
        return None
    mdtype = {torch.float16: mx.float16, torch.bfloat16: mx.bfloat16, torch.float32: mx.float32}[dtype]
    q, k, v = (mx.random.normal((B, H, L, D)).astype(mdtype) for _ in range(3))

    def fwd():
        mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=D ** -0.5, mask="causal" if causal else None))
    return seconds(fwd, torch.device("cpu"), repeats)


def variant_rows(B, H, L, D, causal, dtype, device, repeats) -> list:
    """Our forward with each variant of the tuning space forced (ms, TFLOP/s)."""
    q, k, v = (torch.randn(B, H, L, D, dtype=dtype, device=device) for _ in range(3))
    flops = 4 * B * H * L * L * D * (0.5 if causal else 1.0)
    rows = []
    for variant in tmf.tuning.variants("fwd", dtype=dtype, head_dim=D):
        with tmf.tuning.use("fwd", variant), torch.no_grad():
            t = seconds(lambda: tmf.scaled_dot_product_attention(q, k, v, is_causal=causal), device, repeats)
        rows.append(f"| {B}×{H}×{L}×{D} | {causal} | {variant} | {t * 1e3:.2f} | {flops / t / 1e12:.2f} |")
    return rows


def run_config(B, H, L, D, causal, dtype, device, repeats):
    q, k, v = (torch.randn(B, H, L, D, dtype=dtype, device=device, requires_grad=True) for _ in range(3))
    dout = torch.randn(B, H, L, D, dtype=dtype, device=device)
    flops = 4 * B * H * L * L * D * (0.5 if causal else 1.0)
    rows = {}
    for name, fn in (("ours", tmf.scaled_dot_product_attention), ("torch", F.scaled_dot_product_attention)):
        def fwd():
            with torch.no_grad():
                fn(q, k, v, is_causal=causal)

        def fwd_bwd():
            torch.autograd.grad(fn(q, k, v, is_causal=causal), (q, k, v), dout)
        try:
            t_f, t_fb = seconds(fwd, device, repeats), seconds(fwd_bwd, device, repeats)
        except RuntimeError as exc:  # e.g. the O(L²) math path running out of memory
            rows[name] = (None, None, str(exc).splitlines()[0])
            continue
        rows[name] = (t_f, t_fb, "")
    return flops, rows


def set_commit(on: bool) -> bool:
    """Turn the launcher's commit after large plans on or off (same threshold); returns the previous state."""
    from torch_metal_flash import native
    ext = native.launcher()
    enabled, threads = ext.commit_policy()
    ext.set_commit(on, threads)
    return enabled


def commit_rows(B, H, L, D, causal, dtype, device, repeats) -> str:
    """Our forward, forward+backward and forward-then-host-work, commit off | on (ms)."""
    q, k, v = (torch.randn(B, H, L, D, dtype=dtype, device=device, requires_grad=True) for _ in range(3))
    dout = torch.randn(B, H, L, D, dtype=dtype, device=device)
    x = torch.randn(256, 256, device=device)

    def fwd():
        with torch.no_grad():
            tmf.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def fwd_bwd():
        torch.autograd.grad(tmf.scaled_dot_product_attention(q, k, v, is_causal=causal), (q, k, v), dout)

    def fwd_then_host_work():
        fwd()
        y = x
        for _ in range(32):
            y = y * 1.0001
    cells = []
    before = set_commit(False)
    for fn in (fwd, fwd_bwd, fwd_then_host_work):
        for on in (False, True):
            set_commit(on)
            cells.append(f"{seconds(fn, device, repeats) * 1e3:.2f}")
    set_commit(before)
    return f"| {B}×{H}×{L}×{D} | {causal} | " + " | ".join(cells) + " |"


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--device", default="mps" if torch.backends.mps.is_available() else "cpu")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--variants", action="store_true", help="also time every forward variant, forced")
    ap.add_argument("--commit", default="on", choices=["on", "both"],
                    help="'both': also time our kernels with the commit after large plans off and on (MPS)")
    args = ap.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    lines = [f"# Timing on {device.type} ({args.dtype}), best of {args.repeats}\n",
             f"`python bench/timing.py --device {args.device} --dtype {args.dtype}`"
             + (" (reference path on the CPU: not our kernels)" if device.type != "mps" else "") + "\n",
             "| B×H×L×D | causal | ours fwd ms | torch fwd ms | ours fwd TFLOP/s | torch fwd TFLOP/s "
             "| ours fwd+bwd ms | torch fwd+bwd ms | ours fwd+bwd TFLOP/s | torch fwd+bwd TFLOP/s "
             "| MLX fwd ms | MLX fwd TFLOP/s | our kernels (why) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    plot = []
    for B, H, L, D, causal in (QUICK if args.quick else CONFIGS):
        flops, rows = run_config(B, H, L, D, causal, dtype, device, args.repeats)
        cells = []
        for col in (0, 1):
            for name in ("ours", "torch"):
                t = rows[name][col]
                cells.append("—" if t is None else f"{t * 1e3:.2f}")
            for name in ("ours", "torch"):
                t = rows[name][col]
                work = flops * (1.0 if col == 0 else 3.5)
                cells.append("—" if t is None else f"{work / t / 1e12:.2f}")
        t_mlx = mlx_seconds(B, H, L, D, causal, dtype, args.repeats) if device.type == "mps" else None
        cells += ["—", "—"] if t_mlx is None else [f"{t_mlx * 1e3:.2f}", f"{flops / t_mlx / 1e12:.2f}"]
        cells.append(in_force(H, L, D, causal, dtype))
        lines.append(f"| {B}×{H}×{L}×{D} | {causal} | " + " | ".join(cells) + " |")
        plot.append((f"{L}/{D}{'c' if causal else ''}", rows))
        print(lines[-1], flush=True)
    if args.variants:
        lines += ["", "## Every forward variant, forced (docs/tuning.md)", "",
                  "| B×H×L×D | causal | variant | fwd ms | fwd TFLOP/s |", "|---|---|---|---|---|"]
        for B, H, L, D, causal in (QUICK if args.quick else CONFIGS):
            lines += variant_rows(B, H, L, D, causal, dtype, device, args.repeats)
            print("\n".join(lines[-3:]), flush=True)
    if args.commit == "both" and device.type == "mps":
        lines += ["", "## Commit after large plans (ms, commit off | on)", "",
                  "| B×H×L×D | causal | fwd off | fwd on | fwd+bwd off | fwd+bwd on | fwd + host work off "
                  "| fwd + host work on |", "|---|---|---|---|---|---|---|---|"]
        for B, H, L, D, causal in (QUICK if args.quick else CONFIGS):
            lines.append(commit_rows(B, H, L, D, causal, dtype, device, args.repeats))
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    out_dir = harness.write_result(f"timing_{device.type}.md", text).parent
    print(text)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    for i, name in enumerate(("ours", "torch")):
        ms = [(r[name][1] or 0) * 1e3 for _, r in plot]
        ax.bar([x + 0.4 * i for x in range(len(plot))], ms, width=0.4, label=f"{name} fwd+bwd")
    ax.set_xticks([x + 0.2 for x in range(len(plot))], [label for label, _ in plot], rotation=30)
    ax.set_ylabel("ms (lower is better)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / f"timing_{device.type}.png")


if __name__ == "__main__":
    main()
