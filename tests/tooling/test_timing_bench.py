"""bench/timing.py --dry-run: the standard table (kernels, torch, MLX; forward and forward + backward;
the route) and the TFLOP/s plot from the emulator's timings, labelled as not a GPU measurement."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_dry_run_writes_the_table_and_the_plot(tmp_path):
    env = {**os.environ, "TORCH_METAL_FLASH_TUNING_CACHE": str(tmp_path / "none.json")}  # no routes
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "timing.py"), "--dry-run", "--lengths", "64,128",
                             "--repeats", "1", "--results", str(tmp_path)], capture_output=True, text=True,
                            timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    text = (tmp_path / "timing_emulator.md").read_text()
    assert text.startswith("# Attention TFLOP/s on emulator (dry run") and "NOT a GPU measurement" in text
    rows = [line for line in text.splitlines() if line.startswith("| float16 |")]
    assert len(rows) == 4  # 2 lengths x causal or not
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 11 and cells[5] == cells[8] == "—"  # no MLX here
        assert all(float(c) > 0 for c in (cells[3], cells[4], cells[6], cells[7]))
        assert cells[9] == "kernels; kernels"
    png = tmp_path / "timing_emulator.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![TFLOP/s against L per route](timing_emulator.png)" in text
