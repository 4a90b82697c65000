"""FlexAttention's ``score_mod`` / ``mask_mod`` lowered to Metal functions.

The mods are traced as torch traces them: ``make_fx`` over 0-d tensors (a
float32 score, int32 b, h, q_idx, kv_idx) with tensor indexing turned into
``aten.index``; tensors the mods capture (closures, globals) are the graph's
constants (the user's very tensors) and become kernel buffers.  The score's
derivative ``score_grad`` is the trace of ``torch.func.grad`` of the score_mod.
Each aten node becomes one typed C statement: ``bool``, ``int``/``long``
(and the narrower integers of captured tensors), ``float`` for every floating
value (Metal has no double: float64 computes as float).

Conventions where a GPU cannot do what torch does: a captured read wraps a
negative index once (as torch indexing) and reads 0 for an index still out of
range; integer division or remainder by zero gives 0; a ``-inf`` literal is
``-FLT_MAX`` (the kernels hide an element whose score is <= -FLT_MAX, torch's
meaning of ``-inf``), NaN literals are refused.  Data-dependent Python control
flow and ops outside the table raise :class:`~torch_metal_flash.UnsupportedError`
naming them (the caller falls back or, strict, re-raises).
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Callable, Optional

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from ..backends import UnsupportedError

aten = torch.ops.aten
MAX_CAPTURED = 9  # buffers 22..30
FIRST_CAPTURED_BUFFER = 22

# captured tensor dtype -> (Metal element type, host dtype it is bound as)
_ELEMENT = {
    torch.bool: ("uchar", torch.uint8), torch.uint8: ("uchar", torch.uint8), torch.int8: ("char", torch.int8),
    torch.int16: ("short", torch.int16), torch.int32: ("int", torch.int32), torch.int64: ("long", torch.int64),
    torch.float16: ("half", torch.float16), torch.bfloat16: ("bfloat", torch.bfloat16),
    torch.float32: ("float", torch.float32), torch.float64: ("float", torch.float32),
}
_VALUE = {torch.bool: "bool", torch.uint8: "uchar", torch.int8: "char", torch.int16: "short", torch.int32: "int",
          torch.int64: "long"}


def _value_type(dtype: torch.dtype) -> str:
    if dtype.is_floating_point:
        return "float"
    if dtype not in _VALUE:
        raise UnsupportedError(f"values of dtype {dtype} cannot be lowered to Metal")
    return _VALUE[dtype]


@dataclasses.dataclass(frozen=True)
class LoweredMods:
    header: str
    key: str
    captured: tuple  # the user's tensors, in buffer order
    has_score_mod: bool
    has_mask_mod: bool

    def buffers(self, device: torch.device) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The captured tensors ready to bind (contiguous, bool as uint8, float64 as float32) and
        the int32 sizes of all of them (the ``dims`` buffer), on ``device``."""
        out, dims = [], []
        for i, t in enumerate(self.captured):
            if t.device != device:
                raise ValueError(f"flex_attention: captured tensor {i} (shape {tuple(t.shape)}, {t.dtype}) is on "
                                 f"{t.device}, the query on {device}: move it to {device}")
            t = t.detach()
            t = t.view(torch.uint8) if t.dtype == torch.bool else t.to(_ELEMENT[t.dtype][1])
            out.append(t.contiguous())
            dims.extend(t.shape)
        return out, torch.tensor(dims or [0], dtype=torch.int32, device=device)


# ---------------------------------------------------------------------------
# tracing
# ---------------------------------------------------------------------------
def _trace(fn: Callable, args: tuple, what: str) -> torch.fx.GraphModule:
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
    try:
        with torch.no_grad(), TransformGetItemToIndex():
            return make_fx(fn, tracing_mode="real")(*args)
    except UnsupportedError:
        raise
    except Exception as e:  # noqa: BLE001 -- any failure of user code to trace is a reason to fall back
        text = str(e)
        if "_local_scalar_dense" in text or "data-dependent" in text or "data dependent" in text:
            raise UnsupportedError(f"{what} uses data-dependent Python control flow (if/while/bool() on a tensor "
                                   "value); write it with torch.where") from e
        raise UnsupportedError(f"{what} could not be traced ({type(e).__name__}: {text.splitlines()[0][:200]})") from e


def _index_args(score: bool) -> tuple:
    idx = tuple(torch.zeros((), dtype=torch.int32) for _ in range(4))
    return ((torch.zeros((), dtype=torch.float32),) + idx) if score else idx


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


class _Emitter:
    def __init__(self, what: str, captured: dict, prefix: str):
        self.what, self.captured, self.prefix = what, captured, prefix
        self.lines: list[str] = []
        self.names: dict = {}
        self.types: dict = {}

    def operand(self, a, ctype: str) -> str:
        if isinstance(a, torch.fx.Node):
            if a not in self.names:
                raise UnsupportedError(f"{self.what} uses a captured tensor of {a.meta['val'].dim()} dims as a "
                                       "value (index it down to a scalar)")
            name = self.names[a]
            return name if self.types[a] == ctype else f"{ctype}({name})"
        return _literal(a, ctype)

    def common(self, *args) -> str:
        """The type two operands are compared in."""
        floating = any((isinstance(a, torch.fx.Node) and self.types[a] == "float") or isinstance(a, float)
                       for a in args)
        return "float" if floating else "long"

    def read(self, node: torch.fx.Node, indices) -> str:
        """A captured tensor element at `indices` (wrapped once, 0 when out of range)."""
        k, offset, ndim = self.captured[node]
        if len(indices) != ndim or any(i is None for i in indices):
            raise UnsupportedError(f"{self.what} indexes a captured tensor of {ndim} dims with {len(indices)} "
                                   "indices (index every dim with a scalar)")
        parts, ok = [], []
        for d, i in enumerate(indices):
            size = f"long(c.dims[{offset + d}])"
            var = f"{self.prefix}i{len(self.lines)}_{d}"
            self.lines.append(f"long {var} = {self.operand(i, 'long')}; {var} += {var} < 0 ? {size} : 0;")
            ok.append(f"{var} >= 0 && {var} < {size}")
            parts.append((var, size))
        flat = parts[0][0] if parts else "0"
        for var, size in parts[1:]:
            flat = f"({flat}) * {size} + {var}"
        cond = " && ".join(ok) if ok else "true"
        elem = f"c.t{k}[{flat}]"
        if self.captured_dtype(node) == torch.bool:
            elem = f"({elem} != 0)"
        return f"({cond}) ? {elem} : 0"

    def captured_dtype(self, node):
        return self.captured_tensors[self.captured[node][0]].dtype

    def emit(self, node: torch.fx.Node) -> None:
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise UnsupportedError(f"{self.what} uses {node.target}, which gives no tensor")
        op, inplace = _out_of_place(node.target)
        expr = _lower_op(self, op, node.args, dict(node.kwargs), node)
        if val.dim() != 0:
            raise UnsupportedError(f"{self.what} computes a non-scalar value with {op} (a mod maps scalars to "
                                   "a scalar)")
        ctype = _value_type(val.dtype)
        name = f"{self.prefix}{len(self.names)}"
        self.lines.append(f"const {ctype} {name} = {ctype}({expr});")
        self.names[node], self.types[node] = name, ctype
        if inplace:  # (autograd's formulas mutate) later reads of the operand see the new value
            self.names[node.args[0]], self.types[node.args[0]] = name, ctype


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
_PASS = {aten.lift_fresh_copy.default, aten.clone.default, aten.alias.default, aten.detach.default}


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


def _lower_op(e: _Emitter, op, args, kwargs, node) -> str:
    packet = getattr(op, "overloadpacket", None)
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
    if op is aten.index.Tensor and isinstance(args[0], torch.fx.Node) and args[0] in e.captured:
        return e.read(args[0], list(args[1]))
    raise UnsupportedError(f"{e.what} uses {op}, which torch_metal_flash cannot lower to Metal")


def _body(gm: torch.fx.GraphModule, what: str, params: list[str], captured: dict, captured_tensors: list,
          result_type: str, prefix: str) -> list[str]:
    e = _Emitter(what, captured, prefix)
    e.captured_tensors = captured_tensors
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for n, p in zip(placeholders, params):
        e.names[n], e.types[n] = p, _value_type(n.meta["val"].dtype)
    result = None
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            t = getattr(gm, n.target)
            if n not in captured:
                raise AssertionError("captured tensors are registered before emission")
            if t.dim() == 0:  # a captured scalar used as a value
                e.names[n], e.types[n] = f"{_value_type(t.dtype)}(c.t{captured[n][0]}[0])", _value_type(t.dtype)
        elif n.op == "call_function":
            if n.target is aten._assert_tensor_metadata.default:
                continue
            e.emit(n)
        elif n.op == "output":
            out = n.args[0]
            result = out[0] if isinstance(out, (tuple, list)) else out
    if not isinstance(result, torch.fx.Node):
        e.lines.append(f"return {_literal(result, result_type)};")
    elif result_type == "bool" and e.types[result] != "bool":
        e.lines.append(f"return {e.names[result]} != 0;")
    else:
        e.lines.append(f"return {e.operand(result, result_type)};")
    return e.lines


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


def _function(signature: str, lines: Optional[list[str]], default: str) -> str:
    body = "\n".join("  " + line for line in (lines if lines is not None else [default]))
    return f"__attribute__((always_inline)) inline {signature} {{\n{body}\n}}"


def lower(score_mod: Optional[Callable], mask_mod: Optional[Callable]) -> LoweredMods:
    """Trace and lower the mods (None: identity score, every element visible)."""
    graphs = {}
    if score_mod is not None:
        graphs["score_mod"] = _trace(score_mod, _index_args(True), "score_mod")

        def grad_fn(s, b, h, q, kv):
            return torch.func.grad(lambda x: score_mod(x, b, h, q, kv).float())(s)

        graphs["score_grad"] = _trace(grad_fn, _index_args(True), "score_mod (its derivative)")
    if mask_mod is not None:
        graphs["mask_mod"] = _trace(mask_mod, _index_args(False), "mask_mod")

    captured: dict = {}  # node -> (buffer number, dims offset, ndim)
    tensors: list = []
    offsets: list = []
    for gm in graphs.values():
        for n in gm.graph.nodes:
            if n.op != "get_attr":
                continue
            t = getattr(gm, n.target)
            k = next((i for i, u in enumerate(tensors) if u is t), None)
            if k is None:
                if t.dtype not in _ELEMENT:
                    raise UnsupportedError(f"a mod captures a tensor of dtype {t.dtype}")
                k = len(tensors)
                offsets.append(sum(u.dim() for u in tensors))
                tensors.append(t)
            captured[n] = (k, offsets[k], t.dim())
    if len(tensors) > MAX_CAPTURED:
        raise UnsupportedError(f"the mods capture {len(tensors)} tensors; the kernels bind at most {MAX_CAPTURED}")

    score_params = ["s", "b", "h", "q", "kv"]
    bodies = {name: _body(gm, name.replace("score_grad", "score_mod"),
                          score_params if name != "mask_mod" else score_params[1:], captured, tensors,
                          "bool" if name == "mask_mod" else "float", f"{name[0]}{name[-1]}")
              for name, gm in graphs.items()}
    elements = [_ELEMENT[t.dtype][0] for t in tensors]
    members = "".join(f"const device {el}* t{k}; " for k, el in enumerate(elements))
    params = " ".join(f"const device {el}* flex_t{k} [[buffer({FIRST_CAPTURED_BUFFER + k})]]," for k, el in
                      enumerate(elements))
    init = ", ".join([f"flex_t{k}" for k in range(len(tensors))] + ["flex_dims"])
    unused = "(void)s; (void)b; (void)h; (void)q; (void)kv; (void)c;"
    header = "\n".join([
        "// FlexAttention mods, generated by torch_metal_flash.flex.lowering.",
        "#pragma once",
        '#include "flash_transforms.h"',
        f"#define FLEX_HAS_SCORE_MOD {int(score_mod is not None)}",
        f"#define FLEX_HAS_MASK_MOD {int(mask_mod is not None)}",
        f"#define FLEX_CAPTURED_PARAMS {params}",
        f"#define FLEX_CAPTURED_INIT flex::Captured{{{init}}}",
        _PRELUDE,
        f"struct Captured {{ {members}constant int* dims; }};",
        _function("float score_mod(float s, int b, int h, int q, int kv, thread const Captured& c)",
                  [unused] + bodies["score_mod"] if "score_mod" in bodies else None, f"{unused} return s;"),
        _function("float score_grad(float s, int b, int h, int q, int kv, thread const Captured& c)",
                  [unused] + bodies["score_grad"] if "score_grad" in bodies else None, f"{unused} return 1.0f;"),
        _function("bool mask_mod(int b, int h, int q, int kv, thread const Captured& c)",
                  ["(void)b; (void)h; (void)q; (void)kv; (void)c;"] + bodies["mask_mod"]
                  if "mask_mod" in bodies else None, "(void)b; (void)h; (void)q; (void)kv; (void)c; return true;"),
        "}  // namespace flex",
        "",
    ])
    return LoweredMods(header, hashlib.sha256(header.encode()).hexdigest(), tuple(tensors),
                       score_mod is not None, mask_mod is not None)
