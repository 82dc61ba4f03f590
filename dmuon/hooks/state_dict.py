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
  broadcasts each master over its shard group and every rank keeps its own rows, so the call
  is **collective** over the mesh, like FSDP2's full state dict. Memory: one full matrix at a
  time, transient.
* **load_state_dict pre-hook:** each dedicated entry (such a DTensor, or a full tensor) is
  staged into the owner's shape (the shard ranks' rows gathered over the shard group for a
  DTensor laid out as above, ``DTensor.full_tensor()`` for another one; collective), checked
  on every rank (shape), the ranks agree (one ``all_gather_object``), and only then the entry
  is replaced: the full tensor on the owner (torch copies it into the fp32 master; dmuon's load
  post-hook then refreshes the published weights), the placeholder elsewhere. A bad entry on
  any rank raises ``ValueError`` naming dmuon on every rank before anything is written.

Tensor parallelism: the owner (of this TP rank's slice) broadcasts its slice over the shard
group and each rank keeps the rows FSDP2 would (FSDP2 chunks the TP-local tensor along dim 0);
without FSDP2 the TP slice itself, as the TP DTensor. Not translated (``RuntimeError`` naming
dmuon, on every rank): expert stacks split into several owner ranges and expert-parallel
stacks (the optimizer steps each range as a parameter of its own, which
``model.named_parameters()`` does not list). Their checkpoints go through
:func:`dmuon.state_dict` / :func:`dmuon.load`.

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
    if rec.stack is not None:
        return "is an expert stack split into several owner ranges"
    if rec.group is not None:
        return "is an expert-parallel stack"
    return None


def layout_of(tensor: Any, fsdp: bool = True) -> tuple | None:
    """``(mesh, placements, shape, stride, fsdp)`` of a DTensor parameter (FSDP2's sharded
    parameter with ``fsdp``; else a tensor-parallel one FSDP2 does not manage); ``None`` for a
    plain tensor."""
    if tensor is None or not hasattr(tensor, "device_mesh"):
        return None
    return (tensor.device_mesh, tuple(tensor.placements), tuple(tensor.shape), tuple(tensor.stride()), fsdp)


def _chunks(t: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """``torch.chunk(t, parts, dim=0)`` padded with empty chunks to ``parts`` (FSDP2's
    ``_chunk_with_empty``): the rows each shard rank holds."""
    chunks = list(torch.chunk(t, parts, dim=0))
    return chunks + [t.new_empty((0, *t.shape[1:]))] * (parts - len(chunks))


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


def as_fsdp_entry(rec: DedicatedParam, tp_local: torch.Tensor, shard_rank: int, shard_size: int) -> torch.Tensor:
    """``tp_local`` (this rank's TP slice ``rec.shape``, the whole matrix without TP; the same on
    every rank of the shard group) as FSDP2 would show the parameter: its rows chunk for this
    shard rank (FSDP2 chunks the TP-local tensor along dim 0, ``torch.chunk`` sizes) as a DTensor
    with ``rec.sd_layout``'s mesh, placements, global shape and stride; without FSDP2 the TP
    slice as that DTensor, or ``tp_local`` itself (no DTensor at all: DDP's view)."""
    if rec.sd_layout is None:
        return tp_local
    from torch.distributed.tensor import DTensor

    mesh, placements, shape, stride, fsdp = rec.sd_layout
    local = _chunks(tp_local, shard_size)[shard_rank].clone() if fsdp else tp_local
    return DTensor.from_local(local, mesh, list(placements), run_check=False, shape=torch.Size(shape),
                              stride=stride)


def staged_tp_local(value: Any, rec: DedicatedParam, where: str, group: Any, tp_rank: int,
                    tp_size: int) -> tuple[torch.Tensor | None, str | None]:
    """A loaded entry as this rank's TP slice (``rec.shape``; the whole matrix without TP), or
    why it cannot be one: ``(tensor, None)`` or ``(None, problem)``.

    A DTensor laid out as :func:`as_fsdp_entry` makes it: the shard ranks' chunks, gathered over
    ``group`` (collective); another DTensor: ``full_tensor()`` (collective over its mesh), then
    this TP rank's slice; a plain tensor: the full matrix, sliced.
    """
    if not isinstance(value, torch.Tensor):
        return None, f"{where} should be a tensor, got {type(value).__name__}"
    full_shape = tuple(rec.full_shape) if rec.tp_shard_dim is not None else tuple(rec.shape)
    if tuple(value.shape) != full_shape:
        return None, (f"{where} has shape {tuple(value.shape)} but the matrix is {full_shape} "
                      f"(a state dict of another model, or a dmuon placeholder)")
    layout = rec.sd_layout
    if (layout is not None and layout[4] and hasattr(value, "to_local")
            and value.device_mesh == layout[0] and tuple(value.placements) == layout[1]):
        size = dist.get_world_size(group)
        rows = [c.shape[0] for c in _chunks(torch.empty(rec.shape[0], 0), size)]
        local = value.to_local().detach()
        padded = torch.zeros((max(rows), *rec.shape[1:]), dtype=local.dtype, device=local.device)
        padded[: local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in range(size)]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([p[:r] for p, r in zip(parts, rows)]), None
    full = (value.full_tensor() if hasattr(value, "full_tensor") else value).detach()
    if rec.tp_shard_dim is None:
        return full, None
    return torch.chunk(full, tp_size, dim=rec.tp_shard_dim)[tp_rank], None


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

    def entry(self, rec: DedicatedParam, owned: torch.Tensor | None) -> torch.Tensor:
        """The owner's ``owned`` (master or momentum, ``rec.shape``) as FSDP2 would show the
        parameter on this rank (:func:`owner_full`, :func:`as_fsdp_entry`; collective)."""
        state = self.state
        return as_fsdp_entry(rec, owner_full(rec, owned, state.group), state.rank, state.world_size)

    def staged(self, value: Any, rec: DedicatedParam, where: str) -> tuple[torch.Tensor | None, str | None]:
        """A loaded entry as this rank's TP slice (:func:`staged_tp_local`; collective)."""
        state = self.state
        return staged_tp_local(value, rec, where, state.group, state.tp_rank, state.roles.tp_size)

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
            sd[key] = self.entry(rec, rec.master)

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
            full, problem = self.staged(sd[key], rec, f"entry {key!r}")
            staged.append(full)
            if problem:
                problems.append(problem)
        agree(problems, self.state.roles.world, "the state dict does not fit this model")
        for (rec, key), full in zip(present, staged):
            sd[key] = full if rec.is_owner else rec.master.detach()
