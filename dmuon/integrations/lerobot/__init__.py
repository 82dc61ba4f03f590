"""dmuon for LeRobot's policies (pi0, pi05, SmolVLA, ACT, diffusion) under FSDP2 (recipe:
docs/integrations.md): :func:`fully_shard_policy`, ``dmuon.dedicate_params(policy, mesh)``,
``dmuon.Muon(policy, ...)``, then train with ``policy(batch)``; :mod:`.train` runs LeRobot's
own training script this way.

The FSDP2 units are the modules LeRobot's code *calls* (FSDP2 gathers in a unit's forward
pre-hook): pi0, pi05 and SmolVLA call a decoder layer's parts directly, so their units are each
decoder layer's ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` and ``mlp``, and each
vision-encoder layer; ACT's are its encoder / decoder layers and ResNet blocks, diffusion's its
residual and ResNet blocks.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

import dmuon
from dmuon.hooks.dedicate import declare_predicate
from dmuon.integrations.lerobot.attention import record_attention

__all__ = ["POLICY_TYPES", "fsdp_units", "fully_shard_policy", "predicate", "record_attention"]

# ResNet blocks (torchvision) of ACT's and diffusion's vision backbones.
_RESNET_BLOCKS = ("BasicBlock", "Bottleneck")


def _decoder_units(language_models: list[nn.Module]) -> list[nn.Module]:
    units: list[nn.Module] = []
    for lm in language_models:
        for layer in lm.layers:
            attn = layer.self_attn
            units += [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, layer.mlp]
    return units


def _pi_units(policy: nn.Module) -> list[nn.Module]:
    pwe = policy.model.paligemma_with_expert
    tower = pwe.paligemma.model.vision_tower  # a SiglipVisionModel; transformers < 5 nests it
    vision = list(getattr(tower, "vision_model", tower).encoder.layers)
    return vision + _decoder_units([pwe.paligemma.model.language_model, pwe.gemma_expert.model])


def _smolvla_units(policy: nn.Module) -> list[nn.Module]:
    vwe = policy.model.vlm_with_expert
    vlm = vwe.get_vlm_model()
    return list(vlm.vision_model.encoder.layers) + _decoder_units([vlm.text_model, vwe.lm_expert])


def _by_class(*names: str) -> Callable[[nn.Module], list[nn.Module]]:
    def units(policy: nn.Module) -> list[nn.Module]:
        return [m for m in policy.modules() if type(m).__name__ in names]
    return units


# policy.name (LeRobot's config type) -> the modules fully_shard_policy wraps, children first
_UNITS: dict[str, Callable[[nn.Module], list[nn.Module]]] = {
    "pi0": _pi_units,
    "pi05": _pi_units,
    "smolvla": _smolvla_units,
    "act": _by_class("ACTEncoderLayer", "ACTDecoderLayer", *_RESNET_BLOCKS),
    "diffusion": _by_class("DiffusionConditionalResidualBlock1d", *_RESNET_BLOCKS),
}
POLICY_TYPES = tuple(_UNITS)


def fsdp_units(policy: nn.Module) -> list[nn.Module]:
    """The modules :func:`fully_shard_policy` makes FSDP2 units of ``policy`` (a LeRobot
    ``PreTrainedPolicy`` whose ``name`` is in :data:`POLICY_TYPES`), in forward order.

    Raises:
        ValueError: an unknown policy type (the message says how to shard by hand).
    """
    name = getattr(policy, "name", None) or getattr(getattr(policy, "config", None), "type", None)
    if name not in _UNITS:
        raise ValueError(
            f"dmuon: fully_shard_policy knows LeRobot policy types {', '.join(POLICY_TYPES)}; "
            f"got {type(policy).__name__} (type {name!r}). Shard it by hand: call "
            f"torch.distributed.fsdp.fully_shard on each module its forward code calls "
            f"(a transformer layer, or a layer's projections and MLP where the code calls those "
            f"directly), then on the policy itself, and pass the policy to "
            f"dmuon.dedicate_params")
    return _UNITS[name](policy)


def fully_shard_policy(policy: nn.Module, mesh: Any, *, root_kwargs: dict[str, Any] | None = None,
                       **fully_shard_kwargs: Any) -> nn.Module:
    """FSDP2 ``fully_shard`` on :func:`fsdp_units`, then on the policy; declares :func:`predicate`
    the policy's default for :func:`dmuon.dedicate_params` and calls :func:`record_attention`.
    Train with ``policy(batch)``: ``policy.forward(batch)`` skips FSDP2's root hooks.

    Args:
        policy: a LeRobot policy of a type in :data:`POLICY_TYPES`, all parameters of one
            dtype (FSDP2 takes one per unit: build pi0 / pi05 in float32 and use ``mp_policy``
            for bf16 compute).
        mesh: a 1-D ``DeviceMesh`` (FSDP) or a 2-D ``("replicate", "shard")`` one (HSDP).
        root_kwargs: the root's ``fully_shard`` keyword arguments; default
            ``fully_shard_kwargs``. For bf16 give the units ``MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32)``
            and the root ``{}`` (pi0's fp32 flow-matching noise meets the root's own layers).
        fully_shard_kwargs: passed to every unit's ``fully_shard`` call.

    Returns:
        ``policy``, sharded in place (its class now FSDP2's subclass of it).

    Raises:
        ValueError: an unknown policy type, or a policy already sharded.
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    units = fsdp_units(policy)
    if isinstance(policy, FSDPModule) or any(isinstance(u, FSDPModule) for u in units):
        raise ValueError(f"dmuon: {type(policy).__name__} is already (partly) sharded by FSDP2; "
                         f"call fully_shard_policy once, on the unsharded policy")
    for unit in units:
        fully_shard(unit, mesh=mesh, **fully_shard_kwargs)
    fully_shard(policy, mesh=mesh, **(fully_shard_kwargs if root_kwargs is None else root_kwargs))
    declare_predicate(policy, predicate(policy))
    record_attention(policy)
    return policy


def predicate(policy: nn.Module) -> dmuon.hooks.dedicate.Predicate:
    """:func:`dmuon.default_predicate` without the ``lm_head`` matrices, which LeRobot's training
    never reads (they stay FSDP2-sharded on AdamW)."""
    base = dmuon.default_predicate(policy)

    def pick(fqn: str, param: nn.Parameter) -> bool | int:
        if ".lm_head." in f".{fqn}":
            return False
        return base(fqn, param)

    return pick
