"""Scaled-down views of the canonical model inventories in :mod:`dmuon.balance.inventories`.

The shapes come from the public configs (Pi0 = PaliGemma's Gemma-2B + a Gemma action expert +
SigLIP So400m; Qwen2.5-7B); see that module. Benchmarks on CPU shrink them so they cannot rot.
"""

from __future__ import annotations

import math
import re

from dmuon.balance.inventories import inventory as _full_inventory

INVENTORY_NAMES = ("pi0", "qwen2.5-7b")
_LAYER = re.compile(r"\.layers\.(\d+)\.")


def inventory(name: str, *, scale: int = 1, max_layers: int | None = None) -> list[tuple[str, tuple[int, int]]]:
    """The Muon matrices of model ``name`` as ``(fqn, (rows, cols))``, in model order.

    Args:
        name: one of :data:`INVENTORY_NAMES`.
        scale: divide every dimension by this (ceil, >= 1) for scaled-down smoke runs.
        max_layers: keep only layers ``0 .. max_layers - 1`` of every stack (``None``: all).

    Raises:
        ValueError: unknown ``name`` or ``scale < 1``.
    """
    if name not in INVENTORY_NAMES:
        raise ValueError(f"inventory: unknown model {name!r}; choose one of {INVENTORY_NAMES}.")
    if scale < 1:
        raise ValueError(f"inventory: scale must be >= 1; got {scale}.")
    out = []
    for fqn, (rows, cols) in _full_inventory(name):
        layer = _LAYER.search(fqn)
        if max_layers is not None and layer and int(layer.group(1)) >= max_layers:
            continue
        out.append((fqn, (max(1, math.ceil(rows / scale)), max(1, math.ceil(cols / scale)))))
    return out
