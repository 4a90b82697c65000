"""TFLOP/s of our kernels, stock torch's SDPA and MLX's on a standard grid, forward and forward + backward.

On a Mac (the point of it):

    python bench/timing.py                      # MPS: the standard grid, fp16 and bf16
    python bench/timing.py --dtypes float16 --lengths 1024,4096
    python bench/timing.py --variants           # ... and every forward variant of the tuning space, forced
    python bench/timing.py --commit both        # ... and the effect of the launcher's commits

The standard grid follows flash-attn's benchmark: 16K tokens per batch (B = 16384 / L), a model
width of 2048 (H = 2048 / D), L 512 to 16K, D 64 and 128, causal and not, fp16 and bf16; each
problem forward and forward + backward.  Routes: ``kernels`` (our kernels, whatever route the
tuning cache gives the class: ``tmf.scaled_dot_product_attention``'s kernels), ``torch``
(``F.scaled_dot_product_attention``) and ``mlx`` (``mx.fast.scaled_dot_product_attention``, when
``mlx`` is installed; its own arrays, evaluated with ``mx.eval``).  The ``route`` column says
which one ``tmf.scaled_dot_product_attention`` takes for the class (docs/tuning.md).

    python bench/timing.py --dry-run            # anywhere: the same table and plot from the emulator

``--dry-run`` runs the same code with the emulator's timings (our kernels on the CPU, torch's CPU
SDPA) on a small grid (B 1, H 2, L 64-256, D 64, fp16), labelled as such: it exercises the
script, its table and its plot; its figures say nothing about a GPU.  A Mac run differs only in
the device and the timer.

Writes markdown to bench/results/timing_<device>.md and a plot of TFLOP/s against L per route
(one panel per head dim, mode and causality) to bench/results/timing_<device>.png; the plot needs
matplotlib (the ``plot`` extra: ``pip install "torch_metal_flash[plot]"``).

``--commit both`` (MPS) also measures the launcher's commits (adaptive after each plan, and after large plans
with TORCH_METAL_FLASH_COMMIT_THREADS)
(``TORCH_METAL_FLASH_COMMIT``): our forward, forward+backward, and a forward
followed by host work (32 small MPS ops encoded before the sync, where an early
commit lets the GPU start on attention sooner), with the commit off and on.
FLOPs counted as flash-attn does: 4·B·H·Lq·Lk·D forward (halved for causal),
2.5× that for the backward (3.5× for forward + backward).
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn.functional as F

import harness

import torch_metal_flash as tmf

LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)
DRY_LENGTHS = (64, 128, 256)
ROUTES = ("kernels", "torch", "mlx")
MODES = ("fwd", "fwd+bwd")


def grid(lengths, head_dims, dtypes, dry_run: bool) -> list:
    """(B, H, L, D, causal, dtype) of the standard grid (16K tokens, width 2048), or the dry run's."""
    return [(1, 2, L, D, c, dt) if dry_run else (max(1, 16384 // L), 2048 // D, L, D, c, dt)
            for dt in dtypes for D in head_dims for c in (False, True) for L in lengths]


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
    """MLX's fused attention on the same problem: (forward, forward + backward) seconds, or None without mlx."""
    try:
        import mlx.core as mx
    except ImportError:
        return None
    mdtype = {torch.float16: mx.float16, torch.bfloat16: mx.bfloat16, torch.float32: mx.float32}[dtype]
    q, k, v = (mx.random.normal((B, H, L, D)).astype(mdtype) for _ in range(3))
    dout = mx.random.normal((B, H, L, D)).astype(mdtype)

    def attention(q, k, v):
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=D ** -0.5, mask="causal" if causal else None)

    def fwd():
        mx.eval(attention(q, k, v))

    def fwd_bwd():
        mx.eval(mx.vjp(attention, [q, k, v], [dout])[1])
    return seconds(fwd, torch.device("cpu"), repeats), seconds(fwd_bwd, torch.device("cpu"), repeats)


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


def run_config(B, H, L, D, causal, dtype, device, repeats) -> dict:
    """{route: (forward seconds, forward + backward seconds) or None (not installed) or the error}."""
    from torch_metal_flash.faces.functional import kernels_sdpa
    q, k, v = (torch.randn(B, H, L, D, dtype=dtype, device=device, requires_grad=True) for _ in range(3))
    dout = torch.randn(B, H, L, D, dtype=dtype, device=device)
    out = {}
    for name, fn in (("kernels", kernels_sdpa), ("torch", F.scaled_dot_product_attention)):
        def fwd():
            with torch.no_grad():
                fn(q, k, v, is_causal=causal)

        def fwd_bwd():
            torch.autograd.grad(fn(q, k, v, is_causal=causal), (q, k, v), dout)
        try:
            out[name] = (seconds(fwd, device, repeats), seconds(fwd_bwd, device, repeats))
        except RuntimeError as exc:  # e.g. the O(L²) math path running out of memory
            out[name] = str(exc).splitlines()[0]
    out["mlx"] = mlx_seconds(B, H, L, D, causal, dtype, repeats) if device.type == "mps" else None
    return out


def route_of(q_shape, L, D, causal, dtype, device) -> str:
    """The route tmf.scaled_dot_product_attention takes for the class (forward; fwd+bwd)."""
    from torch_metal_flash.faces import stock
    q = torch.empty(q_shape, dtype=dtype, device=device)
    routes = []
    for grad in (False, True):
        q.requires_grad_(grad)
        routes.append("torch" if stock.takes_torch(None, q, q, q, None, 0.0, causal) else "kernels")
    return "; ".join(routes)


def tflops(B, H, L, D, causal, mode, t) -> float:
    return 4 * B * H * L * L * D * (0.5 if causal else 1.0) * (3.5 if mode == "fwd+bwd" else 1.0) / t / 1e12


def plot(points, path, title) -> bool:
    """TFLOP/s against L per route, one panel per (dtype, D, mode, causal); False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = sorted({p[:4] for p in points}, key=str)
    cols = min(4, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        for route in ROUTES:
            xs = [(p[4], p[6]) for p in points if p[:4] == panel and p[5] == route]
            if xs:
                ax.plot([x for x, _ in xs], [y for _, y in xs], marker="o", label=route)
        dtype, D, mode, causal = panel
        ax.set_title(f"{dtype} d{D} {mode}{' causal' if causal else ''}", fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("L")
        ax.set_ylabel("TFLOP/s")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True


def set_commit(on: bool) -> bool:
    """Turn the launcher's commits on or off (same threshold); returns the previous state."""
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
    ap = harness.parser(__doc__, results=True)
    ap.add_argument("--device", default="mps" if torch.backends.mps.is_available() else "cpu")
    ap.add_argument("--dtypes", default="float16,bfloat16", help="comma-separated: float16,bfloat16,float32")
    ap.add_argument("--lengths", default=None, help="comma-separated sequence lengths (default 512 ... 16384)")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--dry-run", action="store_true", help="the emulator's timings on a small grid (any machine)")
    ap.add_argument("--variants", action="store_true", help="also time every forward variant, forced")
    ap.add_argument("--commit", default="on", choices=["on", "both"],
                    help="'both': also time our kernels with the launcher's commits off and on (MPS)")
    args = ap.parse_args()
    if args.dry_run:
        device, dtypes, head_dims, repeats = torch.device("cpu"), [torch.float16], [64], min(args.repeats, 2)
        lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else DRY_LENGTHS
        backend = "emulator"
        label = "emulator (dry run: our kernels on the CPU, torch's CPU SDPA; NOT a GPU measurement)"
    else:
        device, repeats = torch.device(args.device), args.repeats
        dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
        head_dims = [int(d) for d in args.head_dims.split(",")]
        lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else LENGTHS
        backend, label = "auto", device.type
    name = "emulator" if args.dry_run else device.type
    command = "python bench/timing.py " + ("--dry-run" if args.dry_run else
                                           f"--device {args.device} --dtypes {args.dtypes}")
    lines = [f"# Attention TFLOP/s on {label}, best of {repeats}\n", f"`{command}`\n",
             "TFLOP/s as flash-attn counts (4·B·H·L²·D forward, halved when causal; 3.5× that for forward + "
             "backward). kernels: our kernels; torch: `F.scaled_dot_product_attention`; mlx: "
             "`mx.fast.scaled_dot_product_attention` (— when not installed); route: what "
             "`tmf.scaled_dot_product_attention` takes for the class (forward; forward + backward).\n",
             harness.row("dtype", "B×H×L×D", "causal", *(f"{r} {m}" for m in MODES for r in ROUTES), "route",
                         "our kernels (why)"),
             "|" + "---|" * (5 + len(MODES) * len(ROUTES))]
    points = []
    with tmf.backend(backend):
        for B, H, L, D, causal, dtype in grid(lengths, head_dims, dtypes, args.dry_run):
            timings = run_config(B, H, L, D, causal, dtype, device, repeats)
            cells = []
            for i, mode in enumerate(MODES):
                for route in ROUTES:
                    t = timings[route]
                    if isinstance(t, tuple):
                        rate = tflops(B, H, L, D, causal, mode, t[i])
                        points.append((str(dtype)[6:], D, mode, causal, L, route, rate))
                        cells.append(f"{rate:.3g}")
                    else:
                        cells.append("—" if t is None else f"error: {t[:60]}")
            lines.append(harness.row(str(dtype)[6:], f"{B}×{H}×{L}×{D}", causal, *cells,
                                     route_of((B, H, L, D), L, D, causal, dtype, device),
                                     in_force(H, L, D, causal, dtype)))
            print(lines[-1], flush=True)
        if args.variants and not args.dry_run:
            lines += ["", "## Every forward variant, forced (docs/tuning.md)", "",
                      "| B×H×L×D | causal | variant | fwd ms | fwd TFLOP/s |", "|---|---|---|---|---|"]
            for B, H, L, D, causal, dtype in grid(lengths, head_dims, dtypes, False):
                lines += variant_rows(B, H, L, D, causal, dtype, device, repeats)
        if args.commit == "both" and device.type == "mps":
            lines += ["", "## The launcher's commits (ms, commits off | on)", "",
                      "| B×H×L×D | causal | fwd off | fwd on | fwd+bwd off | fwd+bwd on | fwd + host work off "
                      "| fwd + host work on |", "|---|---|---|---|---|---|---|---|"]
            for B, H, L, D, causal, dtype in grid(lengths, head_dims, dtypes, False):
                lines.append(commit_rows(B, H, L, D, causal, dtype, device, repeats))
    png = Path(args.results) / f"timing_{name}.png"
    png.parent.mkdir(parents=True, exist_ok=True)
    if plot(points, png, f"TFLOP/s on {label}"):
        lines += ["", f"![TFLOP/s against L per route](timing_{name}.png)"]
    else:
        lines += ["", "(no plot: matplotlib is not installed; `pip install \"torch_metal_flash[plot]\"`)"]
    text = "\n".join(lines) + "\n"
    harness.write_result(f"timing_{name}.md", text, args.results)
    print(text)


if __name__ == "__main__":
    main()
