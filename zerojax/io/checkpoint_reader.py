"""The read side of a checkpoint directory (:class:`zerojax.CheckpointManager`'s
steps): which steps are complete, their markers, metadata and ``extra``, and each
file's checksum against the marker (:meth:`CheckpointReader.verify`). Reads files only
(no collective, no JAX backend): any one process may use it.

:class:`zerojax.checkpoint.CheckpointManager` adds saving, pruning and restoring on
top of :class:`CheckpointReader`; :mod:`zerojax.export` reads steps through it without
the manager, so the imports run one way (files < export < checkpoint). The layout on
disk is described in :mod:`zerojax.checkpoint`.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import threading
import warnings
import zlib
from typing import Any

import jax
import numpy as np

FORMAT = 2
MARKER = "_zerojax_step.json"
_TMP = ".zerojax-tmp-"          # a save in progress (or a failed or killed one)
_DELETE = ".zerojax-delete-"    # being deleted (a pruned, or rolled-back, step)
_REPLACED = ".zerojax-replaced-"  # a step moved aside while its replacement moves in
_ROLLBACK = ".zerojax-rollback-"  # a rollback's journal: the newer steps it deletes
_CHUNK = 1 << 20  # checksum reads: one reused 1 MiB buffer per thread
VALUES = "_zerojax_chunks.json"  # the chunk table (zerojax.checkpoint._ocdbt_chunks)


class CheckpointError(RuntimeError):
    """A checkpoint step that is damaged (a file missing, truncated or changed) or that
    cannot be written as asked."""


def _check_step(step, what: str = "step") -> int:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise TypeError(f"{what}={step!r} must be a non-negative int (a training step).")
    return int(step)


def _read_json(path: str, step: int, directory: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint step {step} in {directory} is damaged: "
                              f"{os.path.relpath(path, directory)} is missing.") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint step {step} in {directory} is damaged: "
                              f"{os.path.relpath(path, directory)} is not valid JSON ({e})."
                              ) from None


_buffers = threading.local()


def _crc(path: str, segments: list | tuple = ()) -> tuple[int, int, list[int]]:
    """``(size, CRC-32, [CRC-32 of each (offset, length) segment])`` of a file, read
    once. Segments must not overlap; one cut short by the file's end gets the CRC of
    what is there."""
    buf = getattr(_buffers, "buf", None)
    if buf is None:
        buf = _buffers.buf = memoryview(bytearray(_CHUNK))
    order = sorted(range(len(segments)), key=lambda i: segments[i][0])
    seg_crcs = [0] * len(segments)
    crc, size, first = 0, 0, 0  # first: the first segment not yet read to its end
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(buf[:n], crc)  # releases the GIL: files are hashed in parallel
            end = size + n
            for i in order[first:]:
                off, length = segments[i]
                if off >= end:
                    break
                lo, hi = max(off, size), min(off + length, end)
                if hi > lo:
                    seg_crcs[i] = zlib.crc32(buf[lo - size:hi - size], seg_crcs[i])
            while first < len(order) and sum(segments[order[first]]) <= end:
                first += 1
            size = end
    return size, crc, seg_crcs


def _files(root: str) -> list[str]:
    out = []
    for r, _, fs in os.walk(root):
        out += [os.path.relpath(os.path.join(r, f), root) for f in fs]
    return sorted(out)


def _checksums(root: str, names: list[str], segments: dict | None = None
               ) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """``({name: [size, CRC-32]}, {name: [CRC-32 of each segment]})`` of the files
    ``names`` under ``root``; ``segments``: ``{name: [(offset, length), ...]}``."""
    segments = segments or {}
    with concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 2)) as ex:
        sums = list(ex.map(lambda n: _crc(os.path.join(root, n), segments.get(n, ())), names))
    return ({n: [size, crc] for n, (size, crc, _) in zip(names, sums)},
            {n: segs for n, (_, _, segs) in zip(names, sums) if n in segments})


def _changed_leaves(root: str, name: str, size: int | None = None) -> str:
    """A sentence naming the leaves whose chunks in file ``name`` of the step at
    ``root`` differ from the save (``""`` when the step has no chunk table)."""
    try:
        with open(os.path.join(root, VALUES)) as f:
            table = json.load(f).get(name)
        if table is None:
            return " It holds no array chunks (it is part of the database's index)."
        got_size, _, crcs = _crc(os.path.join(root, name), [(o, n) for o, n, _, _ in table])
    except (OSError, ValueError, TypeError, AttributeError):
        return ""
    changed: dict[str, list[str]] = {}
    for (off, length, crc, key), got in zip(table, crcs):
        if off + length > got_size or got != crc:
            leaf, _, chunk = key.rpartition("/")
            changed.setdefault(leaf or key, []).append(chunk)
    if not changed:
        return (" No array chunk stored in it changed: the damage is outside them (the "
                "database's index).")
    parts = [f"{leaf} (chunk{'s' if len(c) > 1 else ''} {', '.join(c[:4])}"
             f"{' ...' if len(c) > 4 else ''})" for leaf, c in changed.items()]
    return (f" The changed bytes hold leaf{'s' if len(parts) > 1 else ''} "
            f"{'; '.join(parts[:8])}{' ...' if len(parts) > 8 else ''}.")


def _marker_damage(root: str, step: int) -> str | None:
    """None when the step directory ``root`` holds a sound marker, else what is wrong
    with it (``"is missing"``, ``"is not valid JSON"``...)."""
    try:
        with open(os.path.join(root, MARKER)) as f:
            marker = json.load(f)
    except FileNotFoundError:
        return "is missing"
    except (OSError, ValueError) as e:  # JSONDecodeError, UnicodeDecodeError
        return f"is not valid JSON ({type(e).__name__})"
    if not isinstance(marker, dict) or "zerojax_checkpoint" not in marker:
        return "is not a zerojax marker"
    if marker.get("step") != step:
        return f"names step {marker.get('step')!r}"
    return None


def _looks_like_a_step(root: str) -> bool:
    """Whether the directory ``root`` (its marker missing) is one zerojax wrote: its
    ``state/`` item beside the metadata zerojax writes."""
    try:
        names = set(os.listdir(root))
    except OSError:
        return False
    return "state" in names and bool(names & {"meta.json", VALUES} or any(
        re.fullmatch(r"extra\.process-\d+\.json", n) for n in names))


def _listing(directory: str) -> str:
    if not os.path.isdir(directory):
        return f"{directory} does not exist."
    names = sorted(os.listdir(directory))
    return f"{directory} holds: {names[:20] or 'nothing'}."


def _nothing_here(directory: str) -> str:
    return (f"no complete checkpoint in {directory}: " + _listing(directory) +
            " A step directory appears when its save has finished (an interrupted save "
            "leaves only a temporary directory); pass the directory given to "
            "CheckpointManager(...).save.")


class CheckpointReader:
    """The complete steps in ``directory`` and what each holds, read from the files
    (see :class:`zerojax.CheckpointManager`, which adds saving and restoring)."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = os.path.abspath(os.fspath(directory))
        if os.path.exists(self.directory) and not os.path.isdir(self.directory):
            raise NotADirectoryError(f"checkpoint directory {self.directory} is a file.")
        self._warned_foreign = False
        self._warned_damaged: set[int] = set()
        self._damaged: dict[int, str] = {}

    def wait(self) -> None:
        """Nothing to wait for: a reader writes nothing (the manager waits for its saves)."""

    # -- the steps on disk ------------------------------------------------------------
    def _scan(self) -> dict[int, int]:
        """``{step: format}`` of the complete steps this class wrote; ``self._damaged``:
        ``{step: why}`` of the step directories it wrote whose marker is missing or
        damaged. Warns (once each) about those and about anything else found in the
        directory."""
        steps, foreign, damaged = {}, [], {}
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            names = []
        for name in names:
            path = os.path.join(self.directory, name)
            if name.startswith((_TMP, _DELETE, _REPLACED, _ROLLBACK)):
                continue
            fmt, broken = None, False
            if re.fullmatch(r"0|[1-9][0-9]*", name) and os.path.isdir(path):
                why = _marker_damage(path, int(name))
                if why is None:
                    fmt = FORMAT
                elif (os.path.isfile(os.path.join(path, "_CHECKPOINT_METADATA")) and
                      os.path.isfile(os.path.join(path, "meta", "metadata")) and
                      os.path.isdir(os.path.join(path, "state"))):
                    fmt = 1  # zerojax's first format: orbax CheckpointManager's layout
                elif why != "is missing" or _looks_like_a_step(path):
                    damaged[int(name)] = f"its marker {MARKER} {why}"
                    broken = True
            if fmt is not None:
                steps[int(name)] = fmt
            elif not broken:
                foreign.append(name)
        self._damaged = damaged
        new = sorted(set(damaged) - self._warned_damaged)
        if new:
            self._warned_damaged |= set(new)
            warnings.warn(" ".join(
                f"step {s} in {self.directory} is a damaged zerojax step: {damaged[s]}."
                for s in new) + " It is not listed or restored (restore() without a step "
                "refuses while it is the newest); restore an earlier step, or replace it "
                "with save(step, state, overwrite=True).", stacklevel=3)
        if foreign and not self._warned_foreign:
            self._warned_foreign = True
            warnings.warn(
                f"{self.directory} holds entries zerojax did not write: {sorted(foreign)[:10]}"
                f"{' ...' if len(foreign) > 10 else ''}. They are not checkpoint steps and "
                "are never listed, pruned or deleted; keep other files elsewhere.",
                stacklevel=3)
        return steps

    def all_steps(self) -> list[int]:
        """The complete steps on disk, oldest first (after this manager's pending saves
        are written). Reads files only: any one process may call it. Step directories
        zerojax wrote whose marker is missing or damaged are not listed: a warning names
        them (see :meth:`damaged_steps`)."""
        self.wait()
        return sorted(self._scan())

    def damaged_steps(self) -> dict[int, str]:
        """``{step: what is wrong}`` of the step directories zerojax wrote whose marker
        is missing or damaged (deleted, cut short, overwritten): not listed by
        :meth:`all_steps`, never restored, pruned or deleted; ``save(step, state,
        overwrite=True)`` replaces one. (Damage to the other files shows in
        :meth:`verify`.)"""
        self.wait()
        self._scan()
        return dict(sorted(self._damaged.items()))

    def latest_step(self, verify: bool = False) -> int | None:
        """The newest complete step (None if there is none). ``verify=True``: the newest
        that passes its integrity check (every file's size and CRC-32, reading them all),
        skipping damaged ones."""
        steps = self.all_steps()
        if not verify:
            return steps[-1] if steps else None
        for s in reversed(steps):
            try:
                self.verify(s)
                return s
            except CheckpointError as e:
                warnings.warn(f"skipping step {s}: {e}", stacklevel=2)
        return None

    def verify(self, step: int | None = None) -> None:
        """Check every file of ``step`` (default: the newest) against the size and CRC-32
        written at save time; raises :class:`CheckpointError` naming the step and the
        file. Steps of zerojax's first format have no checksums and pass."""
        step = self._step(step)
        root = os.path.join(self.directory, str(step))
        if self._scan().get(step) == 1:
            return
        marker = _read_json(os.path.join(root, MARKER), step, self.directory)
        want = marker.get("files")
        if not isinstance(want, dict):
            raise CheckpointError(f"checkpoint step {step} in {self.directory} is damaged: "
                                  f"{MARKER} lists no files.")
        for name in want:
            if not os.path.isfile(os.path.join(root, name)):
                raise CheckpointError(f"checkpoint step {step} in {self.directory} is damaged: "
                                      f"its file {name} is missing.")
        got, _ = _checksums(root, list(want))
        for name, (size, crc) in want.items():
            if got[name][0] != size:
                raise CheckpointError(
                    f"checkpoint step {step} in {self.directory} is damaged: file {name} has "
                    f"{got[name][0]} bytes, {size} were written (truncated or overwritten)."
                    + _changed_leaves(root, name))
            if got[name][1] != crc:
                raise CheckpointError(
                    f"checkpoint step {step} in {self.directory} is damaged: file {name} "
                    f"fails its checksum (CRC-32 {got[name][1]:#010x}, written {crc:#010x}):"
                    " its bytes changed since the save." + _changed_leaves(root, name))
        extra = sorted(set(_files(root)) - set(want) - {MARKER})
        if any(not n.startswith("extra.process-") for n in extra):
            warnings.warn(f"checkpoint step {step} in {self.directory} holds files written "
                          f"after the save: {extra[:5]}", stacklevel=2)

    def _newest(self, verify: bool, fallback: bool) -> int:
        """The newest step to restore (verified with ``verify``); a damaged newer one
        raises, or with ``fallback`` is named in a warning and skipped."""
        steps = self.all_steps()
        skipped = [(s, why) for s, why in sorted(self._damaged.items(), reverse=True)
                   if not steps or s > steps[-1]]
        for s in reversed(steps):
            if skipped and not fallback:
                bad, why = skipped[0]
                raise CheckpointError(
                    f"the newest step {bad} in {self.directory} is damaged: {why}. The newest "
                    f"step that restores is {s}: pass step={s} or fallback=True to restore "
                    f"it (or remove or replace step {bad}).")
            try:
                if verify:
                    self.verify(s)
            except CheckpointError as e:
                if not fallback and not skipped:
                    raise
                skipped.append((s, str(e)))
                continue
            if skipped:
                warnings.warn("; ".join(f"step {b} in {self.directory} is damaged ({why})"
                                        for b, why in skipped) + f"; restoring step {s}.",
                              stacklevel=3)
            return s
        if skipped:
            raise CheckpointError(
                f"no step in {self.directory} restores: "
                + "; ".join(f"step {b} is damaged ({why})" for b, why in skipped) + ".")
        raise FileNotFoundError(_nothing_here(self.directory))

    def _step(self, step: int | None) -> int:
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise FileNotFoundError(_nothing_here(self.directory))
            return steps[-1]
        step = _check_step(step)
        if step not in steps:
            raise FileNotFoundError(
                f"no complete checkpoint for step {step} in {self.directory}; complete steps: "
                f"{steps or 'none'}. " + _listing(self.directory))
        return step

    def meta(self, step: int | None = None) -> dict:
        """The saving configuration of ``step`` (default: the newest)."""
        step = self._step(step)
        root = os.path.join(self.directory, str(step))
        if self._scan()[step] == 1:
            return _read_json(os.path.join(root, "meta", "metadata"), step, self.directory)
        return _read_json(os.path.join(root, "meta.json"), step, self.directory)

    def extra(self, step: int | None = None, process: int | None = None) -> Any:
        """The ``extra`` this process (or process ``process``) saved with ``step``
        (default: the newest step). Each process's ``extra`` is kept."""
        step = self._step(step)
        meta = self.meta(step)
        if meta.get("format", 1) == 1:
            return meta["extra"]
        process = jax.process_index() if process is None else _check_step(process, "process")
        path = os.path.join(self.directory, str(step), f"extra.process-{process}.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"checkpoint step {step} in {self.directory} has no extra of process "
                f"{process}: it was saved by {meta.get('processes')} process(es); pass "
                "process= to read another's.")
        return _read_json(path, step, self.directory)


def resolve(directory: str | os.PathLike, step: int | None = None) -> tuple[int, str, dict]:
    """``(step, root, meta)`` of the newest (or the given) complete step in
    ``directory``: ``root/state`` is the orbax PyTree item of the arrays; ``meta`` is the
    saved metadata. Reads files only (no collective: any one process may call it)."""
    mgr = CheckpointReader(directory)
    step = mgr._newest(verify=False, fallback=False) if step is None else mgr._step(step)
    meta = mgr.meta(step)
    return step, os.path.join(mgr.directory, str(step)), meta
