"""Kept import path (docs/security.md, scripts/checks/fuzz.py name it): since issue 46 the module is
``pooled_loader.vision.io.decode``, and this name is that same module object."""
import sys

from pooled_loader.vision.io import decode as _module

sys.modules[__name__] = _module
