"""Command line and process launch of ``python -m dmuon.train``.

Under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` set) this process is one rank. Otherwise it
spawns ``--nproc`` local ranks (gloo on CPU, NCCL on CUDA) with a free rendezvous port, giving
each ``OMP_NUM_THREADS = cpus // nproc`` (at least 1) unless the user set it: see
:func:`dmuon.launch.launch`, re-exported here.
"""

from __future__ import annotations

import argparse
import os

from dmuon.launch import default_nproc, launch, under_torchrun
from dmuon.train.data import DataConfig
from dmuon.train.eval import add_eval_args, eval_config_from
from dmuon.train.loop import OPTIMIZERS, TrainConfig, train_rank
from dmuon.train.parallel import Layout

__all__ = ["launch", "main", "parse_args"]

_DEFAULTS = TrainConfig()


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
        world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else (a.nproc or default_nproc())
        Layout.parse(a.mesh, world)
    except ValueError as e:  # bad values across options (held-out seeds, --steps 0, a mesh, ...)
        p.error(str(e).removeprefix("dmuon.train: "))
    return cfg, a.nproc


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``python -m dmuon.train``."""
    cfg, nproc = parse_args(argv)
    launch(train_rank, cfg, nproc)
