"""Inventory-shaped models for ``bench/rank_view.py``: the Muon matrices of a model inventory
(or ``blocks`` units of K square matrices), one FSDP2 unit per layer, each matrix one matmul at
its real shape."""

from __future__ import annotations

import math

import torch
from torch import nn


class _InventoryBlock(nn.Module):
    """One unit of an inventory-shaped model: the matrices of one layer, each applied to the
    leading ``cols`` features of the block's input, the outputs summed into ``width`` features
    (zero-padded). Compute is one matmul per matrix at its real shape."""

    def __init__(self, shapes: list[tuple[int, int]], width: int) -> None:
        super().__init__()
        self.shapes = shapes
        self.width = width
        self.mats = nn.ParameterList(nn.Parameter(torch.randn(r, c) / math.sqrt(c)) for r, c in shapes)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x
        h = self.norm(x)
        for w, (r, c) in zip(self.mats, self.shapes):
            y = h[..., :c] @ w.t()
            out = out + nn.functional.pad(y, (0, self.width - r))
        return out


class InventoryModel(nn.Module):
    """A model with the given Muon matrices, one FSDP2 unit per layer (matrices grouped by the
    layer index in their name, or ``per_block`` at a time), for inventory-shaped rank views."""

    def __init__(self, inventory: list[tuple[str, tuple[int, int]]], per_block: int | None = None) -> None:
        super().__init__()
        import re

        groups: dict[str, list[tuple[int, int]]] = {}
        for i, (fqn, shape) in enumerate(inventory):
            m = re.search(r"^(.*?layers\.\d+)\.", fqn)
            key = str(i // per_block) if per_block else (m.group(1) if m else fqn.rsplit(".", 1)[0])
            groups.setdefault(key, []).append(shape)
        self.width = max(max(r, c) for _, (r, c) in inventory)
        self.embed = nn.Parameter(torch.randn(self.width) * 0.02)  # an AdamW parameter
        self.blocks = nn.ModuleList(_InventoryBlock(s, self.width) for s in groups.values())

    def shardable_blocks(self) -> list[nn.Module]:
        return list(self.blocks)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        x = batch["x"] + self.embed
        for block in self.blocks:
            x = block(x)
        return (x.float() ** 2).mean()


def blocks_inventory(blocks: int, per_block: int, width: int) -> list[tuple[str, tuple[int, int]]]:
    """``blocks`` layers of ``per_block`` square ``width`` matrices (for the ops-scaling check)."""
    return [(f"layers.{b}.m{k}.weight", (width, width)) for b in range(blocks) for k in range(per_block)]
