"""What ``model.state_dict()`` / ``load_state_dict()`` show of a dedicated model: FSDP2's view.

Inside dmuon a dedicated matrix is the owner's fp32 master ``[rows, cols]`` and a zero-size
placeholder ``[0]`` on every other rank. Code outside the training loop (``model.state_dict()``,
``torch.distributed.checkpoint.state_dict.get_model_state_dict``, ``dcp.save``, Accelerate's
``get_state_dict``, ``save_pretrained``) must not see that: it gets what FSDP2 alone would
give it. The hooks installed here (by :func:`dmuon.dedicate_params`, removed with the state's
handles) translate, at the root module:

* **state_dict post-hook:** each dedicated matrix's entry becomes a DTensor laid out like
  FSDP2's sharded parameter (the mesh, placements, global shape and stride FSDP2 gave it,
  recorded at binding in ``DedicatedParam.sd_layout``), whose values are the owner's fp32
  master; on a plain replicated module (DDP-style), the full ``[rows, cols]`` tensor on every
  rank, as DDP shows it. The values are new tensors (never the live master): the owner
  broadcasts each master over its shard group and every rank keeps its own chunk, so the call
  is **collective** over the mesh, like FSDP2's full state dict. Memory: one full matrix at a
  time, transient.
* **load_state_dict pre-hook:** each dedicated entry (such a DTensor, or a full tensor) is
  staged into a full ``[rows, cols]`` tensor (``DTensor.full_tensor()``, collective), checked
  on every rank (shape), the ranks agree (one ``all_gather_object``), and only then the entry
  is replaced: the full tensor on the owner (torch copies it into the fp32 master; dmuon's load
  post-hook then refreshes the published weights), the placeholder elsewhere. A bad entry on
  any rank raises ``ValueError`` naming dmuon on every rank before anything is written.

Not translated (``RuntimeError`` naming dmuon, on every rank): matrices split by tensor
parallelism, expert stacks split into several owner ranges and expert-parallel stacks. Their
checkpoints go through :func:`dmuon.state_dict` / :func:`dmuon.load`.

Keys: ``nn.Module.state_dict`` names parameters as torch does (``checkpoint_wrapper`` strips
``_checkpoint_wrapped_module.``; torch's ``get_model_state_dict`` also strips ``_orig_mod.``);
:func:`canonical_fqn` is that canonical name, used by dmuon's own checkpoints too.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

import torch
import torch.distributed as dist

from dmuon.owners.dedicated import DedicatedParam

WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def canonical_fqn(name: str) -> str:
    """``name`` without activation-checkpointing's and ``torch.compile``'s wrapper components
    (``_checkpoint_wrapped_module.``, ``_orig_mod.``), as torch's state-dict utilities name it."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def module_key(fqn: str) -> str:
    """How ``nn.Module.state_dict`` names parameter ``fqn``: ``checkpoint_wrapper``'s hooks strip
    ``_checkpoint_wrapped_module.``; ``_orig_mod.`` stays (torch keeps it there)."""
    return fqn.replace(WRAPPER_PREFIXES[0], "")


def unsupported(rec: DedicatedParam) -> str | None:
    """Why ``rec`` has no FSDP2-like state-dict entry (``None``: it has one)."""
    if rec.tp_shard_dim is not None:
        return "is split by tensor parallelism"
    if rec.stack is not None:
        return "is an expert stack split into several owner ranges"
    if rec.group is not None:
        return "is an expert-parallel stack"
    return None


def layout_of(sharded: Any) -> tuple | None:
    """``(mesh, placements, shape, stride)`` of FSDP2's sharded DTensor; ``None`` without one."""
    if sharded is None or not hasattr(sharded, "device_mesh"):
        return None
    return (sharded.device_mesh, tuple(sharded.placements), tuple(sharded.shape), tuple(sharded.stride()))


def owner_full(rec: DedicatedParam, owned: torch.Tensor | None, group: Any) -> torch.Tensor:
    """The owner's ``owned`` (master or momentum, fp32 ``rec.shape``) on every rank of ``group``.

    Collective: one broadcast from the owner over ``group`` (dmuon's shard group, where
    ``rec.owner`` is a rank). Returns a new fp32 tensor ``rec.shape`` (a copy on the owner).
    """
    if rec.is_owner:
        full = owned.detach().to(torch.float32).clone()
    else:
        full = torch.empty(rec.shape, dtype=torch.float32, device=rec.master.device)
    if dist.get_world_size(group) > 1:
        dist.broadcast(full, src=dist.get_global_rank(group, rec.owner), group=group)
    return full


def as_fsdp_entry(rec: DedicatedParam, full: torch.Tensor) -> torch.Tensor:
    """``full`` (``rec.shape``, the same on every rank) as FSDP2 would show the parameter: a
    DTensor of this rank's chunk with ``rec.sd_layout``'s mesh, placements, shape and stride
    (``distribute_tensor`` without communication), or ``full`` itself (no FSDP2: DDP's view)."""
    if rec.sd_layout is None:
        return full
    from torch.distributed.tensor import distribute_tensor

    mesh, placements, _, _ = rec.sd_layout
    return distribute_tensor(full, mesh, list(placements), src_data_rank=None)


def staged_full(value: Any, rec: DedicatedParam, where: str) -> tuple[torch.Tensor | None, str | None]:
    """A loaded entry as the full ``rec.shape`` tensor, or why it cannot be one.

    Collective for a DTensor (``full_tensor()`` over its mesh). Returns ``(tensor, None)`` or
    ``(None, problem)``.
    """
    if not isinstance(value, torch.Tensor):
        return None, f"{where} should be a tensor, got {type(value).__name__}"
    if tuple(value.shape) != tuple(rec.shape):
        return None, (f"{where} has shape {tuple(value.shape)} but the matrix is {tuple(rec.shape)} "
                      f"(a state dict of another model, or a dmuon placeholder)")
    full = value.full_tensor() if hasattr(value, "full_tensor") else value
    return full.detach(), None


def agree(problems: list[str], group: Any, what: str) -> None:
    """Raise ``ValueError`` on every rank of ``group`` if any rank has problems (one
    ``all_gather_object``); nothing has been written yet."""
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, problems, group=group)
    ranks = dist.get_process_group_ranks(group)
    bad = {ranks[i]: p for i, p in enumerate(everyone) if p}
    if bad:
        first = "; ".join(f"rank {r}: {', '.join(p[:3])}" for r, p in sorted(bad.items())[:4])
        raise ValueError(f"dmuon: {what} on ranks {sorted(bad)}: {first}. Nothing was loaded: the "
                         f"dedicated matrices are unchanged on every rank.")


class StateDictHooks:
    """The model-level state-dict hooks of one :class:`dmuon.hooks.state.DedicateState`.

    Attributes:
        enabled: translate (``False`` inside :meth:`raw`: dmuon's own checkpoints read the live
            tensors).
    """

    def __init__(self, state: Any) -> None:
        self.state = state
        self.enabled = True

    def install(self) -> list[Any]:
        """Register the post-hook and pre-hook on the root model; returns their handles."""
        model = self.state.model
        # partials: torch marks a public hook with an attribute, which a bound method refuses
        return [model.register_state_dict_post_hook(functools.partial(StateDictHooks.on_state_dict, self)),
                model.register_load_state_dict_pre_hook(functools.partial(StateDictHooks.on_load, self))]

    @contextlib.contextmanager
    def raw(self) -> Iterator[None]:
        """``model.state_dict()`` inside shows dmuon's inside (masters and placeholders)."""
        before, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = before

    def _records(self) -> list[DedicatedParam]:
        state = self.state
        if not self.enabled or not state.bound:
            return []
        refused = [(r.fqn, why) for r in state.records if (why := unsupported(r))]
        if refused:
            fqn, why = refused[0]
            raise RuntimeError(
                f"dmuon: model.state_dict()/load_state_dict() cannot show dedicated matrix {fqn!r} as "
                f"FSDP2 would: it {why} ({len(refused)} such matrices). Checkpoint this model with "
                f"dmuon.state_dict(model, opt) + dcp.save and dmuon.load(model, opt, path).")
        return state.records

    @torch.no_grad()
    def on_state_dict(self, module: Any, sd: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        """Post-hook: dedicated entries -> FSDP2-laid-out DTensors (or full tensors) of the
        owners' current masters. Collective (one broadcast per matrix, in model order)."""
        for rec in self._records():
            key = prefix + module_key(rec.fqn)
            if key not in sd:
                continue
            full = owner_full(rec, rec.master, rec.group or self.state.group)
            sd[key] = as_fsdp_entry(rec, full)

    @torch.no_grad()
    def on_load(self, module: Any, sd: dict[str, Any], prefix: str, local_metadata: Any, strict: bool,
                missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
        """Pre-hook: stage every dedicated entry as a full tensor, check, agree, then hand torch
        the owner's full tensor (the placeholder elsewhere). Collective."""
        records = self._records()
        if not records:
            return
        present = [(rec, prefix + module_key(rec.fqn)) for rec in records]
        present = [(rec, key) for rec, key in present if key in sd]
        kinds = [(key, hasattr(sd[key], "full_tensor")) for _, key in present]
        everyone: list[Any] = [None] * dist.get_world_size(self.state.roles.world)
        dist.all_gather_object(everyone, kinds, group=self.state.roles.world)
        differ = [r for r, k in zip(dist.get_process_group_ranks(self.state.roles.world), everyone)
                  if k != everyone[0]]
        if differ:  # full_tensor() below must run on every rank or on none
            raise ValueError(
                f"dmuon: the state dict's dedicated entries (key, is a DTensor) differ across ranks: "
                f"ranks {differ} against the first rank's {everyone[0][:3]}. Give every rank the "
                f"same kind of state dict (all sharded or all full). Nothing was loaded.")
        staged, problems = [], []
        for rec, key in present:
            full, problem = staged_full(sd[key], rec, f"entry {key!r}")
            staged.append(full)
            if problem:
                problems.append(problem)
        agree(problems, self.state.roles.world, "the state dict does not fit this model")
        for (rec, key), full in zip(present, staged):
            sd[key] = full if rec.is_owner else rec.master.detach()
