"""How well each way of compiling MSL with clang matches Metal's address-space rules.

Every probe is a few lines of MSL that Metal accepts or rejects (the MSL
specification's rules on device / threadgroup / constant / thread pointers,
references, member functions and program-scope variables).  Each is compiled
with plain clang in three ways, and through the emulator:

- ``c++ attrs``: C++17 with ``__attribute__((address_space(n)))`` for
  device / constant / threadgroup (thread = no attribute);
- ``clc++``: C++ for OpenCL 2021 (``-cl-std=clc++2021``), Metal's spaces
  mapped onto __global / __constant / __local, with a generic address space;
- ``clc++ no-generic``: the same without the generic address space (unqualified
  = __private, as Metal's `thread`);
- ``emulator``: ``emulator.compile_shader`` (both OpenCL passes, judged by
  emulator/rules.py).

A cell is "ok" when the verdict is Metal's.  Run:
    python bench/emulator_address_spaces.py
docs/emulator.md quotes its result.
"""
from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import harness  # noqa: F401  (this checkout's torch_metal_flash)

from torch_metal_flash import emulator
from torch_metal_flash.emulator.compiler import find_compiler

COMMON = """
struct S {
  float a[2];
  float get() const { return a[0]; }
  thread float& at(int i) { return a[i]; }
};
"""
# (name, Metal accepts it, code)
PROBES = [
    ("copy out of constant", True, "float f(constant S& s) { S t = s; return t.a[0]; }"),
    ("copy device object and back", True, "float f(device S& s) { S t = s; s = t; return t.a[1]; }"),
    ("member function for device this", True,
     "struct D { float a; float get() const device { return a; } };\nfloat f(device D* d) { return d->get(); }"),
    ("thread member returning thread ref", True, "float f() { S s{{1, 2}}; s.at(1) = 3; return s.a[1]; }"),
    ("template deduces the address space", True,
     "template <class T> T first(const T* p) { return p[0]; }\n"
     "float f(device float* p, threadgroup float* t) { return first(p) + first(t); }"),
    ("overloads by address space", True,
     "float g(device const float* p) { return p[0]; }\nfloat g(constant float* p) { return -p[0]; }\n"
     "float f(device float* a, constant float* b) { return g(a) + g(b); }"),
    ("partial specialisation by address space", True,
     "template <class P> struct elem;\ntemplate <class T> struct elem<device T*> { typedef T type; };\n"
     "template <class T> struct elem<constant T*> { typedef T type; };\n"
     "float f(device float* p) { elem<device float*>::type x = p[0]; return x; }"),
    ("program-scope constant", True, "constant float k = 2.0f;\nfloat f() { return k; }"),
    ("device reference to device reference", True, "float f(device float& r) { device float& q = r; return q; }"),
    ("device -> threadgroup pointer", False, "float f(device float* p) { threadgroup float* t = p; return *t; }"),
    ("device -> thread pointer", False, "float f(device float* p) { thread float* q = p; return *q; }"),
    ("constant -> device pointer", False, "float f(constant float* p) { device const float* q = p; return *q; }"),
    ("device argument for a thread parameter", False,
     "float g(thread const float* x) { return x[0]; }\nfloat f(device float* p) { return g(p); }"),
    ("thread member function on a device object", False, "float f(device S* s) { return s->get(); }"),
    ("program-scope variable outside constant", False, "float k = 2.0f;\nfloat f() { return k; }"),
    ("write through a constant pointer", False, "void f(constant float* p) { p[0] = 1.0f; }"),
]

CXX_ATTRS = ("#define device __attribute__((address_space(1)))\n#define constant __attribute__((address_space(2)))\n"
             "#define threadgroup __attribute__((address_space(3)))\n#define thread\n")
OPENCL = "#define device __global\n#define constant __constant\n#define threadgroup __local\n"
CONFIGS = {
    "c++ attrs": (["-x", "c++", "-std=c++17"], CXX_ATTRS + "#define thread\n"),
    "clc++": (["-x", "clcpp", "-cl-std=clc++2021", "-cl-no-stdinc"], OPENCL + "#define thread\n"),
    "clc++ no-generic": (["-x", "clcpp", "-cl-std=clc++2021", "-cl-no-stdinc", "-Xclang",
                          "-cl-ext=-__opencl_c_generic_address_space,-__opencl_c_pipes,"
                          "-__opencl_c_device_enqueue,-__opencl_c_program_scope_global_variables"],
                         OPENCL + "#define thread __private\n"),
}


def clang_accepts(flags: list, prelude: str, code: str) -> bool:
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "probe.cpp"
        src.write_text(prelude + COMMON + code + "\n")
        proc = subprocess.run(list(find_compiler().argv) + flags + ["-fsyntax-only", "-w", str(src)],
                              capture_output=True, text=True)
        return proc.returncode == 0


def emulator_accepts(code: str) -> bool:
    try:
        emulator.compile_shader("#include <metal_stdlib>\nusing namespace metal;\n" + COMMON + code + "\n",
                                name="probe.metal")
        return True
    except emulator.CompileError:
        return False


def main() -> None:
    columns = list(CONFIGS) + ["emulator"]
    score = dict.fromkeys(columns, 0)
    print(f"{'probe':42s} {'Metal':7s} " + " ".join(f"{c:>17s}" for c in columns))
    for name, metal, code in PROBES:
        cells = []
        for col in columns:
            got = emulator_accepts(code) if col == "emulator" else clang_accepts(*CONFIGS[col], code)
            score[col] += got == metal
            cells.append(("ok" if got == metal else "WRONG") + (" (accepts)" if got else " (rejects)"))
        print(f"{name:42s} {'accepts' if metal else 'rejects':7s} " + " ".join(f"{c:>17s}" for c in cells))
    print(f"{'matches Metal':50s} " + " ".join(f"{f'{score[c]}/{len(PROBES)}':>17s}" for c in columns))


if __name__ == "__main__":
    main()
