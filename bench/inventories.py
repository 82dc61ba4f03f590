"""Matrix inventories (the 2-D weights Muon orthogonalizes) of the models the benchmarks use.

``inventory(name)`` returns ``(fqn, (rows, cols))`` pairs in PyTorch ``nn.Linear`` layout
(``[out_features, in_features]``). Embeddings, norms, biases, the LM head and convolutional patch
embeddings are left out: they go to AdamW under Muon. The FQNs follow the Hugging Face module
names of each model; they are labels for reports, not keys into a checkpoint.

Model sizes (from the issue and the models' configs):

* ``"pi0"``: PaliGemma's Gemma-2B backbone (width 2048, MLP 16384, 18 layers, 8 query heads,
  1 KV head, head dim 256), the action expert (width 1024, MLP 4096, 18 layers; it attends
  jointly with the backbone, so it has the same 8 x 256 query and 1 x 256 KV projections), and
  the SigLIP So400m vision tower (width 1152, MLP 4304, 27 layers, full-width q/k/v/o).
* ``"qwen2.5-7b"``: hidden 3584, intermediate 18944, 28 layers, 28 query heads, 4 KV heads,
  head dim 128.

``scale`` divides every width (rounding up, at least 1) and ``max_layers`` caps the layer count;
the CPU smoke run of the benchmarks uses them so the inventory cannot rot.
"""

from __future__ import annotations

import math

__all__ = ["INVENTORY_NAMES", "inventory"]

INVENTORY_NAMES = ("pi0", "qwen2.5-7b")


def _decoder(prefix: str, layers: int, width: int, mlp: int, heads: int, kv_heads: int, head_dim: int):
    out = []
    for i in range(layers):
        p = f"{prefix}.layers.{i}"
        out += [
            (f"{p}.self_attn.q_proj.weight", (heads * head_dim, width)),
            (f"{p}.self_attn.k_proj.weight", (kv_heads * head_dim, width)),
            (f"{p}.self_attn.v_proj.weight", (kv_heads * head_dim, width)),
            (f"{p}.self_attn.o_proj.weight", (width, heads * head_dim)),
            (f"{p}.mlp.gate_proj.weight", (mlp, width)),
            (f"{p}.mlp.up_proj.weight", (mlp, width)),
            (f"{p}.mlp.down_proj.weight", (width, mlp)),
        ]
    return out


def _vit(prefix: str, layers: int, width: int, mlp: int):
    out = []
    for i in range(layers):
        p = f"{prefix}.encoder.layers.{i}"
        out += [(f"{p}.self_attn.{n}.weight", (width, width)) for n in ("q_proj", "k_proj", "v_proj", "out_proj")]
        out += [(f"{p}.mlp.fc1.weight", (mlp, width)), (f"{p}.mlp.fc2.weight", (width, mlp))]
    return out


def inventory(name: str, *, scale: int = 1, max_layers: int | None = None) -> list[tuple[str, tuple[int, int]]]:
    """The Muon matrices of model ``name`` as ``(fqn, (rows, cols))``.

    Args:
        name: one of :data:`INVENTORY_NAMES`.
        scale: divide every width by this (ceil, >= 1) for scaled-down smoke runs.
        max_layers: cap on the layers of every stack (``None``: the real count).

    Returns:
        A list of ``(fqn, (rows, cols))`` in model order.

    Raises:
        ValueError: unknown ``name`` or ``scale < 1``.
    """
    if scale < 1:
        raise ValueError(f"inventory: scale must be >= 1; got {scale}.")
    s = lambda v: max(1, math.ceil(v / scale))  # noqa: E731
    cap = lambda n: n if max_layers is None else min(n, max_layers)  # noqa: E731
    if name == "pi0":
        return (
            _decoder("paligemma.language_model", cap(18), s(2048), s(16384), 8, 1, s(256))
            + _decoder("gemma_expert.model", cap(18), s(1024), s(4096), 8, 1, s(256))
            + _vit("paligemma.vision_tower.vision_model", cap(27), s(1152), s(4304))
        )
    if name == "qwen2.5-7b":
        return _decoder("model", cap(28), s(3584), s(18944), 28, 4, s(128))
    raise ValueError(f"inventory: unknown model {name!r}; choose one of {INVENTORY_NAMES}.")
