"""Start a multi-process zerojax run on this machine (torchrun-like).

    zerojax launch --nproc 2 --devices-per-proc 4 train.py --stage 3
    python -m zerojax.launch ...        # the same (the name earlier docs use)
    python -m zerojax.cli.launch ...    # the same

starts ``--nproc`` copies of ``train.py`` (with its arguments), each told its rank and
the coordinator through ``ZEROJAX_COORDINATOR_ADDRESS`` / ``ZEROJAX_NUM_PROCESSES`` /
``ZEROJAX_PROCESS_ID``, which :func:`zerojax.distributed.initialize` reads. Every line
a process prints is prefixed with its rank (``[1] ...``). The launcher exits with 0
when every process does; when one fails (an exception: zerojax.distributed makes it exit
at once; a kill; no step for ``--progress-timeout`` seconds) it names it and its last
error line, gives the others ``--grace`` seconds to end on their own, then kills what is
left, and exits non-zero. A process that exits 0 while the others still run is named as
the one that left first when they then fail. A coordinator port in use is refused
before anything starts. No process outlives the launcher.

SIGTERM to the launcher (what SLURM and cloud schedulers send a job before they kill
it) is forwarded to every process, which then have ``--term-grace`` seconds (120) to
save and end (``zerojax.preemption``: every process stops at the same step); the
launcher exits 0 if every process does, else names the one that failed, and kills
what still runs after the grace. A second SIGTERM, or SIGINT, kills them at once.
When only the processes get SIGTERM (a scheduler that signals every task), they stop
the same way and the launcher exits 0 when they all do.

``--devices-per-proc N`` runs each process on the CPU backend with N simulated
devices (``XLA_FLAGS=--xla_force_host_platform_device_count=N``, gloo collectives):
a stand-in for hosts with N accelerators each. Without it the processes see this
machine's devices as they are (e.g. set ``CUDA_VISIBLE_DEVICES`` per process yourself).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from zerojax.runtime.distributed import (
    ENV_COORDINATOR,
    ENV_HEARTBEAT,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    ENV_PROGRESS,
    port_in_use,
)

DEFAULT_TERM_GRACE = 120.0  # s: long enough to save a large state; schedulers give 30-120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _number(kind, minimum: float, strict: bool):
    """An argparse type: ``kind(text)``, above ``minimum`` (``strict``) or at least it."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (value > minimum if strict else value >= minimum):
            raise argparse.ArgumentTypeError(f"{text!r} must be {'>' if strict else '>='} "
                                             f"{minimum}")
        return value
    return parse


def _positive(kind):
    return _number(kind, 0, strict=True)


def _non_negative(kind):
    return _number(kind, 0, strict=False)


def _port(text: str) -> int:
    value = _non_negative(int)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (0-65535)")
    return value


def build_parser(prog: str = "zerojax launch") -> argparse.ArgumentParser:
    """The launcher's arguments; ``prog``: the name it was started by, for messages."""
    from zerojax.cli.args import HelpFormatter

    p = argparse.ArgumentParser(
        prog=prog, formatter_class=HelpFormatter,
        description="Run SCRIPT in NPROC processes on this machine as one zerojax/JAX "
                    "multi-process job (process 0 hosts the coordinator on 127.0.0.1). "
                    "Output lines are prefixed with the rank; the exit status is non-zero "
                    "if any process fails, and no process is left running.",
        epilog=f"example: {prog} --nproc 2 --devices-per-proc 4 "
               "examples/multiprocess.py --steps 20  (also: python -m zerojax.launch, "
               "python -m zerojax.cli.launch)")
    p.add_argument("--nproc", type=_positive(int), required=True,
                   help="number of processes (stand-ins for hosts)")
    p.add_argument("--devices-per-proc", type=_positive(int), default=None,
                   help="simulated CPU devices per process (CPU backend, gloo collectives); "
                        "omit to use the machine's devices as they are")
    p.add_argument("--port", type=_port, default=0,
                   help="coordinator port on 127.0.0.1 (0, the default: a free one)")
    seconds = (  # the timeouts and graces: flag, type, default, help
        ("--heartbeat-timeout", _positive(int), 30,
         "seconds without a heartbeat before a process counts as dead and the others are "
         "ended with an error naming it (default 30)"),
        ("--progress-timeout", _non_negative(float), None,
         "seconds a process may go without a training step before it reports itself "
         f"stuck and exits, ending the job (sets {ENV_PROGRESS}; default: "
         "zerojax.distributed's, 600; 0: off)"),
        ("--grace", _positive(float), 5.0,
         "seconds the other processes get to end on their own after one fails, before "
         "they are killed"),
        ("--term-grace", _positive(float), DEFAULT_TERM_GRACE,
         "seconds the processes get to save a checkpoint and end after the launcher "
         "forwards them a SIGTERM it got (a scheduler's preemption notice), before they "
         f"are killed (default {DEFAULT_TERM_GRACE:g})"))
    for flag, kind, default, text in seconds:
        p.add_argument(flag, type=kind, default=default, help=text)
    p.add_argument("script", help="the Python script each process runs")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    return p


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


_UNHEALTHY = "tasks are unhealthy (stopped sending heartbeats):"
_LEADER_LOST = "Either the leader task was preempted/died"


_SETTLE = 1.0  # seconds to let near-simultaneous failures all end before naming one
# Errors a process gets because a peer failed or left, not of its own making.
_PEER_INDUCED = re.compile(r"Gloo|Connection reset|Connection refused|Connection closed|"
                           r"unhealthy|DEADLINE_EXCEEDED|leader task|coordination service|"
                           r"Socket closed|NCCL|barrier|its peer process", re.IGNORECASE)


_SETTLE_STALL = 5.0  # seconds for every stalled process to report its step count
_STALLED = re.compile(r"made no training step for .* after (\d+) steps")


def _stall_steps(error: str) -> int | None:
    """The step count in zerojax.distributed's progress-timeout report, or None."""
    match = _STALLED.search(error)
    return int(match.group(1)) if match else None


def _peer_induced(error: str) -> bool:
    return bool(_PEER_INDUCED.search(error))


_ERROR_LINE = re.compile(r"^(zerojax\.distributed: .*|[A-Za-z_][\w.]*(Error|Exception|Interrupt"
                         r"|Exit)\b.*)$")


_EXITING = re.compile(r"^zerojax\.distributed: process \d+ of \d+ is exiting")
_PREEMPTED = re.compile(r"stopped for preemption")


def _pump(rank: int, stream, out, lock: threading.Lock, lost: dict, errors: dict,
          exiting: dict, preempted: set) -> None:
    """Copy a process's output lines, prefixed with its rank; note the peers JAX's
    coordination service reports dead (the line after ``_UNHEALTHY`` lists them) and the
    process's last error line (its exception, or zerojax.distributed's own report)."""
    expect = False
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        match = _ERROR_LINE.match(line.strip())
        if _EXITING.match(line.strip()):
            exiting.setdefault(rank, time.monotonic())
            if _PREEMPTED.search(line):  # stopped at the agreed step, not early
                preempted.add(rank)
        elif match and (match.group(1).startswith("zerojax.distributed: ")
                        or not errors.get(rank, "").startswith("zerojax.distributed: ")):
            # zerojax.distributed's report, less its advice: what happened, in one line
            errors[rank] = re.split(r"; exiting now|: stuck \(", match.group(1))[0][:500]
        if expect:
            ids = [int(t) for t in re.findall(r"\d+", line)]
            if ids and re.fullmatch(r"[\d,\s]+", line):
                lost.setdefault(rank, set()).update(ids)
            expect = False
        if line.rstrip().endswith(_UNHEALTHY):
            expect = True
        if _LEADER_LOST in line:  # the coordinator (process 0) itself is gone
            lost.setdefault(rank, set()).add(0)
        with lock:
            out.write(f"[{rank}] {line}\n")
            out.flush()
    stream.close()


def _unknown_option(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """The first launcher option before the script that the launcher does not have
    (``--nrpoc``), with the closest one it has: argparse would report a missing
    --nproc, or take the misspelling for the script's."""
    import difflib

    known = parser._option_string_actions
    i = 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("-") or token == "-":
            return None  # the script: the rest is its own
        name = token.split("=", 1)[0]
        if name == "--":
            return None
        if name not in known:
            close = difflib.get_close_matches(name, [k for k in known if k.startswith("--")],
                                              n=1)
            return (f"unknown option {name!r}" + (f": did you mean {close[0]}?" if close
                                                   else "") + " (the launcher's options "
                    "come before the script; 'zerojax launch --help' lists them)")
        action = known[name]
        i += 1 if ("=" in token or action.nargs == 0) else 2
    return None


def _refusal(args: argparse.Namespace, prog: str) -> str | None:
    """Why the job cannot start (its script is missing, --port is taken), or None."""
    if os.path.isdir(args.script):
        scripts = sorted(f for f in os.listdir(args.script) if f.endswith(".py"))[:3]
        return (f"{prog}: {args.script!r} is a directory; pass the Python script each "
                "process runs (a .py file), e.g. " + (", ".join(
                    os.path.join(args.script, f) for f in scripts) if scripts else
                    os.path.join(args.script, "train.py")) + ".")
    if not os.path.isfile(args.script):
        return f"{prog}: script {args.script!r} not found."
    if args.port:
        busy = port_in_use(args.port)
        if busy:
            return (f"{prog}: --port {args.port} is already in use on this machine "
                    f"({busy}); process 0 would serve the coordinator there. Pass another "
                    "--port, or --port 0 (the default) for a free one.")
    return None


def _environment(args: argparse.Namespace, port: int) -> dict:
    """Every process's environment but its rank: the coordinator, the job's size and
    timeouts, and with --devices-per-proc the CPU backend's simulated devices."""
    base = dict(os.environ)
    base.update({ENV_COORDINATOR: f"127.0.0.1:{port}", ENV_NUM_PROCESSES: str(args.nproc),
                 ENV_HEARTBEAT: str(args.heartbeat_timeout), "PYTHONUNBUFFERED": "1"})
    if args.progress_timeout is not None:
        base[ENV_PROGRESS] = f"{args.progress_timeout:g}"
    if args.devices_per_proc:
        flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                       base.get("XLA_FLAGS", ""))
        base["XLA_FLAGS"] = (f"{flags} --xla_force_host_platform_device_count="
                             f"{args.devices_per_proc}").strip()
        base["JAX_PLATFORMS"] = "cpu"
    return base


class _Job:
    """One launch's processes and what the launcher has seen of them: their error
    lines and the peers they lost (:func:`_pump`), when each ended, a SIGTERM it
    forwarded, the process that left first and the one that failed first.

    :meth:`start` spawns them, :meth:`watch` polls them until all have ended (killing
    what outlives a grace), :meth:`report` names the failure and gives the exit status.
    """

    def __init__(self, args: argparse.Namespace, out):
        self.args, self.out, self.grace = args, out, args.grace
        self.procs: list[subprocess.Popen] = []
        self.pumps: list[threading.Thread] = []
        self.lock = threading.Lock()
        self.lost: dict[int, set] = {}
        self.errors: dict[int, str] = {}
        self.exiting: dict[int, float] = {}
        self.preempted: set[int] = set()  # ranks that announced they stopped for preemption
        self.term: dict[str, float] = {}  # "at": when the launcher forwarded a SIGTERM it got
        self.ended: dict[int, float] = {}  # rank -> when its process ended (waiter threads)
        self.first_failure = self.deadline = self.left = self.settle = None
        self.exiting_note: dict[str, bool] = {}
        self.old_handlers: dict = {}

    def say(self, text: str, flush: bool = True) -> None:
        with self.lock:
            self.out.write(text)
            if flush:
                self.out.flush()

    def kill_all(self, sig=signal.SIGKILL) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass

    def on_signal(self, signum, frame) -> None:
        if signum == signal.SIGTERM and not self.term:
            # A scheduler's notice: pass it on, let the processes save and end.
            # (no output here: the main thread may hold the output lock)
            self.term["at"] = time.monotonic()
            self.kill_all(signal.SIGTERM)
            return
        self.kill_all()
        raise SystemExit(128 + signum)

    def _restore_handlers(self) -> None:
        for s, h in self.old_handlers.items():
            signal.signal(s, h)

    def start(self, base: dict) -> None:
        """Spawn the processes (rank r with ``base`` and its rank), each with a thread
        copying its output and one noting when it ends; SIGTERM/SIGINT handled."""
        self.old_handlers = {s: signal.signal(s, self.on_signal)
                             for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            for rank in range(self.args.nproc):
                env = dict(base, **{ENV_PROCESS_ID: str(rank)})
                proc = subprocess.Popen([sys.executable, "-u", self.args.script,
                                         *self.args.args], env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, start_new_session=True)
                self.procs.append(proc)
                t = threading.Thread(target=_pump, daemon=True,
                                     args=(rank, proc.stdout, self.out, self.lock, self.lost,
                                           self.errors, self.exiting, self.preempted))
                t.start()
                self.pumps.append(t)
        except BaseException:
            self.kill_all()
            self._restore_handlers()
            raise
        if self.term:  # a SIGTERM while they were starting: the later ones get it too
            self.kill_all(signal.SIGTERM)
        for rank, proc in enumerate(self.procs):
            threading.Thread(target=self._wait, args=(rank, proc), daemon=True).start()

    def _wait(self, rank: int, proc: subprocess.Popen) -> None:
        proc.wait()
        self.ended.setdefault(rank, time.monotonic())

    def watch(self) -> None:
        """Poll until every process has ended; then kill what is left, wait for them
        and their output, and put the signal handlers back."""
        try:
            while True:
                codes = [p.poll() if r in self.ended else None
                         for r, p in enumerate(self.procs)]
                running = [r for r, c in enumerate(codes) if c is None]
                if self.term and "said" not in self.term:
                    self.term["said"] = time.monotonic()
                    self.say(f"[launch] got SIGTERM: forwarded it to every process; they "
                             f"get {self.args.term_grace:g} s to save and end "
                             "(--term-grace)\n")
                self._note_left(codes, running)
                self._note_failure(codes, running)
                if not running:
                    break
                self._kill_overdue(running)
                time.sleep(0.05)
        finally:
            self.kill_all()
            for p in self.procs:
                p.wait()
            for t in self.pumps:
                t.join(timeout=5)
            self._restore_handlers()

    def _note_left(self, codes: list, running: list) -> None:
        """A script that ended (exit 0, or announced by zerojax.distributed before JAX's
        shutdown waits for the peers) while others still run: noted, and said when the
        others do not follow within the grace."""
        term, ended = self.term, self.ended
        if self.left is None and self.first_failure is None and running and not term:
            done = {r: ended[r] for r, c in enumerate(codes) if c == 0}
            done.update({r: t for r, t in self.exiting.items() if r not in ended})
            done = {r: t for r, t in done.items() if r not in self.preempted}
            if done and [r for r in running if r not in done]:
                rank = min(done, key=done.get)
                self.left = (rank, done[rank])
        left = self.left
        if (left is not None and "said" not in self.exiting_note and running and not term
                and self.first_failure is None
                and time.monotonic() - left[1] > max(self.grace, 5.0)):
            # the others did not follow within the grace: not a normal finish (in one,
            # the processes end within a moment of each other)
            self.exiting_note["said"] = True
            self.say(f"[launch] process {left[0]}'s script ended "
                     f"{time.monotonic() - left[1]:.0f} s ago while processes "
                     f"{running} still run\n")

    def _note_failure(self, codes: list, running: list) -> None:
        """The first failure, named once the near-simultaneous ones have settled."""
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if self.first_failure is not None or not failed:
            return
        # A peer's failure makes the others fail too, within milliseconds (a reset
        # connection): let them all end, then name the one whose error is its own, not a
        # lost peer's. A stalled job: every process stops making steps and reports it
        # within a second or so of the others; the one that made the fewest steps is the
        # one the others wait for.
        errors, ended = self.errors, self.ended
        now = time.monotonic()
        self.settle = self.settle or now + _SETTLE
        stalled = {r: _stall_steps(errors.get(r, "")) for r in range(len(self.procs))}
        stalled = {r: n for r, n in stalled.items() if n is not None}
        if stalled and any(r not in stalled for r in running):
            self.settle = max(self.settle, min(ended[r] for r in failed) + _SETTLE_STALL)
        if now >= self.settle or not running:
            candidates = sorted(set(failed) | set(stalled))

            rank = min(candidates, key=lambda r, stalled=stalled, now=now: (
                _peer_induced(errors.get(r, "")), r in stalled, stalled.get(r, 0),
                ended.get(r, now)))
            code = codes[rank] if codes[rank] is not None else 1
            self.first_failure = (rank, code, ended.get(rank, now))
            self.deadline = now + self.grace
            self.say(f"[launch] process {rank} failed ({_describe(code)})"
                     f"; the others get {self.grace:g} s to end\n")

    def _kill_overdue(self, running: list) -> None:
        """Kill what still runs --term-grace after a SIGTERM, or --grace after the
        first failure."""
        term, term_grace = self.term, self.args.term_grace
        if term and "killed" not in term and time.monotonic() > term["at"] + term_grace:
            term["killed"] = time.monotonic()
            self.say(f"[launch] killing processes still running {term_grace:g} "
                     f"s after SIGTERM (--term-grace): {running}\n")
            self.kill_all()
        if self.deadline is not None and time.monotonic() > self.deadline:
            self.say(f"[launch] killing processes still running {self.grace:g} s after "
                     f"process {self.first_failure[0]} failed: {running}\n", flush=False)
            self.kill_all()

    def report(self) -> int:
        """Say how the job ended (who left first, who failed first and why, who was
        lost); the launcher's exit status."""
        term, ended, left = self.term, self.ended, self.left
        if self.first_failure is None:
            if term:
                self.say(f"[launch] every process ended with status 0 "
                         f"{max(ended.values()) - term['at']:.1f} s after SIGTERM\n")
            return 0
        rank, code, when = self.first_failure
        survivors = [r for r in range(self.args.nproc) if r != rank]
        out = self.out
        with self.lock:
            if left is not None and left[1] <= when:
                then = (f"then waited {when - left[1]:.1f} s in JAX's shutdown for its peers"
                        if left[0] == rank else f"{when - left[1]:.1f} s before process "
                        f"{rank} failed")
                out.write(f"[launch] process {left[0]} left first: its script ended while "
                          f"the others still ran, and {then} (a rank that returns early "
                          "leaves its peers waiting in a collective)\n")
            if "killed" in term:
                out.write(f"[launch] the processes did not all end within --term-grace "
                          f"{self.args.term_grace:g} s of SIGTERM and were killed\n")
            why = f": {self.errors[rank]}" if rank in self.errors else ""
            out.write(f"[launch] process {rank} failed first ({_describe(code)}){why}\n")
            out.write(f"[launch] processes {survivors} ended {time.monotonic() - when:.1f} "
                      f"s after process {rank} failed\n")
            for reporter, ids in sorted(self.lost.items()):
                out.write(f"[launch] process {reporter} was ended by the coordination "
                          f"service: lost process(es) {sorted(ids)}\n")
            out.flush()
        return code if 0 < code < 256 else 128 + (-code if code < 0 else 1)


def launch(argv: list[str] | None = None, out=None, prog: str = "zerojax launch") -> int:
    """Run the launcher (``argv`` as on the command line); returns its exit status."""
    parser = build_parser(prog)
    unknown = _unknown_option(parser, list(sys.argv[1:] if argv is None else argv))
    if unknown:
        parser.print_usage(sys.stderr)
        print(f"{prog}: error: {unknown}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    refusal = _refusal(args, prog)
    if refusal:
        print(refusal, file=sys.stderr)
        return 2
    job = _Job(args, out or sys.stdout)
    job.start(_environment(args, args.port or _free_port()))
    job.watch()
    return job.report()


def main(argv: list[str] | None = None, prog: str = "python -m zerojax.cli.launch") -> None:
    sys.exit(launch(argv, prog=prog))


if __name__ == "__main__":
    main()
