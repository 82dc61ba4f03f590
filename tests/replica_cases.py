"""Rank functions for tests/test_replicas.py: HSDP cross-replica collectives, counted.

:func:`train_counting` trains the test model under HSDP 2x2 as ``tests.mesh_cases.train`` does
and records every collective dmuon issues on its replicate process group, per step, by
wrapping ``torch.distributed.all_reduce/reduce/broadcast`` for the duration of the call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

import dmuon
from tests import models
from tests.dist_cases import full_params
from tests.mesh_cases import build, dp_coordinate, mixed_auto_kwargs

@contextlib.contextmanager
def counting(group: dist.ProcessGroup, log: list[tuple[str, str]]) -> Iterator[None]:
    """Append ``(op, dtype)`` to ``log`` for each all_reduce/reduce/broadcast on ``group``."""
    originals = {name: getattr(dist, name) for name in ("all_reduce", "reduce", "broadcast")}

    def wrap(name, fn):
        def counted(tensor, *args, **kwargs):
            if kwargs.get("group") is group:
                log.append((name, str(tensor.dtype)))
            return fn(tensor, *args, **kwargs)
        return counted

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def train_counting(rank: int, world_size: int, *, replicate_mode: str, steps: int = 3,
                   mixed_auto: bool = False) -> dict:
    """HSDP 2x2 training; returns params, owned masters, modes and per-step replicate collectives."""
    model, mesh, dp_names = build("hsdp", replicate_mode=replicate_mode, **mixed_auto_kwargs(mixed_auto))
    opt = dmuon.Muon(model, lr=0.02, adamw_lr=0.01, weight_decay=0.1, ns_method="standard",
                     ns_dtype=torch.float32, ns_coefficients="muon")
    state = model._dmuon_state
    dp_index, dp_count = dp_coordinate(mesh, dp_names)
    per_step: list[list[tuple[str, str]]] = []
    for step in range(steps):
        log: list[tuple[str, str]] = []
        with counting(state.roles.replicate, log):
            idx, y = models.local_batch(step, dp_index, dp_count)
            models.loss_fn(model, idx, y).backward()
            opt.step()
            opt.zero_grad()
        per_step.append(log)
    owned = {rec.fqn: rec.master.detach().numpy().copy() for rec in state.records if rec.is_owner}
    modes = {rec.fqn: rec.replicate_mode for rec in state.records if rec.is_owner}
    return {"params": full_params(model, rank), "owned": owned, "modes": modes, "per_step": per_step,
            "dp_count": dp_count, "replicate_rank": state.replicate_rank}
