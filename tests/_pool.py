"""Pools of gloo worker processes for fast multi-rank tests (and benchmarks).

Spawning a world of processes costs ~2.5 s per test on a 2-core machine (mostly `import torch`
in every child). :class:`DistPool` pays that once per world size: it keeps one set of worker
processes per world size, each with an initialized gloo default process group on CPU, and runs
many "module:function" calls on them. Workers are forked from a forkserver that has torch
imported, so even a restart costs ~0.1-0.3 s. :func:`spawn_world` runs one call on fresh
processes, for tests that kill a rank on purpose.

Every call has a timeout. A rank that raises, dies or hangs makes the call raise an error that
names the ranks, with their tracebacks or (hung) :mod:`faulthandler` stacks; the world is then
killed and restarted lazily, as a failed call may leave the ranks out of step in their
collectives. Usable outside pytest (no pytest import):

    with DistPool() as pool:
        sums = pool.run(world_size=4, fn="tests.dist_cases:my_case", kwargs={"n": 3})
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import multiprocessing
import multiprocessing.connection as mp_connection
import os
import pickle
import random
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

#: Repository root: put first on the workers' ``sys.path`` so ``tests.*`` and ``dmuon`` import.
REPO_ROOT = str(Path(__file__).resolve().parent.parent)

# Environment of every worker, set before torch is imported there. One thread per rank: the
# machine has 2 cores shared by up to 8 ranks, and oversubscribed OpenMP makes gloo tests crawl.
_WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
_STACK_DUMP_WAIT_S = 1.0  # longest wait for hung ranks' stack dumps; they take ~10 ms


class DistPoolError(RuntimeError):
    """A multi-rank call failed: a rank raised, died, or did not answer in time."""


class RankTimeoutError(DistPoolError):
    """Some ranks did not answer within the call's timeout (a hang)."""


@dataclasses.dataclass(frozen=True, slots=True)
class RankExit:
    """How a rank of :func:`spawn_world` ended when it did not return a value.

    Attributes:
        rank: Global rank of the process.
        exitcode: Process exit code; ``-N`` means killed by signal ``N``.
        traceback: Traceback text if the function raised, else ``None`` (e.g. the rank died).
    """

    rank: int
    exitcode: int | None
    traceback: str | None


def resolve_fn(fn: str) -> Callable[..., Any]:
    """Import the function named by a ``"package.module:function"`` string.

    Raises:
        ValueError: If ``fn`` has no single ``:`` or the attribute is not callable.
        ImportError: If the module cannot be imported.
    """
    _check_args(1, fn)
    module_name, _, attr = fn.partition(":")
    target = getattr(importlib.import_module(module_name), attr, None)
    if not callable(target):
        raise ValueError(f"{fn!r}: module {module_name!r} has no callable named {attr!r}")
    return target


def _check_args(world_size: int, fn: str, kwargs: dict[str, Any] | None = None) -> None:
    """Validate the arguments shared by :meth:`DistPool.run` and :func:`spawn_world`."""
    if kwargs is not None and ({"rank", "world_size"} & set(kwargs)):
        raise ValueError(f"kwargs must not contain 'rank' or 'world_size' (every rank receives "
                         f"its own), got keys {sorted(kwargs)}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    module_name, sep, attr = fn.partition(":") if isinstance(fn, str) else ("", "", "")
    if not sep or not module_name or not attr or ":" in attr:
        raise ValueError(f"fn must look like 'package.module:function', got {fn!r}")


def _context(start_method: str) -> Any:
    """Multiprocessing context for workers; the forkserver preloads torch so forks are cheap.

    Forking the forkserver is safe: it imports torch but never runs an op, so no OpenMP pool
    exists yet (OpenBLAS's thread is handled by its fork handlers). On 2 busy cores a 4-rank
    world starts in ~0.1 s so, ~6 s with "spawn". The preload list is process-wide and only
    applies if the forkserver is not running yet.

    Raises:
        ValueError: If ``start_method`` is not ``"forkserver"`` or ``"spawn"``.
    """
    if start_method not in ("forkserver", "spawn"):
        raise ValueError(f"start_method must be 'forkserver' or 'spawn' (fork is unsafe after "
                         f"torch starts threads), got {start_method!r}")
    ctx = multiprocessing.get_context(start_method)
    if start_method == "forkserver":
        # pytest too when running under it: test modules imported by workers import it (~0.15 s
        # per fresh worker otherwise).
        extra = ["pytest"] if "pytest" in sys.modules else []
        ctx.set_forkserver_preload(["torch", "torch.distributed", "numpy", *extra])
    return ctx


def _init_worker(rank: int, world_size: int, port: int, stack_file: str, sys_path: list[str],
                 pg_timeout_s: float) -> None:
    """Set up one rank: parent watchdog, environment, stack dumps, gloo default process group."""
    import faulthandler
    import threading

    parent = multiprocessing.parent_process()
    if parent is not None:  # die with the parent even when stuck in a C++ collective
        threading.Thread(target=lambda: (mp_connection.wait([parent.sentinel]), os._exit(3)),
                         name="dmuon-pool-parent-watch", daemon=True).start()
    os.environ.update(_WORKER_ENV)
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world_size)
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo resolves the hostname otherwise
    sys.path[:0] = [p for p in sys_path if p not in sys.path]
    # faulthandler keeps a reference to the file, which stays open for the process life.
    stack_dump = open(stack_file, "w")  # noqa: SIM115
    faulthandler.register(signal.SIGUSR1, file=stack_dump, all_threads=True)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=pg_timeout_s))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=pg_timeout_s))


def _call(fn: str, rank: int, world_size: int, kwargs: dict[str, Any],
          seed: int) -> tuple[str, bytes]:
    """Seed and run one call on this rank; return ``(kind, pickled (kind, value or text))``."""
    import numpy
    import torch

    try:
        random.seed(seed)
        numpy.random.seed(seed)
        torch.manual_seed(seed)
        value = resolve_fn(fn)(rank=rank, world_size=world_size, **kwargs)
    except BaseException:  # noqa: BLE001 - any failure goes back to the parent as text
        return "err", pickle.dumps(("err", traceback.format_exc()))
    try:
        return "ok", pickle.dumps(("ok", value))
    except Exception:  # noqa: BLE001
        return "err", pickle.dumps(("err", f"the value returned by {fn} on rank {rank} cannot be "
                                    f"pickled (return tensors, numbers or plain containers):\n"
                                    f"{traceback.format_exc()}"))


def _cleanup_after_call() -> None:
    """Local, collective-free reset between calls: destroy the subgroups the call created.
    (No ``gc.collect()``: 0.1-0.3 s per rank per call once torch is imported.)"""
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world

    for pg in list(_world.pg_map):
        if pg is not dist.group.WORLD:
            dist.destroy_process_group(pg)
    torch.set_grad_enabled(True)
    torch.set_num_threads(1)


def _worker_main(rank: int, world_size: int, port: int, conn: Any, stack_file: str,
                 sys_path: list[str], pg_timeout_s: float, once: tuple | None = None) -> None:
    """Pool worker (``once is None``): report ``ready``, then answer pickled ``(fn, kwargs,
    seed)`` requests until ``None`` or EOF. With ``once`` (such a triple, for
    :func:`spawn_world`): run it, report, exit with 0 (returned) or 1 (raised)."""
    try:
        _init_worker(rank, world_size, port, stack_file, sys_path, pg_timeout_s)
        kind, answer = "ready", pickle.dumps(("ready", None))
    except BaseException:  # noqa: BLE001
        kind, answer = "err", pickle.dumps(("err", traceback.format_exc()))
    if once is not None and kind == "ready":
        kind, answer = _call(once[0], rank, world_size, once[1], once[2])
    serve = once is None and kind == "ready"
    try:
        conn.send_bytes(answer)
        while serve:
            request = pickle.loads(conn.recv_bytes())
            if request is None:
                break
            kind, answer = _call(request[0], rank, world_size, request[1], request[2])
            if kind == "ok":
                try:
                    _cleanup_after_call()
                except BaseException:  # noqa: BLE001
                    text = "cleanup after the call failed:\n" + traceback.format_exc()
                    kind, answer = "err", pickle.dumps(("err", text))
            conn.send_bytes(answer)
    except (EOFError, OSError):  # the parent went away or closed the pipe
        pass
    sys.stdout.flush(), sys.stderr.flush()
    # Skip interpreter teardown: gloo's destructors can block on peers that died or hang.
    os._exit(0 if serve or kind == "ok" else 1)


class _World:
    """One set of ``world_size`` worker processes and the TCP store they rendezvous on."""

    def __init__(self, world_size: int, ctx: Any, pg_timeout_s: float,
                 once: tuple | None = None) -> None:
        import torch.distributed as dist

        self.world_size = world_size
        # The parent hosts the store on a port the OS picks: no free-port race between ranks.
        self._store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False,
                                    timeout=timedelta(seconds=pg_timeout_s))
        self.port = self._store.port
        self._tmp = tempfile.TemporaryDirectory(prefix=f"dmuon-pool-w{world_size}-")
        self.stack_files = [f"{self._tmp.name}/rank{r}.stack" for r in range(world_size)]
        self.conns, self.procs = [], []  # parent pipe ends and processes, by rank
        try:
            for rank in range(world_size):
                parent_end, child_end = ctx.Pipe(duplex=True)
                self.conns.append(parent_end)
                proc = ctx.Process(
                    target=_worker_main, name=f"dmuon-pool-w{world_size}-r{rank}", daemon=True,
                    args=(rank, world_size, self.port, child_end, self.stack_files[rank],
                          [REPO_ROOT, *sys.path], pg_timeout_s, once))
                proc.start()
                child_end.close()
                self.procs.append(proc)
        except BaseException:
            self.kill()
            raise

    def collect(self, timeout_s: float, grace_s: float | None) -> tuple[dict, dict, list[int]]:
        """Wait up to ``timeout_s`` seconds for one message per rank; once a rank raised or
        died, the others get at most ``grace_s`` more (``None``: the full timeout).

        Returns:
            ``(answers, dead, silent)``: ``answers[rank] = (kind, payload)`` for ranks that sent
            a message, ``dead[rank] = exitcode`` for ranks that exited without one, and the
            sorted ranks that neither answered nor died before the deadline.
        """
        answers: dict[int, tuple[str, Any]] = {}
        dead: dict[int, int | None] = {}
        deadline = time.monotonic() + timeout_s
        by_object = {c: r for r, c in enumerate(self.conns)}
        by_object.update({p.sentinel: r for r, p in enumerate(self.procs)})
        while len(answers) + len(dead) < self.world_size and time.monotonic() < deadline:
            remaining = deadline - time.monotonic()
            pending = [o for o, r in by_object.items() if r not in answers and r not in dead]
            for obj in mp_connection.wait(pending, timeout=max(0.0, remaining)):
                rank = by_object[obj]
                if rank in answers or rank in dead:
                    continue
                conn = self.conns[rank]
                try:
                    if conn.poll():
                        answers[rank] = pickle.loads(conn.recv_bytes())
                        continue
                except (EOFError, OSError):
                    pass
                if obj is conn:  # pipe closed without a message: the sentinel will follow
                    self.procs[rank].join(1.0)
                dead[rank] = self.procs[rank].exitcode
            failed = any(kind == "err" for kind, _ in answers.values()) or dead
            if failed and grace_s is not None:
                deadline = min(deadline, time.monotonic() + grace_s)
        silent = [r for r in range(self.world_size) if r not in answers and r not in dead]
        return answers, dead, silent

    def stacks(self, ranks: Sequence[int]) -> dict[int, str]:
        """Ask hung ranks for their Python stacks (faulthandler on SIGUSR1) and read them."""
        files = {r: Path(self.stack_files[r]) for r in ranks if self.procs[r].is_alive()}
        for rank in files:
            os.kill(self.procs[rank].pid, signal.SIGUSR1)

        def text(rank: int) -> str:  # the file is missing if the rank hung before creating it
            return files[rank].read_text().strip() if files.get(rank, Path()).is_file() else ""

        deadline = time.monotonic() + _STACK_DUMP_WAIT_S
        while time.monotonic() < deadline and not all(text(r) for r in files):
            time.sleep(0.02)
        time.sleep(0.05)  # let a dump that has started finish writing
        return {r: text(r) or "(no stack dump)" for r in ranks}

    def kill(self, graceful_s: float = 0.0) -> None:
        """Stop every worker, reap it and free the world's resources.

        Args:
            graceful_s: Time (seconds) the workers get to exit on request first; then SIGKILL
                (a worker stuck in a C++ collective ignores anything milder).
        """
        if graceful_s > 0:
            for conn in self.conns:
                try:
                    conn.send_bytes(pickle.dumps(None))
                except OSError:
                    pass
            deadline = time.monotonic() + graceful_s
            for proc in self.procs:
                proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5.0)
            if proc.is_alive():
                logger.warning("dmuon test pool: %s (pid %s) survived SIGKILL", proc.name, proc.pid)
            else:
                proc.close()
        for conn in self.conns:
            conn.close()
        self.procs, self.conns, self._store = [], [], None
        self._tmp.cleanup()


def _failure_message(what: str, timeout_s: float, answers: dict, dead: dict, silent: list[int],
                     stacks: dict[int, str]) -> str:
    """Say which ranks raised, died or hung, with their tracebacks and stacks."""
    raised = sorted(r for r, (kind, _) in answers.items() if kind == "err")
    ok = sorted(r for r, (kind, _) in answers.items() if kind == "ok")
    lines = [what] + [f"ranks {raised} raised"] * bool(raised)
    if dead:
        lines.append("ranks " + ", ".join(f"{r} (exitcode {c})" for r, c in sorted(dead.items()))
                     + " died without answering")
    lines += [f"ranks {silent} did not answer within {timeout_s:g} s (hung)"] * bool(silent)
    lines.append(f"ranks {ok} returned")
    lines += [f"----- rank {r} traceback -----\n{answers[r][1].rstrip()}" for r in raised]
    lines += [f"----- rank {r} stack when killed -----\n{stacks.get(r, '')}" for r in silent]
    return "\n".join(lines)


class DistPool:
    """Session-long gloo worker processes, one world per world size, created on first use.

    Args:
        start_method: ``"forkserver"`` (default, torch preloaded: worlds start in ~0.1 s) or
            ``"spawn"`` (~2.5 s per world); never ``"fork"`` (see :func:`_context`).
        grace_s: After a rank raised or died, how long (seconds) the others get to answer before
            the call gives up on them (they are likely stuck in a collective).
        startup_timeout_s: Limit (seconds) for a world's workers to import torch and join the
            process group; counted apart from a call's ``timeout_s``.
        pg_timeout_s: gloo's own collective timeout (seconds) inside the workers.

    Raises:
        ValueError: If ``start_method`` is not ``"spawn"`` or ``"forkserver"``.
    """

    def __init__(self, start_method: str = "forkserver", grace_s: float = 10.0,
                 startup_timeout_s: float = 180.0, pg_timeout_s: float = 300.0) -> None:
        self._ctx = _context(start_method)
        self.grace_s = grace_s
        self.startup_timeout_s = startup_timeout_s
        self.pg_timeout_s = pg_timeout_s
        self._worlds: dict[int, _World] = {}
        self.starts = 0  # how many worlds were started (tests check recovery with it)

    def __enter__(self) -> DistPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _world(self, world_size: int) -> _World:
        world = self._worlds.get(world_size)
        if world is not None and all(p.is_alive() for p in world.procs):
            return world
        if world is not None:
            logger.warning("dmuon test pool: a worker of world_size=%d died between calls; "
                           "restarting that world", world_size)
            self._drop(world_size)
        started = time.monotonic()
        world = _World(world_size, self._ctx, self.pg_timeout_s)
        try:
            answers, dead, silent = world.collect(self.startup_timeout_s, grace_s=self.grace_s)
        except BaseException:  # e.g. pytest-timeout fired during startup
            world.kill()
            raise
        if dead or silent or any(kind != "ready" for kind, _ in answers.values()):
            stacks = world.stacks(silent) if silent else {}
            world.kill()
            raise DistPoolError(_failure_message(
                f"dmuon test pool: starting {world_size} gloo workers failed.",
                self.startup_timeout_s, answers, dead, silent, stacks))
        logger.info("dmuon test pool: world_size=%d up in %.1f s", world_size,
                    time.monotonic() - started)
        self._worlds[world_size] = world
        self.starts += 1
        return world

    def _drop(self, world_size: int) -> None:
        if (world := self._worlds.pop(world_size, None)) is not None:
            world.kill()

    def run(self, world_size: int, fn: str, kwargs: dict[str, Any] | None = None,
            timeout_s: float = 60.0, seed: int = 0, fresh: bool = False) -> list[Any]:
        """Run ``fn(rank=r, world_size=world_size, **kwargs)`` on every rank of a gloo world.

        The default process group is initialized (gloo, CPU, ranks ``0..world_size-1``) before
        the call; python, numpy and torch are seeded with ``seed`` on every rank; process
        groups the call created are destroyed after it (locally, no collective).

        Args:
            world_size: Number of ranks (>= 1).
            fn: ``"package.module:function"`` importable in the workers (the repository root is
                on their ``sys.path``).
            kwargs: Keyword arguments for every rank, pickled (tensors travel by value).
            timeout_s: Limit (seconds) for all ranks to answer.
            seed: Seed for ``random``, ``numpy.random`` and ``torch`` on every rank.
            fresh: run in a newly started world (~0.1 s with the forkserver): for cases that
                build multi-dimensional DeviceMeshes, whose sub-groups do not survive the
                group cleanup between calls.

        Returns:
            The value each rank returned, indexed by rank.

        Raises:
            ValueError: If ``world_size`` < 1, ``fn`` is malformed or ``kwargs`` has ``rank`` or
                ``world_size``.
            RankTimeoutError: If some ranks did not answer in ``timeout_s`` (or within
                ``grace_s`` after another rank failed); names them, with their stacks.
            DistPoolError: If a rank raised or died; carries each failing rank's traceback.
            In both error cases the world is killed and restarted on next use.
        """
        _check_args(world_size, fn, kwargs)
        if fresh:
            self._drop(world_size)
        request = pickle.dumps((fn, dict(kwargs or {}), seed))
        world = self._world(world_size)
        try:
            for conn in world.conns:
                conn.send_bytes(request)
            answers, dead, silent = world.collect(timeout_s, grace_s=self.grace_s)
        except BaseException:  # e.g. pytest-timeout or Ctrl-C mid-call: the world is unusable
            self._drop(world_size)
            raise
        if not dead and not silent and all(kind == "ok" for kind, _ in answers.values()):
            return [answers[rank][1] for rank in range(world_size)]
        stacks = world.stacks(silent) if silent else {}
        self._drop(world_size)
        message = _failure_message(
            f"dmuon test pool: {fn} on world_size={world_size} failed; that world was killed "
            f"and restarts on next use.", timeout_s, answers, dead, silent, stacks)
        raise (RankTimeoutError if silent else DistPoolError)(message)

    def close(self) -> None:
        """Stop every world: workers exit on request within 10 s, stragglers are killed."""
        for world_size in list(self._worlds):
            self._worlds.pop(world_size).kill(graceful_s=10.0)


def spawn_world(world_size: int, fn: str, kwargs: dict[str, Any] | None = None,
                timeout_s: float = 60.0, seed: int = 0,
                start_method: str = "forkserver", pg_timeout_s: float = 300.0) -> list[Any]:
    """Run ``fn`` once on ``world_size`` fresh processes (for tests that kill ranks).

    Same calling convention as :meth:`DistPool.run`, but every call starts new processes
    (~0.1-0.3 s with the forkserver, ~2.5 s with "spawn") and a rank that raises or dies is
    reported in the result, not raised.

    Returns:
        Per rank (index = rank): the value ``fn`` returned, or a :class:`RankExit` with the
        exit code (and traceback text if ``fn`` raised).

    Raises:
        ValueError: If ``world_size`` < 1 or ``start_method`` is not spawn/forkserver.
        RankTimeoutError: If some ranks neither answered nor exited in ``timeout_s``; they are
            killed and named, with their stacks.
    """
    _check_args(world_size, fn, kwargs)
    ctx = _context(start_method)
    world = _World(world_size, ctx, pg_timeout_s, once=(fn, dict(kwargs or {}), seed))
    try:
        answers, dead, silent = world.collect(timeout_s, grace_s=None)
        if silent:
            stacks = world.stacks(silent)
            raise RankTimeoutError(_failure_message(
                f"dmuon spawn_world: {fn} on world_size={world_size} hung; all ranks killed.",
                timeout_s, answers, dead, silent, stacks))
        for proc in world.procs:
            proc.join(5.0)
        results: list[Any] = []
        for rank in range(world_size):
            kind, payload = answers.get(rank, ("died", None))
            results.append(payload if kind == "ok" else RankExit(
                rank=rank, exitcode=world.procs[rank].exitcode,
                traceback=payload if kind == "err" else None))
        return results
    finally:
        world.kill()
