"""`remove_stale`: region files of dead jobs, found by their locks and removed.

Every opener of a `SharedHostRegion` holds a shared `flock` on its file until it closes
(`_region_file`), so a region file nobody holds belongs to a job that is gone.
"""

from __future__ import annotations

import fcntl
import os
import stat
import time

from ._errors import InvalidTransferError
from ._region_file import FILE_PREFIX, FILE_SUFFIX, ident

__all__ = ["remove_stale"]


def remove_stale(directory: str = "/dev/shm", *, min_age: float = 60.0,
                 dry_run: bool = False) -> list[str]:
    """Remove region files of dead jobs from `directory`; the paths removed (or, with
    `dry_run`, that would be).

    A file is stale when it is named like a region file, is a regular file owned by this
    uid, was last changed at least `min_age` seconds ago, and no process holds it open
    through a `SharedHostRegion` (each opener keeps a shared flock until it closes). Files
    of live jobs, of other users, and anything that is not a regular file are left alone.
    """
    if isinstance(min_age, bool) or not isinstance(min_age, (int, float)) or not min_age >= 0:
        raise InvalidTransferError(f"min_age must be a number of seconds >= 0, got {min_age!r}")
    uid, now = os.geteuid(), time.time()
    found: list[str] = []
    for entry in sorted(os.listdir(directory)):
        if not (entry.startswith(FILE_PREFIX) and entry.endswith(FILE_SUFFIX)):
            continue
        path = os.path.join(directory, entry)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
            continue
        if now - max(st.st_mtime, st.st_ctime) < min_age:
            continue  # maybe a creator between its open and its lock
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            fst = os.fstat(fd)
            if ident(fst) != ident(st):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # an opener holds it: a live job
            if not dry_run:
                if ident(os.lstat(path)) != ident(st):
                    continue
                os.unlink(path)  # openers that wait on our lock see st_nlink == 0, retry
            found.append(path)
        except FileNotFoundError:
            continue
        finally:
            os.close(fd)
    return found
