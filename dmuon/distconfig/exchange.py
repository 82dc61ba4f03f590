"""Batched owner exchanges: many matrices' pieces to their owners, and updates back, in one
``all_to_all_single`` each.

This is the layer sharding of "Layer Sharding for Large-Scale Training with Muon" (2025): a
round of matrices, each owned by one rank, is re-sharded from the training layout (pieces of
every matrix on every rank) to whole matrices on their owners with one all-to-all, and back
with a second one, instead of one gather and one scatter per matrix. With split sizes
(``all_to_all_single``'s alltoallv form) uneven and strided pieces need no padding. gloo
implements ``all_to_all_single`` with splits and ``async_op=True`` on CPU; NCCL on GPU.

Only one copy of a replicated piece travels to the owner, and none when the owner holds it
(:meth:`MatrixLayout.source_for`); every rank receives its own piece of the update, replicas included.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from dmuon.comm.collectives import Pending
from dmuon.owners.slices import MatrixLayout, put, take

logger = logging.getLogger(__name__)


def _all_to_all(send: Tensor, send_splits: list[int], recv_splits: list[int], group: Any,
                async_op: bool, traffic: bool) -> tuple[Tensor, Any]:
    """``traffic``: whether any rank sends anything (the same on every rank, from the layouts);
    without it the collective is skipped everywhere (e.g. DDP gathers: the owner has it all)."""
    recv = send.new_empty(sum(recv_splits))
    if not traffic:
        return recv, None
    work = dist.all_to_all_single(recv, send, output_split_sizes=recv_splits,
                                  input_split_sizes=send_splits, group=group, async_op=async_op)
    return recv, work


def gather_to_owners(local_pieces: Sequence[Tensor], layouts: Sequence[MatrixLayout],
                     owners: Sequence[int], *, group: Any, rank: int, world_size: int,
                     dtype: torch.dtype, async_op: bool = True) -> Pending:
    """Assemble every matrix of a round, whole, on its owner, with one all-to-all.

    Args:
        local_pieces: this rank's local piece of each matrix ``[local rows, local cols]``
            (any dtype; not mutated), in round order.
        layouts: each matrix's :class:`MatrixLayout` (identical on every rank).
        owners: each matrix's owner, a rank of ``group``.
        group: the process group (``None``: the default group).
        rank, world_size: this rank and the size of ``group``.
        dtype: transport and result dtype.
        async_op: issue the collective asynchronously.

    Returns:
        A :class:`Pending` whose ``wait()`` gives, per matrix, the full ``[rows, cols]`` tensor
        on its owner and ``None`` elsewhere.

    Raises:
        RuntimeError: a local piece whose shape is not the layout's (names the matrix, rank and
            both shapes). Collective errors (a dead peer, a timeout) propagate from ``wait()``.
    """
    send_parts: list[list[Tensor]] = [[] for _ in range(world_size)]
    recv_splits = [0] * world_size
    for j, (piece, layout, owner) in enumerate(zip(local_pieces, layouts, owners)):
        if tuple(piece.shape) != layout.local_shape(rank):
            raise RuntimeError(
                f"dmuon: matrix {j} of the round: rank {rank} holds a piece of shape "
                f"{tuple(piece.shape)}, but its layout says {layout.local_shape(rank)} of the full "
                f"{layout.full_shape}. The tensor does not match the layout computed at "
                f"construction; were parameters re-sharded after the optimizer was built?")
        if owner != rank and layout.source_for(rank, owner) == rank and piece.numel():
            send_parts[owner].append(piece.reshape(-1).to(dtype))
        if owner == rank:
            for rep in layout.representatives():
                src = layout.source_for(rep, owner)
                if src != rank:
                    recv_splits[src] += layout.numel(rep)
    send_splits = [sum(p.numel() for p in parts) for parts in send_parts]
    flat = [p for parts in send_parts for p in parts]
    device = local_pieces[0].device if local_pieces else torch.device("cpu")
    send = torch.cat(flat) if flat else torch.empty(0, dtype=dtype, device=device)
    traffic = any(layout.source_for(rep, owner) != owner and layout.numel(rep)
                  for layout, owner in zip(layouts, owners) for rep in layout.representatives())
    recv, work = _all_to_all(send, send_splits, recv_splits, group, async_op, traffic)
    # Own pieces are copied now: the caller may reuse its tensors once this returns.
    own = [piece.to(dtype, copy=True) if owner == rank else None
           for piece, owner in zip(local_pieces, owners)]

    def finish() -> list[Tensor | None]:
        offsets = [sum(recv_splits[:s]) for s in range(world_size)]
        out: list[Tensor | None] = []
        for j, (layout, owner) in enumerate(zip(layouts, owners)):
            if owner != rank:
                out.append(None)
                continue
            full = torch.empty(layout.full_shape, dtype=dtype, device=device)
            for rep in layout.representatives():  # one copy of each distinct piece
                src = layout.source_for(rep, owner)
                if src == rank:
                    put(full, layout.slices[rep], own[j])
                else:
                    n = layout.numel(rep)
                    piece = recv[offsets[src]:offsets[src] + n].view(layout.local_shape(rep))
                    offsets[src] += n
                    put(full, layout.slices[rep], piece)
            out.append(full)
        return out

    return Pending(work, (send, recv), f"the gather of {len(layouts)} matrices to their owners",
                   group, finish)


def scatter_from_owners(fulls: Sequence[Tensor | None], layouts: Sequence[MatrixLayout],
                        owners: Sequence[int], *, group: Any, rank: int, world_size: int,
                        dtype: torch.dtype, device: torch.device, async_op: bool = True) -> Pending:
    """Send every rank its piece of each owner's full matrix, with one all-to-all.

    Args:
        fulls: per matrix, the full ``[rows, cols]`` update on its owner, ``None`` elsewhere.
        layouts, owners, group, rank, world_size: as :func:`gather_to_owners`.
        dtype: transport and result dtype.
        device: device of the results.
        async_op: issue the collective asynchronously.

    Returns:
        A :class:`Pending` whose ``wait()`` gives this rank's piece ``[local rows, local cols]``
        of every matrix (replicas included).

    Raises:
        RuntimeError: an owner without its full matrix, a non-owner given one, or a full
            matrix of the wrong shape (names the matrix, rank, expected and actual shapes).
    """
    send_parts: list[list[Tensor]] = [[] for _ in range(world_size)]
    recv_splits = [0] * world_size
    for j, (full, layout, owner) in enumerate(zip(fulls, layouts, owners)):
        if owner == rank:
            if full is None or tuple(full.shape) != layout.full_shape:
                got = None if full is None else tuple(full.shape)
                raise RuntimeError(
                    f"dmuon: rank {rank} owns matrix {j} of the round and must pass its full "
                    f"update of shape {layout.full_shape}; got {got}.")
            for dst in range(world_size):
                if dst != rank and layout.numel(dst):
                    send_parts[dst].append(take(full, layout.slices[dst]).reshape(-1).to(dtype))
        else:
            if full is not None:
                raise RuntimeError(
                    f"dmuon: rank {rank} is not the owner (rank {owner}) of matrix {j} of the "
                    f"round but passed a tensor of shape {tuple(full.shape)}; pass None.")
            recv_splits[owner] += layout.numel(rank)
    send_splits = [sum(p.numel() for p in parts) for parts in send_parts]
    flat = [p for parts in send_parts for p in parts]
    send = torch.cat(flat) if flat else torch.empty(0, dtype=dtype, device=device)
    traffic = any(dst != owner and layout.numel(dst)
                  for layout, owner in zip(layouts, owners) for dst in range(world_size))
    recv, work = _all_to_all(send, send_splits, recv_splits, group, async_op, traffic)
    own = [take(full, layout.slices[rank]).to(dtype, copy=True) if owner == rank else None
           for full, layout, owner in zip(fulls, layouts, owners)]

    def finish() -> list[Tensor]:
        offsets = [sum(recv_splits[:s]) for s in range(world_size)]
        out = []
        for j, (layout, owner) in enumerate(zip(layouts, owners)):
            if owner == rank:
                out.append(own[j])
                continue
            n = layout.numel(rank)
            out.append(recv[offsets[owner]:offsets[owner] + n].view(layout.local_shape(rank)))
            offsets[owner] += n
        return out

    return Pending(work, (send, recv), f"the scatter of {len(layouts)} updates from their owners",
                   group, finish)
