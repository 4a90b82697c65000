"""Facts about a kernel library read from its LLVM IR (the build translation
unit at -O0, before inlining hides anything):

- recursion: a cycle in the call graph (MSL does not allow recursive calls);
- function pointers: a function's address used as a value, or a call through a
  pointer, in the kernel's code (a function as a template argument is a direct
  call: Metal allows that);
- vector casts the pre-pass could not rewrite: a bitcast between vectors of
  different element types in the kernel's code (clang's C-style cast of a
  vector reinterprets its bits, MSL converts each component);
- per kernel entry point: the static threadgroup memory (its threadgroup
  variables, as the runtime allocates them: 16-byte aligned and rounded) and
  its [[max_total_threads_per_threadgroup]] (1024 without the attribute).
"""
from __future__ import annotations

import re

from .rules import SHIM_PATH

_DEFINE = re.compile(r"^define [^@]*@(\"[^\"]+\"|[\w.$]+)\((.*)$")
_CALL = re.compile(r"\b(?:call|invoke)\b[^@]*@(\"[^\"]+\"|[\w.$]+)\(")
_DBG = re.compile(r"!dbg (!\d+)")
_META = re.compile(r"^(!\d+) = (?:distinct )?!(\w+)\((.*)\)\s*$")
_TG_KEY = re.compile(r"^@(_ZZ[\w.$]+?E\d+__mtl_tgk_\d+) = .*\[2 x i64\] \[i64 (\d+), i64 (\d+)\]", re.M)
_MAX_THREADS = re.compile(r"^@__mtl_max_threads_(\d+) = .*constant i32 (-?\d+)", re.M)
_ENTRY_ARG = re.compile(r"ptr (?:noundef )?@(_Z[\w.$]+)")
_VEC_BITCAST = re.compile(r"= bitcast <(\d+) x (\w+)> .* to <(\d+) x (\w+)>")


def _metadata(ir: str) -> dict:
    meta = {}
    for line in ir.splitlines():
        m = _META.match(line)
        if m:
            meta[m.group(1)] = (m.group(2), m.group(3))
    return meta


def _field(body: str, name: str):
    m = re.search(rf"\b{name}: (\"(?:[^\"\\\\]|\\\\.)*\"|[^,]+)", body)
    return m.group(1).strip('"') if m else None


def _location(meta: dict, ref: str) -> tuple:
    """(file, line) of a !DILocation or !DISubprogram."""
    kind, body = meta.get(ref, ("", ""))
    line = int(_field(body, "line") or 0)
    scope = _field(body, "scope") if kind == "DILocation" else ref
    while scope in meta and meta[scope][0] not in ("DISubprogram",):
        scope = _field(meta[scope][1], "scope")
    sub = meta.get(scope, ("", ""))[1]
    file_ref = _field(sub, "file")
    fname = _field(meta.get(file_ref, ("", ""))[1], "filename") or "?"
    return fname, line


def analyze_ir(ir: str) -> dict:
    meta = _metadata(ir)
    calls, names, first_call = {}, {}, {}
    cur = None
    for line in ir.splitlines():
        m = _DEFINE.match(line)
        if m:
            cur = m.group(1)
            calls[cur] = []
            d = _DBG.search(line)
            if d:
                names[cur] = _field(meta.get(d.group(1), ("", ""))[1], "name") or cur
            continue
        if cur is None:
            continue
        if line.startswith("}"):
            cur = None
            continue
        for c in _CALL.finditer(line):
            callee = c.group(1)
            calls[cur].append(callee)
            d = _DBG.search(line)
            if d:
                first_call.setdefault((cur, callee), d.group(1))
    result = {"recursion": _find_cycle(calls, names, first_call, meta), "vector_cast": _vector_cast(ir, meta),
              "function_pointer": _function_pointer(ir, meta, set(calls) | set(_DECLARE.findall(ir))),
              "kernels": {}}
    # Kernel entry points: __mtl_kernel_<i> passes the kernel function to __mtl::invoke.
    tg = {}
    for m in _TG_KEY.finditer(ir):
        tg.setdefault(m.group(1).rsplit("E", 1)[0][len("_ZZ"):], []).append((int(m.group(2)), int(m.group(3))))
    limits = {int(m.group(1)): int(m.group(2)) for m in _MAX_THREADS.finditer(ir)}
    for entry in calls:
        m = re.fullmatch(r"__mtl_kernel_(\d+)", entry)
        if not m:
            continue
        i = int(m.group(1))
        body = ir[ir.index(f"@{entry}("):]
        body = body[:body.index("\n}")]
        a = _ENTRY_ARG.search(body)
        kernel = a.group(1)[len("_Z"):] if a else ""
        total = 0
        for size, align in tg.get(kernel, []):
            total = (total + max(align, 16) - 1) // max(align, 16) * max(align, 16) + (size + 15) // 16 * 16
        result["kernels"][str(i)] = {"static_threadgroup_memory_length": total,
                                     "max_total_threads_per_threadgroup": limits.get(i, 1024)}
    return result


_DECLARE = re.compile(r"^declare [^@]*@(\"[^\"]+\"|[\w.$]+)\(", re.M)
# A function as a value (stored, passed): `ptr @f` not followed by `(`; in `call ptr @f(...)` the
# `ptr` is the return type of a direct call.
_FUNCTION_VALUE = re.compile(r"\bptr (?:noundef )?@(\"[^\"]+\"|[\w.$]+)(?![\w.$\"(])")
_INDIRECT_CALL = re.compile(r"\b(?:call|invoke)\b[^@(]*\s%[\w.$]+\(")


def _function_pointer(ir: str, meta: dict, functions: set):
    """The first use of a function pointer in code outside the shim and the glue: a function's
    address as a value (stored, passed) or a call through a pointer."""
    glue = False
    for line in ir.splitlines():
        m = _DEFINE.match(line)
        if m:
            glue = m.group(1).startswith(("__mtl", "_ZN5__mtl"))
            continue
        d = _DBG.search(line)
        if glue or not d:
            continue
        if any(v in functions for v in _FUNCTION_VALUE.findall(line)) or _INDIRECT_CALL.search(line):
            file, ln = _location(meta, d.group(1))
            if not SHIM_PATH.search(file):
                return {"file": file, "line": ln}
    return None


def _vector_cast(ir: str, meta: dict):
    """The first bitcast between vectors of as many different elements outside the shim."""
    for line in ir.splitlines():
        m = _VEC_BITCAST.search(line)
        d = _DBG.search(line)
        if m and d and m.group(1) == m.group(3) and m.group(2) != m.group(4):
            file, ln = _location(meta, d.group(1))
            if not SHIM_PATH.search(file):
                return {"file": file, "line": ln}
    return None


def _find_cycle(calls: dict, names: dict, first_call: dict, meta: dict):
    """The first recursive call (a cycle in the call graph), or None."""
    WHITE, GREY, BLACK = 0, 1, 2
    color = {f: WHITE for f in calls}
    stack = []

    def visit(f):
        color[f] = GREY
        stack.append(f)
        for g in calls[f]:
            if g not in calls:
                continue
            if color[g] == GREY:
                cycle = stack[stack.index(g):] + [g]
                ref = first_call.get((f, g))
                file, line = _location(meta, ref) if ref else ("?", 0)
                return {"cycle": " -> ".join(names.get(h, h) for h in cycle), "file": file, "line": line}
            if color[g] == WHITE:
                found = visit(g)
                if found:
                    return found
        stack.pop()
        color[f] = BLACK
        return None

    for f in calls:
        if color[f] == WHITE:
            found = visit(f)
            if found:
                return found
    return None
