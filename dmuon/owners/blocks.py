"""Split Muon (per-head Muon): a :class:`Split` cuts a matrix into blocks, each orthogonalized
and lr-adjusted by its own shape, as ``torch.optim.Muon`` on every block (torchtitan's per-head
Muon, ``_adjust_muon_learning_rate`` on the ``[num_heads, head_dim, dim]`` view, PR #4078).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from dmuon.owners.attention import find_attention
from dmuon.owners.slices import chunk_span
from dmuon.owners.update import split_orthogonalize


@dataclass(frozen=True, slots=True, kw_only=True)
class Split:
    """How one matrix cuts into Newton-Schulz blocks.

    Attributes:
        sizes: block sizes along ``dim``, in order; they must add up to the matrix's size there.
        dim: 0 (row blocks, e.g. heads of a ``[heads * head_dim, dim]`` projection) or 1
            (column blocks).
    """

    sizes: tuple[int, ...]
    dim: int = 0

    def __post_init__(self) -> None:
        sizes = tuple(self.sizes) if isinstance(self.sizes, (tuple, list)) else None
        if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
            raise ValueError(f"dmuon: Split.sizes must be a non-empty tuple of positive ints, got "
                             f"{self.sizes!r}")
        object.__setattr__(self, "sizes", sizes)
        if self.dim not in (0, 1):
            raise ValueError(f"dmuon: Split.dim must be 0 (rows) or 1 (columns), got {self.dim!r}")

    @classmethod
    def heads(cls, num_heads: int, head_dim: int, *, dim: int = 0) -> "Split":
        """``num_heads`` blocks of ``head_dim`` rows (or columns)."""
        if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
            raise ValueError(f"dmuon: Split.heads needs a positive num_heads, got {num_heads!r}")
        return cls(sizes=(head_dim,) * num_heads, dim=dim)

    @classmethod
    def fused(cls, *parts: "Split | int") -> "Split":
        """Parts laid end to end along one dim: a :class:`Split` (its blocks) or an ``int`` (one
        block of that size). ``Split.fused(Split.heads(8, 64), Split.heads(2, 64), 128)``: a
        fused ``[q; k; v]`` with q and k per head and v whole."""
        dims = {p.dim for p in parts if isinstance(p, Split)}
        if len(dims) > 1:
            raise ValueError(f"dmuon: Split.fused parts split different dims {sorted(dims)}")
        sizes: list[int] = []
        for part in parts:
            sizes.extend(part.sizes if isinstance(part, Split) else (part,))
        return cls(sizes=tuple(sizes), dim=dims.pop() if dims else 0)

    def bounds(self) -> list[tuple[int, int]]:
        """``[start, stop)`` of every block along ``dim``."""
        out, start = [], 0
        for size in self.sizes:
            out.append((start, start + size))
            start += size
        return out

    def block_shape(self, index: int, shape: Sequence[int]) -> tuple[int, int]:
        """``(rows, cols)`` of block ``index`` of a matrix of ``shape``."""
        rows, cols = int(shape[0]), int(shape[1])
        return (self.sizes[index], cols) if self.dim == 0 else (rows, self.sizes[index])

    def check(self, fqn: str, shape: Sequence[int]) -> None:
        """Raise ``ValueError`` naming ``fqn`` unless the blocks tile ``shape`` along ``dim``."""
        if len(shape) != 2 or sum(self.sizes) != shape[self.dim]:
            raise ValueError(
                f"dmuon: split of parameter {fqn!r} (shape {tuple(shape)}): blocks {self.sizes} "
                f"along dim {self.dim} add up to {sum(self.sizes)}, not the matrix's "
                f"{shape[self.dim] if len(shape) == 2 else shape}; give sizes that tile it.")


def per_head_splits(model: nn.Module, records: Sequence[Any] = ()) -> dict[tuple[int, str], Split]:
    """Per-head splits of the q / k / v projections of every attention module
    :func:`dmuon.owners.attention.find_attention` recognizes, keyed by ``(id(module), attr)``
    of the weight (a fused weight: every head, in row order)."""
    blocks: dict[tuple[int, str], set[tuple[int, int]]] = {}
    for layout in find_attention(model, records):
        for ref in (layout.q, layout.k, layout.v):
            if ref is not None:
                blocks.setdefault((id(ref.module), ref.attr), set()).update(
                    (r, ref.head_dim) for r in ref.head_rows)
    return {key: Split(sizes=tuple(size for _, size in sorted(found)))
            for key, found in blocks.items()}


def resolve_splits(model: nn.Module, records: Sequence[Any], *, per_head: bool,
                   split: Mapping[Any, Split] | Callable[[str, tuple[int, ...]], Split | None] | None
                   ) -> dict[int, Split]:
    """The split of every dedicated record that has one, keyed by ``id(record)``, from
    ``dedicate_params``' ``per_head`` and ``split`` (``{fqn or parameter: Split}``, winning over
    ``per_head``, or a callable ``(fqn, full_shape) -> Split | None``).

    Raises:
        ValueError: ``per_head`` on a model with no attention module dmuon recognizes, a
            ``split`` key that names no dedicated matrix, a split that does not tile its
            matrix, a matrix that is an expert stack or already cut into row blocks
            (``fused_blocks``), or a value that is not a :class:`Split`.
    """
    if per_head and not find_attention(model, records):
        raise ValueError(
            f"dmuon: per_head=True but {type(model).__name__} has no attention module dmuon "
            f"recognizes (Hugging Face q_proj/k_proj/v_proj, nn.MultiheadAttention, torchtitan "
            f"wq/wk/wv or wqkv, a ViT qkv, q + kv; see docs/usage.md), so no matrix would be "
            f"split. Give the splits by name (split={{fqn: dmuon.Split.heads(num_heads, head_dim)}}) "
            f"or leave per_head=False.")
    by_slot = per_head_splits(model, records) if per_head else {}
    by_fqn: dict[str, Split] = {}
    call = None
    if callable(split) and not isinstance(split, Mapping):
        call = split
    elif split is not None:
        if not isinstance(split, Mapping):
            raise ValueError(f"dmuon: split must be a mapping {{fqn or parameter: Split}} or a "
                             f"callable (fqn, shape) -> Split | None; got {type(split).__name__}")
        names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        for rec in records:
            names.setdefault(id(rec.master), rec.fqn)
        known = {rec.fqn for rec in records}
        for key, value in split.items():
            fqn = key if isinstance(key, str) else getattr(key, "_dmuon_fqn", names.get(id(key)))
            if fqn not in known:
                raise ValueError(
                    f"dmuon: split names {key if isinstance(key, str) else 'a parameter'!r} "
                    f"({fqn!r}), which is not a dedicated matrix of this model; name one of "
                    f"{sorted(known)[:6]}{'...' if len(known) > 6 else ''}.")
            by_fqn[fqn] = value
    out: dict[int, Split] = {}
    for rec in records:
        found = by_fqn.get(rec.fqn)
        if found is None and call is not None:
            found = call(rec.fqn, tuple(rec.full_shape))
        if found is None:
            found = by_slot.get((id(rec.module), rec.attr))
        if found is None:
            continue
        if not isinstance(found, Split):
            raise ValueError(f"dmuon: the split of {rec.fqn!r} must be a dmuon.Split, got "
                             f"{type(found).__name__}")
        if (rec.stack is not None or rec.experts is not None
                or tuple(rec.matrix_shape) != tuple(rec.full_shape)):
            raise ValueError(
                f"dmuon: parameter {rec.fqn!r} is an expert stack or already cut into row blocks "
                f"(matrix {tuple(rec.matrix_shape)} of {tuple(rec.full_shape)}); a split applies to "
                f"a plain matrix. Drop it from fused_blocks, or give it no split.")
        found.check(rec.fqn, rec.full_shape)
        out[id(rec)] = found
    return out


def tp_rank_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """``(rank, size)`` in the TP group, ``(0, 1)`` without one."""
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _local_split(rec: Any, split: Split | None, rank: int, size: int) -> Split | None:
    """The blocks of this TP rank's slice when every TP slice of ``rec`` holds whole blocks
    (a colwise-sharded q/k/v split by heads); ``None`` otherwise (shapes only: ranks agree)."""
    if split is None or rec.tp_shard_dim != split.dim or size == 1:
        return None
    spans = [chunk_span(int(rec.full_shape[split.dim]), size, r) for r in range(size)]
    edges = {a for a, _ in split.bounds()} | {b for _, b in split.bounds()}
    if any(a == b for a, b in spans) or not {x for span in spans for x in span} <= edges:
        return None
    start, stop = spans[rank]
    return Split(sizes=tuple(b - a for a, b in split.bounds() if start <= a and b <= stop), dim=split.dim)


def tp_orthogonalizer(recs: Sequence[Any], splits: Sequence[Split | None], group: dist.ProcessGroup,
                      ns: Callable[[list[torch.Tensor]], list[torch.Tensor]],
                      exchange: Callable[..., list[torch.Tensor]]
                      ) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
    """Newton-Schulz of tensor-parallel slices, for :func:`dmuon.owners.update.muon_update_`: a
    slice holding whole blocks (:func:`_local_split`) is done on its own TP rank, every other
    matrix by its TP owner through ``exchange`` (:func:`dmuon.comm.exchange.orthogonalize_tp`).
    ``recs``: the owned records in plan order (alike on the TP ``group``), ``splits`` theirs.

    Returns a function from the slices' updates to their orthogonalized slices (same order and
    shapes), collective over ``group``.
    """
    rank, size = tp_rank_size(group)
    local = [_local_split(r, s, rank, size) for r, s in zip(recs, splits)]

    def run(updates: list[torch.Tensor]) -> list[torch.Tensor]:
        ortho: list[Any] = [None] * len(updates)
        here = [i for i, s in enumerate(local) if s is not None]
        for i, out in zip(here, split_orthogonalize([local[i] for i in here], None, ns)(
                [updates[i] for i in here])):
            ortho[i] = out
        rest = [i for i, s in enumerate(local) if s is None]
        mine = [splits[i] for i in rest if recs[i].tp_owner == rank]
        orthogonalize = split_orthogonalize(mine, None, ns)
        outs = exchange([updates[i] for i in rest], [recs[i] for i in rest], group, orthogonalize)
        for i, out in zip(rest, outs):
            ortho[i] = out
        return ortho

    return run
