"""How much of the emulator's front end is text rewriting: lines and regex call sites.

    python bench/prepass_size.py

Counts, per module of torch_metal_flash/emulator/ that rewrites or reads source
text: its lines, and its call sites of the ``re`` module and of compiled
patterns (``re.<fn>(`` and ``<PATTERN>.<match|search|finditer|sub|...>(``).
"""
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "torch_metal_flash" / "emulator"
CALL = re.compile(r"\bre\.(?:compile|match|fullmatch|search|finditer|findall|sub|subn|split|escape)\(|"
                  r"\b_?[A-Z][A-Z0-9_]*\.(?:match|fullmatch|search|finditer|findall|sub|subn|split)\(|"
                  r"\bself\._[a-z]+\.(?:match|search|finditer|findall|sub)\(")


def count(path: Path) -> tuple:
    text = path.read_text()
    return len(text.splitlines()), len(CALL.findall(text))


if __name__ == "__main__":
    names = sys.argv[1:] or ["prepass.py", "syntax.py", "rules.py", "analysis.py"]
    print(f"{'module':<14}{'lines':>7}{'regex call sites':>18}")
    for name in names:
        path = ROOT / name
        if path.exists():
            lines, calls = count(path)
            print(f"{name:<14}{lines:>7}{calls:>18}")
