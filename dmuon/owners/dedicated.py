"""Per-matrix runtime record. Each dedicated matrix has two ``nn.Parameter`` objects:
``master`` (shown outside forward/backward, stepped by the optimizer: the fp32 ``[rows, cols]``
on the owner, a ``[0]`` placeholder elsewhere) and ``compute`` (the weight in the compute
dtype, swapped onto the module during its forward as FSDP2 does; on non-owners its storage is
freed when not needed and refilled by the owner's broadcast).
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
        fqn, module, attr: the parameter's name; ``module._parameters[attr]`` holds it.
        shape: this rank's matrix ``(rows, cols)`` (a TP slice), or expert range ``[k, rows,
            cols]``; ``full_shape``: the whole matrix's ``(rows, cols)``.
        owner, is_owner: the owner's rank within ``group`` (default the shard group), and
            whether it is this one.
        master, compute: see the module docstring.
        reduce_dtype: dtype gradients are summed in on their way to the owner.
        order: index in forward order (publication order and prefetch).
        tp_shard_dim, tp_owner: the dim TP splits (0/1, or ``None``) and the TP rank that runs
            Newton-Schulz.
        replicate_mode: HSDP only (:attr:`dmuon.owners.plan.MatrixSpec.replicate_mode`).
        matrix_shape: ``(rows, cols)`` of one Newton-Schulz matrix (:mod:`dmuon.owners.stacks`).
        key, experts: the plan entry's name and expert range (:attr:`MatrixSpec.key`); under
            expert parallelism over the stack's global experts (one checkpoint key per name).
        stack: the :class:`dmuon.owners.stacks.StackSlot` of a stack split into several
            ranges; ``None`` otherwise.
        optional: a routed expert's matrix: it may take no gradient on some ranks of a step.
        sd_layout: ``(mesh, placements, shape, stride)`` of FSDP2's sharded parameter (shown by
            ``model.state_dict()``), or ``None``.
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
        full: the full matrix ``[rows, cols]`` (any float dtype; the TP slice under TP); only
            read on the owner.
        owner, rank: the owner's and this rank's rank in the dmuon group.
        wrap: the local compute tensor to what the module computes with (a DTensor on the TP
            mesh); identity when ``None``.
        storage: a view of a publish group's flat buffer to hold the compute weight (the
            group frees it on non-owners).
        extra: further :class:`DedicatedParam` fields.
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
            master = nn.Parameter(torch.empty(0, dtype=torch.float32, device=device),
                                  requires_grad=requires_grad)
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
