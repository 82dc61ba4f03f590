"""Tiny LeRobot policies (pi0, pi05, SmolVLA, ACT, diffusion) for dmuon's LeRobot tests.

Every policy is LeRobot 0.6.1's own class, built from its own config with random weights and no
hub access: :func:`lerobot_tiny.tiny` (``bench/``) shrinks the pretrained backbones those
classes hard-code (PaliGemma's Gemma 2B / 300M and SigLIP, SmolVLM2's config and processor) for
the duration of the constructor, and the configs here drop ResNet-18's ImageNet weights. Layer
structure, forward code, loss and processors stay LeRobot's. ``*_run`` functions run on every
rank of the test pool (``tests/_pool.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

_BENCH = str(Path(__file__).resolve().parents[1] / "bench")
sys.path.insert(0, _BENCH)
try:
    from lerobot_tiny import IMAGE, local_tokenizer, tiny, train_tiny
finally:
    sys.path.remove(_BENCH)

POLICIES = ("pi0", "pi05", "smolvla", "act", "diffusion")
STATE_DIM, ACTION_DIM = 6, 4
CHUNK = 4         # action chunk (horizon) length
LANG_LEN = 5      # language tokens per sample (pi0 / pi05 / SmolVLA)
VOCAB = 257152    # PaliGemma's vocabulary, hard-coded by LeRobot's pi0 / pi05


def features() -> tuple[dict, dict]:
    """LeRobot input and output features: one ``IMAGE``-pixel camera, a ``STATE_DIM`` state,
    an ``ACTION_DIM`` action."""
    from lerobot.configs.types import FeatureType, PolicyFeature

    inputs = {"observation.image": PolicyFeature(type=FeatureType.VISUAL, shape=(3, IMAGE, IMAGE)),
              "observation.state": PolicyFeature(type=FeatureType.STATE, shape=(STATE_DIM,))}
    outputs = {"action": PolicyFeature(type=FeatureType.ACTION, shape=(ACTION_DIM,))}
    return inputs, outputs


def config(name: str, **overrides: Any) -> Any:
    """The tiny LeRobot config of policy type ``name`` (``"pi0"``, ...), on CPU, fp32."""
    from lerobot.configs.policies import PreTrainedConfig

    inputs, outputs = features()
    common = dict(input_features=inputs, output_features=outputs, device="cpu",
                  push_to_hub=False)
    kw: dict[str, Any] = {
        "pi0": dict(chunk_size=CHUNK, n_action_steps=CHUNK, max_state_dim=8, max_action_dim=8,
                    image_resolution=(IMAGE, IMAGE), tokenizer_max_length=LANG_LEN),
        "pi05": dict(chunk_size=CHUNK, n_action_steps=CHUNK, max_state_dim=8, max_action_dim=8,
                     image_resolution=(IMAGE, IMAGE), tokenizer_max_length=LANG_LEN),
        "smolvla": dict(chunk_size=CHUNK, n_action_steps=CHUNK, max_state_dim=8,
                        max_action_dim=8, resize_imgs_with_padding=(IMAGE, IMAGE),
                        num_vlm_layers=2, tokenizer_max_length=LANG_LEN),
        "act": dict(chunk_size=CHUNK, n_action_steps=CHUNK, dim_model=32, n_heads=2,
                    dim_feedforward=64, n_encoder_layers=2, n_decoder_layers=1,
                    n_vae_encoder_layers=1, latent_dim=8, dropout=0.0,
                    pretrained_backbone_weights=None),
        "diffusion": dict(horizon=8, n_action_steps=CHUNK, n_obs_steps=1,
                          down_dims=(16, 32), diffusion_step_embed_dim=16, kernel_size=3,
                          n_groups=4, spatial_softmax_num_keypoints=4, crop_shape=None,
                          pretrained_backbone_weights=None, use_group_norm=True,
                          num_train_timesteps=10),
    }[name]
    kw.update(overrides)
    return PreTrainedConfig.get_choice_class(name)(**common, **kw)



def build(name: str, **overrides: Any) -> torch.nn.Module:
    """The tiny policy of type ``name``, random weights (seed the global RNG first)."""
    from lerobot.policies.factory import get_policy_class

    with tiny(name):
        return get_policy_class(name)(config(name, **overrides))


def batch(name: str, seed: int, size: int) -> dict[str, torch.Tensor]:
    """A normalized training batch of ``size`` samples as LeRobot's preprocessor hands it to
    ``policy.forward`` (language already tokenized for the VLAs), from ``seed``."""
    from lerobot.utils.constants import OBS_LANGUAGE_ATTENTION_MASK, OBS_LANGUAGE_TOKENS

    g = torch.Generator().manual_seed(seed)
    horizon = 8 if name == "diffusion" else CHUNK
    out = {"observation.image": torch.rand(size, 3, IMAGE, IMAGE, generator=g),
           "observation.state": torch.randn(size, STATE_DIM, generator=g),
           "action": torch.randn(size, horizon, ACTION_DIM, generator=g),
           "action_is_pad": torch.zeros(size, horizon, dtype=torch.bool)}
    if name == "diffusion":  # n_obs_steps = 1: a time axis of one
        out["observation.image"] = out["observation.image"][:, None]
        out["observation.state"] = out["observation.state"][:, None]
    if name in ("pi0", "pi05", "smolvla"):
        vocab = 128 if name == "smolvla" else VOCAB
        out[OBS_LANGUAGE_TOKENS] = torch.randint(0, vocab, (size, LANG_LEN), generator=g)
        out[OBS_LANGUAGE_ATTENTION_MASK] = torch.ones(size, LANG_LEN, dtype=torch.bool)
    return out


# ---------------------------------------------------------------------------- parity runs
STEPS, GA, MICRO = 3, 2, 2     # optimizer steps, micro-batches per step, samples per rank
MAX_NORM = 1.0                 # below every true norm: every step clips
OPT_KWARGS = dict(lr=0.02, adamw_lr=0.01, weight_decay=0.1, ns_method="standard",
                  ns_dtype=torch.float32, ns_coefficients="muon")


def matrix_names(policy: torch.nn.Module) -> list[str]:
    """The reference's Muon matrices, written out independently of dmuon's predicate: the
    trainable 2-D weights that are not an ``nn.Embedding``'s and not an ``lm_head``."""
    embeddings = {f"{n}.weight" for n, m in policy.named_modules() if isinstance(m, torch.nn.Embedding)}
    return [n for n, p in policy.named_parameters()
            if p.requires_grad and p.dim() == 2 and n not in embeddings and "lm_head" not in n]


def noise_driven(policy: torch.nn.Module) -> dict[str, slice]:
    """Entries whose true gradient is ~0, so that what they get is rounding noise (~1e-8) that
    AdamW (sign-like first steps) or Muon (orthogonalization of a noise matrix) turns into
    steps of full size: by parameter name, the rows concerned. Tests compare them apart, only
    bounded by the largest step the optimizer can take.

    - Attention key biases (``nn.MultiheadAttention.in_proj_bias`` rows ``[E, 2E)``, a
      ``k_proj.bias``): softmax ignores a constant added to every key's score.
    - ACT's first decoder layer's self-attention query and key projections
      (``in_proj_weight`` rows ``[0, 2E)``): ACT feeds its decoder zeros, so that layer's values
      are all its value bias and the attention weights do not change the output.
    """
    out = {}
    for n, m in policy.named_modules():
        if isinstance(m, torch.nn.MultiheadAttention) and m.in_proj_bias is not None:
            out[f"{n}.in_proj_bias"] = slice(m.embed_dim, 2 * m.embed_dim)
            if n.endswith("decoder.layers.0.self_attn"):
                out[f"{n}.in_proj_weight"] = slice(0, 2 * m.embed_dim)
        elif n.endswith("k_proj") and getattr(m, "bias", None) is not None:
            out[f"{n}.bias"] = slice(None)
    return out


def _seed(step: int, micro: int, rank: int) -> int:
    return 1000 * step + 10 * micro + rank


def _micro_loss(policy: torch.nn.Module, name: str, step: int, micro: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s loss on micro-batch ``micro`` of ``step``; noise, flow-matching time
    and VAE samples drawn from a seed of the three (the same in the reference)."""
    b = batch(name, _seed(step, micro, rank), MICRO)
    torch.manual_seed(_seed(step, micro, rank))
    loss, _ = policy(b)
    return loss


def reference(name: str, world_size: int) -> tuple[dict[str, Any], list[float], list[float]]:
    """Single-process ``torch.optim.Muon`` (fp32 iteration) + ``AdamW`` on the same
    micro-batches (loss averaged over ranks and micro-batches), clipped at ``MAX_NORM``."""
    from tests import models

    torch.manual_seed(0)
    policy = build(name)
    policy.train()
    names = set(matrix_names(policy))
    mats = [p for n, p in policy.named_parameters() if n in names]
    rest = [p for n, p in policy.named_parameters() if n not in names and p.requires_grad]
    muon = torch.optim.Muon(mats, lr=OPT_KWARGS["lr"], weight_decay=OPT_KWARGS["weight_decay"],
                            ns_coefficients=models.MUON_COEFFICIENTS)
    adamw = torch.optim.AdamW(rest, lr=OPT_KWARGS["adamw_lr"], weight_decay=OPT_KWARGS["weight_decay"])
    losses, norms = [], []
    with models.reference_ns(torch.float32):
        for step in range(STEPS):
            total = 0.0
            for micro in range(GA):
                for rank in range(world_size):
                    loss = _micro_loss(policy, name, step, micro, rank)
                    (loss / (GA * world_size)).backward()
                    total += loss.item() / (GA * world_size)
            losses.append(total)
            norms.append(float(torch.nn.utils.clip_grad_norm_(policy.parameters(), MAX_NORM)))
            for o in (muon, adamw):
                o.step()
                o.zero_grad()
    params = {n: p.detach().numpy().copy() for n, p in policy.named_parameters()}
    return params, losses, norms


def local_numel(policy: torch.nn.Module) -> int:
    """Parameter elements this rank stores: FSDP2 shards, owned matrices whole, placeholders
    (size 0) and dmuon's fp32 masters of owned matrices counted once."""
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in policy.parameters())


def dmuon_run(rank: int, world_size: int, *, name: str) -> dict[str, Any]:
    """fully_shard_policy + dedicate_params (the default call, no ``predicate=``) + dmuon.Muon
    over ``STEPS`` steps of ``GA`` micro-batches with clipping (``torch.nn.utils.clip_grad_norm_``,
    as LeRobot calls it)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon
    from dmuon.integrations import lerobot as dl
    from tests.dist_cases import full_params

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    policy = build(name)
    policy.train()
    total = sum(p.numel() for p in policy.parameters())
    full = {n: p.numel() for n, p in policy.named_parameters()}
    dl.fully_shard_policy(policy, mesh)
    dmuon.dedicate_params(policy, mesh)  # no predicate=: fully_shard_policy declared its own
    opt = dmuon.Muon(policy, **OPT_KWARGS)
    losses, norms = [], []
    for step in range(STEPS):
        total_loss = 0.0
        for micro in range(GA):
            loss = _micro_loss(policy, name, step, micro, rank)
            (loss / GA).backward()
            total_loss += loss.item() / GA
        t = torch.tensor(total_loss, dtype=torch.float64)
        dist.all_reduce(t)
        losses.append(float(t) / world_size)
        norms.append(float(torch.nn.utils.clip_grad_norm_(policy.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
    dedicated = sorted(r.fqn for r in policy._dmuon_state.records)
    # the share of each lm_head this rank stores: 1/N as an FSDP2 shard; 1 or 0 had it an owner
    heads = {n: (p.to_local() if hasattr(p, "to_local") else p).numel() / full[n]
             for n, p in policy.named_parameters() if "lm_head" in n}
    names = {m: n for n, m in policy.named_modules()}
    return dict(params=full_params(policy, rank), losses=losses, norms=norms,
                local_fraction=local_numel(policy) / total, dedicated=dedicated,
                lm_head_shares=heads, units=[names[u.module] for u in policy._dmuon_state.units])


# ---------------------------------------------------------------------------- entry point
def train_entry(rank: int, world_size: int, *, argv: list[str], policy: str,
                tokenizer: str) -> list[dict[str, float]]:
    """Pool worker: :func:`lerobot_tiny.train_tiny`; its per-step records."""
    return train_tiny(argv, policy, tokenizer)


def entry_reference(cfg: Any, args: Any, *, world_size: int = 2) -> dict[str, Any]:
    """The entry point's run in one process with ``torch.optim.Muon`` (fp32 iteration) +
    ``AdamW``: the same LeRobot config, dataset, policy, processors and scheduler, each
    simulated rank's batches (``train.batches``) and RNG stream (every rank starts from the
    seeded state and draws its own noise), the loss averaged over ranks, LeRobot's clip.
    Shares with dmuon only the batch order (``train.batches``, a pure function of the seed)."""
    from lerobot.datasets.factory import make_train_eval_datasets
    from lerobot.policies import make_policy, make_pre_post_processors
    from lerobot.utils.random_utils import set_seed

    from dmuon.integrations.lerobot import train
    from tests import models

    set_seed(cfg.seed)
    dataset, _ = make_train_eval_datasets(cfg)
    policy = make_policy(cfg=cfg.policy, ds_meta=dataset.meta, rename_map=cfg.rename_map)
    pre, _ = make_pre_post_processors(policy_cfg=cfg.policy, dataset_stats=dataset.meta.stats)
    policy.train()
    names = set(matrix_names(policy))
    o = cfg.optimizer
    muon = torch.optim.Muon([p for n, p in policy.named_parameters() if n in names], lr=args.lr,
                            weight_decay=o.weight_decay, ns_coefficients=models.MUON_COEFFICIENTS)
    adamw = torch.optim.AdamW([p for n, p in policy.named_parameters()
                               if n not in names and p.requires_grad],
                              lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    scheds = [cfg.scheduler.build(x, cfg.steps) for x in (muon, adamw)]
    initial = {n: p.detach().numpy().copy() for n, p in policy.state_dict().items()}
    rng = [torch.get_rng_state() for _ in range(world_size)]
    data = [train.batches(dataset, cfg.batch_size, cfg.seed, 0, r, world_size)
            for r in range(world_size)]
    losses = []
    with models.reference_ns(torch.float32):
        for _ in range(cfg.steps):
            total = 0.0
            for r in range(world_size):
                torch.set_rng_state(rng[r])
                loss, _ = policy(pre(next(data[r])))
                rng[r] = torch.get_rng_state()
                (loss / world_size).backward()
                total += loss.item() / world_size
            losses.append(total)
            torch.nn.utils.clip_grad_norm_(policy.parameters(), o.grad_clip_norm)
            for x in (muon, adamw):
                x.step()
                x.zero_grad()
            for s in scheds:
                s.step()
    return dict(losses=losses, initial=initial,
                params={n: p.detach().numpy().copy() for n, p in policy.state_dict().items()})


def entry_reference_main(argv: list[str], policy: str, tokenizer: str) -> dict[str, Any]:
    """:func:`entry_reference` on ``argv`` parsed as the entry point parses it (one process)."""
    return train_tiny(argv, policy, tokenizer, runner=entry_reference)


def load_exported(policy: str, path: str, tokenizer: str) -> dict[str, Any]:
    """``<Policy>.from_pretrained(path)``, LeRobot's own loader, as numpy by state-dict key."""
    from lerobot.policies.factory import get_policy_class

    with tiny(policy), local_tokenizer(tokenizer):
        loaded = get_policy_class(policy).from_pretrained(path)
    return {n: p.detach().numpy().copy() for n, p in loaded.state_dict().items()}


# ---------------------------------------------------------------------------- QK-clip
class _SoftmaxInputs(torch.overrides.TorchFunctionMode):
    """Per head and query row, the max of every ``[batch, heads, rows, keys]`` softmax input over
    the last dim: the scaled, masked attention logits LeRobot's eager attention normalizes (its
    own tensor, read here without dmuon)."""

    def __init__(self, out: list[torch.Tensor]) -> None:
        super().__init__()
        self.out = out

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.nn.functional.softmax, torch.softmax, torch.Tensor.softmax):
            dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
            if args[0].dim() == 4 and dim in (-1, 3):
                self.out.append(args[0].detach().amax(dim=(0, 3)).clone())  # [heads, rows]
        return func(*args, **kwargs)


class DecoderLogits:
    """While active: per call of LeRobot's decoder-layer function (pi0 / pi05
    ``compute_layer_complete``, SmolVLA ``forward_attn_layer`` / ``forward_cross_attn_layer``)
    its input hidden states (``inputs[i]``) and, per attention it computes and per model whose
    queries it holds, the per-head max logits (``blocks``: ``(layer, model, kind, [heads])``;
    model 0 the VLM, 1 the expert; kind ``"joint"`` (both models' tokens in one attention),
    ``"prefix"`` (SmolVLA's VLM alone in a cross-attention layer) or ``"cross"`` (its expert
    over the VLM's keys)). With ``replay`` (another instance's ``inputs``) each call runs on the
    replayed inputs instead of its own: every layer then sees the hidden states of the replayed
    forward, whatever the layers below it do now."""

    def __init__(self, name: str, replay: list[list[Any]] | None = None) -> None:
        import importlib
        from unittest import mock

        self.inputs: list[list[Any]] = []
        self.blocks: list[tuple[int, int, str, torch.Tensor]] = []
        self.replay = replay
        if name in ("pi0", "pi05"):
            module = importlib.import_module(f"lerobot.policies.{name}.modeling_{name}")
            original = module.compute_layer_complete

            def layer(inputs_embeds, *args, **kwargs):
                return self._run(original, inputs_embeds, lambda x: (x, *args), kwargs, cross=False)

            self.patches = [mock.patch.object(module, "compute_layer_complete", layer)]
        else:
            from lerobot.policies.smolvla.smolvlm_with_expert import SmolVLMWithExpertModel as cls

            def wrap(original, cross):
                def layer(vwe, model_layers, inputs_embeds, *args, **kwargs):
                    return self._run(original, inputs_embeds,
                                     lambda x: (vwe, model_layers, x, *args), kwargs, cross=cross)
                return layer

            self.patches = [mock.patch.object(cls, n, wrap(getattr(cls, n), n.endswith("cross_attn_layer")))
                            for n in ("forward_attn_layer", "forward_cross_attn_layer")]

    def _run(self, original, inputs_embeds, args, kwargs, cross):
        index = len(self.inputs)
        if self.replay is not None:
            inputs_embeds = self.replay[index]
        self.inputs.append([None if x is None else x.detach().clone() for x in inputs_embeds])
        seen: list[torch.Tensor] = []
        with _SoftmaxInputs(seen):
            out = original(*args(inputs_embeds), **kwargs)
        rows = [x.shape[1] for x in inputs_embeds]
        if cross:  # the VLM over its prefix, then the expert over the VLM's keys
            assert len(seen) == 2 and [m.shape[1] for m in seen] == rows
            self.blocks += [(index, 0, "prefix", seen[0].amax(dim=1)),
                            (index, 1, "cross", seen[1].amax(dim=1))]
        else:  # one joint attention: the VLM's query rows, then the expert's
            assert len(seen) == 1 and seen[0].shape[1] == sum(rows)
            self.blocks += [(index, 0, "joint", seen[0][:, :rows[0]].amax(dim=1)),
                            (index, 1, "joint", seen[0][:, rows[0]:].amax(dim=1))]
        return out

    def __enter__(self) -> "DecoderLogits":
        for p in self.patches:
            p.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        for p in reversed(self.patches):
            p.stop()


def qk_clip_run(rank: int, world_size: int, *, name: str, alpha: float = 0.5, fraction: float = 0.5,
                **overrides: Any) -> dict[str, Any]:
    """QK-clip on a LeRobot VLA (config ``overrides``) through fully_shard_policy (issue 45):
    one clip-only step (``lr`` 0, AdamW ``lr`` 0, no weight decay, ``qk_clip_alpha=alpha``) at
    ``tau = fraction x`` the smallest max logit of any decoder attention block whose queries
    train, on any rank; then the same batch again, each decoder layer on the hidden states it
    saw in the step (so a layer's logits change only by its own clip).

    Returns:
        ``tau``, and per attention block (:class:`DecoderLogits`: layer, model, kind) whether
        the model trains (``trains``) and this rank's per-head max logits ``before`` / ``after``
        the step (lists of floats): LeRobot's own logits, read by :class:`DecoderLogits`.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon
    from dmuon.integrations import lerobot as dl

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    policy = build(name, **overrides)
    policy.train()
    if name == "smolvla":  # SmolVLA freezes its VLM (train_expert_only) or its last layer
        vwe = policy.model.vlm_with_expert
        models = [vwe.get_vlm_model().text_model, vwe.lm_expert]
    else:
        pwe = policy.model.paligemma_with_expert
        models = [pwe.paligemma.model.language_model, pwe.gemma_expert.model]
    trains = {(i, m): layer.self_attn.q_proj.weight.requires_grad  # (layer, model)
              for m, model in enumerate(models) for i, layer in enumerate(model.layers)}
    dl.fully_shard_policy(policy, mesh)
    dmuon.dedicate_params(policy, mesh)
    b = batch(name, 500 + rank, MICRO)

    def forward(capture: DecoderLogits, grad: bool) -> torch.Tensor:
        torch.manual_seed(77 + rank)  # the same flow-matching noise and time every time
        with capture, torch.set_grad_enabled(grad):
            loss, _ = policy(b)
        return loss

    probe = DecoderLogits(name)
    forward(probe, grad=False)
    smallest = torch.tensor(min(float(m.max()) for layer, model, _, m in probe.blocks
                                if trains[layer, model]))
    dist.all_reduce(smallest, op=dist.ReduceOp.MIN)
    tau = fraction * float(smallest)
    opt = dmuon.Muon(policy, lr=0.0, adamw_lr=0.0, weight_decay=0.0, qk_clip_threshold=tau,
                     qk_clip_alpha=alpha)
    step = DecoderLogits(name)
    forward(step, grad=True).backward()
    opt.step()
    opt.zero_grad()
    after = DecoderLogits(name, replay=step.inputs)
    forward(after, grad=False)
    return dict(tau=tau, blocks=[dict(layer=layer, model=model, kind=kind, trains=trains[layer, model],
                                      before=m.tolist(), after=a[3].tolist())
                                 for (layer, model, kind, m), a in zip(step.blocks, after.blocks)])
