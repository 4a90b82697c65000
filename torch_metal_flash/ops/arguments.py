"""The ops' arguments: clear errors, naming the argument, for what a direct call of an op
cannot mean (the faces check their own arguments first), and the problem they describe."""
from __future__ import annotations

import collections
import inspect

import torch

import torch_metal_flash.problem.checks as checks
from ..problem.spec import AttentionSpec, make_spec


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


def problem_spec(q, k, v, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left, window_right,
                 softcap, dropout_p=0.0, rng_state=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None,
                 block_table=None, max_seqlen_q=0, max_seqlen_k=0) -> AttentionSpec:
    check_dropout_varlen(q, k, v, attn_mask, dropout_p, rng_state, cu_seqlens_q, cu_seqlens_k, seqused_k,
                         block_table, max_seqlen_q, max_seqlen_k)
    return make_spec(q, k, v, attn_mask, alibi_slopes, sinks, scale=scale, diag_offset=diag_offset,
                     window_left=window_left, window_right=window_right, softcap=softcap, dropout_p=dropout_p,
                     rng_state=rng_state, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                     seqused_k=seqused_k, block_table=block_table, max_seqlen_q=max_seqlen_q,
                     max_seqlen_k=max_seqlen_k)


_SPEC_ARGS = tuple(inspect.signature(problem_spec).parameters)


def spec_of(args) -> AttentionSpec:
    """The problem an op's named arguments describe (those of ``problem_spec`` it has; the rest at their defaults)."""
    return problem_spec(**{name: getattr(args, name) for name in _SPEC_ARGS if hasattr(args, name)})


def schema_args(qualname: str) -> type:
    """A named tuple of the op's arguments in schema order: the op's signature is their one definition,
    so the planners, references and autograd read them by name instead of slicing 20 positions."""
    namespace, name = qualname.split("::")
    schema = getattr(getattr(torch.ops, namespace), name).default._schema
    return collections.namedtuple(f"{name}_args", [a.name for a in schema.arguments])


class OpCall:
    """An op called with its arguments by name -- ``fwd_call(q=q, k=k, v=v, scale=s, ...)``: the
    schema is the one definition of the names and defaults; arguments left out take the schema's
    default, a name it does not have or a required one missing is a TypeError.  The op itself is
    called positionally, up to the last argument given, as the dispatcher parses keywords slower."""

    def __init__(self, qualname: str):
        namespace, name = qualname.split("::")
        self.qualname = qualname
        self.overload = getattr(getattr(torch.ops, namespace), name).default
        arguments = self.overload._schema.arguments
        self.names = tuple(a.name for a in arguments)
        self._defaults = {a.name: a.default_value for a in arguments if a.has_default_value()}
        # per call shape (the names given, in call order; one per call site): (given, name or default) per position
        self._orders: dict = {}

    def __call__(self, **kwargs):
        order = self._orders.get(tuple(kwargs))
        if order is None:
            order = self._orders.setdefault(tuple(kwargs), self._order(kwargs))
        return self.overload(*(kwargs[x] if given else x for given, x in order))

    def _order(self, kwargs: dict) -> tuple:
        unknown = [n for n in kwargs if n not in self.names]
        if unknown:
            raise TypeError(f"{self.qualname}: no argument {', '.join(map(repr, unknown))}; its arguments: "
                            f"{', '.join(self.names)}")
        missing = [n for n in self.names if n not in kwargs and n not in self._defaults]
        if missing:
            raise TypeError(f"{self.qualname}: missing {', '.join(map(repr, missing))}")
        last = max((self.names.index(n) for n in kwargs), default=-1)
        return tuple((True, n) if n in kwargs else (False, self._defaults[n]) for n in self.names[:last + 1])

    def prefix(self, *names: str):
        """The op overload itself, for a hot path that passes exactly ``names`` positionally:
        checked once, here, to be the schema's first arguments with every required one among them."""
        if names != self.names[:len(names)]:
            raise TypeError(f"{self.qualname}: {names} are not its first arguments ({', '.join(self.names)})")
        missing = [n for n in self.names[len(names):] if n not in self._defaults]
        if missing:
            raise TypeError(f"{self.qualname}: a call passing {len(names)} arguments misses {', '.join(missing)}")
        return self.overload


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


def check_index_values(spec: AttentionSpec) -> None:
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
