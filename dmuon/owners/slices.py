"""Which rows and columns of a full ``[rows, cols]`` matrix each rank holds, as *runs* (tuples
of half-open ``(start, stop)`` intervals), following DTensor's splitting
(``torch/distributed/tensor/placement_types.py``) in mesh-dimension order: ``Shard(d)`` over
``n`` ranks cuts dim ``d``'s indices into ``torch.chunk``'s ``n`` chunks of ``ceil(len / n)``;
``_StridedShard(d)`` (FSDP2 over a TP-sharded dim) is applied last as a plain ``Shard``, which
is what FSDP2 stores.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

Runs = tuple[tuple[int, int], ...]


def local_tensor(t: Tensor) -> Tensor:
    """This rank's local piece of a DTensor (``to_local()``, no copy), or ``t`` itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def chunk_sizes(size: int, parts: int) -> list[int]:
    """Sizes ``torch.chunk`` (and DTensor's ``Shard``) gives ``size`` indices over ``parts``
    ranks: ``ceil(size / parts)`` each, trailing chunks shorter or empty."""
    step = -(-size // parts) if size else 0
    return [max(0, min(step, size - i * step)) for i in range(parts)]


def chunk_span(size: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of chunk ``index`` of :func:`chunk_sizes`: the indices a TP slice
    ``Shard`` over ``parts`` ranks holds along its dim."""
    sizes = chunk_sizes(size, parts)
    start = sum(sizes[:index])
    return start, start + sizes[index]


def runs_length(runs: Runs) -> int:
    """Number of indices in ``runs``."""
    return sum(stop - start for start, stop in runs)


def sub_runs(runs: Runs, start: int, stop: int) -> Runs:
    """Positions ``[start, stop)`` of the index sequence ``runs``, as runs (``stop`` clipped)."""
    out: list[tuple[int, int]] = []
    pos = 0
    for a, b in runs:
        lo, hi = max(start, pos), min(stop, pos + b - a)
        if lo < hi:
            s, e = a + lo - pos, a + hi - pos
            if out and out[-1][1] == s:
                out[-1] = (out[-1][0], e)
            else:
                out.append((s, e))
        pos += b - a
    return tuple(out)


def placement_runs(shape: Sequence[int], placements: Sequence[object], mesh_shape: Sequence[int],
                   coords: Sequence[int]) -> list[Runs]:
    """The indices, per dim, of the piece of a DTensor of global ``shape`` held at mesh
    coordinates ``coords`` (the module docstring's rules); ValueError for an unknown placement."""
    dims = [((0, int(n)),) if n else () for n in shape]
    for placement, size, coord in sorted(zip(placements, mesh_shape, coords),
                                         key=lambda x: type(x[0]).__name__ == "_StridedShard"):
        name = type(placement).__name__
        if name in ("Shard", "_StridedShard"):
            dim = int(placement.dim) % len(dims)
            dims[dim] = sub_runs(dims[dim], *chunk_span(runs_length(dims[dim]), int(size), int(coord)))
        elif name not in ("Replicate", "Partial"):
            raise ValueError(f"dmuon: unsupported DTensor placement {placement!r}; expected Shard, "
                             f"_StridedShard or Replicate")
    return dims


@dataclass(frozen=True, slots=True, kw_only=True)
class MatrixLayout:
    """The pieces of one full ``[rows, cols]`` matrix over the ranks of a process group.

    Attributes:
        full_shape: ``(rows, cols)`` of the full matrix.
        slices: per group rank, ``(row runs, col runs)`` of the piece it holds locally.
        sources: per group rank, the group rank whose copy of that rank's piece a gather reads:
            the lowest rank holding an identical piece (replicas send once).
    """

    full_shape: tuple[int, int]
    slices: tuple[tuple[Runs, Runs], ...]
    sources: tuple[int, ...]

    @staticmethod
    def build(full_shape: Sequence[int], slices: Sequence[tuple[Runs, Runs]]) -> "MatrixLayout":
        """Layout from per-rank slices; RuntimeError if some element is held by no rank."""
        first: dict[tuple[Runs, Runs], int] = {}
        sources = []
        for r, s in enumerate(slices):
            sources.append(first.setdefault(s, r))
        rows, cols = int(full_shape[0]), int(full_shape[1])
        covered = torch.zeros(rows, cols, dtype=torch.bool)
        for r_runs, c_runs in first:
            covered[index_of(r_runs)[:, None], index_of(c_runs)] = True
        if not bool(covered.all()):
            raise RuntimeError(
                f"dmuon: the ranks' pieces of a {rows}x{cols} matrix do not cover it "
                f"({int((~covered).sum())} elements held by no rank); slices per rank: {list(slices)}")
        return MatrixLayout(full_shape=(rows, cols), slices=tuple(slices), sources=tuple(sources))

    def representatives(self) -> list[int]:
        """One group rank per distinct piece (the lowest holding it)."""
        return [r for r, src in enumerate(self.sources) if src == r]

    def source_for(self, rank: int, owner: int) -> int:
        """The rank whose copy of ``rank``'s piece a gather to ``owner`` reads: the owner itself
        when it holds an identical piece (no traffic), else the lowest rank holding it."""
        return owner if self.slices[owner] == self.slices[rank] else self.sources[rank]

    def local_shape(self, rank: int) -> tuple[int, int]:
        """Shape of group rank ``rank``'s local piece."""
        r, c = self.slices[rank]
        return runs_length(r), runs_length(c)

    def numel(self, rank: int) -> int:
        """Elements of group rank ``rank``'s local piece."""
        rows, cols = self.local_shape(rank)
        return rows * cols


def index_of(runs: Runs) -> Tensor:
    """The runs as an int64 index tensor ``[len]`` (CPU)."""
    if not runs:
        return torch.zeros(0, dtype=torch.long)
    return torch.cat([torch.arange(a, b) for a, b in runs])


def take(full: Tensor, piece: tuple[Runs, Runs]) -> Tensor:
    """``full[rows][:, cols]`` for a piece; a view when both are single runs."""
    r_runs, c_runs = piece
    if len(r_runs) <= 1 and len(c_runs) <= 1:
        r0, r1 = r_runs[0] if r_runs else (0, 0)
        c0, c1 = c_runs[0] if c_runs else (0, 0)
        return full[r0:r1, c0:c1]
    rows, cols = index_of(r_runs).to(full.device), index_of(c_runs).to(full.device)
    return full.index_select(0, rows).index_select(1, cols)


def put(full: Tensor, piece: tuple[Runs, Runs], value: Tensor) -> None:
    """Write ``value`` (shape of the piece) into ``full[rows][:, cols]`` in place."""
    r_runs, c_runs = piece
    if len(r_runs) <= 1 and len(c_runs) <= 1:
        r0, r1 = r_runs[0] if r_runs else (0, 0)
        c0, c1 = c_runs[0] if c_runs else (0, 0)
        full[r0:r1, c0:c1].copy_(value)
        return
    rows, cols = index_of(r_runs).to(full.device), index_of(c_runs).to(full.device)
    full[rows[:, None], cols] = value.to(full.dtype)


def local_rows(t: Tensor) -> Tensor:
    """Indices, along dim 0 of the full tensor, of the rows this rank's local piece of ``t`` (a
    DTensor, or a plain tensor: every row) holds, in local order (int64 CPU ``[local rows]``)."""
    mesh = getattr(t, "device_mesh", None)
    if mesh is None:
        return torch.arange(int(t.shape[0]))
    coords = mesh.get_coordinate()
    if coords is None:  # not on this tensor's mesh: holds nothing
        return torch.zeros(0, dtype=torch.long)
    return index_of(placement_runs(t.shape, t.placements, mesh.mesh.shape, coords)[0])


def dtensor_layout(t: Tensor, group_ranks: Sequence[int]) -> MatrixLayout:
    """Layout of a 2-D DTensor ``t`` (metadata only) whose mesh holds exactly the global ranks
    ``group_ranks`` (in group-rank order); ValueError if it does not, or for a placement
    sharding a dim other than 0 or 1 or an unknown one."""
    mesh = t.device_mesh
    grid = mesh.mesh
    mesh_ranks = sorted(int(r) for r in grid.flatten().tolist())
    if mesh_ranks != sorted(int(r) for r in group_ranks):
        raise ValueError(
            f"dmuon: a DTensor of shape {tuple(t.shape)} lives on a mesh of ranks {mesh_ranks}, "
            f"but the optimizer's group has ranks {list(group_ranks)}. Give all matrices a mesh "
            f"spanning the group, or pass the mesh's group (state['group']) to the config.")
    for placement in t.placements:
        dim = getattr(placement, "dim", None)
        if dim is not None and dim not in (0, 1, -1, -2):
            raise ValueError(f"dmuon: placement {placement!r} shards dim {dim} of a 2-D matrix")
    slices = []
    for g in group_ranks:
        coords = [int(c) for c in (grid == int(g)).nonzero()[0].tolist()]
        slices.append(tuple(placement_runs(t.shape, t.placements, grid.shape, coords)))
    return MatrixLayout.build(tuple(t.shape), slices)
