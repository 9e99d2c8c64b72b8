"""Private temporary folders that outlive no owner: each holds a lock its owner keeps for its
life, and making one removes those of the same prefix whose lock is free. A process killed
outright (SIGKILL) runs no cleanup: `batchyard up`'s config copy and triton-local's backend
folder stayed in /tmp, one per kill. A lock, not a pid in the name: the kernel frees a dead
owner's lock, and a pid read in another pid namespace, or reused, says nothing.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from pathlib import Path

LOCK = ".owner.lock"


class PrivateDir:
    def __init__(self, prefix: str):
        sweep(prefix)
        self.path = Path(tempfile.mkdtemp(prefix=prefix))
        # Locked under another name, then renamed: a sweep that opened the lock between its
        # creation and its locking found it free and removed a live owner's folder (1 start in
        # ~400 beside a sweeping loop, a review's run). The lock stays with the file renamed.
        unlocked = self.path / (LOCK + ".new")
        self._lock = os.open(unlocked, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        os.rename(unlocked, self.path / LOCK)

    def cleanup(self) -> None:
        if self._lock >= 0:
            shutil.rmtree(self.path, ignore_errors=True)
            os.close(self._lock)
            self._lock = -1


def sweep(prefix: str) -> list[str]:
    """Remove this user's folders ``<tmp>/<prefix>*`` whose owner is gone (their lock is free);
    returns their paths. One without a lock yet (just made) or another user's is kept."""
    gone = []
    with os.scandir(tempfile.gettempdir()) as entries:
        for e in entries:
            if not e.name.startswith(prefix):
                continue
            try:
                if not e.is_dir(follow_symlinks=False) or e.stat(follow_symlinks=False).st_uid != os.getuid():
                    continue
                fd = os.open(os.path.join(e.path, LOCK), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # held: its owner lives
                continue
            finally:
                os.close(fd)
            shutil.rmtree(e.path, ignore_errors=True)
            gone.append(e.path)
    return gone
