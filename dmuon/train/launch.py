"""Command line and process launch of ``python -m dmuon.train``.

Under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` set) this process is one rank. Otherwise it
spawns ``--nproc`` local ranks (gloo on CPU, NCCL on CUDA) with a free rendezvous port, giving
each ``OMP_NUM_THREADS = cpus // nproc`` (at least 1) unless the user set it: see
:func:`dmuon.train.ranks.launch`, re-exported here.
"""

from __future__ import annotations

import argparse
import os

from dmuon.train.ranks import default_nproc, exit_on_rank_failure, launch, under_torchrun
from dmuon.train.data import ACTION_MODES, OBS_KINDS, DataConfig
from dmuon.train.eval import add_eval_args, eval_config_from
from dmuon.train.loop import OPTIMIZERS, TrainConfig, train_rank
from dmuon.train.model import PolicyConfig
from dmuon.train.parallel import Layout

__all__ = ["PRESETS", "launch", "main", "parse_args"]

_DEFAULTS = TrainConfig()

# Named configurations; options given on the command line override them.
PRESETS: dict[str, dict] = {
    # A state policy (keypoints + agent, 2-frame history, delta actions) that learns to push the
    # T on a CPU: see docs/training.md for its measured success and time.
    "pusht-state": dict(
        obs="state", history=2, action_mode="delta", steps=3000, batch_size=256, lr=0.02,
        adamw_lr=1e-3, warmup=200, schedule="cosine", eval_episodes=50,
        model=dict(d_model=128, depth=2, d_act=96, act_heads=3, head_dim=32, mlp_ratio=2, mlp_ratio_act=2),
    ),
}


def parse_args(argv: list[str] | None = None) -> tuple[TrainConfig, int | None]:
    """Parses the command line into a :class:`TrainConfig` and ``--nproc`` (None: default)."""
    p = argparse.ArgumentParser(
        prog="python -m dmuon.train",
        description="Train a small Pi0-style policy on PushT demonstrations with dmuon, "
                    "vanilla (gather-then-compute) Muon, or AdamW over FSDP2.",
    )
    p.add_argument("--nproc", type=int, default=None,
                   help="local ranks to spawn (default: 4 on CPU, all GPUs on CUDA); ignored under torchrun")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="a named configuration; options given beside it override it. pusht-state: "
                        + ", ".join(f"{k}={v}" for k, v in PRESETS["pusht-state"].items()))
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="dmuon")
    p.add_argument("--steps", type=int, default=None, help=f"optimizer steps (default {_DEFAULTS.steps})")
    p.add_argument("--batch-size", type=int, default=None, help=f"global batch (default {_DEFAULTS.batch_size})")
    p.add_argument("--lr", type=float, default=None, help="default: 0.02 (Muon variants), 1e-3 (adamw)")
    p.add_argument("--adamw-lr", type=float, default=None,
                   help=f"lr of non-matrix parameters under dmuon/vanilla (default {_DEFAULTS.adamw_lr})")
    p.add_argument("--weight-decay", type=float, default=_DEFAULTS.weight_decay)
    p.add_argument("--warmup", type=int, default=None, help=f"lr warm-up steps (default {_DEFAULTS.warmup})")
    p.add_argument("--schedule", choices=("constant", "cosine"), default=None,
                   help="lr after warm-up: constant (default) or cosine decay to 0")
    p.add_argument("--obs", choices=OBS_KINDS, default=None,
                   help="policy input: image (rendered frame, Pi0-style, default) or state (T keypoints + agent)")
    p.add_argument("--image-size", type=int, default=None,
                   help=f"rendered image side in pixels for --obs image (default {DataConfig().image_size})")
    p.add_argument("--history", type=int, default=None, help="observations per sample for --obs state (default 1)")
    p.add_argument("--action-mode", choices=ACTION_MODES, default=None,
                   help="absolute agent targets (default) or delta = target - agent position")
    p.add_argument("--ns-dtype", default="auto", choices=("auto", "float16", "bfloat16", "float32"))
    p.add_argument("--per-head", action="store_true",
                   help="per-head Muon: orthogonalize q/k/v projections one head at a time")
    p.add_argument("--qk-clip", type=float, default=None, metavar="TAU",
                   help="QK-clip (MuonClip) threshold on the per-head max attention logit")
    p.add_argument("--overlap", choices=("off", "forward", "backward"), default="off",
                   help="dmuon.Muon(overlap=...): Newton-Schulz behind the next forward, or also "
                        "started during the last backward (default off)")
    p.add_argument("--clip-grad-norm", type=float, default=None, metavar="NORM",
                   help="clip the gradients to this global norm before each step (default: no clip)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mesh", default="fsdp",
                   help="fsdp (1-D), replicate (DDP-style, no FSDP2), hsdp:RxS (replicate x shard) or fsdp-tp:DxT (data x tensor parallel)")
    p.add_argument("--episodes", type=int, default=DataConfig().episodes,
                   help="demonstrations to run (300 steps each; only successful ones are kept)")
    p.add_argument("--cache-dir", default=None,
                   help="directory of the PushT demonstrations and rendered frames (default: "
                        "$DMUON_CACHE_DIR, else ~/.cache/dmuon)")
    p.add_argument("--out", default=None, help="write summary JSON here (rank 0)")
    p.add_argument("--plot", action=argparse.BooleanOptionalAction, default=True,
                   help="write <out>_loss.png beside the summary (needs matplotlib)")
    p.add_argument("--save", default=None,
                   help="write DCP checkpoints (dmuon.state_dict) to DIR/step_NNNNNN at the end")
    p.add_argument("--save-every", type=int, default=0, help="also checkpoint every N steps (0: only at the end)")
    add_eval_args(p, episodes_default=None)
    p.add_argument("--no-eval", action="store_true",
                   help="skip the closed-loop evaluation after training (overrides --preset's 50 episodes)")
    a = p.parse_args(argv)
    preset = dict(PRESETS[a.preset]) if a.preset else {}
    if a.no_eval:
        if a.eval_episodes is not None:
            p.error("--no-eval and --eval-episodes contradict each other; pass one")
    elif preset.get("eval_episodes") and a.eval_episodes is None:
        a.eval_episodes = preset["eval_episodes"]

    def pick(name: str, default):
        value = getattr(a, name)
        return value if value is not None else preset.get(name, default)

    if a.nproc is not None and a.nproc < 1:
        p.error(f"--nproc {a.nproc}: must be >= 1")
    if a.save_every < 0 or (a.save_every and not a.save):
        p.error(f"--save-every {a.save_every}: must be >= 0 and needs --save DIR")
    # A CLI answers bad values with a usage error and exit code 2, not a traceback.
    try:
        obs = pick("obs", "image")
        history = pick("history", 1)
        image_size = pick("image_size", DataConfig().image_size)
        data = DataConfig(episodes=a.episodes, obs=obs, history=history, image_size=image_size,
                          action_mode=pick("action_mode", "absolute"), cache_dir=a.cache_dir)
        model = PolicyConfig(**{**preset.get("model", {}), "obs": obs, "history": history, "image_size": image_size})
        cfg = TrainConfig(
            optimizer=a.optimizer, steps=pick("steps", _DEFAULTS.steps), batch_size=pick("batch_size", _DEFAULTS.batch_size),
            lr=pick("lr", None), adamw_lr=pick("adamw_lr", _DEFAULTS.adamw_lr), weight_decay=a.weight_decay,
            warmup=pick("warmup", _DEFAULTS.warmup), schedule=pick("schedule", "constant"), ns_dtype=a.ns_dtype,
            per_head=a.per_head, qk_clip=a.qk_clip, overlap=a.overlap, clip=a.clip_grad_norm, seed=a.seed,
            out=a.out, plot=a.plot, mesh=a.mesh, data=data, model=model,
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
    with exit_on_rank_failure("python -m dmuon.train"):
        launch(train_rank, cfg, nproc)
