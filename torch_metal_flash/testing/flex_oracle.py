"""The float64 oracle of FlexAttention, judged by :mod:`.oracle`'s acceptance rule.

A FlexAttention problem is plain attention whose scores go through an
elementwise map: ``s' = score_mod(s)`` where ``mask_mod`` allows it, hidden
elsewhere (and where ``s'`` is -inf).  :func:`flex_attention_math` computes it as
:func:`~.oracle.plain_attention` does -- in float64 for the oracle, and as
plain math in the inputs' dtype with :class:`~.oracle.Arith` for the rule's
baseline -- with the mods evaluated on the whole (B, Hq, Lq, Lk) grid (torch's
vmap over the index tensors) in float64 and, in the baseline, rounded once to
float32 (a fused elementwise op, as torch's own math evaluates mods in float32).
The mods are given as functions of the tensors they capture (:class:`FlexMods`),
so that the oracle evaluates them on float64 copies; gradients flow to those
tensors as they do to q, k and v.

Magnitudes of the rule's floor, on top of plain attention's: a modded score
carries the score's rounding through the mod and the mod's own, ``a = |f'(s)|
scale |q||k| + |f(s)| + |s f'(s)|`` (the terms of the mod's first operation,
e.g. ``s + bias``, bounded by |f(s)| + |s|); the gradient of the score is the
modded score's times ``f'(s)``, so its magnitude is ``s_mag |f'(s)|``; element c
of a captured tensor's gradient sums ``dS'_ij d f_ij / d x_c`` over the grid,
its magnitude ``sum s_mag_ij |d f_ij / d x_c|`` (forward-mode derivatives, one
per element of the tensor: meant for the small tensors tests capture).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import torch
from torch.nn.attention import flex_attention as torch_flex

from .oracle import SATURATED, Arith, error_budget


@dataclasses.dataclass
class FlexMods:
    """The mods as factories of their captured tensors: ``score(*captured) -> score_mod``,
    ``mask(*captured) -> mask_mod`` (None: none)."""

    score: Optional[Callable] = None
    mask: Optional[Callable] = None
    captured: tuple = ()

    def build(self, captured: Optional[tuple] = None) -> tuple:
        """(score_mod, mask_mod) reading ``captured`` (default: the problem's own tensors)."""
        captured = self.captured if captured is None else captured
        return (None if self.score is None else self.score(*captured),
                None if self.mask is None else self.mask(*captured))


@dataclasses.dataclass
class FlexResult:
    out: torch.Tensor
    lse: torch.Tensor
    dq: Optional[torch.Tensor] = None
    dk: Optional[torch.Tensor] = None
    dv: Optional[torch.Tensor] = None
    dcaptured: Optional[list] = None  # per captured tensor (None: no gradient)
    magnitude: Optional[dict] = None  # by result name; "dcaptured" a list


class _IndexByTensors(torch.overrides.TorchFunctionMode):
    """Tensor indexing with 0-d index tensors as aten.index (as torch's TransformGetItemToIndex,
    without its autograd.Function: forward-mode derivatives go through)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__getitem__:
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            if all(isinstance(i, (torch.Tensor, int)) for i in index):
                return torch.ops.aten.index.Tensor(args[0], [i if isinstance(i, torch.Tensor) else
                                                             torch.tensor(i) for i in index])
        return func(*args, **(kwargs or {}))


def _grid(fn, values, B, H, L, S, prefix):
    idx = (torch.arange(B), torch.arange(H), torch.arange(L), torch.arange(S))
    with _IndexByTensors():
        return torch_flex._vmap_for_bhqkv(fn, prefix=prefix)(*values, *idx)


def flex_attention_math(q, k, v, mods: FlexMods, scale: Optional[float], dtype: torch.dtype,
                        dout: Optional[torch.Tensor] = None, dlse: Optional[torch.Tensor] = None) -> FlexResult:
    """FlexAttention of (q, k, v) (their values taken exactly; Hq a multiple of Hkv) as plain
    math in ``dtype`` (:class:`Arith`; float64: the oracle, which also returns the rule's
    magnitudes), with the gradients of q, k, v and the captured tensors when ``dout`` is given."""
    A = Arith(dtype)
    f64 = lambda t: t.detach().cpu().to(torch.float64)  # noqa: E731
    q, k, v = f64(q), f64(k), f64(v)
    B, H, L, D = q.shape
    S, G = k.shape[2], H // k.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    kk, vv = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    captured = [f64(t).requires_grad_(t.requires_grad and t.dtype.is_floating_point) if t.dtype.is_floating_point
                else t.detach().cpu() for t in mods.captured]
    score_mod, mask_mod = mods.build(tuple(captured))

    s = A.r(A.mm(q, kk.transpose(-1, -2)) * scale).requires_grad_()
    with torch.enable_grad():
        f = s if score_mod is None else _grid(score_mod, (s,), B, H, L, S, (0,))
    fprime = torch.ones_like(s) if score_mod is None else \
        torch.autograd.grad(f, s, torch.ones_like(f), retain_graph=True, allow_unused=True)[0]
    fprime = torch.zeros_like(s) if fprime is None else torch.nan_to_num(fprime, nan=0.0)
    s, s_mod = s.detach(), A.i(f.detach())
    vis = s_mod > -math.inf
    if mask_mod is not None:
        vis = vis & _grid(mask_mod, (), B, H, L, S, ()).to(torch.bool)

    m = torch.where(vis, s_mod, -math.inf).amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, 0.0)
    e = torch.where(vis, A.fn(torch.exp, A.i(torch.where(vis, s_mod, m) - m)), 0.0)
    l = A.isum(e, -1).unsqueeze(-1)
    seen = l > 0
    p = torch.where(seen, A.r(e / torch.where(seen, l, 1.0)), 0.0)
    out = A.mm(p, vv)
    lse = torch.where(seen, A.r(m + A.fn(torch.log, torch.where(seen, l, 1.0))), -math.inf).squeeze(-1)
    res = FlexResult(out=out, lse=lse)
    if A.exact:
        fin = lambda t: torch.where(vis, t, 0.0)  # noqa: E731
        amag = fin(fprime.abs() * scale * (q.abs() @ kk.abs().transpose(-1, -2)) + s_mod.abs() + (s * fprime).abs())
        pa = p * amag
        a = pa.sum(-1, keepdim=True)
        p_err = pa * (1 - 2 * p) + p * a
        res.magnitude = {"out": (p + pa) @ vv.abs() + a * out.abs(),
                         "lse": torch.where(seen.squeeze(-1), lse.abs() + a.squeeze(-1), 0.0)}
    if dout is None:
        return res

    live = seen & (m > SATURATED)
    p = torch.where(live, p, 0.0)
    do = f64(dout)
    dp = A.mm(do, vv.transpose(-1, -2))
    delta = A.isum(A.i(p * dp), -1).unsqueeze(-1)
    if dlse is not None:
        delta = A.i(delta - torch.where(live, f64(dlse).unsqueeze(-1), 0.0))
    dsp = A.r(p * A.i(dp - delta))  # the gradient of the modded score
    ds = A.r(A.r(dsp * A.i(fprime)) * scale)
    res.dq = A.mm(ds, kk)

    def group_sum(x):  # (B, H, Lk, D) -> (B, Hkv, Lk, D), head after head
        return A.sum(x.unflatten(1, (k.shape[1], G)), 2)

    res.dk = group_sum(A.mm(ds.transpose(-1, -2), q))
    res.dv = group_sum(A.mm(p.transpose(-1, -2), do))
    trainable = [t for t in captured if t.requires_grad]
    res.dcaptured = [None] * len(captured)
    if trainable:
        grads = torch.autograd.grad(f, trainable, torch.where(vis, dsp, 0.0), retain_graph=True, allow_unused=True)
        it = iter(grads)
        for i, t in enumerate(captured):
            if t.requires_grad:
                g = next(it)
                g = torch.zeros_like(t) if g is None else g
                res.dcaptured[i] = g if A.exact else g.to(torch.float32).to(torch.float64)
    if A.exact:
        p_err = torch.where(live, p_err, 0.0)
        d_mag = (do.abs() * out.abs()).sum(-1, keepdim=True)
        if dlse is not None:
            d_mag = d_mag + f64(dlse).abs().unsqueeze(-1)
        dp_mag = do.abs() @ vv.abs().transpose(-1, -2)
        delta_err = (p_err * dp.abs()).sum(-1, keepdim=True)
        s_mag = p * (dp_mag + d_mag + delta_err) + p_err * (dp - delta).abs()
        M = res.magnitude
        sf = s_mag * fprime.abs()
        M["dq"] = scale * (sf @ kk.abs())
        M["dk"] = scale * (sf.transpose(-1, -2) @ q.abs()).unflatten(1, (k.shape[1], G)).sum(2)
        M["dv"] = ((p + p_err).transpose(-1, -2) @ do.abs()).unflatten(1, (k.shape[1], G)).sum(2)
        M["dcaptured"] = [_captured_magnitude(mods, s, captured, i, torch.where(vis, s_mag, 0.0))
                          if t.requires_grad else None for i, t in enumerate(captured)]
    return res


def _captured_magnitude(mods: FlexMods, s: torch.Tensor, captured: list, i: int, weight: torch.Tensor,
                        chunk: int = 32) -> torch.Tensor:
    """sum_ij weight_ij |d score_mod(s)_ij / d captured[i]_c| for every element c (forward-mode
    derivatives along each element, ``chunk`` at a time)."""
    B, H, L, S = s.shape
    x = captured[i].detach()

    def modded(xi):
        values = [t.detach() for t in captured]
        values[i] = xi
        return _grid(mods.score(*values), (s,), B, H, L, S, (0,))

    def column(tangent):
        _, d = torch.func.jvp(modded, (x,), (tangent,))
        return (weight * torch.nan_to_num(d, nan=0.0, posinf=0.0, neginf=0.0).abs()).sum()

    eye = torch.eye(x.numel(), dtype=torch.float64).view(x.numel(), *x.shape)
    return torch.cat([torch.func.vmap(column)(eye[c:c + chunk]) for c in range(0, x.numel(), chunk)]).view(x.shape)


def flex_reference(q, k, v, mods: FlexMods, scale: Optional[float] = None, dout: Optional[torch.Tensor] = None,
                   dlse: Optional[torch.Tensor] = None) -> tuple[FlexResult, FlexResult]:
    """(oracle, plain math in the inputs' dtype) of a FlexAttention problem."""
    return (flex_attention_math(q, k, v, mods, scale, torch.float64, dout, dlse),
            flex_attention_math(q, k, v, mods, scale, q.dtype, dout, dlse))


def flex_errors(q, mods: FlexMods, got: dict, reference: tuple) -> dict:
    """{name: (error, allowed)} of results ``got`` ({"out", "lse", "dq", "dk", "dv",
    "dcaptured": [per captured tensor or None]}) against ``reference`` (:func:`flex_reference`),
    per the rule: the worst element of each (of each captured tensor, "dcaptured<i>")."""
    ref, low = reference
    dtype = q.dtype
    out = {}
    for name, value in got.items():
        if name == "dcaptured":
            for i, g in enumerate(value):
                want = ref.dcaptured[i]
                if want is None and g is None:
                    continue
                if (want is None) != (g is None):
                    raise AssertionError(f"dcaptured[{i}]: got {'a gradient' if g is not None else 'none'}, "
                                         f"expected {'one' if want is not None else 'none'}")
                # the attention's rule, plus the final rounding to the tensor's own dtype
                out[f"dcaptured{i}"] = error_budget(f"dcaptured{i}", g, want, low.dcaptured[i],
                                                    ref.magnitude["dcaptured"][i], dtype,
                                                    result_dtype=mods.captured[i].dtype)
            continue
        out[name] = error_budget(name, value, getattr(ref, name), getattr(low, name), ref.magnitude[name], dtype)
    return out


def check_flex(q, mods: FlexMods, got: dict, reference: tuple) -> None:
    """Assert results against the oracle (see :func:`flex_errors`)."""
    for name, (err, allowed) in flex_errors(q, mods, got, reference).items():
        if not err <= allowed:
            raise AssertionError(f"{name}: max error {err:.3e} > allowed {allowed:.3e} (2 x plain "
                                 f"{str(q.dtype)[6:]} math error + rounding floor; torch_metal_flash.testing)")
