"""Tiny LeRobot policies without the hub, for benchmarks and tests: while :func:`tiny` is
active, LeRobot 0.6.1's constructors build pi0 / pi05 with 2-layer Gemmas 32 wide and a 1-layer
SigLIP, SmolVLA with a 2-layer SmolVLM (random weights; LeRobot's layers, forward and loss).
:func:`local_tokenizer` points LeRobot's tokenizer step at a local directory.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any, Iterator
from unittest import mock

__all__ = ["local_tokenizer", "smolvlm_config", "tiny", "train_tiny"]

#: pixels per side of the camera image the tiny vision encoders take by default
IMAGE = 32


def _frozen_fields(config: Any, keep: dict[str, Any]) -> Any:
    """``config`` with the ``keep`` fields set and deaf to later assignments (LeRobot's pi0
    resets SigLIP's sizes after building the config)."""
    for k, v in keep.items():
        setattr(config, k, v)
    base = type(config)

    def setattr_(self: Any, name: str, value: Any) -> None:
        if name not in keep:
            base.__setattr__(self, name, value)

    config.__class__ = type(base.__name__, (base,), {"__setattr__": setattr_})
    return config


@contextlib.contextmanager
def _tiny_paligemma(module: Any, width: int = 32) -> Iterator[None]:
    """Patch a pi0 / pi05 modeling module: both Gemmas ``width`` wide, 2 layers, SigLIP 1
    layer on ``IMAGE``-pixel images with 8-pixel patches."""
    from transformers.models.auto import CONFIG_MAPPING

    def gemma(variant: str) -> Any:
        return module.GemmaConfig(width=width, depth=2, mlp_dim=2 * width, num_heads=8,
                                  num_kv_heads=1, head_dim=8)  # LeRobot hard-codes 8 heads

    def paligemma() -> Any:
        config = CONFIG_MAPPING["paligemma"]()
        vision = config.vision_config
        vision.hidden_size, vision.num_hidden_layers, vision.num_attention_heads = 16, 1, 2
        vision.patch_size = 8
        _frozen_fields(vision, dict(intermediate_size=32, projection_dim=width))
        return config

    mapping = {"paligemma": paligemma, "gemma": CONFIG_MAPPING["gemma"]}
    with mock.patch.object(module, "get_gemma_config", gemma), \
            mock.patch.object(module, "CONFIG_MAPPING", mapping):
        yield


def smolvlm_config() -> Any:
    """A 2-layer SmolVLM config (text 64 wide, vision 16 wide, ``IMAGE``-pixel images)."""
    from transformers import SmolVLMConfig

    return SmolVLMConfig(
        text_config=dict(model_type="llama", hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, vocab_size=128, max_position_embeddings=256),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, image_size=IMAGE, patch_size=8),
        scale_factor=2, vocab_size=128)


# SmolVLA's model reads two token ids off the processor (the tokenizer runs in the preprocessor)
_PROCESSOR = SimpleNamespace(tokenizer=SimpleNamespace(fake_image_token_id=126,
                                                       global_image_token_id=127))


@contextlib.contextmanager
def _tiny_smolvlm() -> Iterator[None]:
    from lerobot.policies.smolvla import smolvlm_with_expert as m

    with mock.patch.object(m.AutoConfig, "from_pretrained", lambda *a, **k: smolvlm_config()), \
            mock.patch.object(m.AutoProcessor, "from_pretrained", lambda *a, **k: _PROCESSOR):
        yield


@contextlib.contextmanager
def tiny(name: str) -> Iterator[None]:
    """While active, LeRobot's constructors (``make_policy``, ``from_pretrained``) of policy
    type ``name`` build the tiny backbones of this module instead of the pretrained ones
    (``"pi0"``, ``"pi05"``, ``"smolvla"``; other types build as they are: ACT's and diffusion's
    ResNets need ``pretrained_backbone_weights=None`` in their config, not a patch)."""
    if name in ("pi0", "pi05"):
        import importlib
        module = importlib.import_module(f"lerobot.policies.{name}.modeling_{name}")
        with _tiny_paligemma(module):
            yield
    elif name == "smolvla":
        with _tiny_smolvlm():
            yield
    else:
        yield


@contextlib.contextmanager
def local_tokenizer(path: str) -> Iterator[None]:
    """LeRobot's ``TokenizerProcessorStep`` loads the tokenizer at ``path`` whatever name its
    processor asks for (pi0 / pi05 ask for PaliGemma's on the hub)."""
    from lerobot.processor import tokenizer_processor as m

    original = m.AutoTokenizer.from_pretrained
    with mock.patch.object(m.AutoTokenizer, "from_pretrained",
                           lambda name, *a, **k: original(path, *a, **k)):
        yield


def train_tiny(argv: list[str], policy: str, tokenizer: str, runner: Any = None) -> Any:
    """:func:`dmuon.integrations.lerobot.train.main` (``argv``, ``runner``) with the tiny
    backbones of ``policy`` (a LeRobot policy type) and the tokenizer saved at ``tokenizer``;
    returns what ``main`` returns (the per-step records of :func:`~dmuon.integrations.lerobot.
    train.run`). Collective when ``runner`` is (``run`` is)."""
    from dmuon.integrations.lerobot import train

    with tiny(policy), local_tokenizer(tokenizer):
        return train.main(argv, runner=runner)
