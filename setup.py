"""Build the optional compiled kernels (pooled_loader.vision._kernels).

Package metadata lives in pyproject.toml; this file only adds the C extension.  The extension is
optional: where no compiler is available the install still succeeds and
pooled_loader.vision.kernels falls back to its OpenCV path.

Flags: -O3 and a portable x86-64 baseline; on x86-64 Linux/GCC the hot loops are also compiled
for AVX2 and picked at run time (target_clones), so one wheel runs on any x86-64 machine.
-ffp-contract=off keeps the results bit-identical between those clones (no FMA contraction).
POOLED_LOADER_MARCH=<arch> (e.g. "native") adds -march=<arch> for a local, non-portable build;
POOLED_LOADER_NO_BUILD_EXT=1 skips the extensions entirely.

A second optional extension, pooled_loader.vision._jpeg (csrc/jpeg_roi.c), decodes only the crop
of a JPEG with the system libjpeg-turbo.  It is built only where jpeglib.h is found (Debian/Ubuntu:
libjpeg62-turbo-dev or libjpeg-turbo8-dev; Fedora: libjpeg-turbo-devel), in the default include
directories or in POOLED_LOADER_JPEG_PREFIX/include (library in .../lib); without it the install
still succeeds and JPEGs are decoded whole by simplejpeg.  POOLED_LOADER_NO_JPEG_EXT=1 skips it.
"""
import os
import sys
import sysconfig

from setuptools import Extension, setup

_OFF = ("1", "true", "yes")


def _jpeg_dirs():
    """(include_dirs, library_dirs) holding jpeglib.h and libjpeg, or None when it is absent."""
    prefix = os.environ.get("POOLED_LOADER_JPEG_PREFIX")
    if prefix:
        candidates = [(os.path.join(prefix, "include"), os.path.join(prefix, "lib"))]
    else:
        candidates = [(d, None) for d in ("/usr/include", "/usr/local/include",
                                          "/opt/homebrew/include", sysconfig.get_path("include"))]
        conda = os.environ.get("CONDA_PREFIX")
        if conda:
            candidates.append((os.path.join(conda, "include"), os.path.join(conda, "lib")))
    for inc, lib in candidates:
        if inc and os.path.exists(os.path.join(inc, "jpeglib.h")):
            return [inc], [lib] if lib else []
    return None


ext_modules = []
if os.environ.get("POOLED_LOADER_NO_BUILD_EXT", "") not in _OFF:
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
            sources=["csrc/kernels.c"],  # one translation unit: it #includes the files below
            depends=["csrc/kernels_common.h", "csrc/resize.c", "csrc/resize_passes.c",
                     "csrc/jitter.c"],
            extra_compile_args=extra_compile_args,
            extra_link_args=[] if sys.platform == "win32" else ["-pthread"],
            optional=True,
        )
    )
    jpeg = None if os.environ.get("POOLED_LOADER_NO_JPEG_EXT", "") in _OFF else _jpeg_dirs()
    if jpeg is not None and sys.platform != "win32":
        ext_modules.append(
            Extension(
                "pooled_loader.vision._jpeg",
                sources=["csrc/jpeg_roi.c"],
                include_dirs=jpeg[0],
                library_dirs=jpeg[1],
                libraries=["jpeg"],
                extra_compile_args=["-O2", "-std=c11", "-Wall"],
                optional=True,
            )
        )

setup(ext_modules=ext_modules)
