"""How a dedicated parameter is one matrix ``[rows, cols]`` or a stack ``[E, rows, cols]`` of
expert matrices (leading dims flattened in C order; HF ``transformers`` 5.x, torchtitan), each
optionally cut into ``blocks`` equal row blocks: Newton-Schulz input ``[E * blocks, rows /
blocks, cols]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch
from torch import nn

#: attributes an expert module uses to declare how many experts its stacks hold (HF
#: ``Qwen3MoeExperts.num_experts``, torchtitan's ``GroupedExperts.num_experts``, ...)
EXPERT_COUNT_ATTRS = ("num_experts", "num_local_experts", "n_routed_experts", "n_experts")


@dataclass(frozen=True, slots=True)
class ParamLayout:
    """How one dedicated parameter of full ``shape`` (``(rows, cols)`` or ``(*lead, rows,
    cols)``) splits into Newton-Schulz matrices: ``blocks`` row blocks per stored matrix."""

    shape: tuple[int, ...]
    blocks: int = 1

    def local(self, ep: int) -> "ParamLayout":
        """One expert-parallel rank's part, ``[E / ep, ..., rows, cols]``, of a stack whose
        experts are split evenly over ``ep`` ranks; ``self`` for ``ep == 1``."""
        if ep == 1:
            return self
        return ParamLayout(shape=(self.shape[0] // ep,) + self.shape[1:], blocks=self.blocks)

    @property
    def is_stack(self) -> bool:
        """The parameter is a stack of matrices (more than 2 dims)."""
        return len(self.shape) > 2

    @property
    def count(self) -> int:
        """Stored matrices (experts): the product of the leading dims; 1 for a 2-D parameter."""
        return math.prod(self.shape[:-2])

    @property
    def matrix_shape(self) -> tuple[int, int]:
        """``(rows / blocks, cols)`` of one Newton-Schulz matrix."""
        return self.shape[-2] // self.blocks, self.shape[-1]

    def flat_view(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (the full parameter) as ``[count, rows, cols]`` (a view when contiguous)."""
        return t.reshape(self.count, self.shape[-2], self.shape[-1])


def param_layout(fqn: str, shape: Sequence[int], blocks: int = 1) -> ParamLayout:
    """Validate a selected parameter's shape and return its layout; ValueError for fewer than 2
    dims or ``blocks`` that do not divide the rows."""
    shape = tuple(int(s) for s in shape)
    if len(shape) < 2:
        raise ValueError(
            f"dmuon: parameter {fqn!r} has shape {shape}; Muon takes 2-D matrices or stacks of "
            f"them ([experts, rows, cols]). Pass predicate=... to leave it on AdamW.")
    if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 1 or shape[-2] % blocks:
        raise ValueError(
            f"dmuon: parameter {fqn!r} (shape {shape}) is to be split into {blocks!r} row blocks, "
            f"but its {shape[-2]} rows do not split into that many equal parts; give a block "
            f"count that divides the rows (1 keeps the matrix whole).")
    return ParamLayout(shape=shape, blocks=blocks)


def declared_experts(module: nn.Module) -> int | None:
    """The expert count ``module`` declares (:data:`EXPERT_COUNT_ATTRS`), or ``None``."""
    for attr in EXPERT_COUNT_ATTRS:
        value = getattr(module, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def check_expert_stack(fqn: str, module: nn.Module, shape: Sequence[int]) -> None:
    """ValueError for a >2-D parameter whose leading dims are not experts: experts need a module
    declaring an expert count (:data:`EXPERT_COUNT_ATTRS`) equal to their product or to the
    first leading dim; a convolution's weight never is."""
    shape = tuple(int(s) for s in shape)
    if len(shape) <= 2:
        return
    if isinstance(module, nn.modules.conv._ConvNd):
        raise ValueError(
            f"dmuon: parameter {fqn!r} is the weight of a convolution ({type(module).__name__}, "
            f"shape {shape}); its leading dims are channels, not experts, and Muon does not "
            f"orthogonalize kernels. Pass predicate=... to leave it on AdamW.")
    experts = declared_experts(module)
    lead = math.prod(shape[:-2])
    if experts is None or experts not in (lead, shape[0]):
        found = ("declares no expert count" if experts is None
                 else f"declares {experts} experts")
        raise ValueError(
            f"dmuon: parameter {fqn!r} has shape {shape}, but its module "
            f"{type(module).__name__} {found} matching the leading dims {shape[:-2]} (product "
            f"{lead}); dmuon treats a >2-D parameter as a stack of expert matrices "
            f"[experts, rows, cols] only when the module says so. Set "
            f"module.num_experts = {shape[0]} if the leading dim does count experts, or pass "
            f"predicate=... to leave it on AdamW.")


def expert_module_names(model: nn.Module) -> set[str]:
    """Names of the experts kept as separate modules: the children of an ``nn.ModuleList``
    held under an attribute named ``experts`` or by a module that declares an expert count."""
    names: set[str] = set()
    for name, module in model.named_modules():
        for attr, child in module.named_children():
            declares = attr == "experts" or declared_experts(module) is not None
            if isinstance(child, nn.ModuleList) and declares:
                prefix = f"{name}.{attr}" if name else attr
                names.update(f"{prefix}.{i}" for i in range(len(child)))
    return names


def in_expert(module_name: str, experts: set[str]) -> bool:
    """Whether the module ``module_name`` is (inside) one of ``experts``
    (:func:`expert_module_names`)."""
    parts = module_name.split(".")
    return any(".".join(parts[:k]) in experts for k in range(1, len(parts) + 1))


#: mesh dimension names of expert parallelism (torchtitan's ``"ep"``)
EP_NAMES = ("ep",)


def expert_parallel_size(fqn: str, param: torch.Tensor, ep_name: str | None, ep_size: int) -> int:
    """How many expert-parallel ranks split a selected parameter's experts: 1 off the ``"ep"``
    mesh dimension, ``ep_size`` for an expert stack ``Shard(0)`` over it (torchtitan's
    ``ExpertParallel``). ``ep_name``, ``ep_size``: ``dedicate_params``' mesh's ``"ep"``
    dimension (``None``, 1 without one).

    Raises ValueError for a parameter on an ``"ep"`` mesh when the given mesh has none, another
    ``"ep"`` size, anything but a stack ``Shard(0)`` on ``"ep"``, or experts ``ep`` does not divide.
    """
    mesh = getattr(param, "device_mesh", None)
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ()) if mesh is not None else ()
    on_ep = [i for i, n in enumerate(names) if n in EP_NAMES]
    if not on_ep:
        return 1
    dim = on_ep[0]
    shape = tuple(int(s) for s in param.shape)
    if ep_name is None:
        raise ValueError(
            f"dmuon: parameter {fqn!r} (shape {shape}) is placed on a mesh with an expert-parallel "
            f"dimension {names}, but dedicate_params was given a mesh without one; pass the mesh "
            f"the experts live on, e.g. the ('efsdp', 'ep') mesh torchtitan shards them over, or "
            f"predicate=... to leave the parameter on AdamW.")
    size = int(mesh.shape[dim])
    if size != ep_size:
        raise ValueError(
            f"dmuon: parameter {fqn!r} is split over an expert-parallel dimension of {size} ranks "
            f"but the mesh given to dedicate_params has {ep_size} on {ep_name!r}; pass the mesh the "
            f"experts were distributed on.")
    placement = param.placements[dim]
    if len(shape) < 3 or type(placement).__name__ != "Shard" or getattr(placement, "dim", None) != 0:
        raise ValueError(
            f"dmuon: parameter {fqn!r} (shape {shape}) has placement {placement!r} on the "
            f"expert-parallel dimension {names[dim]!r}; dmuon takes expert stacks [experts, rows, "
            f"cols] sharded Shard(0) over it (torchtitan's ExpertParallel). Pass predicate=... to "
            f"leave it on AdamW; if it is a dense parameter fully_shard-ed over a mesh dimension "
            f"named 'ep', give the dense blocks a mesh of their own name (e.g. 'dp').")
    if shape[0] % size:
        fits = [d for d in range(1, shape[0] + 1) if shape[0] % d == 0]
        raise ValueError(
            f"dmuon: expert stack {fqn!r} (shape {shape}) has {shape[0]} experts, which the "
            f"expert-parallel dimension {names[dim]!r} of {size} ranks does not divide (ranks "
            f"would hold different numbers of experts); use an 'ep' size that divides "
            f"{shape[0]} ({fits}), or pass predicate=... to leave the parameter on AdamW.")
    return size


@dataclass(frozen=True, slots=True)
class OwnerItem:
    """What the balancer places: a 2-D parameter (``index`` None), or one stored matrix
    (expert ``index``) of a stack, holding ``matrices`` Newton-Schulz matrices (its row blocks)
    of ``matrix_shape``."""

    fqn: str
    index: int | None
    matrix_shape: tuple[int, int]
    matrices: int = 1


def owner_items(layouts: Iterable[tuple[str, ParamLayout]]) -> list[OwnerItem]:
    """Every parameter's owner items, in model order (a stack's experts in index order)."""
    items: list[OwnerItem] = []
    for fqn, layout in layouts:
        if layout.is_stack:
            items += [OwnerItem(fqn, e, layout.matrix_shape, layout.blocks) for e in range(layout.count)]
        else:
            items.append(OwnerItem(fqn, None, layout.matrix_shape, layout.blocks))
    return items


@dataclass(frozen=True, slots=True)
class OwnerRange:
    """A run of one parameter's owner items with one owner (and bucket): one plan entry.
    ``experts``: ``(start, stop)`` over its flattened leading dims (``None`` for a 2-D
    parameter); ``items``: the items' positions in the :func:`owner_items` list."""

    fqn: str
    experts: tuple[int, int] | None
    owner: int
    items: tuple[int, ...] = field(default=())
    bucket: int | None = None


def collapse_ranges(items: Sequence[OwnerItem], owners: Sequence[int],
                    buckets: Sequence[int] | None = None) -> list[OwnerRange]:
    """Solved items back to plan entries: one expert range per owner of a stack, in the order
    owners first appear (its experts cost alike: no load changes); with ``buckets`` only
    neighbouring items with the same owner and bucket merge."""
    ranges: list[OwnerRange] = []
    i = 0
    while i < len(items):
        j = i
        while j < len(items) and items[j].fqn == items[i].fqn:
            j += 1
        if items[i].index is None:
            ranges.append(OwnerRange(items[i].fqn, None, int(owners[i]), (i,),
                                     None if buckets is None else int(buckets[i])))
        elif buckets is not None:
            start = i
            for k in range(i + 1, j + 1):
                if k == j or owners[k] != owners[start] or buckets[k] != buckets[start]:
                    ranges.append(OwnerRange(items[i].fqn, (start - i, k - i), int(owners[start]),
                                             tuple(range(start, k)), int(buckets[start])))
                    start = k
        else:
            by_owner: dict[int, list[int]] = {}
            for k in range(i, j):
                by_owner.setdefault(int(owners[k]), []).append(k)
            pos = 0
            for owner, members in by_owner.items():
                ranges.append(OwnerRange(items[i].fqn, (pos, pos + len(members)), owner, tuple(members)))
                pos += len(members)
        i = j
    return ranges


@dataclass(eq=False)
class StackSlot:
    """The module slot of a stack split over several owner ranges, each a record of its own.
    ``show("compute")`` registers the concatenation of the ranges' compute weights (autograd
    splits the gradient back); ``show("master")`` the first range's master.

    ``shape``: the full parameter shape (this rank's local experts under expert parallelism);
    ``records``: the ranges', in expert order; ``wrap``: the concatenated stack to what the
    module computes with (the ``"ep"`` DTensor, :func:`dmuon.hooks.tp_placements.as_compute_param`).
    """

    module: nn.Module
    attr: str
    shape: tuple[int, ...]
    records: list = field(default_factory=list)
    wrap: Any = None

    def show(self, which: str) -> None:
        if which == "compute":
            # Inside the autograd engine (pre-backward) grad mode is off, but a forward that
            # activation checkpointing recomputes there uses this tensor: it must keep the graph.
            in_backward = torch._C._current_graph_task_id() != -1
            with torch.set_grad_enabled(torch.is_grad_enabled() or in_backward):
                whole = torch.cat([rec.compute for rec in self.records]).view(self.shape)
                if self.wrap is not None:
                    whole = self.wrap(whole)
            self.module._parameters[self.attr] = whole  # a non-leaf: autograd reaches the ranges
        else:
            self.module._parameters[self.attr] = self.records[0].master
