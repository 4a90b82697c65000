"""The register estimate per kernel variant (torch_metal_flash/planner/registers.py) and its table."""
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torch_metal_flash.planner import registers
from torch_metal_flash.planner.backward_tiles import DKVTile, DQTile, backward_tiles, backward_variants, dkv_variants
from torch_metal_flash.planner.decode import decode_variants
from torch_metal_flash.planner.tiles import ForwardTile, forward_variants

ROOT = Path(__file__).resolve().parents[2]


def test_hand_counts():
    # forward d64, 64 keys per step: Qf 8 + Of 8 + S 8 + one K/V fragment = 25 fragments, 2 registers each
    assert registers.estimate(ForwardTile("f16", 64, 32, 64)) == 50
    # the fused dK/dV kernel at d128 staging K and V: dKf 16 + dVf 16 + S^T 1 + dP^T 1 + 4 temporaries
    assert registers.estimate(DKVTile("f16", 128, 32, 8, 0)) == 2 * 38
    # the split dK kernel holds K and V too: 16 + 16 + dKf 16 + S^T, dP^T 4 each + 3 temporaries
    assert registers.estimate(DKVTile("f16", 128, 64, 32, 1)) == 2 * 59
    # dQ at d64, 32 keys per step: Qf, dOf, dQf 8 each + S, dP 4 each + 2
    assert registers.estimate(DQTile("f16", 64, 64, 32)) == 2 * 34
    # accelerator forward d64, 32 keys: Qf 4 + 2 temporaries (half: 4 registers each), Of 4 + S 2 (float: 8 each)
    assert registers.estimate(ForwardTile("f16", 64, 64, 32, nax=True)) == 6 * 4 + 6 * 8
    with pytest.raises(TypeError, match="no register estimate"):
        registers.estimate(object())


def test_every_variant_has_an_estimate():
    for t in (*forward_variants(), *backward_variants(), *decode_variants()):
        assert 0 < registers.estimate(t) < 1024, t


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_the_fused_dkv_kernel_holds_fewer_than_the_split_dk_kernel(dtype):
    for d in (80, 96, 128, 160, 192, 256):
        fused, = backward_tiles(dtype, d).dkv
        split = next(p for p in dkv_variants(dtype, d) if p[0].mode == 1)
        assert fused.stages_kv and registers.estimate(fused) < registers.estimate(split[0]), (d, fused, split)


def test_estimates_grow_with_the_head_dim_and_the_split_cuts_them():
    """Undivided kernels hold more with every bucket; a head-dim split over 4 simdgroups holds
    less than half of the undivided kernel of its bucket (forward, dQ: about a quarter; the fused
    dK/dV kernel against the undivided dK kernel: K, V, dK and dV slices against K, V and dK)."""
    per_dim = sorted((t.bd, registers.estimate(t)) for t in forward_variants()
                     if t.dtype == "f16" and not t.nax and t.ds == 1)
    best = {}
    for bd, r in per_dim:
        best[bd] = min(best.get(bd, r), r)
    values = [best[bd] for bd in sorted(best)]
    assert values == sorted(values)
    for t in [*forward_variants(), *backward_variants()]:
        if t.ds > 1:
            undivided = dataclasses.replace(t, ds=1)
            if isinstance(t, DKVTile):
                undivided = dataclasses.replace(undivided, mode=1)  # the undivided kernels' heaviest
            assert 2 * registers.estimate(t) < registers.estimate(undivided), t


def test_table_bench(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "registers.py"), "--results", str(tmp_path)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    text = (tmp_path / "registers.md").read_text()
    assert "| 512 |" in text and "`flash_bwd_dkv_f16_d128_k32_q8_m0` 76" in text
