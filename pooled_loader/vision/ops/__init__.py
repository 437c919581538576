"""The image ops and the contract they follow: each declares its output (``spec``), draws its
random parameters (``draw``) and writes into a given buffer (``apply``).

- ``crop_box``: RandomResizedCrop's box and its centre fallback, written once for every random
  source that draws them (Python's ``random``, torch's generator, timm's rule);
- ``geometry``: ``Resampler`` (the resizing ops' base), ``RandomResizedCrop``, ``Resize``,
  ``RandomHorizontalFlip``, ``CenterCrop``, ``ToCHW``, ``Normalize``;
- ``jitter``: Pillow-exact colour jitter on uint8 CHW images (the torchvision path's).

Imports: numpy, vision/base.py (the contract: ``Spec``, ``Op``, ``Box``) and vision/io/; nothing
above. Exports the ops and the contract (``__all__``), as the module ``pooled_loader.vision.ops``
did before it became this package.
"""
from pooled_loader.vision.base import Box, Op, Size, Spec
from pooled_loader.vision.ops.geometry import (CenterCrop, Normalize, RandomHorizontalFlip,
                                               RandomResizedCrop, Resampler, Resize, ToCHW)

__all__ = ["Box", "Op", "Resampler", "Size", "Spec", "CenterCrop", "Normalize",
           "RandomHorizontalFlip", "RandomResizedCrop", "Resize", "ToCHW"]
