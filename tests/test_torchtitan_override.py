"""``--override.imports dmuon.integrations.torchtitan.muon``: torchtitan 0.3.0's own override
mechanism turns the trainer's stock AdamW config into :class:`DmuonOptimizersContainer.Config`
with the expected dmuon.Muon keyword arguments (one process; the trainer run itself, on torch
2.14.1, is ``bench/torchtitan_trainer.py``). torchtitan is installed by the test when absent
(the ``torchtitan_path`` fixture, ``tests/_torchtitan_site.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

import dmuon

TARGET = "dmuon.integrations.torchtitan.muon"


@pytest.fixture(autouse=True)
def _torchtitan(torchtitan_path: str | None) -> None:
    """torchtitan importable in this process (installed into the test cache if absent)."""


def _apply(cli_token: str) -> Any:
    """torchtitan's ``apply_overrides`` of ``cli_token`` on the part of its ``Trainer.Config``
    the override sees (its ``optimizer``, torchtitan's ``default_adamw(lr=8e-4)``)."""
    from torchtitan.components.optimizer import OptimizersContainer, default_adamw
    from torchtitan.config import Configurable
    from torchtitan.config.override import OverrideConfig, apply_overrides, parse_cli_imports

    @dataclass(kw_only=True, slots=True)
    class _Root(Configurable.Config):
        optimizer: OptimizersContainer.Config = field(default_factory=lambda: default_adamw(lr=8e-4))

    root = _Root()
    replaced = apply_overrides(OverrideConfig(imports=parse_cli_imports([cli_token])), root)
    assert len(replaced) == 1 and "optimizer" in replaced[0]
    return root.optimizer


def test_flag_alone_carries_torchtitans_adamw_over():
    from dmuon.integrations.torchtitan import DmuonOptimizersContainer
    config = _apply(TARGET)
    assert type(config) is DmuonOptimizersContainer.Config
    # torchtitan's default_adamw: lr, betas (0.9, 0.95), eps 1e-8, weight decay 0.1.
    assert config.muon_kwargs == dict(
        lr=8e-4, adjust_lr_fn="match_rms_adamw", weight_decay=0.1,
        adamw_lr=8e-4, adamw_betas=(0.9, 0.95), adamw_eps=1e-8, adamw_weight_decay=0.1)
    dmuon.Muon([torch.nn.Parameter(torch.zeros(4, 4))], **config.muon_kwargs)  # valid kwargs


def test_flag_kwargs_win_and_fields_reach_the_container():
    config = _apply(TARGET + '={"lr": 0.02, "adamw_lr": 3e-4, "dedicate_kwargs": {"prefetch": 2}}')
    assert config.muon_kwargs == dict(adamw_lr=3e-4, adamw_betas=(0.9, 0.95), adamw_eps=1e-8,
                                      adamw_weight_decay=0.1, lr=0.02)
    assert config.dedicate_kwargs == {"prefetch": 2} and config.path == "hooks"
    assert _apply(TARGET + '={"path": "distributed_config"}').path == "distributed_config"
    dmuon.Muon([torch.nn.Parameter(torch.zeros(4, 4))], **config.muon_kwargs)
