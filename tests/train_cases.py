"""Multi-rank cases of the main job's checkpoints and evaluation (run by ``tests/test_train.py``).

Shared sizes and the synthetic batch live here so the pool's worker ranks and the test process
build the same tiny policy.
"""

from __future__ import annotations

import dataclasses

import torch

from dmuon.train import ckpt
from dmuon.train.data import DataConfig
from dmuon.train.eval import EvalConfig, evaluate
from dmuon.train.loop import TrainConfig
from dmuon.train.model import Pi0Policy, PolicyConfig

TINY_DATA = DataConfig(episodes=2, max_steps=12, image_size=16, horizon=4, seed=3, keep_failed=True)
TINY_MODEL = PolicyConfig(image_size=16, patch=8, d_vis=32, vision_depth=1, d_model=64, depth=2,
                          d_act=30, act_heads=2, head_dim=16, max_tokens=10, horizon=4)
# The state path (keypoint tokens, 2-frame history, delta actions) at the same sizes.
TINY_STATE_DATA = DataConfig(episodes=2, max_steps=12, obs="state", horizon=4, seed=3, history=2,
                             action_mode="delta", keep_failed=True)
TINY_STATE_MODEL = dataclasses.replace(TINY_MODEL, obs="state", history=2)
TINY = {"image": (TINY_DATA, TINY_MODEL), "state": (TINY_STATE_DATA, TINY_STATE_MODEL)}
MUON_KW = dict(lr=0.02, weight_decay=0.1, adamw_lr=3e-3)


def synthetic_batch(batch: int, cfg: PolicyConfig, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if cfg.obs == "state":
        seen = {"env_state": torch.rand(batch, cfg.history, 28, generator=g) * 2 - 1}
    else:
        seen = {"images": torch.rand(batch, 3, cfg.image_size, cfg.image_size, generator=g)}
    return {
        **seen,
        "state": torch.rand(batch, 2, generator=g) * 2 - 1,
        "tokens": torch.randint(cfg.vocab_size, (batch, cfg.max_tokens), generator=g),
        "actions": torch.rand(batch, cfg.horizon, 2, generator=g) * 2 - 1,
        "noise": torch.randn(batch, cfg.horizon, 2, generator=g),
        "time": torch.rand(batch, generator=g) * 0.999 + 0.001,
    }


def train_and_save(rank: int, world_size: int, *, path: str, steps: int, rows: int, optimizer: str,
                   obs: str = "image") -> None:
    """Trains the tiny policy under FSDP2 + ``optimizer`` on the global batch, saves with --save's code.

    ``dmuon`` runs in its fp32 exact mode (standard NS, fp32, Keller Jordan's coefficients) so a
    single-process ``torch.optim.Muon`` in fp32 is its reference.
    """
    import dmuon
    from dmuon.train.parallel import Layout, shard_model

    data_cfg, model_cfg = TINY[obs]
    torch.manual_seed(0)
    model = Pi0Policy(model_cfg)
    mesh, dp_index, dp_count = shard_model(model, model.shardable_blocks(), Layout.parse("fsdp", world_size),
                                           torch.device("cpu"))
    if optimizer == "dmuon":
        dmuon.dedicate_params(model, mesh)
        opt = dmuon.Muon(model, ns_method="standard", ns_dtype=torch.float32, ns_coefficients="muon", **MUON_KW)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    b = rows // world_size
    for step in range(steps):
        batch = synthetic_batch(rows, model_cfg, seed=100 + step)
        model({k: v[dp_index * b:(dp_index + 1) * b] for k, v in batch.items()}).backward()
        opt.step()
        opt.zero_grad()
    cfg = TrainConfig(optimizer=optimizer, steps=steps, data=data_cfg, model=model_cfg)
    ckpt.save_checkpoint(path, steps, model, opt, optimizer, dataclasses.asdict(cfg))


def load_and_evaluate(rank: int, world_size: int, *, path: str, eval_kwargs: dict) -> dict:
    """Every rank loads the checkpoint into a plain policy; the episodes are split over the ranks."""
    policy, meta = ckpt.load_policy(path)
    return evaluate(policy, EvalConfig(**eval_kwargs), ckpt.configs_from(meta)[1], progress=False)
