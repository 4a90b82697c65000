"""ctypes mirror of ``FlexParams`` in ``shaders/flash_flex.h`` (a BlockMask's lists as the kernels read them)."""
from __future__ import annotations

import ctypes

_I32 = ctypes.c_int32


class FlexParams(ctypes.Structure):
    _fields_ = [
        ("row_block", _I32), ("col_block", _I32), ("rows", _I32), ("cols", _I32),
        ("batch", _I32), ("heads", _I32), ("has_full", _I32), ("pad_i", _I32),
    ]

    def to_bytes(self) -> bytes:
        return bytes(self)
