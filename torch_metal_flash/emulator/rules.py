"""What the Metal compiler rejects: clang's diagnostics, named by the MSL rule they enforce.

The rules pass (compiler.check_rules) compiles the pre-pass output as C++ for
OpenCL 2021, whose address spaces are Metal's, twice:

- with a generic address space: everything but one rule.  Copies of objects
  out of ``constant`` memory fail there (C++ for OpenCL's implicit copy
  members take ``__generic`` references, which exclude ``__constant``) while
  Metal allows them: those errors are dropped, and the build compiles
  ``constant`` as ``__global const`` instead.
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
FUNCTION_CONSTANTS = ("MSL function constants are specialised when the pipeline is created, after compilation: "
                      "they are not constant expressions (if constexpr, template arguments, array sizes, "
                      "static_assert, case labels)")

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
     "MSL: function pointers need [[visible]] functions and a function table, which the emulator does not "
     "support; plain function pointers are an error"),
    ("builtin-type", r"MSL: built-in parameter", "MSL: built-in parameters have fixed types"),
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
    ("bool-vector", r"invalid vector element type 'bool'",
     "emulator limitation: vec<bool, N> is not available (C++ for OpenCL has no bool vectors); the bool2, bool3 "
     "and bool4 types work (one byte per lane)"),
    ("address-space", r"address space|__global|__local|__constant|__private|__generic", ADDRESS_SPACES),
]


def explanations(rule: str) -> set:
    """The texts a CompileError of a rule starts with (after file:line)."""
    special = {"recursion": RECURSION, "function-constant": FUNCTION_CONSTANTS}
    return {text for r, _, text in RULES if r == rule} | ({special[rule]} if rule in special else set())


_CONSTANT_EXPRESSION = re.compile(r"constant expression|explicitly-specified argument|initializer of '\w+' is unknown")
_HEADER = re.compile(r"^(.*?):(\d+):(\d+): (fatal error|error|warning|note): (.*)$")
_SHIM = re.compile(r"[/\\]csrc[/\\]emulator[/\\]shim[/\\]")


@dataclasses.dataclass
class Diagnostic:
    file: str
    line: int
    col: int
    severity: str
    message: str
    text: str  # the whole diagnostic: header, source excerpt and notes


def parse(stderr: str) -> list:
    """Errors and warnings with their notes and source excerpts."""
    diags, cur = [], None
    for line in stderr.splitlines():
        m = _HEADER.match(line)
        if m and m.group(4) != "note":
            cur = Diagnostic(m.group(1), int(m.group(2)), int(m.group(3)), m.group(4), m.group(5), line)
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


def rule_of(d: Diagnostic, constants: set = frozenset()) -> tuple:
    """(rule id, explanation) of an error."""
    if constants and _CONSTANT_EXPRESSION.search(d.text):
        names = set(re.findall(r"[A-Za-z_]\w*", d.text))
        if names & constants:
            return "function-constant", FUNCTION_CONSTANTS
    if d.message.startswith("no matching") and re.search(r"address space '__\w+'", d.text):
        return "address-space", ADDRESS_SPACES  # every candidate needs another address space
    for rule, pattern, text in RULES:
        if re.search(pattern, d.message):
            return rule, text
    return "", ""


def _user_location(d: Diagnostic) -> tuple:
    """Where in the user's code an error is: the innermost note outside the shim
    (e.g. the instantiation) when clang reports it inside the shim."""
    if _SHIM.search(d.file):
        for line in d.text.splitlines()[1:]:
            m = _HEADER.match(line)
            if m and not _SHIM.search(m.group(1)):
                return m.group(1), int(m.group(2))
    return d.file, d.line


def _error_dict(d: Diagnostic, rule: str, text: str, name: str) -> dict:
    file, line = _user_location(d)
    head = f"{file}:{line}: {text}" if text else f"{file}:{line}: {d.message}"
    return {"error": f"{head}\n{d.text}".strip(), "file": file, "line": line, "rule": rule or "c++"}


def judge(generic_stderr: str, this_stderr: str, name: str, constants: set) -> dict:
    """The verdict of the rules passes: {"error": ...} for the first broken
    rule, else {"constant_in_global": bool, "warnings": str}."""
    constant_copies = False
    warnings = []
    for d in parse(generic_stderr):
        if d.severity == "warning":
            if not _SHIM.search(d.file):
                warnings.append(d.text)
            continue
        if _copies_from_constant(d):
            constant_copies = True
            continue
        rule, text = rule_of(d, constants)
        return _error_dict(d, rule, text, name)
    for d in parse(this_stderr):
        if d.severity != "warning" and not _SHIM.search(d.file) and _breaks_thread_rules(d):
            rule, text = rule_of(d)
            return _error_dict(d, rule, text, name)
    return {"constant_in_global": constant_copies, "warnings": "\n".join(warnings)}


def compile_error(stderr: str, name: str, constants: set = frozenset()) -> CompileError:
    """A CompileError for clang's first error in stderr (preprocessing)."""
    for d in parse(stderr):
        if d.severity in ("error", "fatal error"):
            e = _error_dict(d, *rule_of(d, constants), name)
            return CompileError(e["error"], file=e["file"], line=e["line"], rule=e["rule"])
    return CompileError(f"compiling {name} failed:\n{stderr[:20000]}")
