"""Command line and process launch of ``python -m dmuon.train``.

Under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` set) this process is one rank. Otherwise it
spawns ``--nproc`` local ranks (gloo on CPU, NCCL on CUDA) with a free rendezvous port, giving
each ``OMP_NUM_THREADS = cpus // nproc`` (at least 1) unless the user set it.
"""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dmuon.train.data import DataConfig
from dmuon.train.eval import add_eval_args, eval_config_from
from dmuon.train.loop import OPTIMIZERS, TrainConfig, train_rank
from dmuon.train.parallel import Layout

_DEFAULTS = TrainConfig()
_RANK_TIMEOUT = timedelta(minutes=30)  # rank 0 may generate the dataset while others wait


def parse_args(argv: list[str] | None = None) -> tuple[TrainConfig, int | None]:
    """Parses the command line into a :class:`TrainConfig` and ``--nproc`` (None: default)."""
    p = argparse.ArgumentParser(
        prog="python -m dmuon.train",
        description="Train a small Pi0-style policy on PushT demonstrations with dmuon, "
                    "vanilla (gather-then-compute) Muon, or AdamW over FSDP2.",
    )
    p.add_argument("--nproc", type=int, default=None,
                   help="local ranks to spawn (default: 4 on CPU, all GPUs on CUDA); ignored under torchrun")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="dmuon")
    p.add_argument("--steps", type=int, default=_DEFAULTS.steps)
    p.add_argument("--batch-size", type=int, default=_DEFAULTS.batch_size, help="global batch")
    p.add_argument("--lr", type=float, default=None, help="default: 0.02 (Muon variants), 1e-3 (adamw)")
    p.add_argument("--adamw-lr", type=float, default=_DEFAULTS.adamw_lr,
                   help="lr of non-matrix parameters under dmuon/vanilla")
    p.add_argument("--weight-decay", type=float, default=_DEFAULTS.weight_decay)
    p.add_argument("--warmup", type=int, default=_DEFAULTS.warmup)
    p.add_argument("--ns-dtype", default="auto", choices=("auto", "float16", "bfloat16", "float32"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mesh", default="fsdp",
                   help="fsdp (1-D), replicate (DDP-style, no FSDP2), hsdp:RxS (replicate x shard) or fsdp-tp:DxT (data x tensor parallel)")
    p.add_argument("--episodes", type=int, default=DataConfig().episodes, help="demonstrations to generate")
    p.add_argument("--out", default=None, help="write summary JSON here (rank 0)")
    p.add_argument("--plot", action=argparse.BooleanOptionalAction, default=True,
                   help="write <out>_loss.png beside the summary (needs matplotlib)")
    p.add_argument("--save", default=None,
                   help="write DCP checkpoints (dmuon.state_dict) to DIR/step_NNNNNN at the end")
    p.add_argument("--save-every", type=int, default=0, help="also checkpoint every N steps (0: only at the end)")
    add_eval_args(p, episodes_default=None)
    a = p.parse_args(argv)
    if a.nproc is not None and a.nproc < 1:
        p.error(f"--nproc {a.nproc}: must be >= 1")
    if a.save_every < 0 or (a.save_every and not a.save):
        p.error(f"--save-every {a.save_every}: must be >= 0 and needs --save DIR")
    # A CLI answers bad values with a usage error and exit code 2, not a traceback.
    try:
        cfg = TrainConfig(
            optimizer=a.optimizer, steps=a.steps, batch_size=a.batch_size, lr=a.lr,
            adamw_lr=a.adamw_lr, weight_decay=a.weight_decay, warmup=a.warmup, ns_dtype=a.ns_dtype,
            seed=a.seed, out=a.out, plot=a.plot, mesh=a.mesh, data=DataConfig(episodes=a.episodes),
            save=a.save, save_every=a.save_every, eval=eval_config_from(a, p),
        )
        world = int(os.environ["WORLD_SIZE"]) if _under_torchrun() else (a.nproc or _default_nproc())
        Layout.parse(a.mesh, world)
    except ValueError as e:  # bad values across options (held-out seeds, --steps 0, a mesh, ...)
        p.error(str(e).removeprefix("dmuon.train: "))
    return cfg, a.nproc


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _default_nproc() -> int:
    """Local ranks without ``--nproc``: every GPU on CUDA, 4 on CPU."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_initialized(fn: Callable[[Any], Any], arg: Any) -> None:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    dist.init_process_group(backend, timeout=_RANK_TIMEOUT)
    try:
        fn(arg)
    finally:
        dist.destroy_process_group()


def _spawned_rank(local_rank: int, fn: Callable[[Any], Any], arg: Any, world: int, port: int,
                  threads: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(local_rank),
                      LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world))
    torch.set_num_threads(threads)
    _run_initialized(fn, arg)


def launch(fn: Callable[[Any], Any], arg: Any, nproc: int | None, *, spawn_one: bool = True) -> None:
    """Runs ``fn(arg)`` on every rank: this process under torchrun, else ``nproc`` local ranks.

    Args:
        fn: A module-level function (picklable for ``spawn``); the process group is initialized.
        arg: Its argument (picklable).
        nproc: Local ranks; ``None``: every GPU, or 4 on CPU.
        spawn_one: With ``nproc == 1``, still initialize a 1-rank process group (else call
            ``fn`` in this process without one).
    """
    if _under_torchrun():
        _run_initialized(fn, arg)
        return
    if nproc is None:
        nproc = _default_nproc()
    if nproc == 1 and not spawn_one:
        fn(arg)
        return
    if "OMP_NUM_THREADS" in os.environ:
        threads = max(1, int(os.environ["OMP_NUM_THREADS"]))
    else:
        threads = max(1, (os.cpu_count() or 1) // nproc)
        os.environ["OMP_NUM_THREADS"] = str(threads)  # inherited by the spawned ranks
    port = _free_port()
    if nproc == 1:
        _spawned_rank(0, fn, arg, 1, port, threads)
        return
    torch.multiprocessing.start_processes(
        _spawned_rank, args=(fn, arg, nproc, port, threads), nprocs=nproc, join=True, start_method="spawn"
    )


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``python -m dmuon.train``."""
    cfg, nproc = parse_args(argv)
    launch(train_rank, cfg, nproc)
