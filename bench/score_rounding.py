"""Float32 score rounding in out: the minimal float32 fuzz misses of tests/core/test_fuzz.py.

    python bench/score_rounding.py

For each case (RULE_GAP_CASES), on the emulator: the kernels' out error against the
float64 oracle under the default (relaxed) and the "safe" math mode, the rule's floor
4uM (M = P|V|) and the score-rounding term u * sum_j P_j A_j |v_j - o| at the worst
element, A_j = |scale| sum_d |q_d k_jd| (the summed terms of score j), and the error of
exact attention on float32 scores summed in 40 random orders (median, max): what any
float32 dot-product order gives.  bench/results/fuzz.md quotes these figures.
"""
from __future__ import annotations

import torch

import harness  # noqa: F401  (this checkout's torch_metal_flash)

import torch_metal_flash as tmf
from torch_metal_flash import emulator
from support import fuzz_problems as fp
from support import portable
from torch_metal_flash.testing import randn
from support.fuzz_problems import RULE_GAP_CASES

torch.randn, torch.randn_like = randn, portable.randn_like  # the portable inputs the tests draw

U = 2.0 ** -24
CASES = ("override_f32_decode_route_out", "kvpacked_f32_decode_route_big_scores_out")


def _problem(name):
    p = dict(RULE_GAP_CASES[name])
    x, _ = fp.FACES[p["face"]].build(p, torch.Generator().manual_seed(p["seed"]))
    if "kv" in x:  # (B, L, 2, H, D), B = H = 1
        q, k, v = x["q"].double()[0, :, 0], x["kv"].double()[0, :, 0, 0], x["kv"].double()[0, :, 1, 0]
        call = lambda: tmf.flash_attn_kvpacked_func(x["q"], x["kv"], softmax_scale=p["scale"])[0, :, 0]  # noqa: E731
    else:
        q, k, v = (x[n].double()[0, 0] for n in "qkv")
        call = lambda: tmf.scaled_dot_product_attention(x["q"], x["k"], x["v"], scale=p["scale"])[0, 0]  # noqa: E731
    return q, k, v, p["scale"] or q.shape[-1] ** -0.5, call


def _random_orders(q, k, v, scale, ref, n=40):
    """Exact attention on float32 scores, each summed by fma in a random order (the kernels
    pre-scale q in float32)."""
    g = torch.Generator().manual_seed(0)
    qs = (q.float() * scale).double()
    errs = []
    for _ in range(n):
        acc = torch.zeros(q.shape[0], k.shape[0], dtype=torch.float32)
        for d in torch.randperm(q.shape[1], generator=g).tolist():
            acc = (acc.double() + qs[:, d:d + 1] * k[:, d][None, :]).float()
        errs.append((torch.softmax(acc.double(), -1) @ v - ref).abs().max().item())
    errs.sort()
    return errs[n // 2], errs[-1]


def main():
    print("| case | math | out error | 4uM | score term | error / term | random orders: median, max |")
    print("|---|---|---|---|---|---|---|")
    for name in CASES:
        q, k, v, scale, call = _problem(name)
        P = torch.softmax(scale * q @ k.T, -1)
        ref = P @ v
        A = abs(scale) * q.abs() @ k.abs().T
        term = U * torch.einsum("ij,ij,ijd->id", P, A, (v[None] - ref[:, None]).abs())
        floor = 4 * U * (P @ v.abs())
        med, worst = _random_orders(q, k, v, scale, ref)
        for mode in ("relaxed", "safe"):
            with fp.kernels("forward", strict=True), emulator.settings(math_mode=mode):
                err = (call().double() - ref).abs()
            i = err.argmax()
            print(f"| {name} | {mode} | {err.max():.3e} | {floor.flatten()[i]:.3e} | {term.flatten()[i]:.3e} | "
                  f"{err.max() / term.flatten()[i]:.2f} | {med:.3e}, {worst:.3e} |")


if __name__ == "__main__":
    main()
