"""Kept import path (loader.py, scripts/benchmarks name it): since issue 46 the module is
``pooled_loader.vision.torchvision.folder``, and this name is that same module object."""
import sys

from pooled_loader.vision.torchvision import folder as _module

sys.modules[__name__] = _module
