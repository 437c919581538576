"""Small local datasets written with third-party libraries' own writers (litdata,
mosaicml-streaming), for the tests that run them through PooledLoader; nothing is downloaded."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
import types

import numpy as np


def write_litdata(root: str, n: int, chunk_size: int = 16) -> str:
    """`n` items {"index": i, "x": float32[3]} with litdata's own chunk writer."""
    from litdata.streaming.writer import BinaryWriter
    writer = BinaryWriter(root, chunk_size=chunk_size)
    for i in range(n):
        writer.add_item(i, {"index": i, "x": np.full(3, i, dtype=np.float32)})
    writer.done()
    writer.merge()
    return root


@functools.lru_cache(maxsize=None)
def streaming_modules() -> tuple[type, type]:
    """mosaicml-streaming's (StreamingDataset, MDSWriter).

    ``import streaming`` imports its vision datasets (torchvision) and its StreamingDataLoader
    (transformers < 5) at the top level; neither is installed in the test environment (a
    torchvision wheel would replace the CPU torch). The dataset and the writer need neither, so
    when the package's top level cannot be imported they are imported from its installed files
    with the two package ``__init__``s passed over (the modules themselves are the library's)."""
    try:
        streaming = importlib.import_module("streaming")
        return streaming.StreamingDataset, streaming.MDSWriter
    except ImportError:
        pass
    spec = importlib.util.find_spec("streaming")
    if spec is None or spec.origin is None:
        raise ImportError("mosaicml-streaming is not installed (see .ci/run)")
    root = os.path.dirname(spec.origin)
    for name in [m for m in sys.modules if m == "streaming" or m.startswith("streaming.")]:
        del sys.modules[name]  # the half-imported package of the failed attempt
    for name, path in (("streaming", root), ("streaming.base", os.path.join(root, "base"))):
        package = types.ModuleType(name)
        package.__path__ = [path]
        sys.modules[name] = package
    dataset = importlib.import_module("streaming.base.dataset")
    writer = importlib.import_module("streaming.base.format.mds.writer")
    return dataset.StreamingDataset, writer.MDSWriter


def write_mds(root: str, n: int) -> str:
    """`n` items {"index": i, "x": float32[3]} with mosaicml-streaming's MDSWriter."""
    _, writer_cls = streaming_modules()
    with writer_cls(out=root, columns={"index": "int", "x": "ndarray:float32:3"},
                    size_limit=1 << 10) as writer:
        for i in range(n):
            writer.write({"index": i, "x": np.full(3, i, dtype=np.float32)})
    return root
