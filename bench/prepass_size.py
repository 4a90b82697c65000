"""How much of the emulator's front end is text rewriting: lines and regex call sites.

    python bench/prepass_size.py             # the working tree
    python bench/prepass_size.py --rev REV   # a commit (git show REV:path)

Counts, per module of torch_metal_flash/emulator/ that rewrites or reads source
text: its lines, and its call sites of the ``re`` module and of compiled
patterns (``re.<fn>(`` and ``<PATTERN>.<match|search|finditer|sub|...>(``).
"""
import argparse
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "torch_metal_flash" / "emulator"
CALL = re.compile(r"\bre\.(?:compile|match|fullmatch|search|finditer|findall|sub|subn|split|escape)\(|"
                  r"\b_?[A-Z][A-Z0-9_]*\.(?:match|fullmatch|search|finditer|findall|sub|subn|split)\(|"
                  r"\bself\._[a-z]+\.(?:match|search|finditer|findall|sub)\(")


def source(name: str, rev) -> str:
    if rev is None:
        path = ROOT / name
        return path.read_text() if path.exists() else ""
    got = subprocess.run(["git", "show", f"{rev}:torch_metal_flash/emulator/{name}"], cwd=ROOT, capture_output=True,
                         text=True)
    return got.stdout if got.returncode == 0 else ""


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--rev", help="count the files of this git revision instead of the working tree")
    ap.add_argument("modules", nargs="*", default=["prepass.py", "syntax.py", "rules.py", "analysis.py"])
    args = ap.parse_args()
    print(f"{'module':<14}{'lines':>7}{'regex call sites':>18}")
    for name in args.modules:
        text = source(name, args.rev)
        if text:
            print(f"{name:<14}{len(text.splitlines()):>7}{len(CALL.findall(text)):>18}")
