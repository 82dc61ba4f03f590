"""Phase 1, publish: dmuon's ``FSDPParamGroup``.

A :class:`Unit` is what is published before one module runs
(:func:`dmuon.hooks.fsdp_adapter.publish_block`); its matrices travel in :class:`PublishGroup`
buffers, one broadcast per owner and compute dtype; the :class:`Publisher` issues them in the
one order every rank shares. Like ``FSDPParamGroup``, a unit keeps its full weights from its
pre-backward until its last gradient is in, and its forward hooks do nothing while autograd
runs (activation checkpointing re-runs forwards inside backward).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten

from dmuon.comm import collectives as comm
from dmuon.comm.collectives import Pending, is_complete, issued_together, label
from dmuon.comm.mesh_roles import is_fake_backend
from dmuon.hooks.step_check import in_autograd_backward
from dmuon.owners.dedicated import DedicatedParam, alloc_storage, free_storage

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class PublishGroup:
    """Dedicated matrices of one unit with the same owner, published by one broadcast.

    Attributes:
        owner: the broadcasting rank (in ``pg``, else the dmuon group).
        flat: ``[sum of numels]`` compute-dtype buffer; the members' compute weights are views
            of it; freed on non-owners while not live (never in keep mode).
        keep: ``replicas="keep"``: every rank keeps ``flat``.
        grad_count: members that take a gradient; freed once ``bwd_done`` holds that many.
        live: the current weights are published or being published (rank-independent).
        pg: the broadcast's process group when not the units' (expert parallelism).
    """

    owner: int
    is_owner: bool
    flat: torch.Tensor
    keep: bool = False
    members: list[DedicatedParam] = field(default_factory=list)
    grad_count: int = 0
    live: bool = False
    work: Pending | None = None
    bwd_done: set[DedicatedParam] = field(default_factory=set)
    pg: dist.ProcessGroup | None = None

    def issue(self, group: dist.ProcessGroup) -> Pending:
        """Allocate a non-owner's buffer and start the owner's broadcast into it."""
        if not self.is_owner:
            alloc_storage(self.flat)
        with torch.autograd._unsafe_preserve_version_counter(self.flat):
            self.work = comm.publish(self.flat, self.owner, group, lambda: [r.fqn for r in self.members])
        self.live = True
        self.bwd_done.clear()
        return self.work

    def in_flight(self) -> bool:
        """Whether this group's broadcast is issued and not known to be complete."""
        return self.work is not None and not is_complete(self.work.work)

    def wait(self) -> None:
        """Wait for this group's broadcast, if in flight (on NCCL: the current stream waits)."""
        if self.work is not None:
            self.work.wait()
            self.work = None

    def release(self) -> None:
        """Free a non-owner's copy of the group (not in keep mode); the group is not live."""
        self.wait()
        if not self.is_owner and not self.keep:
            # no host sync: the current stream waited on the broadcast and NCCL recorded its
            # stream on the tensor (FSDP2 frees its all-gather outputs the same way)
            free_storage(self.flat)
        self.live = False
        self.bwd_done.clear()

    def grad_in(self, rec: DedicatedParam) -> None:
        """``rec``'s gradient is in: release once every member that takes one has it."""
        if self.keep:
            return
        self.bwd_done.add(rec)
        if len(self.bwd_done) >= self.grad_count:  # O(1): bwd_done only holds members
            self.release()

    def refresh(self, copy: bool = True) -> None:
        """After a step: the owner copies its masters into its compute copy (``copy=False``: an
        overlapped job does it); the others free theirs. The group is no longer live."""
        if not self.is_owner:
            self.release()
            return
        self.wait()
        if copy:
            self.copy_masters()
        self.live = False

    def copy_masters(self) -> None:
        """The owner's compute copy from its masters: one op for the group, cast to its dtype."""
        with torch.autograd._unsafe_preserve_version_counter(self.flat), torch.no_grad():
            torch._foreach_copy_([rec.buffer for rec in self.members], [rec.master for rec in self.members])


def issue_groups(groups: list[PublishGroup], group: dist.ProcessGroup) -> None:
    """Publish ``groups`` (each once, in order), one NCCL group call per (device, process
    group); a group with its own ``pg`` goes out on it."""
    by_device: dict[tuple, list[PublishGroup]] = {}
    for pub in dict.fromkeys(groups):  # in keep mode a group (a bucket) may span several units
        by_device.setdefault((pub.flat.device, pub.pg or group), []).append(pub)
    for (device, pg), pubs in by_device.items():
        pendings: list[Pending] = []
        with issued_together(pg, device, pendings):
            for pub in pubs:
                pendings.append(pub.issue(pg))


class Publisher:
    """The publish phase of one model: issues the units' publications in the one order every
    rank shares.

    Attributes:
        deferred: publish groups this rank held back at its last :meth:`issue`.
        seen: the units in the order the first forward ran them (``None`` once
            :meth:`adopt_forward_order` has run).
    """

    def __init__(self, state: Any) -> None:
        self.state = state
        self.deferred: list[PublishGroup] = []
        self.seen: list[Unit] | None = []

    def issue(self, units: list[Unit], need: Unit | None = None) -> None:
        """Publish the groups of ``units`` not yet live, in order. With overlapped updates
        pending, a group goes out after its own update: those up to ``need``'s wait; a later
        group whose update is not done is held back with those after it (:attr:`deferred`), so
        a forward never waits on a later unit's Newton-Schulz.

        Args:
            units: the units to publish, in forward (or backward prefetch) order.
            need: the unit that runs next (its groups go out now); ``None``: all prefetch.
        """
        groups = [g for unit in units for g in unit.groups if not g.live]
        if self.deferred:  # what this rank held back last time goes first: one order on all ranks
            groups = [g for g in self.deferred if not g.live] + [g for g in groups if g not in self.deferred]
            self.deferred = []
        pending, pg = self.state.pending, self.state.group
        if not pending.jobs:
            issue_groups(groups, pg)
            return
        last = max((i for i, g in enumerate(groups) if need is not None and g in need.groups), default=-1)
        ready = groups
        for i, g in enumerate(groups):
            # never hold back a group with a process group of its own (expert parallelism: the
            # model's own collectives may run on it before this rank's next issue)
            if i > last and not pending.done(g) and all(h.pg is None for h in groups[i:]):
                ready, self.deferred = groups[:i], groups[i:]
                break
        stream = pending.stream_for(ready)
        if stream is None:
            pending.wait_for(ready)
            issue_groups(ready, pg)
            return
        for g in ready:  # a non-owner's buffer is allocated on the compute stream, which frees it
            if not g.is_owner:
                alloc_storage(g.flat)
        stream.wait_stream(torch.cuda.current_stream(stream.device))
        with torch.cuda.stream(stream):
            batch: list[PublishGroup] = []  # groups without a job: one group call
            for g in ready:
                if not pending.pending(g):
                    batch.append(g)
                    continue
                issue_groups(batch, pg)
                batch = []
                pending.wait_for([g])  # this stream waits for g's job event alone
                issue_groups([g], pg)
            issue_groups(batch, pg)

    def adopt_forward_order(self) -> None:
        """Once, at the first step: reorder the units as the first forward ran them (those it
        did not run last), as FSDP2's prefetch follows execution order. Collective: adopted only
        if every rank saw the same order."""
        if self.seen is None:
            return
        self.flush()  # nothing held back may cross the all_gather below
        seen, self.seen = self.seen, None
        units, pg = self.state.units, self.state.group
        if not seen or self.state.keep:
            return
        order = seen + [u for u in units if u not in set(seen)]
        if order == units:
            return
        digest = tuple(u.index for u in order)
        if dist.is_initialized() and dist.get_world_size(pg) > 1 and \
                not is_fake_backend(dist.get_backend(pg)):
            everyone: list[Any] = [None] * dist.get_world_size(pg)
            dist.all_gather_object(everyone, digest, group=pg)
            if any(d != digest for d in everyone):
                logger.info("dmuon: the ranks ran their units in different orders in the first "
                            "forward; prefetch keeps registration order")
                return
        units[:] = order
        for index, unit in enumerate(units):
            unit.index = index

    def flush(self) -> None:
        """Publish what :meth:`issue` held back, before any other collective on its group."""
        if not self.deferred:
            return
        groups = [g for g in self.deferred if not g.live]
        self.deferred = []
        self.state.pending.wait_for(groups)
        issue_groups(groups, self.state.group)


@dataclass(eq=False)
class Unit:
    """The dedicated matrices published together before one module runs, and their hooks.

    Attributes:
        index: position in forward order (the prefetch order).
        module: the module whose hooks publish it (:func:`dmuon.hooks.fsdp_adapter.publish_block`).
        reshard: free non-owners' copies after forward (FSDP2's rule, set at bind).
        in_backward: between its pre-backward and post-backward (a recomputation's forward
            hooks then leave the full weights alone).
        grads_done: records whose gradient is in; the backward is over at ``grad_count``.
        backward_finished: every gradient is in during this backward; backward prefetch skips it.
    """

    state: Any
    index: int
    module: nn.Module
    reshard: bool = True
    records: list[DedicatedParam] = field(default_factory=list)
    groups: list[PublishGroup] = field(default_factory=list)
    in_backward: bool = False
    grads_done: set[DedicatedParam] = field(default_factory=set)
    grad_count: int = 0
    backward_finished: bool = False
    pre_backward_hook: Any = None  # the dynamo-disabled pre_backward, made at bind

    def add(self, rec: DedicatedParam, group: PublishGroup) -> None:
        """Bind one dedicated matrix and its publish group to this unit."""
        self.records.append(rec)
        if group not in self.groups:
            self.groups.append(group)
        if rec.compute.requires_grad:
            self.grad_count += 1

    def show(self, which: str) -> None:
        """Register every record's ``"compute"`` weight (or ``"master"``) on its module."""
        for rec in self.records:
            rec.show(which)

    def wait(self) -> None:
        """Wait for every publication of this unit."""
        for group in self.groups:
            group.wait()

    def pre_forward(self, module: nn.Module, args: Any) -> None:
        """Forward pre-hook: publish this unit (and prefetch the next), wait, show compute."""
        state = self.state
        state.ensure_bound()
        state.step_check.before_forward()
        seen = state.publisher.seen
        if seen is not None and not (self.in_backward or in_autograd_backward()) and self not in seen:
            seen.append(self)  # the first forward's order (adopt_forward_order)
        with label("dmuon::pre_forward"):
            if state.keep:  # every bucket at once (here: the first forward, or after a load)
                to_issue = [] if all(g.live for g in state.groups) else state.units
            elif self.in_backward or in_autograd_backward():
                to_issue = [self]  # a recomputation: whole until the unit's post-backward
            else:
                to_issue = state.units[self.index: self.index + 1 + state.prefetch]
            if any(not g.live for unit in to_issue for g in unit.groups) or any(
                    g.in_flight() for g in self.groups):
                state.step_check.settle()  # a deferred check, before issuing or blocking
            if to_issue:
                state.publisher.issue(to_issue, need=self)
            self.wait()
        self.show("compute")

    def post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        """Forward hook: masters back; free (reshard) unless kept; arm the pre-backward."""
        if self.in_backward or in_autograd_backward():
            return  # a recomputation: the unit's post-backward puts the masters back
        self.show("master")
        if self.state.keep:  # the weights stay: no release, no pre-backward
            return
        needs_grad = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if self.reshard or not needs_grad:
            for group in self.groups:
                group.release()
        if needs_grad:
            register_multi_grad_hook(needs_grad, self.pre_backward_hook, mode="any")

    def pre_backward(self, grad: Any) -> None:
        """First gradient of the unit's output: publish it again (and prefetch the previous
        units), wait, and show the compute weights until its post-backward."""
        state = self.state
        state.backward.queue_final_callback()  # the step check; ends every unit's backward
        if not state.keep:  # keep mode: the weights never left
            with label("dmuon::pre_backward"):
                state.step_check.settle()
                previous = state.units[max(0, self.index - state.prefetch): self.index][::-1]
                previous = [prev for prev in previous if prev.grad_count and not prev.backward_finished]
                state.publisher.issue([self] + previous, need=self)
                self.wait()
        # Like FSDP2's pre-backward unshard: a recomputed forward reads the module's weights.
        self.in_backward = True
        self.show("compute")

    def grad_in(self, rec: DedicatedParam) -> None:
        """``rec``'s gradient is in: the unit's backward is over once every gradient is."""
        self.grads_done.add(rec)
        if len(self.grads_done) >= self.grad_count:
            self.post_backward()
            self.backward_finished = True

    def post_backward(self) -> None:
        """Masters back on the modules; the unit's backward is over."""
        self.show("master")
        self.in_backward = False
        self.grads_done.clear()
