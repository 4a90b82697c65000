"""The ``torch.ops.metal_flash`` custom ops: schemas, fake kernels, autograd.

Schemas (flat: tensors, optional tensors, int, float, bool)::

    fwd(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, Tensor? alibi_slopes, Tensor? sinks,
        float scale, int diag_offset, int window_left, int window_right, float softcap,
        bool return_aux, float dropout_p=0., Tensor? rng_state=None, Tensor? cu_seqlens_q=None,
        Tensor? cu_seqlens_k=None, Tensor? seqused_k=None, Tensor? block_table=None,
        int max_seqlen_q=0, int max_seqlen_k=0) -> (Tensor out, Tensor lse, Tensor aux)
    bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor aux, Tensor? dlse,
        Tensor? attn_mask, Tensor? alibi_slopes, Tensor? sinks, float scale, int diag_offset,
        int window_left, int window_right, float softcap, bool compute_dbias, float dropout_p=0.,
        Tensor? rng_state=None, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None,
        Tensor? seqused_k=None, int max_seqlen_q=0, int max_seqlen_k=0)
        -> (Tensor dq, Tensor dk, Tensor dv, Tensor dbias, Tensor dsinks)
    fwd_probs(<fwd's arguments without return_aux>) -> Tensor probs

Dropout and varlen are optional trailing arguments of the same two ops, not
ops of their own: both are features of the one pair of kernels (function
constants of flash_fwd.metal / flash_bwd.metal), so the autograd formula, the
plan cache, the fallbacks and the reference path stay one path; the existing
calls keep their meaning (the defaults switch both off).

* ``dropout_p`` > 0 drops attention probabilities, each by Philox
  (:mod:`torch_metal_flash.problem.philox`) from ``rng_state`` = (seed, offset), int64
  (2,) on q's device, and rescales the kept ones by 1 / (1 - p); the backward
  regenerates the mask from the same ``rng_state`` (nothing stored: memory stays
  O(L)).  The faces draw ``rng_state`` from the device's default generator per
  call (``philox.new_rng_state``).
* ``cu_seqlens_q``/``cu_seqlens_k`` (int32 (num_seqs + 1,)) make the call varlen:
  ``q`` (1, Hq, total_q, D), ``k``/``v`` (1, Hkv, total_k, D) views of packed
  sequences, each attended on its own with its band aligned to its bottom-right
  corner (``diag_offset`` counts from there), ``alibi_slopes`` (num_seqs, Hq) or
  (Hq,); outputs (1, Hq, total_q, ...).  ``max_seqlen_q``/``max_seqlen_k`` (ints:
  no data-dependent shapes) bound the sequence lengths; ``seqused_k``
  (num_seqs,) uses only the first keys of each sequence; ``block_table``
  (num_seqs, max_blocks) makes ``k``/``v`` paged caches (num_blocks, Hkv,
  page_size, D)-indexed (``bwd`` takes packed K/V only: fwd's autograd formula
  gathers paged K/V into a packed layout and sums dK/dV back into the blocks,
  :mod:`torch_metal_flash.ops.paged`).  The kernels read these index vectors
  on the GPU (no host synchronisation) and clamp what is out of range to the
  tensors: offsets to [0, total], each length to [0, max_seqlen] (an end before
  its start: an empty sequence), ``seqused_k`` to [0, the sequence's keys], block
  numbers to the pool -- never an access outside them (sequences that overlap
  after clamping race on their shared rows: garbage in, garbage out).
  ``TORCH_METAL_FLASH_DEBUG=1`` validates the values on the host instead (clear
  errors, one sync per call).  No ``attn_mask`` with varlen.
* ``fwd_probs`` (debug) returns flash-attn's ``S_dmask`` of a ``fwd`` call with
  the same arguments: (num_seqs, Hq, max_seqlen_q, max_seqlen_k) in q's dtype
  (padded problems: (B, Hq, Lq, Lk)), ``exp(s - m)`` per element with ``m`` the
  row's max, the sign bit set where dropout drops it, 0 where nothing is seen:
  ``probs >= 0`` (``~signbit``) recovers the keep mask, ``|probs| * exp(m - lse)``
  the probabilities.  It is O(L^2): for tests.

``aux`` is the row state the backward needs (:mod:`torch_metal_flash.problem.spec`:
row max and sum, and the unrounded output for fp16/bf16), written only when
``return_aux`` (the faces pass ``True`` when an input requires grad), else an
empty tensor; either side of a training step may fall back to the reference
path, aux is the same contract for both.  Both take the general problem of
:mod:`torch_metal_flash.problem.spec` so that the SDPA and flash-attn faces map onto
them without copies.  ``fwd_kvcache`` (``flash_attn_with_kvcache``) appends to
a KV cache in place and attends to it.

Their bodies run in the C++ core (:mod:`torch_metal_flash.core`): each op is a
:class:`~torch_metal_flash.core.CoreOp` (outputs, planner, reference path) and
a call replays a cached launch template, planning once per problem signature;
configurations the kernels do not cover fall back to the reference path with a
one-time warning naming the reason.  The Python bodies below only serve devices
the core does not (CUDA ...) and hand the first kernel call over to the core.

Schema notes: the kernels take ``alibi_slopes`` as float32 and ``sinks`` as a
contiguous float32 vector (other dtypes take the reference path; the faces
convert), and ``bwd`` takes ``dout`` with a contiguous last dim and a
contiguous ``dlse`` (the autograd formula makes them so).  ``fwd`` and
``fwd_kvcache`` also take K/V (caches) in float16 / bfloat16 under a float32 q
(mixed precision, on the decode kernels).

Quantized K/V (:mod:`torch_metal_flash.problem.quant`, inference only) have their own
ops, each the plain op's arguments with ``k``/``v`` (``k_cache``/``v_cache``)
the packed data, followed by the scales, the biases (None: symmetric int8) and
the format ``kv_bits, kv_group_size, kv_dtype`` (dtype code of
:data:`~torch_metal_flash.problem.quant.DTYPE_CODES`):

* ``fwd_quantized(q, k, v, attn_mask, alibi_slopes, sinks, scale, diag_offset,
  window_left, window_right, softcap, k_scales, k_biases, v_scales, v_biases,
  kv_bits, kv_group_size, kv_dtype) -> (out, lse)``; its backward raises.
* ``fwd_kvcache_quantized(<fwd_kvcache's arguments>, k_cache_scales,
  k_cache_biases, v_cache_scales, v_cache_biases, kv_bits, kv_group_size,
  kv_dtype) -> (out, lse)``, mutating the caches' data, scales and biases (the
  new rows are quantized by the append kernel).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor

from .. import backends, core, planner, reference
from ..planner.kvcache import KvCacheProblem, plan_kvcache
from ..planner.plan import Unsupported
from ..problem import checks
from ..problem.layout import empty_in_layout
from ..problem.quant import from_flat
from ..problem.spec import AttentionSpec, aux_width, make_spec, stats_dtype
from ..reference import kvcache as kvcache_reference
from . import paged


def check_args(q, k, v, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left, window_right,
               softcap, cu_seqlens_q=None, block_table=None) -> None:
    """Clear errors, naming the argument, for what the op cannot mean (the faces check
    their own arguments first; this guards direct calls of the ops).  The ops' ``outputs``
    functions run it: the C++ core calls them once per plan-cache key, on a miss (the
    checks read only what the key holds: dtypes, devices, shapes, scalars), the reference
    path and the fake kernels (torch.compile) on every call.  K/V may be quantized.
    Varlen (``cu_seqlens_q``): ALiBi slopes per sequence; paged K/V (``block_table``): k's
    first dim is the block pool (:func:`check_dropout_varlen` checks the rest)."""
    checks.tensor("q", q, ndim=(4,))
    checks.float_dtype("q", q)
    checks.head_dim("q", q)
    for name, t in (("k", k), ("v", v)):
        checks.kv_tensor(name, t, ndim=(4,))
        checks.head_dim(name, t)
    checks.kv_dtypes("q", q, ("k", "v"), k, v)
    B, H, Lq, D = q.shape
    if (k.shape[0] != B and block_table is None) or k.shape[3] != D:
        raise ValueError(f"k: expected shape ({B}, Hkv, Lk, {D}) (q's batch and head dim), got {tuple(k.shape)}")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v: expected shape ({', '.join(map(str, k.shape[:3]))}, Dv) like k's, got {tuple(v.shape)}")
    checks.gqa_heads(H, k.shape[1], "q", "k/v")
    if attn_mask is not None:
        checks.tensor("attn_mask", attn_mask)
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            raise TypeError(f"attn_mask: expected dtype bool or a float dtype, got {attn_mask.dtype}")
        checks.same(("q", "attn_mask"), (q, attn_mask), "device")
        checks.broadcastable("attn_mask", attn_mask, (B, H, Lq, k.shape[2]))
    if alibi_slopes is not None:
        checks.tensor("alibi_slopes", alibi_slopes)
        checks.float_dtype("alibi_slopes", alibi_slopes)
        checks.same(("q", "alibi_slopes"), (q, alibi_slopes), "device")
        rows = B if cu_seqlens_q is None else cu_seqlens_q.shape[0] - 1  # varlen: one row per sequence
        checks.broadcastable("alibi_slopes", alibi_slopes, (rows, H))
    checks.sinks(sinks, H, q.device)
    checks.scale("scale", scale)
    checks.window_side("window_left", window_left)
    checks.window_side("window_right", window_right)
    checks.softcap(softcap)


def _spec(q, k, v, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left, window_right,
          softcap, dropout_p=0.0, rng_state=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None,
          block_table=None, max_seqlen_q=0, max_seqlen_k=0) -> AttentionSpec:
    check_dropout_varlen(q, k, v, attn_mask, dropout_p, rng_state, cu_seqlens_q, cu_seqlens_k, seqused_k,
                         block_table, max_seqlen_q, max_seqlen_k)
    return make_spec(q, k, v, attn_mask, alibi_slopes, sinks, scale=scale, diag_offset=diag_offset,
                     window_left=window_left, window_right=window_right, softcap=softcap, dropout_p=dropout_p,
                     rng_state=rng_state, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                     seqused_k=seqused_k, block_table=block_table, max_seqlen_q=max_seqlen_q,
                     max_seqlen_k=max_seqlen_k)


def _index_vector(name: str, t, shape, device) -> None:
    checks.tensor(name, t, ndim=(len(shape),))
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name}: expected dtype int32, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    if any(isinstance(n, int) and n != want for n, want in zip(t.shape, shape) if want is not None):
        raise ValueError(f"{name}: expected shape {tuple('*' if n is None else n for n in shape)}, "
                         f"got {tuple(t.shape)}")


def check_dropout_varlen(q, k, v, attn_mask, dropout_p, rng_state, cu_seqlens_q, cu_seqlens_k, seqused_k,
                         block_table, max_seqlen_q, max_seqlen_k) -> None:
    """Clear errors for the dropout and varlen arguments of the ops (shapes, dtypes,
    devices; index values are read on the GPU only)."""
    if isinstance(dropout_p, (int, float)) and not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout_p: expected a float in [0, 1], got {dropout_p!r}")
    if rng_state is not None:
        checks.tensor("rng_state", rng_state, ndim=(1,))
        if rng_state.dtype != torch.int64 or rng_state.shape[0] != 2 or rng_state.device != q.device:
            raise ValueError(f"rng_state: expected an int64 (seed, offset) pair on {q.device}, got "
                             f"{rng_state.dtype} {tuple(rng_state.shape)} on {rng_state.device}")
    elif dropout_p > 0:
        raise ValueError("rng_state: required when dropout_p > 0 (an int64 (seed, offset) pair; "
                         "torch_metal_flash.problem.philox.new_rng_state(device) draws one)")
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError("cu_seqlens_q, cu_seqlens_k: pass both (varlen) or neither")
    if cu_seqlens_q is None:
        for name, t in (("seqused_k", seqused_k), ("block_table", block_table)):
            if t is not None:
                raise ValueError(f"{name}: only with cu_seqlens_q / cu_seqlens_k (varlen)")
        return
    _index_vector("cu_seqlens_q", cu_seqlens_q, (None,), q.device)
    n = cu_seqlens_q.shape[0] - 1
    if n < 0:
        raise ValueError("cu_seqlens_q: expected at least one offset (0)")
    _index_vector("cu_seqlens_k", cu_seqlens_k, (n + 1,), q.device)
    if seqused_k is not None:
        _index_vector("seqused_k", seqused_k, (n,), q.device)
    if block_table is not None:
        _index_vector("block_table", block_table, (n, None), q.device)
    if q.shape[0] != 1 or (block_table is None and (k.shape[0] != 1 or v.shape[0] != 1)):
        raise ValueError(f"q, k, v: varlen takes (1, H, total, D) views of the packed sequences, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if attn_mask is not None:
        raise ValueError("attn_mask: not supported with cu_seqlens (varlen)")
    for name, x in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(x, bool) or (isinstance(x, int) and x < 0):
            raise ValueError(f"{name}: expected an int >= 0, got {x!r}")


def unsupported_reason(q, k, v, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left, window_right,
                       softcap, dropout_p: float = 0.0) -> Optional[str]:
    """None when the selected backend would run the kernels for this call (and,
    when an input requires grad, for its backward); else why the op would take
    the reference path.  Answered from the plan cache; warns about nothing."""
    backend, why = backends.select(q.device)
    if backend is None:
        return why or "the reference backend is selected"
    grad = needs_grad(q, k, v, attn_mask, sinks)
    rng_state = torch.zeros(2, dtype=torch.int64, device=q.device) if dropout_p > 0 else None  # values unread
    args = (q, k, v, attn_mask, alibi_slopes, sinks, float(scale), int(diag_offset), int(window_left),
            int(window_right), float(softcap), grad, float(dropout_p), rng_state, None, None, None, None, 0, 0)
    reason = core.probe(FWD, backend.name, args)
    if reason is not None:
        return reason
    if grad:
        out, lse, aux = _fwd_outputs(*args)
        compute_dbias = attn_mask is not None and attn_mask.requires_grad
        reason = core.probe(BWD, backend.name, (torch.empty_like(out), q, k, v, out, aux, None, *args[3:11],
                                                compute_dbias, float(dropout_p), rng_state, None, None, None, 0,
                                                0))
        if reason is not None:
            return f"backward: {reason}"
    return None


def needs_grad(*tensors: Optional[Tensor]) -> bool:
    """Whether autograd will ask for gradients of a call with these inputs (the
    faces pass it as ``return_aux``)."""
    if not torch.is_grad_enabled():
        return False
    for t in tensors:
        if t is not None and t.requires_grad:
            return True
    return False


# ---------------------------------------------------------------------------
# fwd
# ---------------------------------------------------------------------------

def _fwd_buffers(q: Tensor, v: Tensor, return_aux: bool):
    B, H, Lq, _ = q.shape
    aux_shape = (B, H, Lq, aux_width(q.dtype, v.shape[-1])) if return_aux else (0,)
    return (empty_in_layout(q, v.shape[-1]), q.new_empty((B, H, Lq), dtype=stats_dtype(q.dtype)),
            q.new_empty(aux_shape, dtype=stats_dtype(q.dtype)))


def _fwd_outputs(q, k, v, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left, window_right, softcap,
                 return_aux, dropout_p=0.0, rng_state=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None,
                 block_table=None, max_seqlen_q=0, max_seqlen_k=0):
    check_args(q, k, v, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left, window_right, softcap,
               cu_seqlens_q, block_table)
    check_dropout_varlen(q, k, v, attn_mask, dropout_p, rng_state, cu_seqlens_q, cu_seqlens_k, seqused_k,
                         block_table, max_seqlen_q, max_seqlen_k)
    return _fwd_buffers(q, v, return_aux)


def _fwd_spec(args: tuple) -> AttentionSpec:
    """The spec of fwd's arguments (all but return_aux)."""
    return _spec(*args[:11], *args[12:])


def _fwd_plan(backend, args: tuple, outputs: tuple):
    spec = _fwd_spec(args)
    if spec.varlen is None and (spec.q.numel() == 0 or spec.seqlen_k == 0):
        return None  # nothing for a kernel to do: the reference fills zeros / lse / aux
    out, lse, aux = outputs
    # Launches are checked against the pipelines' limits here, before any is encoded.
    return planner.plan_forward(spec, out, lse, aux if args[11] else None, family=backend.family,
                                pipeline_info=backend.pipeline_info)


def _fwd_reference(*args):
    out, lse, aux = _fwd_outputs(*args)
    spec = _fwd_spec(args)
    _check_index_values(spec)  # the reference path reads them on the host anyway
    ref_out, ref_lse = reference.forward(spec, aux if args[11] else None)
    out.copy_(ref_out)
    lse.copy_(ref_lse)
    return out, lse, aux


def _fwd_debug_check(*args) -> None:
    _check_index_values(_fwd_spec(args))


def _check_index_values(spec: AttentionSpec) -> None:
    """The varlen index vectors' values, on the host (a GPU sync on MPS): on the reference
    path, and before the kernels with TORCH_METAL_FLASH_DEBUG=1."""
    vl = spec.varlen
    if vl is None:
        return
    for name, cu, total, longest in (("cu_seqlens_q", vl.cu_seqlens_q, spec.seqlen_q, vl.max_seqlen_q),
                                     ("cu_seqlens_k", vl.cu_seqlens_k, None if vl.block_table is not None
                                      else spec.seqlen_k, vl.max_seqlen_k)):
        cu = cu.tolist()
        if cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])) or (total is not None and cu[-1] != total):
            want = f"from 0 to {total}" if total is not None else "from 0"
            raise ValueError(f"{name}: expected non-decreasing offsets {want}, got {cu}")
        if any(b - a > longest for a, b in zip(cu, cu[1:])):
            raise ValueError(f"{name}: a sequence is longer than the max_seqlen given ({longest})")
    lens_k = [b - a for a, b in zip(vl.cu_seqlens_k.tolist(), vl.cu_seqlens_k.tolist()[1:])]
    if vl.seqused_k is not None:
        used = vl.seqused_k.tolist()
        if any(not 0 <= u <= n for u, n in zip(used, lens_k)):
            raise ValueError(f"seqused_k: expected values in [0, sequence length], got {used}")
        lens_k = used
    if vl.block_table is not None:
        page, blocks = spec.k.shape[2], vl.block_table.tolist()
        for b, n in enumerate(lens_k):
            pages = blocks[b][:-(-n // page)] if n else []
            if n > len(blocks[b]) * page or any(not 0 <= x < spec.k.shape[0] for x in pages):
                raise ValueError(f"block_table: row {b} must name {-(-n // page)} blocks in [0, "
                                 f"{spec.k.shape[0]}) for its {n} keys, got {blocks[b]}")


@torch.library.custom_op("metal_flash::fwd", mutates_args=())
def fwd(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], alibi_slopes: Optional[Tensor],
        sinks: Optional[Tensor], scale: float, diag_offset: int, window_left: int, window_right: int,
        softcap: float, return_aux: bool, dropout_p: float = 0.0, rng_state: Optional[Tensor] = None,
        cu_seqlens_q: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None,
        seqused_k: Optional[Tensor] = None, block_table: Optional[Tensor] = None, max_seqlen_q: int = 0,
        max_seqlen_k: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Attention forward on (B, H, L, D)-indexed tensors; see :mod:`torch_metal_flash.problem.spec`.
    Returns ``out``, ``lse`` and ``aux`` (the backward's row state when
    ``return_aux``, else empty).  Dropout and varlen: see the module doc."""
    return core.python_body(FWD, (q, k, v, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left,
                                window_right, softcap, return_aux, dropout_p, rng_state, cu_seqlens_q,
                                cu_seqlens_k, seqused_k, block_table, max_seqlen_q, max_seqlen_k))


fwd.register_fake(_fwd_outputs)


# ---------------------------------------------------------------------------
# bwd
# ---------------------------------------------------------------------------

def _bwd_buffers(spec: AttentionSpec, compute_dbias: bool):
    q = spec.q
    B, H, Lq, Lk = spec.batch, spec.heads, spec.seqlen_q, spec.seqlen_k
    return (empty_in_layout(q), empty_in_layout(spec.k), empty_in_layout(spec.v),
            q.new_empty((B, H, Lq, Lk) if compute_dbias else (0,), dtype=stats_dtype(q.dtype)),
            q.new_empty((H,) if spec.sinks is not None else (0,), dtype=stats_dtype(q.dtype)))


def _bwd_spec(args: tuple) -> AttentionSpec:
    """The spec of bwd's arguments (no block_table: bwd takes packed K/V, see :mod:`torch_metal_flash.ops.paged`)."""
    q, k, v = args[1:4]
    return _spec(q, k, v, *args[7:15], *args[16:21], None, *args[21:23])


def _bwd_outputs(dout, q, k, v, out, aux, dlse, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left,
                 window_right, softcap, compute_dbias, dropout_p=0.0, rng_state=None, cu_seqlens_q=None,
                 cu_seqlens_k=None, seqused_k=None, max_seqlen_q=0, max_seqlen_k=0):
    check_args(q, k, v, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left, window_right, softcap,
               cu_seqlens_q)
    want = (*q.shape[:3], aux_width(q.dtype, v.shape[-1]))
    if tuple(aux.shape) != want:
        raise ValueError(f"metal_flash.bwd: aux must be the forward's aux of shape {want} (fwd with "
                         f"return_aux=True), got {tuple(aux.shape)}")
    args = (dout, q, k, v, out, aux, dlse, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left,
            window_right, softcap, compute_dbias, dropout_p, rng_state, cu_seqlens_q, cu_seqlens_k, seqused_k,
            max_seqlen_q, max_seqlen_k)
    return _bwd_buffers(_bwd_spec(args), compute_dbias)


def _bwd_plan(backend, args: tuple, outputs: tuple):
    spec = _bwd_spec(args)
    dout, q, k, v, out, aux, dlse = args[:7]
    if spec.varlen is None and (q.numel() == 0 or spec.seqlen_k == 0):
        return None
    return planner.plan_backward(spec, dout, out, aux, dlse, *outputs, family=backend.family,
                                 pipeline_info=backend.pipeline_info)


def _bwd_reference(*args):
    dout, q, k, v, out, aux, dlse = args[:7]
    compute_dbias = args[15]
    grads = _bwd_outputs(*args)
    spec = _bwd_spec(args)
    _check_index_values(spec)
    for buf, ref in zip(grads, reference.backward(spec, dout, out, aux, dlse, compute_dbias)):
        buf.copy_(ref)
    return grads


@torch.library.custom_op("metal_flash::bwd", mutates_args=())
def bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, aux: Tensor, dlse: Optional[Tensor],
        attn_mask: Optional[Tensor], alibi_slopes: Optional[Tensor], sinks: Optional[Tensor], scale: float,
        diag_offset: int, window_left: int, window_right: int, softcap: float, compute_dbias: bool,
        dropout_p: float = 0.0, rng_state: Optional[Tensor] = None, cu_seqlens_q: Optional[Tensor] = None,
        cu_seqlens_k: Optional[Tensor] = None, seqused_k: Optional[Tensor] = None, max_seqlen_q: int = 0,
        max_seqlen_k: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of :func:`fwd` from its ``out`` and ``aux`` (``return_aux=True``):
    ``dq, dk, dv`` in the inputs' dtypes and layouts, ``dbias`` (B, H, Lq, Lk) when
    ``compute_dbias`` else empty, ``dsinks`` (H,) when ``sinks`` is given else
    empty; both float32 (float64 for float64 inputs).  The dropout and varlen
    arguments must be the forward's (the same ``rng_state`` regenerates its mask);
    varlen dK/dV rows of keys a sequence does not use (seqused_k) are zero."""
    return core.python_body(BWD, (dout, q, k, v, out, aux, dlse, attn_mask, alibi_slopes, sinks, scale, diag_offset,
                                window_left, window_right, softcap, compute_dbias, dropout_p, rng_state,
                                cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k))


bwd.register_fake(_bwd_outputs)


# ---------------------------------------------------------------------------
# autograd
# ---------------------------------------------------------------------------

_FWD_ARGS = ("q", "k", "v", "attn_mask", "alibi_slopes", "sinks", "scale", "diag_offset", "window_left",
             "window_right", "softcap", "return_aux", "dropout_p", "rng_state", "cu_seqlens_q", "cu_seqlens_k",
             "seqused_k", "block_table", "max_seqlen_q", "max_seqlen_k")


def _setup_context(ctx, inputs, output):
    q, k, v, attn_mask, alibi_slopes, sinks = inputs[:6]
    rng_state, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table = inputs[13:18]
    out, lse, aux = output
    ctx.mark_non_differentiable(aux)
    ctx.save_for_backward(q, k, v, out, aux, attn_mask, alibi_slopes, sinks, rng_state, cu_seqlens_q,
                          cu_seqlens_k, seqused_k, block_table)
    ctx.scalars = inputs[6:11]
    ctx.dropout_p, ctx.max_seqlens = inputs[12], inputs[18:20]
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse, _daux):
    q, k, v, out, aux, attn_mask, alibi_slopes, sinks, *extra = ctx.saved_tensors
    rng_state, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table = extra
    needs = dict(zip(_FWD_ARGS, ctx.needs_input_grad))
    if needs["alibi_slopes"]:
        raise NotImplementedError("metal_flash.fwd: gradients for alibi_slopes are not supported")
    max_seqlens = ctx.max_seqlens
    layout = None
    if block_table is not None:
        # Paged K/V: the varlen backward runs on the cache gathered into a padded packed
        # layout; dK/dV are summed back into the blocks (torch_metal_flash.ops.paged).
        layout = paged.padded_layout(block_table, cu_seqlens_k, seqused_k, max_seqlens[1], page=k.shape[2],
                                     num_blocks=k.shape[0])
        caches = (k, v)
        k, v = paged.gather(k, layout), paged.gather(v, layout)
        cu_seqlens_k, seqused_k, max_seqlens = layout.cu_seqlens_k, layout.seqused_k, (max_seqlens[0],
                                                                                        layout.max_seqlen_k)
    if dout is None:
        dout = torch.zeros_like(out)
    elif dout.shape[-1] > 1 and dout.stride(-1) != 1:
        dout = dout.contiguous()  # e.g. the expanded gradient of a sum(): the kernels read rows
    if dlse is not None:
        dlse = dlse.contiguous()
    varlen = (cu_seqlens_q, cu_seqlens_k, seqused_k)
    if aux.dim() == 1:
        # fwd ran with return_aux=False (a direct op call): recompute the row state.
        _, _, aux = torch.ops.metal_flash.fwd(q, k, v, attn_mask, alibi_slopes, sinks, *ctx.scalars, True,
                                              ctx.dropout_p, rng_state, *varlen, None, *max_seqlens)
    compute_dbias = bool(needs["attn_mask"])
    dq, dk, dv, dbias, dsinks = torch.ops.metal_flash.bwd(
        dout, q, k, v, out, aux, dlse, attn_mask, alibi_slopes, sinks, *ctx.scalars, compute_dbias, ctx.dropout_p,
        rng_state, *varlen, *max_seqlens)
    if layout is not None:
        dk, dv = paged.scatter_sums((dk if needs["k"] else None, dv if needs["v"] else None), layout, caches)
    dmask = dbias.sum_to_size(attn_mask.shape).to(attn_mask.dtype) if compute_dbias else None
    dsinks = dsinks.to(sinks.dtype) if needs["sinks"] else None
    return (dq, dk, dv, dmask, None, dsinks) + (None,) * (len(_FWD_ARGS) - 6)


# ---------------------------------------------------------------------------
# fwd_probs (debug): flash-attn's S_dmask of a fwd call
# ---------------------------------------------------------------------------

def _probs_spec(args: tuple) -> AttentionSpec:
    return _spec(*args)


def _probs_outputs(q, k, v, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left, window_right, softcap,
                   dropout_p=0.0, rng_state=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None,
                   block_table=None, max_seqlen_q=0, max_seqlen_k=0):
    args = (q, k, v, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left, window_right, softcap)
    check_args(*args, cu_seqlens_q, block_table)
    spec = _spec(*args, dropout_p, rng_state, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, max_seqlen_q,
                 max_seqlen_k)
    return (q.new_empty(planner.forward.probs_shape(spec)),)


def _probs_plan(backend, args: tuple, outputs: tuple):
    spec = _probs_spec(args)
    if spec.varlen is None and (spec.q.numel() == 0 or spec.seqlen_k == 0):
        return None
    out, lse, _ = _fwd_buffers(spec.q, spec.v, False)  # the forward's results are not returned: scratch
    plan = planner.plan_prefill(spec, out, lse, None, family=backend.family, pipeline_info=backend.pipeline_info,
                                probs=outputs[0])
    return plan if isinstance(plan, Unsupported) else dataclasses.replace(plan, scratch=(out, lse))


def _probs_reference(*args):
    spec = _probs_spec(args)
    _check_index_values(spec)
    return (reference.probs(spec),)


@torch.library.custom_op("metal_flash::fwd_probs", mutates_args=())
def fwd_probs(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], alibi_slopes: Optional[Tensor],
              sinks: Optional[Tensor], scale: float, diag_offset: int, window_left: int, window_right: int,
              softcap: float, dropout_p: float = 0.0, rng_state: Optional[Tensor] = None,
              cu_seqlens_q: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None,
              seqused_k: Optional[Tensor] = None, block_table: Optional[Tensor] = None, max_seqlen_q: int = 0,
              max_seqlen_k: int = 0) -> Tensor:
    """flash-attn's ``S_dmask`` of :func:`fwd` with the same arguments (debug, O(L^2);
    see the module doc).  Not differentiable."""
    return core.python_body(FWD_PROBS, (q, k, v, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left,
                                      window_right, softcap, dropout_p, rng_state, cu_seqlens_q, cu_seqlens_k,
                                      seqused_k, block_table, max_seqlen_q, max_seqlen_k))[0]


fwd_probs.register_fake(lambda *args: _probs_outputs(*args)[0])


# ---------------------------------------------------------------------------
# fwd_kvcache
# ---------------------------------------------------------------------------

def _kvcache_buffers(q: Tensor):
    B, Lq, Hq, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((B, Hq, Lq), dtype=stats_dtype(q.dtype))


def _kvcache_outputs(q, *args):
    return _kvcache_buffers(q)


def _kvcache_plan(backend, args: tuple, outputs: tuple):
    return _kvcache_problem_plan(KvCacheProblem(*args), backend, outputs)


def _kvcache_problem_plan(problem: KvCacheProblem, backend, outputs: tuple):
    return plan_kvcache(problem, *outputs, family=backend.family, pipeline_info=backend.pipeline_info)


def _kvcache_debug_check(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                         cache_leftpad, block_table, alibi_slopes, seqlen, scale, window_left, window_right, softcap,
                         rotary_interleaved, num_splits):
    kvcache_reference.host_indices(kvcache_reference.Geometry.of(q, k_cache, k, block_table, window_left, window_right),
                                   cache_seqlens, seqlen, cache_batch_idx, cache_leftpad, block_table, rotary_cos)


def _kvcache_reference(*args):
    return _kvcache_problem_reference(KvCacheProblem(*args))


def _kvcache_problem_reference(problem: KvCacheProblem):
    out, lse = _kvcache_buffers(problem.q)
    ref_out, ref_lse = kvcache_reference.forward(*problem[:-1])  # all but num_splits
    out.copy_(ref_out)
    lse.copy_(ref_lse)
    return out, lse


@torch.library.custom_op("metal_flash::fwd_kvcache", mutates_args=("k_cache", "v_cache"))
def fwd_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor], v: Optional[Tensor],
                rotary_cos: Optional[Tensor], rotary_sin: Optional[Tensor], cache_seqlens: Optional[Tensor],
                cache_batch_idx: Optional[Tensor], cache_leftpad: Optional[Tensor], block_table: Optional[Tensor],
                alibi_slopes: Optional[Tensor], seqlen: int, scale: float, window_left: int, window_right: int,
                softcap: float, rotary_interleaved: bool, num_splits: int) -> tuple[Tensor, Tensor]:
    """``flash_attn_with_kvcache`` as an op: rotary of q and the new ``k``, ``k``/``v``
    written into ``k_cache``/``v_cache`` **in place** at ``cache_seqlens`` (``seqlen``
    for every row when None), then q (B, Lq, Hq, D) attends to keys
    [cache_leftpad, cache_seqlens + seqlen_new) of its cache row, with the band
    ``window_left/right`` aligned bottom-right per row (causal: window_right = 0;
    q is rotated per row when a window side is >= 0).  Index tensors are int32;
    on the kernel path they are read on the GPU only, and out-of-range values are
    clamped or ignored (shaders/kvcache_index.h); the reference path, and the
    kernel path in debug mode (``TORCH_METAL_FLASH_DEBUG=1``), validate them on the
    host.  Returns ``out`` (B, Lq, Hq, D) and ``lse`` (B, Hq, Lq)."""
    return core.python_body(FWD_KVCACHE, (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                        cache_batch_idx, cache_leftpad, block_table, alibi_slopes, seqlen, scale,
                                        window_left, window_right, softcap, rotary_interleaved, num_splits))


fwd_kvcache.register_fake(_kvcache_outputs)


# ---------------------------------------------------------------------------
# Quantized K/V (inference only): each quantized tensor enters flat, as its data,
# scales and biases, then the format (the schemas know no dtype type).
# ---------------------------------------------------------------------------

def _quantized_args(q, k, v, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left, window_right, softcap,
                    k_scales, k_biases, v_scales, v_biases, kv_bits, kv_group_size, kv_dtype) -> tuple:
    """fwd's arguments, K/V as QuantizedTensors."""
    return (q, from_flat(k, k_scales, k_biases, kv_bits, kv_group_size, kv_dtype),
            from_flat(v, v_scales, v_biases, kv_bits, kv_group_size, kv_dtype), attn_mask, alibi_slopes, sinks,
            scale, diag_offset, window_left, window_right, softcap)


def _quantized_spec(*args) -> AttentionSpec:
    return _spec(*_quantized_args(*args))


def _quantized_outputs(*args):
    plain = _quantized_args(*args)
    check_args(*plain)
    return _fwd_buffers(plain[0], plain[2], False)[:2]


def _quantized_plan(backend, args: tuple, outputs: tuple):
    spec = _quantized_spec(*args)
    if spec.q.numel() == 0 or spec.seqlen_k == 0:
        return None
    return planner.plan_forward(spec, *outputs, family=backend.family, pipeline_info=backend.pipeline_info)


def _quantized_reference(*args):
    out, lse = _quantized_outputs(*args)
    spec = _quantized_spec(*args)
    ref_out, ref_lse = reference.forward(dataclasses.replace(spec, k=spec.k.dequantize(), v=spec.v.dequantize()))
    out.copy_(ref_out)
    lse.copy_(ref_lse)
    return out, lse


def _quantized_no_backward(ctx, *grads):
    raise RuntimeError("metal_flash::fwd_quantized is inference-only: quantized K/V have no gradient (run under "
                       "torch.no_grad(), or attend to dequantize()d tensors to train)")


@torch.library.custom_op("metal_flash::fwd_quantized", mutates_args=())
def fwd_quantized(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], alibi_slopes: Optional[Tensor],
                  sinks: Optional[Tensor], scale: float, diag_offset: int, window_left: int, window_right: int,
                  softcap: float, k_scales: Tensor, k_biases: Optional[Tensor], v_scales: Tensor,
                  v_biases: Optional[Tensor], kv_bits: int, kv_group_size: int,
                  kv_dtype: int) -> tuple[Tensor, Tensor]:
    """:func:`fwd` over quantized K/V: ``k``/``v`` are the packed data of (B, Hkv, Lk, D)
    QuantizedTensors (see the module doc).  The kernels dequantize in registers (every
    query length takes the decode kernels); the reference path dequantizes first."""
    return core.python_body(FWD_QUANTIZED, (q, k, v, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left,
                                          window_right, softcap, k_scales, k_biases, v_scales, v_biases, kv_bits,
                                          kv_group_size, kv_dtype))


fwd_quantized.register_fake(_quantized_outputs)


def _kvcache_quantized_problem(*args) -> KvCacheProblem:
    *plain, k_scales, k_biases, v_scales, v_biases, kv_bits, kv_group_size, kv_dtype = args
    problem = KvCacheProblem(*plain)
    return problem._replace(k_cache=from_flat(problem.k_cache, k_scales, k_biases, kv_bits, kv_group_size, kv_dtype),
                            v_cache=from_flat(problem.v_cache, v_scales, v_biases, kv_bits, kv_group_size, kv_dtype))


@torch.library.custom_op("metal_flash::fwd_kvcache_quantized",
                         mutates_args=("k_cache", "v_cache", "k_cache_scales", "k_cache_biases", "v_cache_scales",
                                       "v_cache_biases"))
def fwd_kvcache_quantized(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor], v: Optional[Tensor],
                          rotary_cos: Optional[Tensor], rotary_sin: Optional[Tensor], cache_seqlens: Optional[Tensor],
                          cache_batch_idx: Optional[Tensor], cache_leftpad: Optional[Tensor],
                          block_table: Optional[Tensor], alibi_slopes: Optional[Tensor], seqlen: int, scale: float,
                          window_left: int, window_right: int, softcap: float, rotary_interleaved: bool,
                          num_splits: int, k_cache_scales: Tensor, k_cache_biases: Optional[Tensor],
                          v_cache_scales: Tensor, v_cache_biases: Optional[Tensor], kv_bits: int, kv_group_size: int,
                          kv_dtype: int) -> tuple[Tensor, Tensor]:
    """:func:`fwd_kvcache` over quantized caches (``k_cache``/``v_cache`` their packed
    data): the new ``k``/``v`` rows (in the caches' dtype) are quantized by the append
    kernel into the caches in place, and the attention reads the stored values."""
    return core.python_body(FWD_KVCACHE_QUANTIZED, (
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
        alibi_slopes, seqlen, scale, window_left, window_right, softcap, rotary_interleaved, num_splits,
        k_cache_scales, k_cache_biases, v_cache_scales, v_cache_biases, kv_bits, kv_group_size, kv_dtype))


fwd_kvcache_quantized.register_fake(_kvcache_outputs)


# ---------------------------------------------------------------------------
# The C++ core runs the ops (and fwd's autograd formula when a call needs a graph).
# ---------------------------------------------------------------------------

FWD = core.register(core.CoreOp("metal_flash::fwd", outputs=_fwd_outputs, plan=_fwd_plan, reference=_fwd_reference,
                                setup_context=_setup_context, backward=_backward, debug_check=_fwd_debug_check))
FWD_PROBS = core.register(core.CoreOp("metal_flash::fwd_probs", outputs=_probs_outputs, plan=_probs_plan,
                                      reference=_probs_reference, debug_check=lambda *args: _check_index_values(
                                          _probs_spec(args))))
BWD = core.register(core.CoreOp("metal_flash::bwd", outputs=_bwd_outputs, plan=_bwd_plan, reference=_bwd_reference))
FWD_KVCACHE = core.register(core.CoreOp("metal_flash::fwd_kvcache", outputs=_kvcache_outputs, plan=_kvcache_plan,
                                        reference=_kvcache_reference, debug_check=_kvcache_debug_check))
FWD_QUANTIZED = core.register(core.CoreOp(
    "metal_flash::fwd_quantized", outputs=_quantized_outputs, plan=_quantized_plan, reference=_quantized_reference,
    setup_context=lambda ctx, inputs, output: None, backward=_quantized_no_backward))
FWD_KVCACHE_QUANTIZED = core.register(core.CoreOp(
    "metal_flash::fwd_kvcache_quantized", outputs=_kvcache_outputs,
    plan=lambda backend, args, outputs: _kvcache_problem_plan(_kvcache_quantized_problem(*args), backend, outputs),
    reference=lambda *args: _kvcache_problem_reference(_kvcache_quantized_problem(*args)),
    debug_check=lambda *args: _kvcache_debug_check(*args[:19])))
