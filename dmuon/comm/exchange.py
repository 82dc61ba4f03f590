"""Batched owner exchanges: a round of matrices' pieces to their owners, and the updates
back, in one ``all_to_all_single`` each (the ``distributed_config`` rounds and
:func:`orthogonalize_tp`): the layer sharding of "Layer Sharding for Large-Scale Training with
Muon" (2025). Split sizes need no padding; one copy of a replicated piece travels
(:meth:`MatrixLayout.source_for`), and every rank receives its own piece back.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from dmuon.comm.collectives import Pending
from dmuon.owners.slices import MatrixLayout, placement_runs, put, take


def _all_to_all(send_parts: list[list[Tensor]], recv_splits: list[int], traffic: bool, group: Any,
                dtype: torch.dtype, device: torch.device, what: str,
                finish: Callable[[Callable[[int, tuple[int, int]], Tensor]], list]) -> Pending:
    """One ``all_to_all_single`` sending ``send_parts[dst]`` to each ``dst`` and receiving
    ``recv_splits[src]`` elements from each ``src`` (skipped everywhere without ``traffic``).
    ``finish(received)`` builds the result; ``received(src, shape)``: the next piece from ``src``."""
    send_splits = [sum(p.numel() for p in parts) for parts in send_parts]
    flat = [p for parts in send_parts for p in parts]
    send = torch.cat(flat) if flat else torch.empty(0, dtype=dtype, device=device)
    recv = send.new_empty(sum(recv_splits))
    work = None
    if traffic:
        work = dist.all_to_all_single(recv, send, output_split_sizes=recv_splits,
                                      input_split_sizes=send_splits, group=group, async_op=True)
    offsets = [sum(recv_splits[:s]) for s in range(len(recv_splits))]

    def received(src: int, shape: tuple[int, int]) -> Tensor:
        n = shape[0] * shape[1]
        offsets[src] += n
        return recv[offsets[src] - n: offsets[src]].view(shape)

    return Pending(work, (send, recv), what, group, lambda: finish(received))


def gather_to_owners(local_pieces: Sequence[Tensor], layouts: Sequence[MatrixLayout],
                     owners: Sequence[int], *, group: Any, rank: int, world_size: int,
                     dtype: torch.dtype) -> Pending:
    """Assemble each matrix of a round whole on its owner (a rank of ``group``; ``None``: the
    default group) with one all-to-all, from this rank's pieces ``[local rows, local cols]``
    (any dtype, not mutated) laid out by ``layouts`` (identical on every rank). ``rank`` and
    ``world_size`` are this rank's and ``group``'s; ``dtype`` is the transport and result dtype.

    Returns:
        A :class:`Pending` whose ``wait()`` gives each full ``[rows, cols]`` matrix on its owner,
        ``None`` elsewhere.

    Raises:
        RuntimeError: a local piece whose shape is not the layout's (names the matrix, rank and
            both shapes).
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
    traffic = any(layout.source_for(rep, owner) != owner and layout.numel(rep)
                  for layout, owner in zip(layouts, owners) for rep in layout.representatives())
    own = [piece.to(dtype, copy=True) if owner == rank else None
           for piece, owner in zip(local_pieces, owners)]
    device = local_pieces[0].device if local_pieces else torch.device("cpu")

    def finish(received: Callable[[int, tuple[int, int]], Tensor]) -> list[Tensor | None]:
        out: list[Tensor | None] = []
        for j, (layout, owner) in enumerate(zip(layouts, owners)):
            if owner != rank:
                out.append(None)
                continue
            full = torch.empty(layout.full_shape, dtype=dtype, device=device)
            for rep in layout.representatives():  # one copy of each distinct piece
                src = layout.source_for(rep, owner)
                piece = own[j] if src == rank else received(src, layout.local_shape(rep))
                put(full, layout.slices[rep], piece)
            out.append(full)
        return out

    return _all_to_all(send_parts, recv_splits, traffic, group, dtype, device,
                       f"the gather of {len(layouts)} matrices to their owners", finish)


def scatter_from_owners(fulls: Sequence[Tensor | None], layouts: Sequence[MatrixLayout],
                        owners: Sequence[int], *, group: Any, rank: int, world_size: int,
                        dtype: torch.dtype, device: torch.device) -> Pending:
    """Send every rank its piece ``[local rows, local cols]`` (on ``device``) of each owner's
    full ``[rows, cols]`` matrix (``fulls``; ``None`` off the owner) with one all-to-all; the
    other arguments as :func:`gather_to_owners`. Returns a :class:`Pending` giving the pieces.

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
    traffic = any(dst != owner and layout.numel(dst)
                  for layout, owner in zip(layouts, owners) for dst in range(world_size))
    own = [take(full, layout.slices[rank]).to(dtype, copy=True) if owner == rank else None
           for full, layout, owner in zip(fulls, layouts, owners)]

    def finish(received: Callable[[int, tuple[int, int]], Tensor]) -> list[Tensor]:
        return [own[j] if owner == rank else received(owner, layout.local_shape(rank))
                for j, (layout, owner) in enumerate(zip(layouts, owners))]

    return _all_to_all(send_parts, recv_splits, traffic, group, dtype, device,
                       f"the scatter of {len(layouts)} updates from their owners", finish)


@functools.lru_cache(maxsize=None)
def tp_layout(full_shape: tuple[int, int], shard_dim: int | None, size: int) -> MatrixLayout:
    """The layout of a matrix cut by ``torch.chunk`` along ``shard_dim`` over ``size`` TP ranks
    (DTensor's ``Shard``), or held whole by each (``shard_dim=None``)."""
    from torch.distributed.tensor import Replicate, Shard  # here: importing dmuon leaves torch alone

    placements = [Replicate() if shard_dim is None else Shard(shard_dim)]
    return MatrixLayout.build(full_shape, [tuple(placement_runs(full_shape, placements, [size], [r]))
                                           for r in range(size)])


def orthogonalize_tp(updates: Sequence[Tensor], recs: Sequence[Any], group: dist.ProcessGroup,
                     orthogonalize: Callable[[list[Tensor]], list[Tensor]]) -> list[Tensor]:
    """Newton-Schulz of TP-sharded updates: each TP owner (``rec.tp_owner``, a rank of the TP
    ``group``) gathers its matrices' slices, runs ``orthogonalize`` on the full matrices and
    scatters the slices back, one all-to-all each way. ``updates``: this rank's slice of each
    update (``[rows_t, cols]`` / ``[rows, cols_t]`` by ``rec.tp_shard_dim``; whole when None),
    ``recs`` in the same order on every rank. Returns this rank's slices of the results, fp32.
    """
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    layouts = [tp_layout(tuple(rec.full_shape), rec.tp_shard_dim, size) for rec in recs]
    owners = [rec.tp_owner for rec in recs]
    device = updates[0].device if updates else torch.device("cpu")
    kw = dict(group=group, rank=rank, world_size=size, dtype=torch.float32)
    fulls = gather_to_owners(updates, layouts, owners, **kw).wait()
    mine = [j for j, owner in enumerate(owners) if owner == rank]
    for j, out in zip(mine, orthogonalize([fulls[j] for j in mine]) if mine else []):
        fulls[j] = out
    return scatter_from_owners(fulls, layouts, owners, device=device, **kw).wait()
