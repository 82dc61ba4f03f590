"""The XOR owner layout over the ``nodes x gpus_per_node`` grid (DMuon's "XOR rule").

Global rank ``= node * gpus_per_node + gpu``. Matrix ``j`` (its index inside its layer,
forward order) of layer ``l`` ideally lives on

    gpu(l, j)  = (j mod G) (+) (l mod G)
    node(l, j) = (floor(j / G) mod N) (+) (l mod N)

where ``(+)`` is XOR when the size (``G`` or ``N``) is a power of two, else addition modulo the
size. Both are group operations, so for a fixed ``l`` the map ``j -> rank`` is a bijection on
the first ``N*G`` matrices (a layer spreads over distinct ranks), and layers ``l`` and ``l + 1``
put matrix ``j`` on a different GPU index and node whenever ``G, N >= 2``: neighbouring layers'
collectives leave from different GPUs and cross different NICs.

The solver fixes how many matrices of each class every rank owns (that alone sets the loads);
:func:`apply_layout` then chooses which matrices of a class go to which of those ranks.
"""

from __future__ import annotations

from typing import Hashable, Sequence


def _combine(a: int, b: int, size: int) -> int:
    if size & (size - 1) == 0:  # power of two: XOR stays inside range(size)
        return (a ^ b) % size
    return (a + b) % size


def xor_owner(layer: int, index: int, nodes: int, gpus_per_node: int) -> int:
    """Global rank the XOR rule gives matrix ``index >= 0`` of layer ``layer >= 0``."""
    gpu = _combine(index % gpus_per_node, layer % gpus_per_node, gpus_per_node)
    node = _combine((index // gpus_per_node) % nodes, layer % nodes, nodes)
    return node * gpus_per_node + gpu


def apply_layout(
    owners: Sequence[int],
    classes: Sequence[Hashable],
    groups: Sequence[int],
    nodes: int,
    gpus_per_node: int,
) -> tuple[int, ...]:
    """Rearrange owners inside each class to follow the XOR layout, keeping every rank's
    per-class counts (hence its load and memory) exactly.

    Matrices are placed in input (forward) order; each takes, among the ranks that still hold a
    slot of its class, the one that minimizes, in this order: reusing a rank already owning a
    matrix of the same group; sharing the node, then the GPU index, with the same-index matrix
    of the previous group; differing from :func:`xor_owner`; the rank number.

    Args:
        owners: owner per matrix from the solver.
        classes: per-matrix class (matrices of one class are interchangeable).
        groups: per-matrix layer id, increasing in forward order.
        nodes: number of nodes ``N``.
        gpus_per_node: GPUs per node ``G``; every owner is in ``range(N * G)``.

    Returns:
        New owner per matrix, input order.
    """
    world = nodes * gpus_per_node
    slots: dict[Hashable, list[int]] = {}
    for r, s in zip(owners, classes):
        slots.setdefault(s, [0] * world)[r] += 1
    position: dict[int, int] = {}
    index = []
    for g in groups:
        index.append(position.get(g, 0))
        position[g] = index[-1] + 1
    order_of_group = {g: k for k, g in enumerate(dict.fromkeys(groups))}
    owner_at: dict[tuple[int, int], int] = {}
    in_group: dict[int, set[int]] = {}
    out = [0] * len(owners)
    for i, (s, g) in enumerate(zip(classes, groups)):
        layer, j = order_of_group[g], index[i]
        ideal = xor_owner(layer, j, nodes, gpus_per_node)
        prev = owner_at.get((layer - 1, j))
        used = in_group.setdefault(g, set())
        free = slots[s]

        def penalty(r: int) -> tuple:
            node_clash = prev is not None and r // gpus_per_node == prev // gpus_per_node
            gpu_clash = prev is not None and r % gpus_per_node == prev % gpus_per_node
            return (r in used, node_clash, gpu_clash, r != ideal, r)

        best = min((r for r in range(world) if free[r]), key=penalty)
        free[best] -= 1
        out[i] = best
        used.add(best)
        owner_at[(layer, j)] = best
    return tuple(out)
