"""The XOR owner layout over the ``nodes x gpus_per_node`` grid (DMuon's "XOR rule").

Global rank ``= node * gpus_per_node + gpu``. Matrix ``j`` (its index inside its layer,
forward order) of layer ``l`` ideally lives on

    gpu(l, j)  = (j mod G) (+) (l mod G)
    node(l, j) = (floor(j / G) mod N) (+) (l mod N)

where ``(+)`` is XOR when the size is a power of two, else addition modulo the size. Both are
group operations, so a layer's first ``N*G`` matrices go to distinct ranks, and layers ``l`` and
``l + 1`` put matrix ``j`` on a different GPU index and node whenever ``G, N >= 2``.
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
    """New owners per matrix: ``owners`` rearranged inside each class to follow the XOR layout,
    every rank's per-class counts (hence load and memory) kept.

    In forward order, each matrix takes, among the ranks with a slot of its class left, the one
    that minimizes, in order: reusing a rank already owning its group; sharing the node, then
    the GPU index, with the same-index matrix of the previous group; differing from
    :func:`xor_owner`; the rank number. ``groups`` are layer ids increasing in forward order.
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
