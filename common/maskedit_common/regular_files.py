"""Opening files a caller named (an adapter to load, a library entry: an adapter, a ControlNet) only when they are
regular files.

``open()`` on a FIFO waits for a writer forever, a device may block or act on being opened, a socket cannot be
read: a name in a source directory must not be able to hang a thread of the router or a backend. The name is
``stat``-ed first (nothing is opened when it is not a regular file), then opened non-blocking (a FIFO swapped in
meanwhile opens at once instead of waiting) and checked again on the open descriptor, so what is read is what was
checked; reads are blocking again after that."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


class NotRegularFile(OSError):
    """``path`` exists but is no regular file; the message says what it is (never its contents)."""


def kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def open_regular(path: str | Path) -> BinaryIO:
    """``path`` opened for reading in binary, if it is a regular file (symlinks followed); raises
    ``NotRegularFile`` otherwise, ``OSError`` if it cannot be opened."""
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        raise NotRegularFile(f"{Path(path).name} is {kind(mode)}, not a regular file")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFile(f"{Path(path).name} is {kind(mode)}, not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | Path) -> bytes:
    """The bytes of ``path`` if it is a regular file (``open_regular``)."""
    with open_regular(path) as fh:
        return fh.read()


def check_regular_dir(directory: str | Path) -> None:
    """Raise ``NotRegularFile`` naming the first entry of ``directory`` that is neither a regular file nor a
    directory (symlinks followed; ``stat`` only, nothing opened): for a model directory a loader then opens by name
    (``from_pretrained``), so that a FIFO named like a weight file is refused before anything waits on it."""
    for p in sorted(Path(directory).iterdir()):
        mode = os.stat(p).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise NotRegularFile(f"{p.name} is {kind(mode)}, not a regular file")
