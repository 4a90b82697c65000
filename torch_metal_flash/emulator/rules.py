"""What the Metal compiler rejects: clang's diagnostics, named by the MSL rule they enforce.

The rules pass (compiler.check_rules) compiles the pre-pass output as C++ for
OpenCL 2021, whose address spaces are Metal's, twice:

- with a generic address space: everything but one rule.  Copies of objects
  out of ``constant`` memory fail there (C++ for OpenCL's implicit copy
  members take ``__generic`` references, which exclude ``__constant``) while
  Metal allows them: the source of each such copy (clang's diagnostic gives
  its range) is wrapped in ``__mtl::copy(...)`` and the pass runs again.
- without one, where ``this`` of an unqualified member function and
  ``thread`` are ``__private`` as in Metal (with a generic address space
  ``thread`` is compiled as generic, so that member functions can return
  ``thread`` references to members).  Only two kinds of errors are taken
  from this pass, because clang cannot copy class objects or use temporaries
  there: member functions called on device / threadgroup / constant objects,
  and conversions of device / threadgroup / constant pointers and references
  to ``thread`` ones.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Optional

from .errors import CompileError

ADDRESS_SPACES = ("MSL address spaces: a pointer or reference keeps its address space (device, threadgroup, "
                  "constant, thread); converting it to another one is an error")
RECURSION = "MSL restriction: recursive function calls are not supported"
FUNCTION_POINTERS = ("MSL: function pointers need [[visible]] functions and a function table, which the emulator does "
                     "not support; plain function pointers are an error (a function as a template argument is fine)")
VECTOR_CAST = ("emulator limitation: this cast between vector types would reinterpret the bits here, where MSL "
               "converts each component; spell the vector type (float4(x), (float4)x) or cast to a template "
               "parameter (T(x), (T)x, static_cast<T>(x))")
FUNCTION_CONSTANTS = ("MSL function constants are specialised when the pipeline is created, after compilation: "
                      "they are not constant expressions (if constexpr, template arguments, array sizes, "
                      "static_assert, case labels)")

# clang's error for a vector of bool (C++ for OpenCL has none): compiler.check_rules
# retries such a source with its bool template arguments as byte lanes
BOOL_VECTOR = "invalid vector element type 'bool'"

# (rule id, regex on the first line of an error, explanation)
RULES = [
    ("member-address-space", r"cannot initialize object parameter of type",
     "MSL address spaces: `this` of a member function is in `thread` memory unless the function is declared "
     "for another address space (e.g. `float get() const device`); calling it on a device, threadgroup or "
     "constant object needs such a member function"),
    ("program-scope", r"program scope variable must reside in constant address space",
     "MSL address spaces: program-scope variables (and static data members) must be declared in the "
     "`constant` address space"),
    ("program-scope", r"static local variable must reside in constant address space",
     "MSL address spaces: static variables must be declared in the `constant` address space"),
    ("host-header", r"file not found",
     "MSL: only the Metal standard library headers (<metal_stdlib>, <metal_math>, ...) and your own headers are "
     "available to a kernel; host (C/C++ standard library) headers are not"),
    ("language-version", r"MSL language version:",
     "MSL language version: Metal 4's tensor ops (<MetalPerformancePrimitives/MetalPerformancePrimitives.h>) need "
     "the Metal 4.0 language (-std=metal4.0; compile_shader(..., language_version=\"4.0\"))"),
    ("virtual", r"virtual functions are not supported", "MSL restriction: virtual functions are not supported"),
    ("dynamic_cast", r"'dynamic_cast' is not supported", "MSL restriction: dynamic_cast is not supported"),
    ("typeid", r"'typeid' is not supported", "MSL restriction: typeid (type identification) is not supported"),
    ("new-delete", r"'default (new|delete)' is not supported|'(new|delete)' is not supported",
     "MSL restriction: the new and delete operators are not supported"),
    ("exceptions", r"with exceptions disabled", "MSL restriction: exception handling (try, catch, throw) is not "
                                                "supported"),
    ("goto", r"MSL restriction: goto", "MSL restriction: the goto statement is not supported"),
    ("thread_local", r"thread_local", "MSL restriction: thread_local storage is not supported"),
    ("register", r"'register' storage class", "MSL restriction: the register storage class is not supported"),
    ("double", r"use of type 'double' requires", "MSL: the double type is not supported"),
    ("vla", r"variable length array|array size is not a constant expression",
     "MSL restriction: variable-length arrays are not supported (array sizes must be constant expressions)"),
    ("function-pointers", r"pointers to functions are not allowed|taking address of function is not allowed",
     FUNCTION_POINTERS),
    ("builtin-type", r"MSL: built-in parameter", "MSL: built-in parameters have fixed types"),
    ("buffer-address-space", r"MSL: kernel parameter '.*' must be a pointer or reference in the",
     "MSL: a kernel's [[buffer(n)]] parameter is a pointer or reference in the device or constant address space, "
     "a [[threadgroup(n)]] one in the threadgroup address space (`device float* out [[buffer(0)]]`)"),
    ("missing-return", r"\[-Werror,-Wreturn-type\]|does not return a value",
     "a non-void function must return a value on every path (undefined on the GPU; an error here)"),
    ("uninitialized", r"\[-Werror,-Wuninitialized\]", "a variable is read before it is initialised (undefined on "
                                                       "the GPU; an error here)"),
    ("array-bounds", r"\[-Werror,-Warray-bounds\]", "a constant array index is out of bounds (an error here)"),
    ("division-by-zero", r"\[-Werror,-Wdivision-by-zero\]", "division by zero (an error here)"),
    ("return-stack-address", r"\[-Werror,-Wreturn-stack-address\]",
     "a function returns the address of one of its local variables (an error here)"),
    ("read-only", r"read-only variable is not assignable|cannot assign to variable .* with const-qualified type",
     "MSL: constant memory is read-only (and so is data reached through const pointers and references)"),
    ("bool-vector", re.escape(BOOL_VECTOR),
     "emulator limitation: a vector of bool written directly is not available (C++ for OpenCL has no bool "
     "vectors; vec<bool, N> through templates and the bool2, bool3, bool4 types work, one byte per lane)"),
    ("address-space", r"address space|__global|__local|__constant|__private|__generic", ADDRESS_SPACES),
]


def explanations(rule: str) -> set:
    """The texts a CompileError of a rule starts with (after file:line)."""
    special = {"recursion": RECURSION, "function-constant": FUNCTION_CONSTANTS, "vector-cast": VECTOR_CAST,
               "constant-const": CONSTANT_CONST}
    return {text for r, _, text in RULES if r == rule} | ({special[rule]} if rule in special else set())


_CONSTANT_EXPRESSION = re.compile(r"constant expression|explicitly-specified argument|initializer of '\w+' is unknown")
_HEADER = re.compile(r"^(.*?):(\d+):(\d+):((?:\{\d+:\d+-\d+:\d+\})*):? ?(fatal error|error|warning|note): (.*)$")
_RANGE = re.compile(r"\{(\d+):(\d+)-(\d+):(\d+)\}")
# The shim's files: csrc/ in a checkout, _csrc/ in an installed package; debug info may name them relatively.
SHIM_PATH = re.compile(r"(?:^|[/\\])_?csrc[/\\]emulator[/\\]shim[/\\]")
# The system headers kernels include (<metal_stdlib>, <MetalPerformancePrimitives/...>).
SYSTEM_HEADER_PATH = re.compile(r"(?:^|[/\\])_?csrc[/\\]emulator[/\\]include[/\\]")
_INCLUDED_FROM = re.compile(r"^In file included from (.*?):(\d+):$")


@dataclasses.dataclass
class Diagnostic:
    file: str
    line: int
    col: int
    severity: str
    message: str
    text: str  # the whole diagnostic: header, source excerpt and notes
    ranges: list = dataclasses.field(default_factory=list)  # (line, col, end line, end col): its source ranges
    included_from: list = dataclasses.field(default_factory=list)  # (file, line) of the #includes, outermost first


def parse(stderr: str) -> list:
    """Errors and warnings with their notes and source excerpts."""
    diags, cur, includes = [], None, []
    for line in stderr.splitlines():
        m = _HEADER.match(line)
        inc = _INCLUDED_FROM.match(line)
        if inc:
            includes.append((inc.group(1), int(inc.group(2))))
        elif m and m.group(5) != "note":
            ranges = [tuple(map(int, r)) for r in _RANGE.findall(m.group(4))]
            cur = Diagnostic(m.group(1), int(m.group(2)), int(m.group(3)), m.group(5), m.group(6), line, ranges,
                             includes)
            includes = []
            diags.append(cur)
        elif cur is not None and not line.startswith("In file included from") and \
                not re.match(r"\d+ (errors?|warnings?)( and \d+ (errors?|warnings?))? generated", line):
            cur.text += "\n" + line
    return diags


def _copies_from_constant(d: Diagnostic) -> bool:
    """C++ for OpenCL cannot copy a class object out of __constant memory; Metal can."""
    return bool(re.search(r"\(the implicit (copy|move) (constructor|assignment operator)\) not viable: cannot bind "
                          r"reference in address space '__constant'", d.text))


def _breaks_thread_rules(d: Diagnostic) -> bool:
    """An error of the pass without a generic address space that Metal makes too."""
    if re.search(r"cannot initialize object parameter of type .* with an expression of type "
                 r"'[^']*(__global|__local|__constant)", d.message):
        return True
    if re.search(r"\(the implicit|default address space|address space unqualified", d.text):
        return False  # a copy or a temporary: C++ for OpenCL's limitation, not Metal's rule
    return bool(re.search(r"__private", d.text) and re.search(r"__global|__local|__constant", d.text) and
                re.search(r"cannot initialize|cannot pass pointer|changes address space|converts between mismatching|"
                          r"cannot bind|assigning to", d.text))


# `constexpr constant float table[16]` passed as `constant float*`: Metal's constant pointers
# are read-only anyway, C++ for OpenCL keeps const apart
_CONST_CONSTANT = re.compile(r"no known conversion from '(?:const __constant|__constant const) [^']*' to "
                             r"'__constant (?!const)[^']*\*")
CONSTANT_CONST = ("emulator limitation: a const object in constant memory (e.g. a constexpr constant array) passed "
                  "as a `constant T*` / `constant T&` without const: Metal allows it, C++ for OpenCL does not; "
                  "spell the parameter `constant const T*`")


def rule_of(d: Diagnostic, constants: set = frozenset()) -> tuple:
    """(rule id, explanation) of an error."""
    if constants and _CONSTANT_EXPRESSION.search(d.text):
        names = set(re.findall(r"[A-Za-z_]\w*", d.text))
        if names & constants:
            return "function-constant", FUNCTION_CONSTANTS
    if _CONST_CONSTANT.search(d.text):
        return "constant-const", CONSTANT_CONST
    if d.message.startswith("no matching") and re.search(r"address space '__\w+'", d.text):
        return "address-space", ADDRESS_SPACES  # every candidate needs another address space
    for rule, pattern, text in RULES:
        if re.search(pattern, d.message):
            return rule, text
    return "", ""


def _user_location(d: Diagnostic) -> tuple:
    """Where in the user's code an error is: the innermost note outside the shim
    (e.g. the instantiation) when clang reports it inside the shim."""
    if SYSTEM_HEADER_PATH.search(d.file):  # an #error of a system header: the #include that reached it
        for file, line in reversed(d.included_from):
            if not SYSTEM_HEADER_PATH.search(file) and not SHIM_PATH.search(file):
                return file, line
    if SHIM_PATH.search(d.file):
        for line in d.text.splitlines()[1:]:
            m = _HEADER.match(line)
            if m and not SHIM_PATH.search(m.group(1)):
                return m.group(1), int(m.group(2))
    return d.file, d.line


def _error_dict(d: Diagnostic, rule: str, text: str, name: str) -> dict:
    file, line = _user_location(d)
    head = f"{file}:{line}: {text}" if text else f"{file}:{line}: {d.message}"
    return {"error": f"{head}\n{d.text}".strip(), "file": file, "line": line, "rule": rule or "c++"}


# An unsuffixed literal is a float in Metal: not worth a warning
_FLOAT_LITERAL = re.compile(r"double precision constant requires cl_khr_fp64")


def _wide_scalar_operand(d: Diagnostic) -> Optional[tuple]:
    """The range of the scalar operand in `float * half4` (or `0.5 * v` in a template): MSL
    converts the scalar to the vector's element type, C++ for OpenCL rejects it."""
    m = re.match(r"scalar operand type has greater rank than the type of the vector element\. \('([^']*)'( \(vector)?",
                 d.message)
    if not m or len(d.ranges) != 2 or SHIM_PATH.search(d.file):
        return None
    first_is_vector = bool(m.group(2)) or "ext_vector_type" in m.group(1)
    return d.ranges[1] if first_is_vector else d.ranges[0]


def judge_generic(stderr: str, name: str, constants: set) -> dict:
    """The pass with a generic address space: {"error": ...} for the first
    broken rule, else {"copies": [(line, col, end line, end col)] of sources
    copied out of constant memory, "warnings": str}."""
    copies, warnings = [], []
    for d in parse(stderr):
        if d.severity == "warning":
            if not SHIM_PATH.search(d.file) and not _FLOAT_LITERAL.search(d.message):
                warnings.append(d.text)
            continue
        if _copies_from_constant(d) and d.ranges and not SHIM_PATH.search(d.file):
            copies.append(d.ranges[-1])  # the last range is the source (`a = b`: b)
            continue
        scalar = _wide_scalar_operand(d)
        if scalar is not None:
            copies.append((*scalar, "lane"))
            continue
        return _error_dict(d, *rule_of(d, constants), name)
    return {"copies": sorted(set(copies)), "warnings": "\n".join(warnings)}


def judge_this(stderr: str, name: str) -> Optional[dict]:
    """The pass without a generic address space: the first error Metal makes too."""
    for d in parse(stderr):
        if d.severity != "warning" and not SHIM_PATH.search(d.file) and _breaks_thread_rules(d):
            return _error_dict(d, *rule_of(d), name)
    return None


def apply_copies(text: str, rounds: list) -> str:
    """The text the rules pass accepted: check_rules' rounds of wrap_copies."""
    for copies in rounds:
        text = wrap_copies(text, [tuple(c) for c in copies])
    return text


def wrap_copies(text: str, copies: list) -> str:
    """`text` with the source of each copy out of constant memory wrapped in
    __mtl::copy(...), or inside the braces of an initializer list, and each scalar operand
    wider than its vector operand's elements (ranges tagged "lane") in __mtl::lane(...).  The
    ranges are clang's: lines of the compiled text, columns, exclusive ends."""
    lines = text.split("\n")
    inserts = set()  # (line index, column, text)
    for l1, c1, l2, c2, *lane in copies:
        a, b, c1, c2 = l1 - 1, l2 - 1, c1 - 1, c2 - 1
        if lines[a][c1:c1 + 1] == "{" and lines[b][c2 - 1:c2] == "}" and not lane:
            c1, c2 = c1 + 1, c2 - 1
        inserts |= {(a, c1, "__mtl::lane(" if lane else "__mtl::copy("), (b, c2, ")")}
    for i, col, s in sorted(inserts, key=lambda x: (x[0], -x[1], x[2] == ")")):
        lines[i] = lines[i][:col] + s + lines[i][col:]
    return "\n".join(lines)


def compile_error(stderr: str, name: str, constants: set = frozenset()) -> CompileError:
    """A CompileError for clang's first error in stderr (preprocessing)."""
    for d in parse(stderr):
        if d.severity in ("error", "fatal error"):
            e = _error_dict(d, *rule_of(d, constants), name)
            return CompileError(e["error"], file=e["file"], line=e["line"], rule=e["rule"])
    return CompileError(f"compiling {name} failed:\n{stderr[:20000]}")
