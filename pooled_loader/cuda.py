"""Public import path: re-exports ``pooled_loader.engine.cuda``, where this module lives since the
regroup (issue 41)."""
from __future__ import annotations

from .engine.cuda import (CUDA_HOST_REGISTER_PORTABLE, CudaBackend, backend_for, pin_pool,
                          record_stream, map_tensors, DeviceIter, NormalizeImages)  # noqa: F401
