"""Our fused image ops as a Ray Data ``map_batches`` UDF: :func:`transform`.

``ds.map_batches(transform(t, seed=3), batch_size=256, batch_format="numpy")``
turns the readers' rows (``row_id``, ``epoch``, ``bytes``, ``label``, ``path``: see
``sources``) into one image array per batch. A torchvision v1/v2 ``Compose`` runs on the fused
folder path (``vision.torchvision.folder.FusedFolder`` fed the in-memory bytes instead of a
file): header, the fused ops' draws with the ops' own code, ROI decode, one crop/resize/flip/
normalize kernel writing straight into the batch's row, then the unfused rest as torchvision's
own ops. A row the fused path cannot make (a PNG, a JPEG our decoder refuses, a CenterCrop
larger than the image) is made as torchvision makes it, from ``Image.open(...).convert("RGB")``,
with the random state as it was before the fused draws; a transform that cannot be read (a
lambda, a first op with no fused equivalent) runs as it is on every row. A
``pooled_loader.vision.Compose`` runs as it is too, on the bytes when it starts with
``DecodeImage``, else on the decoded RGB array.

Randomness is per row: before a row's draws the global RNGs are seeded with
``seed_globals(sample_seed(seed, epoch, row_id))``, so a row gets the same pixels in any batch,
actor, process or retried task, and other pixels in another epoch.
"""
from __future__ import annotations

import copy
import copyreg
import io
import logging
import threading
import uuid
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from pooled_loader.core.errors import SampleError
from pooled_loader.core.seeds import sample_seed, seed_globals
from pooled_loader.vision.io.buffers import MAX_FILE_BYTES
from pooled_loader.vision.io.decode import DecodeImage
from pooled_loader.vision.torchvision import plan as tp
from pooled_loader.vision.torchvision.folder import (FusedFolder, _Fallback,
                                                     _preload_augment)

__all__ = ["transform", "PooledTransform", "MAX_IMAGE_BYTES"]

log = logging.getLogger("pooled_loader")

# The bound the folder path puts on an image file (read_file's), so the UDF refuses exactly
# the files a FusedFolder would; the readers refuse the same before reading.
MAX_IMAGE_BYTES = MAX_FILE_BYTES


def transform(t: Any, *, seed: int = 0, image_column: str = "bytes",
              label_column: str | None = "label", output_column: str = "image"
              ) -> "PooledTransform":
    """A UDF for ``Dataset.map_batches(udf, batch_size=..., batch_format="numpy")`` running
    ``t`` on each row's encoded image (see the module docstring).

    Ray runs it as tasks, in its long-lived worker processes: each process reads the plan and
    grows its buffers once (an unpickled copy is that process's one instance), and the read and
    the transform fuse into one task. Its class, ``type(udf)``, runs on actors instead
    (``map_batches(type(udf), concurrency=N)``), but Ray starts new actors at every execution,
    so every epoch (scripts/benchmarks/bench_ray.py: ~5 CPU-s an actor). A call returns every
    input column but ``image_column`` unchanged, plus ``output_column``: one
    ``[B, *sample_shape]`` array (float32 CHW for a ``ToTensor``/``Normalize`` recipe).
    ``label_column`` (None: the rows have none) is checked to be present and passed through."""
    if not callable(t):
        raise TypeError(f"transform: t must be a callable transform, got {type(t).__name__}")
    for name, value in (("image_column", image_column), ("output_column", output_column)):
        if not isinstance(value, str) or not value:
            raise TypeError(f"transform: {name} must be a column name, got {value!r}")
    if label_column is not None and label_column == output_column:
        raise ValueError(f"transform: output_column {output_column!r} is the label column")
    config = {"t": t, "seed": int(seed), "image_column": image_column,
              "label_column": label_column, "output_column": output_column,
              "token": uuid.uuid4().hex}
    return _make_class(config, announce=True)()


class _Meta(type):
    """The classes :func:`transform` returns: plain pickle rebuilds one from its arguments
    (cloudpickle, which Ray uses, copies such a class by value instead)."""


_CLASSES: "OrderedDict[str, type]" = OrderedDict()  # this process's classes, by token
_LIVE: "OrderedDict[str, PooledTransform]" = OrderedDict()  # its instances run as tasks
KEPT = 4  # transforms whose class and buffers a process keeps (least recently used go)


def _kept(cache: OrderedDict, key: str, make: Any) -> Any:
    value = cache.get(key)
    if value is None:
        value = cache[key] = make()
        while len(cache) > KEPT:
            cache.popitem(last=False)
    cache.move_to_end(key)
    return value


def _make_class(config: dict, announce: bool = False) -> type:
    def make() -> type:
        kind, plan, line = _read(config["t"])
        if announce and line:
            log.info("%s", line)
        return _Meta("PooledTransform", (PooledTransform,),
                     {"_config": config, "_kind": kind, "_plan": plan, "__module__": __name__})
    return _kept(_CLASSES, config["token"], make)


def _live(cls: type) -> "PooledTransform":
    """An instance unpickled in a Ray worker (a task's UDF): this process's one instance of its
    transform, so the plan is read and the buffers grown once per process, not per task."""
    return _kept(_LIVE, cls._config["token"], cls)


def _reduce_class(cls: type) -> Any:
    if vars(cls).get("_config") is None:
        return cls.__qualname__  # PooledTransform itself (or a subclass of one): by name
    return _make_class, (cls._config,)


copyreg.pickle(_Meta, _reduce_class)


def _read(t: Any) -> tuple[str, tp.Plan | None, str]:
    """("fused", the plan, its INFO line), ("pooled", None, "") for our own Compose, or
    ("as_is", None, the line saying why)."""
    from pooled_loader.vision.compose import Compose
    if isinstance(t, Compose):
        return "pooled", None, ""
    ops, why = tp.read_compose(t)
    plan = tp.read_plan(t, "pil") if ops is not None else None
    if plan is None:
        return "as_is", None, ("PooledLoader: the Ray transform runs as it is "
                               f"({why or 'its first op has no fused equivalent'})")
    d = plan.describe()
    return "fused", plan, ("PooledLoader: accelerated Ray transform: fused [{}]; as is [{}]{}"
                           .format(", ".join(d["fused"]), ", ".join(d["as_is"]),
                                   f" ({d['why_not_fused']})" if d["as_is"] else ""))


class PooledTransform(metaclass=_Meta):
    """The base of :func:`transform`'s classes; an instance holds one actor's buffers."""

    # set on the classes transform() makes (Ray's map_batches runs a subclass of the one given)
    _config: dict | None = None
    _kind: str = ""
    _plan: tp.Plan | None = None

    def __init__(self) -> None:
        if self._config is None:
            raise TypeError("PooledTransform is made by pooled_loader.ray.transform(t, ...)")
        c = self._config
        self._t = c["t"]
        self._seed = c["seed"]
        self._fused = FusedFolder(None, self._plan) if self._kind == "fused" else None
        # our own Compose keeps buffers in itself: one copy per instance
        self._compose = copy.deepcopy(self._t) if self._kind == "pooled" else None
        self._decodes = (self._compose is not None and bool(self._compose.ops)
                         and isinstance(self._compose.ops[0], DecodeImage))
        if self._plan is not None and any(s.kind == tp.AUGMENT for s in self._plan.steps):
            _preload_augment()
        self._shape: tuple | None = None  # (sample shape, dtype) of the last batch
        # per-row seeding of the global RNGs is only deterministic one batch at a time (an
        # actor given max_concurrency > 1 runs calls on threads)
        self._lock = threading.Lock()
        self.fallbacks = 0  # rows made by torchvision from a PIL image on the fused path

    def __reduce__(self) -> tuple:
        return _live, (type(self),)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The batch's images as one array in ``output_column``, the other columns as they
        are (see :func:`transform`)."""
        c = self._config
        image_column, output_column = c["image_column"], c["output_column"]
        need = ["row_id", "epoch", image_column] + \
            ([c["label_column"]] if c["label_column"] is not None else [])
        missing = [name for name in need if name not in batch]
        if missing:
            raise ValueError(f"pooled_loader.ray.transform: the batch has no column "
                             f"{missing[0]!r} (it has {sorted(batch)}); read the rows with "
                             "pooled_loader.ray's readers or name the columns in transform()")
        if output_column != image_column and output_column in batch:
            raise ValueError(f"pooled_loader.ray.transform: output_column {output_column!r} "
                             "is already a column of the batch; choose another name")
        result = {k: v for k, v in batch.items() if k != image_column}
        with self._lock:
            result[output_column] = self._images(batch[image_column], batch["row_id"],
                                                 batch["epoch"], batch.get("path"))
        return result

    # -- the rows

    def _images(self, images: np.ndarray, row_ids: np.ndarray, epochs: np.ndarray,
                paths: np.ndarray | None) -> np.ndarray:
        n = len(images)
        out = None if self._shape is None else np.empty((n, *self._shape[0]), self._shape[1])
        first = None  # the row id whose shape the batch has
        for i in range(n):
            row_id = int(row_ids[i])
            data = self._buffer(images[i], row_id, paths, i)
            seed_globals(sample_seed(self._seed, int(epochs[i]), row_id))
            dst = out[i] if out is not None else None
            made = self._row(data, dst, row_id, paths, i)
            if made is dst:
                first = row_id if first is None else first
                continue
            arr = _as_array(made, row_id)
            if out is None or (first is None and (arr.shape, arr.dtype) !=
                               (out.shape[1:], out.dtype)):
                out = np.empty((n, *arr.shape), arr.dtype)  # this batch's size, not the last's
                self._shape = (arr.shape, arr.dtype)
            elif (arr.shape, arr.dtype) != (out.shape[1:], out.dtype):
                raise ValueError(
                    f"pooled_loader.ray.transform: row {row_id} gives an image of shape "
                    f"{tuple(arr.shape)} ({arr.dtype}) but row {first} of the same batch gives "
                    f"{tuple(out.shape[1:])} ({out.dtype}); a batch is one array: crop or "
                    "resize every image to one size (e.g. RandomResizedCrop(224), or "
                    "Resize(256) then CenterCrop(224))")
            first = row_id if first is None else first
            out[i] = arr
        if out is None:  # an empty batch
            shape, dtype = self._shape if self._shape is not None else ((0,), np.float32)
            out = np.empty((0, *shape), dtype)
        return out

    def _row(self, data: np.ndarray, dst: np.ndarray | None, row_id: int,
             paths: np.ndarray | None, i: int) -> Any:
        """One row's image: ``dst`` itself when it was written there, else the image as the
        transform gives it (tensor, PIL image or array)."""
        try:
            if self._fused is not None:
                try:
                    return self._fused._image_from(data, dst)
                except _Fallback:  # the random state is back to before the fused draws
                    self.fallbacks += 1
            elif self._compose is not None:
                x = data if self._decodes else np.asarray(self._open(data, row_id, paths, i))
                return self._compose(x, out=dst)
        except SampleError as e:
            raise SampleError(f"{_where(row_id, paths, i)}: {e}") from e
        return self._t(self._open(data, row_id, paths, i))

    def _open(self, data: np.ndarray, row_id: int, paths: np.ndarray | None, i: int) -> Any:
        """torchvision's ``pil_loader`` on the row's bytes."""
        from PIL import Image
        try:
            with Image.open(io.BytesIO(data)) as im:
                return im.convert("RGB")
        except Exception as e:  # Pillow raises many kinds for a broken file
            raise SampleError(f"{_where(row_id, paths, i)}: cannot decode the image "
                              f"({type(e).__name__}: {e})") from e

    @staticmethod
    def _buffer(value: Any, row_id: int, paths: np.ndarray | None, i: int) -> np.ndarray:
        """The encoded file as a uint8 array viewing the column's memory (no copy), as
        ``read_file`` gives it to the folder path."""
        if isinstance(value, np.ndarray) and value.dtype == np.uint8 and value.ndim == 1:
            data = value
        else:
            try:
                data = np.frombuffer(value, np.uint8)  # bytes, np.bytes_, memoryview, ...
            except (TypeError, ValueError) as e:
                raise SampleError(f"{_where(row_id, paths, i)}: the image column holds "
                                  f"{type(value).__name__}, not encoded image bytes") from e
        if data.nbytes > MAX_IMAGE_BYTES:
            raise SampleError(f"{_where(row_id, paths, i)}: the encoded image is "
                              f"{data.nbytes} bytes, over the {MAX_IMAGE_BYTES}-byte limit")
        return data


def _where(row_id: int, paths: np.ndarray | None, i: int) -> str:
    return f"row {row_id}" if paths is None else f"row {row_id} ({paths[i]})"


def _as_array(x: Any, row_id: int) -> np.ndarray:
    """What the transform gave, as an array: a tensor's values, a PIL image's HWC pixels."""
    if isinstance(x, torch.Tensor):
        return x.as_subclass(torch.Tensor).detach().cpu().numpy()
    if isinstance(x, np.ndarray):
        return x
    if type(x).__module__.startswith("PIL."):
        return np.asarray(x)
    raise TypeError(f"pooled_loader.ray.transform: row {row_id}: the transform returned "
                    f"{type(x).__name__}; it must return one image (a tensor, an array or a "
                    "PIL image)")
