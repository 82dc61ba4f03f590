"""Second-level ownership: Newton-Schulz of tensor-parallel matrices on one TP owner.

Each TP slice's DP owner holds the slice's momentum and forms its Nesterov update; the TP
owner of the matrix gathers the slices over the TP group, runs Newton-Schulz on the full
matrix (batched by shape with its other matrices) and scatters the orthogonalized slices back
(Megatron's "duplicated" mode without the duplication; see the seed on TP Newton-Schulz).
Matrices that every TP rank holds whole are computed by their TP owner and broadcast.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dmuon.owners.slices import chunk_sizes


@dataclass(frozen=True, slots=True)
class TPItem:
    """One matrix in the TP exchange (same sequence on every rank of the TP group).

    Attributes:
        update: this rank's slice of the Nesterov update (fp32, ``[rows_t, cols]`` or
            ``[rows, cols_t]``), or the whole update when ``shard_dim`` is None.
        shard_dim: TP split dimension (0/1) or None.
        full_shape: ``(rows, cols)`` of the whole matrix.
        tp_owner: rank in the TP group that runs Newton-Schulz.
    """

    update: torch.Tensor
    shard_dim: int | None
    full_shape: tuple[int, int]
    tp_owner: int


def _pad_to(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    missing = size - t.shape[dim]
    if missing == 0:
        return t.contiguous()
    pad = [0, 0, 0, 0]
    pad[(1 - dim) * 2 + 1] = missing  # F.pad orders pads from the last dim
    return F.pad(t, pad)


def orthogonalize_tp(items: list[TPItem], group: dist.ProcessGroup,
                     orthogonalize: Callable[[list[torch.Tensor]], list[torch.Tensor]]) -> list[torch.Tensor]:
    """Gather to the TP owners, orthogonalize there, scatter back.

    Args:
        items: the TP group's matrices, in plan order (identical on every rank of ``group``).
        group: the TP process group.
        orthogonalize: Newton-Schulz over a list of full matrices (batched by shape).

    Returns:
        This rank's slice (or whole matrix) of each orthogonalized update, fp32.
    """
    size, me = dist.get_world_size(group), dist.get_rank(group)
    pending = []
    for item in items:  # 1. slices travel to their TP owner
        owner = dist.get_global_rank(group, item.tp_owner)
        if item.shard_dim is None:
            pending.append((item, None, None))
            continue
        sizes = chunk_sizes(item.full_shape[item.shard_dim], size)
        padded = _pad_to(item.update.float(), item.shard_dim, max(sizes))
        bufs = [torch.empty_like(padded) for _ in range(size)] if me == item.tp_owner else None
        work = dist.gather(padded, bufs, dst=owner, group=group, async_op=True)
        pending.append((item, (work, padded, bufs), sizes))
    fulls, mine = [], []
    for index, (item, comm, sizes) in enumerate(pending):
        if comm is not None:
            comm[0].wait()
        if me != item.tp_owner:
            continue
        if comm is None:
            fulls.append(item.update.float())
        else:
            fulls.append(torch.cat([b.narrow(item.shard_dim, 0, n) for b, n in zip(comm[2], sizes)],
                                   dim=item.shard_dim))
        mine.append(index)
    ortho = dict(zip(mine, orthogonalize(fulls))) if fulls else {}
    results, works = [], []
    for index, (item, comm, sizes) in enumerate(pending):  # 2. orthogonalized slices go back
        owner = dist.get_global_rank(group, item.tp_owner)
        if item.shard_dim is None:
            buf = ortho[index].float().contiguous() if me == item.tp_owner else torch.empty(
                item.full_shape, dtype=torch.float32, device=item.update.device)
            works.append(dist.broadcast(buf, src=owner, group=group, async_op=True))
            results.append(buf)
            continue
        full = ortho.get(index)
        parts = None
        if full is not None:
            parts = [_pad_to(p.float(), item.shard_dim, max(sizes))
                     for p in torch.split(full, sizes, dim=item.shard_dim)]
        out = torch.empty_like(comm[1])
        works.append(dist.scatter(out, parts, src=owner, group=group, async_op=True))
        results.append(out.narrow(item.shard_dim, 0, sizes[me]))
    for work in works:
        work.wait()
    return results
