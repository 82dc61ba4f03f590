"""What ``model.state_dict()`` / ``load_state_dict()`` show of a dedicated model: FSDP2's view.

Inside dmuon a dedicated matrix is the owner's fp32 master ``[rows, cols]`` and a zero-size
placeholder ``[0]`` on every other rank. Code outside the training loop (``model.state_dict()``,
``torch.distributed.checkpoint.state_dict.get_model_state_dict``, ``dcp.save``, Accelerate's
``get_state_dict``, ``save_pretrained``, torchtitan's ``CheckpointManager``) must not see that:
it gets what FSDP2 alone would give it. The hooks installed here (by
:func:`dmuon.dedicate_params`, removed with the state's handles) translate:

* **state_dict post-hook, on each module that holds a dedicated matrix** (first among that
  module's post-hooks): the matrix's entry becomes a DTensor laid out like FSDP2's sharded
  parameter (the mesh, placements, global shape and stride FSDP2 gave it, recorded at binding
  in ``DedicatedParam.sd_layout``), whose values are the owner's fp32 master; on a plain
  replicated module (DDP-style), the full ``[rows, cols]`` tensor on every rank, as DDP shows
  it. It runs where the parameter lives, before any hook of that module's ancestors and before
  its own later hooks: a parent's hook that rewrites its children's entries (torchtitan's
  fused-QKV ``_split_qkv_on_save`` splits ``wqkv`` into ``wq``/``wk``/``wv``) already sees
  FSDP2's view, and ``submodule.state_dict()`` translates too. The values are new tensors
  (never the live master): the owner broadcasts each master over its shard group and every rank
  keeps its own rows, so the call is **collective** over the mesh, like FSDP2's full state
  dict (every rank must call it on the same module). Memory: one full matrix at a time,
  transient.
* **load_state_dict pre-hooks**, in two places:

  - on the root module, before anything is written: each dedicated entry present under its
    canonical key is staged into the owner's shape (the shard ranks' rows gathered over the
    shard group for a DTensor laid out as above, ``DTensor.full_tensor()`` for another one;
    collective), checked on every rank (shape), and the ranks agree (one
    ``all_gather_object``). A bad entry on any rank raises ``ValueError`` naming dmuon on
    every rank before anything is written. The entries themselves stay as they are.
  - on each module that holds a dedicated matrix, after that module's ancestors' load
    pre-hooks and its own earlier ones: each of its entries is replaced by the full tensor on
    the owner (torch copies it into the fp32 master; dmuon's load post-hook then refreshes the
    published weights) and the placeholder elsewhere. An entry that is still the one the root
    checked takes the staged tensor; another one (made by such a hook, torchtitan's
    ``_merge_qkv_on_load`` merging ``wq``/``wk``/``wv`` into ``wqkv``, or any entry when
    ``submodule.load_state_dict`` is called) is staged, checked and agreed on now, the same
    way, for that module's matrices; a bad one raises ``ValueError`` on every rank before they
    are written (modules loaded before it keep what they loaded).

Tensor parallelism: the owner (of this TP rank's slice) broadcasts its slice over the shard
group and each rank keeps the rows FSDP2 would (FSDP2 chunks the TP-local tensor along dim 0);
without FSDP2 the TP slice itself, as the TP DTensor. Not translated (``RuntimeError`` naming
dmuon, on every rank): expert stacks split into several owner ranges and expert-parallel
stacks (the optimizer steps each range as a parameter of its own, which
``model.named_parameters()`` does not list). Their checkpoints go through
:func:`dmuon.state_dict` / :func:`dmuon.load`.

Keys: ``nn.Module.state_dict`` names parameters as torch does (``checkpoint_wrapper`` strips
``_checkpoint_wrapped_module.``; torch's ``get_model_state_dict`` also strips ``_orig_mod.``);
:func:`canonical_fqn` is that canonical name, used by dmuon's own checkpoints too. The per-module
hooks see the module's own prefix (``prefix + attr``), whatever wrappers sit above it.
"""

from __future__ import annotations

import functools
from typing import Any

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


_UNSTAGED = object()  # no entry is this object: the root pre-hook did not stage the matrix
NOTHING_LOADED = "Nothing was loaded: the dedicated matrices are unchanged on every rank."


def agree(problems: list[str], group: Any, what: str, consequence: str = NOTHING_LOADED,
          error: type[Exception] = ValueError, cause: BaseException | None = None) -> None:
    """Raise ``error`` on every rank of ``group`` if any rank has problems (one
    ``all_gather_object``; ``None``: the default group; local only when torch.distributed is
    not initialized). Each rank with problems is named with its first three (ranks with the
    same ones listed together); ``consequence`` ends the message; ``cause`` is chained."""
    if dist.is_available() and dist.is_initialized():
        everyone: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, problems, group=group)
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    else:
        everyone, ranks = [problems], [0]
    bad = {ranks[i]: p for i, p in enumerate(everyone) if p}
    if bad:
        same: dict[tuple, list[int]] = {}  # identical problems (DCP reports every rank's) once
        for rank, p in sorted(bad.items()):
            same.setdefault(tuple(p[:3]) + ((f"+{len(p) - 3} more",) if len(p) > 3 else ()), []).append(rank)
        listed = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {rs if len(rs) > 1 else rs[0]}: " + ", ".join(p)
                           for p, rs in list(same.items())[:4])
        raise error(f"dmuon: {what} on ranks {sorted(bad)}: {listed}. {consequence}") from cause


class StateDictHooks:
    """The state-dict hooks of one :class:`dmuon.hooks.state.DedicateState`."""

    def __init__(self, state: Any) -> None:
        self.state = state
        # id(rec) -> (the entry the root pre-hook checked, its staged full tensor), this load
        self._staged: dict[int, tuple[Any, torch.Tensor]] = {}
        self._in_root_load = False  # between the root's load pre-hook and its post-hook
        self._refresh = False  # a module's hook wrote masters outside a root load
        self._by_module: tuple[Any, dict[int, list[DedicatedParam]]] = (None, {})

    def install(self) -> list[Any]:
        """Register the hooks; returns their handles.

        On the root model: a load pre-hook and post-hook. On each module that holds a
        dedicated matrix (``module._parameters[attr]``): a state_dict post-hook moved to the
        front of the module's ``_state_dict_hooks`` (an ``OrderedDict`` keyed by handle id in
        every torch >= 2.0; ``register_state_dict_post_hook`` has no ``prepend``), a load
        pre-hook (last so far: hooks the module registered at construction, like torchtitan's
        fused-QKV merge, run before it) and a load post-hook.
        """
        model = self.state.model
        # partials: torch marks a public hook with an attribute, which a bound method refuses
        handles = [model.register_load_state_dict_pre_hook(functools.partial(StateDictHooks.on_load, self)),
                   model.register_load_state_dict_post_hook(functools.partial(StateDictHooks.after_load, self))]
        save, load, loaded = (functools.partial(f, self) for f in (
            StateDictHooks.on_module_state_dict, StateDictHooks.on_module_load, StateDictHooks.after_module_load))
        for module in dict.fromkeys(sel.module for sel in self.state.selected):
            handle = module.register_state_dict_post_hook(functools.partial(save))
            module._state_dict_hooks.move_to_end(handle.id, last=False)
            handles += [handle, module.register_load_state_dict_pre_hook(functools.partial(load)),
                        module.register_load_state_dict_post_hook(functools.partial(loaded))]
        return handles

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
        if not state.bound:
            return []
        refused = [(r.fqn, why) for r in state.records if (why := unsupported(r))]
        if refused:
            fqn, why = refused[0]
            raise RuntimeError(
                f"dmuon: model.state_dict()/load_state_dict() cannot show dedicated matrix {fqn!r} as "
                f"FSDP2 would: it {why} ({len(refused)} such matrices). Checkpoint this model with "
                f"dmuon.state_dict(model, opt) + dcp.save and dmuon.load(model, opt, path).")
        return state.records

    def _module_records(self, module: Any) -> list[DedicatedParam]:
        """The dedicated matrices ``module`` holds itself, in model order (``[]`` outside
        translation)."""
        records = self._records()
        if not records:
            return []
        if self._by_module[0] is not records:
            by_module: dict[int, list[DedicatedParam]] = {}
            for rec in records:
                by_module.setdefault(id(rec.module), []).append(rec)
            self._by_module = (records, by_module)
        return self._by_module[1].get(id(module), [])

    # ------------------------------------------------------------------ save
    @torch.no_grad()
    def on_module_state_dict(self, module: Any, sd: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        """Post-hook of a module holding dedicated matrices: their entries -> FSDP2-laid-out
        DTensors (or full tensors) of the owners' current masters. Collective (one broadcast
        per matrix, in model order)."""
        for rec in self._module_records(module):
            key = prefix + rec.attr
            if key in sd:
                sd[key] = self.entry(rec, rec.master)

    # ------------------------------------------------------------------ load
    def stage_all(self, entries: list[tuple[DedicatedParam, str, Any]], consequence: str,
                  source: str = "the state dict", target: str = "this model") -> list[torch.Tensor]:
        """Stage every ``(rec, where, value)`` entry as this rank's TP slice (:meth:`staged`),
        check, agree. Collective over the world (two ``all_gather_object`` and the staging);
        every rank must pass the same entries (``where`` names one in the errors; ``source``
        and ``target`` name what is loaded into what). Returns the staged tensors, in
        ``entries``' order.

        Raises:
            ValueError: on every rank, if the ranks' entries differ in kind or an entry does
                not fit on any rank; ``consequence`` ends the message.
        """
        world = self.state.roles.world
        kinds = [(where, hasattr(value, "full_tensor")) for _, where, value in entries]
        everyone: list[Any] = [None] * dist.get_world_size(world)
        dist.all_gather_object(everyone, kinds, group=world)
        differ = [r for r, k in zip(dist.get_process_group_ranks(world), everyone) if k != everyone[0]]
        if differ:  # full_tensor() below must run on every rank or on none
            raise ValueError(
                f"dmuon: {source}'s dedicated entries (name, is a DTensor) differ across ranks: "
                f"ranks {differ} against the first rank's {everyone[0][:3]}. Give every rank the "
                f"same kind of state dict (all sharded or all full). {consequence}")
        staged, problems = [], []
        for rec, where, value in entries:
            full, problem = self.staged(value, rec, where)
            staged.append(full)
            if problem:
                problems.append(problem)
        agree(problems, world, f"{source} does not fit {target}", consequence)
        return staged

    @torch.no_grad()
    def on_load(self, module: Any, sd: dict[str, Any], prefix: str, local_metadata: Any, strict: bool,
                missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
        """Root pre-hook: every dedicated entry present under its canonical key is staged,
        checked and agreed on before anything is written (:meth:`_stage_all`); the entries stay
        as they are, and each module's pre-hook hands torch the staged tensor for an entry that
        is still the one checked here. Collective."""
        self._staged.clear()
        records = self._records()
        if not records:
            return
        present = [(rec, prefix + module_key(rec.fqn)) for rec in records]
        present = [(rec, key) for rec, key in present if key in sd]
        staged = self.stage_all([(rec, f"entry {key!r}", sd[key]) for rec, key in present], NOTHING_LOADED)
        self._staged = {id(rec): (sd[key], full) for (rec, key), full in zip(present, staged)}
        self._in_root_load = True

    def after_load(self, module: Any, incompatible_keys: Any) -> None:
        """Root post-hook: forget this load's staged entries."""
        self._staged.clear()
        self._in_root_load = False

    @torch.no_grad()
    def on_module_load(self, module: Any, sd: dict[str, Any], prefix: str, local_metadata: Any, strict: bool,
                       missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
        """Pre-hook of a module holding dedicated matrices: torch gets the owner's full tensor
        (the placeholder elsewhere) for each of its entries. An entry the root pre-hook staged
        and no hook replaced since takes that staged tensor; another one (made by a load hook
        of this module or its ancestors, or any entry of a submodule's own
        ``load_state_dict``) is staged, checked and agreed on now: collective when there are
        such entries."""
        present, pending = [], []
        for rec in self._module_records(module):
            key = prefix + rec.attr
            if key in sd:
                checked, full = self._staged.get(id(rec), (_UNSTAGED, None))
                (present if sd[key] is checked else pending).append((rec, key, full))
        if pending:
            name = prefix[:-1] or "the model"
            try:
                staged = self.stage_all([(rec, f"entry {key!r}", sd[key]) for rec, key, _ in pending], (
                    f"Module {name!r}'s dedicated matrices are unchanged on every rank (entries a load "
                    f"hook made are checked as their module loads: modules loaded before it keep what "
                    f"they loaded)."))
            except ValueError:
                self._in_root_load = False
                self._staged.clear()
                raise
            present += [(rec, key, full) for (rec, key, _), full in zip(pending, staged)]
            self._refresh = self._refresh or not self._in_root_load
        for rec, key, full in present:
            sd[key] = full if rec.is_owner else rec.master.detach()

    def after_module_load(self, module: Any, incompatible_keys: Any) -> None:
        """Post-hook of a module holding dedicated matrices: outside a root load (a submodule's
        own ``load_state_dict``), the written masters' published copies are refreshed."""
        if self._refresh and not self._in_root_load:
            self._refresh = False
            self.state.publish_after_step(issue=False)
