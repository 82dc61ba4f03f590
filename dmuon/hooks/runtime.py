"""The per-model runtime: hooks for the four phases of a dmuon step.

One :class:`DedicateState` per model holds all mutable per-step state (FSDP2's
``FSDPStateContext`` pattern). Hooks only enqueue work (issue a broadcast, issue a reduce,
mark a record); the math lives in :mod:`dmuon.owners`.

Phase 1, forward materialization: a forward pre-hook on each *unit* waits for the unit's
publication, issued earlier, and prefetches the next ``prefetch`` units; a post-hook puts the
placeholders back and, with ``reshard_after_forward``, frees the full weights until a
pre-backward hook re-publishes them. A unit is what FSDP2 gathers: the module ``fully_shard``
was called on, never the leaf holding the parameter, so a parent that reads a child's weight
without calling the child (``nn.MultiheadAttention.out_proj``), a module called twice and a
block reused across depth all see full weights. On a plain replicated module it is the module
holding the matrix or its enclosing torch attention/transformer layer
(:func:`dmuon.hooks.fsdp.publish_block`).

Like FSDP2's ``FSDPParamGroup``, a unit keeps its full weights registered from its
pre-backward until its post-backward (its last gradient is in), and its forward hooks do
nothing while autograd runs: activation checkpointing re-runs forwards inside backward,
and cuts them short (early stop) so their post-forward never runs.
Phase 2, reduce-to-owner: a post-accumulate-grad hook on each full weight issues an async
``reduce`` of its gradient to the owner; a callback at the end of backward waits and averages.
Phase 4, publication: :meth:`DedicateState.publish_after_step` refreshes the owners' compute
copies and issues the first units' broadcasts so they overlap the next forward.

Which ranks hold what is a function of one rank-independent flag per matrix, ``live`` ("the
current weights are published or being published"), so every rank issues the same collectives
in the same order without talking about it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten

from dmuon.hooks import fsdp
from dmuon.hooks.comm import Pending, issued_together, publish
from dmuon.hooks.compile import dynamo_disable
from dmuon.hooks.desync import StepCheck, in_autograd_backward
from dmuon.hooks.grad_buckets import GradBucket, make_buckets
from dmuon.hooks.keep import bucket_keys, resolve_replicas
from dmuon.hooks.mesh import MeshRoles
from dmuon.hooks.replicas import ReplicaCombine, broadcast_masters
from dmuon.hooks.replicated import ReplicatedGrads
from dmuon.hooks.tp import as_compute_param, local_slice
from dmuon.owners.dedicated import DedicatedParam, alloc_storage, free_storage, make_dedicated
from dmuon.owners.plan import OwnerPlan

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class PublishGroup:
    """Dedicated matrices of one unit with the same owner, published by one broadcast.

    Their compute weights are views of ``flat`` (``[sum of numels]``, compute dtype), so the
    group is materialized, published and freed as one tensor, as FSDP2 all-gathers a unit's
    parameters into one buffer. ``live`` is rank-independent ("the current weights are
    published or being published"); ``bwd_done`` collects members whose gradient is in since
    the group went live, and the group is freed when every member that takes one has it.
    """

    owner: int
    is_owner: bool
    flat: torch.Tensor
    members: list[DedicatedParam] = field(default_factory=list)
    live: bool = False
    work: Any = None
    bwd_done: set = field(default_factory=set)
    grad_members: set = field(default_factory=set)  # ids of members that take a gradient


@dataclass(eq=False)
class Unit:
    """The dedicated matrices published together before one module runs.

    Attributes:
        index: position in forward order (the order units are prefetched in).
        module: the FSDP2 block (``fully_shard`` module) or, without FSDP2, the matrices'
            parent module (:func:`dmuon.hooks.fsdp.publish_block`).
        records: its dedicated matrices, in model order.
        groups: its publish groups (one per owner and compute dtype).
        takes_grad: some record's compute weight requires grad (set at bind).
        reshard: free non-owners' copies after forward (set at bind, FSDP2's rule).
        in_backward: between the unit's pre-backward and its post-backward; forward hooks
            (activation-checkpointing recomputation) then leave the full weights alone.
        grads_done: ids of records whose gradient is in during this backward.
        backward_finished: every gradient of the unit is in during this backward (an
            enclosing unit, e.g. FSDP2's root holding the head, may finish before the units
            it encloses): backward prefetch skips it.
    """

    index: int
    module: nn.Module
    records: list[DedicatedParam] = field(default_factory=list)
    groups: list[PublishGroup] = field(default_factory=list)
    takes_grad: bool = False
    reshard: bool = True
    in_backward: bool = False
    grads_done: set = field(default_factory=set)
    backward_finished: bool = False

    def show(self, which: str) -> None:
        """Register every record's ``"compute"`` weight (or ``"master"``) on its module."""
        for rec in self.records:
            rec.show(which)

    def grads_complete(self) -> bool:
        return all(id(rec) in self.grads_done for rec in self.records if rec.compute.requires_grad)


@dataclass(eq=False)
class Selected:
    """A dedicated matrix found at ``dedicate_params`` time, before binding."""

    fqn: str
    module: nn.Module
    attr: str
    shape: tuple[int, int]


def check_materialized(selected: list[Selected]) -> None:
    """Refuse to bind matrices that still live on the meta device.

    Binding copies each matrix's current value into its owner's master and leaves a zero-size
    placeholder on the module; a meta tensor has no value, and an init run after binding
    would see placeholders. Same on every rank (meta-ness does not depend on the rank), so
    every rank raises before any collective: no hang.

    Raises:
        RuntimeError: naming the first meta parameters and the order of calls that works.
    """
    on_meta = [sel.fqn for sel in selected if sel.module._parameters[sel.attr].is_meta]
    if on_meta:
        shown = ", ".join(repr(n) for n in on_meta[:3]) + (f" and {len(on_meta) - 3} more" if len(on_meta) > 3 else "")
        raise RuntimeError(
            f"dmuon: {len(on_meta)} dedicated matrices are still on the meta device ({shown}); "
            f"dmuon.Muon (or the first forward) builds the owners' masters from the current "
            f"values. Call, in this order: fully_shard(...), dmuon.dedicate_params(model, mesh), "
            f"model.to_empty(device=...), the model's own init (reset_parameters() / "
            f"init_weights()), then dmuon.Muon(model, ...)."
        )


def _check_param_dtypes(selected: list[Selected],
                        policies: list[tuple[torch.dtype | None, torch.dtype | None]]) -> None:
    """Refuse an FSDP2 ``param_dtype`` dmuon cannot publish, on every rank alike (the policies
    are the same everywhere), before binding changes anything.

    Raises:
        ValueError: naming the matrix, the dtype and the fix.
    """
    for sel, (param_dtype, _) in zip(selected, policies):
        if param_dtype is not None and (not param_dtype.is_floating_point or param_dtype.itemsize < 2):
            raise ValueError(
                f"dmuon: the FSDP2 block holding {sel.fqn!r} computes in {param_dtype} "
                f"(MixedPrecisionPolicy.param_dtype); dmuon publishes float16, bfloat16, float32 "
                f"or float64 weights. Use one of those, or pass predicate=... to leave the matrix "
                f"on AdamW."
            )


class DedicateState:
    """Everything dmuon keeps for one model on one rank.

    Args:
        model: the user's model (FSDP2-wrapped or plain).
        roles: dmuon's process groups along the mesh's shard / replicate / TP dimensions.
        plan: the owner plan, already checked identical on every rank.
        selected: the dedicated matrices, in model order.
        prefetch: how many units ahead a publication is issued (>= 1).
        reshard_after_forward: free non-owners' full weights after forward and publish again
            before backward (less memory, one more broadcast per matrix); ``None`` follows
            each enclosing FSDP2 block (:func:`dmuon.hooks.fsdp.reshards_after_forward`).
        bucket_bytes: bucket size for replicated gradient all-reduces (DDP-style path).
        replicate_mode: unused; the plan holds each matrix's HSDP mode
            (:attr:`dmuon.owners.plan.MatrixSpec.replicate_mode`).
        reduce_mode: how a block's gradients reach their owners: ``"reduce"`` or
            ``"all_reduce"`` (:mod:`dmuon.hooks.grad_buckets`).
        replicas: plain replicated module only: ``"keep"`` (default there) or
            ``"placeholder"`` (:mod:`dmuon.hooks.keep`).
        step_check: compare step and backward counts across ranks (:mod:`dmuon.hooks.desync`).
    """

    def __init__(
        self,
        model: nn.Module,
        roles: MeshRoles,
        plan: OwnerPlan,
        selected: list[Selected],
        *,
        prefetch: int,
        reshard_after_forward: bool | None,
        bucket_bytes: int,
        replicate_mode: str = "auto",
        reduce_mode: str = "reduce",
        replicas: str | None = None,
        step_check: bool = True,
    ) -> None:
        self.model = model
        self.roles = roles
        self.group = roles.shard
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.tp_rank = dist.get_rank(roles.tp) if roles.tp is not None else 0
        self.replicate_rank = dist.get_rank(roles.replicate) if roles.replicate is not None else 0
        self.replicate_mode = replicate_mode
        self.reduce_mode = reduce_mode
        self.plan = plan
        self.selected = selected
        self.prefetch = prefetch
        self.reshard_after_forward = reshard_after_forward
        self.bucket_bytes = bucket_bytes
        self.records: list[DedicatedParam] = []
        self.units: list[Unit] = []
        self.replicated: ReplicatedGrads | None = None
        self.bound = False
        self.fsdp_wrapped = False
        self._final_callback_queued = False
        self.sync_enabled = True  # False inside dmuon.no_sync
        self._sync_this_backward = True
        self._handles: list[Any] = []
        self.groups: list[PublishGroup] = []
        self.group_of: dict[int, PublishGroup] = {}
        self.buckets: list[GradBucket] = []
        self.bucket_of: dict[int, GradBucket] = {}  # id(record) -> its gradient bucket
        self.record_of_master: dict[int, DedicatedParam] = {}  # id(master) -> record
        self._fsdp_states: list[Any] = []
        self.unit_of_module: dict[int, Unit] = {}  # id(unit module) -> unit, set at bind
        self.unit_of_record: dict[int, Unit] = {}  # id(record) -> its unit
        self.ns_matrices = 0  # matrices this rank orthogonalized (for tests and stats)
        # replicas="keep" (dmuon.hooks.keep): set at binding on a plain replicated module; the
        # hooks below that differ there hand over to it.
        self.replicas = replicas
        self.keep = False  # replicas="keep": every rank keeps the full weights (set at bind)
        # ranks agree on steps and backwards (dedicate_params(step_check=False): no check)
        self.step_check = StepCheck(roles.steps if step_check else None)
        # Units are FSDP2 blocks, known only once fully_shard has run: binding (at dmuon.Muon
        # or, failing that, at the first forward, before FSDP2's root hook) creates them.
        self._bind_handle = model.register_forward_pre_hook(dynamo_disable(self._bind_at_first_forward),
                                                            prepend=True)
        self._handles += self.step_check.install(model)  # prepended: in front of binding too

    # ------------------------------------------------------------------ binding
    def ensure_bound(self) -> None:
        """Create masters and placeholders (collective; idempotent).

        Runs at optimizer construction or at the first forward, whichever comes first, so that
        ``dedicate_params`` may be called before or after the user's ``fully_shard`` calls.
        """
        if self.bound:
            return
        check_materialized(self.selected)
        self._bind_handle.remove()
        self._fsdp_states = fsdp.fsdp_states(self.model)
        self.fsdp_wrapped = bool(self._fsdp_states)
        # -- keep-mode dispatch (dmuon.hooks.keep) --
        plain_1d = self.roles.tp is None and self.roles.replicate is None
        if resolve_replicas(self.replicas, fsdp_wrapped=self.fsdp_wrapped, plain_1d=plain_1d) == "keep":
            self.keep = True
        specs = {m.fqn: m for m in self.plan.matrices}
        parents = fsdp.parent_map(self.model)
        unit_modules = [fsdp.publish_block(sel.module, parents) for sel in self.selected]
        policies = [fsdp.mixed_precision_dtypes(fsdp.enclosing_fsdp_module(sel.module, parents))
                    for sel in self.selected]
        _check_param_dtypes(self.selected, policies)  # before anything is taken from FSDP2
        self._make_units(unit_modules, parents)
        slices, blocks = [], []
        for sel, unit_module, (param_dtype, reduce_dtype) in zip(self.selected, unit_modules, policies):
            # collective redistributes, in the same order on every rank
            param = sel.module._parameters[sel.attr]
            taken = fsdp.take_from_fsdp(self.model, sel.module, sel.attr)
            sl = local_slice(taken if taken is not None else param, sel.fqn, self.roles.tp_name)
            slices.append((sl, param.requires_grad, param_dtype or sl.local.dtype,
                           reduce_dtype or param_dtype or sl.local.dtype))
            blocks.append(id(unit_module))
        unit_keys = list(blocks)
        if self.keep:  # publish groups and gradient buckets per plan bucket
            blocks = bucket_keys(self.plan, self.selected, self.bucket_bytes)
        views = self._make_groups(slices, specs, blocks)
        for order, (sel, (sl, requires_grad, compute_dtype, reduce_dtype)) in enumerate(zip(self.selected, slices)):
            spec = specs[sel.fqn]
            rec = make_dedicated(
                fqn=sel.fqn, module=sel.module, attr=sel.attr, full=sl.local,
                owner=spec.owner, rank=self.rank, compute_dtype=compute_dtype,
                reduce_dtype=reduce_dtype, requires_grad=requires_grad, order=order,
                wrap=lambda t, sl=sl, shape=sel.shape: as_compute_param(t, sl, shape),
                storage=views[order][1], full_shape=sel.shape, tp_shard_dim=sl.shard_dim,
                tp_owner=spec.tp_owner, replicate_mode=spec.replicate_mode or "compute",  # the plan decides
            )
            group = views[order][0]
            group.members.append(rec)
            if rec.compute.requires_grad:
                group.grad_members.add(id(rec))
            self.group_of[id(rec)] = group
            self.record_of_master[id(rec.master)] = rec
            self.records.append(rec)
            unit = self.unit_of_module[unit_keys[order]]
            unit.records.append(rec)
            self.unit_of_record[id(rec)] = unit
            if group not in unit.groups:
                unit.groups.append(group)
            if rec.compute.requires_grad:
                unit.takes_grad = True
                self._handles.append(rec.compute.register_post_accumulate_grad_hook(self._make_on_grad(rec)))
        for group in self.groups:
            if not group.is_owner and not self.keep:  # keep mode: full weights stay
                free_storage(group.flat)
        self.buckets = make_buckets(self.records, blocks)
        self.bucket_of = {id(rec): bucket for bucket in self.buckets for rec in bucket.records}
        if not self.fsdp_wrapped and self.world_size > 1:
            self._bind_replicated()
        # Loading a state dict writes the masters; the compute copies must follow.
        self._handles.append(self.model.register_load_state_dict_post_hook(
            lambda module, keys: self.publish_after_step(issue=False)))
        for unit in self.units:
            self._handles.append(unit.module.register_forward_pre_hook(self._make_pre_forward(unit)))
            self._handles.append(unit.module.register_forward_hook(self._make_post_forward(unit)))
        self.bound = True
        logger.debug("dmuon: rank %d bound %d dedicated matrices in %d units", self.rank,
                     len(self.records), len(self.units))

    def _make_units(self, unit_modules: list[nn.Module], parents: dict[int, nn.Module]) -> None:
        """One :class:`Unit` per distinct unit module, in the order their forward pre-hooks
        fire when modules run in registration order (an enclosing unit, such as the FSDP2
        root, before the units inside it)."""
        wanted = {id(m) for m in unit_modules}
        self.unit_of_module = {}
        for module in self.model.modules():
            if id(module) in wanted and id(module) not in self.unit_of_module:
                unit = Unit(index=len(self.units), module=module)
                # FSDP2's setting, read before its groups lose our matrices
                unit.reshard = (self.reshard_after_forward if self.reshard_after_forward is not None
                                else fsdp.reshards_after_forward(fsdp.enclosing_fsdp_module(module, parents),
                                                                 parents))
                self.unit_of_module[id(module)] = unit
                self.units.append(unit)

    def _bind_at_first_forward(self, module: nn.Module, args: Any) -> None:
        """Root pre-hook (removed once bound): bind if ``dmuon.Muon`` has not yet."""
        self.ensure_bound()
        root = self.unit_of_module.get(id(self.model))
        if root is not None:  # its pre-hook was registered during this call: run it now
            self._make_pre_forward(root)(module, args)

    def _make_groups(self, slices, specs, blocks) -> list[tuple[PublishGroup, torch.Tensor]]:
        """One :class:`PublishGroup` per (block, owner, dtype, device); returns each matrix's
        group and its view of the group's flat buffer, in ``self.selected`` order."""
        keyed: dict[tuple, list[int]] = {}
        for i, (sel, (sl, _, dtype, _)) in enumerate(zip(self.selected, slices)):
            key = (blocks[i], specs[sel.fqn].owner, dtype, sl.local.device)
            keyed.setdefault(key, []).append(i)
        views: list[Any] = [None] * len(slices)
        for (_, owner, dtype, device), indices in keyed.items():
            numels = [slices[i][0].local.numel() for i in indices]
            flat = torch.empty(sum(numels), dtype=dtype, device=device)
            group = PublishGroup(owner=owner, is_owner=owner == self.rank, flat=flat)
            self.groups.append(group)
            for i, piece in zip(indices, torch.split(flat, numels)):
                views[i] = (group, piece)
        return views

    def _bind_replicated(self) -> None:
        if self.roles.tp is not None or self.roles.replicate is not None:
            raise ValueError(
                "dmuon: HSDP and tensor-parallel meshes need FSDP2 (fully_shard) on the "
                "data-parallel dimensions; a plain replicated module is supported on a 1-D mesh"
            )
        params = [p for p in self.model.parameters()
                  if id(p) not in self.record_of_master and not hasattr(p, "placements")]
        src = dist.get_global_rank(self.group, 0)
        with torch.no_grad():
            for p in params:  # start every replica from rank 0's values, as DDP does
                dist.broadcast(p.data, src=src, group=self.group)
        trainable = [p for p in params if p.requires_grad]
        if not trainable:
            return
        self.replicated = ReplicatedGrads(trainable, self.group, self.bucket_bytes)
        for p in trainable:
            self._handles.append(p.register_hook(self._make_on_replicated_grad(p)))

    # -------------------------------------------------------------- publication
    def _issue(self, units: list[Unit]) -> None:
        """Publish every group of ``units`` not yet live, as one NCCL group call if possible."""
        by_device: dict[torch.device, list[PublishGroup]] = {}
        for group in dict.fromkeys(g for unit in units for g in unit.groups if not g.live):
            # dict.fromkeys: in keep mode a group (a bucket) may span several units
            by_device.setdefault(group.flat.device, []).append(group)
        for device, groups in by_device.items():
            self._issue_groups(groups, device)

    def _issue_groups(self, groups: list[PublishGroup], device: torch.device) -> None:
        pendings: list[Pending] = []
        with issued_together(self.group, device, pendings):
            for group in groups:
                if not group.is_owner:
                    alloc_storage(group.flat)
                with torch.autograd._unsafe_preserve_version_counter(group.flat):
                    group.work = publish(group.flat, group.owner, self.group,
                                         lambda group=group: [r.fqn for r in group.members])
                pendings.append(group.work)
                group.live = True
                group.bwd_done.clear()

    def _wait(self, unit: Unit) -> None:
        for group in unit.groups:
            if group.work is not None:
                group.work.wait()
                group.work = None

    def _release(self, group: PublishGroup) -> None:
        """Free a non-owner's copy of the group (the owner keeps it: it is the source; in keep
        mode every rank keeps it, and the group only stops being live)."""
        if group.work is not None:
            group.work.wait()
            group.work = None
        if not group.is_owner and not self.keep:
            free_storage(group.flat)
        group.live = False
        group.bwd_done.clear()

    def _make_pre_forward(self, unit: Unit) -> Callable:
        @dynamo_disable
        def pre_forward(module: nn.Module, args: Any) -> None:
            self.ensure_bound()
            self.step_check.before_forward()
            with torch.profiler.record_function("dmuon::pre_forward"):
                if unit.in_backward or in_autograd_backward():
                    # Activation checkpointing recomputes this forward inside backward: the
                    # weights must be whole, and stay so until the unit's post-backward.
                    self._issue([unit])
                else:  # keep mode: every bucket goes out at once, the unit waits for its own
                    self._issue(self.units if self.keep else self.units[unit.index: unit.index + 1 + self.prefetch])
                self._wait(unit)
            unit.show("compute")
        return pre_forward

    def _make_post_forward(self, unit: Unit) -> Callable:
        @dynamo_disable
        def post_forward(module: nn.Module, args: Any, output: Any) -> None:
            if unit.in_backward or in_autograd_backward():
                return  # a recomputation: the unit's post-backward puts the masters back
            unit.show("master")
            needs_grad = [t for t in tree_flatten(output)[0]
                          if isinstance(t, torch.Tensor) and t.requires_grad]
            if (unit.reshard or not needs_grad) and not self.keep:  # keep mode: weights stay
                for group in unit.groups:
                    self._release(group)
            if needs_grad:
                register_multi_grad_hook(needs_grad, self._make_pre_backward(unit), mode="any")
        return post_forward

    def _make_pre_backward(self, unit: Unit) -> Callable:
        @dynamo_disable
        def pre_backward(grad: Any) -> None:
            self._queue_final_callback()  # the step check; ends every unit's backward, even a frozen unit's
            if not self.keep:  # keep mode: the weights never left
                with torch.profiler.record_function("dmuon::pre_backward"):
                    previous = self.units[max(0, unit.index - self.prefetch): unit.index][::-1]
                    self._issue([unit] + [prev for prev in previous
                                          if prev.takes_grad and not prev.backward_finished])
                    self._wait(unit)
            # Like FSDP2's pre-backward unshard: a recomputed forward reads the module's weights.
            unit.in_backward = True
            unit.show("compute")
        return pre_backward

    # ------------------------------------------------------------ reduce-to-owner
    def _queue_final_callback(self) -> None:
        """First gradient hook of a backward: decide sync once, and wait at the end."""
        if not self._final_callback_queued:
            self.step_check.before_backward()
            self._final_callback_queued = True
            self._sync_this_backward = self.sync_enabled and (
                not self.fsdp_wrapped or fsdp.gradient_sync_enabled(self._fsdp_states))
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)

    def _make_on_grad(self, rec: DedicatedParam) -> Callable:
        def on_grad(param: torch.Tensor) -> None:
            self._queue_final_callback()
            if not self._sync_this_backward:
                # Gradient accumulation: keep the local sum in compute.grad (full size on every
                # rank, like FSDP2's unsharded grads under no_sync); reduce it on the sync pass.
                self._backward_done(rec)
                return
            grad = param.grad
            param.grad = None
            if hasattr(grad, "to_local"):  # the TP slice's gradient
                grad = grad.to_local()
            bucket = self.bucket_of[id(rec)]
            if bucket.add(rec, grad):
                bucket.issue(self.group, self.reduce_mode)
            self._backward_done(rec)
        return on_grad

    def _backward_done(self, rec: DedicatedParam) -> None:
        """Free the group once every member that takes a gradient has its gradient, and end
        the unit's backward (masters back on the modules) once all of its records have."""
        group = self.group_of[id(rec)]
        group.bwd_done.add(id(rec))
        if group.bwd_done >= group.grad_members and not self.keep:  # keep mode: weights stay
            self._release(group)
        unit = self.unit_of_record[id(rec)]
        unit.grads_done.add(id(rec))
        if unit.grads_complete():
            self._post_backward(unit)
            unit.backward_finished = True

    @staticmethod
    def _post_backward(unit: Unit) -> None:
        unit.show("master")
        unit.in_backward = False
        unit.grads_done.clear()

    def _make_on_replicated_grad(self, param: nn.Parameter) -> Callable:
        def on_grad(grad: torch.Tensor) -> torch.Tensor:
            self._queue_final_callback()
            return self.replicated.on_grad(param, grad, sync=self._sync_this_backward)
        return on_grad

    def finish_backward(self) -> None:
        """End of backward: wait for every reduce; owners add the average to ``master.grad``.

        Under HSDP the owners then combine across replicas (:mod:`dmuon.hooks.replicas`): one
        all-reduce of all "compute" averages (each replica's owner runs Newton-Schulz) and one
        reduce to replica 0 of all "broadcast" averages (it runs NS and broadcasts), per dtype.
        """
        self._final_callback_queued = False
        for unit in self.units:  # units with unused matrices, or cut short by checkpointing
            self._post_backward(unit)
            unit.backward_finished = False
        replicas = self.roles.replicate_size
        with torch.profiler.record_function("dmuon::finish_backward"), torch.no_grad():
            combine = self._combine_replicas() if replicas > 1 else None
            for bucket in self.buckets:
                if bucket.flat is None:
                    continue
                if not bucket.issued:  # a member took no gradient in this backward
                    bucket.issue(self.group, self.reduce_mode)
                for rec, avg in bucket.take(self.world_size):
                    if avg is not None:
                        if combine is not None:
                            combine.add(rec, avg)
                        else:
                            self._accumulate(rec, avg)
                    rec.had_grad = True
            if combine is not None:
                combine.issue()
                for rec, summed in combine.wait():
                    self._accumulate(rec, summed.div_(replicas))
            if self.replicated is not None and self._sync_this_backward:
                self.replicated.finish()

    def _combine_replicas(self) -> ReplicaCombine:
        """This backward's cross-replica combination (records are queued in bucket order)."""
        return ReplicaCombine(group=self.roles.replicate, replicate_rank=self.replicate_rank)

    @staticmethod
    def _accumulate(rec: DedicatedParam, avg: torch.Tensor) -> None:
        master = rec.master
        master.grad = avg if master.grad is None else master.grad.add_(avg)

    # --------------------------------------------------------------- after step
    def publish_after_step(self, issue: bool = True) -> None:
        """Phase 4: owners refresh their compute copy; the first units' broadcasts go out.

        Args:
            issue: issue the first ``prefetch`` units' broadcasts now (after a step); ``False``
                only invalidates (after loading a state dict).
        """
        with torch.profiler.record_function("dmuon::publish_after_step"), torch.no_grad():
            if issue and self.roles.replicate is not None:
                self._broadcast_from_replica0()
            for rec in self.records:
                rec.had_grad = False
            for group in self.groups:
                if group.is_owner:
                    if group.work is not None:
                        group.work.wait()
                        group.work = None
                    with torch.autograd._unsafe_preserve_version_counter(group.flat):
                        for rec in group.members:
                            rec.buffer.detach().copy_(rec.master)
                    group.live = False
                else:
                    self._release(group)
            if issue:  # keep mode: every bucket, overlapping the next forward
                self._issue(self.units if self.keep else self.units[: self.prefetch])

    def _broadcast_from_replica0(self) -> None:
        """HSDP "broadcast" matrices: replica 0's owner stepped; the other replicas copy.

        One flat broadcast per dtype of the owned masters that had a gradient (the same list
        on every replica: the plan and the set of matrices with a gradient are the same).
        """
        masters = [rec.master.data for rec in self.records
                   if rec.is_owner and rec.replicate_mode == "broadcast" and rec.had_grad]
        broadcast_masters(masters, self.roles.replicate, self.replicate_rank)

    def remove(self) -> None:
        """Remove every hook dmuon installed (the model keeps its current parameters)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
