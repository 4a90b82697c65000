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
import shutil
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
# MLX runs its NAX kernels only where the neural accelerators are (M5 class): they read and write Apple10's
# cooperative-tensor layout, so the emulator runs them as that family.
MLX_NAX_FAMILY = "apple10"


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
    with emulator.settings(family=MLX_NAX_FAMILY):
        st = lib[f"nax_attn_{MLX_DTYPE_NAMES[q.dtype]}_{d}_mask_{kind}"](
            q, k, v, o, buffers=bufs, grid=(-(-ql // bq) * 32, H * wm, B * wn), threadgroup=(32, wm, wn),
            order=order, checked=checked)
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
    with emulator.settings(family=MLX_NAX_FAMILY):
        st = lib[name](a, b, buffers={**bufs, 3: d}, grid=(tn * 32, tm * wn, wm), threadgroup=(32, wn, wm),
                       order=order, checked=checked)
    return d, st


# ---------------------------------------------------------------- PyTorch's MPS attention kernels

PYTORCH_TYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
PYTORCH_METAL_TYPES = {torch.float16: "half", torch.bfloat16: "bfloat", torch.float32: "float"}
PYTORCH_PARAM_BUFFERS = (4, 5)  # PrefillAttnParams and PrefillAttnMaskParams structs
KERNELS = Path("ATen/native/mps/kernels")
PREFILL_HEADER = KERNELS / "PrefillAttention.h"
DECODE_HEADER = KERNELS / "DecodeAttention.h"
MPP_HEADER = KERNELS / "MppAttention.h"


def _pytorch_source(header: Path) -> str:
    return f"#include <metal_stdlib>\nusing namespace metal;\n#include <c10/metal/utils.h>\n#include <{header}>\n"


def pytorch_include(root: Path) -> Path:
    """The include folder under ``root`` (a torch wheel unpacked, its ``torch/`` or its ``include/``)."""
    for inc in (root / "torch" / "include", root / "include", root):
        if (inc / PREFILL_HEADER).is_file():
            return inc
    raise FileNotFoundError(f"--pytorch {root}: no {PREFILL_HEADER} under it (nor under torch/include or include)")


def pytorch_wheel_include(version: str) -> Path:
    """torch ``version``'s Metal kernel headers (``ATen/native/mps/kernels``, ``c10/metal``), extracted once from
    its macOS wheel (bench/macos_cross_build.py finds or downloads it) into a cache folder; returns that include
    folder.  Nothing of torch's is stored in this repository."""
    import zipfile

    import macos_cross_build as mcb

    final = mcb.CACHE / f"torch-{version}-metal-kernels"
    if (final / PREFILL_HEADER).is_file():
        return final
    wheel = mcb.find_wheel(version)
    mcb.CACHE.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=mcb.CACHE))
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n.startswith(("torch/include/ATen/native/mps/kernels/",
                                                          "torch/include/c10/metal/"))]
        z.extractall(tmp, names)
    try:
        (tmp / "torch" / "include").rename(final)
    except OSError:  # another process got there first
        pass
    shutil.rmtree(tmp, ignore_errors=True)
    return final


_C_FIELDS = {"int": "i", "uint": "I", "float": "f", "int64_t": "q", "uint32_t": "I", "int32_t": "i"}


def struct_format(inc: Path, header: Path, name: str) -> str:
    """The struct-module format of ``struct name`` as the header declares it (scalar and array fields of the
    types above, with C alignment): torch 2.13's PrefillAttnParams has int32 strides, 2.15's int64."""
    import re

    text = (inc / header).read_text()
    m = re.search(r"struct\s+" + name + r"\s*\{(.*?)\};", text, re.S)
    if not m:
        raise ValueError(f"{header}: no struct {name}")
    fmt, offset, align = "<", 0, 1
    for ctype, count in re.findall(r"^\s*(\w+)\s+\w+(?:\[(\d+)\])?\s*;", re.sub(r"//[^\n]*", "", m.group(1)), re.M):
        code = _C_FIELDS[ctype]
        size = struct.calcsize(code)
        pad = -offset % size
        fmt += "x" * pad + f"{int(count or 1)}{code}"
        offset += pad + size * int(count or 1)
        align = max(align, size)
    return fmt + "x" * (-offset % align)


def pytorch_prefill_blocks(head_dim: int, mpp: bool = False) -> tuple[int, int, int]:
    """(BQ, BK, WM) torch's host picks for its prefill kernel (the MPP one: 64 x 32, 4 simdgroups)."""
    if mpp:
        return 64, 32, 4
    return {32: (32, 32, 4), 64: (32, 32, 4), 72: (32, 32, 4), 80: (32, 32, 4), 96: (32, 32, 4),
            128: (32, 16, 4), 256: (16, 8, 2)}[head_dim]


def run_pytorch_prefill(inc, q, k, v, scale, *, causal=False, mask=None, mpp=None, order=None, checked=None):
    """Launch PyTorch's prefill attention on (B, H, L, D) tensors as its host (Attention.mm) binds it; ``mpp``
    "a10" or "a9" runs the Metal 4 tensor-op kernel of that GPU class instead (MppAttention.h, MSL 4.0).
    Returns (out, LaunchStats)."""
    B, H, ql, d = q.shape
    Hk, kl = k.shape[1], k.shape[2]
    bq, bk, wm = pytorch_prefill_blocks(d, mpp is not None)
    o = torch.zeros_like(q)
    strides = [s for t in (q, k, v, o) for s in t.stride()[:3]]
    header = PREFILL_HEADER if mpp is None else MPP_HEADER
    params = struct.pack(struct_format(inc, PREFILL_HEADER, "PrefillAttnParams"), B, H, d, ql, kl, H // Hk, scale,
                         1.0, *strides)
    lib = compile_source(_pytorch_source(header), f"pytorch_{header.stem}.metal", [inc], math_mode="safe",
                         language_version="4.0" if mpp else None)
    dt = PYTORCH_TYPES[q.dtype]
    if mask is not None:
        mask = mask.expand(B, H, ql, kl)
        mask_params = struct.pack(struct_format(inc, PREFILL_HEADER, "PrefillAttnMaskParams"), *mask.stride())
        bufs = {5: mask_params, 6: mask}
    else:
        bufs = {5: bytes(4), 6: bytes(4)}  # the host binds a 4-byte zero to each; the kernel never reads them
    kind = dt if mask is None or mask.dtype != torch.bool else "bool_"
    name = (f"prefill_attention{f'_mpp_{mpp}' if mpp else ''}_{dt}_bq{bq}_bk{bk}_bd{d}_wm{wm}_wn1"
            f"_hm{int(mask is not None)}_dc{int(causal)}_mask{kind}")
    st = lib[name](q, k, v, o, buffers={4: params, **bufs}, grid=(-(-ql // bq) * 32, H * wm, B),
                   threadgroup=(32, wm, 1), order=order, checked=checked)
    return o, st


PYTORCH_DECODE_BLOCKS = 32  # the two-pass decode's key blocks (Attention.mm)


def pytorch_decode_two_pass(q, k) -> bool:
    """Whether torch's host takes the two-pass decode: 1K+ keys, or 4K+ with grouped heads."""
    return k.shape[2] >= 1024 or (k.shape[1] < q.shape[1] and k.shape[2] >= 4096)


def run_pytorch_decode(inc, q, k, v, scale, *, causal=False, mask=None, two_pass=None, order=None, checked=None):
    """Launch PyTorch's sdpa_vector decode (DecodeAttention.h, at most 8 query rows) on (B, H, L, D) tensors as
    its host binds it: nothing at the mask's slots without a mask.  ``two_pass`` None: as the host decides.
    Returns (out, [LaunchStats per pass])."""
    B, H, ql, d = q.shape
    Hk, kl = k.shape[1], k.shape[2]
    if two_pass is None:
        two_pass = pytorch_decode_two_pass(q, k)
    lib = compile_source(_pytorch_source(DECODE_HEADER), "pytorch_decode.metal", [inc], math_mode="safe")
    t = PYTORCH_METAL_TYPES[q.dtype]
    suffix = ("none" if mask is None else "bool" if mask.dtype == torch.bool else t) + ("_causal" if causal else "")
    o = torch.zeros_like(q)
    dims = struct.pack("<2I", H // Hk, kl)
    heads = struct.pack("<3I", q.stride(1), k.stride(1), v.stride(1))
    seqs = struct.pack("<3I", q.stride(2), k.stride(2), v.stride(2))
    tail = struct.pack("<4I", q.stride(0), k.stride(0), v.stride(0), H)
    masks = {}
    if mask is not None:
        mask = mask.expand(B, H, ql, kl)
        masks = {0: mask, 1: struct.pack("<4I", *(mask.stride(i) if mask.shape[i] > 1 else 0 for i in (3, 2, 1, 0)))}
    if not two_pass:
        bufs = {4: dims[:4], 5: dims[4:], 6: heads, 7: seqs, 8: struct.pack("<f", scale), 11: tail}
        bufs.update({9 + i: m for i, m in masks.items()})
        st = lib[f"sdpa_vector_{t}_{d}_{d}_mask{suffix}"](q, k, v, o, buffers=bufs, grid=(B * H * 1024, ql, 1),
                                                           threadgroup=(1024, 1, 1), order=order, checked=checked)
        return o, [st]
    blocks = PYTORCH_DECODE_BLOCKS
    partial = torch.zeros(B, H, ql, blocks, d, dtype=q.dtype)
    sums = torch.zeros(B, H, ql, blocks)
    maxs = torch.zeros(B, H, ql, blocks)
    bufs = {4: sums, 5: maxs, 6: dims[:4], 7: dims[4:], 8: heads, 9: seqs, 10: struct.pack("<f", scale), 13: tail}
    bufs.update({11 + i: m for i, m in masks.items()})
    st1 = lib[f"sdpa_vector_2pass_1_{t}_{d}_{d}_mask{suffix}"](
        q, k, v, partial, buffers=bufs, grid=(B * H * 256, ql, blocks), threadgroup=(256, 1, 1), order=order,
        checked=checked)
    st2 = lib[f"sdpa_vector_2pass_2_{t}_{d}"](partial, sums, maxs, o, grid=(B * H * 1024, ql, 1),
                                               threadgroup=(1024, 1, 1), order=order, checked=checked)
    return o, [st1, st2]


def default_scale(head_dim: int) -> float:
    return 1 / math.sqrt(head_dim)


__all__ = ["MLX_NAX_GEMM_TILES", "MLX_NAX_HEAD_DIMS", "MLX_NAX_TYPES", "MLX_PARAM_BUFFERS", "MLX_STEEL", "MLX_TYPES", "PYTORCH_PARAM_BUFFERS", "TOL", "attention_reference",
           "compile_source", "default_scale", "max_error", "mlx_steel_blocks", "pytorch_include",
           "pytorch_decode_two_pass", "pytorch_prefill_blocks", "pytorch_wheel_include", "run_mlx_nax_attention",
           "run_mlx_nax_gemm", "run_mlx_steel", "run_pytorch_decode", "run_pytorch_prefill", "struct_format"]
