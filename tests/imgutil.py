"""Real test images: scikit-image's sample photos encoded with Pillow at chosen sizes/qualities."""
from __future__ import annotations

import io
import os
from functools import lru_cache

import numpy as np
from PIL import Image

PHOTOS = ("astronaut", "chelsea", "coffee")


@lru_cache(maxsize=None)
def photo(name: str) -> np.ndarray:
    """An RGB uint8 sample photo from skimage.data (read-only)."""
    import skimage.data

    a = np.ascontiguousarray(getattr(skimage.data, name)()[:, :, :3])
    a.setflags(write=False)
    return a


def rgb(name: str = "astronaut", size: tuple[int, int] | None = None) -> np.ndarray:
    """The photo resized (Pillow LANCZOS) to ``size = (width, height)``."""
    a = photo(name)
    if size is None or size == (a.shape[1], a.shape[0]):
        return a.copy()
    return np.asarray(Image.fromarray(a).resize(size, Image.LANCZOS))


def encode(img: np.ndarray, fmt: str = "JPEG", quality: int = 90, mode: str | None = None,
           **kw) -> bytes:
    """Encode an RGB array (optionally converted to ``mode``: "L", "CMYK", "RGBA", "P", ...)."""
    im = Image.fromarray(img)
    if mode is not None:
        im = im.convert(mode)
    buf = io.BytesIO()
    if fmt == "JPEG":
        kw.setdefault("quality", quality)
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def jpeg(name: str = "astronaut", size: tuple[int, int] | None = None, quality: int = 90,
         mode: str | None = None) -> bytes:
    """JPEG bytes of a sample photo at ``size = (width, height)``."""
    return encode(rgb(name, size), "JPEG", quality, mode)


def write(path: str, data: bytes) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    return path


def make_folder(root: str, n_per_class: int = 4, classes: tuple[str, ...] = ("cat", "dog"),
                sizes: tuple[tuple[int, int], ...] = ((320, 256), (256, 384), (500, 375),
                                                      (1200, 900), (2048, 1536))) -> list[str]:
    """A small ImageFolder of JPEGs of varied size (some large enough for DCT downscaling)."""
    paths = []
    k = 0
    for c in classes:
        for i in range(n_per_class):
            name = PHOTOS[k % len(PHOTOS)]
            size = sizes[k % len(sizes)]
            paths.append(write(os.path.join(root, c, f"{i:03d}.jpg"),
                               jpeg(name, size, quality=75 + 5 * (k % 4))))
            k += 1
    return paths


def assert_runs_as_torchvision(ds, accelerate: bool = True) -> None:
    """PooledLoader gives DataLoader's batches bit for bit (torchvision's own path: nothing
    fused, no ``transforms`` in its stats), in-process, from the same seed."""
    import torch
    from torch.utils.data import DataLoader

    from pooled_loader import PooledLoader
    kw = dict(batch_size=3, num_workers=0, shuffle=False)
    torch.manual_seed(0)
    want = list(DataLoader(ds, **kw))
    torch.manual_seed(0)
    loader = PooledLoader(ds, accelerate_transforms=accelerate, **kw)
    got = list(loader)
    assert len(got) == len(want)
    for (xa, ya), (xb, yb) in zip(want, got):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert "transforms" not in loader.stats()
