"""Canonical Muon matrix inventories of the models dmuon is measured on.

Each inventory lists the dedicated matrices as ``(fqn, (out_features, in_features))`` (an
``nn.Linear.weight``'s shape), or ``(fqn, (experts, rows, cols))`` for an expert stack, in
forward order with Hugging Face names. Embeddings, LM head, norms, biases and conv patch
embeddings stay on AdamW, as in Muon practice.

Sources (public configs):
    * Pi0 (Physical Intelligence, openpi): PaliGemma = SigLIP So400m/14 vision tower (width
      1152, MLP 4304, 27 layers, 16 heads x 72) + linear projector 1152 -> 2048 + Gemma-2B
      (width 2048, MLP 16384, 18 layers, 8 heads, 1 KV head, head dim 256); action expert =
      Gemma-300M variant (width 1024, MLP 4096, 18 layers, 8 heads, 1 KV head, head dim 256, so
      q: 8*256 x 1024, k/v: 256 x 1024, o: 1024 x 8*256); pi0 projections action_in/out
      (action dim 32), state_proj (32 -> 1024), action_time_mlp_in (2048 -> 1024),
      action_time_mlp_out (1024 -> 1024).
    * Qwen2.5-7B (Qwen/Qwen2.5-7B config.json): hidden 3584, intermediate 18944, 28 layers,
      28 heads, 4 KV heads, head dim 128 (q/o: 3584 x 3584, k/v: 512 x 3584).
    * Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B config.json): hidden 2048, 48 layers, 32 heads, 4 KV
      heads, head dim 128, 128 experts (8 active) of moe_intermediate 768, router
      ``mlp.gate.weight`` [128, 2048]. Experts as Hugging Face ``transformers`` 5.x stores them:
      ``mlp.experts.gate_up_proj`` [128, 1536, 2048] and ``mlp.experts.down_proj``
      [128, 2048, 768], one Muon matrix per expert (:mod:`dmuon.owners.stacks`).
    * Moonlight-16B-A3B (moonshotai/Moonlight-16B-A3B config.json, DeepSeek-V3 architecture):
      hidden 2048, 27 layers (layer 0 dense, intermediate 11264), MLA with 16 heads, no q LoRA,
      kv_lora_rank 512, qk nope/rope 128/64, v 128; 64 routed experts (6 active) of
      moe_intermediate 1408 and 2 shared experts (one MLP of 2 x 1408).
    * Kimi K2 (moonshotai/Kimi-K2-Instruct config.json, DeepSeek-V3 architecture): hidden 7168,
      61 layers (layer 0 dense, intermediate 18432), MLA with 64 heads, q_lora_rank 1536,
      kv_lora_rank 512, qk nope/rope 128/64, v 128; 384 routed experts (8 active) of
      moe_intermediate 2048 and 1 shared expert.
"""

from __future__ import annotations

import math
import re
from typing import Callable

Inventory = list[tuple[str, tuple[int, ...]]]  # (rows, cols), or (experts, rows, cols)


def _gqa_attention(p: str, width: int, heads: int, kv_heads: int, head_dim: int) -> Inventory:
    """The four projections of a grouped-query attention layer at prefix ``p``."""
    return [
        (f"{p}.self_attn.q_proj.weight", (heads * head_dim, width)),
        (f"{p}.self_attn.k_proj.weight", (kv_heads * head_dim, width)),
        (f"{p}.self_attn.v_proj.weight", (kv_heads * head_dim, width)),
        (f"{p}.self_attn.o_proj.weight", (width, heads * head_dim)),
    ]


def _gemma_layers(prefix: str, layers: int, width: int, mlp: int, heads: int, kv_heads: int,
                  head_dim: int) -> Inventory:
    out: Inventory = []
    for i in range(layers):
        p = f"{prefix}.layers.{i}"
        out += _gqa_attention(p, width, heads, kv_heads, head_dim) + [
            (f"{p}.mlp.gate_proj.weight", (mlp, width)),
            (f"{p}.mlp.up_proj.weight", (mlp, width)),
            (f"{p}.mlp.down_proj.weight", (width, mlp)),
        ]
    return out


def _siglip_layers(prefix: str, layers: int, width: int, mlp: int) -> Inventory:
    out: Inventory = []
    for i in range(layers):
        p = f"{prefix}.encoder.layers.{i}"
        out += [(f"{p}.self_attn.{n}.weight", (width, width))
                for n in ("q_proj", "k_proj", "v_proj", "out_proj")]
        out += [(f"{p}.mlp.fc1.weight", (mlp, width)), (f"{p}.mlp.fc2.weight", (width, mlp))]
    return out


def _pi0(*, vit_width, vit_mlp, vit_layers, lm_width, lm_mlp, lm_layers, heads, head_dim,
         ax_width, ax_mlp, action_dim=32) -> Inventory:
    inv = _siglip_layers("paligemma.vision_tower", vit_layers, vit_width, vit_mlp)
    inv.append(("paligemma.multi_modal_projector.linear.weight", (lm_width, vit_width)))
    inv += _gemma_layers("paligemma.language_model", lm_layers, lm_width, lm_mlp, heads, 1,
                         head_dim)
    inv += _gemma_layers("gemma_expert.model", lm_layers, ax_width, ax_mlp, heads, 1, head_dim)
    inv += [
        ("state_proj.weight", (ax_width, action_dim)),
        ("action_in_proj.weight", (ax_width, action_dim)),
        ("action_time_mlp_in.weight", (ax_width, 2 * ax_width)),
        ("action_time_mlp_out.weight", (ax_width, ax_width)),
        ("action_out_proj.weight", (action_dim, ax_width)),
    ]
    return inv


def pi0() -> Inventory:
    """Pi0 (PaliGemma 3B + 300M action expert): 420 matrices."""
    return _pi0(vit_width=1152, vit_mlp=4304, vit_layers=27, lm_width=2048, lm_mlp=16384,
                lm_layers=18, heads=8, head_dim=256, ax_width=1024, ax_mlp=4096)


def pi0_tiny() -> Inventory:
    """Pi0's structure scaled down ~16x in width and to 2-3 layers, for CPU tests and demos."""
    return _pi0(vit_width=72, vit_mlp=272, vit_layers=3, lm_width=128, lm_mlp=1024,
                lm_layers=2, heads=2, head_dim=64, ax_width=64, ax_mlp=256, action_dim=8)


def qwen2_5_7b() -> Inventory:
    """Qwen2.5-7B: 196 matrices (lm_head excluded, as for every embedding/head)."""
    return _gemma_layers("model", 28, 3584, 18944, 28, 4, 128)


def qwen3_30b_a3b() -> Inventory:
    """Qwen3-30B-A3B: 48 layers of attention (4 matrices), router and two expert stacks of 128:
    12,528 Newton-Schulz matrices."""
    width, heads, kv_heads, head_dim, experts, inter = 2048, 32, 4, 128, 128, 768
    out: Inventory = []
    for i in range(48):
        p = f"model.layers.{i}"
        out += _gqa_attention(p, width, heads, kv_heads, head_dim) + [
            (f"{p}.mlp.gate.weight", (experts, width)),
            (f"{p}.mlp.experts.gate_up_proj", (experts, 2 * inter, width)),
            (f"{p}.mlp.experts.down_proj", (experts, width, inter)),
        ]
    return out


def _deepseek_v3(*, width, layers, dense_layers, dense_inter, heads, q_lora, kv_lora, nope, rope, v,
                 experts, inter, shared) -> Inventory:
    out: Inventory = []
    for i in range(layers):
        p = f"model.layers.{i}"
        attn = f"{p}.self_attn"
        if q_lora:
            out += [(f"{attn}.q_a_proj.weight", (q_lora, width)),
                    (f"{attn}.q_b_proj.weight", (heads * (nope + rope), q_lora))]
        else:
            out.append((f"{attn}.q_proj.weight", (heads * (nope + rope), width)))
        out += [(f"{attn}.kv_a_proj_with_mqa.weight", (kv_lora + rope, width)),
                (f"{attn}.kv_b_proj.weight", (heads * (nope + v), kv_lora)),
                (f"{attn}.o_proj.weight", (width, heads * v))]
        if i < dense_layers:
            out += [(f"{p}.mlp.gate_proj.weight", (dense_inter, width)),
                    (f"{p}.mlp.up_proj.weight", (dense_inter, width)),
                    (f"{p}.mlp.down_proj.weight", (width, dense_inter))]
            continue
        out += [(f"{p}.mlp.gate.weight", (experts, width)),
                (f"{p}.mlp.experts.gate_up_proj", (experts, 2 * inter, width)),
                (f"{p}.mlp.experts.down_proj", (experts, width, inter)),
                (f"{p}.mlp.shared_experts.gate_proj.weight", (shared * inter, width)),
                (f"{p}.mlp.shared_experts.up_proj.weight", (shared * inter, width)),
                (f"{p}.mlp.shared_experts.down_proj.weight", (width, shared * inter))]
    return out


def moonlight_16b_a3b() -> Inventory:
    """Moonlight-16B-A3B (DeepSeek-V3 shaped): 26 MoE layers of 64 experts: 3,543 matrices."""
    return _deepseek_v3(width=2048, layers=27, dense_layers=1, dense_inter=11264, heads=16, q_lora=0,
                        kv_lora=512, nope=128, rope=64, v=128, experts=64, inter=1408, shared=2)


def kimi_k2() -> Inventory:
    """Kimi K2 (DeepSeek-V3 shaped, 1T parameters): 60 MoE layers of 384 experts: 46,628
    matrices."""
    return _deepseek_v3(width=7168, layers=61, dense_layers=1, dense_inter=18432, heads=64, q_lora=1536,
                        kv_lora=512, nope=128, rope=64, v=128, experts=384, inter=2048, shared=1)


def matrix_count(inv: Inventory) -> int:
    """Newton-Schulz matrices of an inventory (a stack counts its experts)."""
    return sum(math.prod(shape[:-2]) for _, shape in inv)


INVENTORIES: dict[str, Callable[[], Inventory]] = {
    "pi0": pi0,
    "pi0-tiny": pi0_tiny,
    "qwen2.5-7b": qwen2_5_7b,
    "qwen3-30b-a3b": qwen3_30b_a3b,
    "moonlight-16b-a3b": moonlight_16b_a3b,
    "kimi-k2": kimi_k2,
}


def inventory(name: str) -> Inventory:
    """The named inventory; ValueError for an unknown name (listing the known ones)."""
    try:
        return INVENTORIES[name]()
    except KeyError:
        raise ValueError(
            f"dmuon: unknown inventory {name!r}; known: {sorted(INVENTORIES)}"
        ) from None


_LAYER = re.compile(r"^(.*?\.\d+)\.")


def layer_groups(fqns: list[str]) -> list[int]:
    """Publish-group id per matrix name (forward order) under the usual FSDP2 wrapping (each
    numbered layer, then the root): one id per numbered module (``...layers.7.``) from 0 in
    order of first appearance, one for the root block. The inventory-side twin of
    :func:`dmuon.hooks.fsdp_adapter.publish_block`.
    """
    ids: dict[str, int] = {}
    out = []
    for fqn in fqns:
        m = _LAYER.match(fqn)
        key = m.group(1) if m else ""  # "" is the root block
        out.append(ids.setdefault(key, len(ids)))
    return out
