"""``python -m pooled_loader cache {build,info,verify}``: build an image folder's cache, print a
cache's header, check every record's checksum."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from .build import build_cache
from .dataset import CachedDataset
from .format import CacheError, CacheSampleError

def main(argv: Sequence[str] | None = None) -> int:
    """``cache build SRC DST [--max-side N] [--variants K --crop S] [--workers N] [--skip-bad]``,
    ``cache info DST [--all]``, ``cache verify DST``. A leading ``"cache"`` in ``argv`` is
    skipped. Errors are raised; ``python -m pooled_loader`` prints them as one line."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["cache"]:
        argv = argv[1:]
    p = argparse.ArgumentParser(prog="python -m pooled_loader cache",
                                description="Build, inspect and check sample caches.",
                                epilog="--verbose (any command): show the traceback of an error")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="cache an image folder (decoded, resized)")
    b.add_argument("src", help="image folder: SRC/CLASS/IMAGE")
    b.add_argument("dst", help="cache file to write")
    b.add_argument("--max-side", type=int, default=None, help="resize so the longer side <= N")
    b.add_argument("--variants", type=int, default=1,
                   help="store K random crops per image (needs --crop)")
    b.add_argument("--crop", type=int, default=None,
                   help="RandomResizedCrop(S) stored per variant (the random, expensive part)")
    b.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--skip-bad", action="store_true",
                   help="leave images that fail to load out of the cache (listed by `info`)")
    b.add_argument("--overwrite", action="store_true", help="replace an existing cache at DST")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    i = sub.add_parser("info", help="print a cache's header")
    i.add_argument("dst")
    i.add_argument("--all", action="store_true", help="list every skipped sample")
    v = sub.add_parser("verify", help="check every record's checksum")
    v.add_argument("dst")
    args = p.parse_args(argv)
    if args.cmd == "build":
        if args.variants > 1 and args.crop is None:
            p.error("--variants > 1 stores random outputs: give --crop S")
        _cli_build(args)
    elif args.cmd == "info":
        _cli_info(args.dst, args.all)
    else:
        CachedDataset(args.dst).verify(progress=True)
        print(f"{args.dst}: all records OK")
    return 0


def _cli_build(args: argparse.Namespace) -> None:
    from ..vision import Compose, DecodeImage, ImageFolder, RandomResizedCrop, Resize
    ops = [DecodeImage()]
    if args.max_side:
        ops.append(Resize(max_side=args.max_side))
    if args.crop:
        ops.append(RandomResizedCrop(args.crop))
    ds = ImageFolder(args.src, transform=Compose(ops))
    existed = os.path.exists(args.dst) and not args.overwrite
    try:
        build_cache(ds, args.dst, num_workers=args.workers, variants=args.variants,
                    seed=args.seed, progress=not args.quiet, overwrite=args.overwrite,
                    on_error="skip" if args.skip_bad else "raise")
    except CacheSampleError as e:
        where = e.file or f"sample {e.index}"
        resumes = f" (the build resumes: {e.kept:,} records are kept)" if e.kept else ""
        raise CacheError(
            f"cannot cache {where}: {e.reason}. Either fix or remove it and run the same command "
            f"again{resumes}, or add --skip-bad to leave bad images out") from e
    cache = CachedDataset(args.dst)
    print(f"{args.dst}: {len(cache):,} samples x {cache.variants} variants, "
          f"{os.path.getsize(args.dst) / 2**20:.1f} MiB")
    if cache.skipped and (args.quiet or existed):  # else build_cache printed it
        print(f"{len(cache.skipped):,} of {cache.header['source_count']:,} samples skipped "
              f"(see `python -m pooled_loader cache info {args.dst}`)")


INFO_SKIPPED_SHOWN = 20  # `cache info` lists this many skipped samples unless --all


def _cli_info(dst: str, show_all: bool) -> None:
    ds = CachedDataset(dst)
    h = ds.header
    shp = {lf["id"]: ds._arrays.get(f"leaf{lf['id']}.shape") for lf in ds._leaves}
    print(f"file:       {dst} ({os.path.getsize(dst) / 2**20:.1f} MiB)")
    print(f"format:     version {h['format_version']}, created {h['created']}")
    print(f"samples:    {h['count']} x {h['variants']} variants (seed {h['seed']})")
    for lf in ds._leaves:
        s = f"  leaf {lf['id']}: {lf['kind']}"
        if lf.get("dtype"):
            s += f" {lf['dtype']}"
        if shp.get(lf["id"]) is not None:
            a = shp[lf["id"]].reshape(-1, lf["ndim"])
            s += (f" shape min {tuple(int(v) for v in a.min(0))}"
                  f" max {tuple(int(v) for v in a.max(0))}")
        print(s)
    skipped = ds.skipped
    print(f"skipped:    {len(skipped)} of {h.get('source_count', h['count'])} source samples"
          + (" (left out; cache indices are renumbered, CachedDataset.source_indices maps "
             "them back)" if skipped else ""))
    shown = skipped if show_all else skipped[:INFO_SKIPPED_SHOWN]
    for s in shown:
        print(f"  source index {s['index']}: {s['path'] or '(no file)'}: {s['reason']}")
    if len(shown) < len(skipped):
        print(f"  ... and {len(skipped) - len(shown)} more (--all lists them)")
    for k, val in h["source"].items():
        print(f"source.{k}: {val}")
