"""Small files the front door reads and writes beside its peers or from the config: the node's
trace and log settings in its registry folder, the gRPC TLS files. Each is read whole, as a
regular file of bounded size, without blocking (a FIFO planted at the name held the event loop
in open(); /dev/zero had no end), and written whole (a process killed part-way, or a full disk,
leaves the old file)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
from typing import Optional


def read_small_file(path: str, limit: int, dir_fd: Optional[int] = None, follow_links: bool = True) -> bytes:
    """The bytes of ``path`` (in ``dir_fd``): OSError where it cannot be opened (a link, with
    ``follow_links`` false), ValueError where it is no regular file or is over ``limit`` bytes."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_links else os.O_NOFOLLOW)
    with os.fdopen(os.open(path, flags, dir_fd=dir_fd), "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ValueError("not a regular file")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"larger than {f'{limit >> 20} MiB' if limit % (1 << 20) == 0 else f'{limit} bytes'}")
    return data


def replace_whole(path: str, data: bytes, mode: int, dir_fd: Optional[int] = None) -> None:
    """``path`` (in ``dir_fd``) becomes a new file of ``data``, or stays as it was: written beside
    it, then renamed over it (a link at ``path`` is replaced, not followed)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise


@contextlib.contextmanager
def flocked(fd: Optional[int]):
    """An exclusive flock on ``fd`` while the block runs (the node's front doors take turns);
    none for None (a process with settings of its own)."""
    if fd is None:
        yield
        return
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
