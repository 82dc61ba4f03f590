"""Binding: from the selected matrices to owners' masters, placeholders, units and buckets.

Runs once per model, at ``dmuon.Muon`` construction or the first forward (after the user's
``fully_shard``). Collective, in the same order on every rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dmuon.hooks import fsdp_adapter as fsdp
from dmuon.comm.ddp_allreduce import ReplicatedGrads
from dmuon.comm.grad_buckets import GradBucket, IssueOrder, make_buckets
from dmuon.hooks.keep import bucket_keys, keeps_replicas
from dmuon.hooks.state_dict import layout_of
from dmuon.hooks.tp_placements import as_compute_param, local_slice
from dmuon.hooks.unit import PublishGroup, Unit
from dmuon.owners.dedicated import DedicatedParam, free_storage, make_dedicated
from dmuon.owners.stacks import ParamLayout, StackSlot


@dataclass(eq=False)
class Selected:
    """A dedicated parameter (a matrix or a stack of them) before binding."""

    fqn: str
    module: nn.Module
    attr: str
    shape: tuple[int, ...]
    blocks: int = 1
    optional: bool = False  # a ModuleList expert: may take no gradient on some ranks
    ep: int = 1  # expert parallelism: ranks its experts are split over (1: not expert-parallel)

    @property
    def layout(self) -> ParamLayout:
        """How this rank's part (its ``E / ep`` local experts) splits into matrices."""
        return ParamLayout(shape=tuple(self.shape), blocks=self.blocks).local(self.ep)

    @property
    def param(self) -> nn.Parameter:
        """The parameter the module holds now (the user's, until binding replaces it)."""
        return self.module._parameters[self.attr]


def check_materialized(selected: list[Selected]) -> None:
    """``RuntimeError`` for matrices still on the meta device (binding copies their values)."""
    on_meta = [sel.fqn for sel in selected if sel.param.is_meta]
    if on_meta:
        shown = ", ".join(repr(n) for n in on_meta[:3])
        shown += f" and {len(on_meta) - 3} more" if len(on_meta) > 3 else ""
        raise RuntimeError(
            f"dmuon: {len(on_meta)} dedicated matrices are still on the meta device ({shown}); "
            f"dmuon.Muon (or the first forward) builds the owners' masters from the current "
            f"values. Call, in this order: fully_shard(...), dmuon.dedicate_params(model, mesh), "
            f"model.to_empty(device=...), the model's own init (reset_parameters() / "
            f"init_weights()), then dmuon.Muon(model, ...)."
        )


def bind(state: Any) -> list[tuple[DedicatedParam, Unit, PublishGroup, GradBucket]]:
    """Take the selected matrices from the model and fill ``state``'s runtime fields in place;
    returns ``(record, unit, publish group, gradient bucket)`` per record that takes a gradient.
    ``ValueError``: an FSDP2 ``param_dtype`` dmuon cannot publish, bad ``replicas``, an HSDP or
    TP mesh without FSDP2."""
    selected, model, roles = state.selected, state.model, state.roles
    fsdp_states = state.fsdp_states = fsdp.fsdp_states(model)
    keep = state.keep = keeps_replicas(state.replicas, fsdp_wrapped=bool(fsdp_states), roles=roles)
    specs_of = state.plan.specs_by_fqn()
    parents = fsdp.parent_map(model)
    policies = [fsdp.mixed_precision_dtypes(fsdp.enclosing_fsdp_module(sel.module, parents))
                for sel in selected]
    for sel, (param_dtype, _) in zip(selected, policies):  # before anything is taken from FSDP2
        if param_dtype is not None and (not param_dtype.is_floating_point or param_dtype.itemsize < 2):
            raise ValueError(
                f"dmuon: the FSDP2 block holding {sel.fqn!r} computes in {param_dtype} "
                f"(MixedPrecisionPolicy.param_dtype); dmuon publishes float16, bfloat16, float32 "
                f"or float64 weights. Use one of those, or pass predicate=... to leave the matrix "
                f"on AdamW."
            )
    unit_ids, unit_modules = publish_units(model, selected, parents)
    units = []
    for index, module in enumerate(unit_modules):
        reshard = state.reshard_after_forward  # FSDP2's, read before its groups lose our matrices
        if reshard is None:
            reshard = fsdp.reshards_after_forward(fsdp.enclosing_fsdp_module(module, parents), parents)
        units.append(Unit(state=state, index=index, module=module, reshard=reshard))
    # one entry per plan entry: a matrix, or an expert range of a stack (the shape seam)
    layouts: dict[int, Any] = {}  # selected index -> FSDP2's sharded layout (or None)
    entries = []  # (selected index, spec, slice holding the entry's piece, requires_grad, dtypes)
    for i, (sel, (param_dtype, reduce_dtype)) in enumerate(zip(selected, policies)):
        # collective redistributes, in the same order on every rank
        param = sel.param
        taken = fsdp.take_from_fsdp(model, sel.module, sel.attr)
        layouts[i] = layout_of(taken) if taken is not None else layout_of(param, fsdp=False)
        sl = local_slice(taken if taken is not None else param, sel.fqn, roles.tp_name,
                         roles.ep_name if sel.ep > 1 else None)
        layout, specs = sel.layout, specs_of[sel.fqn]
        if layout.is_stack and sl.shard_dim is not None:
            raise ValueError(f"dmuon: parameter {sel.fqn!r} (shape {tuple(sel.shape)}) is a stack of "
                             f"matrices split by tensor parallelism; dmuon takes TP on 2-D matrices "
                             f"only. Pass predicate=... to leave it on AdamW.")
        dtypes = (param_dtype or sl.local.dtype, reduce_dtype or param_dtype or sl.local.dtype)
        for spec in specs:
            piece = sl.local
            if len(specs) > 1:
                piece = layout.flat_view(sl.local)[spec.experts[0]: spec.experts[1]]
            entries.append((i, spec, dataclasses.replace(sl, local=piece), param.requires_grad) + dtypes)
    unit_of = [units[unit_ids[e[0]]] for e in entries]
    # keep mode: publish groups and gradient buckets per plan bucket; else per unit
    keys = (bucket_keys(state.plan, [e[1] for e in entries], state.bucket_bytes) if keep
            else [u.index for u in unit_of])
    # expert parallelism: an expert stack's owner is a rank of the group holding its experts
    pgs = [roles.expert if e[1].ep else None for e in entries]
    ranks = [dist.get_rank(pg) if pg is not None else state.rank for pg in pgs]
    views = make_groups(entries, keys, ranks, keep, pgs)
    records = []
    slots: dict[int, StackSlot] = {}
    for order, (i, spec, sl, requires_grad, compute_dtype, reduce_dtype) in enumerate(entries):
        sel = selected[i]
        group, storage = views[order]
        stacked = sel.layout.is_stack or sel.blocks > 1
        split = len(specs_of[sel.fqn]) > 1  # the module computes with the whole stack
        key, experts = spec.key, spec.experts
        if spec.ep:  # named by global experts: each "ep" coordinate's own (checkpoint keys)
            first = sl.tp_mesh.get_local_rank() * sel.layout.count
            experts = (first + spec.experts[0], first + spec.experts[1])
            key = f"{sel.fqn}[{experts[0]}:{experts[1]}]"
        wrap = (lambda t, sl=sl, shape=sel.shape: as_compute_param(t, sl, shape))
        rec = make_dedicated(
            fqn=sel.fqn, module=sel.module, attr=sel.attr, full=sl.local,
            owner=spec.owner, rank=ranks[order], compute_dtype=compute_dtype,
            reduce_dtype=reduce_dtype, requires_grad=requires_grad, order=order,
            # an "ep" stack split into ranges is wrapped whole, by its slot
            wrap=None if split and sel.ep > 1 else wrap,
            storage=storage, full_shape=tuple(sl.local.shape) if stacked else sel.shape,
            tp_shard_dim=sl.shard_dim, tp_owner=spec.tp_owner,
            replicate_mode=spec.replicate_mode or "compute",  # the plan decides
            matrix_shape=sel.layout.matrix_shape if stacked else sel.shape, key=key,
            experts=experts, optional=sel.optional, group=pgs[order],
            sd_layout=layouts[i],  # what model.state_dict() shows (dmuon.hooks.state_dict)
        )
        if split:
            slot = slots.setdefault(i, StackSlot(sel.module, sel.attr, tuple(sel.layout.shape),
                                                 wrap=wrap if sel.ep > 1 else None))
            slot.records.append(rec)
            rec.stack = slot
        group.members.append(rec)
        if rec.compute.requires_grad:
            group.grad_count += 1
        unit_of[order].add(rec, group)
        records.append(rec)
    for slot in slots.values():
        slot.show("master")
    groups = list(dict.fromkeys(group for group, _ in views))
    for group in groups:
        if not group.is_owner and not keep:  # keep mode: full weights stay
            free_storage(group.flat)
    buckets = make_buckets(records, keys, persistent=keep)
    bucket_of = {rec: bucket for bucket in buckets for rec in bucket.records}
    wiring = [(rec, unit_of[i], views[i][0], bucket_of[rec])
              for i, rec in enumerate(records) if rec.compute.requires_grad]
    if fsdp_states:  # each bucket follows its FSDP2 block's gradient divide factor
        for rec, unit, _, bucket in wiring:
            bucket.block = unit.module
    state.records, state.units, state.groups, state.buckets = records, units, groups, buckets
    state.issue_order = IssueOrder(buckets)  # every rank issues the buckets in this order
    state.record_of_master = {rec.master: rec for rec in records}
    replicated = replicate_others(state, records) if not fsdp_states and state.world_size > 1 else []
    if keep and replicated and records:
        # the bucket of the model's first matrix goes out last, at the end of backward, when
        # the first layers' parameters (embeddings, the patch projection's bias) are in too
        first = next(bucket for bucket in buckets if records[0] in bucket.index)
        if all(p.dtype == first.dtype and p.device == first.device for p in replicated):
            first.attach_shared(replicated)
            state.shared_bucket = first
    if replicated and state.shared_bucket is None:
        state.replicated = ReplicatedGrads(replicated, state.group, state.bucket_bytes,
                                           before_issue=state.step_check.settle)
    return wiring


def publish_units(model: nn.Module, selected: list[Selected],
                  parents: dict[int, nn.Module]) -> tuple[list[int], list[nn.Module]]:
    """``(unit id per selected matrix, module per unit id)``
    (:func:`dmuon.hooks.fsdp_adapter.publish_block`), ids in ``model.modules()`` order: the
    runtime's initial unit order."""
    blocks = [fsdp.publish_block(sel.module, parents) for sel in selected]
    wanted = {id(b) for b in blocks}  # modules compared by identity, as FSDP2 does
    modules = [m for m in model.modules() if id(m) in wanted]
    index = {id(m): i for i, m in enumerate(modules)}
    return [index[id(b)] for b in blocks], modules


def make_groups(entries: list[tuple], keys: list, ranks: list[int],
                keep: bool, pgs: list) -> list[tuple[PublishGroup, torch.Tensor]]:
    """One :class:`PublishGroup` per (key, process group, owner, dtype, device); returns each
    of :func:`bind`'s ``entries``' group and view of its flat buffer. ``pgs``: per entry, the
    owner's process group (``None``: the shard group); ``ranks``: this rank's index in it."""
    keyed: dict[tuple, list[int]] = {}
    for i, (_, spec, sl, _, dtype, _) in enumerate(entries):
        keyed.setdefault((keys[i], pgs[i], spec.owner, dtype, sl.local.device), []).append(i)
    views: list[Any] = [None] * len(entries)
    for (_, pg, owner, dtype, device), indices in keyed.items():
        numels = [entries[i][2].local.numel() for i in indices]
        flat = torch.empty(sum(numels), dtype=dtype, device=device)
        group = PublishGroup(owner=owner, is_owner=owner == ranks[indices[0]], flat=flat, keep=keep, pg=pg)
        for i, piece in zip(indices, torch.split(flat, numels)):
            views[i] = (group, piece)
    return views


def replicate_others(state: Any, records: list[DedicatedParam]) -> list[nn.Parameter]:
    """Plain replicated module on a 1-D mesh (else ``ValueError``): broadcast every other
    parameter from rank 0, as DDP does, and return the trainable ones."""
    roles = state.roles
    if roles.tp is not None or roles.replicate is not None or roles.expert is not None:
        raise ValueError(
            "dmuon: HSDP, tensor-parallel and expert-parallel meshes need FSDP2 (fully_shard) on "
            "the data-parallel dimensions; a plain replicated module is supported on a 1-D mesh"
        )
    masters = {rec.master for rec in records}  # parameters, hashed by identity
    params = [p for p in state.model.parameters() if p not in masters and not hasattr(p, "placements")]
    src = dist.get_global_rank(state.group, 0)
    with torch.no_grad():
        for p in params:
            dist.broadcast(p.data, src=src, group=state.group)
    return [p for p in params if p.requires_grad]
