"""What clang's own parser says about a source: the casts, initialisers, function pointer types and threadgroup
variables the pre-pass rewrites.

The pre-pass (prepass.py) hands clang a *view* of its text: the same characters
(so every offset is an offset of the text) with what C++ for OpenCL cannot
parse blanked -- ``[[...]]`` attributes, the ``kernel`` keyword, the
``constant`` of function constants.  clang parses the view syntax-only with
the shim as a precompiled header (compiler.syntax_facts) and dumps its AST as
JSON; this module reads from that AST:

- casts: C-style casts ``(T)x``, functional casts ``T(x)`` / ``T(x, y)`` (vector
  constructors among them), ``static_cast<T>(x)`` and expressions in error
  (a vector constructor C++ for OpenCL cannot build), each with its extent,
  the extents of its operands and the template type parameters in scope --
  so which parenthesis is a cast or a constructor and where its operands end
  is the compiler's answer, not a guess from the characters around it;
- initialised declarations ``float4 a = {0.f};``, ``bool4 m = x > y;``: the
  declaration's start, where its first declarator's name is, the extent of the
  initialiser and, for a brace list, how many elements it has;
- function pointer types of template parameters (``template <void (*deq)(...)>``)
  and of typedef / using declarations: the declaration's extent and where its
  name is;
- namespaces (extent, name) and program-scope variables (extent);
- threadgroup variables declared in function bodies (``threadgroup float
  tile[32], acc;``): the statement's extent and each variable's name and
  declarator.

Offsets are characters of the view.  clang's JSON writes a location's file
only when it differs from the previous location written, so the walk follows
the order of the output.
"""
from __future__ import annotations

import re

import bisect
import itertools
from typing import Optional

# A vector constructor MSL has and C++ for OpenCL lacks (`float4(f2, z, w)`, `half4(f4)`) is an
# expression in error, which clang keeps (typed, with its operands) as a RecoveryExpr.
CAST_KINDS = ("CStyleCastExpr", "CXXUnresolvedConstructExpr", "CXXStaticCastExpr", "CXXFunctionalCastExpr",
              "RecoveryExpr")


def _offset_map(text: str):
    """Byte offset of the UTF-8 encoding -> character offset."""
    if text.isascii():
        return lambda b: b
    table = list(itertools.accumulate(len(c.encode()) for c in text))
    return lambda b: bisect.bisect_right(table, b)


class _Walk:
    """The AST in output order, tracking the file of each location."""

    def __init__(self, main_file: str, char_at):
        self.file = None
        self.main = main_file
        self.char_at = char_at

    def location(self, loc: dict, end: bool = False) -> Optional[int]:
        """The character offset in the view of a (begin, or end token's end) location; None elsewhere.
        Must be called on every location in output order."""
        if "spellingLoc" in loc:
            self.location(loc["spellingLoc"])
            return self.location(loc["expansionLoc"], end)
        if "offset" not in loc:
            return None
        self.file = loc.get("file", self.file)
        if self.file != self.main:
            return None
        return self.char_at(loc["offset"] + (loc.get("tokLen", 0) if end else 0))

    def extent(self, node: dict):
        """(loc, begin, end) of a node, end exclusive (each None outside the view)."""
        loc = self.location(node["loc"]) if "loc" in node else None
        rng = node.get("range", {})
        begin = self.location(rng["begin"]) if "begin" in rng else None
        end = self.location(rng["end"], end=True) if "end" in rng else None
        return loc, begin, end


_THREAD_WORD = re.compile(r"(?<![\w])thread(?![\w])")


def _qualifiers_before(view: str, at: int) -> set:
    """Where the word `thread` is among the qualifiers just before `at` (`const thread T* p`: an empty
    macro is not part of clang's source range)."""
    found, i = set(), at
    while True:
        j = len(view[:i].rstrip())
        m = re.search(r"(?<![\w])(thread|const|volatile)$", view[max(0, j - 8):j])
        if not m:
            return found
        i = j - len(m.group(1))
        if m.group(1) == "thread":
            found.add(i)


def _local_object(qual_type: str) -> bool:
    """A type whose object is in threadgroup memory: ``__local float[40]``, ``__local Accum``,
    ``__local T[2 * BK]``, not a pointer or reference to threadgroup memory (``__local T *``)."""
    if not qual_type.startswith("__local "):
        return False
    square = angle = 0
    for c in qual_type:  # the declarator's characters: outside template arguments and array bounds
        square += (c == "[") - (c == "]")
        if square == 0:
            angle += (c == "<") - (c == ">")
            if angle == 0 and c in "*&(":
                return False
    return True


def _starts_with_word(text: str, at: Optional[int], word: str) -> bool:
    end = (at or 0) + len(word)
    return at is not None and text.startswith(word, at) and not (text[end:end + 1].isalnum() or text[end:end + 1] == "_")


def _nodes(ast: dict):
    """(node, parent) depth first, in the order of clang's output."""
    stack = [(ast, None)]
    while stack:
        node, parent = stack.pop()
        yield node, parent
        stack.extend((c, node) for c in reversed(node.get("inner", ())) if isinstance(c, dict))


def _written(node: dict, cast_start: int, extent: dict) -> dict:
    """The operand as written: a conversion clang adds around it (a constructor call spanning the
    whole cast) is looked through."""
    while extent[id(node)][1] == cast_start and node.get("inner"):
        node = node["inner"][0]
    return node


def _initialisers(declarators: list, extent: dict) -> list:
    """The `= x` initialisers of variables, parameters and fields (their declarations' starts are
    shared by all their declarators: `float4 a = {0.f}, b = x;`).  A field's initialiser clang
    rejects is not in its AST: "init" None."""
    first_name, out = {}, []
    for node in declarators:
        loc, start, _ = extent[id(node)]
        init = node["inner"][-1] if node.get("inner") else {}
        _, begin, end = extent.get(id(init), (None, None, None))
        if loc is None or start is None or (init and None in (begin, end)):
            continue
        first_name.setdefault(start, loc)
        if not init:
            out.append({"start": start, "name": loc, "first_name": first_name[start], "init": None, "elements": None})
            continue
        while init.get("kind") == "RecoveryExpr" and len(init.get("inner", ())) == 1:
            init = init["inner"][0]  # a brace list C++ for OpenCL rejects (too few elements for a vector)
        elements = len(init.get("inner", ())) if init.get("kind") == "InitListExpr" else None
        out.append({"start": start, "name": loc, "first_name": first_name[start], "init": [begin, end],
                    "elements": elements})
    return out


def facts(ast: dict, view: str, main_file: str) -> dict:
    """{"casts": [...], "inits": [...], "threadgroup": [...], "function_pointers": [(kind, name,
    start, end)], "namespaces": [(start, end, name)], "globals": [(start, end)]} of the view (see
    the module docstring)."""
    walk = _Walk(main_file, _offset_map(view))
    extent, params = {}, {id(None): frozenset()}
    casts, declarators, declarations, function_pointers, thread_params = [], [], [], [], set()
    namespaces, globals_ = [], []
    for node, parent in _nodes(ast):
        extent[id(node)] = walk.extent(node)
        names = {c.get("name") for c in node.get("inner", ()) if c.get("kind") == "TemplateTypeParmDecl"}
        params[id(node)] = params[id(parent)] | (names - {None})
        kind = node.get("kind")
        if kind in CAST_KINDS or (kind == "DeclStmt" and _starts_with_word(view, extent[id(node)][1], "threadgroup")):
            (casts if kind in CAST_KINDS else declarations).append(node)
        elif (kind in ("VarDecl", "ParmVarDecl") and node.get("init") in ("c", "list") and node.get("inner")) or \
                (kind == "FieldDecl" and node.get("hasInClassInitializer")):
            declarators.append(node)
        elif kind in ("NonTypeTemplateParmDecl", "TypedefDecl", "TypeAliasDecl") and \
                "*)(" in node.get("type", {}).get("qualType", ""):  # void (*)(int), void (__generic *)(int)
            function_pointers.append(node)
        if kind == "ParmVarDecl" and re.search(r"\*\s*(const\s*)?$", node.get("type", {}).get("qualType", "")):
            loc, begin, _ = extent[id(node)]
            if loc is not None and begin is not None:
                thread_params |= {begin + m.start() for m in _THREAD_WORD.finditer(view[begin:loc])}
                thread_params |= _qualifiers_before(view, begin)
        if kind == "NamespaceDecl":
            namespaces.append((*extent[id(node)][1:], node.get("name", "")))
        elif kind == "VarDecl" and (parent or {}).get("kind") in ("TranslationUnitDecl", "NamespaceDecl",
                                                                   "LinkageSpecDecl"):
            globals_.append(extent[id(node)][1:])
    out = {"casts": [], "inits": _initialisers(declarators, extent), "threadgroup": [],
           "function_pointers": sorted({(node["kind"], *extent[id(node)]) for node in function_pointers
                                        if None not in extent[id(node)]}),
           "namespaces": [n for n in namespaces if None not in n],  # outer ones first
           "globals": sorted(g for g in globals_ if None not in g), "thread_params": sorted(thread_params)}
    for node in casts:
        _, begin, end = extent[id(node)]
        operands = [extent[id(_written(c, begin, extent))][1:] for c in node.get("inner", ()) if isinstance(c, dict)]
        if begin is None or end is None or any(None in o for o in operands):
            continue  # outside the view (the shim) or from a macro expansion
        out["casts"].append({"kind": node["kind"], "start": begin, "end": end, "operands": operands,
                             "params": sorted(params[id(node)])})
    for node in declarations:
        _, begin, end = extent[id(node)]
        variables = []
        for var in node.get("inner", ()):
            loc, _, var_end = extent[id(var)]
            if var.get("kind") != "VarDecl" or loc is None or var_end is None or "init" in var or \
                    "storageClass" in var or not _local_object(var.get("type", {}).get("qualType", "")):
                break
            variables.append((loc, var["name"], var_end))
        else:
            if end is not None and variables:
                out["threadgroup"].append({"start": begin, "end": end, "variables": variables})
    # a template's instantiations repeat its pattern's nodes
    unique = {}
    for c in out["casts"]:
        unique.setdefault((c["kind"], c["start"], c["end"]), c)
    out["casts"] = sorted(unique.values(), key=lambda c: (c["start"], -c["end"]))
    inits = {}
    for i in out["inits"]:
        inits.setdefault((i["start"], i["name"]), i)
    out["inits"] = sorted(inits.values(), key=lambda i: i["name"])
    out["threadgroup"] = sorted({d["start"]: d for d in out["threadgroup"]}.values(), key=lambda d: d["start"])
    return out
