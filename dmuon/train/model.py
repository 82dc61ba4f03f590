"""A small Pi0-style vision-language-action policy trained with flow matching.

Layout (after Black et al., "pi0: A Vision-Language-Action Flow Model for General Robot
Control", 2024), shrunk to run on CPU:

- **Observation encoder**, one of two (``PolicyConfig.obs``):

  - ``"image"``, **vision encoder** (``model.vision``): 8x8 patches -> ``Linear(3*64, d_vis)`` + learned
  position embedding, ``vision_depth`` pre-norm transformer blocks, plus an attention-pooled
  summary token (score head ``Linear(d_vis, 1)``: a ``[1, d_vis]`` matrix), projected to the
  backbone width.
  - ``"state"``, **state tokens** (``model.state_tokens``): per observation in the history, the
    T's 8 keypoints (one token each, ``Linear(2, d_model)``), the agent position (one token) and
    the block-frame features of :func:`dmuon.train.data.state_features` (one token,
    ``Linear(10, d_model)``), plus a learned position embedding per token: they take the image
    tokens' place in the prefix, as Pi0 takes several camera images.
- **Backbone** (``model.backbone``): ``nn.Embedding`` instruction tokens, then ``depth`` blocks
  over the prefix ``[observation tokens, text]`` with bidirectional attention and
  multi-query attention (one shared key/value head, as Gemma in Pi0). The last backbone block
  only computes keys/values: its prefix output would feed nothing (no language loss), so its
  query/output/MLP weights would never get a gradient.
- **Action expert** (``model.expert``): narrower blocks (``d_act``, not divisible by 4 by
  default) over the suffix ``[state, noisy action chunk]``. Layer l of the expert attends to the
  keys/values of backbone layer l over the prefix and to its own suffix keys/values (Pi0's
  shared attention, block-causal: the state token does not see the action tokens; the prefix
  never sees the suffix).

Flow-matching convention (Pi0's): with clean actions ``a``, noise ``eps ~ N(0, I)`` and time
``t`` in (0, 1], ``x_t = t * eps + (1 - t) * a`` and the network predicts the velocity
``u = eps - a``; the loss is the mean squared error. Sampling integrates from t = 1 (noise) to
t = 0 (actions) with ``x <- x - dt * v``.

Each transformer block is its own ``nn.Module`` in a ``ModuleList`` (``vision.blocks``,
``backbone.blocks``, ``expert.blocks``) so FSDP2 can ``fully_shard`` each one;
:meth:`Pi0Policy.shardable_blocks` lists them in forward order.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PolicyConfig:
    """Sizes of :class:`Pi0Policy` (widths in features, lengths in tokens).

    Args:
        image_size: Input image side in pixels; divisible by ``patch``.
        patch: Patch side in pixels.
        d_vis: Vision encoder width.
        vision_depth: Vision blocks.
        d_model: Backbone width; divisible by ``head_dim``.
        depth: Backbone blocks, and action-expert blocks (one per backbone layer, as in Pi0).
        d_act: Action-expert width.
        act_heads: Action-expert query heads.
        head_dim: Attention head size shared by backbone and expert (they share keys/values).
        mlp_ratio_vis: Vision MLP hidden = ``mlp_ratio_vis * d_vis``.
        mlp_ratio: Backbone MLP hidden = ``mlp_ratio * d_model``.
        mlp_ratio_act: Expert MLP hidden = ``mlp_ratio_act * d_act``.
        vocab_size: Text vocabulary.
        max_tokens: Instruction length.
        horizon: Action chunk length H.
        action_dim: Action features (2 for PushT).
        state_dim: Proprioceptive state features (2 for PushT).
        obs: ``"image"`` (vision encoder) or ``"state"`` (state tokens).
        history: Observations in the prefix (``obs="state"``).
    """

    image_size: int = 96
    patch: int = 8
    d_vis: int = 96
    vision_depth: int = 2
    d_model: int = 160
    depth: int = 3
    d_act: int = 90
    act_heads: int = 3
    head_dim: int = 32
    mlp_ratio_vis: int = 4
    mlp_ratio: int = 3
    mlp_ratio_act: int = 3
    vocab_size: int = 256
    max_tokens: int = 10
    horizon: int = 8
    action_dim: int = 2
    state_dim: int = 2
    obs: str = "image"
    history: int = 1

    def __post_init__(self) -> None:
        if self.obs not in ("image", "state"):
            raise ValueError(f"dmuon.train: PolicyConfig.obs={self.obs!r}; choose 'image' or 'state'.")
        if self.history < 1 or (self.history > 1 and self.obs != "state"):
            raise ValueError(f"dmuon.train: PolicyConfig.history={self.history}; must be >= 1, and 1 for images.")
        if self.image_size % self.patch:
            raise ValueError(
                f"dmuon.train: image_size={self.image_size} is not divisible by patch={self.patch}."
            )
        if self.d_model % self.head_dim:
            raise ValueError(
                f"dmuon.train: d_model={self.d_model} is not divisible by head_dim={self.head_dim}."
            )


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Scaled dot-product attention; q [B, Hq, T, D], k/v [B, 1, S, D] (one shared head)."""
    k = k.expand(-1, q.shape[1], -1, -1)
    v = v.expand(-1, q.shape[1], -1, -1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.transpose(1, 2).flatten(2)  # [B, T, Hq * D]


class Mlp(nn.Module):
    """GELU MLP ``Linear(d, hidden) -> GELU -> Linear(hidden, d)``."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class VisionBlock(nn.Module):
    """Pre-norm ViT block with fused qkv (``Linear(d, 3d)``) and ``heads`` heads."""

    def __init__(self, d: int, heads: int, mlp_hidden: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = Mlp(d, mlp_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: float [B, T, d] -> [B, T, d]."""
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))
        return x + self.mlp(self.norm2(x))


class BackboneBlock(nn.Module):
    """Pre-norm multi-query block over the prefix; also returns its keys/values for the expert."""

    def __init__(self, d: int, head_dim: int, mlp_hidden: int, *, kv_only: bool = False) -> None:
        super().__init__()
        self.heads, self.head_dim, self.kv_only = d // head_dim, head_dim, kv_only
        self.norm1 = nn.LayerNorm(d)
        self.kv = nn.Linear(d, 2 * head_dim, bias=False)  # one shared key/value head
        if not kv_only:  # the last layer's prefix output is never read: only its keys/values
            self.q = nn.Linear(d, d, bias=False)
            self.o = nn.Linear(d, d, bias=False)
            self.norm2 = nn.LayerNorm(d)
            self.mlp = Mlp(d, mlp_hidden)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: float [B, P, d] -> (x [B, P, d], k [B, 1, P, head_dim], v [B, 1, P, head_dim]).

        Keys/values come from this layer's input, as in Pi0's joint attention at layer l.
        """
        b, p, _ = x.shape
        h = self.norm1(x)
        k, v = self.kv(h).view(b, p, 2, 1, self.head_dim).permute(2, 0, 3, 1, 4)
        if self.kv_only:  # clone x too: FSDP2 hooks make a passed-through input a view
            return x.clone(), k.clone(), v.clone()
        q = self.q(h).view(b, p, self.heads, self.head_dim).transpose(1, 2)
        x = x + self.o(_attend(q, k, v, None))
        # clone: FSDP2 warns about (and mishandles in-place ops on) view outputs of a block
        return x + self.mlp(self.norm2(x)), k.clone(), v.clone()


class ExpertBlock(nn.Module):
    """Action-expert block: suffix queries over [prefix keys/values, suffix keys/values]."""

    def __init__(self, d: int, heads: int, head_dim: int, mlp_hidden: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.norm1 = nn.LayerNorm(d)
        self.q = nn.Linear(d, heads * head_dim, bias=False)
        self.kv = nn.Linear(d, 2 * head_dim, bias=False)
        self.o = nn.Linear(heads * head_dim, d, bias=False)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = Mlp(d, mlp_hidden)

    def forward(self, x: torch.Tensor, prefix_k: torch.Tensor, prefix_v: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """x: [B, S, d]; prefix_k/v: [B, 1, P, head_dim]; mask: bool [S, P + S] -> [B, S, d]."""
        b, s, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(h).view(b, s, 2, 1, self.head_dim).permute(2, 0, 3, 1, 4)
        k = torch.cat([prefix_k, k], dim=2)
        v = torch.cat([prefix_v, v], dim=2)
        x = x + self.o(_attend(q, k, v, mask))
        return x + self.mlp(self.norm2(x))


class VisionEncoder(nn.Module):
    """Patch embedding, ViT blocks, attention pooling, projection to the backbone width."""

    def __init__(self, cfg: PolicyConfig) -> None:
        super().__init__()
        self.patch = cfg.patch
        n_patches = (cfg.image_size // cfg.patch) ** 2
        self.patch_embed = nn.Linear(3 * cfg.patch * cfg.patch, cfg.d_vis)
        self.pos = nn.Embedding(n_patches, cfg.d_vis)
        heads = max(1, cfg.d_vis // 32)
        self.blocks = nn.ModuleList(
            VisionBlock(cfg.d_vis, heads, cfg.mlp_ratio_vis * cfg.d_vis) for _ in range(cfg.vision_depth)
        )
        self.norm = nn.LayerNorm(cfg.d_vis)
        self.pool_score = nn.Linear(cfg.d_vis, 1)  # a [1, d_vis] matrix
        self.to_backbone = nn.Linear(cfg.d_vis, cfg.d_model)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """images: float [B, 3, S, S] in [0, 1] -> tokens [B, n_patches + 1, d_model]."""
        x = F.unfold(images * 2.0 - 1.0, self.patch, stride=self.patch).transpose(1, 2)
        x = self.patch_embed(x) + self.pos.weight
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        weights = torch.softmax(self.pool_score(x), dim=1)  # [B, n_patches, 1]
        pooled = (weights * x).sum(dim=1, keepdim=True)
        return self.to_backbone(torch.cat([x, pooled], dim=1))


class StateTokens(nn.Module):
    """Prefix tokens of the state observation: 10 per frame (8 keypoints, agent, features)."""

    def __init__(self, cfg: PolicyConfig) -> None:
        super().__init__()
        self.keypoint_in = nn.Linear(2, cfg.d_model)  # a [d_model, 2] matrix, shared by the 8 keypoints
        self.agent_in = nn.Linear(2, cfg.d_model)
        self.feature_in = nn.Linear(_DERIVED, cfg.d_model)
        self.pos = nn.Embedding(cfg.history * _TOKENS_PER_FRAME, cfg.d_model)
        self.norm = nn.LayerNorm(cfg.d_model)

    def forward(self, env_state: torch.Tensor) -> torch.Tensor:
        """env_state: float [B, history, 28] (``data.state_features``) -> [B, history * 10, d_model]."""
        b, h, _ = env_state.shape
        kp = self.keypoint_in(env_state[..., :16].reshape(b, h, 8, 2))
        agent = self.agent_in(env_state[..., 16:18])[:, :, None]
        feat = self.feature_in(env_state[..., 18:])[:, :, None]
        x = torch.cat([kp, agent, feat], dim=2).reshape(b, h * _TOKENS_PER_FRAME, -1)
        return self.norm(x + self.pos.weight)


_DERIVED = 10  # data.state_features beyond the keypoints and the agent position
_TOKENS_PER_FRAME = 10


class Backbone(nn.Module):
    """Instruction embedding and the prefix transformer."""

    def __init__(self, cfg: PolicyConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.text_pos = nn.Embedding(cfg.max_tokens, cfg.d_model)
        self.blocks = nn.ModuleList(
            BackboneBlock(cfg.d_model, cfg.head_dim, cfg.mlp_ratio * cfg.d_model, kv_only=i == cfg.depth - 1)
            for i in range(cfg.depth)
        )


class ActionExpert(nn.Module):
    """State/action/time embeddings, expert blocks and the velocity head."""

    def __init__(self, cfg: PolicyConfig) -> None:
        super().__init__()
        d = cfg.d_act
        self.state_in = nn.Linear(cfg.state_dim, d)  # a [d_act, 2] matrix
        self.action_in = nn.Linear(cfg.action_dim, d)
        self.time_mlp_in = nn.Linear(2 * d, d)  # [action embedding, sinusoidal time] -> d
        self.time_mlp_out = nn.Linear(d, d)
        self.action_pos = nn.Embedding(cfg.horizon + 1, d)
        self.blocks = nn.ModuleList(
            ExpertBlock(d, cfg.act_heads, cfg.head_dim, cfg.mlp_ratio_act * d) for _ in range(cfg.depth)
        )
        self.norm = nn.LayerNorm(d)
        self.action_out = nn.Linear(d, cfg.action_dim)


def sinusoidal_time(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sine-cosine embedding of flow time (Vaswani et al. 2017), as openpi's ``posemb_sincos``
    (``min_period=4e-3``, ``max_period=4.0``): features ``[sin(2 pi t / p_i), cos(2 pi t / p_i)]``.

    Args:
        t: float [B] in [0, 1].
        dim: Output features (even or odd; an odd last feature is zero).

    Returns:
        float [B, dim].
    """
    half = dim // 2
    # openpi's posemb_sincos: periods from 4e-3 to 4.0 on a log scale, angle = 2 pi t / period.
    periods = torch.exp(torch.linspace(math.log(4e-3), math.log(4.0), half, device=t.device, dtype=t.dtype))
    ang = t[:, None] * (2 * math.pi / periods)[None, :]
    emb = torch.cat([ang.sin(), ang.cos()], dim=-1)
    return F.pad(emb, (0, dim - 2 * half))


class Pi0Policy(nn.Module):
    """Pi0-style flow-matching policy; see the module docstring for the layout.

    Args:
        cfg: Sizes.
    """

    def __init__(self, cfg: PolicyConfig) -> None:
        super().__init__()
        self.cfg = cfg
        if cfg.obs == "image":
            self.vision = VisionEncoder(cfg)
        else:
            self.state_tokens = StateTokens(cfg)
        self.backbone = Backbone(cfg)
        self.expert = ActionExpert(cfg)
        s = cfg.horizon + 1
        mask = torch.ones(s, s, dtype=torch.bool)
        mask[0, 1:] = False  # the state token does not attend to the noisy actions (Pi0)
        self.register_buffer("suffix_mask", mask, persistent=False)

    def shardable_blocks(self) -> list[nn.Module]:
        """Returns the transformer blocks in forward order, to ``fully_shard`` one by one."""
        vision = list(self.vision.blocks) if self.cfg.obs == "image" else []
        return [*vision, *self.backbone.blocks, *self.expert.blocks]

    def prefix_kv(self, obs: torch.Tensor, tokens: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Backbone keys/values of the prefix ``[observation tokens, text]``.

        They do not depend on the noisy actions or the flow time, so sampling computes them
        once per observation and reuses them at every flow step (Pi0's KV cache).

        Args:
            obs: ``obs="image"``: images float [B, 3, S, S] in [0, 1]; ``obs="state"``:
                ``env_state`` float [B, history, 28].
            tokens: int64 [B, L].

        Returns:
            One ``(k, v)`` per backbone layer, each float [B, 1, P, head_dim].
        """
        bb = self.backbone
        text = bb.embed(tokens) + bb.text_pos.weight[: tokens.shape[1]]
        seen = self.vision(obs) if self.cfg.obs == "image" else self.state_tokens(obs)
        prefix = torch.cat([seen, text], dim=1)
        kvs = []
        for block in bb.blocks:
            prefix, k, v = block(prefix)
            kvs.append((k, v))
        return kvs

    def suffix_velocity(self, kvs: list[tuple[torch.Tensor, torch.Tensor]], state: torch.Tensor,
                        x_t: torch.Tensor, time: torch.Tensor) -> torch.Tensor:
        """The action expert's velocity given the prefix keys/values from :meth:`prefix_kv`.

        Args:
            kvs: :meth:`prefix_kv`'s output for the same batch.
            state: float [B, state_dim], normalized.
            x_t: float [B, H, action_dim], the noisy action chunk.
            time: float [B] in (0, 1].

        Returns:
            float [B, H, action_dim], the predicted ``noise - actions``.
        """
        ex = self.expert
        d = self.cfg.d_act
        act = ex.action_in(x_t)
        # In act's dtype: under a bf16 MixedPrecisionPolicy the float32 frequencies would
        # promote the concatenation to float32 and the bf16 time_mlp_in would refuse it.
        temb = sinusoidal_time(time, d).to(act.dtype)[:, None, :].expand(-1, x_t.shape[1], -1)
        act = ex.time_mlp_out(F.silu(ex.time_mlp_in(torch.cat([act, temb], dim=-1))))
        suffix = torch.cat([ex.state_in(state)[:, None, :], act], dim=1) + ex.action_pos.weight
        p = kvs[0][0].shape[2]
        mask = torch.cat([self.suffix_mask.new_ones(suffix.shape[1], p), self.suffix_mask], dim=1)
        for block, (k, v) in zip(ex.blocks, kvs):
            suffix = block(suffix, k, v, mask)
        return ex.action_out(ex.norm(suffix[:, 1:]))

    def velocity(self, obs: torch.Tensor, state: torch.Tensor, tokens: torch.Tensor,
                 x_t: torch.Tensor, time: torch.Tensor) -> torch.Tensor:
        """Predicts the flow velocity (:meth:`prefix_kv` then :meth:`suffix_velocity`).

        Args:
            obs: Images or ``env_state``, as in :meth:`prefix_kv`.
            state: float [B, state_dim], normalized.
            tokens: int64 [B, L].
            x_t: float [B, H, action_dim], the noisy action chunk.
            time: float [B] in (0, 1].

        Returns:
            float [B, H, action_dim], the predicted ``noise - actions``.
        """
        return self.suffix_velocity(self.prefix_kv(obs, tokens), state, x_t, time)

    @torch.no_grad()
    def sample_actions(self, obs: torch.Tensor, state: torch.Tensor, tokens: torch.Tensor,
                       noise: torch.Tensor, steps: int = 10) -> torch.Tensor:
        """Samples an action chunk by integrating the flow-matching ODE with Euler steps.

        Pi0's sampler (Black et al. 2024, Sec. IV): start at ``x_1 = noise`` (t = 1) and step
        ``x <- x - dt * v(x, t)`` with ``dt = 1 / steps`` down to t = 0; the prefix keys/values
        are computed once.

        Args:
            obs: Images or ``env_state``, as in :meth:`prefix_kv`.
            state: float [B, state_dim], normalized.
            tokens: int64 [B, L].
            noise: float [B, H, action_dim], a standard normal draw (the caller seeds it).
            steps: Euler steps (>= 1).

        Returns:
            float [B, H, action_dim], actions in the training data's units (``data.DataConfig.action_mode``).

        Raises:
            ValueError: If ``steps < 1``.
        """
        if steps < 1:
            raise ValueError(f"dmuon.train: sample_actions steps={steps}; must be >= 1.")
        kvs = self.prefix_kv(obs, tokens)
        x = noise
        dt = 1.0 / steps
        for i in range(steps):
            t = torch.full((x.shape[0],), 1.0 - i * dt, dtype=x.dtype, device=x.device)
            x = x - dt * self.suffix_velocity(kvs, state, x, t)
        return x

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Flow-matching loss of a batch from :meth:`dmuon.train.data.PushTDemos.batch`.

        Returns:
            float scalar: mean over batch, horizon and action features of
            ``(v_pred - (noise - actions))^2``.
        """
        actions, noise = batch["actions"], batch["noise"]
        t = batch["time"][:, None, None]
        x_t = t * noise + (1.0 - t) * actions
        obs = batch["images"] if self.cfg.obs == "image" else batch["env_state"]
        pred = self.velocity(obs, batch["state"], batch["tokens"], x_t, batch["time"])
        return F.mse_loss(pred, noise - actions)
