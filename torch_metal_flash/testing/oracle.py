"""Testing attention results against the float64 oracle, identically on every machine.

The acceptance rule
-------------------
A result ``y`` (out, lse, dq, dk, dv, dbias, dsinks) of inputs in dtype ``T``
passes when, for every element::

    |y - ref64| <= 2 * max|plain_T - ref64| + 4 * (u + u_64) * M + u_T * |ref64|

* ``ref64``: the same math in float64 (:func:`plain_attention`; its gradients
  are checked against torch's autograd in tests/kernels/test_precision.py).
* ``plain_T``: plain attention math in ``T`` -- flash-attn's rule:
  "twice the error of the same math in the same dtype" -- computed by
  :class:`Arith` so that it is the same number on every machine: each operation
  computes in float32 and rounds its output to ``T``; reductions add one term
  after the other in float32.  It is *not* torch's own low-precision math: that
  runs through the machine's BLAS (MKL, OpenBLAS, Accelerate, oneDNN) and
  vectorised exp/tanh, whose rounding depends on the CPU model, its vector
  instructions and the thread count: with it, a verdict would depend on the
  machine (for the same inputs, float32 ``dv`` would be allowed 2.875e-06 on one
  machine and 1.911e-06 on another, by MKL's code path, which
  ``MKL_CBWR=COMPATIBLE`` changes).
* ``4 * u * M``: the floor of a stated error model.  ``plain_T`` follows one
  order of operations and is sometimes exact by luck where a kernel, summing in
  another order, is not (one visible key: ``dP - delta`` is exactly 0 in
  ``plain_T``, ~1 ulp of ``|dO||V|`` in the kernels).  ``M`` is, per element,
  the magnitude of the terms of the last reductions that produce it: ``P |V|``
  for out; ``|lse|`` plus the P-weighted ``scale |q||k| + |bias| + |ALiBi|``
  for lse; ``P^T |dO|`` for dV; ``P (|dO||V|^T + rowsum(|dO||O|) + |dlse|)`` for
  dS = dbias, and through it ``scale |dS||K|`` / ``scale |dS|^T|Q|`` for dQ /
  dK.  ``u`` is the unit roundoff of the kernels' float32 accumulators (2^-24;
  2^-53 for float64 inputs).  A sum reordered changes by a few ``u * sum|terms|``
  in practice (n u in the worst case); 4 covers the kernels' blocked orders.
  ``M`` carries no length factor and is per element: it cannot hide an error
  that grows with the sequence, and a row of huge scores (a finfo.min mask)
  widens no other row's budget.
* The scores' own rounding, carried through exp: a score ``s = scale q.k``
  (+ bias, ALiBi) is itself a sum, off by a few ``u * a`` with ``a = scale
  |q||k| + |bias| + |ALiBi|`` its magnitude, and exp turns an absolute error
  of ``s`` into a relative error of P.  To first order ``dP_ij = P_ij
  sum_{k != j} P_ik (e_ij - e_ik)`` with ``|e| <= a``, so ``|dP_ij| <= P_ij
  (a_ij (1 - 2 P_ij) + sum_k P_ik a_ik) =: p_err`` (no term for k = j: a lone
  key's P is exactly 1 whatever its score), and ``out = sum_j P_ij v_j`` moves
  by ``sum_j P_ij e_ij (v_j - out_i)``.  ``M`` therefore also holds
  ``(P a) |V| + rowsum(P a) |out|`` for out (lse already held ``rowsum(P a)``),
  ``p_err^T |dO|`` for dV, and ``p_err |dP - delta| + P rowsum(p_err |dP|)``
  for dS (delta = rowsum(dO O) moves with O).  One float32 ulp of a score is
  ``2 u |s|``: at |s| ~ 1300 it is 1.2e-4, a relative 1.2e-4 of P -- far above
  ``4 u``; plain_T makes the same kind of error but can round two top scores
  alike by luck (the long fuzz profile's ``kvpacked_f32_decode_route_big_scores_out``:
  out off by 2.5e-5 in the kernels, 3.5e-7 in plain float32, both correct).
  In ordinary problems (|s| <= 30, tests/kernels/test_precision.py's sweep and
  planted-defect problems) it widens the allowed error of out, dq, dk, dv and
  dbias by a median 1.0-3.7x (dsinks 2.3-6.7x), up to 12x on single elements;
  lse is unchanged; the planted defects still fail (bench/rule_widening.py,
  bench/results/rule_widening.md).
* ``u_64``: the oracle's own rounding.  ``ref64`` is float64 math, a few
  ``u_64 * M`` off the exact value.  Beside float32 accumulators that is noise
  (2^-29 of the floor), but for float64 inputs the reference path and the
  oracle are two float64 computations of the same size of error, and plain_T
  (float64, one term after the other) may agree with the oracle bit for bit
  (base 0, the fuzz's ``sdpa_f64_reference_dv``: the oracle 2 ulps off the
  exact dV, the reference path 1): the floor must hold both errors.
* ``u_T * |ref64|``: the final rounding of a float16/bfloat16 out, dq, dk, dv.
  A composite of operations in T rounds its intermediates to T as well (torch's
  nn.MultiheadAttention in float16: the attention's dq in float16, then
  ``dquery = dq W``), each a ``u_T |x|`` that the later linear maps carry to the
  result as ``u_T |x| |W|`` -- more than ``u_T |ref64|`` where the map cancels,
  and not in plain_T's error when plain_T rounds x luckily (the long fuzz
  profile's ``mha_f16_dquery``: dquery 1.3 float16 ulps off, plain_T 0.3).  Such
  faces add those carried magnitudes to ``|ref64|`` (``rounded``).

Why not "2 x the same-dtype baseline + atol" for float32 (an atol of 1e-5 or
1e-6, say): an absolute atol does not scale with the values --
it is less than one ulp of |dk| = 142, reached at large scores, and would hide
a 1e-4 relative error in a gradient of size 0.1 -- and the baseline alone is
sometimes exact by luck.  The rule above has no absolute constant.
tests/kernels/test_precision.py plants small defects (one key dropped from one
gradient row, a 1e-4 relative error in one row of dV, the softmax scale off by
1 + 1e-5) into correct kernel results and checks that each still fails, and
sweeps float32 gradients up to |score| = 30; bench/precision.py prints max
error / allowed of this checkout, or of another with ``--package``.

Inputs
------
:func:`randn` draws standard-normal-like samples that are the same on every
machine: ``torch.randn`` is not (its vectorised AVX2/AVX-512 path and its
scalar path, used e.g. on ARM, give different bits).  The test suite's
``conftest.py`` routes ``torch.randn`` / ``Tensor.normal_`` through it.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

import torch_metal_flash.problem.philox as philox
from ..problem.spec import AttentionSpec

UNIT_ROUNDOFF = {torch.float64: 2.0 ** -53, torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11,
                 torch.bfloat16: 2.0 ** -8}
FLOOR_ROUNDINGS = 4  # C of the rule
# A row whose max score is below this passes no gradient (spec: saturated rows).
SATURATED = -1e37


def randn(*size, generator: Optional[torch.Generator] = None, dtype: Optional[torch.dtype] = None,
          device=None, requires_grad: bool = False, out=None, layout=None, pin_memory=False,
          names=None) -> torch.Tensor:
    """Like ``torch.randn`` but bitwise identical on every machine.

    Sum of 12 uniforms minus 6 (mean 0, variance 1, within +-6): uniform bits
    are machine-independent and float64 additions are exact roundings, while
    ``torch.randn``'s Box-Muller runs vectorised (AVX2/AVX-512) or scalar
    transcendental functions depending on the CPU.
    """
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    u = torch.rand((12, *size), generator=generator, dtype=torch.float64)
    x = u[0]
    for i in range(1, 12):
        x = x + u[i]
    x = (x - 6.0).to(dtype or torch.get_default_dtype())
    if device is not None:
        x = x.to(device)
    if out is not None:
        return out.copy_(x)
    return x.requires_grad_(requires_grad)


# ---------------------------------------------------------------------------
# Plain math in a chosen dtype, identical on every machine.
# ---------------------------------------------------------------------------
class Arith:
    """Plain PyTorch math in ``dtype``, identical on every machine.

    Values are float64 tensors holding numbers of ``dtype``.  As torch's CPU
    kernels do, an operation computes in float32 (float64 for float64) and
    rounds its output to ``dtype`` once: :meth:`r` rounds an operation's output,
    :meth:`i` a step inside one (a fused softmax, say).  Reductions accumulate
    one term after the other in float32 -- IEEE float32 additions, the same bits
    everywhere, unlike a BLAS -- or, for float16/bfloat16, exactly: there the
    output rounding dominates.  Transcendental functions are evaluated in
    float64 and rounded.

    ``Arith(torch.float64)`` is the oracle (``exact``: float64 as torch computes
    it).  ``Arith(torch.float64, exact=False)`` is plain math *for* float64
    inputs (the reference path's results): reductions one term after the other
    in float64.  The oracle's float64 BLAS calls would otherwise be the very
    same ones, and the baseline's error 0 by luck."""

    def __init__(self, dtype: torch.dtype, exact: Optional[bool] = None):
        self.dtype = dtype
        self.exact = dtype == torch.float64 if exact is None else exact
        self.acc = torch.float64 if dtype == torch.float64 else torch.float32  # accumulation dtype

    def i(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.acc == torch.float64 else x.to(torch.float32).to(torch.float64)

    def r(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.acc == torch.float64 else x.to(torch.float32).to(self.dtype).to(torch.float64)

    def _sequential(self) -> bool:
        return not self.exact and self.dtype in (torch.float32, torch.float64)

    def mm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """The output of a @ b, a (..., n, k), b (..., k, m)."""
        if not self._sequential():
            return self.r(a @ b)
        a_, b_ = a.to(self.acc), b.to(self.acc)
        acc = torch.zeros(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1]),
                          dtype=self.acc)
        for t in range(a.shape[-1]):
            acc = acc + a_[..., :, t:t + 1] * b_[..., t:t + 1, :]
        return acc.to(torch.float64)

    def isum(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """A sum inside an operation (float32; float64 for float64)."""
        if not self._sequential():
            return self.i(x.sum(dim))
        x_ = x.to(self.acc).movedim(dim, 0)
        acc = torch.zeros(x_.shape[1:], dtype=self.acc)
        for t in range(x_.shape[0]):
            acc = acc + x_[t]
        return acc.to(torch.float64)

    def sum(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """The output of x.sum(dim)."""
        return self.r(self.isum(x, dim))

    def fn(self, f, x: torch.Tensor) -> torch.Tensor:
        """A transcendental function, inside an operation."""
        return self.i(f(x))


@dataclasses.dataclass
class Attention:
    """Results of :func:`plain_attention` (float64 tensors, logical (B, H, L, D) dims)."""
    out: torch.Tensor
    lse: torch.Tensor
    dq: Optional[torch.Tensor] = None
    dk: Optional[torch.Tensor] = None
    dv: Optional[torch.Tensor] = None
    dbias: Optional[torch.Tensor] = None
    dsinks: Optional[torch.Tensor] = None
    # Magnitudes M of the rule (float64 runs only), by result name.
    magnitude: Optional[dict] = None


def _inputs(spec: AttentionSpec):
    f64 = (lambda t: None if t is None else t.detach().cpu().to(torch.float64))
    mask = spec.mask
    if mask is not None:
        mask = mask.detach().cpu()
        mask = mask if mask.dtype == torch.bool else mask.to(torch.float64)
    return f64(spec.q), f64(spec.k), f64(spec.v), mask, f64(spec.alibi_slopes), f64(spec.sinks)


def plain_attention(spec: AttentionSpec, dtype: torch.dtype, dout: Optional[torch.Tensor] = None,
                    dlse: Optional[torch.Tensor] = None, compute_dbias: bool = False,
                    keep: Optional[torch.Tensor] = None, exact: Optional[bool] = None) -> Attention:
    """Attention of ``spec`` (its inputs taken exactly) computed as plain math in
    ``dtype`` with :class:`Arith`: softmax(scores) @ V, and with ``dout`` the
    textbook gradients (autograd's softmax backward: dS = P (dP - rowsum(P dP))).
    ``dtype=torch.float64`` is the oracle, which also returns the magnitudes of
    the rule; ``exact=False`` with float64 gives the plain math for float64 inputs
    (:class:`Arith`).  With dropout (``spec.dropout``), ``keep`` (bool, broadcast to
    (B, H, Lq, Lk)) is the mask to apply -- the kernel's own, recovered from its
    ``fwd_probs`` -- as torch's dropout does: P' = P * keep / (1 - p), one
    operation in ``dtype``, and its gradient through the same factor."""
    A = Arith(dtype, exact)
    drop = None
    if spec.dropout is not None:
        if keep is None:
            raise ValueError("plain_attention: a spec with dropout needs the keep mask")
        drop = keep.detach().cpu().to(torch.float64) * philox.keep_scale(spec.dropout.p)
    q, k, v, mask, slopes, sinks = _inputs(spec)
    B, H, Lq, Lk = spec.batch, spec.heads, spec.seqlen_q, spec.seqlen_k
    G = H // spec.kv_heads
    kk, vv = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)

    # Scores, transformed in the spec's order.
    qk = A.mm(q, kk.transpose(-1, -2))
    s = A.r(qk * spec.scale)
    th = None
    if spec.softcap > 0:
        th = A.r(A.fn(torch.tanh, A.r(s / spec.softcap)))
        s = A.r(spec.softcap * th)
    i = torch.arange(Lq).unsqueeze(-1)
    j = torch.arange(Lk)
    if slopes is not None:
        dist = (i + spec.diag_offset - j).abs().to(torch.float64)
        s = A.r(s - A.r(slopes[:, :, None, None] * dist))
    vis = spec.visible(i, j).expand(B, H, Lq, Lk)
    if mask is not None:
        if mask.dtype == torch.bool:
            vis = vis & mask
        else:
            s = A.r(s + mask)

    # Softmax (one operation: normalised by the row max, the sink a logit of
    # its own) and logsumexp.
    neg = torch.tensor(-math.inf, dtype=torch.float64)
    m = torch.where(vis, s, neg).amax(-1, keepdim=True) if Lk else torch.full((B, H, Lq, 1), -math.inf,
                                                                                 dtype=torch.float64)
    sink = None if sinks is None else A.r(sinks)[None, :, None, None].expand(B, H, Lq, 1)
    if sink is not None:
        m = torch.maximum(m, sink)
    m = torch.where(torch.isfinite(m), m, 0.0)
    e = torch.where(vis, A.fn(torch.exp, A.i(torch.where(vis, s, m) - m)), 0.0)
    terms = e if sink is None else torch.cat([e, A.fn(torch.exp, A.i(sink - m))], dim=-1)
    l = A.isum(terms, -1).unsqueeze(-1)
    seen = l > 0
    p_all = torch.where(seen, A.r(terms / torch.where(seen, l, 1.0)), 0.0)
    p = p_all[..., :Lk]
    pd = p if drop is None else A.r(p * drop)  # the probabilities after dropout
    out = A.mm(pd, vv)
    lse = torch.where(seen, A.r(m + A.fn(torch.log, torch.where(seen, l, 1.0))), math.inf).squeeze(-1)
    res = Attention(out=out, lse=lse)

    # Magnitudes of the forward's last reductions: out = P V; lse = m + log l
    # (m is a score: the magnitude of its terms, q.k and the transforms).  A
    # score carries a few u * amag of its own rounding, which exp turns into
    # an error of P: dP_ij = P_ij sum_k P_ik (e_ij - e_ik), |e| <= amag, so
    # |dP_ij| <= p_err_ij = P_ij (amag_ij (1 - 2 P_ij) + rowsum(P amag)) (the
    # k = j term cancels: a lone key's P is exactly 1); out = sum_j P_ij v_j moves
    # by sum_j P_ij e_ij (v_j - out_i), at most (P amag) |V| + rowsum(P amag) |out|.
    if A.exact:
        amag = spec.scale * (q.abs() @ kk.abs().transpose(-1, -2))
        if slopes is not None:
            amag = amag + slopes.abs()[:, :, None, None] * dist
        if mask is not None and mask.dtype != torch.bool:
            amag = amag + mask.abs()
        pa = torch.where(p > 0, p * amag, 0.0)
        a = pa.sum(-1, keepdim=True)
        p_err = pa * (1 - 2 * p) + p * a
        pad, p_errd = (pa, p_err) if drop is None else (pa * drop, p_err * drop)  # dropout scales P's error too
        res.magnitude = {"out": (pd + pad) @ vv.abs() + a * out.abs(),
                         "lse": torch.where(seen.squeeze(-1), lse.abs() + a.squeeze(-1), 0.0)}
    if dout is None:
        return res

    # Backward (rows whose max is below SATURATED pass no gradient); the
    # softmax backward is one operation.
    live = seen & (m > SATURATED)
    p = torch.where(live, p, 0.0)
    pd = torch.where(live, pd, 0.0)
    do = dout.detach().cpu().to(torch.float64)
    dpd = A.mm(do, vv.transpose(-1, -2))
    dp = dpd if drop is None else A.r(dpd * drop)  # the gradient of P through dropout
    delta = A.isum(A.i(p * dp), -1).unsqueeze(-1)
    if dlse is not None:
        delta = A.i(delta - torch.where(live, dlse.detach().cpu().to(torch.float64).unsqueeze(-1), 0.0))
    ds = A.r(p * A.i(dp - delta))  # the gradient of the final score
    res.dbias = ds if compute_dbias else None
    if sinks is not None:
        ps = torch.where(live, p_all[..., Lk:], 0.0)
        res.dsinks = -A.sum(A.i(ps * delta).squeeze(-1).transpose(0, 1).reshape(H, B * Lq), -1)
    if th is not None:
        ds = A.r(ds * A.r(1.0 - A.r(th * th)))
    ds = A.r(ds * spec.scale)
    res.dq = A.mm(ds, kk)

    def group_sum(x):  # (B, H, Lk, D) -> (B, Hkv, Lk, D): the sum over each GQA group, head after head
        return A.sum(x.unflatten(1, (spec.kv_heads, G)), 2)

    res.dk = group_sum(A.mm(ds.transpose(-1, -2), q))
    res.dv = group_sum(A.mm(pd.transpose(-1, -2), do))
    if A.exact:
        # Magnitudes of the backward's last reductions.  delta's terms are
        # dO * O (how FlashAttention computes it), dP's dO * V.
        # P (and O, hence delta = rowsum(dO O) = rowsum(P dP)) carry the scores'
        # rounding, to first order: dS = P (dP - delta) moves by at most
        # p_err |dP - delta| + P rowsum(p_err |dP|) (dP: through dropout).
        p_err, p_errd = torch.where(live, p_err, 0.0), torch.where(live, p_errd, 0.0)
        d_mag = (do.abs() * out.abs()).sum(-1, keepdim=True)
        if dlse is not None:
            d_mag = d_mag + dlse.detach().cpu().to(torch.float64).abs().unsqueeze(-1)
        dp_mag = do.abs() @ vv.abs().transpose(-1, -2)
        delta_err = (p_err * dp.abs()).sum(-1, keepdim=True)
        s_mag = p * ((dp_mag if drop is None else dp_mag * drop) + d_mag + delta_err) + p_err * (dp - delta).abs()
        M = res.magnitude
        M["dbias"] = s_mag
        M["dq"] = spec.scale * (s_mag @ kk.abs())
        M["dk"] = spec.scale * (s_mag.transpose(-1, -2) @ q.abs()).unflatten(1, (spec.kv_heads, G)).sum(2)
        M["dv"] = ((pd + p_errd).transpose(-1, -2) @ do.abs()).unflatten(1, (spec.kv_heads, G)).sum(2)
        if sinks is not None:
            # the sink's logit is exact: its P moves by P_sink rowsum(P amag)
            ps = torch.where(live, p_all[..., Lk:], 0.0)
            M["dsinks"] = (ps * (d_mag + a * delta.abs() + delta_err)).sum((0, 2, 3))
    return res


# ---------------------------------------------------------------------------
# The rule.
# ---------------------------------------------------------------------------
def allowed_error(name: str, ref64: torch.Tensor, plain: torch.Tensor, magnitude: torch.Tensor,
                  dtype: torch.dtype, rounded: Optional[torch.Tensor] = None,
                  result_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The rule's allowed error at each finite element of ``ref64`` (flattened);
    ``rounded``: the intermediates a composite rounds to ``dtype``, carried to the result;
    ``result_dtype``: what the result is rounded to when not the inputs' dtype (out, dq, dk,
    dv) or float32 (the other results), e.g. a captured tensor's gradient in its own dtype."""
    ref64, plain = (t.detach().cpu().to(torch.float64) for t in (ref64, plain))
    magnitude = magnitude.detach().cpu().to(torch.float64).expand(ref64.shape)
    finite = torch.isfinite(ref64)
    base = (plain - ref64)[finite].abs().max()
    u_acc = UNIT_ROUNDOFF[torch.float64 if dtype == torch.float64 else torch.float32]
    u_oracle = UNIT_ROUNDOFF[torch.float64]  # the oracle's own rounding (as large as u_acc for float64 inputs)
    allowed = 2 * base + FLOOR_ROUNDINGS * (u_acc + u_oracle) * magnitude[finite]
    if result_dtype is None:
        result_dtype = dtype if name in ("out", "dq", "dk", "dv") else torch.float32
    if result_dtype in (torch.float16, torch.bfloat16):
        carried = 0.0 if rounded is None else rounded.detach().cpu().to(torch.float64).expand(ref64.shape)[finite]
        allowed = allowed + UNIT_ROUNDOFF[result_dtype] * (ref64[finite].abs() + carried)
    return allowed


def error_budget(name: str, got: torch.Tensor, ref64: torch.Tensor, plain: torch.Tensor,
                 magnitude: torch.Tensor, dtype: torch.dtype, rounded: Optional[torch.Tensor] = None,
                 result_dtype: Optional[torch.dtype] = None) -> tuple[float, float]:
    """(error, allowed) per the rule (:func:`allowed_error`) at the element where error / allowed
    is largest; infinities must match exactly.  The floor is per element (a row
    of huge scores, e.g. a finfo.min mask, widens no other row's budget)."""
    got, ref64 = (t.detach().cpu().to(torch.float64) for t in (got, ref64))
    if got.shape != ref64.shape:
        raise AssertionError(f"{name}: shape {tuple(got.shape)} != reference {tuple(ref64.shape)}")
    finite = torch.isfinite(ref64)
    if not torch.equal(torch.isfinite(got), finite) or not torch.equal(got[~finite], ref64[~finite]):
        bad = (torch.isfinite(got) != finite) | (~finite & (got != ref64))
        idx = bad.nonzero()[0].tolist()
        raise AssertionError(f"{name}: non-finite mismatch at {idx}: got {got[tuple(idx)]}, "
                             f"reference {ref64[tuple(idx)]}")
    if not finite.any():
        return 0.0, 0.0
    err = (got - ref64)[finite].abs()
    allowed = allowed_error(name, ref64, plain, magnitude, dtype, rounded, result_dtype)
    worst = torch.where(allowed > 0, err / allowed, torch.where(err > 0, math.inf, 0.0)).argmax()
    return err[worst].item(), allowed[worst].item()


def assert_matches_oracle(name: str, got: torch.Tensor, ref64: torch.Tensor, plain: torch.Tensor,
                          magnitude: torch.Tensor, dtype: torch.dtype) -> None:
    err, allowed = error_budget(name, got, ref64, plain, magnitude, dtype)
    if not err <= allowed:
        raise AssertionError(f"{name}: max error {err:.3e} > allowed {allowed:.3e} "
                             f"(2 x plain {str(dtype)[6:]} math error + rounding floor; torch_metal_flash.testing)")


def generator_keep_mask(spec: AttentionSpec) -> torch.Tensor:
    """The dropout mask the host Philox generator gives a padded problem with dropout: bool
    (B, H, Lq, Lk), what the kernels must draw (and the oracle's ``keep``)."""
    d = spec.dropout
    B, H, Lq, Lk = spec.batch, spec.heads, spec.seqlen_q, spec.seqlen_k
    bh = ((torch.arange(B) + d.batch_offset) * H)[:, None, None, None] + torch.arange(H)[None, :, None, None]
    return philox.keep_mask(d.rng_state, d.p, bh, torch.arange(Lq)[:, None], torch.arange(Lk))


def forward_reference(spec: AttentionSpec, keep: Optional[torch.Tensor] = None) -> tuple[Attention, Attention]:
    """(oracle, plain math in the inputs' dtype) of the forward (``keep``: the dropout mask)."""
    return plain_attention(spec, torch.float64, keep=keep), plain_attention(spec, spec.q.dtype, keep=keep)


def check_forward(spec: AttentionSpec, out: torch.Tensor, lse: torch.Tensor,
                  keep: Optional[torch.Tensor] = None) -> None:
    """Assert a forward result (out, lse) against the float64 oracle (``keep``: the dropout mask)."""
    ref, low = forward_reference(spec, keep)
    for name, got in (("out", out), ("lse", lse)):
        assert_matches_oracle(name, got, getattr(ref, name), getattr(low, name), ref.magnitude[name], spec.q.dtype)


GRAD_NAMES = ("dq", "dk", "dv", "dbias", "dsinks")


def backward_reference(spec: AttentionSpec, dout: torch.Tensor, dlse: Optional[torch.Tensor] = None,
                       compute_dbias: bool = False, keep: Optional[torch.Tensor] = None) -> tuple[Attention, Attention]:
    """(oracle, plain math in the inputs' dtype) of the forward and the gradients."""
    return (plain_attention(spec, torch.float64, dout, dlse, compute_dbias, keep),
            plain_attention(spec, spec.q.dtype, dout, dlse, compute_dbias, keep))


def grad_errors(spec: AttentionSpec, dout: torch.Tensor, dlse: Optional[torch.Tensor], grads,
                compute_dbias: bool = False, reference=None, keep: Optional[torch.Tensor] = None) -> dict:
    """{name: (max error, allowed)} of ``grads = (dq, dk, dv, dbias, dsinks)``
    (dbias checked when ``compute_dbias``, dsinks when the spec has sinks)."""
    ref, low = reference or backward_reference(spec, dout, dlse, compute_dbias, keep)
    result = {}
    for name, got in zip(GRAD_NAMES, grads):
        want = getattr(ref, name)
        if want is None or got is None:
            continue
        if name in ("dq", "dk", "dv") and got.dtype != spec.q.dtype:
            raise AssertionError(f"{name}: dtype {got.dtype} != {spec.q.dtype}")
        result[name] = error_budget(name, got, want, getattr(low, name), ref.magnitude[name], spec.q.dtype)
    return result


def check_backward(spec: AttentionSpec, dout: torch.Tensor, dlse: Optional[torch.Tensor], grads,
                   compute_dbias: bool = False, reference=None, keep: Optional[torch.Tensor] = None) -> None:
    """Assert gradients ``(dq, dk, dv, dbias, dsinks)`` against the float64 oracle."""
    for name, (err, allowed) in grad_errors(spec, dout, dlse, grads, compute_dbias, reference, keep).items():
        if not err <= allowed:
            raise AssertionError(f"{name}: max error {err:.3e} > allowed {allowed:.3e} (2 x plain "
                                 f"{str(spec.q.dtype)[6:]} math error + rounding floor; torch_metal_flash.testing)")
