"""Opening files that someone else may have planted: links, FIFOs, devices, hard links.

Why: a reader that ``open()``s a FIFO blocks forever, one that reads a link to ``/dev/zero``
reads until MemoryError, and a writer that ``open(..., O_CREAT)``s a fixed name in a shared
folder writes wherever a planted symlink points. Every module that opens a file it did not just
create goes through here, so the rule is written once:

- ``open_regular``: read-only, ``O_NOFOLLOW`` (unless ``follow``: a user's own input may be a
  link to a regular file) and ``O_NONBLOCK`` (a FIFO opens at once instead of waiting for a
  writer), then ``fstat``: a regular file, of the expected or bounded size, and with ``own``
  this user's with one link; only then is ``O_NONBLOCK`` cleared. A device node is opened
  (non-blocking) before it is refused: ``fstat`` needs the descriptor.
- ``open_own``: the same checks for a fixed name this library creates or reuses (lock files,
  build journals), with any flags (``O_CREAT``, ``O_RDWR``...).
- ``create_exclusive``: a new file of unpredictable name in a folder (``O_EXCL``), to be renamed
  into place once complete.
- ``write_all``: ``os.write`` until every byte is written (a short count is not an error;
  ``ENOSPC`` is).

Failures raise ``UnsafeFileError`` (an ``OSError``) whose message names the file and says what
to do. This module imports nothing of pooled_loader: any module may use it.
"""
from __future__ import annotations

import errno
import fcntl
import os
import secrets
import stat
from typing import Optional, Union

from . import working_on

__all__ = ["UnsafeFileError", "open_regular", "open_regular_stat", "open_own", "create_exclusive",
           "write_all"]

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR,
          "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


class UnsafeFileError(OSError):
    """A file that is not what it must be (a link, a FIFO, a device, another user's, a hard
    link, the wrong size); the message names it."""


def _refuse(code: int, path: str, why: str) -> UnsafeFileError:
    return UnsafeFileError(code, why, path)


def _open(path: str, flags: int, mode: int, what: str, follow: bool) -> int:
    flags |= os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        return os.open(path, flags, mode)
    except OSError as e:
        if e.errno == errno.ELOOP and not follow:
            raise _refuse(errno.ELOOP, path, f"{what} is a symbolic link: refusing to follow "
                          "it; remove it (or put the file itself there)") from None
        raise


def _check(fd: int, path: str, what: str, *, own: bool = False,
           expect_size: Optional[int] = None, max_bytes: Optional[int] = None) -> os.stat_result:
    """``fstat(fd)`` if it is a regular file meeting the conditions; closes ``fd`` and raises
    ``UnsafeFileError`` otherwise."""
    st = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(st.st_mode):
        kind = next((name for test, name in _KINDS if test(st.st_mode)), "not a regular file")
        problem = (errno.EINVAL, f"{what} is {kind}, not a regular file: refusing to read it")
    elif own and st.st_uid != os.geteuid():
        problem = (errno.EPERM, f"{what} belongs to user {st.st_uid}, not to this user "
                   f"({os.geteuid()}): refusing to use it; remove it")
    elif own and st.st_nlink != 1:
        problem = (errno.EPERM, f"{what} has {st.st_nlink} hard links (a file of this library "
                   "has one): refusing to use it; remove it")
    elif expect_size is not None and st.st_size != expect_size:
        problem = (errno.EINVAL, f"{what} has {st.st_size} bytes where {expect_size} are "
                   "expected")
    elif max_bytes is not None and st.st_size > max_bytes:
        problem = (errno.EFBIG, f"{what} has {st.st_size} bytes, more than the {max_bytes} "
                   "allowed")
    if problem is not None:
        os.close(fd)
        raise _refuse(problem[0], path, problem[1])
    return st


def _blocking(fd: int, flags: Optional[int] = None) -> int:
    """``fd`` without ``O_NONBLOCK``; ``flags``: its other status flags when known (one system
    call fewer: ``F_SETFL`` sets only O_APPEND, O_ASYNC, O_DIRECT, O_NOATIME, O_NONBLOCK)."""
    if flags is None:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)
    return fd


def open_regular(path: Union[str, os.PathLike], *, max_bytes: Optional[int] = None,
                 expect_size: Optional[int] = None, what: str = "file", follow: bool = False,
                 own: bool = False) -> int:
    """A read-only descriptor of ``path`` if it is a regular file (not a link unless
    ``follow``; with ``own``, this user's with one link) of ``expect_size`` bytes / at most
    ``max_bytes`` when given; ``UnsafeFileError`` naming it otherwise. The caller closes it."""
    return open_regular_stat(path, max_bytes=max_bytes, expect_size=expect_size, what=what,
                             follow=follow, own=own)[0]


def open_regular_stat(path: Union[str, os.PathLike], *, max_bytes: Optional[int] = None,
                      expect_size: Optional[int] = None, what: str = "file",
                      follow: bool = False, own: bool = False) -> tuple[int, os.stat_result]:
    """``open_regular``, and the ``fstat`` it checked (one system call fewer for callers that
    need it)."""
    path = os.fspath(path)
    working_on.reading(path)  # a worker stuck in this file's reads is named by it
    fd = _open(path, os.O_RDONLY, 0, what, follow)
    st = _check(fd, path, what, own=own, expect_size=expect_size, max_bytes=max_bytes)
    return _blocking(fd, 0), st  # opened read-only: no other settable flag


def open_own(path: Union[str, os.PathLike], flags: int, mode: int = 0o644,
             what: str = "file") -> int:
    """``os.open(path, flags, mode)`` of a file of this library at a fixed name (``O_CREAT``
    allowed): never through a symlink, and only a regular file of this user with one link."""
    path = os.fspath(path)
    fd = _open(path, flags, mode, what, follow=False)
    _check(fd, path, what, own=True)
    return _blocking(fd)


def create_exclusive(directory: Union[str, os.PathLike], prefix: str, suffix: str = "",
                     mode: int = 0o644) -> tuple[int, str]:
    """``(fd, path)`` of a new empty file ``DIRECTORY/PREFIX<random hex>SUFFIX``, opened for
    writing; created with ``O_EXCL`` (never an existing file or a planted link)."""
    directory = os.fspath(directory)
    for _ in range(100):
        path = os.path.join(directory, f"{prefix}{secrets.token_hex(6)}{suffix}")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, mode)
        except FileExistsError:
            continue
        return fd, path
    raise FileExistsError(errno.EEXIST, "no free temporary name after 100 tries",
                          os.path.join(directory, prefix))


def write_all(fd: int, data: Union[bytes, bytearray, memoryview], path: str = "") -> None:
    """Write every byte of ``data`` to ``fd``: loops over short counts; a write that makes no
    progress is ``ENOSPC`` (an ``OSError`` naming ``path``), as a full disk's error is."""
    view = memoryview(data).cast("B")
    while len(view):
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(errno.ENOSPC, "no progress writing (disk full?)", path or None)
        view = view[n:]
