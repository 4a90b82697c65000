"""What the compiled extension is made of: sources and flags, shared by every build of it.

Three builds read this module: ``setup.py`` (a wheel's prebuilt ``_C``), :mod:`.build` (the
build at first use against the running torch: the op core anywhere, the Metal launcher on
macOS) and ``bench/macos_cross_build.py`` (the launcher cross-compiled and linked on Linux,
which checks what a Mac builds).  It imports nothing from torch or the package: ``setup.py``
loads it by path, before torch may be importable.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

# The torch releases the package runs with (pyproject.toml declares the same range;
# tests/tooling/test_torch_range.py checks that they agree).
TORCH_OLDEST = (2, 10)
TORCH_NEWEST = (2, 15)
TORCH_REQUIREMENT = f"torch>={TORCH_OLDEST[0]}.{TORCH_OLDEST[1]},<{TORCH_NEWEST[0]}.{TORCH_NEWEST[1] + 1}"


def torch_minor(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string (``"2.15.0+cu132"`` -> ``(2, 15)``)."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"not a torch version: {version!r}")
    return int(match.group(1)), int(match.group(2))


def cxx_standard(cpp_extension_source: str) -> str:
    """The ``-std=`` flag that torch's ``cpp_extension`` gives an extension naming none.

    Read from that torch's own ``torch/utils/cpp_extension.py`` text, so each release
    builds with the standard its headers need (C++17 up to torch 2.11, C++20 since).
    """
    match = (re.search(r"cpp_flag\s*=\s*cpp_flag_prefix\s*\+\s*'(c\+\+\d+)'", cpp_extension_source)
             or re.search(r"'-fPIC',\s*'-std=(c\+\+\d+)'", cpp_extension_source))
    if match is None:
        raise LookupError("torch's cpp_extension.py names no default C++ standard")
    return f"-std={match.group(1)}"


@dataclass(frozen=True)
class Target:
    """One extension module: its name (``TORCH_EXTENSION_NAME``), sources relative to
    ``csrc/``, the compile flags beyond the standard and include folders, the link flags
    beyond torch's libraries."""

    module: str
    sources: tuple[str, ...]
    compile_flags: tuple[str, ...]
    link_flags: tuple[str, ...] = ()

    def source_paths(self, csrc: Path) -> list[Path]:
        return [csrc / s for s in self.sources]


# The libraries an extension links, as CppExtension links them.
TORCH_LIBRARIES = ("c10", "torch", "torch_cpu", "torch_python")
DEFINES = ("-DTORCH_API_INCLUDE_EXTENSION_H",)


def _core_sources(csrc: Path) -> list[str]:
    return sorted(f"core/{p.name}" for p in (csrc / "core").glob("*.cpp") if p.name != "module.cpp")


def core(csrc: Path) -> Target:
    """The C++ op core as a module of its own (no Metal encoder)."""
    return Target("_tmf_core", tuple(_core_sources(csrc) + ["core/module.cpp"]), ("-w",))


def launcher(csrc: Path) -> Target:
    """``torch_metal_flash._C``: the Metal launcher plus the op core it encodes for (macOS)."""
    return Target(
        "_C",
        tuple(["metal/launcher.mm"] + _core_sources(csrc)),
        ("-ObjC++", "-fobjc-arc",
         # a macOS 15 API outside @available, nil where Apple's headers say nonnull
         "-Werror=unguarded-availability-new", "-Werror=nonnull"),
        ("-framework", "Metal", "-framework", "Foundation"),
    )
