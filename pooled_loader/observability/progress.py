"""Progress bars that are optional: tqdm's when it is installed (the ``tools`` extra), otherwise
an object with the same few methods that draws nothing.

Why: building a cache, writing shards and tuning are core features; a progress bar is a courtesy.
Their modules must import and run on a machine with only torch and numpy (issue 34), so none of
them imports tqdm itself.
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

__all__ = ["progress_bar"]


class _NoBar:
    """tqdm's counting surface (``n``, ``total``, ``update``, ``close``, iteration), drawing nothing."""

    def __init__(self, iterable: Optional[Iterable] = None, total: Optional[int] = None,
                 initial: int = 0) -> None:
        self.iterable, self.total, self.n = iterable, total, initial

    def __iter__(self):
        for item in self.iterable or ():
            yield item
            self.n += 1

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_description(self, *_: Any, **__: Any) -> None:
        pass

    def set_postfix_str(self, *_: Any, **__: Any) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(iterable: Optional[Iterable] = None, **kwargs: Any) -> Any:
    """``tqdm(iterable, **kwargs)``, or a bar that draws nothing when tqdm is not installed."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar(iterable, kwargs.get("total"), kwargs.get("initial", 0))
    return tqdm(iterable, **kwargs)
