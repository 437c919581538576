"""Unchanged torchvision pipelines on the fused paths: a torchvision ``Compose`` (and the dataset
around it) read into our ops, with the random parameters drawn from the RNG torchvision draws
from, call for call.

- ``table``: the one table of torchvision ops we translate (classification and detection read
  it) and the rule for which resizes resample as our kernels do;
- ``plan``: ``read_plan`` (a classification ``Compose`` into fused steps) and ``Draws`` (torch's
  draws, on reused tensors);
- ``folder``: ``FusedFolder``, a torchvision ``ImageFolder`` + ``Compose`` on the fused path;
- ``detection``: a wrapped torchvision ``CocoDetection``/``VOCDetection`` as our detection
  datasets (``accelerate_detection``);
- ``detection_fused``: ``FusedDetection``, the same with torchvision's output types.

torchvision is imported only inside functions, where a caller already imported it (torch at the
top). Imports: core/ and every other part of vision/; nothing of vision/ imports this package.
Nothing is imported here: import the module you need.
"""
__all__ = ["detection", "detection_fused", "folder", "plan", "table"]
