"""bench/varlen.py (the packed-sequence figures) runs, and its figures say what the README claims: the
varlen step is two op calls with no host synchronisation and allocates only its results, the
per-sequence loop it replaced syncs and allocates several times more; dropout adds no O(L^2)
memory (16 bytes: the (seed, offset) pair)."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_varlen_bench_quick(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "varlen.py"), "--quick", "--iters", "2", "--json",
                             "--results", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    varlen, loop = summary["varlen"], summary["loop"]
    assert (varlen["launches"], varlen["syncs"]) == (2, 0)
    assert loop["launches"] == 2 * summary["shape"]["n"] and loop["syncs"] == 2
    assert loop["total"] > 3 * varlen["total"]
    drop = summary["dropout"]
    for row in drop:
        assert row["p0.1"] - row["p0"] == 16, row
    per_row = [(row["p0.1"] - 16) / row["L"] for row in drop]
    assert max(per_row) == min(per_row), per_row  # O(L): the same bytes per query row at every L
    assert (tmp_path / "varlen.md").read_text().startswith("# Packed sequences and dropout")
