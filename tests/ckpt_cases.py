"""Rank functions for the checkpoint, fault and fuzz tests (run through ``tests/_pool.py``).

Batches: every step has one *global* batch of ``GLOBAL_RANKS * LOCAL_BATCH`` sequences
(:func:`tests.models.global_batch` of a 4-rank world) split evenly over however many ranks
run, so a job restored on 2 ranks trains on exactly the data the 4-rank job would have seen.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch import nn

import dmuon
from dmuon import checkpoint
from tests import models
from tests.dist_cases import build, full_params

GLOBAL_RANKS = 4
EXACT = dict(lr=0.02, adamw_lr=0.01, weight_decay=0.1, ns_method="standard",
             ns_dtype=torch.float32, ns_coefficients="muon")


def batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of step ``step``'s fixed-size global batch."""
    idx, y = models.global_batch(step, GLOBAL_RANKS)
    n = idx.shape[0] // world_size
    return idx[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def run_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: range, rank: int,
              world_size: int, sched=None) -> None:
    for step in steps:
        idx, y = batch(step, rank, world_size)
        models.loss_fn(model, idx, y).backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()


def _job(world_size: int, mode: str):
    model, _ = build(world_size, mode)
    opt = dmuon.Muon(model, **EXACT)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    return model, opt, sched


def train_save_continue(rank: int, world_size: int, *, path: str, first: int, then: int,
                        mode: str = "fsdp") -> dict:
    """Train ``first`` steps, ``dcp.save`` to ``path``, train ``then`` more.

    Returns:
        On rank 0: ``saved`` (full params at save time) and ``final`` (after all steps).
    """
    model, opt, sched = _job(world_size, mode)
    run_steps(model, opt, range(first), rank, world_size, sched)
    sd = checkpoint.state_dict(model, opt)
    sd["sched"] = sched.state_dict()
    dcp.save(sd, checkpoint_id=path)
    saved = full_params(model, rank)
    run_steps(model, opt, range(first, first + then), rank, world_size, sched)
    return dict(saved=saved, final=full_params(model, rank))


def load_continue(rank: int, world_size: int, *, path: str, first: int, then: int,
                  mode: str = "fsdp") -> dict:
    """A fresh job on ``world_size`` ranks: load ``path``, train steps ``first..first+then``.

    Returns:
        On rank 0: ``loaded`` (full params right after loading) and ``final``; on every rank
        ``owned`` (the dedicated FQNs this rank owns in the new plan).
    """
    model, opt, sched = _job(world_size, mode)
    sd = checkpoint.state_dict(model, opt)
    sd["sched"] = sched.state_dict()
    dcp.load(sd, checkpoint_id=path)
    checkpoint.load_state_dict(model, opt, sd)
    sched.load_state_dict(sd["sched"])
    loaded = full_params(model, rank)
    run_steps(model, opt, range(first, first + then), rank, world_size, sched)
    owned = sorted(r.fqn for r in model._dmuon_state.records if r.is_owner)
    return dict(loaded=loaded, final=full_params(model, rank), owned=owned)


def load_incomplete(rank: int, world_size: int) -> str:
    """``load_state_dict`` with the optimizer state removed; returns the error text."""
    model, opt, _ = _job(world_size, "fsdp")
    sd = checkpoint.state_dict(model, opt)
    sd["optim"]["state"] = {}
    try:
        checkpoint.load_state_dict(model, opt, sd)
    except Exception as e:  # noqa: BLE001 - the test inspects type and message
        return f"{type(e).__name__}: {e}"
    return "no error"
