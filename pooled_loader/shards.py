"""Write an ImageFolder (one subfolder of images per class) as WebDataset tar shards.

Each image becomes one sample: ``{key}.jpg`` (the file's bytes as they are; a PNG stays
``.png``, ...) and ``{key}.cls`` (the class index as decimal text). Classes are numbered in sorted
folder-name order, as ``torchvision.datasets.ImageFolder`` does. The key is the file's path
relative to the root without its extension (dots replaced by ``_``, since ``webdataset`` splits
keys at the first dot). Samples are written in a seeded random order so that a shard mixes
classes. CLI: ``python -m pooled_loader shards write SRC OUT_PATTERN --per-shard N``.
"""

from __future__ import annotations

import argparse
import os
import random
from typing import Optional, Sequence

__all__ = ["IMAGE_EXTENSIONS", "list_image_folder", "write_shards", "main"]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def list_image_folder(root: str) -> tuple[list[tuple[str, int]], list[str]]:
    """``([(path, class_index), ...], class_names)`` of an ImageFolder, in sorted order."""
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    if not classes:
        raise ValueError(f"{root}: no class subfolders")
    items: list[tuple[str, int]] = []
    for index, name in enumerate(classes):
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, name)):
            dirnames.sort()
            items.extend((os.path.join(dirpath, f), index) for f in sorted(filenames)
                         if f.lower().endswith(IMAGE_EXTENSIONS))
    if not items:
        raise ValueError(f"{root}: no image files ({', '.join(IMAGE_EXTENSIONS)})")
    return items, classes


def _key(root: str, path: str) -> str:
    rel = os.path.splitext(os.path.relpath(path, root))[0].replace(os.sep, "/")
    return rel.replace(".", "_")


def write_shards(
    src_imagefolder: str,
    out_pattern: str,
    per_shard: int,
    progress: bool = True,
    seed: Optional[int] = 0,
) -> list[str]:
    """Write ``src_imagefolder`` as tar shards named ``out_pattern % shard_index`` (e.g.
    ``out/train-%06d.tar``), ``per_shard`` samples each (the last may hold fewer).

    ``seed`` fixes the sample order (``None``: sorted class/file order). Returns the shard paths.
    """
    from tqdm import tqdm
    from webdataset import ShardWriter

    if per_shard < 1:
        raise ValueError(f"per_shard must be >= 1, got {per_shard}")
    try:
        out_pattern % 0
    except TypeError:
        raise ValueError(f"out_pattern needs one %-format for the shard index, e.g. "
                         f"'shards/data-%06d.tar'; got {out_pattern!r}") from None
    items, _ = list_image_folder(src_imagefolder)
    if seed is not None:
        random.Random(seed).shuffle(items)
    keys = [_key(src_imagefolder, p) for p, _ in items]
    if len(set(keys)) != len(keys):
        dup = next(k for k in keys if keys.count(k) > 1)
        raise ValueError(f"{src_imagefolder}: two files map to the sample key {dup!r}")
    out_dir = os.path.dirname(out_pattern % 0)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
    written: list[str] = []
    with ShardWriter(out_pattern, maxcount=per_shard, maxsize=float("inf"), post=written.append,
                     verbose=0, encoder=False, mtime=0) as sink:
        for (path, label), key in tqdm(list(zip(items, keys)), disable=not progress,
                                       unit="img", desc="shards"):
            ext = os.path.splitext(path)[1][1:].lower()
            with open(path, "rb") as f:
                data = f.read()
            sink.write({"__key__": key, "jpg" if ext == "jpeg" else ext: data,
                        "cls": str(label).encode()})
    return written


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``shards write SRC OUT_PATTERN --per-shard N [--seed S] [--quiet]``; returns the exit code.

    ``argv`` starts at the subcommand (``["write", "imgs/", "out/d-%06d.tar", ...]``)."""
    parser = argparse.ArgumentParser(prog="python -m pooled_loader shards",
                                     description="Make WebDataset tar shards.")
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write", help="write an ImageFolder as tar shards")
    w.add_argument("src", help="ImageFolder root (one subfolder per class)")
    w.add_argument("out_pattern", help="output name with a %%-format, e.g. out/train-%%06d.tar")
    w.add_argument("--per-shard", type=int, required=True, help="samples per shard")
    w.add_argument("--seed", type=int, default=0, help="sample order seed (default 0)")
    w.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    paths = write_shards(args.src, args.out_pattern, args.per_shard, progress=not args.quiet,
                         seed=args.seed)
    print(f"wrote {len(paths)} shards: {paths[0]} .. {paths[-1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
