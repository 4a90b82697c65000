"""Whole attention problems for property-based tests (hypothesis), every face.

A *problem* is a plain dict drawn by :func:`problems`: the face, the sizes,
the dtype, the memory layout of every input (order of the dims in memory,
padding, storage offset), the K/V storage (q's dtype, float16/bfloat16 under a
float32 q, or quantized) and the features (masks, band, softcap, ALiBi, sinks,
extreme values ...).  A :class:`Face` knows how to build its inputs from a
problem, how to call the face under test, and the face's documented semantics
as plain dense math (:func:`dense_attention`), written from the public
contract (torch / flash-attn docs), not from the package's mapping.
:func:`check_problem` runs the kernels (emulator, checked mode, strict) in two
schedule orders and holds the results to the float64 oracle under the rule of
:mod:`torch_metal_flash.testing` (the budget: the plain math in the inputs'
dtype of the very problems the face's math states, see :func:`budget`),
forward and backward, and the two runs to each other bit for bit.

Dropout (the SDPA, override and flash-attn faces): the face draws its Philox
``rng_state`` from torch's default generator seeded with the problem's seed, and the
oracle applies the keep mask :mod:`torch_metal_flash.problem.philox` computes from the same
state (:func:`dropout_keep`).

Later features plug in with a line or two: a draw in the face's strategy and, while the
kernels do not cover it, the :func:`runs_on_kernels` predicate.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
import math
import warnings
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from hypothesis import strategies as st

from torch_metal_flash import backends, emulator
from torch_metal_flash import nn as tmf_nn
import torch_metal_flash.ops as ops
from torch_metal_flash.faces.functional import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                                                flash_attn_varlen_func, scaled_dot_product_attention)
from torch_metal_flash.faces.kvcache import flash_attn_with_kvcache
from torch_metal_flash.faces.sdpa_override import sdpa_override, sdpa_stats
from torch_metal_flash.problem import philox
from torch_metal_flash.problem.quant import QuantizedTensor, flat_format, quantize
from torch_metal_flash.problem.spec import make_spec

import support.kvcache_oracle as kvcache_oracle
import torch_metal_flash.testing.oracle as oracle

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "f64": torch.float64}
KERNEL_DTYPES = ("f32", "f16", "bf16")
MAX_KERNEL_HEAD_DIM = 512  # every kernel family (decode also K 576 / V 512, not drawn here)
ORDER_PAIRS = (("forward", "reverse"), ("reverse", "random"), ("random", "forward"))
SATURATED = -1e37  # spec.py: rows whose scores are all below this pass no gradient


# ---------------------------------------------------------------------------
# Sizes and features
# ---------------------------------------------------------------------------

def _length(draw, big: bool = False) -> int:
    if big:  # the decode route / caches above 256 rows, sparsely
        return draw(st.integers(256, 300))
    return draw(st.one_of(st.sampled_from((0, 1, 1, 2, 3, 5, 8, 17)), st.integers(1, 48)))


def _head_dim(draw) -> int:
    """Mostly small and awkward (not a multiple of 8); sparsely 129..512 and beyond the kernels."""
    return draw(st.one_of(st.sampled_from((1, 3, 8, 13, 16, 32, 40, 64)), st.integers(1, 72),
                          st.integers(129, 256), st.integers(257, MAX_KERNEL_HEAD_DIM),
                          st.just(MAX_KERNEL_HEAD_DIM + 8)))


def _heads(draw) -> tuple[int, int]:
    """(Hq, Hkv): MHA, GQA or MQA."""
    hkv = draw(st.sampled_from((1, 1, 2, 3)))
    return hkv * draw(st.sampled_from((1, 1, 2, 4))), hkv


def draw_sizes(draw, *, gqa: bool = True, dv: bool = True, decode_ok: bool = True) -> dict:
    dtype = draw(st.sampled_from(("f32", "f16", "bf16", "f32", "f16", "bf16", "f64")))
    hq, hkv = _heads(draw) if gqa else (draw(st.integers(1, 3)),) * 2
    decode = decode_ok and draw(st.integers(0, 9)) == 0
    d = _head_dim(draw)
    if decode:  # few query rows, >= 256 keys: the split-K decode kernels of the non-cache faces
        lq, lk = draw(st.integers(1, 3)), _length(draw, big=True)
        d = min(d, 64)
    else:
        lq, lk = _length(draw), _length(draw)
    if d > 128:  # wide heads: keep the problem small
        lq, lk = min(lq, 9), min(lk, 17)
    return dict(dtype=dtype, batch=draw(st.sampled_from((1, 1, 2, 0, 3))), hq=hq, hkv=hkv, lq=lq, lk=lk, d=d,
                dv=draw(st.sampled_from((d, d, d, max(1, d // 2), d + 3))) if dv else d, decode=decode)


def draw_layout(draw, rank: int) -> dict:
    """Memory order of the outer dims (last dim stays contiguous), padding per dim
    (non-contiguous, never overlapping) and a storage offset."""
    order = list(draw(st.permutations(range(rank - 1)))) + [rank - 1]
    pad = [draw(st.sampled_from((0, 0, 0, 1, 3))) for _ in range(rank)]
    return dict(order=order, pad=pad, offset=draw(st.sampled_from((0, 0, 1, 5))))


def draw_extreme(draw, dtype: str) -> str:
    return draw(st.sampled_from(("none",) * 8 + ("big_scores", "nan_q", "nan_k", "nan_v")))


def draw_mask(draw, shape: tuple, dtype: str, min_rank: int = 1) -> Optional[dict]:
    """A bool or additive float mask broadcasting to ``shape`` (dims of size 1, fewer dims),
    with -inf / finfo.min entries and fully masked rows."""
    kind = draw(st.sampled_from(("none", "none", "bool", "float")))
    if kind == "none":
        return None
    keep = draw(st.integers(min_rank, len(shape)))  # leading dims dropped
    mshape = tuple(n if draw(st.booleans()) else 1 for n in shape[-keep:])
    fill = draw(st.sampled_from(("random", "random", "neginf", "finfo_min", "empty_rows")))
    mdtype = dtype if kind == "float" and draw(st.integers(0, 3)) else "f32"
    return dict(kind=kind, shape=mshape, fill=fill, dtype=mdtype,
                grad=kind == "float" and dtype != "f64" and draw(st.booleans()))


QUANT_FORMATS = ({"bits": 4, "mode": "affine"}, {"bits": 8, "mode": "affine"}, {"bits": 8, "mode": "symmetric"})


def draw_kv(draw, p: dict) -> None:
    """K/V storage: ``p["kv"]`` None (q's dtype, mostly), ``{"dtype"}``: float16 /
    bfloat16 under a float32 q (mixed precision), or ``{"dtype", "bits", "group_size", "mode"}``:
    quantized.  Both are inference only (no gradients) and need Dv = D."""
    kinds = ["same"] * 6
    if p["dtype"] in KERNEL_DTYPES:
        kinds += ["quantized"] * 2 + (["mixed"] if p["dtype"] == "f32" else [])
    kind = draw(st.sampled_from(kinds))
    p["kv"] = None
    if kind == "same":
        return
    p["dv"] = p["d"]
    if kind == "mixed":
        p["kv"] = {"dtype": draw(st.sampled_from(("f16", "bf16")))}
        return
    fmts = [f for f in QUANT_FORMATS if f["mode"] == "symmetric" or p["d"] % (32 // f["bits"]) == 0]
    kv_dtype = draw(st.sampled_from(("f32", "f16", "bf16"))) if p["dtype"] == "f32" else p["dtype"]
    p["kv"] = dict(draw(st.sampled_from(fmts)), group_size=draw(st.sampled_from((32, 64, 128))), dtype=kv_dtype)
    if p.get("extreme") in ("nan_k", "nan_v"):
        p["extreme"] = "none"  # a NaN has no quantized code


# ---------------------------------------------------------------------------
# Tensors
# ---------------------------------------------------------------------------

def strided(values: torch.Tensor, layout: dict, dtype: torch.dtype) -> torch.Tensor:
    """``values`` copied into a view with the layout's memory order, padding and
    storage offset; the padding is NaN, so reading outside the view shows."""
    shape = values.shape
    order, pad = layout["order"], layout["pad"]
    mem = [shape[d] + (pad[d] if shape[d] else 0) for d in order]
    n = math.prod(mem)
    base = torch.full((layout["offset"] + n,), float("nan"), dtype=dtype)
    view = base[layout["offset"]:].view(mem)[tuple(slice(0, shape[d]) for d in order)]
    view = view.permute([order.index(d) for d in range(len(order))])
    return view.copy_(values)


def kv_storage(p: dict, values: torch.Tensor, layout: dict):
    """K or V (float64 values) as the problem stores them: in q's dtype, in float16 /
    bfloat16 (mixed precision), or quantized from the values rounded to the K/V dtype."""
    kv = p.get("kv")
    if kv is None:
        return strided(values, layout, p_dtype(p))
    stored = strided(values, layout, DTYPES[kv["dtype"]])
    if "bits" not in kv:
        return stored
    return quantize(stored, bits=kv["bits"], group_size=kv["group_size"], mode=kv["mode"])


def randn(gen: torch.Generator, *shape) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def apply_extreme(p: dict, gen: torch.Generator, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int):
    """Scale q/k so scores come near the fp16 limit, or plant one NaN (float64 values, in place)."""
    e = p.get("extreme", "none")
    if e == "big_scores" and q.numel() and k.numel():
        # |q.k| up to ~6e4 (fp16's max is 65504) for every dtype; the scale then shrinks them.
        amp = (6e4 / max(1.0, (q.abs().amax() * k.abs().amax() * head_dim).item())) ** 0.5
        q.mul_(amp * 0.9)
        k.mul_(amp * 0.9)
    for name, t in (("nan_q", q), ("nan_k", k), ("nan_v", v)):
        if e == name and t.numel():
            idx = int(torch.randint(t.numel(), (1,), generator=gen))
            t.view(-1)[idx] = float("nan")


def make_mask(spec: Optional[dict], gen: torch.Generator) -> Optional[torch.Tensor]:
    if spec is None:
        return None
    shape = spec["shape"]
    if spec["kind"] == "bool":
        m = torch.rand(shape, generator=gen) > 0.3
        if spec["fill"] == "empty_rows" and m.dim() >= 2 and m.numel():
            m[..., 0, :] = False
        return m
    dt = DTYPES[spec["dtype"]]
    m = randn(gen, *shape)
    low = torch.finfo(dt).min
    if spec["fill"] == "neginf":
        m = m.masked_fill(torch.rand(shape, generator=gen) < 0.3, float("-inf"))
    elif spec["fill"] == "finfo_min" and m.dim() >= 2 and m.numel():
        m[..., 0, :] = low  # a padding row, as Hugging Face models build them
        m = m.masked_fill(torch.rand(shape, generator=gen) < 0.2, low)
    elif spec["fill"] == "empty_rows" and m.dim() >= 2 and m.numel():
        m[..., 0, :] = float("-inf")
    return m.to(dt)


# ---------------------------------------------------------------------------
# Dense semantics (the oracle in float64) and the hand-over to the budget
# ---------------------------------------------------------------------------

@contextlib.contextmanager
def seeded(p: dict):
    """torch's default generator at the problem's seed (restored after): where a face with
    dropout draws its Philox state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(p["seed"])
        yield


def dropout_keep(p: dict, B: int, Hq: int, Lq: int, Lk: int, batch_entry: int = 0):
    """``dense_attention``'s ``dropout`` for problem ``p``: (keep mask of batch entries
    ``batch_entry ...`` (B, Hq, Lq, Lk), p) as philox.py states it, from the state the face
    draws under :func:`seeded`; None without dropout."""
    drop_p = p.get("dropout_p", 0.0)
    if not drop_p:
        return None
    with seeded(p):
        state = philox.new_rng_state("cpu")
    bh = ((torch.arange(B) + batch_entry) * Hq)[:, None, None, None] + torch.arange(Hq)[:, None, None]
    return philox.keep_mask(state, drop_p, bh, torch.arange(Lq)[:, None], torch.arange(Lk)), drop_p


# the spec oracle.plain_attention reads dropout's p from (the mask comes as ``keep``)
_NO_RNG = torch.zeros(2, dtype=torch.int64)


def dense_attention(q, k, v, *, scale: float, softcap: float = 0.0, alibi=None, bias=None, visible=None,
                    sinks=None, dropout=None):
    """Softmax attention written out: q (B, Hq, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv);
    ``alibi`` = (slopes (B, Hq), diag) subtracts ``slope * |i + diag - j|`` from the (soft-capped)
    scores, then ``bias`` is added, ``visible`` masks them, ``sinks`` (Hq,) adds one logit per
    head to the denominator; ``dropout`` = (keep (B, Hq, Lq, Lk) bool, p) scales the kept
    probabilities by 1 / (1 - p) and zeroes the others.  Rows with nothing visible: zeros, lse = +inf.
    Rows whose scores are all below -1e37 average the values and pass no gradient (spec.py).
    Differentiable; computes in the inputs' dtype.

    While :func:`budget` runs, the problem is handed over to the rule's plain math instead
    (:class:`_HandOver`)."""
    mode = _BUDGET.get()
    if mode is not None:
        return _HandOver.apply(mode, scale, softcap, alibi, dropout, q, k, v, bias, visible, sinks)
    return _dense(q, k, v, scale, softcap, alibi, bias, visible, sinks, dropout)


def _dense(q, k, v, scale, softcap, alibi, bias, visible, sinks, dropout=None):
    B, Hq, Lq, _ = q.shape
    G = Hq // max(1, k.shape[1])
    kk, vv = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    s = (q @ kk.transpose(-1, -2)) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if alibi is not None:
        s = s + alibi_bias(alibi[0], B, Hq, Lq, k.shape[2], alibi[1]).to(s.dtype)
    if bias is not None:
        s = s + bias
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    logits = s
    if sinks is not None:
        logits = torch.cat([s, sinks.to(s.dtype)[None, :, None, None].expand(B, Hq, Lq, 1)], dim=-1)
    m = logits.amax(dim=-1, keepdim=True) if logits.shape[-1] else logits.new_full((B, Hq, Lq, 1), float("-inf"))
    empty = torch.isneginf(m)
    m = m.masked_fill(empty, 0.0).detach()
    e = torch.exp(logits - m)
    total = e.sum(dim=-1, keepdim=True)
    p = (e / total.masked_fill(empty, 1.0)).masked_fill(empty, 0.0)
    lse = (m + torch.log(total)).masked_fill(empty, float("inf")).squeeze(-1)
    saturated = (lse < SATURATED).unsqueeze(-1)
    p = torch.where(saturated, p.detach(), p)[..., :s.shape[-1]]
    if dropout is not None:
        keep, drop_p = dropout
        p = p * (keep.to(p.dtype) * philox.keep_scale(drop_p))
    out = torch.where(saturated, p @ vv.detach(), p @ vv)
    return out, lse


# The rule of torch_metal_flash.testing: |y - ref64| <= 2 max|plain_T - ref64| + 4 u M + u_T |ref64|.
# ref64 is the face's math above in float64.  plain_T (the plain math in the inputs' dtype T,
# the same on every machine) and the magnitudes M come from oracle.plain_attention, handed
# each dense problem exactly as the face's math states it (ALiBi as slopes, rounded as the
# stated operations round; visibility and bias as one mask); the face's own layout maps
# carry the results back and, through autograd, the
# gradients to the face's inputs (their adjoints only move or add terms: exact for values,
# sums of |terms| for magnitudes).
_BUDGET: contextvars.ContextVar = contextvars.ContextVar("budget", default=None)  # (T, magnitudes?)


class _HandOver(torch.autograd.Function):
    """dense_attention's problem as plain math in T (``magnitudes=False``) or its magnitudes M."""

    @staticmethod
    def forward(ctx, mode, scale, softcap, alibi, dropout, q, k, v, bias, visible, sinks):
        dtype, magnitudes = mode
        # A NaN input only reaches elements the rule does not compare (check_problem: the NaN
        # sets): the budget is the one of the same problem with the NaNs set to 0.
        q, k, v, bias, sinks = (None if t is None else torch.where(t.isnan(), 0.0, t.detach())
                                for t in (q, k, v, bias, sinks))
        mask = bias
        if visible is not None:
            mask = visible if bias is None else bias.masked_fill(~visible, float("-inf"))
        slopes, diag = (None, 0) if alibi is None else (alibi[0].expand(q.shape[0], q.shape[1]), alibi[1])
        ctx.keep, drop_p = (None, 0.0) if dropout is None else dropout
        ctx.spec = make_spec(q, k, v, mask, slopes, sinks, scale=scale, diag_offset=diag, softcap=softcap,
                             dropout_p=drop_p, rng_state=_NO_RNG)
        ctx.dtype = torch.float64 if magnitudes else dtype
        ctx.magnitudes = magnitudes
        ctx.dbias = bias is not None and ctx.needs_input_grad[8]
        ctx.set_materialize_grads(True)
        res = oracle.plain_attention(ctx.spec, ctx.dtype, exact=magnitudes, keep=ctx.keep)
        if magnitudes:
            # The hand-over states the face's problem: in float64 it gives the oracle's numbers.
            exact = _dense(q, k, v, scale, softcap, alibi, bias, visible, sinks, dropout)
            for name, a, b in (("out", res.out, exact[0]), ("lse", res.lse, exact[1])):
                scale_ = max(1.0, b[torch.isfinite(b)].abs().max().item()) if torch.isfinite(b).any() else 1.0
                assert torch.allclose(a, b, rtol=0, atol=1e-9 * scale_, equal_nan=True), \
                    f"the budget's problem is not the face's ({name})"
            return res.magnitude["out"], res.magnitude["lse"]
        return res.out, res.lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        res = oracle.plain_attention(ctx.spec, ctx.dtype, dout=dout.detach(), compute_dbias=ctx.dbias,
                                      exact=ctx.magnitudes, keep=ctx.keep)
        g = res.magnitude if ctx.magnitudes else vars(res)
        return (None, None, None, None, None, g["dq"], g["dk"], g["dv"], g["dbias"] if ctx.dbias else None, None,
                g.get("dsinks") if ctx.spec.sinks is not None else None)


def band(lq: int, lk: int, diag: int, left: int, right: int) -> torch.Tensor:
    """(Lq, Lk) visibility of the band: j in [i + diag - left, i + diag + right] (-1 = unbounded)."""
    i = torch.arange(lq)[:, None]
    j = torch.arange(lk)[None, :]
    ok = torch.ones(lq, lk, dtype=torch.bool)
    if left >= 0:
        ok &= j >= i + diag - left
    if right >= 0:
        ok &= j <= i + diag + right
    return ok


def alibi_bias(slopes: torch.Tensor, batch: int, heads: int, lq: int, lk: int, diag: int) -> torch.Tensor:
    dist = (torch.arange(lq)[:, None] + diag - torch.arange(lk)[None, :]).abs().to(torch.float64)
    return -slopes.to(torch.float64).expand(batch, heads)[:, :, None, None] * dist


def flash_window(window, causal: bool, seqlen_k: int) -> tuple[int, int]:
    """flash-attn: causal sets right = 0; a side >= seqlen_k is unbounded."""
    left, right = window
    if causal:
        right = 0
    return tuple(-1 if w >= seqlen_k else w for w in (left, right))


# ---------------------------------------------------------------------------
# Faces
# ---------------------------------------------------------------------------

@dataclasses.dataclass
class Face:
    """How to draw, build, call and describe one public face."""

    name: str
    draw: Callable  # (draw) -> problem dict
    build: Callable  # (problem, gen) -> (inputs dict, grad names)
    call: Callable  # (problem, inputs) -> (out, lse or None)
    math: Callable  # (problem, inputs) -> (out, lse or None): documented semantics, any dtype
    differentiable: bool = True
    mutated: tuple = ()  # inputs the face documents as updated in place
    # (problem, inputs, grads, dout seed) -> {result: (plain_T, magnitude[, rounded])}; default: _dense_budget
    budget: Optional[Callable] = None


def _qkv_values(p: dict, gen, q_shape, k_shape, v_shape):
    q, k, v = randn(gen, *q_shape), randn(gen, *k_shape), randn(gen, *v_shape)
    apply_extreme(p, gen, q, k, v, p["d"])
    return q, k, v


# dropout in a third of the problems of the faces that take it; the rest keep the plain kernels
DROPOUT_P = st.sampled_from((0.0,) * 4 + (0.17, 0.6))


# -- torch's scaled_dot_product_attention (our face, and F.sdpa through the override) ------

@st.composite
def _draw_sdpa(draw, mask_min_rank=1, kv=True):
    p = draw_sizes(draw)
    p["rank"] = draw(st.sampled_from((4, 4, 3))) if p["batch"] == 1 else 4
    p["layouts"] = [draw_layout(draw, p["rank"]) for _ in range(3)]
    p["mask"] = draw_mask(draw, (p["batch"], p["hq"], p["lq"], p["lk"]), p["dtype"], mask_min_rank)
    if p["mask"] is not None and p["mask"]["kind"] == "float":
        p["mask"]["dtype"] = p["dtype"]  # torch's SDPA takes a bool mask or one of the query's dtype
    p["causal"] = p["mask"] is None and draw(st.booleans())  # and a mask or is_causal, not both
    if p["mask"] is not None and p["rank"] == 3:
        p["mask"]["shape"] = p["mask"]["shape"][-3:] if len(p["mask"]["shape"]) == 4 else p["mask"]["shape"]
    p["scale"] = draw(st.sampled_from((None, None, 0.3, 1.0)))
    p["extreme"] = draw_extreme(draw, p["dtype"])
    if kv:
        draw_kv(draw, p)
    p["dropout_p"] = draw(DROPOUT_P)
    return p


def _build_sdpa(p, gen):
    """q, k, v (B, H, L, D) and the mask: the sdpa face's inputs, and the start of the ops face's."""
    B, Hq, Hkv, Lq, Lk, D, Dv = (p[x] for x in ("batch", "hq", "hkv", "lq", "lk", "d", "dv"))
    dt = DTYPES[p["dtype"]]
    q, k, v = _qkv_values(p, gen, (B, Hq, Lq, D), (B, Hkv, Lk, D), (B, Hkv, Lk, Dv))
    if p.get("rank") == 3:
        q, k, v = q[0], k[0], v[0]
    inputs = {"q": strided(q, p["layouts"][0], dt), "k": kv_storage(p, k, p["layouts"][1]),
              "v": kv_storage(p, v, p["layouts"][2])}
    grads = [] if p.get("kv") else ["q", "k", "v"]
    mask = make_mask(p["mask"], gen)
    if mask is not None:
        inputs["attn_mask"] = mask
        if p["mask"]["grad"] and grads:
            grads.append("attn_mask")
    return inputs, grads


def _call_sdpa(p, x):
    out = scaled_dot_product_attention(x["q"], x["k"], x["v"], attn_mask=x.get("attn_mask"),
                                           dropout_p=p.get("dropout_p", 0.0), is_causal=p["causal"],
                                           scale=p["scale"], enable_gqa=p["hq"] != p["hkv"])
    return out, None


def _override_serves(p) -> bool:
    """The calls the override hands to us (the others go to torch's own code, unchanged:
    tests/faces/test_sdpa_override.py)."""
    mask = p["mask"]
    return runs_on_kernels(p) and not _empty(p) and (mask is None or mask["kind"] == "bool" or
                                                     mask["dtype"] == p["dtype"])


def _call_override(p, x):
    before = sdpa_stats().get("routed", 0)
    with sdpa_override():
        out = F.scaled_dot_product_attention(x["q"], x["k"], x["v"], attn_mask=x.get("attn_mask"),
                                             dropout_p=p.get("dropout_p", 0.0), is_causal=p["causal"],
                                             scale=p["scale"], enable_gqa=p["hq"] != p["hkv"])
    routed = sdpa_stats().get("routed", 0) - before
    if backends.requested() == "emulator":
        assert routed == 1, f"the override did not route the call: {sdpa_stats()}"
    return out, None


def _math_sdpa(p, x):
    q, k, v = (x[n] if p["rank"] == 4 else x[n][None] for n in "qkv")
    B, Hq, Lq, Lk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    visible = torch.ones(B, Hq, Lq, Lk, dtype=torch.bool)
    if p["causal"]:
        visible = visible & torch.ones(Lq, Lk, dtype=torch.bool).tril()
    bias = None
    m = x.get("attn_mask")
    if m is not None:
        m = m.expand(((B,) if p["rank"] == 4 else ()) + (Hq, Lq, Lk)).reshape(B, Hq, Lq, Lk)
        if m.dtype == torch.bool:
            visible = visible & m
        else:
            bias = m.to(q.dtype)
    scale = p["d"] ** -0.5 if p["scale"] is None else p["scale"]
    out, _ = dense_attention(q, k, v, scale=scale, bias=bias, visible=visible,
                             dropout=dropout_keep(p, B, Hq, Lq, Lk))
    return (out if p["rank"] == 4 else out[0]), None


# -- flash-attn: flash_attn_func, packed variants, varlen -----------------------------------

def _draw_flash_features(draw, p):
    p["causal"] = draw(st.booleans())
    left = draw(st.sampled_from((-1, -1, 0, 1, 4, 40, 400)))
    right = draw(st.sampled_from((-1, -1, 0, 2, 7, 400)))
    p["window"] = (left, right)
    p["softcap"] = draw(st.sampled_from((0.0, 0.0, 0.0, 1.5, 30.0)))
    p["alibi"] = draw(st.sampled_from(("none", "none", "h", "bh")))
    p["scale"] = draw(st.sampled_from((None, None, 0.5)))
    p["return_lse"] = draw(st.booleans())
    p["extreme"] = draw_extreme(draw, p["dtype"])
    if p.get("packing", "none") == "none":
        draw_kv(draw, p)
    p["dropout_p"] = draw(DROPOUT_P)
    return p


@st.composite
def _draw_flash(draw, packing="none"):
    p = draw_sizes(draw, gqa=packing != "qkv", dv=False)  # flash-attn 2: v has q's head dim
    if packing == "qkv":
        p["lk"] = p["lq"]
    p["packing"] = packing
    p["layouts"] = [draw_layout(draw, 5 if packing != "none" else 4) for _ in range(3)]
    return _draw_flash_features(draw, p)


def _alibi(p, gen, batch, heads):
    if p["alibi"] == "none":
        return None
    return (torch.rand((heads,) if p["alibi"] == "h" else (batch, heads), generator=gen) * 0.5).float()


def _build_flash(p, gen):
    B, Hq, Hkv, Lq, Lk, D, Dv = (p[x] for x in ("batch", "hq", "hkv", "lq", "lk", "d", "dv"))
    dt = DTYPES[p["dtype"]]
    q, k, v = _qkv_values(p, gen, (B, Lq, Hq, D), (B, Lk, Hkv, D), (B, Lk, Hkv, Dv))
    inputs = {}
    if p["packing"] == "qkv":
        inputs["qkv"] = strided(torch.stack([q, k, v], dim=2), p["layouts"][0], dt)
    elif p["packing"] == "kv":
        inputs["q"] = strided(q, _drop_dim(p["layouts"][0]), dt)
        inputs["kv"] = strided(torch.stack([k, v], dim=2), p["layouts"][1], dt)
    else:
        inputs.update(q=strided(q, p["layouts"][0], dt), k=kv_storage(p, k, p["layouts"][1]),
                      v=kv_storage(p, v, p["layouts"][2]))
    grads = [] if p.get("kv") else list(inputs)
    a = _alibi(p, gen, B, Hq)
    if a is not None:
        inputs["alibi_slopes"] = a
    return inputs, grads


def _drop_dim(layout: dict) -> dict:
    """A rank-5 layout for a rank-4 tensor (drop dim 2)."""
    order = [d - (d > 2) for d in layout["order"] if d != 2]
    return dict(order=order, pad=layout["pad"][:2] + layout["pad"][3:], offset=layout["offset"])


def _flash_kwargs(p, x):
    return dict(dropout_p=p.get("dropout_p", 0.0), softmax_scale=p["scale"], causal=p["causal"],
                window_size=p["window"], softcap=p["softcap"], alibi_slopes=x.get("alibi_slopes"),
                return_attn_probs=p["return_lse"])


def _unpack_lse(res, p):
    return (res[0], res[1]) if p["return_lse"] else (res, None)


def _call_flash(p, x):
    kw = _flash_kwargs(p, x)
    if p["packing"] == "qkv":
        return _unpack_lse(flash_attn_qkvpacked_func(x["qkv"], **kw), p)
    if p["packing"] == "kv":
        return _unpack_lse(flash_attn_kvpacked_func(x["q"], x["kv"], **kw), p)
    return _unpack_lse(flash_attn_func(x["q"], x["k"], x["v"], **kw), p)


def _flash_math_one(p, q, k, v, slopes, seqlen_k_clamp, batch_entry=0):
    """flash-attn semantics on (B, L, H, D) tensors: causal and windows bottom-right
    (``batch_entry``: of q[0] in dropout's counters, the sequence for varlen)."""
    B, Lq, Hq, D = q.shape
    Lk = k.shape[1]
    left, right = flash_window(p["window"], p["causal"], seqlen_k_clamp)
    diag = Lk - Lq
    visible = band(Lq, Lk, diag, left, right).expand(B, Hq, Lq, Lk)
    scale = D ** -0.5 if p["scale"] is None else p["scale"]
    out, lse = dense_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale,
                               softcap=p["softcap"], alibi=None if slopes is None else (slopes, diag),
                               visible=visible, dropout=dropout_keep(p, B, Hq, Lq, Lk, batch_entry))
    return out.transpose(1, 2), lse


def _math_flash(p, x):
    if p["packing"] == "qkv":
        q, k, v = x["qkv"].unbind(2)
    elif p["packing"] == "kv":
        q, (k, v) = x["q"], x["kv"].unbind(2)
    else:
        q, k, v = x["q"], x["k"], x["v"]
    out, lse = _flash_math_one(p, q, k, v, x.get("alibi_slopes"), k.shape[1])
    return out, (lse if p["return_lse"] else None)


@st.composite
def _draw_varlen(draw):
    p = draw_sizes(draw, dv=False, decode_ok=False)
    n = draw(st.integers(0, 4))
    p["lens_q"] = [draw(st.sampled_from((0, 1, 3, 7, 16, 21))) for _ in range(n)]
    p["lens_k"] = [draw(st.sampled_from((0, 1, 2, 9, 16, 30))) for _ in range(n)]
    p["batch"], p["lq"], p["lk"] = n, sum(p["lens_q"]), sum(p["lens_k"])
    p["layouts"] = [draw_layout(draw, 3) for _ in range(3)]
    return _draw_flash_features(draw, p)


def _cu(lens):
    return torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32)


def _build_varlen(p, gen):
    Hq, Hkv, D, Dv = p["hq"], p["hkv"], p["d"], p["dv"]
    dt = DTYPES[p["dtype"]]
    q, k, v = _qkv_values(p, gen, (p["lq"], Hq, D), (p["lk"], Hkv, D), (p["lk"], Hkv, Dv))
    inputs = {"q": strided(q, p["layouts"][0], dt), "k": kv_storage(p, k, p["layouts"][1]),
              "v": kv_storage(p, v, p["layouts"][2])}
    a = _alibi(p, gen, p["batch"], Hq)
    if a is not None:
        inputs["alibi_slopes"] = a
    return inputs, [] if p.get("kv") else ["q", "k", "v"]


def _call_varlen(p, x):
    mq, mk = max(p["lens_q"], default=0), max(p["lens_k"], default=0)
    res = flash_attn_varlen_func(x["q"], x["k"], x["v"], _cu(p["lens_q"]), _cu(p["lens_k"]), mq, mk,
                                     **_flash_kwargs(p, x))
    return _unpack_lse(res, p)


def _math_varlen(p, x):
    outs, lses = [], []
    cq, ck = _cu(p["lens_q"]).tolist(), _cu(p["lens_k"]).tolist()
    slopes = x.get("alibi_slopes")
    for b in range(p["batch"]):
        sl = None if slopes is None else (slopes if slopes.dim() == 1 else slopes[b])
        o, lse = _flash_math_one(p, x["q"][None, cq[b]:cq[b + 1]], x["k"][None, ck[b]:ck[b + 1]],
                                 x["v"][None, ck[b]:ck[b + 1]], sl, max(p["lens_k"]), b)
        outs.append(o[0])
        lses.append(lse[0])
    if not outs:
        lse = x["q"].new_zeros((p["hq"], 0), dtype=torch.float32)
        return x["q"].new_zeros(x["q"].shape[:2] + (p["dv"],)), (lse if p["return_lse"] else None)
    out = torch.cat(outs)
    return out, (torch.cat(lses, dim=1) if p["return_lse"] else None)


# -- the ops (the general problem: any band offset, sinks) --------------------------------

@st.composite
def _draw_ops(draw):
    p = draw_sizes(draw)
    p["layouts"] = [draw_layout(draw, 4) for _ in range(3)]
    p["diag"] = draw(st.sampled_from((0, 0, -3, 2, p["lk"] - p["lq"])))
    p["window"] = (draw(st.sampled_from((-1, -1, 0, 3, 50))), draw(st.sampled_from((-1, -1, 0, 5))))
    p["softcap"] = draw(st.sampled_from((0.0, 0.0, 2.0)))
    p["sinks"] = draw(st.booleans())
    p["alibi"] = draw(st.sampled_from(("none", "none", "h", "bh")))
    p["mask"] = draw_mask(draw, (p["batch"], p["hq"], p["lq"], p["lk"]), p["dtype"])
    p["scale"] = draw(st.sampled_from((0.125, 0.7)))
    p["extreme"] = draw_extreme(draw, p["dtype"])
    draw_kv(draw, p)
    return p


def _build_ops(p, gen):
    B, Hq, dt = p["batch"], p["hq"], DTYPES[p["dtype"]]
    inputs, grads = _build_sdpa(p, gen)
    a = _alibi(p, gen, B, Hq)
    if a is not None:
        inputs["alibi_slopes"] = a
    if p["sinks"]:  # the op's kernels take float32 sinks (the faces convert; spec.stats_dtype)
        inputs["sinks"] = randn(gen, Hq).to(dt).to(torch.float64 if dt == torch.float64 else torch.float32)
        if grads:
            grads.append("sinks")
    return inputs, grads


def _call_ops(p, x):
    """fwd (return_aux when a gradient is wanted, as the faces do), or fwd_quantized."""
    mask = x.get("attn_mask")  # broadcastable, as the op takes it (its backward reduces dmask)
    mask = None if mask is None else mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    q, k, v, alibi, sinks = x["q"], x["k"], x["v"], x.get("alibi_slopes"), x.get("sinks")
    if isinstance(k, QuantizedTensor):
        return torch.ops.metal_flash.fwd_quantized(q, k.data, v.data, mask, alibi, sinks, p["scale"], p["diag"],
                                                   *p["window"], p["softcap"], k.scales, k.biases, v.scales,
                                                   v.biases, *flat_format(k))
    aux = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, mask, sinks))
    out, lse, _ = ops.fwd_call(q=q, k=k, v=v, attn_mask=mask, alibi_slopes=alibi, sinks=sinks, scale=p["scale"],
                               diag_offset=p["diag"], window_left=p["window"][0], window_right=p["window"][1],
                               softcap=p["softcap"], return_aux=aux)
    return out, lse


def _math_ops(p, x):
    q, k, v = x["q"], x["k"], x["v"]
    B, Hq, Lq, Lk = p["batch"], p["hq"], p["lq"], p["lk"]
    visible = band(Lq, Lk, p["diag"], *p["window"]).expand(B, Hq, Lq, Lk)
    bias = None
    slopes = x.get("alibi_slopes")
    m = x.get("attn_mask")
    if m is not None:
        m = m.expand(B, Hq, Lq, Lk)
        if m.dtype == torch.bool:
            visible = visible & m
        else:
            bias = m.to(q.dtype)
    return dense_attention(q, k, v, scale=p["scale"], softcap=p["softcap"],
                           alibi=None if slopes is None else (slopes, p["diag"]), bias=bias, visible=visible,
                           sinks=x.get("sinks"))


# -- flash_attn_with_kvcache (contiguous and paged caches; inference only) ---------------

@st.composite
def _draw_kvcache(draw):
    p = draw_sizes(draw, dv=False, decode_ok=False)
    p["batch"] = max(1, p["batch"])
    p["lq"] = draw(st.sampled_from((1, 1, 2, 4, 9)))
    big = draw(st.integers(0, 5)) == 0
    p["capacity"] = _length(draw, big=True) if big else draw(st.integers(1, 40))
    if p["d"] > 128:
        p["capacity"] = min(p["capacity"], 24)
    p["seqlens"] = [draw(st.integers(0, p["capacity"])) for _ in range(p["batch"])]
    p["new"] = min(draw(st.sampled_from((0, 0, 1, 2))), p["capacity"] - max(p["seqlens"]))
    p["paged"] = draw(st.integers(0, 2)) == 0
    p["page"] = draw(st.sampled_from((1, 3, 16))) if p["paged"] else 0
    p["batch_idx"] = not p["paged"] and draw(st.booleans())
    p["leftpad"] = draw(st.booleans())
    p["causal"] = draw(st.booleans())
    p["window"] = (draw(st.sampled_from((-1, -1, 2, 10))), draw(st.sampled_from((-1, -1, 0, 3))))
    p["softcap"] = draw(st.sampled_from((0.0, 0.0, 5.0)))
    p["alibi"] = draw(st.sampled_from(("none", "none", "h", "bh")))
    p["scale"] = None
    p["q_layout"] = draw_layout(draw, 4)  # any memory order, rotary too (a rotated view must keep working)
    p["rotary"] = draw(st.sampled_from((None, None, "interleaved", "neox"))) if p["new"] and p["d"] >= 2 else None
    if p["rotary"]:
        p["rotary_dim"] = 2 * draw(st.integers(1, p["d"] // 2))
    p["extreme"] = draw(st.sampled_from(("none",) * 6 + ("big_scores",)))
    p["num_splits"] = draw(st.sampled_from((0, 0, 1, 3)))
    draw_kv(draw, p)
    return p


def _build_kvcache(p, gen):
    B, Hq, Hkv, Lq, D, cap = p["batch"], p["hq"], p["hkv"], p["lq"], p["d"], p["capacity"]
    dt = DTYPES[p["dtype"]]
    q = randn(gen, B, Lq, Hq, D)
    if p["paged"]:
        pages = -(-cap // p["page"])
        nblocks = B * pages + 1
        kc, vc = randn(gen, nblocks, p["page"], Hkv, D), randn(gen, nblocks, p["page"], Hkv, D)
        table = torch.randperm(nblocks, generator=gen)[:B * pages].view(B, pages).to(torch.int32)
    else:
        rows = B + (2 if p["batch_idx"] else 0)
        kc, vc = randn(gen, rows, cap, Hkv, D), randn(gen, rows, cap, Hkv, D)
    apply_extreme(p, gen, q, kc, vc, D)
    inputs = {"q": strided(q, p["q_layout"], dt), "k_cache": _cache_storage(p, kc),
              "v_cache": _cache_storage(p, vc)}
    if p["paged"]:
        inputs["block_table"] = table
    if p["batch_idx"]:
        inputs["cache_batch_idx"] = torch.randperm(B + 2, generator=gen)[:B].to(torch.int32)
    inputs["cache_seqlens"] = torch.tensor(p["seqlens"], dtype=torch.int32)
    if p["leftpad"]:
        inputs["cache_leftpad"] = torch.tensor([int(torch.randint(s + 1, (1,), generator=gen)) for s in p["seqlens"]],
                                               dtype=torch.int32)
    if p["new"]:  # new rows in the caches' dtype
        kv_dt = DTYPES[p["kv"]["dtype"]] if p.get("kv") else dt
        inputs["k"], inputs["v"] = (randn(gen, B, p["new"], Hkv, D).to(kv_dt) for _ in range(2))
    if p.get("rotary"):
        angle = torch.arange(cap + Lq + p["new"])[:, None] * 0.3 ** torch.arange(p["rotary_dim"] // 2)[None, :]
        inputs["rotary_cos"], inputs["rotary_sin"] = angle.cos().to(dt), angle.sin().to(dt)
    a = _alibi(p, gen, B, Hq)
    if a is not None:
        inputs["alibi_slopes"] = a
    return inputs, []


def _cache_storage(p: dict, values: torch.Tensor):
    kv = p.get("kv")
    if kv is None:
        return values.to(p_dtype(p))
    stored = values.to(DTYPES[kv["dtype"]])
    if "bits" not in kv:
        return stored
    return quantize(stored, bits=kv["bits"], group_size=kv["group_size"], mode=kv["mode"])


_KV_ARGS = ("k", "v", "cache_seqlens", "cache_batch_idx", "cache_leftpad", "block_table", "alibi_slopes",
            "rotary_cos", "rotary_sin")


def _kv_kwargs(p, x):
    kw = {n: x[n] for n in _KV_ARGS if n in x}
    if p.get("rotary"):
        kw["rotary_interleaved"] = p["rotary"] == "interleaved"
    return kw


def _call_kvcache(p, x):
    kw = _kv_kwargs(p, x)
    return flash_attn_with_kvcache(x["q"], x["k_cache"], x["v_cache"], causal=p["causal"],
                                       window_size=p["window"], softcap=p["softcap"], num_splits=p["num_splits"],
                                       return_softmax_lse=True, **kw)


def _stored_caches(p) -> bool:
    """The oracle attends to the caches as the kernels stored them (``append=False``):
    quantized rows are the kernels' codes, rotated rows their float32 rotation (the
    stored rows themselves are checked in check_problem)."""
    return bool(p.get("rotary")) or _quantized(p)


def _kvcache_problem(p, x, append=None) -> dict:
    """kvcache_oracle's arguments: windows clamped as flash-attn does, causal as window_right = 0,
    and the dtypes the rotated q and k are stored in (``x`` may be cast already)."""
    capacity = -(-p["capacity"] // p["page"]) * p["page"] if p["paged"] else p["capacity"]
    left, right = flash_window(p["window"], p["causal"], capacity)
    rotary = {}
    if p.get("rotary"):
        rotary["rotary_dtypes"] = (p_dtype(p), DTYPES[p["kv"]["dtype"]] if p.get("kv") else p_dtype(p))
    return dict(_kv_kwargs(p, x), q=x["q"], k_cache=x["k_cache"], v_cache=x["v_cache"], causal=False,
                window_size=(left, right), softcap=p["softcap"],
                append=not _stored_caches(p) if append is None else append, **rotary)


def _math_kvcache(p, x):
    problem = _kvcache_problem(p, x)
    out, lse, kc, vc = kvcache_oracle.kvcache_attention(dtype=x["q"].dtype, **problem)
    if problem["append"]:
        x["k_cache"].copy_(kc)  # the documented in-place append
        x["v_cache"].copy_(vc)
    return out, lse


# -- nn.MultiheadAttention (swapped in) ---------------------------------------------------

@st.composite
def _draw_mha(draw):
    p = dict(dtype=draw(st.sampled_from(("f32", "f16", "bf16", "f64"))), batch=draw(st.sampled_from((1, 2))),
             hq=draw(st.sampled_from((1, 2, 4))), lq=_length(draw), lk=_length(draw), decode=False)
    p["lq"], p["lk"] = max(1, p["lq"]), max(1, p["lk"])
    p["d"] = draw(st.sampled_from((1, 3, 8, 16)))
    p["hkv"], p["dv"] = p["hq"], p["d"]
    p["batch_first"] = draw(st.booleans())
    p["key_padding"] = draw(st.booleans())
    p["attn_mask"] = draw(st.sampled_from(("none", "bool", "float")))
    p["seed_weights"] = draw(st.integers(0, 2**16))
    return p


def _build_mha(p, gen):
    E = p["hq"] * p["d"]
    dt = DTYPES[p["dtype"]]
    B, L, S = p["batch"], p["lq"], p["lk"]
    shape = (lambda n: (B, n, E)) if p["batch_first"] else (lambda n: (n, B, E))
    inputs = {"query": randn(gen, *shape(L)).to(dt), "key": randn(gen, *shape(S)).to(dt)}
    inputs["value"] = randn(gen, *shape(S)).to(dt)
    if p["key_padding"]:
        kp = torch.rand(B, S, generator=gen) < 0.3
        kp[:, 0] = False
        inputs["key_padding_mask"] = kp
    if p["attn_mask"] == "bool":
        inputs["attn_mask"] = torch.rand(L, S, generator=gen) < 0.3  # True = masked out (nn semantics)
    elif p["attn_mask"] == "float":
        inputs["attn_mask"] = randn(gen, L, S).to(dt)
    return inputs, ["query", "key", "value"]


def _mha_module(p, dtype, ours: bool):
    """The same weights (rounded to the problem's dtype) for ours and torch's module."""
    with torch.random.fork_rng():
        torch.manual_seed(p["seed_weights"])
        mod = torch.nn.MultiheadAttention(p["hq"] * p["d"], p["hq"], batch_first=p["batch_first"],
                                          dtype=torch.float64)
    with torch.no_grad():
        for w in mod.parameters():
            w.copy_(w.to(p_dtype(p)))
    mod = mod.to(dtype)
    return tmf_nn.swap_attention(mod) if ours else mod


def _mha_kwargs(x):
    return dict(key_padding_mask=x.get("key_padding_mask"), attn_mask=x.get("attn_mask"), need_weights=False)


def _call_mha(p, x):
    mod = _mha_module(p, x["query"].dtype, ours=True)
    assert isinstance(mod, tmf_nn.MultiheadAttention)
    return mod(x["query"], x["key"], x["value"], **_mha_kwargs(x))[0], None


def _math_mha(p, x):
    mod = _mha_module(p, x["query"].dtype, ours=False)
    return mod(x["query"], x["key"], x["value"], **_mha_kwargs(x))[0], None


class _Linear(torch.autograd.Function):
    """``x @ W^T + b`` for the module's budget.  mode ("plain", T): rounded as plain math in T
    (oracle.Arith), forward and input gradient; ("magnitude", None): the magnitudes of the
    terms of the last reductions, the attention's magnitudes carried through, ``M_x |W|^T +
    |b|`` for the module's output (``last``) and ``M_dy |W|`` for the inputs' gradients (the
    other way round the float64 value flows, which the attention's magnitudes need);
    ("rounded", None): the attention's results (o, dq, dk, dv: rounded to T in the module)
    carried to the module's results, ``|o| |W|^T`` and ``|dy| |W|`` (the rule's ``rounded``);
    ("exact", None): the float64 value."""

    @staticmethod
    def forward(ctx, mode, last, x, W, b):
        ctx.mode, ctx.last, ctx.W = mode, last, W
        if mode[0] == "plain":
            A = oracle.Arith(mode[1], exact=False)
            return A.r(A.mm(x, W.T) + b)
        if mode[0] == "magnitude" and last:
            return x.abs() @ W.abs().T + b.abs()
        if mode[0] == "rounded" and last:
            return x.abs() @ W.abs().T
        return x @ W.T + b

    @staticmethod
    def backward(ctx, dy):
        if ctx.mode[0] == "plain":
            A = oracle.Arith(ctx.mode[1], exact=False)
            return None, None, A.r(A.mm(dy, ctx.W)), None, None
        if ctx.mode[0] in ("magnitude", "rounded") and not ctx.last:
            return None, None, dy.abs() @ ctx.W.abs(), None, None
        return None, None, dy @ ctx.W, None, None


def _mha_math(p, x, mode):
    """nn.MultiheadAttention's forward written out (in-projections, heads, the masks: True =
    masked out, a float mask added; attention; out-projection) with the module's weights,
    in float64; ``mode`` as for :class:`_Linear` (the attention is handed over to the
    plain math, or its magnitudes, too)."""
    mod = _mha_module(p, torch.float64, ours=False)
    E, H, D = p["hq"] * p["d"], p["hq"], p["d"]
    W, b = mod.in_proj_weight.detach(), mod.in_proj_bias.detach()
    batch_first = (lambda t: t) if p["batch_first"] else (lambda t: t.transpose(0, 1))

    def heads(t, i):
        y = _Linear.apply(mode, False, batch_first(t), W[i * E:(i + 1) * E], b[i * E:(i + 1) * E])
        return y.unflatten(-1, (H, D)).transpose(1, 2)  # (B, H, L, D)

    q, k, v = heads(x["query"], 0), heads(x["key"], 1), heads(x["value"], 2)
    B, L, S = q.shape[0], q.shape[2], k.shape[2]
    visible = torch.ones(B, H, L, S, dtype=torch.bool)
    if "key_padding_mask" in x:
        visible = visible & ~x["key_padding_mask"][:, None, None, :]
    bias, mask = None, x.get("attn_mask")
    if mask is not None and mask.dtype == torch.bool:
        visible = visible & ~mask
    elif mask is not None:
        bias = mask.expand(B, H, L, S)
    token = None if mode[0] in ("exact", "rounded") else _BUDGET.set((mode[1], mode[0] == "magnitude"))
    try:
        o, _ = dense_attention(q, k, v, scale=D ** -0.5, bias=bias, visible=visible)
    finally:
        if token is not None:
            _BUDGET.reset(token)
    out = _Linear.apply(mode, True, o.transpose(1, 2).flatten(-2), mod.out_proj.weight.detach(),
                        mod.out_proj.bias.detach())
    return batch_first(out)


def _budget_mha(p, inputs, grads, dout_seed) -> dict:
    exact = _mha_math(p, _cast(inputs, torch.float64, ()), ("exact", None))
    torch_module = _math_mha(p, _cast(inputs, torch.float64, ()))[0]
    assert torch.allclose(exact, torch_module, rtol=1e-9, atol=1e-12), "the budget's module is not torch's"
    res = {}
    modes = (("plain", p_dtype(p)), ("magnitude", None))
    if p_dtype(p) in (torch.float16, torch.bfloat16):  # the rule's rounded term is for these
        modes += (("rounded", None),)
    for mode in modes:
        x = _cast(inputs, torch.float64, grads)
        out = _mha_math(p, x, mode)
        res.setdefault("out", []).append(out.detach())
        if grads and out.numel():
            dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(dout_seed)).to(p_dtype(p))
            for n, g in zip(grads, torch.autograd.grad(out, [x[n] for n in grads], dout.to(torch.float64))):
                res.setdefault("d" + n, []).append(g.to(p_dtype(p)) if mode[0] == "plain" else g)
    return {name: tuple(v) for name, v in res.items()}


FACES = {
    "sdpa": Face("sdpa", _draw_sdpa(), _build_sdpa, _call_sdpa, _math_sdpa),
    # torch's own SDPA (what the override hands unserved calls to) wants masks of rank >= 2
    "sdpa_override": Face("sdpa_override", _draw_sdpa(mask_min_rank=2, kv=False).filter(_override_serves),
                          _build_sdpa, _call_override, _math_sdpa),
    "flash_attn_func": Face("flash_attn_func", _draw_flash(), _build_flash, _call_flash, _math_flash),
    "flash_attn_kvpacked_func": Face("flash_attn_kvpacked_func", _draw_flash("kv"), _build_flash, _call_flash,
                                     _math_flash),
    "flash_attn_qkvpacked_func": Face("flash_attn_qkvpacked_func", _draw_flash("qkv"), _build_flash, _call_flash,
                                      _math_flash),
    "flash_attn_varlen_func": Face("flash_attn_varlen_func", _draw_varlen(), _build_varlen, _call_varlen,
                                   _math_varlen),
    "ops": Face("ops", _draw_ops(), _build_ops, _call_ops, _math_ops),
    "flash_attn_with_kvcache": Face("flash_attn_with_kvcache", _draw_kvcache(), _build_kvcache, _call_kvcache,
                                    _math_kvcache, differentiable=False, mutated=("k_cache", "v_cache"),
                                    budget=lambda p, inputs, grads, seed: _budget_kvcache(p, inputs)),
    "nn.MultiheadAttention": Face("nn.MultiheadAttention", _draw_mha(), _build_mha, _call_mha, _math_mha,
                                  budget=_budget_mha),
}


def problems(face: str) -> st.SearchStrategy:
    """Problems of one face, with a seed for the tensor values and a schedule-order pair."""
    return st.tuples(FACES[face].draw, st.integers(0, 2**31 - 1), st.sampled_from(ORDER_PAIRS)).map(
        lambda t: dict(t[0], face=face, seed=t[1], orders=t[2]))


# ---------------------------------------------------------------------------
# What the kernels cover (README support matrix); the rest falls back
# ---------------------------------------------------------------------------

def runs_on_kernels(p: dict) -> bool:
    if p["dtype"] not in KERNEL_DTYPES:
        return False
    if max(p["d"], p["dv"]) > MAX_KERNEL_HEAD_DIM:
        return False
    mask = p.get("mask")
    if mask is not None and mask["kind"] == "float" and mask["dtype"] not in KERNEL_DTYPES:
        return False
    dequantized = "lens_q" in p or p.get("dropout_p", 0.0) > 0  # varlen and dropout dequantize K/V first
    if _quantized(p) and p["kv"]["mode"] == "symmetric" and p["d"] % 4 and not dequantized:
        return False  # the decode kernels read int8 rows as 4-byte words (docs/kvcache.md)
    return True


# ---------------------------------------------------------------------------
# Checking one problem
# ---------------------------------------------------------------------------

def _values(t):
    """A tensor, or the values a QuantizedTensor stands for (as the kernels dequantize them)."""
    return t.dequantize() if isinstance(t, QuantizedTensor) else t


def _fresh(t):
    return t.clone() if isinstance(t, QuantizedTensor) else t.detach().clone()


def _same(a, b) -> bool:
    """Same values, NaN where NaN (QuantizedTensors: the same components)."""
    if isinstance(a, QuantizedTensor):
        return all(_same(x, y) for x, y in zip(a._parts(), b._parts()))
    return torch.equal(a, b) or (bool((a.isnan() == b.isnan()).all()) and torch.equal(a.nan_to_num(), b.nan_to_num()))


def _quantized(p) -> bool:
    return bool(p.get("kv")) and "bits" in p["kv"]


def _cast(inputs: dict, dtype: torch.dtype, grads) -> dict:
    out = {}
    for n, t in inputs.items():
        t = _values(t).detach().clone()
        if t.is_floating_point() and n not in ("alibi_slopes",) and not (n == "attn_mask" and t.dtype == torch.bool):
            t = t.to(dtype)
        out[n] = t.requires_grad_() if n in grads else t
    return out


def _nan_sets(face: Face, p: dict, inputs: dict) -> tuple:
    """(must be NaN, may be NaN) masks of out and lse for inputs holding NaN:
    an output element that depends on a NaN input must be NaN (it depends on it
    when replacing the NaN by two different numbers changes it); one may also be
    NaN where torch's plain math gives NaN (e.g. 0 * NaN of a masked value row)."""
    res = []
    for fill in (0.0, 1e3):
        x = {n: (t.nan_to_num(fill) if t.is_floating_point() else t)
             for n, t in _cast(inputs, torch.float64, ()).items()}
        res.append(face.math(p, x))
    plain = face.math(p, _cast(inputs, torch.float64, ()))
    sets = []
    for i in range(2):
        if res[0][i] is None:
            sets.append(None)
            continue
        must = (res[0][i] != res[1][i]) & ~(torch.isinf(res[0][i]) & torch.isinf(res[1][i]))
        sets.append((must, must | torch.isnan(plain[i])))
    return sets


def assert_rule(name: str, kind: str, got, ref64, plain, magnitude, dtype, nan_sets=None, rounded=None) -> None:
    """The rule of torch_metal_flash.testing (``kind``: the rule's name of the result, which
    decides the final-rounding term; ``rounded``: a composite face's rounded intermediates
    carried to the result); with NaN inputs, ``nan_sets`` first."""
    got, ref64 = got.detach().to(torch.float64), ref64.detach().to(torch.float64)
    assert got.shape == ref64.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref64.shape)}"
    consider = torch.ones_like(got, dtype=torch.bool)
    if nan_sets is not None:
        must, may = nan_sets
        missing = must & ~torch.isnan(got)
        assert not missing.any(), f"{name}: NaN input did not propagate at {missing.nonzero()[0].tolist()}"
        spurious = torch.isnan(got) & ~may
        assert not spurious.any(), f"{name}: NaN where the math has a number, at {spurious.nonzero()[0].tolist()}"
        consider = ~may
    else:
        bad = torch.isnan(got)
        assert not bad.any(), f"{name}: NaN at {bad.nonzero()[0].tolist()} (reference {ref64[bad][0]})"
    plain = plain.detach().to(torch.float64).expand(ref64.shape)
    magnitude = magnitude.detach().to(torch.float64).expand(ref64.shape)
    try:
        rounded = None if rounded is None else rounded.detach().to(torch.float64).expand(ref64.shape)[consider]
        err, allowed = oracle.error_budget(kind, got[consider], ref64[consider], plain[consider],
                                            magnitude[consider], dtype, rounded)
    except AssertionError as e:  # a non-finite mismatch
        raise AssertionError(f"{name}: {e}") from None
    if not err <= allowed:
        raise AssertionError(f"{name}: max error {err:.3e} > allowed {allowed:.3e} (2 x plain {str(dtype)[6:]} "
                             f"math error + rounding floor; torch_metal_flash.testing)")


def _kind(n: str, t: torch.Tensor) -> str:
    """The rule's name for the gradient of input ``n``: float16 / bfloat16 results get the
    final-rounding term of dq/dk/dv (a float mask or sinks in those dtypes too)."""
    if t.dtype in (torch.float16, torch.bfloat16):
        return "dq"
    return {"attn_mask": "dbias", "sinks": "dsinks"}.get(n, "dq")


def budget(face: Face, p: dict, inputs: dict, grads, dout_seed: int) -> dict:
    """``{result: (plain_T, magnitude)}`` for out, lse and every gradient ``d<input>``."""
    if face.budget is not None:
        return face.budget(p, inputs, grads, dout_seed)
    runs = []
    for magnitudes in (False, True):
        token = _BUDGET.set((p_dtype(p), magnitudes))
        try:
            runs.append(_oracle(face, p, inputs, grads, torch.float64, dout_seed))
        finally:
            _BUDGET.reset(token)
    (out, lse, g, _), (m_out, m_lse, m_g, _) = runs
    res = {"out": (out, m_out), "lse": (lse, m_lse)}
    res.update({"d" + n: (g[n].to(_values(inputs[n]).dtype), m_g[n]) for n in g})  # the gradient's own rounding
    return res


def _budget_kvcache(p, inputs) -> dict:
    plain_out, plain_lse, m_out, m_lse = kvcache_oracle.budget(
        dtype=p_dtype(p), **_kvcache_problem(p, _cast(inputs, torch.float64, ())))
    return {"out": (plain_out, m_out), "lse": (plain_lse, m_lse)}


@contextlib.contextmanager
def kernels(order: str, strict: bool, seed: int = 0):
    with backends.backend("emulator", strict=strict), emulator.settings(order=order, checked=True, seed=seed):
        yield


def _run(face: Face, p, inputs, grads, dout_seed: int):
    """Call the face on fresh copies of ``inputs``; returns (out, lse, grads, inputs used)."""
    x = {n: _fresh(t) if n in face.mutated else t for n, t in inputs.items()}
    leaves = {n: x[n].detach().requires_grad_() for n in grads}
    x.update(leaves)
    with seeded(p):
        out, lse = face.call(p, x)
    g = {}
    if grads and out.numel() and face.differentiable:
        gen = torch.Generator().manual_seed(dout_seed)
        dout = torch.randn(out.shape, generator=gen).to(out.dtype)
        res = torch.autograd.grad(out, [leaves[n] for n in grads], dout, allow_unused=True)
        g = {n: (torch.zeros_like(leaves[n]) if r is None else r) for n, r in zip(grads, res)}
    return out.detach(), None if lse is None else lse.detach(), g, x


def _oracle(face: Face, p, inputs, grads, dtype, dout_seed):
    x = _cast(inputs, dtype, grads if face.differentiable else ())
    out, lse = face.math(p, x)
    g = {}
    if grads and out.numel() and face.differentiable:
        gen = torch.Generator().manual_seed(dout_seed)
        dout = torch.randn(out.shape, generator=gen).to(p_dtype(p)).to(dtype)
        res = torch.autograd.grad(out, [x[n] for n in grads], dout, allow_unused=True)
        g = {n: (torch.zeros_like(x[n]) if r is None else r) for n, r in zip(grads, res)}
    return out.detach(), None if lse is None else lse.detach(), g, x


def p_dtype(p) -> torch.dtype:
    return DTYPES[p["dtype"]]


def check_problem(p: dict) -> None:
    face = FACES[p["face"]]
    gen = torch.Generator().manual_seed(p["seed"])
    inputs, grads = face.build(p, gen)
    if p.get("extreme", "none").startswith("nan"):
        grads = []  # forward only: gradients of NaN inputs are NaN wherever they reach
    _check(face, p, inputs, grads)
    if p.get("decode") and grads and face.differentiable:
        # A call that keeps state for a backward takes the prefill kernels: forward only again,
        # so decode-shaped problems reach the split-K decode kernels on every face.
        _check(face, p, inputs, [])


def _check(face: Face, p: dict, inputs: dict, grads) -> None:
    snapshot = {n: _fresh(t) for n, t in inputs.items()}
    dtype = p_dtype(p)
    on_kernels = runs_on_kernels(p)
    dout_seed = p["seed"] + 1

    results = []
    for order in p["orders"]:
        with kernels(order, strict=on_kernels, seed=p["seed"]), warnings.catch_warnings():
            warnings.simplefilter("ignore", backends.FallbackWarning)
            results.append(_run(face, p, inputs, grads, dout_seed))
        for n, t in inputs.items():  # the caller's tensors are never modified
            assert _same(t, snapshot[n]), f"input {n} was modified"
    if not on_kernels:
        _check_falls_back(face, p, inputs, grads)

    out, lse, g, x_used = results[0]
    for (o2, l2, g2, _), order in zip(results[1:], p["orders"][1:]):
        assert _same_bits(out, o2), f"out differs between schedule orders {p['orders']}"
        assert lse is None or _same_bits(lse, l2), "lse differs between schedule orders"
        for n in g:
            assert _same_bits(g[n], g2[n]), f"d{n} differs between schedule orders {p['orders']}"

    attended = inputs
    if face.mutated:
        _check_caches(face, p, inputs, x_used)
        if _stored_caches(p):  # the oracle attends to the rows as stored
            attended = dict(inputs, **{n: x_used[n] for n in face.mutated})
    ref = _oracle(face, p, attended, grads, torch.float64, dout_seed)
    plain = budget(face, p, attended, grads, dout_seed)
    nan_sets = _nan_sets(face, p, attended) if p.get("extreme", "none").startswith("nan") else [None, None]
    assert out.dtype == dtype, f"out dtype {out.dtype}"
    assert_rule("out", "out", out, ref[0], *plain["out"][:2], dtype, nan_sets[0], *plain["out"][2:])
    if lse is not None:
        assert_rule("lse", "lse", lse, ref[1], *plain["lse"], dtype, nan_sets[1])
    for n in g:
        assert_rule(f"d{n}", _kind(n, g[n]), g[n], ref[2][n], *plain[f"d{n}"][:2], dtype, None,
                    *plain[f"d{n}"][2:])


def _check_caches(face: Face, p, inputs, x_used) -> None:
    """flash_attn_with_kvcache's documented in-place append.  Plain caches: exactly the
    oracle's rows (float32 rotation rounded to the cache's dtype), or, rotated float32 rows or
    a float32 table (the kernel's fused multiply-add), within torch.testing's tolerance
    (as tests/faces/test_kvcache.py checks them).
    Quantized caches: the codes the reference path stores (tmf.quantize of the same rows;
    rotated rows within one code step)."""
    if _quantized(p):
        with backends.backend("reference"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            theirs = _run(face, p, inputs, [], 0)[3]
        for n in face.mutated:
            mine, ref = x_used[n], theirs[n]
            if p.get("rotary") and n == "k_cache":
                step = mine.scales.float().repeat_interleave(mine.group_size, -1)[..., :mine.head_dim]
                assert bool(((mine.dequantize().float() - ref.dequantize().float()).abs() <= step).all()), \
                    f"{n}: stored rows beyond one code step of tmf.quantize's"
            else:
                assert _same(mine, ref), f"{n}: the append kernel stored other codes than tmf.quantize()"
        return
    x = _cast(inputs, torch.float64, ())
    _, _, kc, vc = kvcache_oracle.kvcache_attention(dtype=torch.float64, **_kvcache_problem(p, x, append=True))
    # 16-bit rows and table: products exact in float32, so the rotated rows are exact too.
    fma_may_differ = p.get("rotary") and torch.float32 in (inputs["k"].dtype, inputs["rotary_cos"].dtype)
    for n, want in (("k_cache", kc), ("v_cache", vc)):
        got = x_used[n]
        if fma_may_differ and n == "k_cache":
            torch.testing.assert_close(got, want.to(got.dtype), msg=lambda m: f"{n}: rotated rows: {m}")
        else:
            assert torch.equal(got, want.to(got.dtype)), f"{n} not updated as documented"


def _check_falls_back(face: Face, p, inputs, grads) -> None:
    """Outside the support matrix: strict mode raises (when there is work to do)."""
    with kernels("forward", strict=True):
        try:
            _run(face, p, inputs, grads, 0)
        except backends.UnsupportedError:
            return
    assert _empty(p), "a configuration outside the support matrix ran without the fallback policy"


def _empty(p) -> bool:
    """Nothing for a kernel to do (varlen: in no sequence)."""
    if "lens_q" in p:
        return not any(a and b for a, b in zip(p["lens_q"], p["lens_k"])) or 0 in (p["hq"], p["d"])
    return 0 in (p["batch"], p["hq"], p["lq"], p["lk"])


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape:
        return False
    dense = [torch.empty(t.shape, dtype=t.dtype).copy_(t).view(-1) for t in (a, b)]
    return torch.equal(*(t.view(torch.uint8) for t in dense))


# Contiguous layouts (no permutation, no padding) of a rank-4 and a rank-5 tensor.
FLAT4 = {"order": [0, 1, 2, 3], "pad": [0, 0, 0, 0], "offset": 0}
FLAT5 = {"order": [0, 1, 2, 3, 4], "pad": [0, 0, 0, 0, 0], "offset": 0}

# Found by the long profile (bench/results/fuzz.md): problems that a rule without these
# terms fails although the code is right, each the reason for a term of the floor
# (torch_metal_flash.testing):
# - out 26x over without the scores' rounding: scores ~1300 carry ~1 float32 ulp (1.2e-4)
#   of rounding that exp turns into a relative error of P; the kernels and plain float32
#   both make it, plain float32 rounds the two top scores alike by luck.
# - dv 1.08x over without the oracle's own rounding, float64 on the reference path: the
#   float64 oracle is itself 2 ulps off the exact dV there, and plain float64 equals it bit
#   for bit.
# - dquery 1.04x over without a composite's rounded intermediates, nn.MultiheadAttention in
#   float16: the module rounds the attention's dq to float16 before dquery = dq W (so does
#   torch's); 1.3 ulps where the final-rounding term allows one.
RULE_GAP_CASES = {
    "kvpacked_f32_decode_route_big_scores_out": dict(
        dtype="f32", batch=1, hq=1, hkv=1, lq=1, lk=256, d=14, dv=14, decode=True, packing="kv",
        layouts=[FLAT5] * 3, causal=False, window=(-1, -1), softcap=0.0, alibi="none", scale=None,
        return_lse=False, extreme="big_scores", face="flash_attn_kvpacked_func", seed=0,
        orders=("forward", "reverse")),
    "sdpa_f64_reference_dv": dict(
        dtype="f64", batch=1, hq=2, hkv=2, lq=2, lk=2, d=8, dv=8, decode=False, rank=4, layouts=[FLAT4] * 3,
        causal=False, mask=None, scale=None, extreme="none", kv=None, face="sdpa", seed=1,
        orders=("forward", "reverse")),
    # sdpa_override, scale 1.0 with D = 64 (|s| up to 26): out 1.24x over without the score
    # term, 0.10x with it; the same score rounding at a smaller size (bench/score_rounding.py: the
    # kernels' error is the median of random float32 summation orders; the decode kernel,
    # forward only, gives the same out bit for bit).
    "override_f32_decode_route_out": dict(
        dtype="f32", batch=1, hq=1, hkv=1, lq=2, lk=256, d=64, dv=64, decode=True, rank=4, layouts=[FLAT4] * 3,
        causal=False, mask=None, scale=1.0, extreme="none", face="sdpa_override", seed=3,
        orders=("forward", "reverse")),
    "mha_f16_dquery": dict(
        dtype="f16", batch=2, hq=1, lq=1, lk=2, decode=False, d=1, hkv=1, dv=1, batch_first=False,
        key_padding=False, attn_mask="none", seed_weights=6594, face="nn.MultiheadAttention", seed=80,
        orders=("forward", "reverse")),
}
