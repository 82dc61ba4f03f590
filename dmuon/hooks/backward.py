"""Phase 2 of a dmuon step, reduce-to-owner: each dedicated gradient's hook and the end of each
backward, as FSDP2's root ``_root_post_backward_final_callback`` ends its own. The collectives
are :mod:`dmuon.comm.grad_buckets`' and :mod:`dmuon.comm.hsdp_replicas`'.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dmuon.comm.collectives import label
from dmuon.comm.grad_buckets import owned_averages, reduced
from dmuon.comm.hsdp_replicas import reduce_to_owners
from dmuon.comm.owned_grad import present, unpresent
from dmuon.hooks import fsdp_adapter as fsdp


class ReduceToOwners:
    """The reduce-to-owner phase of one model's runtime.

    Attributes:
        sync_enabled: ``False`` inside :func:`dmuon.no_sync`.
        sync_this_backward: this backward reduces to the owners (decided at its first hook).
        speculator: ``Muon(overlap="backward")``'s :class:`dmuon.optim.OwnerUpdate`.
    """

    def __init__(self, state: Any) -> None:
        self.state = state
        self.sync_enabled = True
        self.sync_this_backward = True
        self._final_callback_queued = False
        self.made_up_grads: dict = {}
        self.speculator: Any = None
        self._handed: set = set()  # buckets handed to the speculator in this backward

    def queue_final_callback(self) -> None:
        """First gradient hook of a backward: decide sync once, and wait at the end."""
        if not self._final_callback_queued:
            self.state.step_check.before_backward()
            self.state.publisher.flush()  # publications held back go out before any reduce-to-owner
            self._final_callback_queued = True
            self.sync_this_backward = self.sync_enabled and fsdp.gradient_sync_enabled(self.state.fsdp_states)
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)

    def on_grad(self, rec: Any, unit: Any, group: Any, bucket: Any, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook of ``rec.compute``: its gradient goes into its bucket, whose
        reduce-to-owner starts once full."""
        s = self.state
        self.queue_final_callback()
        with label("dmuon::grad_hook"):
            if self.sync_this_backward:
                grad = param.grad
                param.grad = None
                if hasattr(grad, "to_local"):  # the TP slice's gradient
                    grad = grad.to_local()
                if bucket.add(rec, grad):
                    s.step_check.settle()  # the ranks agree before the first reduce goes out
                    s.issue_order.full(s.group, s.reduce_mode)  # in the one order of all ranks
                    self.poll_reduced()
            # else gradient accumulation: keep the local sum in compute.grad (full size on every
            # rank, like FSDP2's unsharded grads under no_sync); reduce it on the sync pass.
            group.grad_in(rec)
            unit.grad_in(rec)

    def poll_reduced(self) -> None:
        """``Muon(overlap="backward")``: hand each bucket whose reduce has completed to
        :attr:`speculator` with this rank's averages, once per backward (not under HSDP, whose
        replica combine comes at the end)."""
        s = self.state
        if self.speculator is None or s.roles.replicate_size > 1:
            return
        order = s.issue_order
        for bucket in order.buckets[: order.next]:
            if bucket.my_owner is None or bucket in self._handed or not reduced(bucket):
                continue
            self._handed.add(bucket)
            # the divisor _reduce_and_present will use, read now
            factor = (fsdp.gradient_divide_factor(bucket.block) if bucket.block is not None
                      else bucket.divide_factor)
            averages = owned_averages(bucket, s.world_size if factor is None else factor)
            self.speculator.speculate_early(averages)

    def on_replicated_grad(self, param: nn.Parameter, grad: torch.Tensor) -> torch.Tensor:
        self.queue_final_callback()
        return self.state.replicated.on_grad(param, grad, sync=self.sync_this_backward)

    def reduce_outside_backward(self) -> None:
        """FSDP2's final callback ran outside a backward (pipelining's ``perform_reduce_grad``):
        reduce every gradient accumulated since the last reduce, as FSDP2 does. Collective.
        """
        if (not self.state.bound or self._final_callback_queued or not self.sync_enabled
                or not fsdp.gradient_sync_enabled(self.state.fsdp_states)):
            return
        held = False
        for bucket in self.state.buckets:
            if any(rec.compute.grad is not None for rec in bucket.records):
                bucket.active = held = True  # GradBucket.issue takes each compute.grad
        if not held:
            return
        with label("dmuon::reduce_outside_backward"), torch.no_grad():
            self.sync_this_backward = True
            self.state.issue_order.next = 0
            self.state.step_check.settle()
            self._reduce_and_present()

    def check_reduced(self) -> None:
        """Before a step: ``RuntimeError`` if a matrix holds a gradient that never reached its
        owner (a backward with gradient sync off; the step would skip it)."""
        unreduced = [rec.fqn for rec in self.state.records if rec.compute.grad is not None]
        if unreduced:
            raise RuntimeError(
                f"dmuon: opt.step() would skip {len(unreduced)} dedicated matrices "
                f"({unreduced[:4]}{'...' if len(unreduced) > 4 else ''}, rank {dist.get_rank()}): their "
                f"gradients were computed with gradient sync off (dmuon.no_sync or FSDP2's "
                f"set_requires_gradient_sync(False)) and never reduced to their owners. Turn sync "
                f"back on for the last backward of the step (or let FSDP2's post_backward / final "
                f"callback run with sync on, as torch.distributed.pipelining does) before opt.step().")

    def finish_backward(self) -> None:
        """End of backward: close open units, then reduce-to-owner and, under HSDP, the replica
        combine (:func:`dmuon.comm.hsdp_replicas.reduce_to_owners`); the other parameters'
        DDP-style all-reduce finishes last."""
        s = self.state
        self._final_callback_queued = False
        s.issue_order.next = 0  # the rest go out below, in the same order
        s.step_check.settle()  # before waiting on (or issuing) any reduce of this backward
        for unit in s.units:  # units with unused matrices, or cut short by checkpointing
            unit.post_backward()
            unit.backward_finished = False
        with label("dmuon::finish_backward"), torch.no_grad():
            if s.shared_bucket is not None and self.sync_this_backward:
                s.shared_bucket.issue(s.group, s.reduce_mode)  # the other parameters' .grad
            self._reduce_and_present()
            if s.replicated is not None and self.sync_this_backward:
                s.replicated.finish()

    def _reduce_and_present(self) -> None:
        """Reduce every bucket to its owners (divided by its FSDP2 divide factor, else the mean),
        combine HSDP replicas, present the gradients (:mod:`dmuon.comm.owned_grad`), then call
        the :attr:`speculator`."""
        s = self.state
        for bucket in s.buckets:  # FSDP2's set_gradient_divide_factor, read now
            if bucket.block is not None:
                bucket.divide_factor = fsdp.gradient_divide_factor(bucket.block)
        unpresent(s.records)  # plain gradients for the owners to add to
        reduce_to_owners(s.issue_order, s.roles, s.reduce_mode, s.world_size, s.replicate_rank)
        present(s.records, group=s.roles.world, replicate_rank=s.replicate_rank, tp_rank=s.tp_rank,
                made_up=self.made_up_grads)
        if self.speculator is not None and self.sync_this_backward:
            self.speculator.speculate()
        self._handed.clear()
