"""Demo: run attention through every public face on the best available backend
(Metal on a Mac, else the emulator running the same Metal kernels on the CPU,
else the reference) and check each result against the float64 oracle.

    python -m torch_metal_flash            # a few shapes and features
    python -m torch_metal_flash --quick    # one small case per face
    python -m torch_metal_flash doctor     # the full self-test (torch_metal_flash/doctor.py)
    python -m torch_metal_flash tune       # time the kernel variants on this Mac (docs/tuning.md)
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

import torch_metal_flash as tmf
from torch_metal_flash import backends
from .problem.spec import make_spec
from torch_metal_flash.testing import error_budget, forward_reference, randn


def pick_backend() -> tuple[str, torch.device, str]:
    if torch.backends.mps.is_available():
        from torch_metal_flash.backends import metal
        why = metal.unavailable_reason(torch.device("mps"))
        if why is None:
            return "metal", torch.device("mps"), "Apple GPU via the MPS stream"
        return "reference", torch.device("mps"), why
    from torch_metal_flash import emulator
    try:
        compiler = emulator.find_compiler()
    except emulator.CompilerNotFoundError as exc:  # its message says how to install one
        return "reference", torch.device("cpu"), str(exc)
    return "emulator", torch.device("cpu"), f"the Metal kernels in the CPU emulator ({compiler.ident})"


CASES = [
    # name, (B, Hq, Hkv, Lq, Lk, D), dtype, face kwargs
    ("sdpa causal", (1, 4, 4, 100, 100, 64), torch.float16, dict(face="sdpa", is_causal=True)),
    ("flash GQA bottom-right causal", (1, 8, 2, 37, 129, 64), torch.bfloat16, dict(face="flash", causal=True)),
    ("flash window + softcap", (2, 4, 4, 65, 65, 128), torch.float32,
     dict(face="flash", window_size=(16, 0), softcap=20.0)),
    ("sdpa float mask, head dim 72", (1, 2, 2, 33, 47, 72), torch.float16, dict(face="sdpa", mask=True)),
]


def run_case(name, dims, dtype, kw, device):
    B, Hq, Hkv, Lq, Lk, D = dims
    g = torch.Generator().manual_seed(0)
    kw = dict(kw)
    face = kw.pop("face")
    if face == "flash":
        q, k, v = (randn(B, L, H, D, generator=g).to(dtype) for L, H in ((Lq, Hq), (Lk, Hkv), (Lk, Hkv)))
        q, k, v = q.to(device), k.to(device), v.to(device)
        start = time.perf_counter()
        out, lse, _ = tmf.flash_attn_func(q, k, v, return_attn_probs=True, **kw)
        left, right = kw.get("window_size", (-1, -1))
        spec = make_spec(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=D ** -0.5,
                         diag_offset=Lk - Lq, window_left=left, window_right=0 if kw.get("causal") else right,
                         softcap=kw.get("softcap", 0.0))
        out = out.transpose(1, 2)
    else:
        q, k, v = (randn(B, H, L, D, generator=g).to(dtype) for L, H in ((Lq, Hq), (Lk, Hkv), (Lk, Hkv)))
        q, k, v = q.to(device), k.to(device), v.to(device)
        mask = randn(Lq, Lk, generator=g).to(dtype).to(device) if kw.pop("mask", False) else None
        start = time.perf_counter()
        out = tmf.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, **kw)
        spec = make_spec(q, k, v, mask, scale=D ** -0.5, window_right=0 if kw.get("is_causal") else -1)
    if device.type == "mps":
        torch.mps.synchronize()
    seconds = time.perf_counter() - start
    ref, low = forward_reference(spec)
    err, allowed = error_budget("out", out, ref.out, low.out, ref.magnitude["out"], dtype)
    status = "ok" if err <= allowed else "FAIL"
    print(f"  {name:34s} {str(dtype)[6:]:9s} max|err|={err:.2e} (allowed {allowed:.2e}) {seconds * 1e3:8.1f} ms  {status}")
    return status == "ok"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["doctor"]:
        from torch_metal_flash import doctor
        return doctor.main(argv[1:])
    if argv[:1] == ["tune"]:
        import torch_metal_flash.tune as cli
        return cli.main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m torch_metal_flash", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one small case per face")
    parser.add_argument("--backend", choices=backends.BACKENDS, help="force a backend")
    args = parser.parse_args(argv)
    name, device, why = pick_backend()
    if args.backend and args.backend != "auto":
        name, why = args.backend, "forced with --backend"
    print(f"torch_metal_flash {tmf.__version__}, torch {torch.__version__}")
    print(f"backend: {name} — {why}")
    cases = CASES[:2] if args.quick else CASES
    ok = True
    backends.run_counts(reset=True)
    with tmf.backend(name):
        for case in cases:
            ok &= run_case(*case, device)
    print(f"op calls per backend: {backends.run_counts()}")
    print("all results within the float64-oracle budget" if ok else "SOME RESULTS OUTSIDE THE BUDGET")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
