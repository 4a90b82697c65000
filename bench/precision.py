"""Precision: max error / allowed of the kernels under the rule of torch_metal_flash.testing.

    python bench/precision.py                        # this checkout's kernels (emulator)
    python bench/precision.py --package DIR          # the kernels of another checkout, same rule

``--package`` measures another checkout's kernels (e.g. one without the exact
rebuild of P: ``git worktree add /tmp/tmf-before e27a3b9``) with *this*
checkout's acceptance rule, through the public faces only (SDPA, flash-attn,
kv-cache), which both versions share.  A ratio above 1 fails the rule.

Sections: float32 gradients at score magnitudes up to 30 (where P rebuilt
from a float32 lse fails); float16/bfloat16 gradients of short rows and of
float masks broadcast over the keys (delta from the output rounded to the
input dtype); the decode kernels (split-K and single pass) at large scores.
Writes a markdown table to stdout and to bench/results/precision.md (or --out).
"""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

import harness


def _load(package: str | None):
    """(torch_metal_flash of ``package`` or this checkout, this checkout's testing package)."""
    harness.use_checkout(Path(package) if package else harness.ROOT)
    import torch_metal_flash as tmf
    # The rule and oracles of this checkout, bound to whichever package is imported
    # (the rule only reads AttentionSpec fields, which every version has).
    rule = harness.load_source("torch_metal_flash._rule", harness.ROOT / "torch_metal_flash" / "testing")
    return tmf, rule


def main() -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--package", help="checkout whose torch_metal_flash to measure (default: this one)")
    ap.add_argument("--out", default=str(harness.RESULTS / "precision.md"))
    args = ap.parse_args()
    tmf, rule = _load(args.package)
    import torch

    from torch_metal_flash import backends
    from torch_metal_flash.problem.spec import make_spec

    randn = rule.randn
    rows = []

    def record(section, case, ratios):
        worst = max(ratios.values())
        detail = ", ".join(f"{k} {v:.2f}" for k, v in ratios.items())
        rows.append(harness.row(section, case, f"**{worst:.2f}**", detail))
        print(rows[-1], flush=True)

    def sdpa_grads(q, k, v, mask, scale, causal, dout):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        if mask is not None:
            leaves.append(mask.detach().clone().requires_grad_())
        with backends.backend("emulator", strict=True):
            out = tmf.scaled_dot_product_attention(*leaves[:3], attn_mask=leaves[3] if mask is not None else None,
                                                   scale=scale, is_causal=causal)
            grads = torch.autograd.grad(out, leaves, dout)
        return out, grads

    # 1. float32 gradients at large scores.
    for D, L, amp, scale, causal, bias in [
            (8, 1, 4.0, 1.0, False, False), (8, 2, 4.0, 1.0, False, False), (8, 17, 2.0, 1.0, False, False),
            (64, 33, 1.0, None, False, False), (64, 33, 2.0, None, False, False), (64, 33, 3.0, None, True, False),
            (64, 65, 3.2, None, False, True), (32, 40, 1.0, 0.3, False, True), (32, 40, 2.0, 0.3, True, False),
            (128, 29, 2.5, None, False, False), (16, 64, 5.0, 0.25, False, False)]:
        g = torch.Generator().manual_seed(D * 1000 + L)
        q, k = (amp * randn(1, 2, L, D, generator=g) for _ in range(2))
        v, dout = randn(1, 2, L, D, generator=g), randn(1, 2, L, D, generator=g)
        mask = randn(1, 2, L, L, generator=g) if bias else None
        sc = D ** -0.5 if scale is None else scale
        out, grads = sdpa_grads(q, k, v, mask, scale, causal, dout)
        spec = make_spec(q, k, v, mask, scale=sc, window_right=0 if causal else -1)
        s_max = ((q @ k.transpose(-1, -2)) * sc).abs().max().item()
        errs = rule.grad_errors(spec, dout, None, (*grads[:3], grads[3] if bias else None, None), bias)
        ratios = {n: e / a if a else float("inf") * (e > 0) for n, (e, a) in errs.items()}
        ref, low = rule.forward_reference(spec)
        e, a = rule.error_budget("out", out, ref.out, low.out, ref.magnitude["out"], torch.float32)
        ratios = {"out": e / a, **ratios}
        record("fp32 backward, large scores", f"D={D} L={L} max\\|s\\|={s_max:.0f}{' causal' if causal else ''}"
               f"{' bias' if bias else ''}", ratios)

    # 2. float16 / bfloat16: short rows, key-broadcast float masks (their gradient is exactly 0).
    for dt, Lq, Lk, mask_shape in [(torch.bfloat16, 1, 2, (1, 1)), (torch.bfloat16, 1, 2, None),
                                   (torch.float16, 1, 2, (1, 1)), (torch.bfloat16, 7, 5, (7, 1)),
                                   (torch.float16, 17, 23, (1, 2, 17, 1)), (torch.bfloat16, 3, 64, (1, 1, 1, 1))]:
        g = torch.Generator().manual_seed(Lq * 100 + Lk)
        q, k, v = (randn(1, 2, n, 8, generator=g).to(dt) for n in (Lq, Lk, Lk))
        dout = randn(1, 2, Lq, 8, generator=g).to(dt)
        mask = None if mask_shape is None else randn(*mask_shape, generator=g).to(dt)
        _, grads = sdpa_grads(q, k, v, mask, None, False, dout)
        full = None if mask is None else mask.expand(1, 2, Lq, Lk)
        spec = make_spec(q, k, v, full, scale=8 ** -0.5)
        ref, low = rule.backward_reference(spec, dout, compute_dbias=mask is not None)
        errs = rule.grad_errors(spec, dout, None, (*grads[:3], None, None), reference=(ref, low))
        ratios = {n: e / a for n, (e, a) in errs.items()}
        if mask is not None:  # dmask = dbias summed over the broadcast dims: the rule on that sum
            e, a = rule.error_budget("dmask", grads[3], ref.dbias.sum_to_size(mask.shape),
                                     rule.Arith(dt).r(low.dbias.sum_to_size(mask.shape)),
                                     ref.magnitude["dbias"].sum_to_size(mask.shape), dt)
            ratios["dmask"] = e / a
        record("fp16/bf16 backward", f"{str(dt)[6:]} Lq={Lq} Lk={Lk} mask {mask_shape}", ratios)

    # 3. The decode kernels at large scores (flash_attn_with_kvcache).
    kvcache_oracle = importlib.import_module("torch_metal_flash._rule.kvcache_oracle")
    for amp, splits, seed in [(1.0, 1, 0), (2.0, 1, 1), (2.0, 3, 1), (2.0, 3, 3), (4.0, 1, 2), (4.0, 3, 2)]:
        g = torch.Generator().manual_seed(seed)
        B, Hq, Hkv, D, L = 2, 4, 2, 64, 300
        kw = dict(q=2 * amp * randn(B, 1, Hq, D, generator=g), k_cache=amp * randn(B, L, Hkv, D, generator=g),
                  v_cache=randn(B, L, Hkv, D, generator=g),
                  cache_seqlens=torch.tensor([L, L - 37], dtype=torch.int32))
        with backends.backend("emulator", strict=True):
            out, lse = tmf.flash_attn_with_kvcache(**kw, return_softmax_lse=True, num_splits=splits)
        ref = kvcache_oracle.kvcache_attention(**kw, dtype=torch.float64)
        per_row = [(rule.plain_attention(lo, torch.float32), rule.plain_attention(ex, torch.float64).magnitude)
                   for lo, ex in zip(kvcache_oracle.row_problems(**kw, dtype=torch.float32),
                                     kvcache_oracle.row_problems(**kw, dtype=torch.float64))]
        plain_out = torch.cat([p.out for p, _ in per_row]).transpose(1, 2)
        mag_out = torch.cat([m["out"] for _, m in per_row]).transpose(1, 2)
        e_o, a_o = rule.error_budget("out", out, ref[0], plain_out, mag_out, torch.float32)
        e_l, a_l = rule.error_budget("lse", lse, ref[1], torch.cat([p.lse for p, _ in per_row]),
                                     torch.cat([m["lse"] for _, m in per_row]), torch.float32)
        record("fp32 decode forward", f"max\\|lse\\|={ref[1].abs().max():.0f} splits={splits} seed={seed}",
               {"out": e_o / a_o, "lse": e_l / a_l})

    head = "\n".join(harness.table_head("section", "case", "max error / allowed", "per result"))
    text = (f"# Precision: max error / allowed (rule of torch_metal_flash.testing)\n\nKernels of "
            f"`{args.package or 'this checkout'}`, emulator backend.  Generated by `python bench/precision.py"
            f"{' --package ' + args.package if args.package else ''}`.\n\n{head}\n" + "\n".join(rows) + "\n")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
