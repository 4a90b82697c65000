"""The text pre-pass: preprocessed MSL -> C++ for OpenCL the shim headers compile.

It runs on the output of ``clang -E`` (macros expanded, comments gone, line
markers kept), so instantiations produced by macros are visible.  Every
rewrite keeps the number of lines, so compiler errors and the runtime's
source locations point at the original ``.metal`` lines.  It only rewrites
what clang cannot parse as MSL means it; every language rule is left to the
compiler (see compiler.py).  Which parenthesis is a cast or a vector
constructor, where its operands end, which declarations initialise vectors and
which are threadgroup variables come from clang's AST of a view of the text
(syntax_view, syntax.py):
- MSL vector constructors ``float4(x)``, ``half4(f4)``, ``float4(f2, z, w)`` ->
  ``__mtl::make_vec<float, 4>(...)`` (splat / convert / concatenate), and
  casts that convert vectors in MSL but reinterpret them in clang:
  ``(float4)x`` -> ``float4(x)``; ``T(x)``, ``(T)x``, ``static_cast<T>(x)``
  with T a template type parameter -> ``__mtl::cast<T>(x)``;
- vector initialisers: ``float4 acc = {0.f}`` (the other lanes zero) ->
  ``__mtl::brace_vec<float, 4>(0.f)``, ``bool4 m = a > b`` (a boolN, not an
  integer mask) -> ``__mtl::make_vec<bool, 4>(a > b)``;
- half literals ``1.0h`` -> ``((half)1.0)``;
- ``threadgroup`` objects declared in function bodies -> a reference into the
  per-threadgroup arena, keyed by a function-local static {sizeof, alignof}
  (one per template instantiation);
- ``[[...]]`` attributes: recorded (kernels, parameters, host names, function
  constants, ``max_total_threads_per_threadgroup``), then blanked;
- function constants -> ``MTL_FUNCTION_CONSTANT`` declarations: variables
  whose value is set at launch, never constant expressions (Metal specialises
  them when the pipeline is created, after compilation).
``glue`` is the code the build appends: one exported entry point per kernel
host name, its parameter description, its thread limit and static checks of
its built-in parameter types.
"""
from __future__ import annotations

import ast
import bisect
import dataclasses
import itertools
import operator
import re
from typing import Optional

from .errors import CompileError
from .rules import SHIM_PATH

BUILTINS = {
    "thread_position_in_grid": 0,
    "thread_position_in_threadgroup": 1,
    "threadgroup_position_in_grid": 2,
    "threads_per_threadgroup": 3,
    "threadgroups_per_grid": 4,
    "threads_per_grid": 5,
    "grid_size": 5,
    "thread_index_in_threadgroup": 6,
    "simdgroup_index_in_threadgroup": 7,
    "thread_index_in_simdgroup": 8,
    "simdgroups_per_threadgroup": 9,
    "threads_per_simdgroup": 10,
    "thread_execution_width": 10,
    "dispatch_threads_per_threadgroup": 11,
    "quadgroup_index_in_threadgroup": 12,
    "thread_index_in_quadgroup": 13,
    "quadgroups_per_threadgroup": 14,
    "grid_origin": 15,
    "dispatch_simdgroups_per_threadgroup": 9,
    "dispatch_quadgroups_per_threadgroup": 14,
}
P_BUFFER, P_THREADGROUP, P_BUILTIN = 1, 2, 3

STD_ATTRS = {"likely", "unlikely", "maybe_unused", "fallthrough", "nodiscard", "noreturn", "deprecated",
             "no_unique_address", "assume"}

VEC_TYPES = ("bool", "char", "uchar", "short", "ushort", "int", "uint", "long", "ulong", "half", "bfloat",
             "float")
_HALF_LIT = re.compile(r"(?<![\w.])((?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?)[hH](?![\w.])")
_IDENT = re.compile(r"[A-Za-z_]\w*")
_FC_DEFINED = re.compile(r"\bis_function_constant_defined\s*\(\s*(\w+)\s*\)")


@dataclasses.dataclass
class Param:
    name: str
    kind: int  # P_BUFFER / P_THREADGROUP / P_BUILTIN / 0 unsupported
    index: int
    gate: Optional[str] = None  # function constant name gating an optional buffer
    attr: str = ""
    builtin: str = ""  # the built-in's attribute name
    file: str = ""
    line: int = 0


@dataclasses.dataclass
class Kernel:
    host_name: str
    func: str  # C++ expression naming the function (template arguments included)
    params: list
    file: str
    line: int
    # [[max_total_threads_per_threadgroup(n)]]: a C++ expression (None: 1024)
    max_threads: Optional[str] = None


@dataclasses.dataclass
class FunctionConstant:
    name: str
    index: int
    type: str
    file: str
    line: int


@dataclasses.dataclass
class Result:
    text: str  # the rewritten source
    glue: str  # appended for the build: entry points of the kernels in `built`
    kernels: list
    constants: list  # FunctionConstant
    built: list = dataclasses.field(default_factory=list)  # kernels with glue (entry i = built[i])


# ---------------------------------------------------------------- helpers


def _blank_literals_and_directives(text: str) -> str:
    """Same-length copy with string/char literal contents and directive lines blanked."""
    out = list(text)
    i, n = 0, len(text)
    line_start = True
    while i < n:
        c = text[i]
        if line_start and c in " \t":
            i += 1
            continue
        if line_start and c == "#":
            j = text.find("\n", i)
            j = n if j < 0 else j
            for k in range(i, j):
                out[k] = " "
            i = j
            continue
        line_start = c == "\n"
        if c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                if text[j] == "\\":
                    j += 1
                j += 1
            for k in range(i + 1, min(j, n)):
                if text[k] != "\n":
                    out[k] = " "
            i = j + 1
            continue
        i += 1
    return "".join(out)


# `bool` as a template type argument (`X<bool>`, `f<T, bool>`) -- not a cast's target,
# a template parameter, integral_constant's value type or enable_if's result type (a bool
# value follows those).
_BOOL_ARG = re.compile(r"(?<=[<,\s])bool(?=\s*[,>])")
_KEEPS_BOOL = re.compile(r"\b(?:static_cast|reinterpret_cast|const_cast|as_type|bit_cast|template|integral_constant|"
                         r"enable_if|enable_if_t)\s*$")
_EXPLICIT_INSTANTIATION = re.compile(r"\btemplate\b(?!\s*<)[^;{}]*;")
_EXPLICIT_SPECIALIZATION = re.compile(r"\btemplate\s*<\s*>")
_BOOL = re.compile(r"\bbool\b")
# The shim's one-byte bool lane (shim/mtl_types.h)
BOOL_LANE = "__mtl_bool_lane"


def _template_list_start(masked: str, i: int) -> int:
    """Index of the `<` that opens the template argument list containing ``masked[i]`` (-1 if none)."""
    depth = 0
    for j in range(i - 1, -1, -1):
        c = masked[j]
        if c in ">)]":
            depth += 1
        elif c in "([" or (c == "<" and depth > 0):
            depth -= 1
        elif c == "<":
            return j
        elif c in ";{}":
            return -1
    return -1


def _apply(text: str, edits: list) -> str:
    """`text` with each (start, end, replacement) applied; the edits do not overlap."""
    for a, b, rep in sorted(edits, reverse=True):
        text = text[:a] + rep + text[b:]
    return text


def _bool_lane_specializations(text: str) -> str:
    """An explicit specialization of a function whose template arguments now name the bool
    lane (``template <> bool cast_to<__mtl_bool_lane, float>(float v)``) spells its ``bool``
    return and parameter types as the lane too, so that it still specializes the template, and
    its ``return``s convert to the lane as a bool converts (``return (__mtl_bool_lane)(...)``)."""
    masked = _blank_literals_and_directives(text)
    edits = []
    for m in _EXPLICIT_SPECIALIZATION.finditer(masked):
        paren = masked.find("(", m.end())
        head = masked[m.end():paren]
        if paren < 0 or re.search(r"[;{}]", head) or not head.rstrip().endswith(">") or BOOL_LANE not in head:
            continue  # not a function specialized for the bool lane
        close = _match_close(masked, paren, "(", ")")
        body = masked.find("{", close) if close > 0 else -1
        if body < 0 or re.search(r"[;}]", masked[close:body]):
            continue  # a declaration
        body_end = _match_close(masked, body, "{", "}")
        edits += [(b.start(), b.end(), BOOL_LANE) for b in _BOOL.finditer(masked, m.end(), close)]
        if _BOOL.search(head[:head.find("<")]):
            for r in re.finditer(r"\breturn\b", masked[body:body_end]):
                expr, depth = body + r.end(), 0
                for semi in range(expr, body_end):
                    depth += masked[semi] in "([{"
                    depth -= masked[semi] in ")]}"
                    if depth == 0 and masked[semi] == ";":
                        edits += [(expr, expr, f" ({BOOL_LANE})("), (semi, semi, ")")]
                        break
    return _apply(text, edits)


def bool_type_arguments(text: str) -> str:
    """``text`` with ``bool`` template type arguments spelled as the shim's one-byte bool lane,
    for a source that forms ``vec<bool, N>`` through a template (a matrix-fragment type
    instantiated with bool), which C++ for OpenCL cannot: it has no bool vectors.  Both sides
    of ``is_same<T, bool>`` change alike; an explicit instantiation with such an argument also
    gets the lane for the ``bool`` of its parameter list, an explicit specialization for its
    signature.  Every line stays where it was."""
    masked = _blank_literals_and_directives(text)
    text = _apply(text, [(*m.span(), BOOL_LANE) for m in _BOOL_ARG.finditer(masked)
                         if (opener := _template_list_start(masked, m.start())) >= 0 and
                         not _KEEPS_BOOL.search(masked, 0, opener)])
    masked = _blank_literals_and_directives(text)
    text = _apply(text, [(*b.span(), BOOL_LANE) for m in _EXPLICIT_INSTANTIATION.finditer(masked) if BOOL_LANE in m.group(0)
                         for b in _BOOL.finditer(masked, *m.span())])
    return _bool_lane_specializations(text)


def _match_close(s: str, i: int, open_c: str, close_c: str) -> int:
    """Index of the bracket closing the one at s[i]."""
    depth = 0
    for j in range(i, len(s)):
        c = s[j]
        if c == open_c:
            depth += 1
        elif c == close_c:
            depth -= 1
            if depth == 0:
                return j
    return -1


def _match_angle(s: str, i: int) -> int:
    """Index of the '>' closing the template argument list opened at s[i] == '<'."""
    depth = 0
    paren = 0
    for j in range(i, len(s)):
        c = s[j]
        if c in "([":
            paren += 1
        elif c in ")]":
            paren -= 1
        elif paren == 0 and c == "<":
            depth += 1
        elif paren == 0 and c == ">":
            depth -= 1
            if depth == 0:
                return j
    return -1


def _split_top(s: str, sep: str = ",") -> list:
    parts, depth, angle, start = [], 0, 0, 0
    i = 0
    while i < len(s):
        c = s[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "<" and depth == 0:
            # template brackets in types; comparisons do not appear in declarations
            angle += 1
        elif c == ">" and depth == 0 and angle > 0:
            angle -= 1
        elif c == sep and depth == 0 and angle == 0:
            parts.append((start, i))
            start = i + 1
        i += 1
    parts.append((start, len(s)))
    return parts


def _blank(s: str) -> str:
    return "".join("\n" if c == "\n" else " " for c in s)


def _same_lines(old: str, new: str) -> str:
    """`new` padded with the newlines of `old` so line numbers stay put."""
    return new + "\n" * (old.count("\n") - new.count("\n"))


class _Edits:
    def __init__(self, text: str):
        self.text = text
        self.edits = []

    def replace(self, start: int, end: int, new: str):
        self.edits.append((start, end, _same_lines(self.text[start:end], new)))

    def blank(self, start: int, end: int):
        self.edits.append((start, end, _blank(self.text[start:end])))

    def apply(self) -> str:
        out, pos = [], 0
        for start, end, new in sorted(self.edits, key=lambda e: (e[0], e[1])):
            if start < pos:  # overlapping edit (already covered by an enclosing one)
                continue
            out.append(self.text[pos:start])
            out.append(new)
            pos = end
        out.append(self.text[pos:])
        return "".join(out)


class _Lines:
    """Maps offsets of the preprocessed text to (file, line) through line markers."""

    _marker = re.compile(r'^\s*#\s*(?:line\s+)?(\d+)\s+"((?:[^"\\]|\\.)*)"', re.M)

    def __init__(self, text: str, default_file: str):
        self.points = []  # (offset of the line after the marker, file, line)
        for m in self._marker.finditer(text):
            nl = text.find("\n", m.end())
            self.points.append((nl + 1 if nl >= 0 else len(text), m.group(2).encode().decode("unicode_escape"),
                                int(m.group(1)), nl + 1))
        self.text = text
        self.default_file = default_file
        self.offsets = [p[0] for p in self.points]

    def at(self, offset: int):
        k = bisect.bisect_right(self.offsets, offset) - 1
        if k < 0:
            return self.default_file, self.text.count("\n", 0, offset) + 1
        start, file, line, _ = self.points[k]
        return file, line + self.text.count("\n", start, offset)


def _error(lines: _Lines, offset: int, msg: str) -> CompileError:
    file, line = lines.at(offset)
    return CompileError(f"{file}:{line}: {msg}", file=file, line=line)


# ---------------------------------------------------------------- token-level rewrites


_VEC_TYPE = re.compile(r"(?:metal\s*::\s*)?(?:packed_)?(" + "|".join(VEC_TYPES) + r")([234])")
_VEC_TEMPLATE = re.compile(r"(?:metal\s*::\s*)?vec\s*<(.*)>", re.S)
# the target of a C-style cast `(half4)x` or of `static_cast<half4>(x)`
_CAST_TO_VEC_TYPE = re.compile(r"(?:\(|\bstatic_cast\s*<)\s*(" + _VEC_TYPE.pattern + r")\s*[)>]")
# `vec<bool, 2>`: C++ for OpenCL has no bool vectors (the shim's make_vec builds boolN)
_VEC_OF_BOOL = re.compile(r"\bvec\s*<\s*(bool)\b")
_KERNEL_WORD = re.compile(r"\bkernel\b")
_FUNCTION_CONSTANT = re.compile(r"\bconstant\s+([\w:<>\s,]+?)\s+(\w+)\s*\[\[\s*function_constant\s*\(\s*([^)]*?)\s*\)"
                                r"\s*\]\]\s*;")


def syntax_view(text: str, masked: str) -> str:
    """The text as clang parses it for syntax.facts: attributes, the `kernel` keyword and the
    `constant` of function constants (declarations without a value) blanked, the vector type of a
    C-style or static cast spelled ``__V`` (shim/mtl_syntax.h: a cast to it is valid for any
    operand, where C++ for OpenCL rejects some vector casts MSL converts, and drops a rejected
    static_cast from its AST) and ``vec<bool, N>`` spelled ``vec<char, N>`` (clang drops an
    expression of an invalid type from its AST); same offsets."""
    view = list(text)
    for m in _CAST_TO_VEC_TYPE.finditer(masked):
        view[m.start(1):m.end(1)] = "__V".ljust(m.end(1) - m.start(1))
    for m in _VEC_OF_BOOL.finditer(masked):
        view[m.start(1):m.end(1)] = "char"
    spans = [(a, b) for a, b, _ in _attributes(masked)] + [m.span() for m in _KERNEL_WORD.finditer(masked)] + \
        [(m.start(), m.start() + len("constant")) for m in _FUNCTION_CONSTANT.finditer(masked)]
    for a, b in spans:
        view[a:b] = _blank(text[a:b])
    return "".join(view)


def _vector_type(written: str) -> Optional[str]:
    """The element type and size of a vector type as written (``float4``, ``metal::packed_half2``,
    ``vec<T, 4>``): ``"float, 4"``; None for another type."""
    vec = _VEC_TYPE.fullmatch(written)
    if vec:
        return f"{vec.group(1)}, {vec.group(2)}"
    tmpl = _VEC_TEMPLATE.fullmatch(written)
    parts = _split_top(tmpl.group(1)) if tmpl else []
    return ", ".join(tmpl.group(1)[a:b].strip() for a, b in parts) if len(parts) == 2 else None


def _cast_edit(text: str, cast: dict):
    """The rewrite of one cast clang found, (start, operand start, operand end, end, prefix,
    suffix), or None: MSL converts vectors in C-style and functional casts where clang
    reinterprets their bits, and builds vectors from parts.  Vector constructors ``float4(x)``,
    ``half4(f4)``, ``float4(f2, z, w)``, ``vec<T, 4>(v, x)`` (which clang sees as a functional
    cast, or as an expression in error when it cannot build it) and the casts ``(float4)x``,
    ``static_cast<float4>(x)`` -> __mtl::make_vec<float, 4>(...) (splat / convert / concatenate);
    (T)x, T(x) and static_cast<T>(x) with T a template type parameter -> __mtl::cast<T>(x),
    T(x, y) -> __mtl::construct<T>(x, y) (a vector constructor when T is a vector)."""
    kind, start, end, operands, params = cast["kind"], cast["start"], cast["end"], cast["operands"], cast["params"]
    if not operands:
        return None
    first = operands[0][0]
    if kind == "CStyleCastExpr":
        close = text.rfind(")", start, first)
        written = text[start + 1:close].strip()
        vec = _VEC_TYPE.fullmatch(written)
        if vec:
            return start, close + 1, end, end, f"__mtl::make_vec<{vec.group(1)}, {vec.group(2)}>(", ")"
        if written in params:
            return start, close + 1, end, end, f"__mtl::cast<{written}>(", ")"
        return None
    paren = text.rfind("(", start, first)
    if paren < 0 or text[end - 1] != ")":
        return None  # T{x}: list initialisation; an expression in error that is no constructor
    if kind == "CXXStaticCastExpr":
        written = text[text.find("<", start) + 1:text.rfind(">", start, paren)].strip()
        vec = _VEC_TYPE.fullmatch(written)
        vector = f"{vec.group(1)}, {vec.group(2)}" if vec else None
        helper = "cast"
    else:
        written = text[start:paren].strip()
        vector = _vector_type(written)
        helper = "cast" if len(operands) == 1 else "construct"
    if vector:
        return start, paren + 1, end - 1, end, f"__mtl::make_vec<{vector}>(", ")"
    if written not in params or kind not in ("CXXStaticCastExpr", "CXXUnresolvedConstructExpr"):
        return None
    return start, paren + 1, end - 1, end, f"__mtl::{helper}<{written}>(", ")"


_DECLARATION_WORDS = {"const", "constexpr", "static", "constant", "thread", "threadgroup", "device", "volatile"}


def _rejected_field_initialiser(text: str, after_name: int) -> tuple:
    """The extent of the brace list after `= ` (a field's initialiser clang rejected); (0, 0) if none."""
    def next_char(i):
        return len(text) - len(text[i:].lstrip())

    eq = next_char(after_name)
    brace = next_char(eq + 1)
    close = _match_close(text, brace, "{", "}") if text[eq:eq + 1] == "=" and text[brace:brace + 1] == "{" else -1
    return (brace, close + 1) if close >= 0 else (0, 0)


def _init_edit(text: str, init: dict) -> Optional[tuple]:
    """The rewrite of the initialiser of a vector variable (or parameter), or None: a brace list
    with fewer elements than lanes zeroes the rest in MSL and is an error in C++ for OpenCL
    (``float4 acc = {0.f}`` -> ``__mtl::brace_vec<float, 4>(0.f)``); a comparison of vectors gives
    a boolN in MSL and an integer vector in C++ (``bool4 m = a > b`` ->
    ``__mtl::make_vec<bool, 4>(a > b)``)."""
    words = text[init["start"]:init["first_name"]].split()
    while words and words[0] in _DECLARATION_WORDS:
        words.pop(0)
    vector = _vector_type(" ".join(words))
    name_end = _IDENT.match(text, init["name"])
    if not vector or not name_end:
        return None
    begin, end = init["init"] or _rejected_field_initialiser(text, name_end.end())
    between = text[name_end.end():begin].strip()
    direct = between == "" and text[begin:begin + 1] == "{"  # `vec<T, N> v{0}`
    if between != "=" and not direct:
        return None  # an array / reference / pointer of vectors
    element, lanes = vector.split(", ")
    if init["init"] is None:
        elements = len([1 for a, b in _split_top(text[begin + 1:end - 1]) if text[begin + 1 + a:begin + 1 + b].strip()])
        init = dict(init, elements=elements)
    if init["elements"] is not None:
        # a lane count that is a template argument: brace_vec zeroes whatever the list leaves out
        if (lanes.isdigit() and init["elements"] >= int(lanes)) or text[begin] != "{" or text[end - 1] != "}":
            return None
        return begin, begin + 1, end - 1, end, f"{'= ' if direct else ''}__mtl::brace_vec<{vector}>(", ")"
    if element != "bool" or words[-1].startswith("packed_"):
        return None
    return begin, begin, end, end, f"__mtl::make_vec<{vector}>(", ")"


def _threadgroup_edit(text: str, decl: dict, counter) -> Optional[tuple]:
    """``threadgroup T a[N], b;`` in a function body -> a reference into the per-threadgroup arena
    per variable, keyed by a function-local static {sizeof, alignof} (shim: MTL_THREADGROUP_VAR)."""
    variables = decl["variables"]
    base_type = text[decl["start"] + len("threadgroup"):variables[0][0]].strip()
    if not base_type or "(" in base_type:
        return None
    stmts = []
    for loc, _, end in variables:
        name = _IDENT.match(text, loc).group()  # as written (clang's name has the shim's macros applied)
        dims = " ".join(text[loc + len(name):end].split())
        stmts.append(f"MTL_THREADGROUP_VAR(__mtl_tgk_{next(counter)}, {name}, {f'{base_type} {dims}'.strip()});")
    return decl["start"], decl["start"], decl["start"], decl["end"], _same_lines(
        text[decl["start"]:decl["end"]], " ".join(stmts)), ""


def _rewrite_syntax(text: str, masked: str, facts: dict) -> tuple:
    """Casts, vector initialisers and threadgroup variables, where clang's AST of the text
    (syntax.facts) puts them: (text, masked, where), `where` mapping an offset of the text to
    one of the rewritten text."""
    counter = itertools.count(1)
    edits = {e for e in (_cast_edit(text, c) for c in facts["casts"]) if e}
    edits |= {e for e in (_init_edit(text, i) for i in facts["inits"]) if e}
    edits |= {e for e in (_threadgroup_edit(text, d, counter) for d in facts["threadgroup"]) if e}
    # `thread T*` parameters: the pointee is in the thread address space, so T deduces without one
    # (C++ for OpenCL would deduce T = __generic float from a generic pointer)
    edits |= {(p, p + 6, p + 6, p + 6, "__mtl_thread_param", "") for p in facts.get("thread_params", ())
              if text.startswith("thread", p)}
    edits = sorted(edits, key=lambda e: (e[0], -e[3], e[1]))  # an edit around another first

    kept = []  # (offset in the text, offset in the rewritten text) of each piece kept as it was

    def apply(src: str, lo: int, hi: int, k: int, at: int) -> tuple:
        """src[lo:hi] with the edits from k on that lie inside it (nested ones too), written at `at`."""
        out, pos = [], lo
        while k < len(edits) and edits[k][0] < hi:
            start, a, b, end, prefix, suffix = edits[k]
            if start < pos or end > hi:  # overlaps a rewrite without nesting in it: left as it is
                k += 1
                continue
            kept.append((pos, at))
            inner, k = apply(src, a, b, k + 1, at + start - pos + len(prefix))
            out += [src[pos:start], prefix, inner, suffix]
            at += start - pos + len(prefix) + len(inner) + len(suffix)
            pos = end
        kept.append((pos, at))
        out.append(src[pos:hi])
        return "".join(out), k

    text = apply(text, 0, len(text), 0, 0)[0]
    pieces = sorted(kept)
    starts = [p[0] for p in pieces]

    def where(offset: int) -> int:
        piece = pieces[bisect.bisect_right(starts, offset) - 1]
        return piece[1] + offset - piece[0]

    return text, apply(masked, 0, len(masked), 0, 0)[0], where


def _half_literals(text: str, masked: str) -> tuple:
    """``1.0h`` -> ``((half)1.0f)`` (no new lines, positions shift)."""
    out, mout, pos = [], [], 0
    for m in _HALF_LIT.finditer(masked):
        lit = m.group(1) + ("f" if re.search(r"[.eE]", m.group(1)) else "")  # a float literal, not a double one
        out += [text[pos:m.start()], f"((half){lit})"]
        mout += [masked[pos:m.start()], f"((half){lit})"]
        pos = m.end()
    return "".join(out + [text[pos:]]), "".join(mout + [masked[pos:]])


# ---------------------------------------------------------------- attributes


def _attributes(masked: str):
    """All [[...]] groups: (start, end, content)."""
    res = []
    i = 0
    while True:
        i = masked.find("[[", i)
        if i < 0:
            break
        j = masked.find("]]", i + 2)
        if j < 0:
            break
        res.append((i, j + 2, masked[i + 2:j].strip()))
        i = j + 2
    return res


def _attr_items(content: str) -> list:
    """'kernel, max_total_threads_per_threadgroup(256)' -> [('kernel', ''), ('max_total...', '256')]."""
    items = []
    for a, b in _split_top(content):
        part = content[a:b].strip()
        m = re.match(r"([\w:]+)\s*(?:\((.*)\))?\s*$", part, re.S)
        if m:
            items.append((m.group(1), (m.group(2) or "").strip()))
    return items


def _string_value(text: str) -> str:
    """Concatenate adjacent string literals: '"a_" "float"' -> 'a_float'."""
    return "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', text))


# ---------------------------------------------------------------- the pass

POSITION_BUILTINS = {"thread_position_in_grid", "thread_position_in_threadgroup", "threadgroup_position_in_grid",
                     "threads_per_threadgroup", "threadgroups_per_grid", "threads_per_grid", "grid_size",
                     "dispatch_threads_per_threadgroup", "grid_origin"}


def _function_references(text: str, masked: str, facts: dict) -> tuple:
    """Template parameters that are function pointers (``template <void (*deq)(...)>``, a kernel
    templated on its dequantiser) become references to functions (``void (&deq)(...)``): same
    calls, same arguments, but C++ for OpenCL puts a pointer's pointee in the generic address
    space, so that a function's address never matches a pointer parameter.  Function pointer
    types named by typedef / using become references too (a pointer used at run time is an
    error either way: analysis.py).  Same length."""
    stars = set()
    for kind, name, start, end in facts["function_pointers"]:
        if kind == "TypeAliasDecl":  # using f = void (*)(...): the `*` after the first `(` followed by one
            paren = text.find("(", name, end)
            while paren >= 0 and not text[paren + 1:end].lstrip().startswith("*"):
                paren = text.find("(", paren + 1, end)
            star = text.find("*", paren, end) if paren >= 0 else -1
        else:  # void (*deq)(...), typedef void (*f)(...): the `*` before the name
            star = text.rfind("*", start, name)
        stars |= {star} - {-1}
    for i in sorted(stars):
        text, masked = text[:i] + "&" + text[i + 1:], masked[:i] + "&" + masked[i + 1:]
    return text, masked


# `#pragma unroll (MIN(DK8/2, 4*NSG))`: clang -E leaves pragma arguments unexpanded, so their
# macros are gone by the time the pre-pass output is compiled; an unroll count is only a hint.
_UNROLL_PRAGMA_WITH_NAMES = re.compile(r"^[ \t]*#[ \t]*pragma[ \t]+unroll\b[^\n]*[A-Za-z_][^\n]*$", re.M)


_VIRTUAL = re.compile(r"\bvirtual\b")


def _reject_virtual(masked: str, lines: "_Lines") -> None:
    """Virtual functions: C++ for OpenCL rejects them only without function pointers, which
    the passes allow (a function as a template argument is valid Metal), so the keyword is
    found here."""
    for m in _VIRTUAL.finditer(masked):
        if not SHIM_PATH.search(lines.at(m.start())[0]):
            file, line = lines.at(m.start())
            raise CompileError(f"{file}:{line}: MSL restriction: virtual functions are not supported", file=file,
                               line=line, rule="virtual")


@dataclasses.dataclass
class _Source:
    """The text being rewritten and what the steps have learned about it.  Until `edits` exists the
    steps rewrite `text` (and its same-length `masked` copy, literals and directives blanked) whole;
    from then on they record edits of that text, applied once at the end."""
    text: str
    default_file: str
    syntax: object  # view text -> syntax.facts
    only: Optional[set]
    masked: str = ""
    facts: dict = None
    where: object = None  # offset in the syntax view -> offset in `text`
    namespaces: list = None
    program_scope: list = None
    lines: object = None
    edits: object = None
    attrs: list = None
    handled_attrs: set = dataclasses.field(default_factory=set)
    instantiations: list = dataclasses.field(default_factory=list)  # (host_name, func_expr, template_name, offset)
    templates: dict = dataclasses.field(default_factory=dict)  # name -> Kernel (a template's parameters, thread limit)
    kernels: list = dataclasses.field(default_factory=list)
    constants: list = dataclasses.field(default_factory=list)  # FunctionConstant
    fc_names: dict = dataclasses.field(default_factory=dict)
    derived: list = dataclasses.field(default_factory=list)  # (name, type, expr) in source order


def _unroll_pragmas_and_half_literals(S: _Source) -> None:
    """Blanks `#pragma unroll(N)` with names (clang's pragma takes literals only), masks literals
    and directives, and spells `half` literals (`1.0h`) as casts."""
    S.text = _UNROLL_PRAGMA_WITH_NAMES.sub(lambda m: " " * len(m.group()), S.text)
    S.masked = _blank_literals_and_directives(S.text)
    S.text, S.masked = _half_literals(S.text, S.masked)


def _function_references_step(S: _Source) -> None:
    """Clang's AST of the view: references to functions (Metal has no function pointers) rewritten."""
    S.facts = S.syntax(syntax_view(S.text, S.masked))
    S.text, S.masked = _function_references(S.text, S.masked, S.facts)


def _syntax_rewrites(S: _Source) -> None:
    """Casts, initialisers and threadgroup declarations the AST found, rewritten; then the edit
    phase starts over the result."""
    S.text, S.masked, S.where = _rewrite_syntax(S.text, S.masked, S.facts)
    S.namespaces = [(S.where(a), S.where(b), name) for a, b, name in S.facts["namespaces"] if name]
    S.program_scope = [(S.where(a), S.where(b)) for a, b in S.facts["globals"]]
    S.lines = _Lines(S.text, S.default_file)
    _reject_virtual(S.masked, S.lines)
    S.edits = _Edits(S.text)
    S.attrs = _attributes(S.masked)


def _kernel_instantiations(S: _Source) -> None:
    """Explicit instantiations: ``template [[host_name("x")]] [[kernel]] ... ;``."""
    for m in re.finditer(r"\btemplate\b(?=\s*(?:\[\[|kernel\b))", S.masked):
        end = _stmt_end(S.masked, m.end())
        if end < 0:
            continue
        stmt = S.masked[m.end():end]
        host = None
        is_kernel = False
        for a in S.attrs:
            if m.end() <= a[0] < end:
                S.handled_attrs.add(a[0])
                for name, arg in _attr_items(a[2]):
                    if name == "host_name":
                        host = _string_value(S.text[a[0]:a[1]])
                    if name == "kernel":
                        is_kernel = True
                S.edits.blank(a[0], a[1])
        for k in re.finditer(r"\bkernel\b", stmt):
            is_kernel = True
            S.edits.blank(m.end() + k.start(), m.end() + k.end())
        if not is_kernel:
            continue
        body = _blank_attrs(stmt)
        body = re.sub(r"\bkernel\b", " ", body).strip()
        expr = None
        dm = re.match(r"decltype\s*\(", body)
        if dm:
            close = _match_close(body, dm.end() - 1, "(", ")")
            expr = body[dm.end():close].strip()
        else:
            vm = re.match(r"(?:[\w:]+\s+)([\w:]+\s*<)", body)  # void f<T>(...) or kernel_t f<T>
            if vm:
                lt = vm.end(1) - 1
                gt = _match_angle(body, lt)
                expr = body[vm.start(1):gt + 1].strip()
        if not expr:
            raise _error(S.lines, m.start(), "cannot understand this kernel instantiation; use "
                         "`template [[host_name(\"name\")]] [[kernel]] decltype(f<T>) f<T>;`, "
                         "`... void f<T>(params);` or `... f_type f<T>;` with explicit template arguments")
        expr = " ".join(expr.split())
        tname = re.match(r"[\w:]+", expr).group(0)
        S.instantiations.append((host or tname, expr, tname, m.start()))
        if S.only is not None and (host or tname) not in S.only:
            S.edits.blank(m.start(), end + 1)


def _kernel_definitions(S: _Source) -> None:
    """``[[kernel]]`` / ``kernel void`` definitions, then the instantiations of kernel templates."""
    for a in S.attrs:
        if a[0] in S.handled_attrs:
            continue
        items = _attr_items(a[2])
        if not any(n == "kernel" for n, _ in items):
            continue
        _define_kernel(S.text, S.masked, S.lines, S.edits, S.attrs, a[0], a[1], S.templates, S.kernels, S.namespaces)
    for m in re.finditer(r"\bkernel\b(?=\s*(?:\[\[[^\]]*\]\]\s*)*void\b)", S.masked):
        if any(inst[3] <= m.start() < _stmt_end(S.masked, inst[3]) for inst in S.instantiations):
            continue
        S.edits.blank(m.start(), m.end())
        _define_kernel(S.text, S.masked, S.lines, S.edits, S.attrs, m.start(), m.end(), S.templates, S.kernels,
                       S.namespaces)
    for host, expr, tname, off in S.instantiations:
        short = tname.split("::")[-1]
        if short not in S.templates:
            raise _error(S.lines, off, f"kernel instantiation '{host}': no [[kernel]] template named '{tname}'")
        tmpl = S.templates[short]
        max_threads = tmpl.max_threads
        if max_threads is not None and not max_threads.isdigit():  # depends on the template arguments
            max_threads = tmpl.max_threads.replace("@ARGS@", expr[len(tname):])
        f2, l2 = S.lines.at(off)
        S.kernels.append(Kernel(host, expr, tmpl.params, f2, l2, max_threads))


def _function_constants(S: _Source) -> None:
    """Function constants: values set at launch, never constant expressions."""
    for m in _FUNCTION_CONSTANT.finditer(S.masked):
        S.handled_attrs.update(a[0] for a in S.attrs if m.start() <= a[0] < m.end())
        idx = _constant_int(m.group(3))
        if idx is None:
            raise _error(S.lines, m.start(), f"function constant '{m.group(2)}': the emulator needs an index made of "
                         f"integer literals and arithmetic in [[function_constant(...)]], got '{m.group(3)}'")
        file, line = S.lines.at(m.start())
        fc = FunctionConstant(m.group(2), idx, " ".join(m.group(1).split()), file, line)
        S.constants.append(fc)
        S.fc_names[fc.name] = fc
        S.edits.replace(m.start(), m.end(), f"MTL_FUNCTION_CONSTANT({fc.type}, {fc.name});")
    # program-scope constants computed from function constants are set at launch too
    if S.constants:
        der_re = re.compile(r"\bconstant\s+([\w:<>\s,]+?)\s+(\w+)\s*=\s*([^;]*);")
        names = set(S.fc_names)
        for m in der_re.finditer(S.masked):
            if not any(a <= m.start() < b for a, b in S.program_scope):
                continue
            expr = _FC_DEFINED.sub(r"__mtl_fcdef_\1", S.text[m.start(3):m.end(3)])
            toks = set(_IDENT.findall(S.masked[m.start(3):m.end(3)]))
            if not (toks & names) and "is_function_constant_defined" not in toks:
                continue
            names.add(m.group(2))
            typ = " ".join(m.group(1).split())
            S.derived.append((m.group(2), typ, expr))
            S.edits.replace(m.start(), m.end(), f"MTL_DERIVED_CONSTANT({typ}, {m.group(2)}, {expr});")
    for m in _FC_DEFINED.finditer(S.masked):
        S.edits.replace(m.start(), m.end(), f"__mtl_fcdef_{m.group(1)}")


def _remaining_attributes(S: _Source) -> None:
    """Blanks every attribute but the standard ones."""
    for start, end, content in S.attrs:
        items = _attr_items(content)
        if items and all(n in STD_ATTRS or n.startswith(("clang::", "gnu::")) for n, _ in items):
            continue
        S.edits.blank(start, end)


# The rewrite, in order: each step reads and extends the _Source.
STEPS = [
    ("unroll pragmas and half literals", _unroll_pragmas_and_half_literals),
    ("function references", _function_references_step),
    ("syntax rewrites", _syntax_rewrites),
    ("kernel instantiations", _kernel_instantiations),
    ("kernel definitions", _kernel_definitions),
    ("function constants", _function_constants),
    ("remaining attributes", _remaining_attributes),
]


def run(text: str, *, default_file: str, syntax, only: Optional[set] = None) -> Result:
    """Rewrite preprocessed MSL.  `syntax`: view text -> syntax.facts (compiler.syntax_facts, clang's
    AST of the view).  `only`: host names to build (the other template instantiations are dropped,
    so a big file can be compiled in parallel pieces); the result still lists every kernel, with
    glue for the selected ones only."""
    S = _Source(text, default_file, syntax, only)
    for _, step in STEPS:
        step(S)
    out = S.edits.apply()
    glued = S.kernels if only is None else [k for k in S.kernels if k.host_name in only]
    return Result(out, _glue(glued, S.constants, S.derived), S.kernels, S.constants, glued)


def _blank_attrs(s: str) -> str:
    return re.sub(r"\[\[.*?\]\]", lambda m: " " * len(m.group(0)), s, flags=re.S)


def _stmt_end(masked: str, i: int) -> int:
    """Offset of the ';' ending the statement starting at i (depth 0), or -1 if a '{' comes first."""
    depth = 0
    for j in range(i, len(masked)):
        c = masked[j]
        if c in "([":
            depth += 1
        elif c in ")]":
            depth -= 1
        elif c == "{" and depth == 0:
            return -1
        elif c == ";" and depth == 0:
            return j
    return -1


def _define_kernel(text, masked, lines, edits, attrs, start, end, templates, kernels, namespaces):
    """A kernel definition whose [[kernel]] attribute / `kernel` keyword spans [start, end)."""
    # Host name and thread limit from the attributes around the kernel marker.
    found = {}

    def note(a0, a1):
        for n, arg in _attr_items(masked[a0 + 2:a1 - 2]):
            if n == "host_name":
                found[n] = _string_value(text[a0:a1])
            elif n == "max_total_threads_per_threadgroup":
                found[n] = " ".join(text[a0:a1][text[a0:a1].index("(") + 1:text[a0:a1].rindex(")")].split())

    if masked.startswith("[[", start):
        note(start, end)
    k = start
    while True:  # attributes before (e.g. [[host_name("x")]] [[kernel]])
        before = masked[:k].rstrip()
        if not before.endswith("]]"):
            break
        k = before.rfind("[[")
        note(k, len(before))
    tmpl_region = masked[:k].rstrip()
    template_head = None  # offset of `template` and the parameter list of a kernel template
    if tmpl_region.endswith(">"):
        depth = 0
        for q in range(len(tmpl_region) - 1, -1, -1):
            c = tmpl_region[q]
            if c == ">":
                depth += 1
            elif c == "<":
                depth -= 1
                if depth == 0:
                    t = tmpl_region[:q].rstrip()
                    if t.endswith("template"):
                        template_head = (len(t) - len("template"), text[q:len(tmpl_region)])
                    break
    j = end
    while True:  # attributes after, find `void name(`
        rest = masked[j:]
        s = rest.lstrip()
        if s.startswith("[["):
            a1 = j + (len(rest) - len(s))
            a2 = masked.find("]]", a1) + 2
            note(a1, a2)
            j = a2
            continue
        if s.startswith("kernel") and not re.match(r"kernel\w", s):
            j = j + (len(rest) - len(s)) + 6
            continue
        break
    m = re.match(r"\s*(?:\[\[[^\]]*\]\]\s*)*void\s+(?:\[\[[^\]]*\]\]\s*)*([A-Za-z_]\w*)\s*\(", masked[j:])
    if not m:
        raise _error(lines, start, "a [[kernel]] must be a function `void name(...)`")
    name = m.group(1)
    popen = j + m.end() - 1
    pclose = _match_close(masked, popen, "(", ")")
    after = masked[pclose + 1:].lstrip()
    if not after.startswith("{"):
        return  # a declaration; the definition carries the parameters
    params = _parse_params(text, masked, popen + 1, pclose, lines)
    file, line = lines.at(j + m.start(1))
    path = [name for a, b, name in namespaces if a <= start < b]
    qual = "::" + "::".join(path + [name]) if path else name
    max_threads = found.get("max_total_threads_per_threadgroup")
    if max_threads is not None and not re.fullmatch(r"\d+", max_threads):
        # An expression (it may use the template parameters): a constexpr
        # function next to the kernel evaluates it for each instantiation.
        helper = f"__mtl_max_threads_{name}_{len(kernels) + len(templates)}"
        at = template_head[0] if template_head else k
        tparams = " ".join(template_head[1].split()) if template_head else ""
        edits.replace(at, at, f"{'template ' + tparams if tparams else ''} constexpr unsigned {helper}() "
                              f"{{ return (unsigned)({max_threads}); }} ")
        qhelper = "::" + "::".join(path + [helper]) if path else helper
        max_threads = f"{qhelper}@ARGS@()" if template_head else f"{qhelper}()"
    kernel = Kernel(found.get("host_name") or name, qual, params, file, line, max_threads)
    if template_head:
        templates[name] = kernel
    else:
        kernels.append(kernel)


def _parse_params(text, masked, a, b, lines) -> list:
    params = []
    used = set()
    pending = []
    for s, e in _split_top(masked[a:b]):
        seg = masked[a + s:a + e]
        if not seg.strip() or seg.strip() == "void":
            continue
        kind, index, gate, attr_txt, builtin = 0, -1, None, "", ""
        for am in re.finditer(r"\[\[(.*?)\]\]", seg, re.S):
            attr_txt += am.group(1)
            for n, arg in _attr_items(am.group(1)):
                if n == "buffer":
                    kind, index = P_BUFFER, _int(arg, lines, a + s)
                elif n == "threadgroup":
                    kind, index = P_THREADGROUP, _int(arg, lines, a + s)
                elif n in BUILTINS:
                    kind, index, builtin = P_BUILTIN, BUILTINS[n], n
                elif n == "function_constant":
                    gate = arg
                elif n in ("texture", "sampler", "stage_in", "visible_function_table", "intersection_function_table",
                           "instance_acceleration_structure", "primitive_acceleration_structure", "payload",
                           "mesh_grid_properties"):
                    kind, index = -1, -1
        head = re.sub(r"\[\[.*?\]\]", "", seg, flags=re.S)
        ids = _IDENT.findall(head)
        pname = ids[-1] if ids else "?"
        if kind == 0:
            pending.append(len(params))  # no attribute: the next free buffer index
        if kind == P_BUFFER:
            used.add(index)
        file, line = lines.at(a + s + len(seg) - len(seg.lstrip()))
        params.append(Param(pname, kind, index, gate, attr_txt.strip(), builtin, file, line))
    nxt = 0
    for k in pending:
        while nxt in used:
            nxt += 1
        params[k].kind, params[k].index = P_BUFFER, nxt
        used.add(nxt)
    return params


_INT_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
            ast.Mod: operator.mod, ast.LShift: operator.lshift, ast.RShift: operator.rshift,
            ast.BitOr: operator.or_, ast.BitAnd: operator.and_, ast.BitXor: operator.xor,
            ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Invert: operator.invert}


def _constant_int(s: str) -> Optional[int]:
    """The value of an index written as integer literals and arithmetic (a macro expanded to
    ``800 + 1``, ``0x10``, ``(4u << 2)``); None for anything else (a name, a cast)."""
    s = re.sub(r"\b(0[xX][0-9a-fA-F]+|0[0-7]*|[1-9]\d*)[uUlL]*\b",
               lambda m: str(int(m.group(1), 16 if m.group(1)[1:2] in "xX" else 8 if m.group(1)[0] == "0" else 10)),
               s.strip()).replace("/", "//")  # C literals (hex, octal); integer division
    try:
        tree = ast.parse(s, mode="eval").body
    except SyntaxError:
        return None

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _INT_OPS:
            return _INT_OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _INT_OPS:
            return _INT_OPS[type(node.op)](value(node.operand))
        raise ValueError

    try:
        return value(tree)
    except (ValueError, ZeroDivisionError):
        return None


def _int(s, lines, off):
    v = _constant_int(s)
    if v is None:
        raise _error(lines, off, f"the emulator needs an index made of integer literals and arithmetic here, "
                                 f"got '{s}'")
    return v


def _c_string(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _glue(kernels, constants, derived) -> str:
    out = ['\n# 1 "<emulator glue>"\n']
    for i, k in enumerate(kernels):
        specs = ", ".join(f"{{{p.kind if p.kind > 0 else 0}, {p.index}}}" for p in k.params) or "{0, 0}"
        out.append(f"static MtlParamSpec __mtl_spec_{i}[] = {{{specs}}};\n")
        out.append(f"MTL_EXPORT void __mtl_kernel_{i}(MtlThreadInfo* ti) {{ __mtl::invoke(&{k.func}, ti, __mtl_spec_{i}); }}\n")
        out.append(f"MTL_EXPORT int __mtl_kinfo_{i}(MtlParamInfo* o) {{ return __mtl::describe(&{k.func}, o); }}\n")
        out.append(f"MTL_EXPORT const unsigned __mtl_max_threads_{i} = {k.max_threads or 1024};\n")
        # Built-in parameters must have the types Metal allows, buffer and threadgroup ones
        # their address space (reported at the parameter).
        for j, p in enumerate(k.params):
            if p.kind in (P_BUFFER, P_THREADGROUP):
                space = "device or constant" if p.kind == P_BUFFER else "threadgroup"
                check = "buffer_param_ok" if p.kind == P_BUFFER else "threadgroup_param_ok"
                msg = f"MSL: kernel parameter '{p.name}' must be a pointer or reference in the {space} address space"
                out.append(f"# {p.line} {_c_string(p.file)}\n"
                           f"static_assert(__mtl::{check}<__mtl::param_t<{j}, decltype({k.func})>>, {_c_string(msg)});\n")
                continue
            if p.kind != P_BUILTIN:
                continue
            position = p.builtin in POSITION_BUILTINS
            allowed = "uint, uint2, uint3, ushort, ushort2 or ushort3" if position else "uint or ushort"
            check = "builtin_position_ok" if position else "builtin_index_ok"
            msg = f"MSL: built-in parameter '{p.name}' [[{p.builtin}]] must be declared {allowed}"
            out.append(f"# {p.line} {_c_string(p.file)}\n"
                       f"static_assert(__mtl::{check}<__mtl::param_t<{j}, decltype({k.func})>>, {_c_string(msg)});\n")
        out.append('# 1 "<emulator glue>"\n')
    # Launch-time function constants: set the globals, then re-evaluate the
    # program-scope constants derived from them, in order.
    out.append("MTL_EXPORT void __mtl_set_fcs(const long* iv, const float* dv, const int* def) {\n")
    out.append("  (void)iv; (void)dv; (void)def;\n")
    for i, fc in enumerate(constants):
        out.append(f"  {fc.name} = __mtl::fc_value<{fc.type}>(iv, dv, {i}); __mtl_fcdef_{fc.name} = def[{i}] != 0;\n")
    for name, typ, expr in derived:
        out.append(f"  {name} = ({typ})({' '.join(expr.split())});\n")
    out.append("}\n")
    return "".join(out)
