"""``replicas="keep"``: the DDP-style path, full weights on every rank, collectives in buckets.

On a plain replicated module (no FSDP2) the user chose replication, so memory is not the
constraint: every rank keeps every dedicated matrix whole in its compute dtype and nothing is
published in forward or backward. One step is then DDP's all-reduce cut in its two halves:

* **reduce-to-owner** (backward): the matrices' gradients go to their owners in size-capped
  buckets cut in backward order (:func:`dmuon.owners.plan.build_bucket_plan`; one owner per
  bucket, so one ``reduce`` per bucket), each issued as soon as its last gradient is in, so
  they overlap the rest of backward (:class:`dmuon.hooks.grad_buckets.GradBucket`, issued by
  :class:`dmuon.hooks.runtime.DedicateState`);
* **update**: owners run momentum + Newton-Schulz on what they own (:class:`dmuon.Muon`);
* **publish** (after ``step()``): each bucket's updated matrices are broadcast from their owner
  as one flat tensor, all issued at once in forward order; a module's forward pre-hook waits only
  for the bucket(s) holding its own matrices, so the broadcasts overlap the next forward.

Bytes per rank and step: reduce + broadcast of every matrix, the bytes of one all-reduce
(Li et al., "PyTorch Distributed", VLDB 2020 for DDP's bucketed all-reduce), with
Newton-Schulz run once per matrix. Against ``replicas="placeholder"`` (non-owners hold zero-size
placeholders; each matrix is broadcast before forward and again before backward): ``"keep"``
costs one full copy of every matrix per rank and saves one or two broadcasts per matrix and
step, issued one per unit instead of one per bucket.

The non-dedicated parameters keep dmuon's DDP-style bucketed all-reduce
(:class:`dmuon.hooks.replicated.ReplicatedGrads`): AdamW runs on every rank, as under DDP.

Kept out of :mod:`dmuon.hooks.runtime`: the runtime calls this module at binding, in a unit's
forward pre-hook and after the step; elsewhere it only skips freeing and re-publishing (a
unit's forward and backward bookkeeping, activation checkpointing included, is the runtime's).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dmuon.hooks.comm import issued_together, publish

if TYPE_CHECKING:  # the runtime imports this module
    from dmuon.hooks.runtime import DedicateState, PublishGroup, Unit

REPLICAS = ("keep", "placeholder")


def resolve_replicas(replicas: str | None, *, fsdp_wrapped: bool, plain_1d: bool) -> str | None:
    """``"keep"``, ``"placeholder"`` or ``None`` (the FSDP2 / HSDP / TP paths) for one model.

    Args:
        replicas: the user's ``dedicate_params(replicas=...)``; ``None`` means the default
            (``"keep"`` on a plain replicated module).
        fsdp_wrapped: whether the model carries FSDP2 state.
        plain_1d: whether the mesh is 1-D data parallel (no TP, no replicate dimension).

    Raises:
        ValueError: an unknown value, or ``replicas`` given for a model that is not a plain
            replicated module on a 1-D mesh.
    """
    if replicas is not None and replicas not in REPLICAS:
        raise ValueError(f"dmuon: replicas must be 'keep' or 'placeholder' (or None for the default), "
                         f"got {replicas!r}")
    if fsdp_wrapped or not plain_1d:
        if replicas is not None:
            where = "an FSDP2 (fully_shard) model" if fsdp_wrapped else "an HSDP or tensor-parallel mesh"
            raise ValueError(
                f"dmuon: replicas={replicas!r} applies to a plain replicated module on a 1-D mesh, "
                f"but dedicate_params got {where}; there FSDP2 decides what each rank holds. Drop "
                f"replicas=..., or call dedicate_params on the module without fully_shard."
            )
        return None
    return replicas or "keep"


class KeepReplicas:
    """The keep-mode side of one :class:`DedicateState` (see the module docstring).

    Every rank holds every publish group's flat buffer (``group.flat``) allocated; a group is
    ``live`` when its current weights are on every rank or on their way (``group.work``).
    """

    def __init__(self, state: "DedicateState") -> None:
        self.state = state

    @staticmethod
    def blocks(state: "DedicateState") -> list[int]:
        """The key that groups matrices into publish groups and gradient buckets: the plan's
        bucket (:func:`dmuon.owners.plan.build_bucket_plan`), or, for a plan without buckets
        (a file solved for another path), buckets cut here by the same cap."""
        specs = {m.fqn: m for m in state.plan.matrices}
        if all(specs[sel.fqn].bucket is not None for sel in state.selected):
            return [specs[sel.fqn].bucket for sel in state.selected]
        from dmuon.balance.buckets import cut_buckets

        return cut_buckets([4 * sel.shape[0] * sel.shape[1] for sel in state.selected], state.bucket_bytes)

    def _issue_all(self) -> None:
        """Broadcast every group that is not live from its owner, in forward order."""
        groups = [g for g in self.state.groups if not g.live]
        by_device: dict[torch.device, list["PublishGroup"]] = {}
        for group in groups:
            by_device.setdefault(group.flat.device, []).append(group)
        for device, same in by_device.items():
            pendings: list = []
            with issued_together(self.state.group, device, pendings):
                for group in same:
                    with torch.autograd._unsafe_preserve_version_counter(group.flat):
                        group.work = publish(group.flat, group.owner, self.state.group)
                    pendings.append(group.work)
                    group.live = True

    def pre_forward(self, unit: "Unit") -> None:
        """Wait for this unit's buckets only; the first forward (or one after loading a state
        dict) first issues every bucket's broadcast, in the same order on every rank."""
        with torch.profiler.record_function("dmuon::pre_forward"):
            if any(not g.live for g in unit.groups):
                self._issue_all()
            for group in unit.groups:
                if group.work is not None:
                    group.work.wait()
                    group.work = None
        for rec in unit.records:
            rec.show("compute")

    def publish_after_step(self, issue: bool) -> None:
        """Owners copy their fp32 masters into the compute buffers; with ``issue`` every bucket
        is broadcast now (overlapping the next forward), else at the next forward."""
        with torch.profiler.record_function("dmuon::publish_after_step"), torch.no_grad():
            for group in self.state.groups:
                if group.work is not None:  # a broadcast no forward waited for
                    group.work.wait()
                    group.work = None
                if group.is_owner:
                    with torch.autograd._unsafe_preserve_version_counter(group.flat):
                        for rec in group.members:
                            rec.buffer.detach().copy_(rec.master)
                group.live = False
            for rec in self.state.records:
                rec.had_grad = False
            if issue and self.state.world_size > 1:
                self._issue_all()
            elif self.state.world_size == 1:
                for group in self.state.groups:
                    group.live = True
