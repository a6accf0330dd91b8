"""Host memory of this process: the resident set, its peak over a block of code, and
handing freed heap memory back to the system.

Used by the checkpoint benchmark and memory tests; the standard library only (Linux
``/proc`` and glibc, each optional: elsewhere :func:`rss` returns 0 and
:func:`release_freed_memory` does nothing).

    from zerojax import hostmem

    with hostmem.RssSampler() as s:       # samples rss() in a thread
        mgr.save(step, state)
    print(s.peak_growth, s.end_growth)    # bytes above the level at entry

The peak is exact where the kernel lets the high-water mark be reset
(``/proc/self/clear_refs``, Linux 4.0+): the sampler resets ``VmHWM`` on entry and
reads it on exit, besides sampling every ``interval`` seconds in a thread (which can
miss a peak shorter than the interval, or one reached while another thread holds the
GIL).
"""

from __future__ import annotations

import ctypes
import os
import re
import threading

__all__ = ["rss", "peak_rss", "reset_peak", "release_freed_memory", "available", "RssSampler"]

try:
    _PAGE = os.sysconf("SC_PAGE_SIZE")
except (AttributeError, ValueError, OSError):  # not a POSIX system
    _PAGE = 4096


def rss() -> int:
    """This process's resident set in bytes (``/proc/self/statm``; 0 where absent)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


def _proc_kb(path: str, key: str) -> int:
    """The ``key:  N kB`` line of a ``/proc`` file in bytes; 0 where absent."""
    try:
        with open(path) as f:
            m = re.search(rf"^{key}:\s+(\d+)\s+kB", f.read(), re.M)
    except OSError:
        return 0
    return int(m.group(1)) * 1024 if m else 0


def available() -> int:
    """Bytes of memory the system can give this process now without swapping (Linux
    ``MemAvailable`` in ``/proc/meminfo``); 0 where unknown."""
    return _proc_kb("/proc/meminfo", "MemAvailable")


def peak_rss() -> int:
    """The kernel's high-water mark of the resident set (``VmHWM``) in bytes, since the
    process started or the last :func:`reset_peak`; 0 where unknown."""
    return _proc_kb("/proc/self/status", "VmHWM")


def reset_peak() -> bool:
    """Reset the high-water mark to the current resident set; False where the kernel
    does not allow it (then :func:`peak_rss` keeps the process's all-time peak)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


_malloc_trim = None


def release_freed_memory() -> bool:
    """Hand memory that ``free`` kept in glibc's heaps back to the system
    (``malloc_trim(0)``, every arena). glibc returns freed blocks below its mmap
    threshold (which grows to 32 MiB as larger blocks are freed) to its arenas, not to
    the system, so the resident set stays at its peak after large buffers are freed.
    Returns whether anything was released; False (a no-op) where glibc is absent."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
            _malloc_trim.argtypes = [ctypes.c_size_t]
            _malloc_trim.restype = ctypes.c_int
        except (OSError, AttributeError):
            _malloc_trim = False
    return bool(_malloc_trim(0)) if _malloc_trim else False


class RssSampler:
    """Context manager: the resident set's level at entry (``start``), its peak during
    the block (``peak``) and its level at exit (``end``), in bytes; ``peak_growth`` and
    ``end_growth`` are relative to ``start``; ``samples`` counts the thread's readings.

    ``interval``: seconds between the thread's readings (the thread sleeps between
    them, so it takes little CPU). The peak also takes the kernel's reset high-water
    mark where available (``exact`` is then True)."""

    def __init__(self, interval: float = 0.001):
        self.interval = interval
        self.start = self.peak = self.end = 0
        self.samples = 0
        self.exact = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _poll(self) -> None:
        while True:
            self.peak = max(self.peak, rss())
            self.samples += 1
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> RssSampler:
        self.exact = reset_peak()
        self.start = self.peak = rss()
        self._stop.clear()
        self._thread = threading.Thread(target=self._poll, name="RssSampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.end = rss()
        self.peak = max(self.peak, self.end, peak_rss() if self.exact else 0)

    @property
    def peak_growth(self) -> int:
        return self.peak - self.start

    @property
    def end_growth(self) -> int:
        return self.end - self.start
