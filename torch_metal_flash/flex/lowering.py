"""FlexAttention's ``score_mod`` / ``mask_mod`` lowered to Metal functions: the generated header.

The mods come as torch's flex_attention higher-order op passes them: callables
over 0-d tensors, ``(score, b, h, q_idx, kv_idx, *captured)`` and ``(b, h,
q_idx, kv_idx, *captured)``, the tensors they capture (closures, globals,
parameters) lifted into trailing arguments by Dynamo.  They are traced to aten
graphs as torch traces them (``make_fx`` over fake 0-d tensors -- a float32
score, int32 indices -- with tensor indexing as ``aten.index``), and each aten
node becomes one typed C statement: ``bool``, ``int``/``long`` (and the narrower
integers of captured tensors), ``float`` for every floating value (Metal has
no double: float64 computes as float).  The header depends on the graphs and on
the captured tensors' dtypes and dims, not on their values, sizes or strides
(the kernels read those from a buffer: an expanded mask is read in place).

Gradients.  ``score_grad`` is the derivative of the score_mod with respect to
the score.  For each *read* of a captured floating tensor that requires grad
(``bias[h, q - kv]``, ``slope[h]``, a 0-d temperature used as a value), the
derivative of the score_mod with respect to the value read is traced too, and
the read is classed by what its index depends on: nothing but ``b``, ``h`` and
``q`` -- the kernels sum its gradient along each query row; ``kv`` -- along each
key column; ``q`` and ``kv`` only through ``q - kv`` -- along each diagonal.  A
line's sum lands at the line's one index, and the sums of all lines are added
per index in a fixed order: deterministic, no atomics.  Any other index (one
that depends on ``q`` and ``kv`` otherwise, or on the score) cannot be reduced
that way: :class:`CapturedGradientError` names the tensor.

Conventions where a GPU cannot do what torch does: a captured read wraps a
negative index once (as torch indexing) and reads 0 for an index still out of
range (its gradient goes nowhere); integer division or remainder by zero gives
0; a ``-inf`` literal is ``-FLT_MAX`` (the kernels hide an element whose score
is <= -FLT_MAX, torch's meaning of ``-inf``), NaN literals are refused.
Data-dependent Python control flow and ops outside the table raise
:class:`~torch_metal_flash.UnsupportedError` naming them.
"""
from __future__ import annotations

import dataclasses
import json
import math
import threading
from typing import Callable, Optional

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from ..backends import UnsupportedError
from ..caches import LRU
from ..planner.flex import FIRST_CAPTURED_BUFFER, HEADER_TAG, MAX_CAPTURED

aten = torch.ops.aten

WALKS = ("row", "col", "diag")

# captured tensor dtype -> (Metal element type, host dtype it is bound as)
ELEMENT = {
    torch.bool: ("uchar", torch.uint8), torch.uint8: ("uchar", torch.uint8), torch.int8: ("char", torch.int8),
    torch.int16: ("short", torch.int16), torch.int32: ("int", torch.int32), torch.int64: ("long", torch.int64),
    torch.float16: ("half", torch.float16), torch.bfloat16: ("bfloat", torch.bfloat16),
    torch.float32: ("float", torch.float32), torch.float64: ("float", torch.float32),
}
_VALUE = {torch.bool: "bool", torch.uint8: "uchar", torch.int8: "char", torch.int16: "short", torch.int32: "int",
          torch.int64: "long"}


@torch.library.custom_op("metal_flash::stop_gradient", mutates_args=())
def stop_gradient(x: torch.Tensor) -> torch.Tensor:
    """``x``: what a mod's ``.detach()`` is traced as, a node the derivative pass runs as a
    real ``detach`` (:func:`_call_with`).  make_fx records ``detach`` as ``aten.detach`` in
    some torch releases and as the differentiable ``aten.alias`` in others (2.15), which would
    read a detached value as a trainable one; this node keeps the barrier in every release."""
    return x.clone()


stop_gradient.register_fake(lambda x: torch.empty_like(x))


_STOP_GRADIENT = torch.ops.metal_flash.stop_gradient.default


class _DetachStopsGradient(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.detach, torch.detach):
            return stop_gradient(args[0])
        return func(*args, **(kwargs or {}))


class CapturedGradientError(ValueError):
    """A captured tensor needs a gradient the kernels cannot reduce deterministically (raised, not a
    fallback: the dense path would scatter it with atomics on the GPU)."""


@dataclasses.dataclass(frozen=True)
class Buffer:
    """What the lowering knows of a captured tensor."""

    dtype: Optional[torch.dtype]  # None: an int (Dynamo lifts the sizes of captured tensors it made dynamic)
    shape: tuple
    requires_grad: bool
    name: str  # for messages
    value: Optional[int] = None  # an int's

    @staticmethod
    def of(t, name: str) -> "Buffer":
        hint = lambda s: s.node.hint if isinstance(s, torch.SymInt) else int(s)  # noqa: E731
        if not isinstance(t, torch.Tensor):
            return Buffer(None, (), False, name, hint(t))
        return Buffer(t.dtype, tuple(hint(s) for s in t.shape), bool(t.requires_grad and t.dtype.is_floating_point),
                      name)


@dataclasses.dataclass(frozen=True)
class Read:
    """A read of a trainable captured tensor by the score_mod: which tensor (its position among
    the captured tensors the kernels bind), and the line the kernels sum its gradient along
    ("row", "col" or "diag")."""

    buffer: int
    walk: str


@dataclasses.dataclass(frozen=True)
class LoweredMods:
    header: str   # its first line describes it (planner/flex.py's describe)
    reads: tuple  # Read, in the order of the header's gradient slots (per walk)


def _value_type(dtype: torch.dtype) -> str:
    if dtype.is_floating_point:
        return "float"
    if dtype not in _VALUE:
        raise UnsupportedError(f"values of dtype {dtype} cannot be lowered to Metal")
    return _VALUE[dtype]


# ---------------------------------------------------------------------------
# tracing
# ---------------------------------------------------------------------------
def _trace(fn: Callable, example: list, what: str) -> torch.fx.GraphModule:
    """``fn``'s aten graph over fake tensors shaped like ``example`` (dtype, shape), outside any
    tracing the caller is in (torch.compile traces the op that calls this)."""
    from torch._dispatch.python import suspend_functionalization
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
    from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
    from torch._subclasses.functional_tensor import disable_functional_mode
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    with suspend_functionalization(), disable_functional_mode(), disable_proxy_modes_tracing(), \
            unset_fake_temporarily():
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            args = [torch.empty(shape, dtype=dtype) if dtype is not None else shape for dtype, shape in example]
        try:
            with torch.no_grad(), TransformGetItemToIndex(), _DetachStopsGradient():
                return make_fx(fn, tracing_mode="real")(*args)
        except UnsupportedError:
            raise
        except Exception as e:  # noqa: BLE001 -- any failure of user code to trace is a reason to fall back
            text = str(e)
            if "data-dependent" in text or "data dependent" in text or "_local_scalar_dense" in text:
                raise UnsupportedError(f"{what} uses data-dependent Python control flow (if/while/bool() on a "
                                       "tensor value); write it with torch.where") from e
            raise UnsupportedError(f"{what} could not be traced ({type(e).__name__}: "
                                   f"{text.splitlines()[0][:200] if text else ''})") from e


def _index_example(score: bool) -> list:
    idx = [(torch.int32, ())] * 4
    return ([(torch.float32, ())] + idx) if score else idx


def _example(buffers) -> list:
    return [(b.dtype, b.shape if b.dtype is not None else b.value) for b in buffers]


def _call_with(gm: Callable, n_args: int, reads: dict) -> Callable:
    """``gm`` called with its ``n_args`` inputs, the values of the nodes in ``reads`` (node ->
    position) taken from the arguments after them."""
    class Substitute(torch.fx.Interpreter):
        def __init__(self, extra):
            super().__init__(gm)
            self.extra = extra

        def run_node(self, n):
            if n in reads:
                if n.op == "placeholder":
                    next(self.args_iter)
                return self.extra[reads[n]]
            if n.target is _STOP_GRADIENT:
                with torch._C.DisableTorchFunction():  # the real detach, not the tracing mode's stand-in
                    return self.env[n.args[0]].detach()
            return super().run_node(n)

    def call(*args):
        return Substitute(args[n_args:]).run(*args[:n_args])
    return call


# ---------------------------------------------------------------------------
# what a value depends on (for the reads' lines)
# ---------------------------------------------------------------------------
# A value's dependence on q_idx and kv_idx: None (neither), ("lin", a, c) for a * q + c * kv +
# (something independent of both) built with + - and integer literal factors, or the frozenset of
# "q", "kv", "d" (q - kv) and "s" (the score) it is a function of.
_LINEAR = (aten.add, aten.sub, aten.neg, aten.mul, aten.clone, aten._to_copy)


def _support(dep) -> frozenset:
    if dep is None or isinstance(dep, frozenset):
        return dep or frozenset()
    _, a, c = dep
    if a == 0 and c == 0:
        return frozenset()
    if c == 0:
        return frozenset({"q"})
    if a == 0:
        return frozenset({"kv"})
    return frozenset({"d"}) if a == -c else frozenset({"q", "kv"})


def _combine(supports) -> frozenset:
    out = frozenset().union(*supports)
    return out if len(out) <= 1 or "s" in out else frozenset({"q", "kv"}) | (out & {"s"})


def _linear(n: torch.fx.Node, deps: dict):
    """("lin", a, c) of an integer +, -, negation, literal multiple or copy of linear values, else None."""
    val = n.meta.get("val")
    if getattr(n.target, "overloadpacket", None) not in _LINEAR or not isinstance(val, torch.Tensor) \
            or val.dtype.is_floating_point:
        return None
    coef = []
    for x in n.args[:2]:
        d = deps.get(x) if isinstance(x, torch.fx.Node) else None
        if isinstance(d, frozenset):
            return None
        coef.append((0, 0) if d is None else d[1:])
    packet = n.target.overloadpacket
    if packet in (aten.add, aten.sub):
        sign = (-1 if packet is aten.sub else 1) * n.kwargs.get("alpha", 1)
        (a, c), (a2, c2) = coef
        return ("lin", a + sign * a2, c + sign * c2)
    if packet is aten.mul:  # by an integer literal (the literal's own coefficients are 0)
        k = [x for x in n.args[:2] if isinstance(x, int) and not isinstance(x, bool)]
        return ("lin", k[0] * sum(a for a, _ in coef), k[0] * sum(c for _, c in coef)) if k else None
    sign = -1 if packet is aten.neg else 1
    return ("lin", sign * coef[0][0], sign * coef[0][1])


def _dependences(gm: torch.fx.GraphModule, params: list) -> dict:
    deps = {}
    names = dict(zip([n for n in gm.graph.nodes if n.op == "placeholder"], params))
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            deps[n] = {"q": ("lin", 1, 0), "kv": ("lin", 0, 1), "s": frozenset({"s"})}.get(names.get(n))
        elif n.op == "call_function":
            deps[n] = _linear(n, deps) or _combine(
                [_support(deps.get(a)) for a in _flat_args(n) if isinstance(a, torch.fx.Node)]) or None
    return deps


def _flat_args(n: torch.fx.Node) -> list:
    out = []
    for a in list(n.args) + list(n.kwargs.values()):
        if isinstance(a, (list, tuple)):
            out.extend(a)
        else:
            out.append(a)
    return out


def _walk(support: frozenset) -> Optional[str]:
    if not support or support == {"q"}:
        return "row"
    if support == {"kv"}:
        return "col"
    if support == {"d"}:
        return "diag"
    return None


# ---------------------------------------------------------------------------
# emission
# ---------------------------------------------------------------------------
def _literal(value, ctype: str) -> str:
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, int):
        text = f"{value}L" if ctype == "long" else str(value)
    elif isinstance(value, float):
        if math.isnan(value):
            raise UnsupportedError("a NaN literal in a mod cannot be lowered (no NaN under fast math)")
        if math.isinf(value):
            text = "FLT_MAX" if value > 0 else "-FLT_MAX"
        else:
            text = repr(value)
            text = text + ("" if any(c in text for c in ".e") else ".0") + "f"
    else:
        raise UnsupportedError(f"a literal of type {type(value).__name__} in a mod cannot be lowered")
    return f"{ctype}({text})"


@dataclasses.dataclass
class _Read:
    """A captured read as emitted: the buffer, its flat index variable and validity condition."""
    buffer: int
    flat: str
    ok: str


class _Emitter:
    """Emits one graph's nodes as statements; names of values by node."""

    def __init__(self, what: str, buffers: list, prefix: str):
        self.what, self.buffers, self.prefix = what, buffers, prefix
        self.lines: list[str] = []
        self.names: dict = {}
        self.types: dict = {}
        self.captured: dict = {}  # placeholder node -> buffer number
        self.partial: dict = {}   # node -> (buffer, indices so far): a read not yet down to one element
        self.reads: dict = {}     # node -> _Read

    def bind(self, node, name: str, ctype: str) -> None:
        self.names[node], self.types[node] = name, ctype

    def operand(self, a, ctype: str) -> str:
        if isinstance(a, torch.fx.Node):
            if a not in self.names:
                if a in self.captured or a in self.partial:
                    raise UnsupportedError(f"{self.what} uses a captured tensor that is not 0-d as a value "
                                           "(index it down to one element)")
                raise UnsupportedError(f"{self.what} uses {a.target}, whose value cannot be lowered")
            name = self.names[a]
            return name if self.types[a] == ctype else f"{ctype}({name})"
        return _literal(a, ctype)

    def common(self, *args) -> str:
        """The type two operands are compared in."""
        floating = any((isinstance(a, torch.fx.Node) and self.types.get(a) == "float") or isinstance(a, float)
                       for a in args)
        return "float" if floating else "long"

    def index(self, node, source, indices) -> Optional[str]:
        """aten.index of a captured tensor (or of a partial read): the element when every dim is
        indexed, else None (node becomes a partial read)."""
        k, before = (self.captured[source], []) if source in self.captured else self.partial[source]
        indices = before + list(indices)
        buf, slot = self.buffers[k], self.slot(k)
        if any(i is None for i in indices) or len(indices) > len(buf.shape):
            raise UnsupportedError(f"{self.what} indexes captured tensor {k} ({len(buf.shape)} dims) with "
                                   f"{len(indices)} indices (index every dim with a scalar)")
        if len(indices) < len(buf.shape):
            self.partial[node] = (k, indices)
            return None
        parts, ok = [], []
        n = len(self.lines)
        dims = self._dims_offset(k)
        for d, i in enumerate(indices):
            size, stride = f"long(c.dims[{dims + d}])", f"long(c.dims[{dims + len(indices) + d}])"
            var = f"{self.prefix}i{n}_{d}"
            self.lines.append(f"long {var} = {self.operand(i, 'long')}; {var} += {var} < 0 ? {size} : 0;")
            ok.append(f"{var} >= 0 && {var} < {size}")
            parts.append((var, size, stride))
        flat = parts[0][0] if parts else "0L"  # the element's index in the tensor (row-major: its gradient's)
        for var, size, _ in parts[1:]:
            flat = f"({flat}) * {size} + {var}"
        offset = " + ".join(f"{var} * {stride}" for var, _, stride in parts) or "0L"  # in the tensor as bound
        flat_var, ok_var, at = f"{self.prefix}f{n}", f"{self.prefix}ok{n}", f"{self.prefix}at{n}"
        self.lines.append(f"const long {flat_var} = {flat}; const long {at} = {offset}; "
                          f"const bool {ok_var} = {' && '.join(ok) or 'true'};")
        self.reads[node] = _Read(k, flat_var, ok_var)
        elem = f"c.t{slot}[{at}]"
        vt = _value_type(buf.dtype)
        return f"{ok_var} ? {vt}({elem}{' != 0' if vt == 'bool' else ''}) : {vt}(0)"

    def slot(self, k: int) -> int:
        """The kernels' slot of captured tensor k (the ints among the captured values take none)."""
        return sum(b.dtype is not None for b in self.buffers[:k])

    def _dims_offset(self, k: int) -> int:
        """Where tensor k's sizes, then strides, start in the kernels' dims buffer."""
        return sum(2 * len(b.shape) for b in self.buffers[:k] if b.dtype is not None)

    def emit(self, node: torch.fx.Node) -> None:
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise UnsupportedError(f"{self.what} uses {node.target}, which gives no tensor")
        op, inplace = _out_of_place(node.target)
        expr = _lower_op(self, op, node.args, dict(node.kwargs), node)
        if expr is None:  # a partial read
            return
        if val.dim() != 0:
            raise UnsupportedError(f"{self.what} computes a non-scalar value with {op} (a mod maps scalars to "
                                   "a scalar)")
        ctype = _value_type(val.dtype)
        name = f"{self.prefix}{len(self.names)}"
        self.lines.append(f"const {ctype} {name} = {ctype}({expr});")
        self.bind(node, name, ctype)
        if inplace:  # (autograd's formulas mutate) later reads of the operand see the new value
            self.bind(node.args[0], name, ctype)


def _out_of_place(op):
    """(the out-of-place overload of op, whether op is in-place)."""
    packet = op.overloadpacket.__name__
    if not packet.endswith("_") or packet.startswith("_"):
        return op, False
    functional = getattr(getattr(aten, packet[:-1]), op._overloadname)
    return functional, True


def _float(e: _Emitter, a) -> str:
    return e.operand(a, "float")


_UNARY_FLOAT = {
    aten.exp.default: "metal::exp({})", aten.exp2.default: "metal::exp2({})", aten.log.default: "metal::log({})",
    aten.log2.default: "metal::log2({})", aten.log1p.default: "metal::log(1.0f + {})",
    aten.expm1.default: "(metal::exp({}) - 1.0f)", aten.sqrt.default: "metal::sqrt({})",
    aten.rsqrt.default: "metal::rsqrt({})", aten.tanh.default: "flash::tanh_stable({})",
    aten.sigmoid.default: "(1.0f / (1.0f + metal::exp(-{})))", aten.sin.default: "metal::sin({})",
    aten.cos.default: "metal::cos({})", aten.reciprocal.default: "(1.0f / {})",
}
_ROUNDING = {aten.floor.default: "metal::floor({})", aten.ceil.default: "metal::ceil({})",
             aten.round.default: "metal::rint({})", aten.trunc.default: "metal::trunc({})"}
_ARITH = {aten.add: "+", aten.sub: "-", aten.mul: "*"}
_COMPARE = {aten.eq: "==", aten.ne: "!=", aten.lt: "<", aten.le: "<=", aten.gt: ">", aten.ge: ">="}
_BITWISE = {aten.bitwise_and: "&", aten.bitwise_or: "|", aten.bitwise_xor: "^"}
_LOGICAL = {aten.logical_and.default: "&&", aten.logical_or.default: "||", aten.logical_xor.default: "!="}
_PASS = {aten.lift_fresh_copy.default, aten.clone.default, aten.alias.default, aten.detach.default,
         _STOP_GRADIENT}


def _out_type(node) -> str:
    return _value_type(node.meta["val"].dtype)


def _divide(e: _Emitter, a, b, mode: Optional[str], ctype: str) -> str:
    if ctype == "float":
        q = f"({_float(e, a)} / {_float(e, b)})"
        return {None: q, "floor": f"metal::floor{q}", "trunc": f"metal::trunc{q}"}[mode]
    x, y = e.operand(a, ctype), e.operand(b, ctype)
    if mode == "floor":
        return f"flex::floordiv({x}, {y})"
    return f"(({y}) == 0 ? {ctype}(0) : {ctype}(({x}) / ({y})))"


def _lower_op(e: _Emitter, op, args, kwargs, node) -> Optional[str]:
    packet = getattr(op, "overloadpacket", None)
    if op is aten.index.Tensor and isinstance(args[0], torch.fx.Node) and (args[0] in e.captured or
                                                                          args[0] in e.partial):
        return e.index(node, args[0], args[1])
    if op in (aten.select.int,) and isinstance(args[0], torch.fx.Node) and (args[0] in e.captured or
                                                                          args[0] in e.partial):
        if args[1] != 0:
            raise UnsupportedError(f"{e.what} selects a captured tensor along dim {args[1]}: index it in order")
        return e.index(node, args[0], [args[2]])
    ctype = _out_type(node)
    if op in _PASS:
        return e.operand(args[0], ctype)
    if op in _UNARY_FLOAT:
        return _UNARY_FLOAT[op].format(_float(e, args[0]))
    if op in _ROUNDING:
        return _ROUNDING[op].format(_float(e, args[0])) if ctype == "float" else e.operand(args[0], ctype)
    if packet in _ARITH:
        a, b = args[0], args[1]
        alpha = kwargs.get("alpha", 1)
        rhs = e.operand(b, ctype) if alpha == 1 else f"{_literal(alpha, ctype)} * {e.operand(b, ctype)}"
        return f"{e.operand(a, ctype)} {_ARITH[packet]} {rhs}"
    if packet is aten.rsub:
        return f"{e.operand(args[1], ctype)} - {e.operand(args[0], ctype)}"
    if packet is aten.div:
        mode = kwargs.get("rounding_mode", args[2] if len(args) > 2 else None)
        return _divide(e, args[0], args[1], mode, ctype)
    if packet is aten.floor_divide:
        return _divide(e, args[0], args[1], "floor", ctype)
    if packet is aten.remainder:
        if ctype == "float":
            x, y = _float(e, args[0]), _float(e, args[1])
            return f"({x} - metal::floor({x} / {y}) * {y})"
        return f"flex::mod({e.operand(args[0], ctype)}, {e.operand(args[1], ctype)})"
    if packet in _COMPARE:
        t = e.common(args[0], args[1])
        return f"{e.operand(args[0], t)} {_COMPARE[packet]} {e.operand(args[1], t)}"
    if op in _LOGICAL:
        return f"{e.operand(args[0], 'bool')} {_LOGICAL[op]} {e.operand(args[1], 'bool')}"
    if op is aten.logical_not.default:
        return f"!{e.operand(args[0], 'bool')}"
    if packet in _BITWISE:
        return f"{e.operand(args[0], ctype)} {_BITWISE[packet]} {e.operand(args[1], ctype)}"
    if op is aten.bitwise_not.default:
        return f"!{e.operand(args[0], 'bool')}" if ctype == "bool" else f"~{e.operand(args[0], ctype)}"
    if op is aten.neg.default:
        return f"-{e.operand(args[0], ctype)}"
    if op is aten.abs.default:
        return f"metal::abs({e.operand(args[0], ctype)})"
    if op in (aten.sign.default, aten.sgn.default):
        x = e.operand(args[0], ctype)
        return f"({x} > {ctype}(0)) - ({x} < {ctype}(0))"
    if packet in (aten.minimum, aten.maximum):
        fn = "metal::min" if packet is aten.minimum else "metal::max"
        return f"{fn}({e.operand(args[0], ctype)}, {e.operand(args[1], ctype)})"
    if packet in (aten.clamp, aten.clamp_min, aten.clamp_max):
        lo = args[1] if len(args) > 1 and packet is not aten.clamp_max else kwargs.get("min")
        hi = (args[1] if packet is aten.clamp_max else (args[2] if len(args) > 2 else kwargs.get("max")))
        x = e.operand(args[0], ctype)
        if lo is not None:
            x = f"metal::max({x}, {e.operand(lo, ctype)})"
        if hi is not None:
            x = f"metal::min({x}, {e.operand(hi, ctype)})"
        return x
    if packet is aten.pow:
        base, ex = args[0], args[1]
        if isinstance(ex, (int, float)) and float(ex).is_integer() and 0 <= ex <= 4:
            return " * ".join([e.operand(base, ctype)] * int(ex)) or _literal(1, ctype)
        if ctype != "float":
            raise UnsupportedError(f"{e.what} raises an integer to a power other than 0..4")
        return f"metal::pow({_float(e, base)}, {_float(e, ex)})"
    if packet is aten.where:
        return f"{e.operand(args[0], 'bool')} ? {e.operand(args[1], ctype)} : {e.operand(args[2], ctype)}"
    if packet is aten.masked_fill:
        return f"{e.operand(args[1], 'bool')} ? {e.operand(args[2], ctype)} : {e.operand(args[0], ctype)}"
    if op in (aten._to_copy.default, aten.to.dtype):
        src = args[0]
        if ctype == "bool":
            return f"{e.operand(src, e.types.get(src, 'float') if isinstance(src, torch.fx.Node) else 'float')} != 0"
        return e.operand(src, ctype)
    if op is aten.scalar_tensor.default:
        return _literal(args[0], ctype)
    fills = {aten.full_like: None, aten.zeros_like: 0, aten.ones_like: 1, aten.new_full: None, aten.new_zeros: 0,
             aten.new_ones: 1, aten.full: None, aten.zeros: 0, aten.ones: 1}
    if packet in fills:  # a 0-d constant (the emitter checks the shape)
        fill = fills[packet]
        if fill is None:
            fill = args[2] if packet is aten.new_full else args[1]
        return _literal(fill, ctype)
    if op is aten.tanh_backward.default:
        g, y = _float(e, args[0]), _float(e, args[1])
        return f"{g} * (1.0f - {y} * {y})"
    if op is aten.sigmoid_backward.default:
        g, y = _float(e, args[0]), _float(e, args[1])
        return f"{g} * {y} * (1.0f - {y})"
    if op is aten.threshold_backward.default:
        return f"{_float(e, args[1])} <= {_float(e, args[2])} ? 0.0f : {_float(e, args[0])}"
    raise UnsupportedError(f"{e.what} uses {op}, which torch_metal_flash cannot lower to Metal")


def _emit(e: _Emitter, gm: torch.fx.GraphModule, params: list, first_buffer: int = 0,
          bound: Optional[dict] = None) -> list:
    """Emit ``gm``'s nodes into ``e``: its first placeholders are ``params`` (names), the next
    ones captured tensors ``first_buffer``, ``first_buffer + 1``, ...; ``bound`` maps further
    placeholders (by position after those) to names of values already emitted.  Returns
    the graph's outputs (nodes or literals)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    n_buffers = len(e.buffers) if bound is None else len(placeholders) - len(params) - len(bound)
    for i, n in enumerate(placeholders):
        if i < len(params):
            e.bind(n, params[i], _value_type(n.meta["val"].dtype))
        elif i < len(params) + n_buffers:
            k = first_buffer + i - len(params)
            buf = e.buffers[k]
            if buf.dtype is None:  # an int: the trace took its value
                continue
            e.captured[n] = k
            if len(buf.shape) == 0:  # a 0-d captured tensor used as a value: its one element
                e.bind(n, f"{_value_type(buf.dtype)}(c.t{e.slot(k)}[0])", _value_type(buf.dtype))
                e.reads[n] = _Read(k, "0L", "true")
        else:
            name, ctype = bound[i - len(params) - n_buffers]
            e.bind(n, name, ctype)
    outputs = None
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            t = getattr(gm, n.target)
            if not isinstance(t, torch.Tensor) or t.dim() != 0:
                raise UnsupportedError(f"{e.what} creates a tensor constant of shape {tuple(t.shape)} (capture it "
                                       "instead: the kernels read captured tensors)")
            value = t.item()
            ctype = _value_type(t.dtype)
            e.bind(n, _literal(value, ctype), ctype)
        elif n.op == "call_function":
            if n.target is aten._assert_tensor_metadata.default:
                continue
            e.emit(n)
        elif n.op == "output":
            out = n.args[0]
            outputs = list(out) if isinstance(out, (tuple, list)) else [out]
    return outputs


def _result(e: _Emitter, out, result_type: str) -> str:
    if not isinstance(out, torch.fx.Node):
        return _literal(out, result_type)
    if result_type == "bool" and e.types.get(out) != "bool":
        return f"{e.operand(out, e.types.get(out, 'float'))} != 0"
    return e.operand(out, result_type)


_PRELUDE = """namespace flex {
// Python's floor division and remainder on integers; 0 for a zero divisor.
template <typename T> inline T floordiv(T a, T b) {
  if (b == 0) return 0;
  const T q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}
template <typename T> inline T mod(T a, T b) {
  if (b == 0) return 0;
  const T r = a % b;
  return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}
"""

_SCORE_PARAMS = ["s", "b", "h", "q", "kv"]
_UNUSED = "(void)s; (void)b; (void)h; (void)q; (void)kv; (void)c;"


def _function(signature: str, lines: list) -> str:
    body = "\n".join("  " + line for line in lines)
    return f"__attribute__((always_inline)) inline {signature} {{\n{body}\n}}"


class _Lowering:
    """One lowering: the traced graphs, the emitted functions, the reads."""

    def __init__(self, score_mod, mask_mod, score_buffers: tuple, mask_buffers: tuple):
        self.buffers = list(score_buffers) + list(mask_buffers)
        self.n_score = len(score_buffers)
        self.tensors = [b for b in self.buffers if b.dtype is not None]
        if len(self.tensors) > MAX_CAPTURED:
            raise UnsupportedError(f"the mods capture {len(self.tensors)} tensors; the kernels bind at most "
                                   f"{MAX_CAPTURED}")
        for b in self.tensors:
            if b.dtype not in ELEMENT:
                raise UnsupportedError(f"a mod captures {b.name} of dtype {b.dtype}, which the kernels cannot read")
        self.score = _trace(score_mod, _index_example(True) + _example(score_buffers), "score_mod") \
            if score_mod is not None else None
        self.mask = _trace(mask_mod, _index_example(False) + _example(mask_buffers), "mask_mod") \
            if mask_mod is not None else None

    def score_function(self) -> str:
        if self.score is None:
            return _function("float score_mod(float s, int b, int h, int q, int kv, thread const Captured& c)",
                             [_UNUSED, "return s;"])
        e = _Emitter("score_mod", self.buffers, "sm")
        out = _emit(e, self.score, _SCORE_PARAMS)
        return _function("float score_mod(float s, int b, int h, int q, int kv, thread const Captured& c)",
                         [_UNUSED] + e.lines + [f"return {_result(e, out[0], 'float')};"])

    def mask_function(self) -> str:
        signature = "bool mask_mod(int b, int h, int q, int kv, thread const Captured& c)"
        unused = "(void)b; (void)h; (void)q; (void)kv; (void)c;"
        if self.mask is None:
            return _function(signature, [unused, "return true;"])
        e = _Emitter("mask_mod", self.buffers, "mm")
        out = _emit(e, self.mask, _SCORE_PARAMS[1:], first_buffer=self.n_score)
        return _function(signature, [unused] + e.lines + [f"return {_result(e, out[0], 'bool')};"])

    def gradient_functions(self) -> tuple[list, list]:
        """(the functions score_grad and, per walk, <walk>_grads and <walk>_index; the reads)."""
        if self.score is None:
            return [_function(f"float score_grad{_SIG})", [_UNUSED, "return 1.0f;"])] + _read_functions([], [], []), []
        gm = self.score
        n_in = len([n for n in gm.graph.nodes if n.op == "placeholder"])
        # The score_mod's body and its reads of trainable tensors.
        e = _Emitter("score_mod", self.buffers, "sg")
        _emit(e, gm, _SCORE_PARAMS)
        candidates = [n for n, rd in e.reads.items() if self.buffers[rd.buffer].requires_grad]

        # One traced derivative: d score_mod / d score, then / d each read's value.
        substituted = _call_with(gm, n_in, {n: i for i, n in enumerate(candidates)})

        def grads(*args):
            rest, values = args[1:n_in], args[n_in:]
            f = lambda x, *vals: substituted(x, *rest, *vals).float()  # noqa: E731
            return torch.func.grad(f, argnums=tuple(range(1 + len(values))))(args[0], *values)

        dgm = _trace(grads, _index_example(True) + _example(self.buffers[:self.n_score]) +
                     [(torch.float32, ())] * len(candidates), "score_mod (its derivative)")
        d = _Emitter("score_mod (its derivative)", self.buffers, "dg")
        d.lines = list(e.lines)
        outs = _emit(d, dgm, _SCORE_PARAMS, bound=[(e.names[n], e.types[n]) for n in candidates])
        fns = [_function(f"float score_grad{_SIG})", [_UNUSED] + d.lines + [f"return {_result(d, outs[0], 'float')};"])]

        # The reads a gradient flows from (not detached), and the lines the kernels sum them along.
        deps = _dependences(gm, _SCORE_PARAMS)
        reads, grad_of, index_of = [], [], []
        for n, out in zip(candidates, outs[1:]):
            if _is_zero(out):
                continue
            buf = self.buffers[e.reads[n].buffer]
            walk = _walk(_combine([_support(deps.get(i)) for i in _index_nodes(n)]))
            if walk is None:
                raise CapturedGradientError(
                    f"FlexAttention: captured tensor {buf.name} (shape {buf.shape}, {buf.dtype}) requires grad and score_mod reads "
                    "it at an index that depends on q_idx and kv_idx other than through q_idx - kv_idx (or on the "
                    "score): the kernels cannot reduce its gradient deterministically (detach it, or index it by "
                    "b, h and one of q_idx, kv_idx, q_idx - kv_idx)")
            reads.append(Read(e.slot(e.reads[n].buffer), walk))
            grad_of.append(_result(d, out, "float"))
            index_of.append(f"{e.reads[n].ok} ? int({e.reads[n].flat}) : -1")
        return fns + _read_functions(reads, d.lines, e.lines, grad_of, index_of), reads


def _is_zero(out) -> bool:
    """Whether a traced derivative is the constant 0 (what torch.func.grad gives a value
    the output does not depend on, e.g. through .detach())."""
    if not isinstance(out, torch.fx.Node):
        return out == 0
    fill = {aten.zeros_like.default: 0, aten.zeros.default: 0, aten.new_zeros.default: 0}.get(out.target)
    if out.target in (aten.full_like.default, aten.scalar_tensor.default):
        fill = out.args[1] if out.target is aten.full_like.default else out.args[0]
    return fill == 0


_SIG = "(float s, int b, int h, int q, int kv, thread const Captured& c"


def _read_functions(reads: list, grad_lines: list, index_lines: list, grad_of: list = (), index_of: list = ()) -> list:
    """Per walk: FLEX_<WALK>_READS, ``<walk>_grads`` (g[slot] = d score_mod / d the slot's read
    value) and ``<walk>_index`` (the slot's read's flat index in its tensor, -1 out of range)."""
    fns = []
    for walk in WALKS:
        mine = [i for i, r in enumerate(reads) if r.walk == walk]
        fns.append(f"#define FLEX_{walk.upper()}_READS {len(mine)}")
        fns.append(_function(f"void {walk}_grads{_SIG}, thread float* g)",
                             [_UNUSED, "(void)g;"] + (grad_lines if mine else []) +
                             [f"g[{slot}] = {grad_of[i]};" for slot, i in enumerate(mine)]))
        fns.append(_function(f"int {walk}_index(int slot, int b, int h, int q, int kv, thread const Captured& c)",
                             ["const float s = 0.0f;", _UNUSED, "(void)slot;"] + (index_lines if mine else []) +
                             [f"if (slot == {slot}) return {index_of[i]};" for slot, i in enumerate(mine)] +
                             ["return -1;"]))
    return fns


def _index_nodes(read: torch.fx.Node) -> list:
    """The index operands of a read (through the partial reads of chained indexing)."""
    out = []
    n = read
    while isinstance(n, torch.fx.Node) and n.op == "call_function":
        if n.target is aten.index.Tensor:
            out.extend(i for i in n.args[1] if isinstance(i, torch.fx.Node))
        elif n.target is aten.select.int:
            if isinstance(n.args[2], torch.fx.Node):
                out.append(n.args[2])
        else:
            break
        n = n.args[0]
    return out


_cache = LRU("flex_lowerings", 256)
_cache_lock = threading.Lock()


def lower(score_mod: Optional[Callable], mask_mod: Optional[Callable], score_buffers: tuple = (),
          mask_buffers: tuple = ()) -> LoweredMods:
    """Trace and lower the mods (None: identity score, every element visible) over captured
    tensors described by ``score_buffers`` / ``mask_buffers`` (:class:`Buffer`).  Cached per
    (mods, buffers): a compiled graph's mods lower once."""
    key = (score_mod, mask_mod, tuple(score_buffers), tuple(mask_buffers))
    with _cache_lock:
        hit = _cache.get(key)
    if hit is not None:
        return hit
    low = _Lowering(score_mod, mask_mod, tuple(score_buffers), tuple(mask_buffers))
    grad_fns, reads = low.gradient_functions()
    buffers = low.tensors
    elements = [ELEMENT[b.dtype][0] for b in buffers]
    members = "".join(f"const device {el}* t{k}; " for k, el in enumerate(elements))
    params = " ".join(f"const device {el}* flex_t{k} [[buffer({FIRST_CAPTURED_BUFFER + k})]]," for k, el in
                      enumerate(elements))
    init = ", ".join([f"flex_t{k}" for k in range(len(buffers))] + ["flex_dims"])
    meta = {"captured": len(buffers), "reads": [[r.buffer, r.walk] for r in reads]}
    header = "\n".join([
        HEADER_TAG + json.dumps(meta),
        "// FlexAttention mods, generated by torch_metal_flash.flex.lowering.",
        "#pragma once",
        '#include "flash_transforms.h"',
        f"#define FLEX_HAS_SCORE_MOD {int(score_mod is not None)}",
        f"#define FLEX_HAS_MASK_MOD {int(mask_mod is not None)}",
        f"#define FLEX_CAPTURED_PARAMS {params}",
        f"#define FLEX_CAPTURED_INIT flex::Captured{{{init}}}",
        _PRELUDE,
        f"struct Captured {{ {members}constant int* dims; }};",
        low.score_function(),
        *grad_fns,
        low.mask_function(),
        "}  // namespace flex",
        "",
    ])
    result = LoweredMods(header, tuple(reads))
    with _cache_lock:
        _cache.put(key, result)
    return result
