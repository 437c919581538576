"""Kept import path (docs/vision.md, loader.py name it): since issue 46 the module is
``pooled_loader.vision.torchvision.detection_fused``, and this name is that same module object."""
import sys

from pooled_loader.vision.torchvision import detection_fused as _module

sys.modules[__name__] = _module
