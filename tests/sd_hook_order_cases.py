"""Rank functions: a third-party state-dict hook on a *parent* module, in the style of
torchtitan's fused-QKV ``_split_qkv_on_save`` / ``_merge_qkv_on_load``, meets FSDP2's view of a
dedicated matrix held by its child (``dmuon.hooks.state_dict`` translates where the parameter
lives, ahead of its ancestors' hooks), without torchtitan.

Each block of ``tests/models.py``'s model gets, after ``fully_shard`` and ``dedicate_params``, a
state_dict post-hook that replaces its child's ``fc1.weight`` entry by two row halves
``fc1.a`` / ``fc1.b`` (it needs the matrix's global shape: a zero-size placeholder makes it
raise ``IndexError``) and a load pre-hook that concatenates them back into ``fc1.weight``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests import models
from tests.ckpt_cases import batch, run_steps
from tests.sd_cases import _numpy, job


def _split_on_save(module: torch.nn.Module, sd: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    key = prefix + "fc1.weight"
    if key not in sd:
        return
    w = sd.pop(key)
    w = w.full_tensor() if isinstance(w, DTensor) else w
    rows, cols = w.shape[0] // 2, w.shape[1]  # a placeholder [0] has no shape[1]
    sd[prefix + "fc1.a"], sd[prefix + "fc1.b"] = w[:rows].clone(), w[rows:].reshape(-1, cols).clone()


def _merge_on_load(module: torch.nn.Module, sd: dict[str, Any], prefix: str, *args: Any) -> None:
    keys = [prefix + "fc1.a", prefix + "fc1.b"]
    if all(k in sd for k in keys):
        sd[prefix + "fc1.weight"] = torch.cat([sd.pop(k) for k in keys])


def _with_hooks(rank: int, world_size: int):
    model, opt, dp_index, dp_count = job(rank, world_size)
    for block in model.blocks:
        block.register_state_dict_post_hook(_split_on_save)
        block.register_load_state_dict_pre_hook(_merge_on_load)
    return model, opt, dp_index, dp_count


def _full(sd: dict[str, Any]) -> dict[str, np.ndarray]:
    return {k: _numpy(v) for k, v in sd.items()}


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> list[str]:
    """Keys of ``a`` whose value differs from ``b``'s (or is missing there)."""
    return sorted(k for k in a if k not in b or not np.array_equal(a[k], b[k]))


def parent_hooks(rank: int, world_size: int) -> dict:
    """Train 2 steps, ``model.state_dict()`` and ``blocks[0].state_dict()`` through the parent
    hooks; into a fresh model: a submodule load, a load with a bad ``fc1.a`` on rank 1 only,
    then the full load.

    Returns:
        ``keys`` (of ``model.state_dict()``), ``sub_keys``, ``sub_differs`` (sub-state-dict
        entries that differ from the model's), ``sub_loaded_differs`` (the fresh model's block 0
        after its own ``load_state_dict`` against block 0's saved entries), ``bad_error``,
        ``bad_changed`` (block 1's ``fc1`` master changed by the bad load: ``False`` expected),
        ``loaded_differs`` (the fresh model's state dict after the full load against the saved
        one), ``losses`` (the trained and the loaded model's loss on one batch), and on rank 0
        ``values`` (the saved state dict, full).
    """
    model, opt, dp_index, dp_count = _with_hooks(rank, world_size)
    run_steps(model, opt, range(2), dp_index, dp_count)
    sd = model.state_dict()
    saved = _full(sd)
    sub = model.blocks[0].state_dict()
    sub_saved = _full(sub)
    out: dict[str, Any] = dict(keys=sorted(sd), sub_keys=sorted(sub),
                               sub_differs=_same({f"blocks.0.{k}": v for k, v in sub_saved.items()}, saved))

    fresh, _, _, _ = _with_hooks(rank, world_size)
    fresh.blocks[0].load_state_dict(sub)
    out["sub_loaded_differs"] = _same(_full(fresh.blocks[0].state_dict()), sub_saved)

    bad = dict(sd)
    if rank == 1:  # merges into a [1 + rows / 2, cols] fc1.weight: only dmuon's check can see it
        bad["blocks.1.fc1.a"] = torch.zeros(1, saved["blocks.1.fc1.a"].shape[1])
    rec = next(r for r in fresh._dmuon_state.records if r.fqn == "blocks.1.fc1.weight")
    before = rec.master.detach().clone()
    try:
        fresh.load_state_dict(bad)
        out["bad_error"] = "no error"
    except Exception as e:  # noqa: BLE001
        out["bad_error"] = f"{type(e).__name__}: {e}"
    out["bad_changed"] = not torch.equal(rec.master.detach(), before)

    fresh.load_state_dict(sd)
    out["loaded_differs"] = _same(_full(fresh.state_dict()), saved)
    idx, y = batch(5, dp_index, dp_count)
    losses = []
    with torch.no_grad():
        for m in (model, fresh):
            loss = models.loss_fn(m, idx, y).detach()
            dist.all_reduce(loss)
            losses.append(float(loss))
    out["losses"] = losses
    if rank == 0:
        out["values"] = saved
    return out
