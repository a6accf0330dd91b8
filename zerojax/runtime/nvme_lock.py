"""The NVMe tier's ownership lock of a directory (standard library only: the lock test
loads this file in hundreds of light processes without JAX).

``take(directory, token)`` makes ``directory/LOCK`` this process's: the file is opened
(created if absent) and locked with ``flock(LOCK_EX | LOCK_NB)``, which the kernel
grants to one open file at a time and drops when its holder exits, however it exits
(a SIGKILL included). The winner writes ``{"pid", "host", "token"}`` into the locked
file itself (no shared temporary: two writers of one ``LOCK.tmp`` raced); a loser
reads it and is refused, naming the owner. A LOCK whose lock the kernel grants but
which names another host's process is refused too (a pid on another host cannot be
checked, and ``flock`` over a network filesystem may not reach it); one naming a
process of this host is a dead run's, whose files the caller deletes.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time

LOCK = "LOCK"


class NvmeError(RuntimeError):
    """The NVMe tier's files are missing, short, stale or not this state's."""


def _owner(fd: int) -> dict:
    """The JSON a LOCK's holder wrote ({} while it is being written or unreadable)."""
    try:
        raw = os.pread(fd, 4096, 0)
        owner = json.loads(raw.decode()) if raw else {}
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    return owner if isinstance(owner, dict) else {}


def _refusal(directory: str, owner: dict, reason: str) -> NvmeError:
    pid, host = owner.get("pid"), owner.get("host")
    if pid is None:
        who = "another process that is starting (its LOCK is being written)"
    elif pid == os.getpid() and host == socket.gethostname():
        who = f"another optimizer in this process (pid {pid})"
    else:
        who = f"process {pid} on {host}"
    lock = os.path.join(directory, LOCK)
    return NvmeError(
        f"nvme_path {directory} is in use by {who} ({reason}): two optimizers or processes "
        "given one nvme_path would overwrite each other's optimizer state. Give each run "
        f"its own nvme_path; if no run uses it any more, delete {lock}.")


def take(directory: str, token: str) -> tuple[int, dict | None]:
    """Own ``directory`` (created if absent): ``(fd, previous)``. ``fd`` holds the lock
    until :func:`release`; ``previous`` is what a dead run of this host left in LOCK
    (its files beside it are not a state), None where the LOCK was new. Raises
    :class:`NvmeError` naming the owner where another process or optimizer holds it."""
    lock = os.path.join(directory, LOCK)
    here = socket.gethostname()
    for _ in range(100):
        os.makedirs(directory, exist_ok=True)
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:  # the directory was removed by an owner leaving
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                os.close(fd)
                raise
            owner = _owner(fd)
            for _ in range(500):  # the winner writes its name right after its flock
                if owner:
                    break
                time.sleep(0.002)
                owner = _owner(fd)
            os.close(fd)
            raise _refusal(directory, owner, f"its {LOCK} file is locked") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino
        except FileNotFoundError:
            same = False
        if not same:  # an owner leaving unlinked this LOCK after we opened it: retry
            os.close(fd)
            continue
        owner = _owner(fd)
        if owner and owner.get("host") != here:
            os.close(fd)
            raise _refusal(directory, owner, f"its {LOCK} names another host")
        data = json.dumps({"pid": os.getpid(), "host": here, "token": token}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        return fd, (owner or None)
    raise NvmeError(f"could not take {lock}: it was replaced 100 times while this process "
                    "tried (another run starting and leaving there at once); retry, or give "
                    "each run its own nvme_path.")


def release(fd: int) -> None:
    """Drop the lock :func:`take` returned (closing its file)."""
    try:
        os.close(fd)
    except OSError:
        pass
