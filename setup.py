"""Build: the Objective-C++ Metal launcher (torch_metal_flash._C) on macOS only.

Elsewhere the package installs as pure Python: the reference backend and the
emulator (which compiles the shipped .metal sources with clang at run time).
The shaders and the emulator's C++ runtime ship as package data, from the
repo's shaders/ and csrc/ folders.
"""
import os
import sys

from setuptools import find_packages, setup

PACKAGE_DATA_DIRS = {name: folder for name, folder in
                     {"torch_metal_flash.shaders": "shaders", "torch_metal_flash._csrc": "csrc"}.items()
                     if os.path.isdir(folder)}


def ext_modules():
    if sys.platform != "darwin":
        return [], {}
    import torch
    if not torch.backends.mps.is_built():
        return [], {}
    from torch.utils.cpp_extension import BuildExtension, CppExtension
    # The Metal launcher plus the C++ op core it is the Metal encoder of (csrc/core/module.cpp is
    # the core's own module for builds without Metal; torch_metal_flash/_core_build.py).
    core = sorted(os.path.join("csrc", "core", f) for f in os.listdir(os.path.join("csrc", "core"))
                  if f.endswith(".cpp") and f != "module.cpp")
    ext = CppExtension(
        "torch_metal_flash._C",
        sources=["csrc/metal/launcher.mm"] + core,
        extra_compile_args={"cxx": ["-std=c++17", "-ObjC++", "-fobjc-arc"]},
        extra_link_args=["-framework", "Metal", "-framework", "Foundation"],
    )
    return [ext], {"build_ext": BuildExtension}


modules, cmdclass = ext_modules()
setup(
    packages=find_packages(include=["torch_metal_flash", "torch_metal_flash.*"]) + list(PACKAGE_DATA_DIRS),
    package_dir={name: folder for name, folder in PACKAGE_DATA_DIRS.items()},
    package_data={
        "torch_metal_flash.shaders": ["*.metal", "*.h"],
        "torch_metal_flash._csrc": ["**/*"],
    },
    ext_modules=modules,
    cmdclass=cmdclass,
)
