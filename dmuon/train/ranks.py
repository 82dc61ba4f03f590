"""Local rank processes: the one place dmuon starts them and joins them to a process group.

Used by ``python -m dmuon.train``, ``bench/`` (:func:`launch`) and the test suite's worker pool
(:func:`start_ranks`, :func:`init_rank`). Processes are torch's
(:func:`torch.multiprocessing.start_processes`); this module adds the rank environment, threads
and CUDA device per rank, and the process group's backend and timeout. When ranks fail,
:func:`launch` reports the rank that failed *first* (by the time it recorded its exception) with
its whole traceback, then the others as its likely consequences, as ``torchrun`` does (torch's
join reports whichever process it reaps first, often a peer whose connection closed).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing.connection
import os
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

#: Default process-group timeout of :func:`launch` (rank 0 may build a dataset meanwhile).
DEFAULT_TIMEOUT = timedelta(minutes=30)

#: Seconds :func:`launch` lets the other ranks fail or finish after the first failure before
#: it terminates them.
FAILURE_GRACE_S = 5.0


def under_torchrun() -> bool:
    """Whether this process is one rank of a ``torchrun`` job (``RANK`` and ``WORLD_SIZE`` set)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def default_nproc() -> int:
    """Local ranks when none are asked for: every GPU on CUDA, 4 on CPU."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 4


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a rank-0-hosted store)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_backend() -> str:
    """``"nccl"`` when CUDA is available, else ``"gloo"``."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_rank(rank: int, world_size: int, *, port: int | None = None,
              store: dist.Store | None = None, backend: str | None = None,
              threads: int | None = None, timeout: timedelta = DEFAULT_TIMEOUT) -> None:
    """Makes this process rank ``rank`` of a local job and initializes the default process group.

    Sets ``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT``, ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
    the intra-op thread count, and on NCCL the CUDA device ``rank % device_count``.

    Args:
        rank: This process's rank, ``0 <= rank < world_size`` (also its local rank).
        world_size: Number of ranks (>= 1).
        port: Rendezvous port (``env://``; rank 0 hosts the store). Needed unless ``store``.
        store: A c10d store to rendezvous on instead (e.g. a client of a store the parent hosts).
        backend: ``"gloo"``, ``"nccl"``; ``None``: :func:`default_backend`.
        threads: ``torch.set_num_threads`` value; ``None`` leaves it.
        timeout: Collective timeout of the default group (inherited by dmuon's groups).

    Raises:
        ValueError: If ``rank``/``world_size`` are out of range, or neither ``port`` nor
            ``store`` is given.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"dmuon.train.ranks: rank {rank} is outside 0..{world_size - 1} "
                         f"(world_size={world_size}); pass 0 <= rank < world_size")
    if port is None and store is None:
        raise ValueError(f"dmuon.train.ranks: rank {rank} needs a rendezvous: pass port= (rank 0 hosts "
                         f"the store) or store=")
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    if port is not None:
        os.environ["MASTER_PORT"] = str(port)
    if threads is not None:
        torch.set_num_threads(threads)
    backend = backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    if store is None:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timeout)


def start_ranks(fn: Callable[..., Any], nproc: int, args: Sequence[Any] = (), *,
                start_method: str = "spawn", join: bool = True,
                daemon: bool = False) -> torch.multiprocessing.ProcessContext | None:
    """Starts ``nproc`` local processes running ``fn(rank, *args)``
    (:func:`torch.multiprocessing.start_processes`, validated).

    Args:
        fn: A module-level function (picklable); it initializes its own process group
            (see :func:`init_rank`).
        nproc: Number of processes (>= 1).
        args: Positional arguments after the rank, pickled to every process.
        start_method: ``"spawn"`` or ``"forkserver"`` (never ``"fork"``: unsafe once torch
            has started threads).
        join: Wait for the processes (and raise on a failure); else return the
            ``ProcessContext``.
        daemon: Start daemonic processes (they die with this process).

    Raises:
        ValueError: If ``nproc`` < 1 or ``start_method`` is not spawn/forkserver.
        torch.multiprocessing.ProcessRaisedException, ProcessExitedException: With ``join``,
            if a rank raised or exited with a non-zero code.
    """
    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"dmuon.train.ranks: nproc must be an int >= 1, got {nproc!r}")
    if start_method not in ("spawn", "forkserver"):
        raise ValueError(f"start_method must be 'forkserver' or 'spawn' (fork is unsafe after "
                         f"torch starts threads), got {start_method!r}")
    return torch.multiprocessing.start_processes(fn, args=tuple(args), nprocs=nproc, join=join,
                                                 daemon=daemon, start_method=start_method)


def _run_rank(rank: int, fn: Callable[[Any], Any], arg: Any, world_size: int, port: int,
              backend: str | None, threads: int, timeout: timedelta,
              error_dir: str | None = None) -> None:
    """Body of a rank spawned by :func:`launch`. On an exception it writes
    ``error_dir/rank<R>.json`` *before* destroying its process group (peers fail only once the
    group goes down, so the times order the root cause first)."""
    try:
        init_rank(rank, world_size, port=port, backend=backend, threads=threads, timeout=timeout)
        fn(arg)
    except Exception as exc:
        if error_dir is not None:
            _write_failure(error_dir, rank, exc)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _write_failure(error_dir: str, rank: int, exc: BaseException) -> None:
    """Records ``exc`` (raised on ``rank``) atomically."""
    record = dict(rank=rank, time=time.monotonic(), pid=os.getpid(),
                  error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
    path = os.path.join(error_dir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as fh:
        json.dump(record, fh)
    os.replace(path + ".tmp", path)


def _join_ranks(ctx: torch.multiprocessing.ProcessContext, error_dir: str,
                grace_s: float = FAILURE_GRACE_S) -> None:
    """Waits for every rank of ``ctx``; on a failure, stops the rest and raises as
    :func:`launch` says."""
    procs = ctx.processes
    pending = {p.sentinel: rank for rank, p in enumerate(procs)}
    seen_at: dict[int, float] = {}  # rank -> time this process saw it exit non-zero

    def reap(timeout: float | None) -> None:
        for sentinel in multiprocessing.connection.wait(list(pending), timeout=timeout):
            rank = pending.pop(sentinel)
            procs[rank].join()
            if procs[rank].exitcode != 0:
                seen_at[rank] = time.monotonic()

    while pending and not seen_at:
        reap(None)
    if not seen_at:
        return
    deadline = time.monotonic() + grace_s
    while pending and time.monotonic() < deadline:  # let the others fail or finish by themselves
        reap(max(0.0, deadline - time.monotonic()))
    stopped = sorted(pending.values())
    for rank in stopped:
        procs[rank].terminate()
    for rank in stopped:
        procs[rank].join(grace_s)
        if procs[rank].is_alive():
            procs[rank].kill()
            procs[rank].join()
    records = {}
    for rank in range(len(procs)):
        path = os.path.join(error_dir, f"rank{rank}.json")
        if os.path.exists(path):
            with open(path) as fh:
                records[rank] = json.load(fh)
    exitcodes = [p.exitcode for p in procs]
    report, first = failure_report(records, seen_at, exitcodes, stopped)
    if first in records:
        raise torch.multiprocessing.ProcessRaisedException(report, first, procs[first].pid)
    code = exitcodes[first]
    name = _signal_name(-code) if code is not None and code < 0 else None
    raise torch.multiprocessing.ProcessExitedException(report, first, procs[first].pid, code, name)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def failure_report(records: dict[int, dict], seen_at: dict[int, float], exitcodes: Sequence[int | None],
                   stopped: Sequence[int] = ()) -> tuple[str, int]:
    """The text :func:`launch` raises when ranks fail, and the rank it names as the root cause:
    the earliest recorded exception (a rank that died without one counts from ``seen_at``), with
    its whole traceback, then the other failures in time order, one line each, then the ranks
    the launcher stopped.

    Args:
        records: Rank -> record written by the failing rank (keys ``time`` in
            :func:`time.monotonic` seconds, ``error``, ``traceback``).
        seen_at: Rank -> :func:`time.monotonic` seconds at which the launcher saw it exit non-zero.
        exitcodes: Every rank's exit code (negative: killed by that signal; None: still running).
        stopped: Ranks the launcher terminated after the first failure.

    Returns:
        ``(report, first_rank)``.

    Raises:
        ValueError: If no rank failed (nothing recorded, nothing seen).
    """
    when = {**{r: t for r, t in seen_at.items() if r not in records},
            **{r: rec["time"] for r, rec in records.items()}}
    failed = sorted((r for r in when if r not in stopped), key=lambda r: (when[r], r))
    if not failed:
        raise ValueError(f"dmuon.train.ranks: failure_report needs a failed rank; got records for "
                         f"{sorted(records)}, exits seen for {sorted(seen_at)}")
    world = len(exitcodes)

    def how(rank: int) -> str:
        if rank in records:
            return records[rank]["error"]
        code = exitcodes[rank]
        return (f"killed by {_signal_name(-code)}" if code is not None and code < 0
                else f"exited with code {code} without a Python exception")

    first = failed[0]
    head = (f"rank {first} of {world} failed first" + (f" ({how(first)})" if first not in records else "")
            + (":\n\n" + records[first]["traceback"].rstrip() if first in records else ""))
    lines = [head]
    if len(failed) > 1 or stopped:
        lines.append(f"\nafter rank {first}, most likely in consequence (a peer's collectives "
                     f"break off when a rank fails):")
        for rank in failed[1:]:
            lines.append(f"  rank {rank}, {when[rank] - when[first]:+.3f} s: {_one_line(how(rank))}")
        for rank in stopped:
            lines.append(f"  rank {rank}: still running, stopped by the launcher")
    return "\n".join(lines) + "\n", first


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def launch(fn: Callable[[Any], Any], arg: Any, nproc: int | None = None, *,
           backend: str | None = None, threads: int | None = None,
           timeout: timedelta = DEFAULT_TIMEOUT, torchrun: bool = True,
           spawn_one: bool = True) -> None:
    """Runs ``fn(arg)`` on every rank of a job, with the default process group initialized.

    Under ``torchrun`` (and ``torchrun=True``) this process is the one rank; otherwise it spawns
    ``nproc`` local ranks on a free rendezvous port.

    Args:
        fn: A module-level function (picklable for ``spawn``); called once per rank.
        arg: Its argument (picklable).
        nproc: Local ranks; ``None``: :func:`default_nproc`.
        backend: Process-group backend; ``None``: NCCL with CUDA, else gloo.
        threads: Intra-op threads per rank; ``None``: ``OMP_NUM_THREADS`` if set, else
            ``cpus // nproc`` (at least 1, exported as ``OMP_NUM_THREADS``).
        timeout: Collective timeout of the default group.
        torchrun: Honour a ``torchrun`` environment (else always spawn ``nproc`` ranks).
        spawn_one: With ``nproc == 1``, still initialize a 1-rank process group in this
            process (else call ``fn(arg)`` without one).

    Raises:
        ValueError: If ``nproc`` < 1.
        torch.multiprocessing.ProcessRaisedException: A spawned rank raised: the message is
            :func:`failure_report`'s, ``error_index`` the first failing rank.
        torch.multiprocessing.ProcessExitedException: The first rank to fail died without a
            Python exception (a signal or a non-zero exit code).
    """
    if torchrun and under_torchrun():
        backend = backend or default_backend()
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        dist.init_process_group(backend, timeout=timeout)
        try:
            fn(arg)
        finally:
            dist.destroy_process_group()
        return
    nproc = default_nproc() if nproc is None else nproc
    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"dmuon.train.ranks: nproc must be an int >= 1, got {nproc!r}")
    if nproc == 1 and not spawn_one:
        fn(arg)
        return
    if threads is None:
        if "OMP_NUM_THREADS" in os.environ:
            threads = max(1, int(os.environ["OMP_NUM_THREADS"]))
        else:
            threads = max(1, (os.cpu_count() or 1) // nproc)
            os.environ["OMP_NUM_THREADS"] = str(threads)  # inherited by the spawned ranks
    rank_args = (fn, arg, nproc, free_port(), backend, threads, timeout)
    if nproc == 1:
        _run_rank(0, *rank_args)
        return
    with tempfile.TemporaryDirectory(prefix="dmuon-launch-") as error_dir:
        ctx = start_ranks(_run_rank, nproc, (*rank_args, error_dir), join=False)
        try:
            _join_ranks(ctx, error_dir)
        except BaseException:
            for p in ctx.processes:  # Ctrl-C in the launcher, or the failure path: no orphans
                if p.is_alive():
                    p.terminate()
                    p.join(FAILURE_GRACE_S)
                    if p.is_alive():
                        p.kill()
            raise
        finally:
            for path in ctx.error_files:  # torch's pickled copies of the tracebacks we report
                if os.path.exists(path):
                    os.unlink(path)


@contextlib.contextmanager
def exit_on_rank_failure(prog: str) -> Iterator[None]:
    """For a command line's ``main`` around :func:`launch`: a spawned rank's failure ends the
    program with exit code 1 and :func:`failure_report`'s text on stderr.

    Args:
        prog: The command's name, prefixed to the report (e.g. ``"python -m dmuon.train"``).
    """
    try:
        yield
    except (torch.multiprocessing.ProcessRaisedException, torch.multiprocessing.ProcessExitedException) as e:
        print(f"{prog}: {e}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
