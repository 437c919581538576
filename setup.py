"""Build the optional compiled kernels (pooled_loader.vision._kernels).

Package metadata lives in pyproject.toml; this file only adds the C extension.  The extension is
optional: where no compiler is available the install still succeeds and
pooled_loader.vision.kernels falls back to its OpenCV path.

Flags: -O3 and a portable x86-64 baseline; on x86-64 Linux/GCC the hot loops are also compiled
for AVX2 and picked at run time (target_clones), so one wheel runs on any x86-64 machine.
-ffp-contract=off keeps the results bit-identical between those clones (no FMA contraction).
POOLED_LOADER_MARCH=<arch> (e.g. "native") adds -march=<arch> for a local, non-portable build;
POOLED_LOADER_NO_BUILD_EXT=1 skips the extension entirely.
"""
import os
import sys

from setuptools import Extension, setup

ext_modules = []
if os.environ.get("POOLED_LOADER_NO_BUILD_EXT", "") not in ("1", "true", "yes"):
    extra_compile_args = []
    if sys.platform != "win32":
        extra_compile_args = ["-O3", "-std=c11", "-ffp-contract=off", "-fno-strict-aliasing",
                              "-Wall", "-Wno-unused-function"]
        march = os.environ.get("POOLED_LOADER_MARCH")
        if march:
            extra_compile_args.append(f"-march={march}")
    else:
        extra_compile_args = ["/O2"]
    ext_modules.append(
        Extension(
            "pooled_loader.vision._kernels",
            sources=["csrc/kernels.c"],
            extra_compile_args=extra_compile_args,
            extra_link_args=[] if sys.platform == "win32" else ["-pthread"],
            optional=True,
        )
    )

setup(ext_modules=ext_modules)
