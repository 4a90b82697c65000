"""Other people's attention kernels in the emulator: compiling them from folders the user
points to, launching them as their hosts do, and a float64 reference.

Shared by bench/third_party_kernels.py (correctness of many kernels) and bench/vs_peers.py
(counters next to ours).  No third-party code is stored here: the instantiation lines and the
launch arguments are ours, the kernels are read from the user's folders.

* MLX steel attention: ``mlx/backend/metal/kernels/steel/attn/kernels/steel_attention.h`` of an
  ``mlx-metal`` wheel's ``mlx/include``; launched like MLX's ``sdpa_full_self_attention_metal``
  (BQ 32, BK 32 below head dim 128 and 16 from it, 4 simdgroups).
* MLX NAX attention (Metal 4 tensor ops, compiled as MSL 4.0):
  ``steel/attn/kernels/steel_attention_nax.h``; launched like MLX's
  ``sdpa_full_self_attention_nax`` (BQ 64, BK 32, 4 simdgroups of one 16-row Q fragment each).
* MLX NAX GEMM: ``steel/gemm/kernels/steel_gemm_fused_nax.h``; launched like MLX's
  ``steel_matmul_regular`` NAX branch (BM x BN tiles, SK 32 per tensor op chain, BK per pass).
* PyTorch's MPS prefill attention: ``ATen/native/mps/kernels/PrefillAttention.h`` of a torch
  macOS wheel's ``torch/include`` (the kernel instantiates its own shapes: BQ 32, BK 32 below
  head dim 128, 16 at 128, 4 simdgroups).
"""
from __future__ import annotations

import hashlib
import math
import os
import struct
import tempfile
from pathlib import Path

import torch

from torch_metal_flash import emulator

TOL = {torch.float32: 2e-5, torch.float16: 2e-2, torch.bfloat16: 2e-2}


# Our instantiation files, under a content-keyed path that is the same in every process (the
# emulator's caches key on the path the preprocessed text names).
SOURCES = Path(tempfile.gettempdir()) / "tmf-peer-sources"


def compile_source(text: str, name: str, include_dirs, **kw) -> "emulator.Library":
    """compile_shader on ``text`` saved as ``name`` under SOURCES: the same path for the same text,
    so the emulator's caches serve every later call (other function constants too)."""
    path = SOURCES / hashlib.sha256(text.encode()).hexdigest()[:16] / name
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        tmp.replace(path)  # atomic: another process may be writing the same file
    return emulator.compile_shader(path, include_dirs=[str(i) for i in include_dirs], **kw)


def attention_reference(q, k, v, scale, mask=None, causal=False, sinks=None):
    """float64 attention; ``causal`` aligns the diagonal bottom-right (the same as top-left when Lq == Lk)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = (q.double() @ k.transpose(-1, -2)) * scale
    ql, kl = s.shape[-2:]
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.double()
    if causal:
        s = s.masked_fill(torch.arange(kl)[None] > torch.arange(ql)[:, None] + kl - ql, float("-inf"))
    if sinks is not None:
        sk = sinks.double()[None, :, None, None].expand(s.shape[0], -1, ql, 1)
        return torch.softmax(torch.cat([s, sk], -1), -1)[..., :-1] @ v
    return torch.softmax(s, -1) @ v


def max_error(out, ref) -> tuple[float, bool]:
    """(max |out - ref|, within the dtype's tolerance relative to the reference's largest magnitude)."""
    err = (out.double() - ref.double()).abs().max().item()
    return err, err <= TOL[out.dtype] * max(1.0, ref.abs().max().item())


# ---------------------------------------------------------------- MLX steel attention

MLX_TYPES = {"float32": ("float", torch.float32), "float16": ("half", torch.float16),
             "bfloat16": ("bfloat16_t", torch.bfloat16)}
MLX_DTYPE_NAMES = {dt: n for n, (_, dt) in MLX_TYPES.items()}

MLX_STEEL = """#include "mlx/backend/metal/kernels/utils.h"
#include "mlx/backend/metal/kernels/steel/attn/attn.h"
#include "mlx/backend/metal/kernels/steel/attn/kernels/steel_attention.h"
""" + "".join(f"""
instantiate_kernel("attn_{n}_{d}_mask_{m}", attention, {t}, 32, {bk}, {d}, {d}, 4, 1, {mt}, float)"""
              for n, (t, _) in MLX_TYPES.items() for d, bk in ((64, 32), (128, 16))
              for m, mt in (("float", t), ("bool", "bool"))) + "\n"

MLX_PARAM_BUFFERS = (4, 5)  # AttnParams and AttnMaskParams structs (constant address space)


def mlx_steel_blocks(head_dim: int) -> tuple[int, int]:
    """(BQ, BK) MLX's host picks for its steel attention."""
    return 32, (32 if head_dim < 128 else 16)


def run_mlx_steel(inc, q, k, v, scale, *, mask=None, causal=False, sinks=None, order=None, checked=None):
    """Launch MLX's steel attention on (B, H, L, D) tensors; returns (out, LaunchStats)."""
    B, H, ql, d = q.shape
    Hk, kl = k.shape[1], k.shape[2]
    n = MLX_DTYPE_NAMES[q.dtype]
    bq, bk = mlx_steel_blocks(d)
    o = torch.zeros_like(q)
    nq, nk = -(-ql // bq), -(-kl // bk)
    strides = [s for t in (q, k, v, o) for s in t.stride()[:3]]
    params = struct.pack("<6if7i12q", B, H, d, ql, kl, H // Hk, scale, nq, nk, ql // bq, kl // bk, ql % bq, kl % bk,
                         kl - ql, *strides)
    fcs = {200: ql % bq == 0, 201: kl % bk == 0, 300: mask is not None, 301: causal, 302: sinks is not None,
           303: False}
    lib = compile_source(MLX_STEEL, "mlx_steel.metal", [inc], function_constants=fcs)
    bufs = {4: params}
    if mask is not None:
        bufs.update({5: struct.pack("<3q", *mask.stride()[:3]), 6: mask})
    if sinks is not None:
        bufs[7] = sinks
    st = lib[f"attn_{n}_{d}_mask_{'bool' if mask is not None and mask.dtype == torch.bool else 'float'}"](
        q, k, v, o, buffers=bufs, grid=(nq * 32, H * 4, B), threadgroup=(32, 4, 1), order=order, checked=checked)
    return o, st


def _attn_params(q, k, v, o, scale, bq, bk) -> bytes:
    """MLX's AttnParams (steel/attn/params.h): causal masks align the diagonal bottom-right (qL_off)."""
    B, H, ql, d = q.shape
    Hk, kl = k.shape[1], k.shape[2]
    strides = [s for t in (q, k, v, o) for s in t.stride()[:3]]
    return struct.pack("<6if7i12q", B, H, d, ql, kl, H // Hk, scale, -(-ql // bq), -(-kl // bk), ql // bq, kl // bk,
                       ql % bq, kl % bk, kl - ql, *strides)


# ---------------------------------------------------------------- MLX NAX attention and GEMM (Metal 4)

MLX_NAX_HEAD_DIMS = (64, 96, 128)
MLX_NAX_TYPES = {"float16": ("half", torch.float16), "bfloat16": ("bfloat16_t", torch.bfloat16)}
MLX_NAX_ATTENTION = """#include "mlx/backend/metal/kernels/utils.h"
#include "mlx/backend/metal/kernels/steel/attn/kernels/steel_attention_nax.h"
""" + "".join(f"""
instantiate_kernel("nax_attn_{n}_{d}_mask_{m}", attention_nax, {t}, 64, 32, {d}, {d}, 4, 1, {mt}, float)"""
              for n, (t, _) in MLX_NAX_TYPES.items() for d in MLX_NAX_HEAD_DIMS
              for m, mt in (("float", t), ("bool", "bool")) if m == "float" or d == 64) + "\n"
MLX_NAX_BLOCKS = (64, 32, 4, 1)  # BQ, BK, WM, WN of sdpa_full_self_attention_nax


def run_mlx_nax_attention(inc, q, k, v, scale, *, mask=None, causal=False, order=None, checked=None):
    """Launch MLX's NAX attention on (B, H, L, D) tensors; returns (out, LaunchStats)."""
    B, H, ql, d = q.shape
    kl = k.shape[2]
    bq, bk, wm, wn = MLX_NAX_BLOCKS
    o = torch.zeros_like(q)
    fcs = {200: ql % bq == 0, 201: kl % bk == 0, 300: mask is not None, 301: causal, 302: False, 303: False}
    lib = compile_source(MLX_NAX_ATTENTION, "mlx_nax_attention.metal", [inc], function_constants=fcs,
                         language_version="4.0")
    bufs = {4: _attn_params(q, k, v, o, scale, bq, bk)}
    if mask is not None:
        bufs.update({5: struct.pack("<3q", *mask.stride()[:3]), 6: mask})
    kind = "bool" if mask is not None and mask.dtype == torch.bool else "float"
    st = lib[f"nax_attn_{MLX_DTYPE_NAMES[q.dtype]}_{d}_mask_{kind}"](
        q, k, v, o, buffers=bufs, grid=(-(-ql // bq) * 32, H * wm, B * wn), threadgroup=(32, wm, wn), order=order,
        checked=checked)
    return o, st


# (BM, BN, BK, WM, WN): the two tilings MLX's host picks (M5 class: 128 x 128, BK 512, 4 x 4 simdgroups; the
# others: 64 x 128, BK 256 or 64, 2 x 4), and MLX's own smaller instantiation (64 x 64, BK 256, 2 x 2)
MLX_NAX_GEMM_TILES = ((64, 64, 256, 2, 2), (64, 128, 256, 2, 4), (128, 128, 512, 4, 4))
MLX_NAX_GEMM = """#include "mlx/backend/metal/kernels/utils.h"
#include "mlx/backend/metal/kernels/steel/gemm/gemm_nax.h"
#include "mlx/backend/metal/kernels/steel/gemm/kernels/steel_gemm_fused_nax.h"
""" + "".join(f"""
instantiate_kernel("nax_gemm_{ta}{tb}_{n}_{bm}_{bn}_{bk}_{wm}_{wn}", gemm, {t}, {bm}, {bn}, {bk}, {wm}, {wn}, {tra}, {trb}, float)"""
              for n, (t, _) in MLX_NAX_TYPES.items() for bm, bn, bk, wm, wn in MLX_NAX_GEMM_TILES
              for ta, tra in (("n", "false"), ("t", "true")) for tb, trb in (("n", "false"), ("t", "true"))
              if (bm, bn) == (64, 128) or ta + tb == "nn") + "\n"


def run_mlx_nax_gemm(inc, a, b, *, transpose_a=False, transpose_b=False, tile=MLX_NAX_GEMM_TILES[1], c=None,
                     alpha=1.0, beta=1.0, order=None, checked=None):
    """D = A B (alpha A B + beta C with ``c``) through MLX's fused NAX GEMM.  ``a`` / ``b`` are stored as the
    kernel reads them: (M, K) or, transposed, (K, M); (K, N) or (N, K).  Returns (D, LaunchStats)."""
    bm, bn, bk, wm, wn = tile
    M, K = (a.shape[1], a.shape[0]) if transpose_a else a.shape
    N = b.shape[0] if transpose_b else b.shape[1]
    d = torch.zeros(M, N, dtype=a.dtype)
    tm, tn = -(-M // bm), -(-N // bn)
    params = struct.pack("<8i3q3i4x", M, N, K, a.shape[1], b.shape[1], N, tn, tm, M * K, K * N, M * N, 0, K // bk, 1)
    fcs = {10: False, 100: c is not None, 110: c is not None and (alpha, beta) != (1.0, 1.0), 200: M % bm == 0,
           201: N % bn == 0, 202: K % bk == 0}
    lib = compile_source(MLX_NAX_GEMM, "mlx_nax_gemm.metal", [inc], function_constants=fcs, language_version="4.0")
    bufs = {4: params}
    if c is not None:
        bufs.update({2: c, 5: struct.pack("<2iq2f", c.stride(0), c.stride(1), M * N, alpha, beta)})
    name = f"nax_gemm_{'t' if transpose_a else 'n'}{'t' if transpose_b else 'n'}_{MLX_DTYPE_NAMES[a.dtype]}_" \
           f"{bm}_{bn}_{bk}_{wm}_{wn}"
    st = lib[name](a, b, buffers={**bufs, 3: d}, grid=(tn * 32, tm * wn, wm), threadgroup=(32, wn, wm),
                   order=order, checked=checked)
    return d, st


# ---------------------------------------------------------------- PyTorch MPS prefill attention

PYTORCH_PREFILL = """#include <metal_stdlib>
using namespace metal;
#include <c10/metal/utils.h>
#include <ATen/native/mps/kernels/PrefillAttention.h>
"""
PYTORCH_TYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
PYTORCH_PARAM_BUFFERS = (4, 5)  # PrefillAttnParams and PrefillAttnMaskParams structs
PREFILL_HEADER = Path("ATen/native/mps/kernels/PrefillAttention.h")


def pytorch_include(root: Path) -> Path:
    """The include folder under ``root`` (a torch wheel unpacked, its ``torch/`` or its ``include/``)."""
    for inc in (root / "torch" / "include", root / "include", root):
        if (inc / PREFILL_HEADER).is_file():
            return inc
    raise FileNotFoundError(f"--pytorch {root}: no {PREFILL_HEADER} under it (nor under torch/include or include)")


def pytorch_prefill_blocks(head_dim: int) -> tuple[int, int]:
    """(BQ, BK) of the kernel's instantiation for this head dim (its own instantiation list)."""
    return {32: (32, 32), 64: (32, 32), 72: (32, 32), 80: (32, 32), 96: (32, 32), 128: (32, 16),
            256: (16, 8)}[head_dim]


def run_pytorch_prefill(inc, q, k, v, scale, *, causal=False, order=None, checked=None):
    """Launch PyTorch's prefill attention on (B, H, L, D) tensors (no mask); returns (out, LaunchStats)."""
    B, H, ql, d = q.shape
    Hk, kl = k.shape[1], k.shape[2]
    bq, bk = pytorch_prefill_blocks(d)
    wm = 4 if bq == 32 else 2
    o = torch.zeros_like(q)
    strides = [s for t in (q, k, v, o) for s in t.stride()[:3]]
    params = struct.pack("<6i2f12i", B, H, d, ql, kl, H // Hk, scale, 1.0, *strides)
    lib = compile_source(PYTORCH_PREFILL, "pytorch_prefill.metal", [inc])
    name = (f"prefill_attention_{PYTORCH_TYPES[q.dtype]}_bq{bq}_bk{bk}_bd{d}_wm{wm}_wn1_hm0_dc{int(causal)}"
            f"_mask{PYTORCH_TYPES[q.dtype]}")
    unused_mask = torch.zeros(1, dtype=q.dtype)  # bound as the host binds it; never read without a mask
    st = lib[name](q, k, v, o, buffers={4: params, 5: bytes(16), 6: unused_mask},
                   grid=(-(-ql // bq) * 32, H * wm, B), threadgroup=(32, wm, 1), order=order, checked=checked)
    return o, st


def default_scale(head_dim: int) -> float:
    return 1 / math.sqrt(head_dim)


__all__ = ["MLX_NAX_GEMM_TILES", "MLX_NAX_HEAD_DIMS", "MLX_NAX_TYPES", "MLX_PARAM_BUFFERS", "MLX_STEEL", "MLX_TYPES", "PYTORCH_PARAM_BUFFERS", "TOL", "attention_reference",
           "compile_source", "default_scale", "max_error", "mlx_steel_blocks", "pytorch_include",
           "pytorch_prefill_blocks", "run_mlx_nax_attention", "run_mlx_nax_gemm", "run_mlx_steel",
           "run_pytorch_prefill"]
