"""The package's layout shows its layers (docs/architecture.md): no module imports a layer
above its own, no module takes part in an import cycle (a package's ``__init__`` counted with
its submodules: a submodule never imports from its own package's ``__init__``), few modules
at the top level."""
import ast
import types
from pathlib import Path

import pytest

import torch_metal_flash

PACKAGE = Path(torch_metal_flash.__file__).parent
NAME = "torch_metal_flash"

# Bottom to top; a module may import its own layer and the layers below.
LAYERS = [
    {"_paths", "caches", "progress"},
    {"emulator"},
    {"native"},
    {"problem"},
    {"planner"},
    {"reference"},
    {"backends"},
    {"core"},
    {"ops"},
    {"tuning"},
    {"faces", "flex", "distributed"},
    {"integrations", "nn"},
    {"diagnostics", "testing"},
    {"doctor", "tune", "__main__", "_compose", ""},  # the commands; "" is the package's __init__
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        yield ".".join(parts[:-1] if is_package else parts), is_package, path


def _imports(module: str, is_package: bool, text: str):
    """(target, name, line) of every import in ``module``'s source, at module level or inside functions:
    ``from target import name``, or ``import target`` with name None."""
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                yield target, alias.name, node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None, node.lineno


def _layer(dotted: str) -> str:
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 else ""


# The slots through which a lower layer calls up: filled in the composition root only.
UPWARD_SLOTS = {("backends", "mirror_choice_to"), ("backends", "count_runs_from"), ("metal", "run_plans_with"),
                ("checks", "use_native_signature"), ("core", "when_loaded"), ("config", "on_family_change"),
                ("choice", "install"), ("tuning", "install_result_check")}


def test_upward_callbacks_are_wired_in_the_composition_root_only():
    wired = []
    for module, _, path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and isinstance(node.func.value, ast.Name) \
                    and (node.func.value.id, node.func.attr) in UPWARD_SLOTS:
                wired.append((module, (node.func.value.id, node.func.attr), node.lineno))
    elsewhere = [w for w in wired if w[0] != f"{NAME}._compose"]
    assert not elsewhere, f"wire these in {NAME}/_compose.py: {elsewhere}"
    assert {w[1] for w in wired} == UPWARD_SLOTS


def test_every_module_is_in_a_layer():
    unplaced = sorted({_layer(m) for m, _, _ in _modules()} - set(RANK))
    assert not unplaced, f"place these in LAYERS (and docs/architecture.md): {unplaced}"


def test_no_module_imports_a_layer_above_its_own():
    known = {m for m, _, _ in _modules()}
    wrong = []
    for module, is_package, path in _modules():
        for target, name, line in _imports(module, is_package, path.read_text()):
            if not (target == NAME or target.startswith(NAME + ".")):
                continue
            full = f"{target}.{name}" if name and f"{target}.{name}" in known else target
            if full == NAME and name is not None:
                continue  # `from torch_metal_flash import x` inside the top layer is checked below
            mine, theirs = _layer(module), _layer(full)
            if RANK[theirs] > RANK[mine]:
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line} ({mine}) imports {full} ({theirs})")
    assert not wrong, "imports upward:\n" + "\n".join(wrong)


def test_only_the_top_layer_imports_the_package_itself():
    known = {m for m, _, _ in _modules()}
    wrong = [f"{path.relative_to(PACKAGE.parent)}:{line}"
             for module, is_package, path in _modules() if RANK[_layer(module)] < RANK["doctor"]
             for target, name, line in _imports(module, is_package, path.read_text())
             if target == NAME and (name is None or f"{NAME}.{name}" not in known)]
    assert not wrong, f"these import the package's __init__ (a cycle): {wrong}"


def import_cycles(modules) -> list[list[str]]:
    """The import cycles among ``modules`` ((dotted name, is_package, source text) triples): every
    import counts, at module level or inside a function. ``from P import x`` imports ``P.x`` when that
    is a module, and always ``P`` itself (its ``__init__`` runs and gives the name), so a submodule
    that writes ``from . import x`` depends on its package's ``__init__``; ``import P.x as x`` imports
    ``P.x``."""
    modules = list(modules)
    known = {m for m, _, _ in modules}
    graph = {}
    for module, is_package, text in modules:
        out = set()
        for target, name, _ in _imports(module, is_package, text):
            out |= {target} if name is None else {target, f"{target}.{name}"}
        graph[module] = (out & known) - {module}
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles():
    cycles = import_cycles((m, is_package, path.read_text()) for m, is_package, path in _modules())
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_check_sees_a_submodule_importing_its_package():
    pkg = [("p", True, "from . import a\nfrom .a import f"), ("p.a", False, "from . import b"), ("p.b", False, "")]
    assert import_cycles(pkg) == [["p", "p.a"]]  # p.a's `from . import b` runs p's __init__
    fixed = [pkg[0], ("p.a", False, "import p.b as b"), pkg[2]]
    assert import_cycles(fixed) == []
    assert import_cycles([("x", False, "def f():\n    import y"), ("y", False, "from x import f")]) == [["x", "y"]]


def test_the_reference_path_never_calls_the_ops():
    """reference/ is plain PyTorch: it never reaches torch.ops.metal_flash (which may run kernels)."""
    calls = [f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
             for path in sorted((PACKAGE / "reference").rglob("*.py"))
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Attribute) and node.attr == "metal_flash" and ast.unparse(node.value) == "torch.ops"]
    assert not calls, f"the reference path calls the ops: {calls}"


def test_the_package_never_imports_the_tests_support():
    """What only tests and benches use lives in tests/support, outside the wheel: nothing shipped imports it."""
    bad = [(dotted, target, line) for dotted, is_package, path in _modules()
           for target, _, line in _imports(dotted, is_package, path.read_text())
           if target.split(".")[0] in ("support", "tests", "hypothesis")]
    assert not bad, bad


def test_at_most_ten_modules_at_the_top_level():
    top = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert len(top) <= 10, top


def test_the_package_attribute_sdpa_override_is_the_function():
    assert not isinstance(torch_metal_flash.sdpa_override, types.ModuleType)
    with torch_metal_flash.sdpa_override():
        pass
