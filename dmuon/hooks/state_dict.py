"""One translation of dedicated matrices into state-dict entries (:func:`entries`), and the
hooks that make ``model.state_dict()`` / ``opt.state_dict()`` and their loads show what FSDP2
and a torch optimizer show (what torch's state-dict utilities and ``dcp.save`` expect).

* Model (:class:`StateDictHooks`): a post-hook, first on each module holding a dedicated
  matrix, shows the owner's master in FSDP2's layout (``rec.sd_layout``); on load the root
  pre-hook stages and checks every entry on every rank before anything is written, and each
  module's pre-hook hands torch the staged tensor on the owner, the placeholder elsewhere.
* Optimizer (:class:`OptimizerStateHooks`): ``ns_dtype`` as a string (torch's utilities refuse
  a ``torch.dtype``); each ``momentum_buffer`` in torch's view of its parameter, staged on load
  like the model's and given to its owner.
* ``dmuon.Muon(params, ...)``: state tensors laid out like their parameter and created at
  construction (:func:`init_state`), so ``get_optimizer_state_dict`` finds state and does not
  step.

Split and expert-parallel stacks have no torch view (``RuntimeError``; :func:`dmuon.state_dict`
saves them).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from dmuon.owners.dedicated import DedicatedParam
from dmuon.owners.slices import chunk_sizes, local_tensor
from dmuon.owners.update import dtype_name, first_step_state, parse_dtype

WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")
NOTHING_LOADED = "Nothing was loaded: the dedicated matrices are unchanged on every rank."
_UNSTAGED = object()  # no entry is this object: the root pre-hook did not stage the matrix


def canonical_fqn(name: str) -> str:
    """``name`` without activation-checkpointing's and ``torch.compile``'s wrapper components
    (``_checkpoint_wrapped_module.``, ``_orig_mod.``), as torch's state-dict utilities name it."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


class Layout(NamedTuple):
    """A DTensor parameter's layout: FSDP2's sharded parameter (``fsdp``), else a TP one."""

    mesh: Any
    placements: tuple
    shape: tuple
    stride: tuple
    fsdp: bool = False

    def wrap(self, local: torch.Tensor) -> torch.Tensor:
        """``local`` (this rank's piece) as a DTensor with this layout, aliasing it."""
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local, self.mesh, list(self.placements), run_check=False,
                                  shape=torch.Size(self.shape), stride=tuple(self.stride))


def layout_of(tensor: Any, fsdp: bool = True) -> Layout | None:
    """The :class:`Layout` of a DTensor parameter; ``None`` for a plain tensor."""
    if tensor is None or not hasattr(tensor, "device_mesh"):
        return None
    return Layout(tensor.device_mesh, tuple(tensor.placements), tuple(tensor.shape),
                  tuple(tensor.stride()), fsdp)


def entries(rec: DedicatedParam, local: torch.Tensor | None, state: Any = None) -> list[tuple[str, Any]]:
    """``(canonical key, tensor)`` entries of ``rec``'s master or momentum ``local`` (fp32
    ``rec.shape`` on the owner; unused elsewhere). ``state`` ``None``: dmuon's view (owner only,
    aliases) under ``rec.key``: a TP slice as a DTensor on the TP mesh, an expert range as
    ``"fqn[e]"`` -> ``[rows, cols]`` views. ``state`` the model's ``DedicateState``: torch's
    view (every shard rank, one broadcast) under ``rec.fqn``, laid out as ``rec.sd_layout``.
    """
    if state is not None:
        if rec.is_owner:
            full = local.detach().to(torch.float32).clone()
        else:
            full = torch.empty(rec.shape, dtype=torch.float32, device=rec.master.device)
        if dist.get_world_size(state.group) > 1:
            dist.broadcast(full, src=dist.get_global_rank(state.group, rec.owner), group=state.group)
        lay = rec.sd_layout
        if lay is not None and lay.fsdp:  # this shard rank's rows, as FSDP2 chunks them
            full = full.split(chunk_sizes(rec.shape[0], state.world_size))[state.rank].clone()
        if lay is not None:
            full = lay.wrap(full)
        return [(canonical_fqn(rec.fqn), full)]
    if rec.experts is not None:
        experts, fqn = local.view(-1, *local.shape[-2:]), canonical_fqn(rec.fqn)
        return [(f"{fqn}[{rec.experts[0] + i}]", experts[i]) for i in range(experts.shape[0])]
    if rec.tp_shard_dim is not None:
        from torch.distributed.tensor import Shard

        rows, cols = rec.full_shape
        tp = Layout(rec.compute.device_mesh, (Shard(rec.tp_shard_dim),), (rows, cols), (cols, 1))
        local = tp.wrap(local)
    return [(canonical_fqn(rec.key), local)]


def momentum_replica(rec: DedicatedParam, state: Any) -> int | None:
    """The HSDP replica whose momentum of ``rec`` counts: ``0`` in ``"broadcast"`` mode (only
    replica 0 steps the matrix), ``None`` when every copy is current (``"compute"``, no HSDP)."""
    return 0 if rec.replicate_mode == "broadcast" and state.roles.replicate is not None else None


def staged_tp_local(value: Any, rec: DedicatedParam, where: str,
                    state: Any) -> tuple[torch.Tensor | None, str | None]:
    """A loaded entry as this rank's TP slice (``rec.shape``): ``(tensor, None)``, or ``(None,
    why not)``. Collective for a DTensor: all-gathered over the shard group when laid out as
    :func:`entries`' torch view, else ``full_tensor()``."""
    if not isinstance(value, torch.Tensor):
        return None, f"{where} should be a tensor, got {type(value).__name__}"
    full_shape = tuple(rec.full_shape) if rec.tp_shard_dim is not None else tuple(rec.shape)
    if tuple(value.shape) != full_shape:
        return None, (f"{where} has shape {tuple(value.shape)} but the matrix is {full_shape} "
                      f"(a state dict of another model, or a dmuon placeholder)")
    lay = rec.sd_layout
    if (lay is not None and lay.fsdp and hasattr(value, "to_local")
            and value.device_mesh == lay.mesh and tuple(value.placements) == lay.placements):
        rows = chunk_sizes(rec.shape[0], state.world_size)
        local = value.to_local().detach()
        padded = torch.zeros((max(rows), *rec.shape[1:]), dtype=local.dtype, device=local.device)
        padded[: local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in range(state.world_size)]
        dist.all_gather(parts, padded, group=state.group)
        return torch.cat([p[:r] for p, r in zip(parts, rows)]), None
    full = (value.full_tensor() if hasattr(value, "full_tensor") else value).detach()
    if rec.tp_shard_dim is None:
        return full, None
    return torch.chunk(full, state.roles.tp_size, dim=rec.tp_shard_dim)[state.tp_rank], None


def agree(problems: list[str], group: Any, what: str, consequence: str = NOTHING_LOADED,
          error: type[Exception] = ValueError, cause: BaseException | None = None) -> None:
    """Raise ``error`` on every rank of ``group`` (``None``: the default group) if any rank has
    problems (one ``all_gather_object``; local without torch.distributed), naming each rank's
    first three; ``consequence`` ends the message; ``cause`` is chained."""
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
    """The model's state-dict hooks of one :class:`dmuon.hooks.state.DedicateState`."""

    def __init__(self, state: Any) -> None:
        self.state = state
        # id(rec) -> (the entry the root pre-hook checked, its staged full tensor), this load
        self._staged: dict[int, tuple[Any, torch.Tensor]] = {}
        self._in_root_load = False  # between the root's load pre-hook and its post-hook
        self._refresh = False  # a module's hook wrote masters outside a root load
        # the records list checked by records(), and its matrices by id(module), built once
        self._checked: list[DedicatedParam] | None = None
        self._by_module: dict[int, list[DedicatedParam]] = {}

    def install(self) -> list[Any]:
        """Register the hooks; returns their handles. A module's state_dict post-hook goes
        first (a parent's hook, torchtitan's fused-QKV split, must see FSDP2's view); its load
        pre-hook runs after the module's own (torchtitan's QKV merge)."""
        model, cls, hook = self.state.model, StateDictHooks, functools.partial
        # partials: torch marks a public hook with an attribute, which a bound method refuses
        handles = [model.register_load_state_dict_pre_hook(hook(cls.on_load, self)),
                   model.register_load_state_dict_post_hook(hook(cls.after_load, self))]
        for module in dict.fromkeys(sel.module for sel in self.state.selected):
            handle = module.register_state_dict_post_hook(hook(cls.on_module_state_dict, self))
            module._state_dict_hooks.move_to_end(handle.id, last=False)
            handles += [handle, module.register_load_state_dict_pre_hook(hook(cls.on_module_load, self)),
                        module.register_load_state_dict_post_hook(hook(cls.after_module_load, self))]
        return handles

    def records(self) -> list[DedicatedParam]:
        """The dedicated matrices torch's view translates (``[]`` before binding);
        ``RuntimeError`` for a split or expert-parallel stack, which has none."""
        state = self.state
        if not state.bound:
            return []
        if self._checked is not state.records:  # once per binding, not per module hook
            refused = [(r.fqn, "is an expert stack split into several owner ranges" if r.stack is not None
                        else "is an expert-parallel stack") for r in state.records
                       if r.stack is not None or r.group is not None]
            if refused:
                fqn, why = refused[0]
                raise RuntimeError(
                    f"dmuon: model.state_dict()/load_state_dict() cannot show dedicated matrix {fqn!r} "
                    f"as FSDP2 would: it {why} ({len(refused)} such matrices). Checkpoint this model "
                    f"with dmuon.state_dict(model, opt) + dcp.save and dmuon.load(model, opt, path).")
            by_module: dict[int, list[DedicatedParam]] = {}
            for rec in state.records:
                by_module.setdefault(id(rec.module), []).append(rec)
            self._checked, self._by_module = state.records, by_module
        return state.records

    def _module_records(self, module: Any) -> list[DedicatedParam]:
        """The dedicated matrices ``module`` holds itself, in model order."""
        return self._by_module.get(id(module), []) if self.records() else []

    @torch.no_grad()
    def on_module_state_dict(self, module: Any, sd: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        """Post-hook: the module's masters in torch's view (one broadcast per matrix)."""
        for rec in self._module_records(module):
            if prefix + rec.attr in sd:
                sd[prefix + rec.attr] = entries(rec, rec.master, self.state)[0][1]

    def stage_all(self, entries: list[tuple[DedicatedParam, str, Any]], consequence: str,
                  source: str = "the state dict", target: str = "this model") -> list[torch.Tensor]:
        """Stage every ``(rec, where, value)`` as this rank's TP slice (:func:`staged_tp_local`),
        check, agree (else ``ValueError`` on every rank); returns the staged tensors. Collective."""
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
        staged = [staged_tp_local(value, rec, where, self.state) for rec, where, value in entries]
        agree([p for _, p in staged if p], world, f"{source} does not fit {target}", consequence)
        return [full for full, _ in staged]

    @torch.no_grad()
    def on_load(self, module: Any, sd: dict[str, Any], prefix: str, *args: Any) -> None:
        """Root pre-hook: stage, check and agree on every dedicated entry before anything is
        written. Collective."""
        self._staged.clear()
        records = self.records()
        if not records:
            return
        # nn.Module.state_dict names a parameter without checkpoint_wrapper's component (its hooks
        # strip it), but keeps torch.compile's _orig_mod.
        present = [(rec, prefix + rec.fqn.replace(WRAPPER_PREFIXES[0], "")) for rec in records]
        present = [(rec, key) for rec, key in present if key in sd]
        staged = self.stage_all([(rec, f"entry {key!r}", sd[key]) for rec, key in present], NOTHING_LOADED)
        self._staged = {id(rec): (sd[key], full) for (rec, key), full in zip(present, staged)}
        self._in_root_load = True

    def after_load(self, module: Any, incompatible_keys: Any) -> None:
        """Root post-hook: forget this load's staged entries."""
        self._staged.clear()
        self._in_root_load = False

    @torch.no_grad()
    def on_module_load(self, module: Any, sd: dict[str, Any], prefix: str, *args: Any) -> None:
        """Pre-hook: torch gets the staged tensor on the owner, the placeholder elsewhere; an
        entry the root did not stage (a hook made it) is staged now (collective)."""
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
                self.after_load(module, None)
                raise
            present += [(rec, key, full) for (rec, key, _), full in zip(pending, staged)]
            self._refresh = self._refresh or not self._in_root_load
        for rec, key, full in present:
            sd[key] = full if rec.is_owner else rec.master.detach()

    def after_module_load(self, module: Any, incompatible_keys: Any) -> None:
        """Post-hook: outside a root load (``submodule.load_state_dict``), refresh the
        published copies."""
        if self._refresh and not self._in_root_load:
            self._refresh = False
            self.state.publish_after_step(issue=False)


def param_names(model: torch.nn.Module, params: list[torch.Tensor], state: Any = None) -> list[str]:
    """Canonical FQNs of ``params`` (dedicated masters by their plan key)."""
    names = {id(p): canonical_fqn(n) for n, p in model.named_parameters()}
    if state is not None:
        names.update({id(rec.master): canonical_fqn(rec.key or rec.fqn) for rec in state.records})
    return [names.get(id(p), f"param{i}") for i, p in enumerate(params)]


def _ns_dtypes(groups: list[dict[str, Any]], convert: Any) -> list[dict[str, Any]]:
    """Copies of ``groups`` with ``convert`` applied to each ``ns_dtype``."""
    return [{**g, "ns_dtype": convert(g["ns_dtype"])} if "ns_dtype" in g else dict(g) for g in groups]


class OptimizerStateHooks:
    """The state-dict hooks of :class:`dmuon.Muon` ``opt``; ``state``: the model's
    :class:`dmuon.hooks.state.DedicateState`, or ``None`` (only ``param_groups`` translated)."""

    def __init__(self, opt: torch.optim.Optimizer, state: Any = None) -> None:
        self.opt, self.state = opt, state

    def install(self) -> list[Any]:
        """Register the hooks on the optimizer; returns their handles."""
        cls = OptimizerStateHooks
        return [self.opt.register_state_dict_post_hook(functools.partial(cls.on_state_dict, self)),
                self.opt.register_load_state_dict_pre_hook(functools.partial(cls.on_load, self))]

    def _muon_records(self) -> list[tuple[int, int, Any]]:
        """``(group index, position, record)`` of every trainable dedicated matrix (``[]``
        before binding); ``RuntimeError`` as :meth:`StateDictHooks.records`."""
        if self.state is None or not self.state.state_dict_hooks.records():
            return []
        return [(gi, pos, self.state.record_of_master[master])
                for gi, group in enumerate(self.opt.param_groups) if group.get("kind") == "muon"
                for pos, master in enumerate(group["params"]) if master.requires_grad]

    @torch.no_grad()
    def on_state_dict(self, opt: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
        """Post-hook: ``ns_dtype`` as a string, momentum in torch's view (collective: one
        all_reduce, one broadcast per matrix). Zeros on an owner that has not stepped, unless
        no owner has (a fresh optimizer shows no Muon state)."""
        groups = _ns_dtypes(sd["param_groups"],
                            lambda v: dtype_name(v) if isinstance(v, torch.dtype) else v)
        out = {**sd, "param_groups": groups}
        records = self._muon_records()
        if not records:
            return out
        ctx, state = self.state, dict(sd["state"])
        held = torch.tensor([float(any(rec.is_owner and "momentum_buffer" in opt.state.get(rec.master, {})
                                       for _, _, rec in records))],
                            device=records[0][2].master.device)  # NCCL reduces on the GPU
        if dist.is_initialized() and dist.get_world_size(ctx.roles.world) > 1:
            dist.all_reduce(held, op=dist.ReduceOp.MAX, group=ctx.roles.world)
        if not held.item():
            return out
        for gi, pos, rec in records:
            buf = None
            if rec.is_owner:
                buf = opt.state.get(rec.master, {}).get("momentum_buffer")
                if buf is None:  # not stepped yet: torch.optim.Muon starts from zeros
                    buf = torch.zeros(rec.shape, dtype=torch.float32, device=rec.master.device)
                src = momentum_replica(rec, ctx)
                if src is not None:
                    buf = buf.clone()
                    dist.broadcast(buf, src=dist.get_global_rank(ctx.roles.replicate, src),
                                   group=ctx.roles.replicate)
            pid = groups[gi]["params"][pos]
            state[pid] = {**state.get(pid, {}), "momentum_buffer": entries(rec, buf, ctx)[0][1]}
        # parameter order: torch's full state dict gathers entry by entry in dict order
        out["state"] = {pid: state[pid] for g in groups for pid in g["params"] if pid in state}
        return out

    @torch.no_grad()
    def on_load(self, opt: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
        """Pre-hook: ``ns_dtype`` parsed back; each momentum staged, checked, agreed on
        (:meth:`StateDictHooks.stage_all`), then given to its owner only."""
        groups = _ns_dtypes(sd["param_groups"], parse_dtype)
        out = {**sd, "param_groups": groups}
        records = self._muon_records()
        if not records:
            return out
        state, present = dict(sd["state"]), []
        for gi, pos, rec in records:
            saved = groups[gi]["params"] if gi < len(groups) else []
            if pos >= len(saved):
                continue  # torch's load_state_dict names the group-size mismatch
            entry = state.get(saved[pos])
            if isinstance(entry, dict) and "momentum_buffer" in entry:
                present.append((saved[pos], rec, entry))
        staged = self.state.state_dict_hooks.stage_all(
            [(rec, f"optimizer state {canonical_fqn(rec.fqn)!r}/momentum_buffer", entry["momentum_buffer"])
             for _, rec, entry in present],
            "Nothing was loaded: the optimizer state is unchanged on every rank.",
            source="the optimizer state dict", target="this optimizer")
        for (pid, rec, entry), full in zip(present, staged):
            if rec.is_owner:
                state[pid] = {**entry, "momentum_buffer": full.to(torch.float32)}
            else:
                state.pop(pid)
        out["state"] = state
        return out


def init_state(opt: torch.optim.Optimizer) -> None:
    """Create every trainable parameter's state now (frozen ones get none, as in torch)."""
    for group in opt.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                first_step_state(opt.state[p], p, group["use_muon"])


def local_state(value: torch.Tensor, shape: torch.Size, name: str, where: str) -> torch.Tensor:
    """This rank's piece of state tensor ``name`` (a DTensor or a plain local piece); a
    ``RuntimeError`` naming the fix if it is not ``shape`` (another layout's state dict)."""
    local = local_tensor(value)
    if local.shape != shape:
        raise RuntimeError(
            f"dmuon: {where}: optimizer state {name!r} holds a local piece of shape "
            f"{tuple(local.shape)} ({type(value).__name__} of shape {tuple(value.shape)}), but the "
            f"parameter's local piece is {tuple(shape)}. Load optimizer state with "
            f"torch.distributed.checkpoint.state_dict.set_optimizer_state_dict (or dcp.load into "
            f"get_optimizer_state_dict's dict), which lays it out like the parameter.")
    return local
