"""Device bytes moved by the decode kernels relative to the compulsory minimum.

Runs ``flash_attn_with_kvcache``'s kernels (split-K partial + combine, through
``plan_decode``) in the emulator's checked mode, whose byte counters are exact,
and divides the device bytes read + written by all launches by the compulsory
bytes: q, the L rows of K and V of every KV head, out and lse, once each.
The "append" rows run a whole decode step (``plan_kvcache``: the append kernel
writes one new token, with rotary over the full head dim, then the decode
kernels attend to all L keys); their compulsory bytes add the new k/v rows read
and written once and the rotary table row.
Target: <= 1.1 at B=1, H=32, H_kv=8, D=128, L=4096, one query row.

Quantized caches (affine 4/8-bit, symmetric int8): compulsory counts the
packed values, scales and biases of the visible rows once; target <= 1.1 at the same
shape.  Latent attention (K 576 / V 512, 16 query heads on one KV head) at L >= 4096:
target <= 1.1 with 4 query rows, <= 1.15 on a 4-bit cache (the split heuristic weighs the
float32 partials against the K/V bytes).  The quantized rows also give the cache's bytes
per token (K and V of every KV head) against float16, and a second table reports the quantization error itself -- kept out
of the kernels' accuracy budget, which the tests judge on the dequantized cache:
max |x - x_hat| over the cache, and how far the attention output on the quantized
cache is from the output on the float16 cache (float64 math, one decode step).

    python bench/decode_bytes.py                 # L = 512 ... 8192 (fp16)
    python bench/decode_bytes.py --lengths 512,1024,2048,4096,8192,16384,32768
    python bench/decode_bytes.py --quick         # the target row only
    python bench/decode_bytes.py --mps           # macOS: decode steps/s vs F.scaled_dot_product_attention

Writes the table to stdout and to bench/results/decode_bytes.md.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

import harness

from torch_metal_flash import emulator
from torch_metal_flash.backends.emulator import EmulatorBackend
from torch_metal_flash.planner.decode import DecodeProblem, compulsory_bytes, plan_decode
from torch_metal_flash.planner.kvcache import KvCacheProblem, plan_kvcache
from torch_metal_flash.planner.kvformat import row_bytes
from torch_metal_flash.problem.quant import quantize

FORMATS = {"affine4 g64": dict(bits=4, group_size=64), "affine8 g64": dict(bits=8, group_size=64),
           "int8 g32": dict(bits=8, group_size=32, mode="symmetric"), "affine4 g32": dict(bits=4, group_size=32)}


def _fmt_name(quant):
    return next((n for n, f in FORMATS.items() if f == quant), str(quant)) if quant else None


def measure(B=1, H=32, Hkv=8, D=128, L=4096, Lq=1, dtype=torch.float16, num_splits=0, paged=None, append=False,
            seed=0, quant=None, Dv=None):
    Dv = Dv or D  # v's head dim (latent attention: 512 under D = 576)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Lq, H, D, generator=g).to(dtype)
    if paged:
        nblk = B * (-(-L // paged))
        kc = torch.randn(nblk, paged, Hkv, D, generator=g).to(dtype)
        vc = torch.randn(nblk, paged, Hkv, Dv, generator=g).to(dtype)
        bt = torch.randperm(nblk, generator=g).reshape(B, -1).to(torch.int32)
    else:
        kc = torch.randn(B, L, Hkv, D, generator=g).to(dtype)
        vc = torch.randn(B, L, Hkv, Dv, generator=g).to(dtype)
        bt = None
    dense_token = Hkv * (D + Dv) * 2  # K and V of one token in float16
    if quant is not None:
        kc, vc = quantize(kc, **quant), quantize(vc, **quant)
    token_bytes = Hkv * (row_bytes(kc) + row_bytes(vc))
    out = torch.empty(B, Lq, H, Dv, dtype=dtype)
    lse = torch.empty(B, H, Lq, dtype=torch.float32)
    pb = DecodeProblem(q=q.transpose(1, 2), k_cache=kc, v_cache=vc, out=out.transpose(1, 2), lse=lse,
                       seqlens=torch.full((B,), L, dtype=torch.int32), seqlen_fixed=0, leftpad=None, batch_idx=None,
                       block_table=bt, alibi_slopes=None, scale=D ** -0.5, window_left=-1,
                       window_right=0, softcap=0.0)
    plan = plan_decode(pb, num_splits=num_splits)
    need = compulsory_bytes(pb)
    if append:  # the last key is appended by this call, rotated at position L - 1
        k, v = (torch.randn(B, 1, Hkv, d, generator=g).to(dtype) for d in (D, Dv))
        cos, sin = (torch.randn(L, D // 2, generator=g).to(dtype) for _ in range(2))
        plan = plan_kvcache(KvCacheProblem(q, kc, vc, k, v, cos, sin, torch.full((B,), L - 1, dtype=torch.int32),
                                           None, None, bt, None, 0, D ** -0.5, -1, 0, 0.0, False, num_splits),
                            out, lse)
        need += k.nbytes + v.nbytes + B * token_bytes + B * D * cos.element_size()
    backend = EmulatorBackend()
    t = time.time()
    with emulator.settings(checked=True):
        backend.run(plan)
    secs = time.time() - t
    moved = sum(s.device_bytes for s in backend.last_stats)
    splits = next(la for la in plan.launches if la.source == "flash_decode.metal").threadgroups[0]
    return dict(B=B, H=H, Hkv=Hkv, D=D if Dv == D else f"{D}/{Dv}", L=L, Lq=Lq, dtype=str(dtype).replace("torch.", ""), paged=paged or "-",
                append="1 + rotary" if append else "-", kv=_fmt_name(quant) or "plain",
                token=f"{token_bytes} ({token_bytes / dense_token:.3f}x)",
                splits=splits, launches=len(plan.launches), moved=moved, compulsory=need, ratio=moved / need,
                seconds=secs)


def quantization_error(quant, B=1, H=32, Hkv=8, D=128, L=4096, seed=0) -> dict:
    """The error quantization itself adds (no kernel involved): on a float16 cache of
    standard-normal rows, max |x - x_hat|, and the attention output of one decode
    query row over the dequantized cache against the float16 cache (float64 math)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, 1, D, generator=g).double()
    kc, vc = (torch.randn(B, Hkv, L, D, generator=g).half() for _ in range(2))
    kq, vq = quantize(kc, **quant).dequantize(), quantize(vc, **quant).dequantize()

    def attend(k, v):
        k, v = (t.double().repeat_interleave(H // Hkv, 1) for t in (k, v))
        return torch.softmax(q @ k.transpose(-1, -2) * D ** -0.5, -1) @ v
    ref = attend(kc, vc)
    return dict(kv=_fmt_name(quant), x_err=float((kq.float() - kc.float()).abs().max()),
                out_err=float((attend(kq, vq) - ref).abs().max()), out_scale=float(ref.abs().max()))


def time_mps(lengths, B=1, H=32, Hkv=8, D=128, dtype=torch.float16, iters=200) -> list[str]:
    """macOS only: one decode step (append 1 token + attend) per call, ours vs torch's SDPA
    on the same cache (SDPA reads the valid prefix of the cache through enable_gqa)."""
    import torch.nn.functional as F

    from torch_metal_flash import backend, flash_attn_with_kvcache

    dev = torch.device("mps")
    lines = ["| L | ours steps/s | SDPA steps/s | speed-up |", "|---|---|---|---|"]
    for L in lengths:
        q = torch.randn(B, 1, H, D, device=dev, dtype=dtype)
        kc = torch.randn(B, L + 1, Hkv, D, device=dev, dtype=dtype)
        vc = torch.randn_like(kc)
        kn, vn = torch.randn(B, 1, Hkv, D, device=dev, dtype=dtype), torch.randn(B, 1, Hkv, D, device=dev, dtype=dtype)
        seqlens = torch.full((B,), L, dtype=torch.int32, device=dev)

        def ours():
            with backend("metal", strict=True):
                flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens, causal=True)

        def sdpa():
            kc[:, L:L + 1] = kn
            vc[:, L:L + 1] = vn
            F.scaled_dot_product_attention(q.transpose(1, 2), kc[:, :L + 1].transpose(1, 2),
                                           vc[:, :L + 1].transpose(1, 2), enable_gqa=True)

        rates = []
        for fn in (ours, sdpa):
            for _ in range(10):
                fn()
            torch.mps.synchronize()
            t = time.perf_counter()
            for _ in range(iters):
                fn()
            torch.mps.synchronize()
            rates.append(iters / (time.perf_counter() - t))
        line = f"| {L} | {rates[0]:.0f} | {rates[1]:.0f} | {rates[0] / rates[1]:.2f}x |"
        print(line, flush=True)
        lines.append(line)
    return lines


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--lengths", default="512,1024,2048,4096,8192")
    ap.add_argument("--quick", action="store_true", help="only the target configuration (L=4096)")
    ap.add_argument("--out", default=str(harness.RESULTS / "decode_bytes.md"))
    ap.add_argument("--mps", action="store_true", help="macOS: time decode steps against torch's SDPA")
    args = ap.parse_args()
    if args.mps:
        lines = time_mps([int(x) for x in args.lengths.split(",")])
        out = Path(args.out).with_name("decode_mps.md")
        out.write_text("# Decode steps per second on MPS (B=1, H=32, H_kv=8, D=128, fp16)\n\n" + "\n".join(lines) + "\n")
        print(f"\nwritten to {out}")
        return
    rows = []
    quant_targets = [dict(L=4096, quant=FORMATS[n]) for n in ("affine4 g64", "affine8 g64", "int8 g32")]
    configs = [dict(L=4096)] + quant_targets if args.quick else [dict(L=int(x)) for x in args.lengths.split(",")]
    if not args.quick:
        configs += [dict(L=4096, Lq=5), dict(L=4096, num_splits=1), dict(L=4096, num_splits=16),
                    dict(L=4096, paged=256), dict(L=4096, dtype=torch.float32), dict(L=4096, dtype=torch.bfloat16),
                    dict(L=4096, H=32, Hkv=32), dict(L=4096, H=32, Hkv=1), dict(L=2048, B=4),
                    dict(L=4096, append=True), dict(L=4096, append=True, paged=256)]
        configs += quant_targets + [dict(L=4096, quant=FORMATS["affine4 g32"]),
                                    dict(L=4096, quant=FORMATS["affine4 g64"], dtype=torch.bfloat16),
                                    dict(L=4096, quant=FORMATS["affine4 g64"], paged=256),
                                    dict(L=4096, quant=FORMATS["affine4 g64"], Lq=5),
                                    dict(L=4096, quant=FORMATS["affine4 g64"], append=True),
                                    dict(L=4096, quant=FORMATS["int8 g32"], append=True, paged=256)]
        # multi-head latent attention (DeepSeek): K 576 / V 512, 16 query heads on one KV head
        mla = dict(H=16, Hkv=1, D=576, Dv=512)
        configs += [dict(L=4096, **mla), dict(L=8192, **mla), dict(L=4096, Lq=4, **mla), dict(L=8192, Lq=4, **mla),
                    dict(L=4096, paged=64, **mla), dict(L=4096, append=True, **mla),
                    dict(L=4096, quant=FORMATS["affine4 g64"], **mla),
                    dict(L=8192, quant=FORMATS["affine4 g64"], **mla)]
    lines = harness.table_head("B", "H", "H_kv", "D", "L", "q rows", "dtype", "K/V", "bytes/token (vs fp16)", "paged",
                               "append", "splits", "launches", "device bytes", "compulsory", "ratio", "emulator s")
    print(lines[0])
    for cfg in configs:
        r = measure(**cfg)
        rows.append(r)
        line = harness.row(*(r[k] for k in ("B", "H", "Hkv", "D", "L", "Lq", "dtype", "kv", "token", "paged", "append",
                                             "splits", "launches")),
                           f"{r['moved']:,}", f"{r['compulsory']:,}", f"**{r['ratio']:.4f}**", f"{r['seconds']:.1f}")
        lines.append(line)
        print(line, flush=True)
    text = ("# Decode kernels: device bytes / compulsory bytes\n\n"
            "Emulator, checked mode (exact byte counters), all launches of one call (split-K partial kernel "
            "and, when split, the combine kernel).  Compulsory = q + K and V rows of every KV head + out + lse, "
            "once; the numerator counts every buffer, including the params struct and the per-row index "
            "vectors (read once per threadgroup, shared through threadgroup memory) and the float32 partials.  "
            "Rows with an append are a whole decode step: the append kernel (one new token, rotary over the "
            "head dim, q rotated into scratch) then the decode kernels; compulsory adds the new k/v rows "
            "read and written once and one rotary table row.  Causal, one batch row per cache row, "
            "`num_splits=0` (heuristic, 10 GPU cores) unless a splits value is forced.  Quantized K/V: "
            "compulsory counts the packed values, scales and biases of every visible row once "
            "(and, with an append, the new rows read in float16 and written quantized once); "
            "bytes/token: K and V of one token over all KV heads, against float16 (4096 bytes here).  "
            "Command: `python bench/decode_bytes.py " +
            ("--quick" if args.quick else f"--lengths {args.lengths}") + "`.\n\n" + "\n".join(lines) + "\n")
    errors = [quantization_error(FORMATS[n]) for n in FORMATS]
    text += ("\n## Quantization error (separate from the kernels' accuracy)\n\n"
             "Standard-normal float16 K/V, B=1, H=32, H_kv=8, D=128, L=4096; one decode query row; "
             "float64 attention on the dequantized cache against the float16 cache.  The kernels are tested "
             "against the float64 oracle on the dequantized cache (tests/kernels/test_quantized_kernels.py); this is "
             "what quantizing costs on top.\n\n| K/V | max abs(x - x_hat) | max abs(out error) | max abs(out) |\n"
             "|---|---|---|---|\n" + "".join(f"| {e['kv']} | {e['x_err']:.4f} | {e['out_err']:.2e} | "
                                               f"{e['out_scale']:.3f} |\n" for e in errors))
    print(text[text.index("## Quantization error"):])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
