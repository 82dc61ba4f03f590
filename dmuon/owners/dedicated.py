"""Per-matrix runtime record: the owner's fp32 master, everyone's compute copy, placeholders.

Each dedicated matrix ``W`` (``[rows, cols]``) is represented by two ``nn.Parameter`` objects:

* ``master``: what ``model.parameters()`` lists outside forward/backward and what the optimizer
  steps. On the owner it is the full fp32 master weight ``[rows, cols]``; on every other rank it
  is a zero-size placeholder (``[0]``), so parameter-walking code keeps working without memory.
* ``compute``: the full weight in the compute dtype (``[rows, cols]``), swapped onto the module
  for the duration of its forward (as FSDP2 swaps its unsharded parameter). Autograd
  accumulates the local gradient into ``compute.grad``. On non-owners its storage is freed
  (resized to zero bytes) whenever it is not needed and refilled by the owner's broadcast.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dmuon.owners.slices import local_tensor


def free_storage(t: torch.Tensor) -> None:
    """Release ``t``'s memory, keeping its shape and autograd identity (FSDP2's trick)."""
    storage = t.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)


def alloc_storage(t: torch.Tensor) -> None:
    """Give ``t`` (freed by :func:`free_storage`) memory for its full shape; contents undefined."""
    storage = t.untyped_storage()
    nbytes = t.numel() * t.element_size()
    if storage.size() != nbytes:
        storage.resize_(nbytes)


@dataclass(eq=False)
class DedicatedParam:
    """Runtime state of one dedicated matrix on one rank.

    Attributes:
        fqn: fully qualified parameter name.
        module: the module whose ``_parameters[attr]`` holds the matrix.
        attr: the attribute name on ``module`` (e.g. ``"weight"``).
        shape: full shape ``(rows, cols)``.
        owner: owner's rank within the dmuon process group.
        is_owner: whether this rank is the owner.
        master: fp32 master ``[rows, cols]`` on the owner, zero-size placeholder elsewhere.
        compute: full weight in the compute dtype ``[rows, cols]``; storage freed on non-owners
            while not in use.
        reduce_dtype: dtype gradients are summed in on their way to the owner.
        order: index in forward order (for publication order and prefetch).
        full_shape: ``(rows, cols)`` of the whole matrix (``shape`` is this rank's TP slice).
        tp_shard_dim: 0/1 when TP splits the matrix, ``None`` otherwise.
        tp_owner: TP rank that runs Newton-Schulz for the matrix.
        replicate_mode: HSDP only: ``"compute"`` (every replica's owner runs NS on the
            all-reduced gradient) or ``"broadcast"`` (replica 0's owner runs it and broadcasts
            the new master).
        matrix_shape: ``(rows, cols)`` of one Newton-Schulz matrix: ``full_shape`` for a
            matrix; for a stack's expert range ``[k, rows, cols]`` (``shape``), or a matrix
            cut into row blocks, one expert's (block's) matrix (:mod:`dmuon.owners.stacks`).
        key: the plan entry's name (:attr:`dmuon.owners.plan.MatrixSpec.key`); under expert
            parallelism ``fqn[start:stop]`` over the stack's *global* experts (the plan's range
            is over this rank's local ones), so each expert group's ranges have their own names
            (a checkpoint key is written once per name).
        experts: a stack's expert range ``(start, stop)`` over its global (flattened leading)
            experts, the numbers in ``key``; ``None`` for a 2-D matrix.
        stack: the :class:`dmuon.owners.stacks.StackSlot` of a stack split into several
            ranges (it shows the module the whole stack); ``None`` otherwise.
        optional: a routed expert's matrix (:func:`dmuon.owners.stacks.expert_module_names`):
            it may take no gradient on some ranks of a step.
        group: the process group ``owner`` is a rank of, when it is not dmuon's shard group
            (expert parallelism: the ranks holding the same experts); ``None``: the shard group.
        sd_layout: ``(mesh, placements, shape, stride)`` of FSDP2's sharded parameter, which
            ``model.state_dict()`` shows in its place (:mod:`dmuon.hooks.state_dict`); ``None``
            when FSDP2 did not manage it (plain replicated module: the full tensor).
    """

    fqn: str
    module: nn.Module
    attr: str
    shape: tuple[int, int]
    owner: int
    is_owner: bool
    master: nn.Parameter
    compute: nn.Parameter
    reduce_dtype: torch.dtype
    order: int = 0
    full_shape: tuple[int, int] = (0, 0)
    tp_shard_dim: int | None = None
    tp_owner: int = 0
    replicate_mode: str = "compute"
    had_grad: bool = False
    matrix_shape: tuple[int, int] = (0, 0)
    key: str = ""
    experts: tuple[int, int] | None = None
    stack: Any = None
    optional: bool = False
    group: Any = None
    sd_layout: Any = None

    @property
    def buffer(self) -> torch.Tensor:
        """The compute weight as a plain local tensor (the TP slice under tensor parallelism)."""
        return local_tensor(self.compute)

    def show(self, which: str) -> None:
        """Register ``master`` (outside forward) or ``compute`` (inside) on the module."""
        if self.stack is not None:  # one range of a split stack: the slot shows them all, once
            if self is self.stack.records[0]:
                self.stack.show(which)
            return
        param = self.compute if which == "compute" else self.master
        self.module._parameters[self.attr] = param


def make_dedicated(
    *,
    fqn: str,
    module: nn.Module,
    attr: str,
    full: torch.Tensor,
    owner: int,
    rank: int,
    compute_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    requires_grad: bool,
    order: int,
    wrap: Any = None,
    storage: torch.Tensor | None = None,
    **extra: Any,
) -> DedicatedParam:
    """Build the record from the full initial weight and register the master on the module.

    Args:
        full: the full matrix ``[rows, cols]`` (any float dtype; this rank's TP slice under
            tensor parallelism); only read on the owner.
        owner: owner's rank in the dmuon group; ``rank`` is this rank in it.
        wrap: turns the local compute tensor into what the module computes with (a DTensor on
            the TP mesh); identity when ``None``.
        storage: a view (of a publish group's flat buffer) to hold the compute weight; the
            group, not this function, frees it on non-owners.
        extra: further :class:`DedicatedParam` fields (TP and HSDP attributes).
    """
    shape = tuple(int(s) for s in full.shape)  # a matrix, or an expert range [k, rows, cols]
    is_owner = owner == rank
    device = full.device
    with torch.no_grad():
        wrap = wrap or (lambda t: t)
        if is_owner:
            master = nn.Parameter(full.detach().to(torch.float32).clone(), requires_grad=requires_grad)
            if storage is None:
                local = full.detach().to(compute_dtype).clone()
            else:
                local = storage.view(shape).copy_(full.detach())
        else:
            master = nn.Parameter(torch.empty(0, dtype=torch.float32, device=device), requires_grad=requires_grad)
            if storage is None:
                local = torch.empty(shape, dtype=compute_dtype, device=device)
                free_storage(local)
            else:
                local = storage.view(shape)
        compute = nn.Parameter(wrap(local), requires_grad=requires_grad)
    master._dmuon_fqn = fqn  # type: ignore[attr-defined]
    master._dmuon_shape = shape  # type: ignore[attr-defined]
    compute._dmuon_fqn = fqn  # type: ignore[attr-defined]
    rec = DedicatedParam(
        fqn=fqn, module=module, attr=attr, shape=shape, owner=owner, is_owner=is_owner,
        master=master, compute=compute, reduce_dtype=reduce_dtype, order=order, **extra,
    )
    rec.show("master")
    return rec
