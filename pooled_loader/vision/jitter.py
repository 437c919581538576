"""Kept import path (scripts/benchmarks/bench_torchvision_swap.py names it): since issue 46 the
module is ``pooled_loader.vision.ops.jitter``, and this name is that same module object."""
import sys

from pooled_loader.vision.ops import jitter as _module

sys.modules[__name__] = _module
