"""Kept import path (docs/vision.md name it): since issue 46 the module is
``pooled_loader.vision.detection.voc``, and this name is that same module object."""
import sys

from pooled_loader.vision.detection import voc as _module

sys.modules[__name__] = _module
