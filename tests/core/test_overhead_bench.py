"""bench/overhead.py runs the C++ op core's host path and reports its JSON summary (the overhead ratios)."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_overhead_bench_json(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "overhead.py"), "--iters", "30", "--json",
                             "--results", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(summary) == {"torch_sdpa_us", "op_hit_ratio", "op_miss_ratio", "faces", "backward_ratio",
                            "decode_ratio", "vs_op_hit"}
    assert set(summary["faces"]) == {"scaled_dot_product_attention", "flash_attn_func", "sdpa_override"}
    assert set(summary["vs_op_hit"]) == set(summary["faces"]) | {"decode"}
    assert summary["torch_sdpa_us"] > 0
    # a hit replays a template; a miss plans in Python: the cache must make a difference
    assert summary["op_hit_ratio"] < summary["op_miss_ratio"] / 2
    assert (tmp_path / "overhead.md").read_text().startswith("# Host overhead per call")
