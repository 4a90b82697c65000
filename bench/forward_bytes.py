"""Device traffic, threadgroup memory and MMA coverage of the forward kernels,
measured in the emulator (checked mode counts every device byte exactly).

    python bench/forward_bytes.py   # prints markdown; writes bench/results/forward_bytes.{md,svg}

Per configuration:
* bytes read / written by the kernel, per tensor, from the emulator's stats
  (the params struct in the constant buffer is left out: it is a few hundred
  bytes the GPU keeps in its constant cache, the emulator counts every field
  access);
* compulsory bytes: Q, K, V (and the mask's distinct bytes, when there is
  one) read once, O and LSE written once;
* the ratio of the two.  FlashAttention-2 re-reads K and V once per query
  block of BQ rows (per query head), so the ratio grows like
  ~Lq / BQ * (K+V) / total; on the GPU those re-reads mostly hit the cache;
* threadgroup memory per threadgroup;
* 8x8 simdgroup multiplies and the FMA work they cover, against the QK^T and
  PV FMAs the problem needs (only visible (i, j) pairs).  Every QK^T and PV
  FMA of the kernel is done by simdgroup-matrix multiplies (there is no
  scalar path for them), so the MMA share is 100%; "MMA FMAs / needed" shows
  the padding overhead (head-dim tail, partial blocks, masked parts of blocks
  on the band's edge).
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

import harness

import torch_metal_flash as tmf
from torch_metal_flash import emulator
from torch_metal_flash.planner import forward_variants
from torch_metal_flash.problem.spec import make_spec
from support import forward_cases as fc

DT = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}

# name, dtype, B, Hq, Hkv, Lq, Lk, D, layout, extra spec kwargs, mask maker
CONFIGS = [
    ("plain", "f16", 1, 4, 4, 256, 256, 64, "bhld", {}, None),
    ("causal", "f16", 1, 4, 4, 256, 256, 64, "bhld", dict(window_right=0), None),
    ("causal d128 L512", "f16", 1, 4, 4, 512, 512, 128, "bhld", dict(window_right=0), None),
    ("plain fp32", "f32", 1, 4, 4, 256, 256, 64, "bhld", {}, None),
    ("GQA 8:2 (B,L,H,D)", "bf16", 1, 8, 2, 256, 256, 128, "blhd", {}, None),
    ("d256", "f16", 1, 2, 2, 256, 256, 256, "bhld", {}, None),
    ("d320 (bucket 384)", "f16", 1, 2, 2, 256, 256, 320, "bhld", {}, None),
    ("d512", "f16", 1, 2, 2, 256, 256, 512, "bhld", {}, None),
    ("d512 fp32 causal", "f32", 1, 2, 1, 128, 256, 512, "bhld", dict(window_right=0), None),
    ("d72 (tail)", "f16", 1, 4, 4, 256, 256, 72, "bhld", {}, None),
    ("decode 1x1024 GQA 8:1", "f16", 1, 8, 1, 1, 1024, 128, "bhld", {}, None),
    ("window 64, L512", "f16", 1, 4, 4, 512, 512, 64, "bhld", dict(window_left=64, window_right=0), None),
    ("bool mask (B,1,L,L)", "f16", 1, 4, 4, 256, 256, 64, "bhld", {},
     lambda g, B, H, Lq, Lk: torch.rand(B, 1, Lq, Lk, generator=g) > 0.5),
    ("float bias (1,H,1,L)", "f16", 1, 4, 4, 256, 256, 64, "bhld", {},
     lambda g, B, H, Lq, Lk: torch.randn(1, H, 1, Lk, generator=g).half()),
]


def _distinct_bytes(t: torch.Tensor) -> int:
    """Bytes of memory a (possibly broadcast) view covers: its non-broadcast extent."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size()


def _visible_pairs(spec) -> int:
    i = torch.arange(spec.seqlen_q).unsqueeze(-1)
    j = torch.arange(spec.seqlen_k)
    vis = spec.visible(i, j).expand(spec.batch, spec.heads, -1, -1)
    if spec.mask is not None and spec.mask.dtype == torch.bool:
        vis = vis & spec.mask
    return int(vis.sum())


def measure(name, dt, B, Hq, Hkv, Lq, Lk, D, layout, kw, mask_fn):
    g = torch.Generator().manual_seed(0)
    dtype = DT[dt]

    def rnd(*s):
        return torch.randn(*s, generator=g).to(dtype)

    if layout == "blhd":
        q, k, v = (rnd(B, L, H, D).transpose(1, 2) for L, H in ((Lq, Hq), (Lk, Hkv), (Lk, Hkv)))
    else:
        q, k, v = rnd(B, Hq, Lq, D), rnd(B, Hkv, Lk, D), rnd(B, Hkv, Lk, D)
    mask = mask_fn(g, B, Hq, Lq, Lk) if mask_fn else None
    spec = make_spec(q, k, v, mask=mask, scale=D ** -0.5, **kw)
    tile = fc.tile_for(spec)
    t0 = time.time()
    st = fc.build_stats_for(spec, checked=True)
    secs = time.time() - t0
    rd, wr = st["bytes_read"], st["bytes_written"]
    es = q.element_size()
    params = rd.get(5, 0)
    read = sum(b for i, b in rd.items() if i != 5)
    written = sum(b for i, b in wr.items() if i != 5)
    comp_read = (q.numel() + k.numel() + v.numel()) * es + (_distinct_bytes(spec.mask) if mask is not None else 0)
    comp_write = q.numel() * es + B * Hq * Lq * 4
    mma = st["simdgroup_matrix_multiplies"]
    needed = _visible_pairs(spec) * (D + D)
    return dict(
        name=name, kernel=tile.kernel, dtype=dt, shape=f"{B}x{Hq}:{Hkv}x{Lq}x{Lk}x{D}",
        tg=st["threadgroup_memory"], read=read, written=written, kv_read=rd.get(1, 0) + rd.get(2, 0),
        comp=comp_read + comp_write, ratio=(read + written) / (comp_read + comp_write),
        read_ratio=read / comp_read, kv_ratio=(rd.get(1, 0) + rd.get(2, 0)) / ((k.numel() + v.numel()) * es),
        write_ratio=written / comp_write, params=params, mma=mma,
        mma_cover=(mma * 512) / needed if needed else float("nan"), secs=secs)


def variant_table() -> list[dict]:
    rows = []
    for t in forward_variants():
        dtype = {"f32": "f32", "f16": "f16", "bf16": "bf16"}[t.dtype]
        case = dict(dtype=dtype, d=t.bd, lq=8, lk=8, masking="none", hq=1, hkv=1, feature="none",
                    layout="bhld", batch=1)
        family = fc.tile_family(t)  # the accelerator tiles run planned as apple10
        with emulator.settings(family=family), tmf.tuning.use("fwd", t.kernel):  # every tile, each forced
            st = fc.build_stats_for(fc.build_spec(case), checked=False, family=family)
        rows.append(dict(kernel=t.kernel, bq=t.bq, bk=t.bk, sg=t.simdgroups, threads=t.threads,
                         table=t.threadgroup_memory, measured=st["threadgroup_memory"]))
    return rows


def write_svg(rows: list[dict], path: Path) -> None:
    """A dependency-free bar chart of (read + written) / compulsory per configuration."""
    bar_h, gap, left, width = 18, 6, 190, 420
    top = max(r["ratio"] for r in rows) * 1.1
    height = len(rows) * (bar_h + gap) + 50
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 60}" height="{height}" '
             'font-family="sans-serif" font-size="12">',
             f'<text x="{left}" y="16" font-weight="bold">forward: device bytes / compulsory bytes (emulator)</text>']
    for n, r in enumerate(rows):
        y = 30 + n * (bar_h + gap)
        w = width * r["ratio"] / top
        parts.append(f'<text x="{left - 6}" y="{y + 13}" text-anchor="end">{r["name"]}</text>')
        parts.append(f'<rect x="{left}" y="{y}" width="{w:.1f}" height="{bar_h}" fill="#4a7ab5"/>')
        parts.append(f'<text x="{left + w + 4:.1f}" y="{y + 13}">{r["ratio"]:.2f}</text>')
    parts.append("</svg>")
    path.write_text("\n".join(parts) + "\n")


def main() -> None:
    t_start = time.time()
    lines = ["# Forward kernels: device bytes, threadgroup memory, MMA coverage (emulator)", "",
             "Generated by `python bench/forward_bytes.py` (checked mode: exact byte counts).", "",
             "## Per configuration", "",
             "| config | kernel | B x Hq:Hkv x Lq x Lk x D | TG mem (B) | read (B) | written (B) | compulsory (B) "
             "| (read+written)/compulsory | read/compulsory read | K+V read / K+V size | written/compulsory "
             "| 8x8 MMAs | MMA FMAs / needed QK+PV FMAs | emulator s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    measured = []
    for cfg in CONFIGS:
        r = measure(*cfg)
        measured.append(r)
        lines.append(f"| {r['name']} | `{r['kernel']}` | {r['shape']} | {r['tg']} | {r['read']} | {r['written']} | "
                     f"{r['comp']} | {r['ratio']:.2f} | {r['read_ratio']:.2f} | {r['kv_ratio']:.2f} | "
                     f"{r['write_ratio']:.3f} | {r['mma']} | {r['mma_cover']:.2f} | {r['secs']:.1f} |")
        print(lines[-1], flush=True)
    lines += ["", "All QK^T and PV multiply-adds run on 8x8 simdgroup-matrix multiplies (MMA share 100%: the "
              "kernel has no scalar path for them); the MMA/needed column is the padding overhead. "
              "The params struct (constant buffer) is excluded from the byte counts.", "",
              "## Threadgroup memory per variant", "",
              "| kernel | BQ | BK | simdgroups | threads | TG mem, table (B) | TG mem, emulator (B) |",
              "|---|---|---|---|---|---|---|"]
    for r in variant_table():
        lines.append(f"| `{r['kernel']}` | {r['bq']} | {r['bk']} | {r['sg']} | {r['threads']} | {r['table']} | "
                     f"{r['measured']} |")
    lines += ["", f"Total emulator time: {time.time() - t_start:.0f} s.", ""]
    text = "\n".join(lines)
    print(text)
    out = harness.write_result("forward_bytes.md", text)
    write_svg(measured, out.with_suffix(".svg"))


if __name__ == "__main__":
    main()
