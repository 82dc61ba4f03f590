"""Local rank processes: the one place dmuon starts them and joins them to a process group.

Used by ``python -m dmuon.train`` / ``dmuon.train.eval`` (:func:`launch`), the benchmarks in
``bench/`` (:func:`launch`) and the test suite's gloo worker pool (:func:`start_ranks` +
:func:`init_rank`). Process creation and error propagation are torch's
(:func:`torch.multiprocessing.start_processes`); this module adds the rank environment
(``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``), the thread
count per rank, the CUDA device per rank and the process group's backend and timeout.

Under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` set) :func:`launch` runs in this process as
that one rank instead of spawning.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

#: Default process-group timeout of :func:`launch`: rank 0 may build a dataset while the
#: others wait in their first collective.
DEFAULT_TIMEOUT = timedelta(minutes=30)


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

    Sets ``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT``, ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE``
    (so code that reads them, e.g. ``torchrun``-style scripts, sees a consistent job), the
    intra-op thread count, and on NCCL the CUDA device ``rank % device_count``.

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
        raise ValueError(f"dmuon.launch: rank {rank} is outside 0..{world_size - 1} "
                         f"(world_size={world_size}); pass 0 <= rank < world_size")
    if port is None and store is None:
        raise ValueError(f"dmuon.launch: rank {rank} needs a rendezvous: pass port= (rank 0 hosts "
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
    """Starts ``nproc`` local processes running ``fn(rank, *args)``.

    A thin, validated front to :func:`torch.multiprocessing.start_processes`: with ``join``,
    it waits for all of them and re-raises a rank's exception in this process
    (:class:`torch.multiprocessing.ProcessRaisedException`, with the rank's traceback), killing
    the others; without, it returns the :class:`~torch.multiprocessing.ProcessContext` whose
    ``processes`` the caller manages.

    Args:
        fn: A module-level function (picklable); it initializes its own process group
            (see :func:`init_rank`).
        nproc: Number of processes (>= 1).
        args: Positional arguments after the rank, pickled to every process.
        start_method: ``"spawn"`` or ``"forkserver"`` (never ``"fork"``: unsafe once torch
            has started threads).
        join: Wait for the processes (and raise on a failure) before returning.
        daemon: Start daemonic processes (they die with this process).

    Raises:
        ValueError: If ``nproc`` < 1 or ``start_method`` is not spawn/forkserver.
        torch.multiprocessing.ProcessRaisedException, ProcessExitedException: With ``join``,
            if a rank raised or exited with a non-zero code.
    """
    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"dmuon.launch: nproc must be an int >= 1, got {nproc!r}")
    if start_method not in ("spawn", "forkserver"):
        raise ValueError(f"start_method must be 'forkserver' or 'spawn' (fork is unsafe after "
                         f"torch starts threads), got {start_method!r}")
    return torch.multiprocessing.start_processes(fn, args=tuple(args), nprocs=nproc, join=join,
                                                 daemon=daemon, start_method=start_method)


def _run_rank(rank: int, fn: Callable[[Any], Any], arg: Any, world_size: int, port: int,
              backend: str | None, threads: int, timeout: timedelta) -> None:
    """Body of a rank spawned by :func:`launch`."""
    init_rank(rank, world_size, port=port, backend=backend, threads=threads, timeout=timeout)
    try:
        fn(arg)
    finally:
        dist.destroy_process_group()


def launch(fn: Callable[[Any], Any], arg: Any, nproc: int | None = None, *,
           backend: str | None = None, threads: int | None = None,
           timeout: timedelta = DEFAULT_TIMEOUT, torchrun: bool = True,
           spawn_one: bool = True) -> None:
    """Runs ``fn(arg)`` on every rank of a job, with the default process group initialized.

    Under ``torchrun`` (and ``torchrun=True``) this process is the one rank. Otherwise it
    spawns ``nproc`` local ranks on a free rendezvous port, each with ``threads`` intra-op
    threads (default: ``OMP_NUM_THREADS`` if set, else ``cpus // nproc``, at least 1; the
    value is also exported as ``OMP_NUM_THREADS`` to the ranks).

    Args:
        fn: A module-level function (picklable for ``spawn``); called once per rank.
        arg: Its argument (picklable).
        nproc: Local ranks; ``None``: :func:`default_nproc`.
        backend: Process-group backend; ``None``: NCCL with CUDA, else gloo.
        threads: Intra-op threads per rank (see above).
        timeout: Collective timeout of the default group.
        torchrun: Honour a ``torchrun`` environment (else always spawn ``nproc`` ranks).
        spawn_one: With ``nproc == 1``, still initialize a 1-rank process group in this
            process (else call ``fn(arg)`` without one).

    Raises:
        ValueError: If ``nproc`` < 1.
        torch.multiprocessing.ProcessRaisedException: If a spawned rank raised (its
            traceback is in the message).
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
        raise ValueError(f"dmuon.launch: nproc must be an int >= 1, got {nproc!r}")
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
    start_ranks(_run_rank, nproc, rank_args)
