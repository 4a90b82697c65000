"""The package and the benches call the attention ops by argument name (ops.fwd_call, ops.bwd_call,
ops.fwd_probs_call: the schema is the one definition of names and defaults), never with the long
positional lists the schemas would allow."""
import ast
from pathlib import Path

import pytest
import torch

import torch_metal_flash as tmf
from torch_metal_flash import ops

ROOT = Path(tmf.__file__).resolve().parents[1]
OPS = {"fwd", "bwd", "fwd_probs", "fwd_quantized", "fwd_kvcache", "fwd_kvcache_quantized"}
MAX_POSITIONAL = 12  # the hot paths' prefix calls (checked by OpCall.prefix); anything longer goes by name


def _op_name(func) -> str:
    """``fwd`` for torch.ops.metal_flash.fwd(...) / .fwd.default(...), else ''."""
    if isinstance(func, ast.Attribute) and func.attr == "default":
        func = func.value
    if isinstance(func, ast.Attribute) and func.attr in OPS and isinstance(func.value, ast.Attribute) \
            and func.value.attr == "metal_flash":
        return func.attr
    return ""


def long_positional_calls(source: str) -> list:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and _op_name(node.func) in ("fwd", "bwd", "fwd_probs"):
            starred = any(isinstance(a, ast.Starred) for a in node.args)
            if starred or len(node.args) > MAX_POSITIONAL:
                found.append((node.lineno, _op_name(node.func), len(node.args), starred))
    return found


def test_no_long_positional_op_calls():
    files = [*(ROOT / "torch_metal_flash").rglob("*.py"), *(ROOT / "bench").glob("*.py")]
    bad = {str(f.relative_to(ROOT)): c for f in files if (c := long_positional_calls(f.read_text()))}
    assert not bad, f"call the ops by name (ops.fwd_call / ops.bwd_call): {bad}"


def test_the_scan_finds_a_long_call():
    src = ("import torch\n"
           "torch.ops.metal_flash.fwd(q, k, v, None, None, None, 1.0, 0, -1, -1, 0.0, False, 0.0, None, None, None,"
           " None, None, 0, 0)\n"
           "torch.ops.metal_flash.bwd.default(*args)\n")
    assert [c[:2] for c in long_positional_calls(src)] == [(2, "fwd"), (3, "bwd")]


def test_op_call_by_name():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=g) for _ in range(3))
    named = dict(q=q, k=k, v=v, attn_mask=None, alibi_slopes=None, sinks=None, scale=0.3, diag_offset=0,
                 window_left=-1, window_right=0, softcap=0.0, return_aux=False)
    with tmf.backend("reference"):
        by_name = ops.fwd_call(**named)
        positional = torch.ops.metal_flash.fwd(*named.values())
        # defaults left out; a later argument given positions the ones between at their defaults
        varlen_defaults = ops.fwd_call(**named, max_seqlen_k=0)
    for a, b, c in zip(by_name, positional, varlen_defaults):
        assert torch.equal(a, b) and torch.equal(a, c)
    with pytest.raises(TypeError, match="metal_flash::fwd: no argument 'mask'"):
        ops.fwd_call(**named, mask=None)
    with pytest.raises(TypeError, match="metal_flash::fwd: missing 'return_aux'"):
        ops.fwd_call(**{n: a for n, a in named.items() if n != "return_aux"})
    assert ops.fwd_call.prefix(*named) is torch.ops.metal_flash.fwd.default
    with pytest.raises(TypeError, match="are not its first arguments"):
        ops.fwd_call.prefix("q", "v", "k")
    with pytest.raises(TypeError, match="misses"):
        ops.fwd_call.prefix("q", "k", "v")
