"""One :class:`DedicateState` per model, as FSDP2 has one ``FSDPState`` per module: it holds
what the phases share and registers every hook; :func:`dmuon.hooks.bind.bind` fills it. The
phases: publish (:class:`dmuon.hooks.unit.Publisher`), reduce-to-owner
(:class:`dmuon.hooks.backward.ReduceToOwners`), update (:class:`dmuon.optim.OwnerUpdate`),
overlap (:class:`dmuon.owners.overlap.PendingSteps`). What each rank holds follows from one
rank-independent flag per publish group, ``live``, so every rank issues the same collectives.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook

from dmuon.hooks import fsdp_adapter as fsdp
from dmuon.hooks.bind import Selected, bind, check_materialized
from dmuon.hooks.backward import ReduceToOwners
from dmuon.hooks.compile import dynamo_disable
from dmuon.hooks.step_check import StepCheck
from dmuon.comm.collectives import label
from dmuon.comm.grad_buckets import GradBucket, IssueOrder
from dmuon.comm.mesh_roles import MeshRoles
from dmuon.comm.hsdp_replicas import broadcast_masters
from dmuon.comm.ddp_allreduce import ReplicatedGrads
from dmuon.hooks.unit import Publisher, PublishGroup, Unit
from dmuon.owners.dedicated import DedicatedParam
from dmuon.owners.overlap import PendingSteps
from dmuon.owners.plan import OwnerPlan

logger = logging.getLogger(__name__)


class DedicateState:
    """Everything dmuon keeps for one model on one rank; registers every hook. The options
    are :func:`dmuon.dedicate_params`'s (``bucket_bytes``: ``bucket_cap_mb`` in bytes)."""

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
        self.plan = plan
        self.selected = selected
        self.prefetch = prefetch
        self.reshard_after_forward = reshard_after_forward
        self.bucket_bytes = bucket_bytes
        self.reduce_mode = reduce_mode
        self.replicas = replicas
        # filled in by binding (dmuon.hooks.bind.bind)
        self.bound = False
        self.records: list[DedicatedParam] = []
        self.units: list[Unit] = []
        self.groups: list[PublishGroup] = []
        self.buckets: list[GradBucket] = []
        self.issue_order = IssueOrder([])  # every rank's order of issuing the buckets
        self.replicated: ReplicatedGrads | None = None
        self.shared_bucket: GradBucket | None = None  # keep mode: carries the other parameters
        self.keep = False  # replicas="keep": every rank keeps the full weights
        self.fsdp_states: list[Any] = []
        # torch.optim hands back parameters (the masters): the one lookup by object we keep
        self.record_of_master: dict[nn.Parameter, DedicatedParam] = {}
        self._sharding_checked = False  # check_not_sharded_since_binding ran
        self.pending = PendingSteps()  # Muon(overlap=...)'s scheduled owner updates
        self.step_check = StepCheck(roles.steps if step_check else None, self.pending)
        self.publisher = Publisher(self)  # phases 1 and 4
        self.backward = ReduceToOwners(self)  # phase 2
        # what this rank switched off for want of live peers (the fake backend)
        self.offline: tuple[str, ...] = ()
        self.handles: list[Any] = []  # every hook dmuon installed (remove() takes them out)
        # binding at the first forward (unless dmuon.Muon binds first), then the step check in
        # front of it: both in front of FSDP2's root hook
        self._bind_handle = model.register_forward_pre_hook(
            dynamo_disable(self._bind_at_first_forward), prepend=True)
        self.handles += self.step_check.install(model)

    @property
    def fsdp_wrapped(self) -> bool:
        """The model was FSDP2-wrapped when bound."""
        return bool(self.fsdp_states)

    def _register_hooks(self, wiring: list[tuple]) -> None:
        """The hooks of the bound runtime: units, gradients (``wiring``, from ``bind``), loads."""
        for rec, *where in wiring:  # where each gradient goes
            self.handles.append(rec.compute.register_post_accumulate_grad_hook(
                functools.partial(self.backward.on_grad, rec, *where)))
        if self.replicated is not None:
            for p in self.replicated.params:
                self.handles.append(p.register_hook(functools.partial(self.backward.on_replicated_grad, p)))
        if self.shared_bucket is not None:  # the backward ends in finish_backward, which takes them
            for p in self.shared_bucket.shared:
                self.handles.append(p.register_post_accumulate_grad_hook(
                    lambda p: self.backward.queue_final_callback()))
        # Nothing reads or writes a master with an overlapped update pending (dmuon.owners.overlap)
        self.handles.append(self.model.register_state_dict_pre_hook(
            lambda *args, **kwargs: self.settle_pending()))
        self.handles.append(self.model.register_load_state_dict_pre_hook(
            lambda *args, **kwargs: self.settle_pending()))
        # Loading a state dict writes the masters; the compute copies must follow.
        self.handles.append(self.model.register_load_state_dict_post_hook(
            lambda module, keys: self.publish_after_step(issue=False)))
        for unit in self.units:
            unit.pre_backward_hook = dynamo_disable(unit.pre_backward)
            self.handles.append(unit.module.register_forward_pre_hook(dynamo_disable(unit.pre_forward)))
            self.handles.append(unit.module.register_forward_hook(dynamo_disable(unit.post_forward)))

    def remove(self) -> None:
        """Remove every hook dmuon installed (the model keeps its current parameters)."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def ensure_bound(self) -> None:
        """Bind (collective; idempotent) at optimizer construction or the first forward."""
        if self.bound:
            return
        check_materialized(self.selected)
        self._bind_handle.remove()
        wiring = bind(self)
        self.step_check.deferred = not self.fsdp_wrapped  # the modes of dmuon.hooks.step_check
        self.step_check.issue_at_step = self.fsdp_wrapped
        self.bound = True
        self._register_hooks(wiring)
        if not self.fsdp_wrapped:
            # a later fully_shard (accelerator.prepare) is refused by name at the first forward,
            # by a global forward pre-hook: it runs before FSDP2's root pre-forward, whose
            # all-gather of masters and placeholders would fail in the backend
            def first_forward(module: nn.Module, args: Any) -> None:
                if module is self.model:
                    handle.remove()
                    self.check_not_sharded_since_binding("the model's first forward")

            handle = register_module_forward_pre_hook(dynamo_disable(first_forward))
            self.handles.append(handle)
        else:
            if self.step_check.group is not None:
                # the check settles before FSDP2's root all-gather even when dedicate_params ran
                # before fully_shard, and a rank the others left fails by name in that all-gather
                self.handles += self.step_check.to_front(self.model)
                self.handles += fsdp.wrap_pre_forward(self.fsdp_states,
                                                      self.step_check.guard_fsdp_pre_forward)
            # FSDP2 reduces outside any backward too (pipelining schedules call its final
            # callback themselves): follow it there
            self.handles += fsdp.wrap_final_callback(self.fsdp_states, self.backward.reduce_outside_backward)
        logger.debug("dmuon: rank %d bound %d dedicated matrices in %d units", self.rank,
                     len(self.records), len(self.units))

    def check_not_sharded_since_binding(self, where: str) -> None:
        """``RuntimeError`` if the model, bound without FSDP2, is FSDP2-wrapped now (checked
        once)."""
        if self.fsdp_wrapped or self._sharding_checked:
            return
        self._sharding_checked = True
        if fsdp.fsdp_states(self.model):
            raise RuntimeError(
                f"dmuon: rank {dist.get_rank()}: the model was wrapped by FSDP2's fully_shard (for "
                f"instance by accelerator.prepare) after dmuon bound its {len(self.records)} "
                f"dedicated matrices to the plain module (at dmuon.Muon(model) or the first "
                f"forward); FSDP2 would now shard dmuon's masters and placeholders (found at "
                f"{where}). Call fully_shard (accelerator.prepare(model)) first, then "
                f"dmuon.dedicate_params(model, mesh) and dmuon.Muon(model, ...); with Accelerate, "
                f"prepare the model alone, build the optimizer, then prepare the optimizer.")

    def _bind_at_first_forward(self, module: nn.Module, args: Any) -> None:
        """Root pre-hook (removed once bound): bind if ``dmuon.Muon`` has not yet."""
        self.ensure_bound()
        root = next((unit for unit in self.units if unit.module is self.model), None)
        if root is not None:  # its pre-hook was registered during this call: run it now
            root.pre_forward(module, args)

    def settle_pending(self) -> None:
        """Finish every overlapped update and publish what was held back (before a reader)."""
        self.pending.wait_all()
        self.publisher.flush()

    def publish_after_step(self, issue: bool = True) -> None:
        """Phase 4: owners refresh their compute copy; with ``issue`` (after a step, not a load),
        the first ``prefetch`` units' broadcasts go out."""
        if issue:
            self.step_check.settle()
        with label("dmuon::publish_after_step"), torch.no_grad():
            if issue and self.roles.replicate is not None:  # HSDP "broadcast": replica 0 stepped
                # the same list on every replica: the plan and the matrices with a gradient agree
                masters = [rec.master.data for rec in self.records if rec.is_owner and
                           rec.replicate_mode == "broadcast" and rec.had_grad]
                if masters:  # the stepped masters, overlapped or not
                    self.settle_pending()
                broadcast_masters(masters, self.roles.replicate, self.replicate_rank)
            if not issue:  # a load writes the masters: nothing may be pending
                self.settle_pending()
            for rec in self.records:
                rec.had_grad = False
            for group in self.groups:  # a group with a job pending refreshes itself there
                group.refresh(copy=not self.pending.pending(group))
            if issue:  # keep mode: every bucket, overlapping the next forward
                self.publisher.issue(self.units if self.keep else self.units[: self.prefetch])
