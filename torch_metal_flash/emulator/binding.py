"""Turning launch arguments into bound device memory.

Positional argument i binds ``[[buffer(i)]]``; ``buffers={i: value}`` binds
explicitly.  Values: a CPU ``torch.Tensor`` (any dtype, at its storage offset;
the bound extent is its view, first to last element), a numpy array, ``bytes``
/ ``bytearray`` / ``memoryview`` / a ctypes object (raw bytes, e.g. a packed
params struct), or a Python ``int`` / ``float`` / ``bool`` converted to the
declared type of the parameter (``constant T&``).  ``None`` (or no binding)
leaves a buffer unbound: a kernel that never accesses it runs, as on Metal;
an access through it is a LaunchError naming the argument.
"""
from __future__ import annotations

import ctypes
import struct
import sys

import torch_metal_flash.emulator.prepass as prepass
import torch_metal_flash.emulator.runtime as rt
from .errors import LaunchError

_SINT = {1: "b", 2: "h", 4: "i", 8: "q"}
_UINT = {1: "B", 2: "H", 4: "I", 8: "Q"}


def _bf16_bits(x: float) -> int:
    b = struct.unpack("<I", struct.pack("<f", x))[0]
    if (b & 0x7F800000) == 0x7F800000 and (b & 0x7FFFFF):
        return 0x7FC0
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF


def _pack_scalar(kname: str, pname: str, value, info) -> bytes:
    code, size = info.type_code, info.size
    try:
        if code == 1:  # bool
            return bytes([1 if value else 0]) + b"\0" * (size - 1)
        if code == 2:
            return struct.pack("<" + _SINT[size], int(value))
        if code == 3:
            return struct.pack("<" + _UINT[size], int(value) & ((1 << (8 * size)) - 1))
        if code == 4:
            return struct.pack("<e", float(value))
        if code == 5:
            return struct.pack("<H", _bf16_bits(float(value)))
        if code == 6:
            return struct.pack("<f", float(value))
        if code == 7:
            return struct.pack("<d", float(value))
    except (KeyError, struct.error, OverflowError) as e:
        raise LaunchError(f"{kname}: cannot convert {value!r} for parameter '{pname}': {e}") from None
    raise LaunchError(f"{kname}: parameter '{pname}' is not a scalar type; pass bytes or a ctypes.Structure")


def _memory_of(kname: str, pname: str, value, info, keep: list):
    """(address, nbytes, writable) of a bindable value."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise LaunchError(f"{kname}: parameter '{pname}' got a {value.device.type} tensor; the emulator "
                              "binds CPU tensors")
        if value.numel() == 0:
            return None
        if any(s < 0 for s in value.stride()):
            raise LaunchError(f"{kname}: parameter '{pname}': negative strides are not supported")
        span = sum((n - 1) * s for n, s in zip(value.shape, value.stride())) + 1
        return value.data_ptr(), span * value.element_size(), True
    np = sys.modules.get("numpy")
    if np is not None and isinstance(value, np.ndarray):
        if value.size == 0:
            return None
        if any(s < 0 for s in value.strides):
            raise LaunchError(f"{kname}: parameter '{pname}': negative strides are not supported")
        span = sum((n - 1) * s for n, s in zip(value.shape, value.strides)) + value.itemsize
        return value.__array_interface__["data"][0], span, bool(value.flags.writeable)
    if isinstance(value, (bool, int, float)):
        data = _pack_scalar(kname, pname, value, info)
        buf = ctypes.create_string_buffer(data, len(data))
        keep.append(buf)
        return ctypes.addressof(buf), len(data), False
    if isinstance(value, bytes):
        if not value:
            return None
        buf = ctypes.create_string_buffer(value, len(value))
        keep.append(buf)
        return ctypes.addressof(buf), len(value), False
    if isinstance(value, (bytearray, memoryview)):
        mv = memoryview(value)
        if mv.nbytes == 0:
            return None
        if mv.readonly:
            buf = ctypes.create_string_buffer(mv.tobytes(), mv.nbytes)
            keep.append(buf)
            return ctypes.addressof(buf), mv.nbytes, False
        arr = (ctypes.c_char * mv.nbytes).from_buffer(mv)
        keep.append(arr)
        return ctypes.addressof(arr), mv.nbytes, True
    if isinstance(value, (ctypes.Structure, ctypes.Union, ctypes.Array, ctypes._SimpleCData)):
        return ctypes.addressof(value), ctypes.sizeof(value), True
    raise LaunchError(f"{kname}: cannot bind {type(value).__name__} to parameter '{pname}' (expected a CPU tensor, "
                      "numpy array, bytes, ctypes object or Python scalar)")


def bind_arguments(kname: str, kernel, infos, args, buffers: dict, gate_on):
    values = {}
    for i, a in enumerate(args):
        values[i] = a
    for k, v in buffers.items():
        values[int(k)] = v
    buffer_params = {}
    for p, info in zip(kernel.params, infos):
        if p.kind == prepass.P_BUFFER:
            buffer_params.setdefault(p.index, []).append((p, info))
    for idx in values:
        if idx not in buffer_params and values[idx] is not None:
            raise LaunchError(f"{kname}: argument for buffer({idx}) but the kernel has no [[buffer({idx})]] "
                              f"parameter (buffers: {sorted(buffer_params)})")
    binds, keep = [], []
    dummy = ctypes.create_string_buffer(16)
    keep.append(dummy)
    for idx, plist in sorted(buffer_params.items()):
        p, info = plist[0]
        needed = any(gate_on(q) for q, _ in plist)
        value = values.get(idx)
        if value is None:
            # Nothing bound: the runtime points the argument into an inaccessible range, so a kernel that never
            # reads it runs, and one that does fails with a LaunchError naming it (library.launch).
            if not needed and any(q_info.is_reference for _, q_info in plist):
                # A reference gated off: the GPU compiles it away with its function constant, but here
                # the constant is a launch-time value and the optimiser may load through the reference
                # (references are dereferenceable) before the `if` that guards its use.  Reads find zeros.
                absent = ctypes.create_string_buffer(max(16, max(q_info.size for _, q_info in plist)))
                keep.append(absent)
                binds.append(rt.Binding(ctypes.addressof(absent), ctypes.sizeof(absent), idx, 0))
            continue
        if idx >= rt.MTL_MAX_BUFFERS:
            raise LaunchError(f"{kname}: buffer index {idx} is too large")
        mem = _memory_of(kname, p.name, value, info, keep)
        if mem is None:  # empty: bound, but every access is out of bounds
            binds.append(rt.Binding(ctypes.addressof(dummy), 0, idx, 0))
            continue
        addr, nbytes, writable = mem
        if all((q_info.is_pointer or q_info.is_reference) and q_info.is_const for _, q_info in plist):
            writable = False
        binds.append(rt.Binding(addr, nbytes, idx, int(writable)))
    return binds, keep
