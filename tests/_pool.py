"""Pools of gloo worker processes for fast multi-rank tests (and benchmarks).

Spawning a world of processes costs ~2.5 s per test on a 2-core machine (mostly `import torch`
in every child). :class:`DistPool` pays that once per world size: it keeps one set of worker
processes per world size, each with an initialized gloo default process group on CPU, and runs
many "module:function" calls on them. :func:`spawn_world` is the slow path for tests that need
fresh processes (a rank is killed on purpose).

Every call has a timeout. A rank that raises, dies or does not answer in time makes the call
raise an error that names the ranks, with their tracebacks (raised) or Python stacks (hung, via
:mod:`faulthandler`); the world is then killed and restarted lazily, since a failed call may
leave the ranks out of step in their collectives.

Usable outside pytest (no pytest import):

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
_WORKER_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "MASTER_ADDR": "127.0.0.1",
}
# Longest wait (seconds) for hung ranks to write their faulthandler stack dumps before the
# kill; a dump normally lands within ~10 ms.
_STACK_DUMP_WAIT_S = 1.0


class DistPoolError(RuntimeError):
    """A multi-rank call failed: a rank raised, died, or did not answer in time."""


class RankTimeoutError(DistPoolError):
    """Some ranks did not answer within the call's timeout (a hang)."""


@dataclasses.dataclass(frozen=True, slots=True)
class RankExit:
    """How a rank of :func:`spawn_world` ended when it did not return a value.

    Attributes:
        rank: Global rank of the process.
        exitcode: Process exit code; negative ``-N`` means killed by signal ``N``; ``None`` if it
            was still running when collected.
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


def _check_args(world_size: int, fn: str) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    module_name, sep, attr = fn.partition(":") if isinstance(fn, str) else ("", "", "")
    if not sep or not module_name or not attr or ":" in attr:
        raise ValueError(f"fn must look like 'package.module:function', got {fn!r}")


def _context(start_method: str) -> Any:
    """Multiprocessing context for workers; the forkserver preloads torch so forks are cheap.

    Forking the forkserver is safe: it imports torch but never runs an op, so no OpenMP pool
    exists yet (OpenBLAS's own thread is handled by its fork handlers). Measured on 2 busy
    cores: a 4-rank world starts in ~0.1 s this way versus ~6 s with "spawn". The preload list
    is process-wide and only applies if the forkserver is not running yet.

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


def _seed_all(seed: int) -> None:
    """Seed python, numpy and torch identically on every rank."""
    import numpy
    import torch

    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)


def _init_worker(rank: int, world_size: int, port: int, stack_file: str, sys_path: list[str],
                 pg_timeout_s: float) -> Any:
    """Set up one rank: environment, stack-dump signal, gloo default process group."""
    os.environ.update(_WORKER_ENV)
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world_size)
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo resolves the hostname otherwise
    sys.path[:0] = [p for p in sys_path if p not in sys.path]
    import faulthandler

    dump = open(stack_file, "w")  # noqa: SIM115 - faulthandler needs it open for the process life
    faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=pg_timeout_s))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=pg_timeout_s))
    return dump


def _exit_when_parent_dies() -> None:
    """Kill this worker when the parent goes away, even if it hangs in a collective."""
    import threading

    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        mp_connection.wait([parent.sentinel])
        os._exit(3)

    threading.Thread(target=watch, name="dmuon-pool-parent-watch", daemon=True).start()


def _call(fn: str, rank: int, world_size: int, kwargs: dict[str, Any], seed: int) -> bytes:
    """Run one call on this rank; return the pickled ``("ok", value)`` or ``("err", text)``."""
    try:
        _seed_all(seed)
        value = resolve_fn(fn)(rank=rank, world_size=world_size, **kwargs)
    except BaseException:  # noqa: BLE001 - any failure goes back to the parent as text
        return pickle.dumps(("err", traceback.format_exc()))
    try:
        return pickle.dumps(("ok", value))
    except Exception:  # noqa: BLE001
        return pickle.dumps(("err", f"the value returned by {fn} on rank {rank} cannot be "
                                    f"pickled (return tensors, numbers or plain containers):\n"
                                    f"{traceback.format_exc()}"))


def _cleanup_after_call() -> None:
    """Local, collective-free reset between calls: destroy the subgroups the call created.

    No ``gc.collect()``: it costs 0.1-0.3 s per rank per call once torch is imported.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world

    for pg in list(_world.pg_map):
        if pg is not dist.group.WORLD:
            dist.destroy_process_group(pg)
    torch.set_grad_enabled(True)
    torch.set_num_threads(1)


def _pool_worker_main(rank: int, world_size: int, port: int, conn: Any, stack_file: str,
                      sys_path: list[str], pg_timeout_s: float) -> None:
    """Worker loop of :class:`DistPool`: answer ``(fn, kwargs, seed)`` requests until EOF/None."""
    _exit_when_parent_dies()
    try:
        _init_worker(rank, world_size, port, stack_file, sys_path, pg_timeout_s)
    except BaseException:  # noqa: BLE001
        conn.send_bytes(pickle.dumps(("err", traceback.format_exc())))
        return
    conn.send_bytes(pickle.dumps(("ready", None)))
    while True:
        try:
            request = pickle.loads(conn.recv_bytes())
        except EOFError:
            break
        if request is None:
            break
        fn, kwargs, seed = request
        answer = _call(fn, rank, world_size, kwargs, seed)
        if pickle.loads(answer)[0] == "ok":
            try:
                _cleanup_after_call()
            except BaseException:  # noqa: BLE001
                answer = pickle.dumps(("err", "cleanup after the call failed:\n"
                                              + traceback.format_exc()))
        conn.send_bytes(answer)
    import torch.distributed as dist

    dist.destroy_process_group()


def _spawn_worker_main(rank: int, world_size: int, port: int, conn: Any, stack_file: str,
                       sys_path: list[str], pg_timeout_s: float, fn: str,
                       kwargs: dict[str, Any], seed: int) -> None:
    """One-shot worker of :func:`spawn_world`: init, run ``fn`` once, report, exit."""
    _exit_when_parent_dies()
    try:
        _init_worker(rank, world_size, port, stack_file, sys_path, pg_timeout_s)
    except BaseException:  # noqa: BLE001
        answer = pickle.dumps(("err", traceback.format_exc()))
    else:
        answer = _call(fn, rank, world_size, kwargs, seed)
    conn.send_bytes(answer)
    conn.close()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: gloo's destructors can block on peers that died or hang.
    os._exit(0 if pickle.loads(answer)[0] == "ok" else 1)


class _World:
    """One set of ``world_size`` worker processes and the TCP store they rendezvous on."""

    def __init__(self, world_size: int, ctx: Any, target: Callable[..., None],
                 pg_timeout_s: float, extra_args: tuple[Any, ...] = ()) -> None:
        import torch.distributed as dist

        self.world_size = world_size
        # The parent hosts the store on a port the OS picks: no free-port race between ranks.
        self._store = dist.TCPStore("127.0.0.1", 0, None, True,
                                    timeout=timedelta(seconds=pg_timeout_s),
                                    wait_for_workers=False)
        self.port = self._store.port
        self._tmp = tempfile.TemporaryDirectory(prefix=f"dmuon-pool-w{world_size}-")
        self.stack_files = [os.path.join(self._tmp.name, f"rank{r}.stack")
                            for r in range(world_size)]
        self.conns: list[Any] = []
        self.procs: list[Any] = []
        try:
            for rank in range(world_size):
                parent_end, child_end = ctx.Pipe(duplex=True)
                self.conns.append(parent_end)
                proc = ctx.Process(
                    target=target, name=f"dmuon-pool-w{world_size}-r{rank}", daemon=True,
                    args=(rank, world_size, self.port, child_end, self.stack_files[rank],
                          [REPO_ROOT, *sys.path], pg_timeout_s, *extra_args))
                proc.start()
                child_end.close()
                self.procs.append(proc)
        except BaseException:
            self.kill()
            raise

    def collect(self, timeout_s: float, grace_s: float | None) -> tuple[dict, dict, list[int]]:
        """Wait for one message per rank.

        Args:
            timeout_s: Wall-clock limit for all ranks (seconds).
            grace_s: After the first rank raises or dies, wait at most this long (seconds) for
                the others, which may be stuck in a collective; ``None``: the full timeout.

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
        while len(answers) + len(dead) < self.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            pending = [o for o, r in by_object.items() if r not in answers and r not in dead]
            for obj in mp_connection.wait(pending, timeout=remaining):
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
        for rank in ranks:
            if self.procs[rank].is_alive():
                os.kill(self.procs[rank].pid, signal.SIGUSR1)
        deadline = time.monotonic() + _STACK_DUMP_WAIT_S
        while time.monotonic() < deadline and not all(
                os.path.getsize(self.stack_files[r]) for r in ranks
                if os.path.exists(self.stack_files[r])):
            time.sleep(0.02)
        time.sleep(0.05)  # let a dump that has started finish writing
        out = {}
        for rank in ranks:
            try:
                out[rank] = Path(self.stack_files[rank]).read_text().strip() or "(no dump)"
            except OSError as exc:
                out[rank] = f"(no dump: {exc})"
        return out

    def kill(self) -> None:
        """SIGKILL every worker (they may be stuck in C++ collectives), reap, free resources."""
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        self._reap(timeout_s=5.0)

    def close(self, timeout_s: float = 10.0) -> None:
        """Ask workers to leave, wait up to ``timeout_s`` seconds, then kill the stragglers."""
        for conn in self.conns:
            try:
                conn.send_bytes(pickle.dumps(None))
            except OSError:
                pass
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def _reap(self, timeout_s: float) -> None:
        for proc in self.procs:
            proc.join(timeout_s)
            if proc.is_alive():
                logger.warning("dmuon test pool: %s (pid %s) survived SIGKILL", proc.name, proc.pid)
            else:
                proc.close()
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []
        self._tmp.cleanup()
        self._store = None


def _failure_message(what: str, timeout_s: float, answers: dict, dead: dict, silent: list[int],
                     stacks: dict[int, str]) -> str:
    """Say which ranks raised, died or hung, with their tracebacks and stacks."""
    lines = [what]
    raised = sorted(r for r, (kind, _) in answers.items() if kind == "err")
    ok = sorted(r for r, (kind, _) in answers.items() if kind == "ok")
    if raised:
        lines.append(f"ranks {raised} raised")
    if dead:
        lines.append("ranks " + ", ".join(f"{r} (exitcode {c})" for r, c in sorted(dead.items()))
                     + " died without answering")
    if silent:
        lines.append(f"ranks {silent} did not answer within {timeout_s:g} s (hung)")
    lines.append(f"ranks {ok} returned")
    for rank in raised:
        lines.append(f"----- rank {rank} traceback -----\n{answers[rank][1].rstrip()}")
    for rank in silent:
        lines.append(f"----- rank {rank} stack when killed -----\n{stacks.get(rank, '')}")
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
        world = _World(world_size, self._ctx, _pool_worker_main, self.pg_timeout_s)
        answers, dead, silent = world.collect(self.startup_timeout_s, grace_s=self.grace_s)
        if dead or silent or any(kind != "ready" for kind, _ in answers.values()):
            stacks = world.stacks(silent) if silent else {}
            world.kill()
            raise DistPoolError(_failure_message(
                f"dmuon test pool: starting {world_size} gloo workers failed.",
                self.startup_timeout_s, answers, dead, silent, stacks))
        logger.info("dmuon test pool: started world_size=%d in %.1f s", world_size,
                    time.monotonic() - started)
        self._worlds[world_size] = world
        self.starts += 1
        return world

    def _drop(self, world_size: int) -> None:
        world = self._worlds.pop(world_size, None)
        if world is not None:
            world.kill()

    def run(self, world_size: int, fn: str, kwargs: dict[str, Any] | None = None,
            timeout_s: float = 60.0, seed: int = 0) -> list[Any]:
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

        Returns:
            The value each rank returned, indexed by rank.

        Raises:
            ValueError: If ``world_size`` < 1 or ``fn`` is malformed.
            RankTimeoutError: If some ranks did not answer in ``timeout_s`` (or within
                ``grace_s`` after another rank failed); names them, with their stacks.
            DistPoolError: If a rank raised or died; carries each failing rank's traceback.
            In both error cases the world is killed and restarted on next use.
        """
        _check_args(world_size, fn)
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
        """Stop every world: workers leave the process group and exit; stragglers are killed."""
        for world_size in list(self._worlds):
            self._worlds.pop(world_size).close()


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
    _check_args(world_size, fn)
    ctx = _context(start_method)
    world = _World(world_size, ctx, _spawn_worker_main, pg_timeout_s,
                   extra_args=(fn, dict(kwargs or {}), seed))
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
            exitcode = world.procs[rank].exitcode
            if rank in answers and answers[rank][0] == "ok":
                results.append(answers[rank][1])
            elif rank in answers:
                results.append(RankExit(rank=rank, exitcode=exitcode, traceback=answers[rank][1]))
            else:
                results.append(RankExit(rank=rank, exitcode=exitcode, traceback=None))
        return results
    finally:
        world.kill()
