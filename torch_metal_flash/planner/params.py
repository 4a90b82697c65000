"""ctypes mirror of ``shaders/flash_params.h`` (the params struct shared by host and kernel).

Field order, types and padding must match the header exactly; the test
``tests/kernels/test_forward_kernels.py::test_params_layout`` compiles a kernel in the
emulator that writes ``sizeof``/``offsetof`` of every field and compares.
"""
from __future__ import annotations

import ctypes

_I64 = ctypes.c_int64
_I32 = ctypes.c_int32
_F32 = ctypes.c_float
_U32 = ctypes.c_uint32


class FlashFwdParams(ctypes.Structure):
    _fields_ = [
        ("q_stride_b", _I64), ("q_stride_h", _I64), ("q_stride_l", _I64),
        ("k_stride_b", _I64), ("k_stride_h", _I64), ("k_stride_l", _I64),
        ("v_stride_b", _I64), ("v_stride_h", _I64), ("v_stride_l", _I64),
        ("o_stride_b", _I64), ("o_stride_h", _I64), ("o_stride_l", _I64),
        ("m_stride_b", _I64), ("m_stride_h", _I64), ("m_stride_q", _I64), ("m_stride_k", _I64),
        ("a_stride_b", _I64), ("a_stride_h", _I64), ("bt_stride_b", _I64),
        ("batch", _I32), ("heads", _I32), ("kv_heads", _I32), ("gqa", _I32),
        ("seqlen_q", _I32), ("seqlen_k", _I32), ("head_dim", _I32), ("head_dim_v", _I32),
        ("diag_offset", _I32), ("window_left", _I32), ("window_right", _I32), ("num_q_blocks", _I32),
        ("pack", _I32), ("num_seqs", _I32), ("max_seqlen_q", _I32), ("max_seqlen_k", _I32),
        ("page_size", _I32), ("num_blocks", _I32), ("max_blocks", _I32), ("dropout_threshold", _U32),
        ("qk_scale", _F32), ("softcap", _F32), ("dropout_scale", _F32), ("pad_i", _I32),
    ]

    def to_bytes(self) -> bytes:
        return bytes(self)


def field_layout(struct: type[ctypes.Structure]) -> dict[str, tuple[int, int]]:
    """``{field: (offset, size)}`` plus ``"__sizeof__"``."""
    out = {name: (getattr(struct, name).offset, getattr(struct, name).size) for name, _ in struct._fields_}
    out["__sizeof__"] = (0, ctypes.sizeof(struct))
    return out
