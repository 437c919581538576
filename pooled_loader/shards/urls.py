"""Shard URL patterns: ``a.tar::b.tar`` lists, ``${VAR}`` from ``WDS_VAR`` and bash-style brace
expansion (``data-{0000..0099}.tar``, ``{train,val}``), as WebDataset reads them, and the
member-name split ``base_plus_ext`` that groups a tar's members into samples.

Why here and not ``webdataset``'s: these two small functions are all the shard readers need from
that package, and importing it at the top of ``shards.samples`` made ``pooled_loader.vision``
(through the class check) fail on a machine without it. Braces are expanded by ``braceexpand``
(a small pure-Python core dependency, the one WebDataset itself uses, so a pattern names the same
shards in both); the rest is written from WebDataset's documented behaviour and compared with it
in ``tests/test_shard_urls.py``.

Which URLs name a file on this machine is decided here, once (``local_path``), for every
reader: the stream opener, the sample counter and seeker, the index lookup and CLI, the shard
cache and the class check all ask it, so ``file:///a%20b.tar`` names one file, ``/a b.tar``.

A pattern is untrusted input: the names it expands to are counted as they come
(``MAX_EXPANDED_URLS``), so ``{0..999999999999}`` is an error, not a MemoryError.
"""

from __future__ import annotations

import os
import re
import sys
import urllib.parse
from typing import Optional

from braceexpand import braceexpand

__all__ = ["expand_urls", "base_plus_ext", "local_path", "MAX_EXPANDED_URLS"]

MAX_EXPANDED_URLS = 1_000_000  # names one pattern may expand to: a million shards is a lot already

_ENV = re.compile(r"\$\{(\w+)\}")
_RANGE = re.compile(r"^(?:(-?\d+)\.\.(-?\d+)|[A-Za-z]\.\.[A-Za-z])(?:\.\.-?(\d+))?$")


def expand_urls(urls: str) -> list[str]:
    """The URLs a WebDataset pattern names: split on ``::``, ``${X}`` replaced by the environment
    variable ``WDS_X``, braces expanded; a malformed pattern is a ValueError naming it."""
    out: list[str] = []
    for url in urls.split("::"):
        url = _substitute_env(url)
        bound = _count_at_most(url)
        if bound > MAX_EXPANDED_URLS:  # braceexpand builds every range before the first name
            raise ValueError(f"the shard pattern {urls!r} names up to {bound} URLs; at most "
                             f"{MAX_EXPANDED_URLS} are allowed")
        try:
            for name in braceexpand(url):
                out.append(name)
                if len(out) > MAX_EXPANDED_URLS:
                    raise ValueError(f"the shard pattern {urls!r} names more than "
                                     f"{MAX_EXPANDED_URLS} URLs")
        except ValueError as exc:  # braceexpand's UnbalancedBracesError is one
            if str(urls) in str(exc):
                raise
            raise ValueError(f"the shard pattern {urls!r}: {exc}") from None
    return out


def _count_at_most(pattern: str) -> int:
    """At least as many names as ``pattern`` expands to, counted without building them: a group's
    alternatives add, the groups of one alternative multiply, a range counts its values."""
    total, i = 1, 0
    while i < len(pattern):  # a stray top-level "," or "}" is a literal: count on past it
        count, i = _count_from(pattern, i)
        total, i = min(total * count, 1 << 62), i + 1
    return total


def _count_from(s: str, i: int) -> tuple[int, int]:
    """(count, end) of the alternative starting at ``s[i]``, ending at an unmatched ``,``/``}``."""
    product = 1
    while i < len(s) and s[i] not in ",}":
        if s[i] == "\\":
            i += 2
        elif s[i] == "{":
            start, alternatives, i = i, 0, i + 1
            while True:
                count, i = _count_from(s, i)
                alternatives += count
                if i >= len(s) or s[i] == "}":
                    break
                i += 1  # a comma
            body = s[start + 1:i]
            match = _RANGE.match(body)
            if match and match.group(1) is not None:
                step = max(1, int(match.group(3) or 1))
                alternatives = abs(int(match.group(2)) - int(match.group(1))) // step + 1
            elif match:
                alternatives = 52
            product = min(product * max(alternatives, 1), 1 << 62)
            i += 1
        else:
            i += 1
    return product, i


def _substitute_env(url: str) -> str:
    def lookup(match: re.Match) -> str:
        key = "WDS_" + match.group(1)
        if key not in os.environ:
            raise ValueError(f"the shard pattern {url!r} uses ${{{match.group(1)}}}, but the "
                             f"environment variable {key} is not set")
        return os.environ[key]
    for _ in range(10):  # a value may name another variable; bounded, as a loop could be planted
        substituted = _ENV.sub(lookup, url)
        if substituted == url:
            break
        url = substituted
    return url


def local_path(url: str) -> Optional[str]:
    """The file on this machine that shard ``url`` names, or None when it is read another way
    (``http(s)://``, another ``scheme://`` through fsspec, a ``pipe:`` command).

    A plain path is itself, as written (never decoded: ``s%20x.tar`` is that name). A
    ``file://`` URL is its path percent-decoded as RFC 8089 says (``file:///a%20b.tar`` ->
    ``/a b.tar``; bytes that are not UTF-8 decoded as ``os.fsdecode`` would), its host not
    looked at (as the reader always did). A ``://`` after something that is not a scheme
    (``./x://y.tar``) is part of a plain path."""
    if url.startswith("pipe:"):
        return None
    if "://" not in url:
        return url
    split = urllib.parse.urlsplit(url)
    if split.scheme == "file":
        return urllib.parse.unquote(split.path, encoding=sys.getfilesystemencoding(),
                                    errors=sys.getfilesystemencodeerrors())
    return None if split.scheme else url


def base_plus_ext(path: str) -> tuple[Optional[str], Optional[str]]:
    """A member name split into its sample key and its extension(s) at the first dot of the last
    path component (``dir/x.seg.png`` -> ``("dir/x", "seg.png")``), or ``(None, None)`` when the
    last component has no dot.

    Odd names are split as WebDataset splits them (so both group a tar alike): the key runs to
    that dot from the last slash after which no other dot comes (``d/.x`` -> ``("d/", "x")``,
    ``a.//.x`` -> ``("a.//", "x")``), and a line break stops the search for slashes."""
    last_slash = path.rfind("/")
    dot = path.find(".", last_slash + 1)
    if dot < 0:
        return None, None
    dot_before = path.rfind(".", 0, dot)
    newline = path.find("\n")
    slash = path.rfind("/", max(dot_before, 0), dot - 1)  # a slash right before the dot leaves no key
    while slash >= 0 and slash > dot_before:
        if newline < 0 or newline > slash:
            return path[:dot], path[dot + 1:]
        slash = path.rfind("/", 0, slash)
    if dot_before < 0 and dot > 0:
        return path[:dot], path[dot + 1:]
    return None, None
