"""How much a change of the acceptance rule widens the allowed error in ordinary problems.

    python bench/rule_widening.py [--against REV]     # default: 26829dd (before the score-rounding term)

On tests/kernels/test_precision.py's float32 sweep (max |score| 1-30) and its planted-defect
problems, runs the kernels (emulator) once and prints, per result, max error / allowed
under REV's rule and under this checkout's, and allowed(this) / allowed(REV) over the
elements (median and max).
"""
from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import torch

import harness

# Where the rule lives, newest layout first: (file at a revision, the package its relative imports name).
RULE_FILES = (("torch_metal_flash/testing/oracle.py", "torch_metal_flash.testing"),
              ("torch_metal_flash/testing.py", "torch_metal_flash"))


def _rule_at(rev: str):
    """The rule module of revision ``rev``; its relative imports resolve against this checkout."""
    for path, package in RULE_FILES:
        got = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=harness.ROOT, capture_output=True, text=True)
        if got.returncode == 0:
            break
    else:
        raise SystemExit(f"{rev}: no acceptance rule at {' or '.join(p for p, _ in RULE_FILES)}:\n{got.stderr}")
    file = Path(tempfile.mkdtemp()) / Path(path).name
    file.write_text(got.stdout)
    return harness.load_source("torch_metal_flash._rule_before", file, package)


def _allowed(rule, name, ref, plain, mag, dtype):
    """The rule's allowed error per element; a rule from before allowed_error existed
    had the floor 2 * base + 4 u M (u of float32)."""
    if hasattr(rule, "allowed_error"):
        return rule.allowed_error(name, ref, plain, mag, dtype)
    ref, plain, mag = (t.double() for t in (ref, plain, mag.expand(ref.shape)))
    finite = torch.isfinite(ref)
    base = (plain - ref)[finite].abs().max()
    return 2 * base + rule.FLOOR_ROUNDINGS * rule.UNIT_ROUNDOFF[torch.float32] * mag[finite]


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--against", default="26829dd")
    args = ap.parse_args()
    from torch_metal_flash import testing as now
    before = _rule_at(args.against)
    from support import backward_cases as bk
    from support import forward_cases as fc
    from support import precision_cases as tp
    from torch_metal_flash.testing import randn
    torch.randn = randn  # the suite's portable inputs (tests/conftest.py)

    print(f"| problem | result | error/allowed {args.against} | error/allowed now | allowed now/{args.against}: "
          "median | max |\n|---|---|---|---|---|---|")

    def compare(label, spec, got, dout=None, dlse=None, dbias=False):
        rows = {}
        for rule in (before, now):
            ref, low = (rule.forward_reference(spec) if dout is None
                        else rule.backward_reference(spec, dout, dlse, dbias))
            for n, g in got.items():
                if g is None or getattr(ref, n) is None:
                    continue
                args_ = (getattr(ref, n), getattr(low, n), ref.magnitude[n])
                e, a = rule.error_budget(n, g, *args_, spec.q.dtype)
                rows.setdefault(n, []).append((e / a, _allowed(rule, n, *args_, spec.q.dtype)))
        for n, ((r0, a0), (r1, a1)) in rows.items():
            ratio = a1 / a0
            print(f"| {label} | {n} | {r0:.3f} | {r1:.3f} | {ratio.median():.2f} | {ratio.max():.2f} |")

    for shape in tp.SWEEP_SHAPES:
        for target in (1, 3, 10, 30):
            spec, dout, dlse = tp.sweep_case(shape, target, seed=target)
            compare(f"{shape} s={target}", spec, dict(zip(("out", "lse"), fc.run_forward(spec, checked=False))))
            out, aux = bk.saved_forward(spec)
            grads, _ = bk.run_backward(spec, dout, out, aux, dlse, spec.mask is not None, checked=False)
            compare(f"{shape} s={target}", spec, dict(zip(now.GRAD_NAMES, grads)), dout, dlse, spec.mask is not None)
    for i, c in enumerate(tp.DEFECT_CASES):
        spec, dout, grads, _ = tp.kernel_grads(c)
        compare(f"defect case {i}", spec, dict(zip(now.GRAD_NAMES[:3], grads[:3])), dout)

    print(f"\nPlanted defects (tests/kernels/test_precision.py): max error / allowed, {args.against} -> now "
          "(above 1: caught)\n\n| problem | one key dropped from a dQ row | dV row x (1 + 1e-4) | scale x (1 + 1e-5) |"
          "\n|---|---|---|---|")

    def worst(rule, spec, dout, grads):
        ref = rule.backward_reference(spec, dout, compute_dbias=True)
        return max(e / a for e, a in rule.grad_errors(spec, dout, None, grads, reference=ref).values())

    for i, c in enumerate(tp.DEFECT_CASES):
        spec, dout, grads, _ = tp.kernel_grads(c)
        row = spec.seqlen_q // 2
        p = torch.softmax(spec.q[0, 0, row].double() @ spec.k[0, 0].double().T * spec.scale, -1)
        j = p.argsort()[spec.seqlen_k // 2].item()
        dbias = now.plain_attention(spec, torch.float64, dout, compute_dbias=True).dbias
        dq = grads[0].double().clone()
        dq[0, 0, row] -= spec.scale * dbias[0, 0, row, j] * spec.k[0, 0, j].double()
        dv = grads[2].clone()
        dv[0, 0, dv[0, 0].norm(dim=-1).argsort()[spec.seqlen_k // 2].item()] *= 1 + 1e-4
        off_spec, off_dout, off_grads, _ = tp.kernel_grads(c, scale_error=1 + 1e-5)
        cells = [" -> ".join(f"{worst(rule, sp, do, gr):.1f}" for rule in (before, now))
                 for sp, do, gr in ((spec, dout, (dq.float(), *grads[1:])), (spec, dout, (*grads[:2], dv, None, None)),
                                    (off_spec, off_dout, off_grads))]
        print(f"| defect case {i} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
