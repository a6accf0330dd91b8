"""Publishing a checkpoint step (:class:`zerojax.CheckpointManager`'s bookkeeping):
a save is written into a temporary directory (``.zerojax-tmp-N``) owned by this
process, sealed (every file's size and CRC-32, the chunk table, then the marker) and
renamed into place by process 0; only then are the steps it replaces deleted (a
rollback's newer steps, through a journal) and the oldest pruned (``max_to_keep``).
The other processes wait for the marker. A killed save's leftovers are removed by the
next save or open, never a live save's.

:class:`StepPublisher` holds this, over a :class:`~zerojax.checkpoint_reader.
CheckpointReader` (which steps exist); it knows nothing of what a step holds (the
format's handler, :mod:`zerojax.checkpoint_state`, writes ``state/``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import time
from collections.abc import Callable
from typing import Any

import jax

from zerojax.io.checkpoint_reader import (
    _DELETE,
    _REPLACED,
    _ROLLBACK,
    _TMP,
    FORMAT,
    MARKER,
    VALUES,
    CheckpointError,
    CheckpointReader,
    _files,
    _looks_like_a_step,
    _marker_damage,
)

_OWNER = "_zerojax_tmp_owner.json"  # in a temporary directory: who writes it
_HOST = socket.gethostname()
_STALE_S = 600  # a temporary directory without an owner record is stale after this
_live_saves: set[str] = set()  # temporary directories of this process's saves in flight
_COMMIT_TIMEOUT = float(os.environ.get("ZEROJAX_CHECKPOINT_COMMIT_TIMEOUT", 1800))


def _write_json(path: str, obj: Any) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _sync(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def _recognisable_tmp(path: str) -> bool:
    """Whether ``path`` is a temporary directory of a zerojax save: its name, and only
    files a save writes in it (anything else there is left alone)."""
    if not re.fullmatch(re.escape(_TMP) + r"\d+", os.path.basename(path)):
        return False
    try:
        names = os.listdir(path)
    except OSError:  # not a directory, or gone
        return False
    return all(n in ("state", "meta.json", MARKER, VALUES, _OWNER) or n.endswith(".tmp")
               or n.startswith("state.orbax-checkpoint-tmp")  # orbax's, killed mid-write
               or re.fullmatch(r"extra\.process-\d+\.json", n) for n in names)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # someone else's process: alive
    return True


def _tmp_is_live(path: str, at_save: bool) -> bool:
    """Whether the temporary directory ``path`` may belong to a save still running:
    one of this process's saves in flight, or one whose owner (process 0 of its job)
    runs on this host. A save on another host cannot be checked: at a save (when every
    process of this job has finished its previous save) it is stale; when a manager
    opens it is left alone. Without an owner record (killed before writing it, or made
    a moment ago by another process of the job), it is stale at a save, and when a
    manager opens once it is ``_STALE_S`` seconds old."""
    if path in _live_saves:
        return True
    try:
        with open(os.path.join(path, _OWNER)) as f:
            owner = json.load(f)
        host, pid = owner["host"], int(owner["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        if at_save:
            return False
        try:
            return time.time() - os.stat(path).st_mtime < _STALE_S
        except OSError:
            return False
    if host != _HOST:
        return not at_save
    return pid != os.getpid() and _pid_alive(pid)


def _process_index() -> int:
    """``jax.process_index()``, without starting JAX's backends before a
    ``jax.distributed.initialize`` that is still to come (0 while none ran)."""
    try:
        from jax._src import distributed as jd

        if jd.global_state.client is None:
            return 0
    except (ImportError, AttributeError):  # pragma: no cover - private module moved
        pass
    return jax.process_index()


class StepPublisher:
    """The steps of ``reader``'s directory as a save changes them: refuse a step that
    would overwrite one silently, open a save's temporary directory, seal it, put it in
    place atomically, delete what it replaces and prune; finish or undo what a killed
    save left half done."""

    def __init__(self, reader: CheckpointReader):
        self.reader = reader  # which steps exist (its _scan, _damaged)

    @property
    def directory(self) -> str:
        return self.reader.directory

    def _known(self) -> tuple[dict[int, int], set[int]]:
        """The complete steps, and those with the damaged ones (zerojax's too)."""
        steps = self.reader._scan()
        return steps, set(steps) | set(self.reader._damaged)

    def check_new(self, step: int, overwrite: bool) -> None:
        """Refuse to save ``step`` over an existing or newer step without
        ``overwrite``, or into a directory entry zerojax did not write."""
        steps, known = self._known()
        newer = sorted(s for s in known if s >= step)
        if newer and not overwrite:
            damaged = self.reader._damaged
            what = (f"step {step} exists" if step in steps else
                    f"step {step} exists (damaged: {damaged[step]})" if step in known
                    else f"step {step} is below the newest step {max(known)}")
            raise CheckpointError(
                f"{what} in {self.directory} (complete steps: {sorted(steps)}); nothing was "
                f"written. Pass overwrite=True to replace step {step} and delete the newer "
                f"steps {[s for s in newer if s > step]} once it is written (a rollback), "
                "or save to another directory.")
        final = os.path.join(self.directory, str(step))
        if step not in known and os.path.lexists(final):
            raise CheckpointError(
                f"cannot save step {step}: {final} exists and zerojax did not write it (it "
                f"holds no {MARKER}); nothing was written and no step was touched. Move it "
                f"out of {self.directory}, or save to another directory.")

    def begin(self, step: int, token: str, meta: dict, extra_json: str) -> str:
        """Open the temporary directory of save ``token`` of ``step`` (made live: no
        cleanup removes it) with its owner record, this process's ``extra`` and (process
        0) ``meta``; returns its path. Process 0 first removes failed or killed saves'
        leftovers (every process has finished the previous save: other temporaries are
        stale); this step's own temporary too with one process (with several, the
        others may be writing into it already: it is reused)."""
        tmp = os.path.join(self.directory, f"{_TMP}{step}")
        me = jax.process_index()
        if me == 0:
            self.cleanup(at_save=True, keep=tmp if jax.process_count() > 1 else None)
        _live_saves.add(tmp)
        os.makedirs(tmp, exist_ok=True)
        if me == 0:
            _write_json(os.path.join(tmp, _OWNER),
                        {"host": _HOST, "pid": os.getpid(), "save": token})
        with open(os.path.join(tmp, f"extra.process-{me}.json"), "w") as f:
            f.write(extra_json)
        if me == 0:
            _write_json(os.path.join(tmp, "meta.json"), meta)
        return tmp

    def cleanup(self, at_save: bool, keep: str | None = None) -> None:
        """Process 0: finish what a killed save left half done, and remove the
        temporary directories of failed or killed saves (only recognisable ones, never
        a live save's: see :func:`_tmp_is_live`) and ``keep``'s aside. A rollback's
        journal whose new step is in place deletes the newer steps it names; a step
        moved aside whose replacement never moved in is put back."""
        d = self.directory
        try:
            names = sorted(os.listdir(d))
        except OSError:
            return
        for name in names:
            path = os.path.join(d, name)
            try:
                if name.startswith(_ROLLBACK) and name.endswith(".json"):
                    self.end_rollback(path)
                elif name.startswith(_REPLACED):
                    m = re.fullmatch(re.escape(_REPLACED) + r"(\d+)-\d+", name)
                    if m and not os.path.lexists(os.path.join(d, m.group(1))):
                        os.replace(path, os.path.join(d, m.group(1)))  # put back
                    else:
                        shutil.rmtree(path, ignore_errors=True)
                elif name.startswith(_DELETE):
                    shutil.rmtree(path, ignore_errors=True)
                elif (name.startswith(_TMP) and path != keep and _recognisable_tmp(path)
                      and not _tmp_is_live(path, at_save)):
                    self._delete(path, name[len(_TMP):])
            except OSError:  # another process got there first; the next save retries
                pass

    def _delete(self, path: str, label: Any) -> None:
        """Remove ``path``: atomically out of the way, then deleted."""
        gone = os.path.join(self.directory, f"{_DELETE}{label}-{time.time_ns()}")
        os.replace(path, gone)
        shutil.rmtree(gone, ignore_errors=True)

    def end_rollback(self, journal: str) -> None:
        """A rollback's journal: when its step is in place (its marker holds the
        journal's token), delete the newer steps it names; then drop the journal."""
        with open(journal) as f:
            j = json.load(f)
        root = os.path.join(self.directory, str(j["step"]))
        try:
            with open(os.path.join(root, MARKER)) as f:
                done = json.load(f).get("token") == j["token"]
        except (OSError, ValueError):
            done = False
        if done:
            for s in j["doomed"]:
                path = os.path.join(self.directory, str(s))
                if os.path.isdir(path) and (_marker_damage(path, s) is None or
                                            _looks_like_a_step(path)):
                    self._delete(path, s)
        os.remove(journal)

    @staticmethod
    def seal(tmp: str, step: int, token: str, checksums: Callable, chunks: Callable) -> None:
        """Checksum every file of the save in ``tmp`` (``checksums``: the reader's
        ``_checksums``), record each array chunk's CRC-32 (``chunks``: the format's
        table of where they lie in the data files) and write the marker last."""
        n = jax.process_count()
        for name in os.listdir(tmp):  # a crashed earlier run's extra of a larger job
            m = re.fullmatch(r"extra\.process-(\d+)\.json", name)
            if m and int(m.group(1)) >= n:
                os.remove(os.path.join(tmp, name))
        try:
            os.remove(os.path.join(tmp, _OWNER))  # not part of the step
        except FileNotFoundError:
            pass
        names = [f for f in _files(tmp)
                 if f not in (MARKER, VALUES) and not f.endswith(".tmp")]
        table = chunks(os.path.join(tmp, "state"))  # where each array chunk lies
        files, chunk_crcs = checksums(
            tmp, names, {n: [(o, ln) for o, ln, _ in c] for n, c in table.items()})
        _write_json(os.path.join(tmp, VALUES), {
            n: [[o, ln, crc, key] for (o, ln, key), crc in zip(c, chunk_crcs[n])]
            for n, c in table.items() if n in chunk_crcs})
        files.update(checksums(tmp, [VALUES])[0])
        marker = {"zerojax_checkpoint": FORMAT, "step": step, "token": token,
                  "time": time.time(), "files": files}
        _write_json(os.path.join(tmp, MARKER), marker)

    def publish(self, step: int, tmp: str, final: str, token: str, overwrite: bool,
                max_to_keep: int | None, checksums: Callable, chunks: Callable) -> None:
        """Process 0: seal ``tmp``, rename it into place; only then delete the steps it
        replaces (a rollback's newer ones) and prune to ``max_to_keep``.

        Never loses a step: the step it replaces is moved aside (``.zerojax-replaced-``)
        and put back if the rename fails; the newer steps a rollback deletes are named
        in a journal (``.zerojax-rollback-N.json``) and deleted after the new step is in
        place, so a process killed at any point leaves either the old steps or the new
        step (the next save or open finishes or undoes what was half done)."""
        self.seal(tmp, step, token, checksums, chunks)
        d = self.directory
        steps, known = self._known()
        if os.path.lexists(final) and step not in known:
            raise CheckpointError(
                f"step {step} could not be put in place: {final} exists and zerojax did "
                f"not write it (it appeared after save({step}) was called); no step was "
                f"removed (complete steps: {sorted(steps)}). Move it out of {d}.")
        doomed = sorted(s for s in known if s > step) if overwrite else []
        journal = os.path.join(d, f"{_ROLLBACK}{step}.json")
        if doomed:
            _write_json(journal, {"step": step, "token": token, "doomed": doomed})
        aside = None
        if os.path.lexists(final):  # the step replaced (overwrite=True): aside, not gone
            aside = os.path.join(d, f"{_REPLACED}{step}-{time.time_ns()}")
            os.replace(final, aside)
        try:
            os.replace(tmp, final)
        except OSError as e:
            if aside is not None:
                os.replace(aside, final)
            if doomed:
                os.remove(journal)
            raise CheckpointError(
                f"step {step} could not be put in place: renaming {tmp} to {final} failed "
                f"({e}); no step was removed (complete steps: {sorted(steps)}).") from e
        _sync(d)
        if doomed:  # the new step is on disk: the rollback's newer steps go now
            self.end_rollback(journal)
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
        self.prune(max_to_keep)

    def prune(self, max_to_keep: int | None) -> None:
        """Keep the newest ``max_to_keep`` complete steps (None: all); finish deleting
        whatever is being deleted."""
        keep = sorted(self.reader._scan())
        if max_to_keep is not None:
            for s in keep[:-max_to_keep]:
                os.replace(os.path.join(self.directory, str(s)),
                           os.path.join(self.directory, f"{_DELETE}{s}-{time.time_ns()}"))
        for name in os.listdir(self.directory):
            if name.startswith(_DELETE):
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

    def await_publish(self, step: int, final: str, token: str) -> None:
        """Other processes: wait until process 0 has put this save's step in place."""
        deadline = time.monotonic() + _COMMIT_TIMEOUT
        marker = os.path.join(final, MARKER)
        while time.monotonic() < deadline:
            try:
                with open(marker) as f:
                    if json.load(f).get("token") == token:
                        return
            except (OSError, ValueError):
                pass
            time.sleep(0.05)
        raise CheckpointError(
            f"process 0 did not complete step {step} in {self.directory} within "
            f"{_COMMIT_TIMEOUT:.0f} s (ZEROJAX_CHECKPOINT_COMMIT_TIMEOUT); did it fail or "
            "save a different step?")
