"""Reading the files users name (schemes, existing modules): regular files only, and never more than a limit.

A path may name a FIFO (opening it waits for a writer, reading it waits for the writer to close), a device
(/dev/zero never ends, /dev/tty waits for a key) or a directory. A scheme or a generated module is a small regular
file, so anything else is refused before a byte is read, and a file is read up to its limit plus one byte, so that
a caller can tell "too large" without holding the whole file.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


class NotRegularFile(OSError):
    """The path names something other than a regular file; strerror says what."""

    def __init__(self, path: str | os.PathLike, mode: int):
        kind = _kind(mode)
        message = kind if kind.startswith("not ") else f"not a regular file: {kind}"
        super().__init__(errno.EINVAL, message, os.fspath(path))


def read_regular(path: str | os.PathLike, limit: int) -> bytes:
    """At most limit + 1 bytes of the regular file at `path` (a symbolic link is followed to what it names).

    Raises NotRegularFile for anything else, and OSError as open and read do.
    """
    path = Path(path)
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        raise NotRegularFile(path, mode)
    # O_NONBLOCK: were the path swapped for a FIFO after the stat, the open still returns (fstat then refuses it).
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFile(path, mode)
        chunks, left = [], limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 16))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)
