"""Ray Data: preprocessing on other machines, batches into the pinned pool, exact resume.

Install with ``pip install 'pooled_loader[ray]'``. Three pieces (docs/ray.md):

- readers with a stable row id: :func:`read_image_folder`, :func:`read_webdataset` (``sources``);
- :func:`transform`: our fused image ops as the ``map_batches`` UDF, on CPU nodes (``udf``);
- :func:`from_ray`: the trainer's ``PooledLoader`` over that pipeline, in an order the loader
  owns, resumable mid-epoch, on any number of ranks (``consume``, ``lineage``).
"""
from __future__ import annotations

try:
    import ray.data  # noqa: F401
except ModuleNotFoundError as _missing:
    raise ModuleNotFoundError(
        f"pooled_loader.ray needs Ray Data ({_missing.name} is not installed): "
        "pip install 'pooled-loader[ray]'", name=_missing.name) from _missing

from .consume import from_ray
from .sources import read_image_folder, read_webdataset
from .udf import transform

__all__ = ["from_ray", "read_image_folder", "read_webdataset", "transform"]
