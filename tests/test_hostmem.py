"""zerojax.hostmem: the resident set, its sampled peak, and giving freed heap back."""

import ctypes.util
import mmap
import os
import sys
import time

import numpy as np
import pytest

from zerojax import hostmem

linux = pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc")
MB = 1 << 20


def touched(nbytes):
    """Fresh anonymous pages, every one written: resident whatever malloc holds already.

    (numpy's own buffers may reuse memory an earlier test freed into the heap, which
    adds nothing to the resident set: CI saw 32 MB of growth for a 96 MB array.)
    Closing the map gives the pages back at once."""
    m = mmap.mmap(-1, nbytes)
    np.frombuffer(m, dtype=np.uint8)[:] = 1
    return m


@linux
def test_rss_counts_touched_memory():
    before = hostmem.rss()
    a = touched(64 * MB)
    grown = hostmem.rss() - before
    a.close()
    assert before > 0
    assert 56 * MB < grown < 96 * MB


@linux
def test_sampler_sees_a_transient_peak_and_the_level_after():
    before = hostmem.rss()
    with hostmem.RssSampler(interval=0.001) as s:
        a = touched(96 * MB)
        time.sleep(0.02)  # the thread samples it even without the kernel's mark
        a.close()
    assert s.start >= before - 8 * MB
    assert 88 * MB < s.peak_growth < 160 * MB
    assert s.end_growth < 16 * MB  # unmapped: back to the system at once
    assert s.samples >= 1


@linux
def test_sampler_peak_exact_with_the_kernel_mark():
    if not hostmem.reset_peak():
        pytest.skip("the kernel does not let VmHWM be reset")
    with hostmem.RssSampler(interval=10.0) as s:  # the thread reads once: the mark finds it
        a = touched(80 * MB)
        a.close()
    assert s.exact
    assert s.peak_growth > 72 * MB
    assert hostmem.peak_rss() >= hostmem.rss() - 4 * MB


@linux
@pytest.mark.skipif(not sys.platform.startswith("linux") or not ctypes.util.find_library("c"),
                    reason="glibc malloc_trim")
def test_release_freed_memory_gives_back_freed_small_blocks():
    # 64 KiB blocks stay below glibc's mmap threshold: freed, they stay in the heap
    blocks = [bytearray(b"x" * (64 << 10)) for _ in range(1600)]
    high = hostmem.rss()
    keep = blocks[-1]  # a live block at the top of the heap: free() alone cannot shrink it
    del blocks
    held = hostmem.rss()
    hostmem.release_freed_memory()
    after = hostmem.rss()
    del keep
    assert after <= held
    assert high - after > 64 * MB  # most of the 100 MB went back
    assert hostmem.release_freed_memory() in (True, False)


def test_no_proc_is_zero(monkeypatch):
    def missing(*a, **k):
        raise OSError("no /proc")

    monkeypatch.setattr("builtins.open", missing)
    assert hostmem.rss() == 0
    assert hostmem.peak_rss() == 0
    assert hostmem.reset_peak() is False
