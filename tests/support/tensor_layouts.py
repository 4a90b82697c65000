"""The cooperative-tensor element-to-lane layouts of Metal 4's tensor ops, per GPU family, as the tests
state them independently of the emulator (docs/emulator.md, "Tensor ops (Metal 4)")."""
from __future__ import annotations

import torch


def apple10_layout(rows: int, cols: int, lane: int, transposed: bool = False) -> list:
    """Apple10's layout: (row, col) of each element of `lane` in a rows x cols operand as stored."""
    out = []
    for e in range(rows * cols // 32):
        f, i = divmod(e, 8)
        per_row = cols // 16
        r = (f // per_row) * 16 + (((lane >> 2) & 4) | ((lane >> 1) & 3)) + (i >> 2) * 8
        c = (f % per_row) * 16 + ((((lane >> 2) & 2) | (lane & 1)) * 4) + i % 4
        out.append((r, c))
    return out


def apple8_layout(rows: int, cols: int, lane: int, transposed: bool = False) -> list:
    """Apple8/9's layout (PyTorch's MppAttention.h): (row, col) as stored of each element of `lane` in a
    rows x cols operand, laid out in its logical orientation (cols x rows when stored transposed)."""
    if transposed:
        return [(c, r) for r, c in apple8_layout(cols, rows, lane)]
    fm = ((lane >> 4) & 1) * 4 + ((lane >> 1) & 3)
    fn = ((lane >> 3) & 1) * 4 + (lane & 1) * 2
    per_row = cols // 16
    return [(strip * 16 + fm + 8 * half, f * 16 + fn + (0, 1, 8, 9)[j])
            for strip in range(rows // 16) for half in (0, 1) for f in range(per_row) for j in range(4)]


LAYOUTS = {"apple10": apple10_layout, "apple8": apple8_layout, "apple9": apple8_layout}


def offsets(shapes, family) -> torch.Tensor:
    """Per lane, the row-major offsets of its elements in each (rows, cols, transposed) operand."""
    return torch.tensor([r * cols + c for lane in range(32) for rows, cols, t in shapes
                         for r, c in LAYOUTS[family](rows, cols, lane, t)], dtype=torch.int16)
