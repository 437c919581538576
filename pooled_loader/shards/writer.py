"""Write an ImageFolder (one subfolder of images per class) as WebDataset tar shards.

Each image becomes one sample: ``{key}.jpg`` (the file's bytes as they are; a PNG stays
``.png``, ...) and ``{key}.cls`` (the class index as decimal text). Files and classes are listed by
``pooled_loader.core.file_index.list_image_folder``, as ``vision.ImageFolder`` lists them, so a folder's
shards and its ImageFolder agree on every label (torchvision's order: sorted folder names, hidden
folders such as ``.ipynb_checkpoints`` included unless ``include_hidden=False``). Every shard starts
with a ``__classes__`` member, the class names as a JSON list (webdataset readers skip ``__*__``
members as metadata); ``read_shard_classes`` reads it, and ``ImageFolder.check_classes(shards)``
raises if the labels differ. The key is the file's path relative to the root without its
extension (dots replaced by ``_``, since ``webdataset`` splits keys at the first dot). Samples are
written in a seeded random order so that a shard mixes classes; each shard is written to a new
file of unpredictable name next to it (``NAME.XXXXXX.partial``, created exclusively: a symlink
planted there is never written through), renamed when complete, then indexed
(``NAME.idx.json``, see pooled_loader.shards.index). CLI:
``python -m pooled_loader shards write SRC OUT_PATTERN --per-shard N``; ``shards index PATTERN``
indexes existing shards.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import sys
import tarfile
import tempfile
from typing import Optional, Sequence

from ..core.errors import ClassMismatchError, ShardFormatError
from . import remote
from ..core.file_index import list_image_folder
from ..observability.progress import progress_bar
from .cache import parse_bytes
from .index import write_index
from .samples import expand_shards
from .tar import TarReader
from .urls import local_path

__all__ = ["CLASSES_MEMBER", "write_shards", "read_shard_classes", "main"]

CLASSES_MEMBER = "__classes__"  # a __*__ name: webdataset's readers skip it as metadata


def _key(relpath: str) -> str:
    rel = os.path.splitext(relpath)[0].replace(os.sep, "/")
    return rel.replace(".", "_")


def _add(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o444  # mtime 0: reproducible shards
    tf.addfile(info, io.BytesIO(data))


def write_shards(
    src_imagefolder: str,
    out_pattern: str,
    per_shard: int,
    progress: bool = True,
    seed: Optional[int] = 0,
    *,
    include_hidden: Optional[bool] = None,
) -> list[str]:
    """Write ``src_imagefolder`` as tar shards named ``out_pattern % shard_index`` (e.g.
    ``out/train-%06d.tar``), ``per_shard`` samples each (the last may hold fewer).

    ``seed`` fixes the sample order (``None``: sorted class/file order); ``include_hidden`` is
    passed to ``list_image_folder`` (as ``ImageFolder`` takes it). Returns the shard paths.
    """
    if per_shard < 1:
        raise ValueError(f"per_shard must be >= 1, got {per_shard}")
    try:
        out_pattern % 0
    except TypeError:
        raise ValueError(f"out_pattern needs one %-format for the shard index, e.g. "
                         f"'shards/data-%06d.tar'; got {out_pattern!r}") from None
    index = list_image_folder(src_imagefolder, include_hidden=include_hidden)
    order = list(range(len(index)))
    if seed is not None:
        random.Random(seed).shuffle(order)
    keys = [_key(index.relpath(i)) for i in order]
    if len(set(keys)) != len(keys):
        seen: set[str] = set()
        dup = next(k for k in keys if k in seen or seen.add(k))
        raise ValueError(f"{src_imagefolder}: two files map to the sample key {dup!r}")
    names = [out_pattern % n for n in range(-(-len(order) // per_shard))]
    if len(set(names)) < len(names):  # checked before anything is written
        first = {}
        a, b = next((first[p], n) for n, p in enumerate(names) if first.setdefault(p, n) != n)
        raise ValueError(f"out_pattern {out_pattern!r} names shards {a} and {b} both "
                         f"{names[a]!r}: each would replace the last; number them, e.g. "
                         "'shards/data-%06d.tar'")
    for out_dir in sorted({os.path.dirname(p) for p in names} - {""}):
        os.makedirs(out_dir, exist_ok=True)
    classes = json.dumps(index.classes).encode()
    written: list[str] = []
    bar = progress_bar(total=len(order), disable=not progress, unit="img", desc="shards")
    try:
        for start in range(0, len(order), per_shard):
            path = names[len(written)]
            fd, partial = tempfile.mkstemp(prefix=os.path.basename(path) + ".",
                                           suffix=".partial", dir=os.path.dirname(path) or ".")
            try:
                with os.fdopen(fd, "wb") as out, \
                        tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tf:
                    _add(tf, CLASSES_MEMBER, classes)
                    for i, key in zip(order[start:start + per_shard],
                                      keys[start:start + per_shard]):
                        src, label = index[i]
                        ext = os.path.splitext(src)[1][1:].lower()
                        with open(src, "rb") as f:
                            data = f.read()
                        _add(tf, f"{key}.cls", str(label).encode())
                        _add(tf, f"{key}.{'jpg' if ext == 'jpeg' else ext}", data)
                        bar.update(1)
                os.chmod(partial, 0o644)  # mkstemp makes it private (0600)
                os.replace(partial, path)
                write_index(path)
            except BaseException:
                if os.path.exists(partial):
                    os.unlink(partial)
                raise
            written.append(path)
    finally:
        bar.close()
    return written


def read_shard_classes(urls: Sequence[str]) -> Optional[list[str]]:
    """Class names recorded in the shards (their ``__classes__`` member), or None when the first
    shard has none (shards not written by ``write_shards``). Every local shard is checked (one
    header each); of remote ones, the first. Raises ClassMismatchError if shards disagree."""
    found: Optional[list[str]] = None
    for n, url in enumerate(urls):
        if n and local_path(url) is None:
            break
        stream = remote.open_shard(url)
        try:
            tar = TarReader(stream, url)
            first = next(iter(tar), None)
            names = (json.loads(tar.read(first))
                     if first is not None and first.name == CLASSES_MEMBER else None)
        except ValueError as exc:  # ShardFormatError names the shard; bad JSON does not
            raise ShardFormatError(url, f"unreadable {CLASSES_MEMBER} member: {exc}") from exc
        finally:
            stream.close()
        if n == 0:
            found = names
            if found is None:
                return None
        elif names != found:
            raise ClassMismatchError(f"shard {url} records the classes {names}, but {urls[0]} "
                                     f"records {found}: the shards come from different folders")
    return found


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
    w.add_argument("--skip-hidden", action="store_true",
                   help="leave hidden folders and files (.ipynb_checkpoints, ._*) out; as "
                        "ImageFolder(include_hidden=False). Default: torchvision's listing")
    w.add_argument("--quiet", action="store_true", help="no progress bar")
    ix = sub.add_parser("index", help="write the sample index (NAME.idx.json) of local shards")
    ix.add_argument("pattern", help="shards: a brace pattern (d-{000..099}.tar), a folder or "
                                    "a path")
    ix.add_argument("--max-sample-bytes", default=None,
                    help="the most member data one sample may hold, e.g. 1GiB (default "
                         "256MiB: constants.MAX_SAMPLE_BYTES)")
    args = parser.parse_args(argv)
    if args.command == "index":
        bound = (None if args.max_sample_bytes is None
                 else parse_bytes(args.max_sample_bytes, "--max-sample-bytes"))
        urls = expand_shards(args.pattern)
        paths = [local_path(url) for url in urls]
        for url, path in zip(urls, paths):  # all checked before the first index is written
            if path is None:
                raise ValueError(f"{url}: shards index works on local shards; index them "
                                 "before uploading")
        for path in paths:
            print(write_index(path, bound))
        return 0
    try:
        paths = write_shards(args.src, args.out_pattern, args.per_shard,
                             progress=not args.quiet, seed=args.seed,
                             include_hidden=False if args.skip_hidden else None)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {len(paths)} shards: {paths[0]} .. {paths[-1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
