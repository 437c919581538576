"""Kept import path (scripts/benchmarks name it): since issue 46 the module is
``pooled_loader.vision.io.buffers``, and this name is that same module object."""
import sys

from pooled_loader.vision.io import buffers as _module

sys.modules[__name__] = _module
