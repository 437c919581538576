#!/usr/bin/env python
"""The peer image loaders, each behind one function, for scripts/benchmarks/bench_images.py.

Every loader does the same work on the same ImageFolder of JPEGs: decode, RandomResizedCrop to
224x224 (scale 0.08..1, ratio 3/4..4/3), random horizontal flip, uint8 CHW, batches of `batch`
(the last one partial), with `workers` worker processes / threads.

Each ``run_<name>(data_dir, batch=256, workers=2, epochs=3, warmup=1) -> list[float]`` builds its
loader once, runs `warmup` untimed epochs (JIT, page cache, worker start-up), then returns the
images/s of each of `epochs` timed epochs.  An epoch is timed from asking for the first batch to
the loader being exhausted; the consumer does nothing with the batches.  A function whose library
is missing raises ``PeerUnavailable`` with the install command.

    torch_pil      torch DataLoader + Pillow, the torchvision ImageFolder/RandomResizedCrop recipe
                   re-implemented with PIL (torchvision does not exist for this torch);
                   persistent workers, so the epoch does not include forking them
    torch_decode_jpeg  torch DataLoader with torchvision's fast uint8 recipe: file bytes,
                   torchvision.io.decode_jpeg, v2 RandomResizedCrop + RandomHorizontalFlip on
                   uint8 tensors (what a well-informed DataLoader user runs)
    webdataset     webdataset.WebLoader over tar shards of the same JPEGs, same PIL decode + aug
    dali           NVIDIA DALI CPU pipeline (device_id=None): readers.file, decoders.image(cpu),
                   random_resized_crop(224), crop_mirror_normalize(uint8, CHW, mirror=coin)
    dali_fused     DALI with the fused ROI decode: decoders.image_random_crop + resize(224)
    ffcv_jpg       FFCV 1.0 .beton in JPEG mode (max side 512, re-encoded at quality 90),
                   RandomResizedCropRGBImageDecoder + RandomHorizontalFlip + ToTensor +
                   ToTorchImage(channels_last=False), OrderOption.RANDOM
    ffcv_raw       the same from a RAW (pre-decoded, max side 512) .beton
    ceiling        no loader: simplejpeg (libjpeg-turbo, fastdct + fastupsample) full decode +
                   cv2.resize of the crop + flip + CHW into a reused batch, a plain loop on one
                   core, images/s multiplied by the number of usable cores
    ceiling_dct    the same, but decoding at the smallest DCT scale (1/2, 1/4, 1/8) that keeps
                   the crop >= 224 on both sides (what a loader that downsizes in the DCT can do)
    ours           pooled_loader.PooledLoader over pooled_loader.vision.ImageFolder (persistent
                   workers, like torch_pil)
    ours_cached    PooledLoader over pooled_loader.cache.CachedDataset (decoded once, max side
                   512; built next to the dataset on first use, untimed): the FFCV RAW counterpart

Run one peer by itself (prints a JSON line): ``python scripts/benchmarks/peers.py NAME --data DIR``.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import os
import random
import sys
import time
from typing import Callable, Iterable

import numpy as np

SIZE = 224
SCALE = (0.08, 1.0)
RATIO = (3.0 / 4.0, 4.0 / 3.0)
IMG_EXTS = (".jpg", ".jpeg", ".JPG", ".JPEG")


class PeerUnavailable(RuntimeError):
    """The peer's library is not installed or cannot run here (the message says why)."""


# --------------------------------------------------------------------------------------------
# shared helpers


def list_images(data_dir: str) -> tuple[list[str], list[int], list[str]]:
    """(paths, labels, class names) of an ImageFolder, in torchvision's order."""
    classes = sorted(e.name for e in os.scandir(data_dir) if e.is_dir())
    if not classes:
        raise FileNotFoundError(f"no class folders in {data_dir}")
    paths, labels = [], []
    for ci, c in enumerate(classes):
        for dirpath, _, files in sorted(os.walk(os.path.join(data_dir, c), followlinks=True)):
            for f in sorted(files):
                if f.endswith(IMG_EXTS):
                    paths.append(os.path.join(dirpath, f))
                    labels.append(ci)
    if not paths:
        raise FileNotFoundError(f"no JPEGs under {data_dir}")
    return paths, labels, classes


def _fingerprint(paths: list[str]) -> str:
    h = hashlib.sha1()
    for p in paths:
        st = os.stat(p)
        h.update(f"{p}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:12]


def _cache_dir(data_dir: str, kind: str) -> str:
    """Derived data (tar shards, .beton files) lives next to the dataset: DIR.<kind>/"""
    d = os.path.abspath(data_dir).rstrip(os.sep) + "." + kind
    os.makedirs(d, exist_ok=True)
    return d


def rrc_params(width: int, height: int, rand: Callable[[], float],
               randint: Callable[[int, int], int]) -> tuple[int, int, int, int]:
    """torchvision RandomResizedCrop.get_params: (top, left, h, w) of the crop box."""
    area = height * width
    log_ratio = (math.log(RATIO[0]), math.log(RATIO[1]))
    for _ in range(10):
        target_area = area * (SCALE[0] + (SCALE[1] - SCALE[0]) * rand())
        aspect_ratio = math.exp(log_ratio[0] + (log_ratio[1] - log_ratio[0]) * rand())
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            i = randint(0, height - h)
            j = randint(0, width - w)
            return i, j, h, w
    # fallback to a central crop
    in_ratio = float(width) / float(height)
    if in_ratio < min(RATIO):
        w = width
        h = int(round(w / min(RATIO)))
    elif in_ratio > max(RATIO):
        h = height
        w = int(round(h * max(RATIO)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def _torch_rand() -> float:
    import torch
    return float(torch.rand(1))


def _torch_randint(lo: int, hi: int) -> int:  # inclusive, as torchvision's randint(lo, hi + 1)
    import torch
    return int(torch.randint(lo, hi + 1, size=(1,)))


def pil_augment(img):
    """torchvision RandomResizedCrop(224) + RandomHorizontalFlip + PILToTensor, with PIL.

    Crop + resize is one PIL ``resize(..., BILINEAR, box=...)`` (what torchvision's PIL path
    does as crop() then resize()).  Randomness from torch's generator, as torchvision does, so
    DataLoader's per-worker seeding applies.
    """
    import torch
    from PIL import Image

    width, height = img.size
    i, j, h, w = rrc_params(width, height, _torch_rand, _torch_randint)
    img = img.resize((SIZE, SIZE), Image.BILINEAR, box=(j, i, j + w, i + h))
    if torch.rand(1) < 0.5:
        img = img.transpose(Image.FLIP_LEFT_RIGHT)
    arr = np.array(img, copy=True)  # HWC uint8
    return torch.from_numpy(arr).permute(2, 0, 1)  # CHW view; default_collate stacks it


def pil_load(path_or_file):
    from PIL import Image

    with Image.open(path_or_file) as im:
        return im.convert("RGB")


def _images(batch):
    """The image tensor of a batch: (images, labels), [{"images": ...}] (DALI) or an array."""
    while isinstance(batch, (list, tuple)):
        batch = batch[0]
    if isinstance(batch, dict):
        batch = batch["images"] if "images" in batch else next(iter(batch.values()))
    return batch


def _nimages(batch) -> int:
    return int(_images(batch).shape[0])


def check_batch(batch) -> None:
    """Every loader must hand out uint8 CHW 224x224 images; fail loudly if one does not."""
    x = _images(batch)
    shape, dtype = tuple(x.shape[1:]), str(x.dtype)
    if shape != (3, SIZE, SIZE) or "uint8" not in dtype:
        raise RuntimeError(f"batch images are {dtype} {tuple(x.shape)}, "
                           f"expected uint8 (N, 3, {SIZE}, {SIZE})")


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def tree_cpu_seconds(pid: int | None = None) -> float | None:
    """user+system CPU seconds of this process, its threads and all its live descendants (plus
    children it has reaped), from /proc; None where /proc is not there (not Linux)."""
    pid = os.getpid() if pid is None else pid
    try:
        names = os.listdir("/proc")
    except OSError:
        return None
    stats = {}
    for d in names:
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                raw = f.read().decode("ascii", "replace")
        except OSError:
            continue
        fields = raw[raw.rfind(")") + 2:].split()  # after "pid (comm) "
        # fields[1] = ppid; [11], [12] = utime, stime; [13], [14] = cutime, cstime
        stats[int(d)] = (int(fields[1]), int(fields[11]) + int(fields[12]),
                         int(fields[13]) + int(fields[14]))
    if pid not in stats:
        return None
    kids: dict[int, list[int]] = {}
    for p, (pp, _, _) in stats.items():
        kids.setdefault(pp, []).append(p)
    total, todo = stats[pid][2], [pid]  # reaped children's time counts once, at the root
    while todo:
        p = todo.pop()
        total += stats[p][1]
        todo.extend(kids.get(p, ()))
    return total / _CLK_TCK


# Filled by time_epochs: per timed epoch, wall seconds, images, CPU seconds of the process tree.
LAST_STATS: dict = {}


def time_epochs(iterate: Callable[[], Iterable], epochs: int, warmup: int,
                count: Callable = _nimages, expect: int | None = None) -> list[float]:
    """Run warmup + epochs epochs of iterate(); images/s of the timed ones.

    Also records, in LAST_STATS, the CPU seconds the whole process tree (main process, its
    threads, worker processes) spent in each timed epoch: images per CPU-second does not depend
    much on other jobs sharing the machine, when wall-clock images/s does.
    """
    rates, walls, cpus, counts = [], [], [], []
    for e in range(warmup + epochs):
        n = 0
        c0 = tree_cpu_seconds()
        t0 = time.perf_counter()
        for batch in iterate():
            if e == 0 and n == 0:
                check_batch(batch)
            n += count(batch)
        dt = time.perf_counter() - t0
        c1 = tree_cpu_seconds()
        if expect is not None and n != expect:
            raise RuntimeError(f"epoch {e} saw {n} images, expected {expect}")
        if e >= warmup:
            rates.append(n / dt)
            walls.append(dt)
            counts.append(n)
            cpus.append(None if c0 is None or c1 is None else c1 - c0)
    LAST_STATS.clear()
    LAST_STATS.update(wall_s=walls, images=counts, cpu_s=cpus)
    return rates


# --------------------------------------------------------------------------------------------
# torch DataLoader + Pillow


class _PILFolder:
    """torchvision.datasets.ImageFolder + the transform above (map-style Dataset)."""

    def __init__(self, data_dir: str):
        self.paths, self.labels, self.classes = list_images(data_dir)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        return pil_augment(pil_load(self.paths[i])), self.labels[i]


def run_torch_pil(data_dir: str, batch: int = 256, workers: int = 2, epochs: int = 3,
                  warmup: int = 1) -> list[float]:
    try:
        import torch
        from torch.utils.data import DataLoader
        import PIL  # noqa: F401
    except ImportError as e:
        raise PeerUnavailable(f"torch DataLoader + Pillow needs torch and pillow ({e})") from e
    return _time_dataloader(DataLoader, _PILFolder(data_dir), batch, workers, epochs, warmup)


def _time_dataloader(loader_cls, ds, batch: int, workers: int, epochs: int,
                     warmup: int) -> list[float]:
    """images/s of a DataLoader over ``ds`` (shuffled, persistent workers)."""
    dl = loader_cls(ds, batch_size=batch, shuffle=True, num_workers=workers,
                    persistent_workers=workers > 0, drop_last=False)
    try:
        return time_epochs(lambda: dl, epochs, warmup, expect=len(ds))
    finally:
        del dl


class _DecodeJpegFolder:
    """The ImageFolder's files through torchvision.io.decode_jpeg and v2 ops on uint8 tensors."""

    def __init__(self, data_dir: str):
        from torchvision.transforms import v2
        self.paths, self.labels, self.classes = list_images(data_dir)
        self.transform = v2.Compose([v2.RandomResizedCrop(SIZE, scale=SCALE, ratio=RATIO),
                                     v2.RandomHorizontalFlip()])

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        from torchvision.io import ImageReadMode, decode_jpeg, read_file
        image = decode_jpeg(read_file(self.paths[i]), mode=ImageReadMode.RGB)
        return self.transform(image), self.labels[i]


def run_torch_decode_jpeg(data_dir: str, batch: int = 256, workers: int = 2, epochs: int = 3,
                          warmup: int = 1) -> list[float]:
    try:
        from torch.utils.data import DataLoader
        import torchvision.io  # noqa: F401
    except (ImportError, RuntimeError) as e:
        raise PeerUnavailable(f"torchvision's decode_jpeg recipe needs a torchvision that "
                              f"imports with this torch (pip install torchvision) ({e})") from e
    return _time_dataloader(DataLoader, _DecodeJpegFolder(data_dir), batch, workers, epochs,
                            warmup)


# --------------------------------------------------------------------------------------------
# webdataset.WebLoader


def make_shards(data_dir: str, shard_size: int = 250) -> list[str]:
    """Tar shards of the ImageFolder (jpg bytes + cls), written once next to the dataset."""
    import webdataset as wds

    paths, labels, _ = list_images(data_dir)
    out = os.path.join(_cache_dir(data_dir, "wds"), _fingerprint(paths))
    done = os.path.join(out, "DONE")
    if not os.path.exists(done):
        os.makedirs(out, exist_ok=True)
        order = list(range(len(paths)))
        random.Random(0).shuffle(order)  # shards mix classes, as real shards do
        with wds.ShardWriter(os.path.join(out, "shard-%06d.tar"), maxcount=shard_size,
                             verbose=0) as sink:
            for k in order:
                with open(paths[k], "rb") as f:
                    sink.write({"__key__": f"{k:08d}", "jpg": f.read(), "cls": labels[k]})
        with open(done, "w") as f:
            f.write(str(len(paths)))
    return sorted(os.path.join(out, f) for f in os.listdir(out) if f.endswith(".tar"))


def _wds_sample(sample):
    return pil_augment(pil_load(io.BytesIO(sample["jpg"]))), int(sample["cls"])


def run_webdataset(data_dir: str, batch: int = 256, workers: int = 2, epochs: int = 3,
                   warmup: int = 1) -> list[float]:
    try:
        import torch  # noqa: F401
        import webdataset as wds
    except ImportError as e:
        raise PeerUnavailable(f"webdataset is not installed: pip install webdataset ({e})") from e
    shards = make_shards(data_dir)
    n = len(list_images(data_dir)[0])
    # The canonical WebLoader recipe: shuffle shards, shuffle samples in a buffer, decode + augment
    # in the workers, batch in the workers (partial last batch per worker), batch_size=None.
    ds = (wds.WebDataset(shards, shardshuffle=len(shards), empty_check=False)
          .shuffle(1000)
          .map(_wds_sample)
          .batched(batch, partial=True))
    dl = wds.WebLoader(ds, batch_size=None, num_workers=workers,
                       persistent_workers=workers > 0)
    return time_epochs(lambda: dl, epochs, warmup, expect=n)


# --------------------------------------------------------------------------------------------
# NVIDIA DALI (CPU pipeline)


def _dali_pipe(data_dir: str, batch: int, workers: int, fused: bool, seed: int = 0):
    try:
        from nvidia.dali import fn, pipeline_def, types
    except ImportError as e:
        raise PeerUnavailable(
            f"NVIDIA DALI is not installed: pip install nvidia-dali-cuda120 ({e})") from e

    @pipeline_def(batch_size=batch, num_threads=workers, device_id=None, seed=seed,
                  prefetch_queue_depth=2)
    def pipe():
        jpegs, labels = fn.readers.file(file_root=data_dir, random_shuffle=True,
                                        name="Reader")
        if fused:
            images = fn.decoders.image_random_crop(
                jpegs, device="cpu", output_type=types.RGB,
                random_area=list(SCALE), random_aspect_ratio=list(RATIO))
            images = fn.resize(images, resize_x=SIZE, resize_y=SIZE)
        else:
            images = fn.decoders.image(jpegs, device="cpu", output_type=types.RGB)
            images = fn.random_resized_crop(images, size=[SIZE, SIZE],
                                            random_area=list(SCALE),
                                            random_aspect_ratio=list(RATIO))
        images = fn.crop_mirror_normalize(images, dtype=types.UINT8, output_layout="CHW",
                                          mirror=fn.random.coin_flip(probability=0.5))
        return images, labels

    return pipe()


def _run_dali(data_dir, batch, workers, epochs, warmup, fused) -> list[float]:
    p = _dali_pipe(data_dir, batch, workers, fused)
    try:
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy
    except ImportError as e:
        raise PeerUnavailable(f"DALI's PyTorch plugin failed to import ({e})") from e
    p.build()
    it = DALIGenericIterator([p], ["images", "labels"], reader_name="Reader",
                             last_batch_policy=LastBatchPolicy.PARTIAL, auto_reset=True)
    n = len(list_images(data_dir)[0])
    try:
        return time_epochs(lambda: it, epochs, warmup, expect=n)
    finally:
        del it, p


def run_dali(data_dir: str, batch: int = 256, workers: int = 2, epochs: int = 3,
             warmup: int = 1) -> list[float]:
    return _run_dali(data_dir, batch, workers, epochs, warmup, fused=False)


def run_dali_fused(data_dir: str, batch: int = 256, workers: int = 2, epochs: int = 3,
                   warmup: int = 1) -> list[float]:
    return _run_dali(data_dir, batch, workers, epochs, warmup, fused=True)


# --------------------------------------------------------------------------------------------
# FFCV


def _ffcv_imports():
    try:
        from ffcv.fields import IntField, RGBImageField  # noqa: F401
        from ffcv.loader import Loader, OrderOption  # noqa: F401
    except ImportError as e:
        raise PeerUnavailable(
            "FFCV is not installed: apt-get install libturbojpeg0-dev libopencv-dev pkg-config; "
            "pip install numba opencv-python-headless pillow; "
            f"pip install --no-build-isolation ffcv ({e})") from e


class _FolderForWriter:
    def __init__(self, data_dir):
        self.paths, self.labels, _ = list_images(data_dir)

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        return pil_load(self.paths[i]), self.labels[i]


def make_beton(data_dir: str, mode: str = "jpg", max_side: int = 512, workers: int = 2) -> str:
    """Write DIR.ffcv/<fingerprint>-<mode><max_side>.beton once; return its path."""
    _ffcv_imports()
    from ffcv.fields import IntField, RGBImageField
    from ffcv.writer import DatasetWriter

    ds = _FolderForWriter(data_dir)
    out = os.path.join(_cache_dir(data_dir, "ffcv"),
                       f"{_fingerprint(ds.paths)}-{mode}{max_side}.beton")
    if not os.path.exists(out):
        tmp = out + ".tmp"
        field = RGBImageField(write_mode=mode, max_resolution=max_side, jpeg_quality=90)
        DatasetWriter(tmp, {"image": field, "label": IntField()}, num_workers=workers)\
            .from_indexed_dataset(ds)
        os.replace(tmp, out)
    return out


def _run_ffcv(data_dir, batch, workers, epochs, warmup, mode) -> list[float]:
    _ffcv_imports()
    from ffcv.fields.basics import IntDecoder
    from ffcv.fields.rgb_image import RandomResizedCropRGBImageDecoder
    from ffcv.loader import Loader, OrderOption
    from ffcv.transforms import RandomHorizontalFlip, ToTensor, ToTorchImage

    path = make_beton(data_dir, mode=mode, max_side=512, workers=workers)
    loader = Loader(
        path, batch_size=batch, num_workers=workers, order=OrderOption.RANDOM, os_cache=True,
        drop_last=False,
        pipelines={
            "image": [RandomResizedCropRGBImageDecoder((SIZE, SIZE), scale=SCALE, ratio=RATIO),
                      RandomHorizontalFlip(), ToTensor(), ToTorchImage(channels_last=False)],
            "label": [IntDecoder(), ToTensor()],
        })
    n = len(list_images(data_dir)[0])
    return time_epochs(lambda: loader, epochs, warmup, expect=n)


def run_ffcv_jpg(data_dir: str, batch: int = 256, workers: int = 2, epochs: int = 3,
                 warmup: int = 1) -> list[float]:
    return _run_ffcv(data_dir, batch, workers, epochs, warmup, mode="jpg")


def run_ffcv_raw(data_dir: str, batch: int = 256, workers: int = 2, epochs: int = 3,
                 warmup: int = 1) -> list[float]:
    return _run_ffcv(data_dir, batch, workers, epochs, warmup, mode="raw")


# --------------------------------------------------------------------------------------------
# the no-loader ceiling


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _run_ceiling(data_dir, batch, workers, epochs, warmup, dct) -> list[float]:
    try:
        import cv2
        import simplejpeg
    except ImportError as e:
        raise PeerUnavailable(f"the ceiling needs simplejpeg and opencv ({e})") from e
    paths, _, _ = list_images(data_dir)
    rng = random.Random(0)
    out = np.empty((batch, 3, SIZE, SIZE), np.uint8)
    resized = np.empty((SIZE, SIZE, 3), np.uint8)
    cv2.setNumThreads(1)

    def epoch():
        order = list(range(len(paths)))
        rng.shuffle(order)
        k = 0
        for idx in order:
            with open(paths[idx], "rb") as f:
                data = f.read()
            if dct:
                h0, w0 = simplejpeg.decode_jpeg_header(data)[:2]
                i, j, h, w = rrc_params(w0, h0, rng.random, rng.randint)
                # smallest decode that keeps the crop >= SIZE on both sides
                s = max(SIZE / w, SIZE / h)
                img = simplejpeg.decode_jpeg(data, colorspace="RGB", fastdct=True,
                                             fastupsample=True, min_factor=2,
                                             min_width=math.ceil(w0 * s),
                                             min_height=math.ceil(h0 * s))
                fy, fx = img.shape[0] / h0, img.shape[1] / w0
                i, j = int(i * fy), int(j * fx)
                h, w = max(1, int(round(h * fy))), max(1, int(round(w * fx)))
            else:
                img = simplejpeg.decode_jpeg(data, colorspace="RGB", fastdct=True,
                                             fastupsample=True)
                i, j, h, w = rrc_params(img.shape[1], img.shape[0], rng.random, rng.randint)
            cv2.resize(img[i:i + h, j:j + w], (SIZE, SIZE), dst=resized,
                       interpolation=cv2.INTER_LINEAR)
            src = resized[:, ::-1] if rng.random() < 0.5 else resized
            out[k] = src.transpose(2, 0, 1)
            k += 1
            if k == batch:
                yield out
                k = 0
        if k:
            yield out[:k]

    cores = usable_cores()
    return [r * cores for r in time_epochs(epoch, epochs, warmup, expect=len(paths))]


def run_ceiling(data_dir: str, batch: int = 256, workers: int = 2, epochs: int = 3,
                warmup: int = 1) -> list[float]:
    return _run_ceiling(data_dir, batch, workers, epochs, warmup, dct=False)


def run_ceiling_dct(data_dir: str, batch: int = 256, workers: int = 2, epochs: int = 3,
                    warmup: int = 1) -> list[float]:
    return _run_ceiling(data_dir, batch, workers, epochs, warmup, dct=True)


# --------------------------------------------------------------------------------------------
# ours


def run_ours(data_dir: str, batch: int = 256, workers: int = 2, epochs: int = 3,
             warmup: int = 1) -> list[float]:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if root not in sys.path:  # the checkout's pooled_loader, when run as scripts/benchmarks/peers.py
        sys.path.insert(0, root)
    try:
        from pooled_loader import PooledLoader
        from pooled_loader.vision import (Compose, DecodeImage, ImageFolder,
                                          RandomHorizontalFlip, RandomResizedCrop, ToCHW)
    except Exception as e:  # not written yet, or broken: say so, do not crash the harness
        raise PeerUnavailable(f"pooled_loader / pooled_loader.vision not importable: "
                              f"{type(e).__name__}: {e}") from e
    ds = ImageFolder(data_dir, transform=Compose([DecodeImage(), RandomResizedCrop(SIZE),
                                                  RandomHorizontalFlip(), ToCHW()]))
    loader = PooledLoader(ds, batch_size=batch, shuffle=True, num_workers=workers,
                          persistent_workers=workers > 0)
    try:
        return time_epochs(lambda: loader, epochs, warmup, expect=len(ds))
    finally:
        close = getattr(loader, "close", None)
        if close is not None:
            close()


def run_ours_cached(data_dir: str, batch: int = 256, workers: int = 2, epochs: int = 3,
                    warmup: int = 1) -> list[float]:
    """PooledLoader over pooled_loader.cache.CachedDataset: decode + Resize(max_side=512) once
    (the cache is built next to the dataset on first use, not timed), then the random tail
    RandomResizedCrop(224) + flip + CHW each epoch: the counterpart of FFCV RAW."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if root not in sys.path:
        sys.path.insert(0, root)
    try:
        from pooled_loader import PooledLoader
        from pooled_loader.cache import CachedDataset, build_cache
        from pooled_loader.vision import (Compose, DecodeImage, ImageFolder,
                                          RandomHorizontalFlip, RandomResizedCrop, Resize, ToCHW)
    except Exception as e:
        raise PeerUnavailable(f"pooled_loader.cache / pooled_loader.vision not importable: "
                              f"{type(e).__name__}: {e}") from e
    front = ImageFolder(data_dir, transform=Compose([DecodeImage(), Resize(max_side=512)]))
    path = _cache_dir(data_dir, "plcache") + "/max512.plc"
    build_cache(front, path, num_workers=workers, progress=False)
    ds = CachedDataset(path, transform=Compose([RandomResizedCrop(SIZE), RandomHorizontalFlip(),
                                                ToCHW()]), expect_fingerprint_of=front)
    loader = PooledLoader(ds, batch_size=batch, shuffle=True, num_workers=workers,
                          persistent_workers=True)
    try:
        return time_epochs(lambda: loader, epochs, warmup, expect=len(ds))
    finally:
        loader.close()


PEERS: dict[str, Callable[..., list[float]]] = {
    "ours": run_ours,
    "ours_cached": run_ours_cached,
    "torch_pil": run_torch_pil,
    "torch_decode_jpeg": run_torch_decode_jpeg,
    "webdataset": run_webdataset,
    "dali": run_dali,
    "dali_fused": run_dali_fused,
    "ffcv_jpg": run_ffcv_jpg,
    "ffcv_raw": run_ffcv_raw,
    "ceiling": run_ceiling,
    "ceiling_dct": run_ceiling_dct,
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="run one peer loader; print one JSON line")
    p.add_argument("name", choices=sorted(PEERS))
    p.add_argument("--data", required=True)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    a = p.parse_args(argv)
    rec = {"name": a.name}
    try:
        rec["rates"] = PEERS[a.name](a.data, batch=a.batch, workers=a.workers, epochs=a.epochs,
                                     warmup=a.warmup)
        rec["status"] = "ok"
        rec.update(LAST_STATS)
        if a.name.startswith("ceiling"):
            rec["rates_one_core"] = [x / usable_cores() for x in rec["rates"]]
    except PeerUnavailable as e:
        rec["status"], rec["error"] = "unavailable", str(e)
    print("PEER_RESULT " + json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
