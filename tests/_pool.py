"""A session pool of gloo worker processes for fast multi-rank tests.

Spawning a world of processes costs ~2.5 s per test on a 2-core machine (mostly ``import torch``
in every child). :class:`DistPool` pays that once per world size: it keeps one set of workers
per world size, started by :func:`dmuon.train.ranks.start_ranks` from a forkserver that has torch
imported (a restart costs ~0.1-0.3 s), each joined to a gloo default group by
:func:`dmuon.train.ranks.init_rank`, and runs many ``"module:function"`` calls on them.
:func:`spawn_world` runs one call on fresh processes, for tests that kill a rank on purpose.

Every call has a timeout. A rank that raises, dies or hangs makes the call raise an error that
names the ranks, with their tracebacks or (hung) :mod:`faulthandler` stacks; the world is then
killed and restarted on next use, as a failed call may leave the ranks out of step.
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
from datetime import timedelta
from pathlib import Path
from typing import Any

from dmuon.train.ranks import init_rank, start_ranks

logger = logging.getLogger(__name__)

#: Repository root: first on the workers' ``sys.path`` so ``tests.*`` and ``dmuon`` import.
REPO_ROOT = str(Path(__file__).resolve().parent.parent)

# Set in every worker. One thread per rank: 2 cores shared by up to 8 ranks, and oversubscribed
# OpenMP makes gloo tests crawl.
_WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
_STACK_DUMP_WAIT_S = 1.0  # longest wait for hung ranks' stack dumps; they take ~10 ms


class DistPoolError(RuntimeError):
    """A multi-rank call failed: a rank raised, died, or did not answer in time."""


class RankTimeoutError(DistPoolError):
    """Some ranks did not answer within the call's timeout (a hang)."""


@dataclasses.dataclass(frozen=True, slots=True)
class RankExit:
    """How a rank of :func:`spawn_world` ended without returning: its rank, exit code (``-N``:
    killed by signal ``N``) and traceback text if ``fn`` raised (else ``None``)."""

    rank: int
    exitcode: int | None
    traceback: str | None


def _check_args(world_size: int, fn: str, kwargs: dict[str, Any] | None) -> None:
    if kwargs is not None and ({"rank", "world_size"} & set(kwargs)):
        raise ValueError(f"kwargs must not contain 'rank' or 'world_size' (every rank receives "
                         f"its own), got keys {sorted(kwargs)}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    module_name, sep, attr = fn.partition(":") if isinstance(fn, str) else ("", "", "")
    if not sep or not module_name or not attr or ":" in attr:
        raise ValueError(f"fn must look like 'package.module:function', got {fn!r}")


def _call(request: tuple[str, dict, int], rank: int, world_size: int) -> tuple[str, bytes]:
    """Seed python/numpy/torch, run ``fn(rank=, world_size=, **kwargs)``; ``(kind, pickled
    (kind, value or traceback text))``."""
    import numpy
    import torch

    fn, kwargs, seed = request
    try:
        random.seed(seed)
        numpy.random.seed(seed)
        torch.manual_seed(seed)
        module_name, _, attr = fn.partition(":")
        target = getattr(importlib.import_module(module_name), attr, None)
        if not callable(target):
            raise ValueError(f"{fn!r}: module {module_name!r} has no callable named {attr!r}")
        value = target(rank=rank, world_size=world_size, **kwargs)
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


def _worker_main(rank: int, world_size: int, port: int, conns: tuple, stack_files: list[str],
                 pg_timeout_s: float, once: tuple | None) -> None:
    """A rank started by :func:`dmuon.train.ranks.start_ranks`. Pool worker (``once is None``):
    report ``ready``, then answer pickled ``(fn, kwargs, seed)`` requests until ``None`` or EOF.
    With ``once`` (such a triple): run it, report, exit with 0 (returned) or 1 (raised)."""
    import faulthandler
    import threading

    conn = conns[rank]
    for other in conns:  # every rank received every pipe end; the parent must see EOF per rank
        if other is not conn:
            other.close()
    try:
        parent = multiprocessing.parent_process()
        if parent is not None:  # die with the parent even when stuck in a C++ collective
            threading.Thread(target=lambda: (mp_connection.wait([parent.sentinel]), os._exit(3)),
                             name="dmuon-pool-parent-watch", daemon=True).start()
        os.environ.update(_WORKER_ENV)
        if sys.platform.startswith("linux"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo resolves the hostname otherwise
        sys.path[:0] = [REPO_ROOT] * (REPO_ROOT not in sys.path)
        # faulthandler keeps a reference to the file, which stays open for the process life.
        faulthandler.register(signal.SIGUSR1, file=open(stack_files[rank], "w"),  # noqa: SIM115
                              all_threads=True)
        import torch.distributed as dist

        timeout = timedelta(seconds=pg_timeout_s)
        store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timeout)
        init_rank(rank, world_size, port=port, store=store, backend="gloo", threads=1,
                  timeout=timeout)
        kind, answer = "ready", pickle.dumps(("ready", None))
    except BaseException:  # noqa: BLE001
        kind, answer = "err", pickle.dumps(("err", traceback.format_exc()))
    if once is not None and kind == "ready":
        kind, answer = _call(once, rank, world_size)
    serve = once is None and kind == "ready"
    try:
        conn.send_bytes(answer)
        while serve and (request := pickle.loads(conn.recv_bytes())) is not None:
            kind, answer = _call(request, rank, world_size)
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

    def __init__(self, world_size: int, start_method: str, pg_timeout_s: float,
                 once: tuple | None = None) -> None:
        import torch.distributed as dist

        self.world_size = world_size
        # The parent hosts the store on a port the OS picks: no free-port race between ranks.
        self._store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False,
                                    timeout=timedelta(seconds=pg_timeout_s))
        self._tmp = tempfile.TemporaryDirectory(prefix=f"dmuon-pool-w{world_size}-")
        self.stack_files = [f"{self._tmp.name}/rank{r}.stack" for r in range(world_size)]
        pipes = [multiprocessing.Pipe(duplex=True) for _ in range(world_size)]
        self.conns = [parent_end for parent_end, _ in pipes]  # by rank
        self.procs: list = []
        try:
            if start_method == "forkserver":
                # pytest too when running under it: test modules the workers import import it.
                extra = ["pytest"] if "pytest" in sys.modules else []
                multiprocessing.get_context("forkserver").set_forkserver_preload(
                    ["torch", "torch.distributed", "numpy", "dmuon.train.ranks", *extra])
            context = start_ranks(
                _worker_main, world_size, start_method=start_method, join=False, daemon=True,
                args=(world_size, self._store.port, tuple(c for _, c in pipes), self.stack_files,
                      pg_timeout_s, once))
            self.procs = context.processes
        except BaseException:
            self.kill()
            raise
        finally:
            for _, child_end in pipes:
                child_end.close()

    def collect(self, timeout_s: float, grace_s: float | None) -> tuple[dict, dict, list[int]]:
        """Wait up to ``timeout_s`` s for one message per rank; once a rank raised or died, the
        others get at most ``grace_s`` more (``None``: the full timeout).

        Returns:
            ``(answers, dead, silent)``: ``answers[rank] = (kind, payload)``, ``dead[rank] =
            exitcode`` for ranks that exited without a message, and the sorted ranks that did
            neither before the deadline.
        """
        answers: dict[int, tuple[str, Any]] = {}
        dead: dict[int, int | None] = {}
        deadline = time.monotonic() + timeout_s
        by_object = {c: r for r, c in enumerate(self.conns)}
        by_object.update({p.sentinel: r for r, p in enumerate(self.procs)})
        while len(answers) + len(dead) < self.world_size and time.monotonic() < deadline:
            pending = [o for o, r in by_object.items() if r not in answers and r not in dead]
            for obj in mp_connection.wait(pending, timeout=max(0.0, deadline - time.monotonic())):
                rank = by_object[obj]
                if rank in answers or rank in dead:
                    continue
                try:
                    if self.conns[rank].poll():
                        answers[rank] = pickle.loads(self.conns[rank].recv_bytes())
                        continue
                except (EOFError, OSError):
                    pass
                if obj is self.conns[rank]:  # pipe closed without a message: the sentinel follows
                    self.procs[rank].join(1.0)
                dead[rank] = self.procs[rank].exitcode
            failed = any(kind == "err" for kind, _ in answers.values()) or dead
            if failed and grace_s is not None:
                deadline = min(deadline, time.monotonic() + grace_s)
        silent = [r for r in range(self.world_size) if r not in answers and r not in dead]
        return answers, dead, silent

    def stacks(self, ranks: list[int]) -> dict[int, str]:
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
        """Stop and reap every worker (after ``graceful_s`` s to exit on request, SIGKILL: a
        worker stuck in a C++ collective ignores anything milder); free the world's resources."""
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
                logger.warning("dmuon test pool: worker pid %s survived SIGKILL", proc.pid)
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
            ``"spawn"`` (~2.5 s per world); ``"fork"`` is refused.
        grace_s: After a rank raised or died, how long (s) the others get to answer before the
            call gives up on them (they are likely stuck in a collective).
        startup_timeout_s: Limit (s) for a world's workers to join the process group; apart
            from a call's ``timeout_s``.
        pg_timeout_s: gloo's own collective timeout (s) inside the workers.

    Raises:
        ValueError: If ``start_method`` is not ``"spawn"`` or ``"forkserver"``.
    """

    def __init__(self, start_method: str = "forkserver", grace_s: float = 10.0,
                 startup_timeout_s: float = 180.0, pg_timeout_s: float = 300.0) -> None:
        if start_method not in ("forkserver", "spawn"):
            raise ValueError(f"start_method must be 'forkserver' or 'spawn' (fork is unsafe "
                             f"after torch starts threads), got {start_method!r}")
        self.start_method = start_method
        self.grace_s = grace_s
        self.startup_timeout_s = startup_timeout_s
        self.pg_timeout_s = pg_timeout_s
        self._worlds: dict[int, _World] = {}
        self.starts = 0  # how many worlds were started (tests check recovery with it)

    def _world(self, world_size: int) -> _World:
        world = self._worlds.get(world_size)
        if world is not None and all(p.is_alive() for p in world.procs):
            return world
        if world is not None:
            logger.warning("dmuon test pool: a worker of world_size=%d died between calls; "
                           "restarting that world", world_size)
            self._drop(world_size)
        world = _World(world_size, self.start_method, self.pg_timeout_s)
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
        self._worlds[world_size] = world
        self.starts += 1
        return world

    def _drop(self, world_size: int) -> None:
        if (world := self._worlds.pop(world_size, None)) is not None:
            world.kill()

    def run(self, world_size: int, fn: str, kwargs: dict[str, Any] | None = None,
            timeout_s: float = 60.0, seed: int = 0, fresh: bool = False,
            isolated: bool = False) -> list[Any]:
        """Run ``fn(rank=r, world_size=world_size, **kwargs)`` on every rank of a gloo world.

        Before the call python, numpy and torch are seeded with ``seed`` on every rank; after
        it, the process groups it created are destroyed (locally, no collective).

        Args:
            world_size: Number of ranks (>= 1).
            fn: ``"package.module:function"`` importable in the workers (the repository root is
                on their ``sys.path``).
            kwargs: Keyword arguments for every rank, pickled (tensors travel by value).
            timeout_s: Limit (s) for all ranks to answer.
            seed: Seed for ``random``, ``numpy.random`` and ``torch`` on every rank.
            fresh: Run in a newly started world (~0.1 s with the forkserver): for cases that
                build multi-dimensional DeviceMeshes, whose sub-groups do not survive the
                cleanup between calls.
            isolated: Run in a newly started world and stop it afterwards, so nothing the call
                leaves behind in the processes reaches later tests: for calls that run torch's
                profiler over gloo collectives (``bench/bench_step.py``), which has crashed
                processes here, once as heap corruption found only by a later test's ``malloc``.

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
        if fresh or isolated:
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
            if isolated:
                self._drop(world_size)
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

    Same calling convention as :meth:`DistPool.run`, but a rank that raises or dies is reported
    in the result, not raised.

    Returns:
        Per rank: the value ``fn`` returned, or a :class:`RankExit`.

    Raises:
        ValueError: If ``world_size`` < 1 or ``start_method`` is not spawn/forkserver.
        RankTimeoutError: If some ranks neither answered nor exited in ``timeout_s``; they are
            killed and named, with their stacks.
    """
    _check_args(world_size, fn, kwargs)
    world = _World(world_size, start_method, pg_timeout_s, once=(fn, dict(kwargs or {}), seed))
    try:
        answers, dead, silent = world.collect(timeout_s, grace_s=None)
        if silent:
            raise RankTimeoutError(_failure_message(
                f"dmuon spawn_world: {fn} on world_size={world_size} hung; all ranks killed.",
                timeout_s, answers, dead, silent, world.stacks(silent)))
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
