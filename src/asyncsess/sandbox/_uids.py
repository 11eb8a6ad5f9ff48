"""Leases on unprivileged uids, one per running sandbox, exclusive across processes on this host.

A dedicated uid per run makes RLIMIT_NPROC a per-run budget, keeps concurrent runs from signalling or reading
each other, and lets the supervisor kill everything the run started with one kill(-1) as that uid. Leases are
flock()s on files in a root-only directory, so they are released even when the holder dies.
"""

from __future__ import annotations

import fcntl
import os
import stat
import tempfile
from dataclasses import dataclass

__all__ = ["UidLease", "acquire_uid"]

_LOCK_DIR = os.path.join(tempfile.gettempdir(), "asyncsess-sandbox-uids")


@dataclass
class UidLease:
    uid: int
    _fd: int

    def release(self) -> None:
        os.close(self._fd)  # drops the flock


def _lock_dir() -> str:
    os.makedirs(_LOCK_DIR, mode=0o700, exist_ok=True)
    st = os.lstat(_LOCK_DIR)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise PermissionError(f"{_LOCK_DIR} must be a directory owned by uid {os.geteuid()} with mode 0700")
    return _LOCK_DIR


def acquire_uid(uids: range) -> UidLease:
    """Lease the first free uid in ``uids``; raises RuntimeError when every one is taken (OSError if the lock
    files cannot be opened)."""
    directory = _lock_dir()
    for uid in uids:
        fd = os.open(os.path.join(directory, str(uid)), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        except BaseException:
            os.close(fd)
            raise
        return UidLease(uid, fd)
    raise RuntimeError(f"all {len(uids)} sandbox uids in {uids} are in use")
