"""Other people's Metal kernels through the emulator: compile them unmodified, run them on small
inputs and compare with a float64 torch reference.

Nothing is fetched and no third-party code is in this repository: point the script at sources
you have (the instantiations below are ours; the kernels are theirs, read from your folders):

    --mlx DIR      an MLX include folder holding mlx/backend/metal/kernels/*.h (the
                   mlx-metal wheel's mlx/include, e.g. `pip download mlx-metal==0.32.4`
                   and unzip): sdpa_vector (1- and 2-pass, bool / float masks, causal,
                   sinks, GQA), steel attention (bool / float masks, causal, sinks),
                   softmax, gemv; and the Metal 4 (tensor ops) NAX kernels, compiled as
                   MSL 4.0: attention_nax (half / bfloat, D 64 / 96 / 128, causal, bool
                   mask, ragged lengths, GQA) and steel_gemm_fused_nax (transposes, ragged
                   M / N / K, axpby, three tilings); --nax-only runs just those
    --llama DIR    llama.cpp's ggml/src (e.g. the llama-cpp-python 0.3.36 sdist's
                   vendor/llama.cpp/ggml/src): every ggml-metal/kernels/*.metal is compiled,
                   soft_max / rms_norm / norm / rope run
    --pytorch DIR  a folder holding PyTorch's aten/src/ATen/native/mps/kernels/RMSNorm.metal
                   (compiled against the installed torch's c10/metal headers, which are
                   compiled and used by a small kernel of ours in any case)
    --torch-kernels VERSION (default 2.15.0; "none" to skip)
                   torch's own attention kernels from that release's macOS wheel (pip
                   downloads it once; only ATen/native/mps/kernels and c10/metal are
                   extracted, into ~/.cache/torch_metal_flash/macos-cross), launched as
                   torch's host binds them, in MSL 4.0 and safe math as torch builds them:
                   the prefill kernel (bool / float masks, causal, GQA, ragged lengths), the
                   sdpa_vector decode in one and two passes (unmasked: nothing bound at the
                   mask's slots; bool / float masks; GQA) and the tensor-op prefill for
                   Apple10 (a10, run as apple10) and Apple8/9 (a9, run as apple8 and apple9)

    python bench/third_party_kernels.py --mlx DIR --llama DIR --pytorch DIR [--orders forward,reverse]

Each line: kernel, configuration, schedule order, max |error| against the reference and the
tolerance of its dtype.  bench/results/third_party_kernels.md records a run.
"""
from __future__ import annotations

import ctypes as C
import math
import sys
import time
from pathlib import Path

import torch

import harness

from torch_metal_flash import emulator

from peer_kernels import (MLX_NAX_GEMM_TILES, MLX_NAX_HEAD_DIMS, MLX_NAX_TYPES, MLX_TYPES, TOL, attention_reference,
                          compile_source, max_error, pytorch_decode_two_pass, pytorch_wheel_include,
                          run_mlx_nax_attention, run_mlx_nax_gemm, run_mlx_steel, run_pytorch_decode,
                          run_pytorch_prefill)

results = []  # (name, ok)


def report(name, out, ref, order, dtype):
    err, ok = max_error(out, ref)
    results.append((name, ok))
    print(f"{'ok  ' if ok else 'FAIL'} {name:70s} {order:8s} max|err| {err:.1e} (tol {TOL[dtype]:.0e})", flush=True)


# ---------------------------------------------------------------- MLX

MLX_SDPA = """#include <metal_stdlib>
#include "mlx/backend/metal/kernels/utils.h"
#include "mlx/backend/metal/kernels/sdpa_vector.h"
using namespace metal;
""" + "".join(f"""
instantiate_kernel("sdpa_vector_{n}_{d}", sdpa_vector, {t}, {d}, {d})
instantiate_kernel("sdpa_vector_2pass_1_{n}_{d}", sdpa_vector_2pass_1, {t}, {d}, {d})
instantiate_kernel("sdpa_vector_2pass_2_{n}_{d}", sdpa_vector_2pass_2, {t}, {d})""" for n, (t, _) in MLX_TYPES.items()
                  for d in (64, 128)) + "\n"

MLX_SMALL = """#include <metal_stdlib>
using namespace metal;
#include "mlx/backend/metal/kernels/bf16.h"
#include "mlx/backend/metal/kernels/defines.h"
#include "mlx/backend/metal/kernels/utils.h"
#include "mlx/backend/metal/kernels/softmax.h"
#include "mlx/backend/metal/kernels/steel/utils.h"
#include "mlx/backend/metal/kernels/gemv.h"
""" + "".join(f"""
instantiate_kernel("block_softmax_{n}", softmax_single_row, {t}, float)
instantiate_kernel("looped_softmax_{n}", softmax_looped, {t}, float)
instantiate_kernel("gemv_{n}", gemv, {t}, 2, 1, 1, 32, 4, 4, false, false)
instantiate_kernel("gemv_t_{n}", gemv_t, {t}, 1, 2, 8, 4, 4, 4, false, false)""" for n, (t, _) in MLX_TYPES.items()) + "\n"


def mlx_sdpa_vector(inc, order, n, d, mask_kind, causal, sinks, two_pass):
    dt = MLX_TYPES[n][1]
    B, Hq, Hk, ql, kl = 1, 4, 2, (2 if two_pass else 3), 301 if two_pass else 77
    q, k, v = (torch.randn(B, h, l, d).to(dt) for h, l in ((Hq, ql), (Hk, kl), (Hk, kl)))
    mask = {None: None, "bool": torch.rand(B, Hq, ql, kl) > 0.3,
            "float": torch.randn(B, Hq, ql, kl).to(dt)}[mask_kind]
    sk = torch.randn(Hq).to(dt) if sinks else None
    scale = 1 / math.sqrt(d)
    blocks = 32
    fcs = {20: mask is not None, 21: False, 22: causal, 23: mask_kind == "bool", 24: mask_kind == "float",
           25: sinks, 26: blocks}
    lib = compile_source(MLX_SDPA, "mlx_sdpa.metal", [inc], function_constants=fcs)
    o = torch.zeros(B, Hq, ql, d, dtype=dt)
    first = 13 if two_pass else 11
    bufs = {}
    if mask is not None:
        bufs.update({first + (0 if mask.dtype == torch.bool else 1): mask, first + 2: 1, first + 3: kl,
                     first + 4: ql * kl})
    if not two_pass:
        bufs.update({4: Hq // Hk, 5: kl, 6: kl * d, 7: d, 8: kl * d, 9: d, 10: scale})
        if sinks:
            bufs.update({16: sk, 17: Hq})
        lib[f"sdpa_vector_{n}_{d}"](q, k, v, o, buffers=bufs, grid=(B * Hq * 1024, ql, 1), threadgroup=(1024, 1, 1),
                                    order=order)
    else:
        bufs.update({7: kl, 8: kl * d, 9: d, 10: kl * d, 11: d, 12: scale})
        if sinks:
            bufs[18] = sk
        part = torch.zeros(B * Hq * ql, blocks, d, dtype=dt)
        sums, maxs = torch.zeros(B * Hq * ql, blocks), torch.zeros(B * Hq * ql, blocks)
        G = Hq // Hk
        lib[f"sdpa_vector_2pass_1_{n}_{d}"](q, k, v, part, sums, maxs, buffers=bufs, grid=(Hk * 32, B * G, blocks * ql),
                                            threadgroup=(32, G, ql), order=order)
        lib[f"sdpa_vector_2pass_2_{n}_{d}"](part, sums, maxs, o, blocks, grid=(B * Hq * 1024, ql, 1),
                                            threadgroup=(1024, 1, 1), order=order)
    name = f"mlx sdpa_vector{'_2pass' if two_pass else ''} {n} D{d} mask={mask_kind} causal={causal} sinks={sinks}"
    report(name, o, attention_reference(q, k, v, scale, mask, causal, sk), order, dt)


def mlx_steel_attention(inc, order, n, d, mask_kind, causal, sinks, ql=37, kl=45, H=4, Hk=2):
    dt = MLX_TYPES[n][1]
    q, k, v = torch.randn(1, H, ql, d).to(dt), torch.randn(1, Hk, kl, d).to(dt), torch.randn(1, Hk, kl, d).to(dt)
    mask = {None: None, "bool": torch.rand(1, H, ql, kl) > 0.3, "float": torch.randn(1, H, ql, kl).to(dt)}[mask_kind]
    if mask_kind == "bool":
        mask[..., 0] = True  # no empty row
    sk = torch.randn(H).to(dt) if sinks else None
    scale = 1 / math.sqrt(d)
    o, _ = run_mlx_steel(inc, q, k, v, scale, mask=mask, causal=causal, sinks=sk, order=order)
    name = f"mlx steel_attention {n} D{d} mask={mask_kind} causal={causal} sinks={sinks}"
    report(name, o, attention_reference(q, k, v, scale, mask, causal, sk), order, dt)


def mlx_small(inc, order):
    lib = compile_source(MLX_SMALL, "mlx_small.metal", [inc])
    for n, (_, dt) in MLX_TYPES.items():
        for looped in (False, True):
            cols = 5000 if looped else 333  # MLX loops above 4096 columns, with 1024 threads
            x = torch.randn(3, cols).to(dt)
            y = torch.zeros_like(x)
            tg = 1024 if looped else ((cols + 3) // 4 + 31) // 32 * 32
            lib[f"{'looped' if looped else 'block'}_softmax_{n}"](x, y, cols, grid=(3 * tg,), threadgroup=(tg,),
                                                                   order=order)
            report(f"mlx {'looped' if looped else 'block'}_softmax {n}", y, torch.softmax(x.double(), -1), order, dt)
        for trans in (False, True):
            n_in, n_out = 200, 70
            mat = torch.randn(n_in, n_out).to(dt) if trans else torch.randn(n_out, n_in).to(dt)
            vec, out, z = torch.randn(n_in).to(dt), torch.zeros(n_out, dtype=dt), torch.zeros(1, dtype=torch.int64)
            (bm, bn), per_tg = ((1, 2), 2 * 4 * 4) if trans else ((2, 1), 2 * 1 * 4)
            # gemv and gemv_t recompute their last rows in two simdgroups (the same values written
            # twice): checked mode reports that as a race (docs/emulator.md), so they run unchecked
            lib[f"gemv_{'t_' if trans else ''}{n}"](
                mat, vec, out, out, n_in, n_out, n_out if trans else n_in, 1.0, 0.0, 1, torch.ones(1, dtype=torch.int32),
                z, z, z, 0, grid=(-(-n_out // per_tg) * 32, bn, bm), threadgroup=(32, bn, bm), order=order,
                checked=False)
            ref = vec.double() @ mat.double() if trans else mat.double() @ vec.double()
            report(f"mlx gemv{'_t' if trans else ''} {n} ({n_out}x{n_in})", out, ref, order, dt)


def run_mlx(inc, orders, quick):
    for order in orders:
        for n in (("float32", "float16") if quick else MLX_TYPES):
            for two_pass in (False, True):
                for mask_kind, causal, sinks in ((None, False, False), ("bool", False, True), ("float", True, False)):
                    mlx_sdpa_vector(inc, order, n, 64 if mask_kind != "bool" else 128, mask_kind, causal, sinks,
                                    two_pass)
            for d in (64, 128):
                for mask_kind, causal, sinks in ((None, False, False), ("bool", True, True), ("float", True, False)):
                    mlx_steel_attention(inc, order, n, d, mask_kind, causal, sinks)
        mlx_small(inc, order)


def mlx_nax_attention(inc, order, n, d, causal, mask_kind=None, ql=77, kl=100, H=4, Hk=2):
    """MLX's attention_nax (Metal 4 tensor ops): ragged qL / kL (not multiples of BQ 64 / BK 32), GQA."""
    dt = MLX_NAX_TYPES[n][1]
    q, k, v = torch.randn(1, H, ql, d).to(dt), torch.randn(1, Hk, kl, d).to(dt), torch.randn(1, Hk, kl, d).to(dt)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(1, H, ql, kl) > 0.3
        mask[..., 0] = True  # no empty row (the causal diagonal, bottom-right, keeps key 0 for every row)
    scale = 1 / math.sqrt(d)
    o, st = run_mlx_nax_attention(inc, q, k, v, scale, mask=mask, causal=causal, order=order)
    assert st.tensor_matmuls > 0 and st.simdgroup_matrix_multiplies == 0
    name = f"mlx attention_nax {n} D{d} qL{ql} kL{kl} GQA{H // Hk} causal={causal} mask={mask_kind}"
    report(name, o, attention_reference(q, k, v, scale, mask, causal), order, dt)


def mlx_nax_gemm(inc, order, n, M, N, K, ta, tb, tile, addmm=False):
    """MLX's fused NAX GEMM (Metal 4 tensor ops), D = A B or alpha A B + beta C."""
    dt = MLX_NAX_TYPES[n][1]
    a = torch.randn(K, M).to(dt) if ta else torch.randn(M, K).to(dt)
    b = torch.randn(N, K).to(dt) if tb else torch.randn(K, N).to(dt)
    c = torch.randn(M, N).to(dt) if addmm else None
    d, st = run_mlx_nax_gemm(inc, a, b, transpose_a=ta, transpose_b=tb, tile=tile, c=c, alpha=0.5, beta=2.0,
                             order=order)
    assert st.tensor_matmuls > 0
    ref = (a.double().t() if ta else a.double()) @ (b.double().t() if tb else b.double())
    if addmm:
        ref = 0.5 * ref + 2.0 * c.double()
    name = (f"mlx steel_gemm_fused_nax {'t' if ta else 'n'}{'t' if tb else 'n'} {n} {M}x{N}x{K} "
            f"bm{tile[0]} bn{tile[1]} bk{tile[2]} wm{tile[3]} wn{tile[4]}{' axpby' if addmm else ''}")
    report(name, d, ref, order, dt)


def run_mlx_nax(inc, orders, quick):
    for order in orders:
        for n in MLX_NAX_TYPES:
            for d in MLX_NAX_HEAD_DIMS:
                for causal in (False, True):
                    mlx_nax_attention(inc, order, n, d, causal)
            mlx_nax_attention(inc, order, n, 64, True, mask_kind="bool")
            mlx_nax_attention(inc, order, n, 64, False, ql=128, kl=96)  # aligned blocks
            tile = MLX_NAX_GEMM_TILES[1]
            for ta in (False, True):
                for tb in (False, True):
                    mlx_nax_gemm(inc, order, n, 70, 150, 300, ta, tb, tile)  # ragged M, N, K
            mlx_nax_gemm(inc, order, n, 64, 128, 512, False, False, tile, addmm=True)  # aligned
            if not quick:
                mlx_nax_gemm(inc, order, n, 100, 90, 270, False, False, MLX_NAX_GEMM_TILES[0])
                mlx_nax_gemm(inc, order, n, 130, 140, 530, False, False, MLX_NAX_GEMM_TILES[2])


# ---------------------------------------------------------------- llama.cpp

i32, u64, f32 = C.c_int32, C.c_uint64, C.c_float


class SoftMaxArgs(C.Structure):  # ggml_metal_kargs_soft_max
    _fields_ = [("ne00", i32), ("ne01", i32), ("ne02", i32), ("nb01", u64), ("nb02", u64), ("nb03", u64),
                ("ne11", i32), ("ne12", i32), ("ne13", i32), ("nb11", u64), ("nb12", u64), ("nb13", u64),
                ("nb1", u64), ("nb2", u64), ("nb3", u64), ("scale", f32), ("max_bias", f32), ("m0", f32),
                ("m1", f32), ("n_head_log2", i32)]


class NormArgs(C.Structure):  # ggml_metal_kargs_norm
    _fields_ = [("ne00", i32), ("ne00_t", i32), ("nb1", u64), ("nb2", u64), ("nb3", u64), ("eps", f32),
                ("nef1", i32 * 3), ("nef2", i32 * 3), ("nef3", i32 * 3), ("nbf1", u64 * 3), ("nbf2", u64 * 3),
                ("nbf3", u64 * 3), ("scale", f32)]


class RopeArgs(C.Structure):  # ggml_metal_kargs_rope
    _fields_ = [(f, i32) for f in ("ne00", "ne01", "ne02", "ne03")] + \
               [(f, u64) for f in ("nb00", "nb01", "nb02", "nb03")] + \
               [(f, i32) for f in ("ne0", "ne1", "ne2", "ne3")] + [(f, u64) for f in ("nb0", "nb1", "nb2", "nb3")] + \
               [(f, i32) for f in ("n_past", "n_dims", "n_offs", "n_ctx_orig")] + \
               [(f, f32) for f in ("freq_base", "freq_scale", "ext_factor", "attn_factor", "beta_fast", "beta_slow")] + \
               [(f, i32) for f in ("sect_0", "sect_1", "sect_2", "sect_3")] + [("src2", C.c_bool), ("inplace", C.c_bool)]


def run_llama(src, orders, quick):
    kernels = src / "ggml-metal" / "kernels"
    inc = [src, src / "ggml-metal", kernels]

    def lib(name, **kw):
        return emulator.compile_shader(kernels / f"{name}.metal", include_dirs=[str(i) for i in inc],
                                       math_mode="relaxed", **kw)

    for path in sorted(kernels.glob("*.metal")):
        if path.stem.endswith("_common"):
            continue  # included by the others, not a translation unit
        t = time.perf_counter()
        try:
            n = len(lib(path.stem).kernel_names)
            msg, ok = f"{n} kernels ({time.perf_counter() - t:.1f} s)", True
        except emulator.CompileError as e:
            msg, ok = str(e).splitlines()[0], False
        results.append((f"llama compile {path.name}", ok))
        print(f"{'ok  ' if ok else 'FAIL'} llama compile {path.name:40s} {msg}", flush=True)
    for order in orders:
        for mdt in (torch.float32, torch.float16):
            for vec4 in (False, True):
                x, m = torch.randn(3, 5, 200), torch.randn(5, 200).to(mdt)
                y = torch.zeros_like(x)
                a = SoftMaxArgs(200, 5, 3, 800, 4000, 12000, 5, 1, 1, m.stride(0) * m.element_size(), 0, 0, 800, 4000,
                                12000, 0.5, 0.0, 1.0, 1.0, 0)
                name = f"kernel_soft_max_{'f16' if mdt == torch.float16 else 'f32'}{'_4' if vec4 else ''}"
                lib("softmax")[name](a, x, m, x, y, grid=(5 * 64, 3, 1), threadgroup=(64, 1, 1),
                                     threadgroup_memory={0: 128}, order=order)
                report(f"llama {name}", y, torch.softmax(x.double() * 0.5 + m.double(), -1), order, torch.float32)
        for kind in ("rms_norm", "norm"):
            for vec4 in (False, True):
                n, rows = 256, 6
                x, w = torch.randn(rows, n), torch.randn(n)
                y = torch.zeros_like(x)
                a = NormArgs(n, n // 4 if vec4 else n, n * 4, n * 4 * rows, n * 4 * rows, 1e-5, (rows, 1, 1), (1, 1, 1),
                             (1, 1, 1), (n * 4, 0, 0), (n * 4 * rows, 0, 0), (n * 4 * rows, 0, 0), 1.0)
                name = f"kernel_{kind}_mul_f32{'_4' if vec4 else ''}"
                lib("norm", function_constants={1700: False})[name](
                    a, x, w, w, y, grid=(rows * 64, 1, 1), threadgroup=(64, 1, 1), threadgroup_memory={0: 128},
                    order=order)
                xd = x.double()
                ref = (xd / torch.sqrt((xd ** 2).mean(-1, keepdim=True) + 1e-5) if kind == "rms_norm"
                       else torch.nn.functional.layer_norm(xd, (n,), eps=1e-5)) * w.double()
                report(f"llama {name}", y, ref, order, torch.float32)
        for neox in (False, True):
            for dt in (torch.float32, torch.float16):
                T, H, D, n_dims = 5, 3, 64, 48
                x, y = torch.randn(T, H, D).to(dt), torch.zeros(T, H, D, dtype=dt)
                pos = torch.tensor([3, 0, 7, 100, 41], dtype=torch.int32)
                e = x.element_size()
                st = (e, D * e, H * D * e, T * H * D * e)
                a = RopeArgs(D, H, T, 1, *st, D, H, T, 1, *st, 0, n_dims, 0, 4096, 10000.0, 1.0, 0.0, 1.0, 32.0, 1.0,
                             0, 0, 0, 0, False, False)
                name = f"kernel_rope_{'neox' if neox else 'norm'}_{'f16' if dt == torch.float16 else 'f32'}"
                lib("rope", function_constants={800: False, 801: False})[name](
                    a, x, pos, x, y, grid=(H * 32, T, 1), threadgroup=(32, 1, 1), order=order)
                ref = x.double().clone()
                theta = pos.double()[:, None] * 10000.0 ** (-2 * torch.arange(n_dims // 2).double() / n_dims)
                c, s = torch.cos(theta)[:, None], torch.sin(theta)[:, None]
                lo, hi = (slice(0, n_dims // 2), slice(n_dims // 2, n_dims)) if neox else \
                    (slice(0, n_dims, 2), slice(1, n_dims, 2))
                a0, a1 = ref[..., lo].clone(), ref[..., hi].clone()
                ref[..., lo], ref[..., hi] = a0 * c - a1 * s, a0 * s + a1 * c
                report(f"llama {name}", y, ref, order, dt)


# ---------------------------------------------------------------- PyTorch

C10_PROBE = """#include <c10/metal/utils.h>
#include <c10/metal/reduction_utils.h>
#include <c10/metal/special_math.h>
#include <c10/metal/indexing.h>
#include <c10/metal/atomic.h>
#include <c10/metal/random.h>
using namespace metal;
kernel void row_sums(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                     uint lane [[thread_index_in_simdgroup]], uint tg [[threadgroup_position_in_grid]]) {
  float v = c10::metal::simd_sum(x[tg * 32 + lane]);
  if (lane == 0) out[tg] = v;
}
"""


def run_pytorch(root, orders, quick):
    torch_include = Path(torch.__file__).parent / "include"
    lib = compile_source(C10_PROBE, "c10_probe.metal", [torch_include])
    for order in orders:
        x, out = torch.randn(4, 32), torch.zeros(4)
        lib.row_sums(x, out, grid=128, threadgroup=32, order=order)
        report("pytorch c10/metal headers: simd_sum", out, x.double().sum(-1), order, torch.float32)
    if root is None:
        return
    kernels = root / "aten/src/ATen/native/mps/kernels"
    rms = emulator.compile_shader(kernels / "RMSNorm.metal", include_dirs=[str(root), str(torch_include)])
    for order in orders:
        for dt, tname in ((torch.float32, "float"), (torch.float16, "half")):
            for looped in (False, True):
                x, w = torch.randn(5, 300).to(dt), torch.randn(300).to(dt)
                y = torch.zeros_like(x)
                tg = 32 if looped else 96
                name = f"rms_norm_{'looped_' if looped else ''}{tname}"
                rms[name](x, w, y, 1e-5, 300, 1, grid=(5 * tg,), threadgroup=(tg,), order=order)
                xd = x.double()
                report(f"pytorch {name}", y, xd / torch.sqrt((xd ** 2).mean(-1, keepdim=True) + 1e-5) * w.double(),
                       order, dt)


def _torch_mask(kind, shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if kind == "bool":
        return torch.rand(shape, generator=g) > 0.3
    return (torch.randn(shape, generator=g) * 2).to(dtype) if kind == "float" else None


def run_torch_kernels(version, orders, quick):
    """torch ``version``'s prefill, decode and tensor-op attention from its wheel, as its host binds them."""
    inc = pytorch_wheel_include(version)
    dtypes = (torch.float16,) if quick else (torch.float16, torch.bfloat16, torch.float32)
    g = torch.Generator().manual_seed(0)

    def rand(*shape, dtype):
        return torch.randn(*shape, generator=g).to(dtype)

    for dt in dtypes:
        for d in (64, 128):
            for mask_kind, causal in ((None, False), (None, True), ("bool", False), ("float", False)):
                q, k, v = rand(2, 4, 37, d, dtype=dt), rand(2, 2, 45, d, dtype=dt), rand(2, 2, 45, d, dtype=dt)
                mask = _torch_mask(mask_kind, (2, 1, 37, 45), dt, d)
                visible = torch.arange(45)[None] <= torch.arange(37)[:, None] if causal else mask
                ref = attention_reference(q, k, v, d ** -0.5, mask=visible)
                for order in orders:
                    out, _ = run_pytorch_prefill(inc, q, k, v, d ** -0.5, causal=causal, mask=mask, order=order,
                                                 checked=True)
                    report(f"torch {version} prefill {dt} d{d} mask={mask_kind} causal={causal} GQA 4:2 37x45",
                           out, ref, order, dt)
            for kl in (300, 1100, 4100):
                for mask_kind in (None, "bool", "float"):
                    q, k, v = rand(1, 8, 1, d, dtype=dt), rand(1, 2, kl, d, dtype=dt), rand(1, 2, kl, d, dtype=dt)
                    mask = _torch_mask(mask_kind, (1, 8, 1, kl), dt, kl)
                    ref = attention_reference(q, k, v, d ** -0.5, mask=mask)
                    passes = 2 if pytorch_decode_two_pass(q, k) else 1
                    for order in orders:
                        out, _ = run_pytorch_decode(inc, q, k, v, d ** -0.5, mask=mask, order=order, checked=True)
                        report(f"torch {version} sdpa_vector {passes}-pass {dt} d{d} mask={mask_kind} GQA 8:2 "
                               f"kL {kl}", out, ref, order, dt)
    for dt in dtypes[:2] if not quick else dtypes:
        if dt == torch.float32:
            continue
        for arch, families in (("a10", ("apple10",)), ("a9", ("apple8", "apple9"))):
            for causal in (False, True):
                q, k, v = rand(1, 4, 70, 64, dtype=dt), rand(1, 2, 70, 64, dtype=dt), rand(1, 2, 70, 64, dtype=dt)
                ref = attention_reference(q, k, v, 0.125, causal=causal)
                for family in families:
                    for order in orders:
                        with emulator.settings(family=family):
                            out, _ = run_pytorch_prefill(inc, q, k, v, 0.125, causal=causal, mpp=arch, order=order,
                                                         checked=True)
                        report(f"torch {version} tensor-op prefill {arch} as {family} {dt} d64 causal={causal} "
                               f"GQA 4:2 70x70", out, ref, order, dt)


def main():
    ap = harness.parser(__doc__)
    ap.add_argument("--mlx", type=Path, help="MLX include folder (mlx/backend/metal/kernels inside)")
    ap.add_argument("--llama", type=Path, help="llama.cpp ggml/src folder")
    ap.add_argument("--pytorch", type=Path, help="PyTorch source root (aten/src/ATen/native/mps/kernels inside)")
    ap.add_argument("--torch-kernels", default="2.15.0", metavar="VERSION",
                    help="torch release whose attention kernels to run from its macOS wheel ('none': skip)")
    ap.add_argument("--orders", default="forward,reverse", help="schedule orders (forward, reverse, random)")
    ap.add_argument("--quick", action="store_true", help="fewer dtypes (MLX's NAX kernels: fewer GEMM tilings)")
    ap.add_argument("--nax-only", action="store_true",
                    help="of MLX, only the NAX kernels (Metal 4 tensor ops: attention_nax, steel_gemm_fused_nax)")
    args = ap.parse_args()
    torch.manual_seed(0)
    orders = args.orders.split(",")
    if args.mlx:
        if not args.nax_only:
            run_mlx(args.mlx, orders, args.quick)
        run_mlx_nax(args.mlx, orders, args.quick)
    if args.llama:
        run_llama(args.llama, orders, args.quick)
    run_pytorch(args.pytorch, orders, args.quick)
    if args.torch_kernels != "none":
        run_torch_kernels(args.torch_kernels, orders, args.quick)
    bad = [n for n, ok in results if not ok]
    print(f"\n{len(results) - len(bad)}/{len(results)} ok" + (": failed " + ", ".join(bad) if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
