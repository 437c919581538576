"""Which class names a dataset, a cache or a shard set records, and the check that two of them
number their classes alike (``ImageFolder.check_classes``).

Why: a label is only an index into a class list. An ImageFolder, the cache built from it
(``build_cache`` keeps the names in its header) and the shards written from it (``shards write``
keeps them in each shard's ``__classes__`` member) agree on every label only when they list the
same classes in the same order; a hidden ``.ipynb_checkpoints/`` folder listed by one and not the
other shifts every label after it. ``check_classes`` raises ``ClassMismatchError`` naming the
classes whose labels differ.
"""
from __future__ import annotations

import os
from typing import Any, Sequence

from ..core.cache_header import read_header
from ..core.errors import ClassMismatchError
from ..core.file_index import is_hidden
from ..shards.samples import expand_shards
from ..shards.writer import read_shard_classes

__all__ = ["classes_of", "check_classes"]


def classes_of(source: Any) -> tuple[list[str] | None, str]:
    """``(class names, description)`` recorded by ``source``: a list of names, a dataset with
    ``classes`` (ImageFolder), a cache (CachedDataset or its path: names from its header), or a
    shard set (WebDataset, or a URL pattern or directory as ``WebDataset`` takes). Names are None
    when ``source`` records none."""
    if isinstance(source, (list, tuple)):
        return [str(c) for c in source], "the given class list"
    header = getattr(source, "header", None)
    if isinstance(header, dict) and "source" in header:
        return header["source"].get("classes"), f"cache {getattr(source, 'path', '?')}"
    if getattr(source, "classes", None) is not None:
        return list(source.classes), repr(source)
    urls = getattr(source, "urls", source)
    if isinstance(urls, (str, os.PathLike)) and os.path.isfile(urls) \
            and not os.fspath(urls).endswith(".tar"):
        return read_header(os.fspath(urls))["source"].get("classes"), f"cache {urls}"
    shards = expand_shards(urls)
    return read_shard_classes(shards), (f"shard set {shards[0]}" + (
        f" (+{len(shards) - 1} more)" if len(shards) > 1 else ""))


def check_classes(expected: Sequence[str], source: Any, where: str = "this dataset") -> None:
    """Raise ClassMismatchError unless ``source`` (see ``classes_of``) has the classes
    ``expected``, in the same order (so the same labels)."""
    got, what = classes_of(source)
    if got is None:
        raise ClassMismatchError(
            f"{what} records no class names, so its labels cannot be checked against {where}; "
            "rewrite it with this version of pooled_loader (shards write / build_cache)")
    if list(got) == list(expected):
        return
    diffs = []
    theirs = {c: i for i, c in enumerate(got)}
    for i, c in enumerate(expected):
        if c not in theirs:
            diffs.append(f"{c!r} missing there")
        elif theirs[c] != i:
            diffs.append(f"{c!r} is {theirs[c]} there and {i} here")
    diffs += [f"{c!r} only there" for c in got if c not in set(expected)]
    hint = ""
    if any(is_hidden(c) for c in list(got) + list(expected)):
        hint = ("; a hidden folder such as .ipynb_checkpoints is a class in one of them: list "
                "both with the same include_hidden")
    raise ClassMismatchError(
        f"{what} and {where} label classes differently ({'; '.join(diffs[:5])}"
        f"{'; ...' if len(diffs) > 5 else ''}): {len(got)} classes there {list(got)[:10]}, "
        f"{len(expected)} here {list(expected)[:10]}{hint}")
