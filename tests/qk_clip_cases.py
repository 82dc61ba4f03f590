"""Rank functions and references for QK-clip on the attention users have (issue 45):
tests/test_qk_clip.py.

The references are written from the formulas, not from dmuon's code:

* :func:`hf_max_logits`: a Hugging Face attention module's per-head max logit, recomputed in a
  forward pre-hook from its input: ``q = RoPE(norm(W_q x + b_q))`` (the norm where the model has a
  QK-norm, over one head's ``head_dim`` or over all heads), the same for ``k``, then
  ``max q_i . k_j * scaling`` over causal pairs (query head ``h`` reads key head
  ``h // (heads / kv_heads)``);
* :func:`mha_max_logits`: ``nn.MultiheadAttention``'s, from ``in_proj_weight`` / ``in_proj_bias``;
* :func:`expected_clip`: Kimi K2's MuonClip with Megatron's GQA rule, for groups whose max ``S``
  is finite and above ``tau`` only: ``eta = tau / S``, query rows (and bias entries)
  ``*= eta ** alpha``, key rows ``*= eta ** (1 - alpha)``; every other row unchanged.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon

TAU_RTOL = 1e-5
BATCH, SEQ, VOCAB = 2, 7, 40
CLIP_ONLY = dict(lr=0.0, weight_decay=0.0, adamw_lr=0.0, adamw_weight_decay=0.0, ns_method="standard",
                 ns_dtype=torch.float32, ns_coefficients="muon")


# ------------------------------------------------------------------ models
def hf_model(kind: str, seed: int = 0) -> nn.Module:
    """A tiny two-layer causal LM from ``transformers`` built from its config (no hub): Llama
    (plain), Qwen2 (q/k/v biases), Qwen3 (per-head-dim QK-norm), OLMo 2 (QK-norm over all
    heads) or Gemma 3 (QK-norm with a ``1 + weight`` gain). GQA: 4 query heads, 2 key heads."""
    import transformers

    common = dict(hidden_size=32, intermediate_size=16, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=64,
                  tie_word_embeddings=False, attn_implementation="sdpa")
    configs = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {}),
        "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM, {}),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
                   dict(query_pre_attn_scalar=8, sliding_window=64)),
    }
    config_cls, model_cls, extra = configs[kind]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**common, **extra))
    with torch.no_grad():  # logits well above 1 (tiny random models sit near 0)
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                proj.weight.mul_(4.0)
                if proj.bias is not None:
                    proj.bias.normal_(0.0, 1.0)
            for norm in (getattr(layer.self_attn, "q_norm", None), getattr(layer.self_attn, "k_norm", None)):
                if norm is not None:  # gains away from their init, so the norm's rule matters
                    norm.weight.add_(0.5 * torch.rand_like(norm.weight))
    return model


class MHABlock(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)  # in_proj_bias on
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + torch.tanh(self.fc(x))


class MHANet(nn.Module):
    """Embedding, two ``nn.MultiheadAttention`` blocks (4 heads of 6), a vocabulary head."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(VOCAB, 24)
        self.layers = nn.ModuleList([MHABlock(24, 4) for _ in range(2)])
        self.head = nn.Linear(24, VOCAB)
        with torch.no_grad():
            for block in self.layers:
                block.attn.in_proj_weight[:48].mul_(4.0)
                block.attn.in_proj_bias[:48].normal_(0.0, 1.0)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.layers:
            x = block(x)
        return self.head(x)


def blocks_of(model: nn.Module) -> list[nn.Module]:
    return list(model.model.layers) if hasattr(model, "model") else list(model.layers)


def attentions(model: nn.Module) -> list[nn.Module]:
    return [b.self_attn if hasattr(b, "self_attn") else b.attn for b in blocks_of(model)]


# ------------------------------------------------------------------ references
def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _causal_max(q: torch.Tensor, k: torch.Tensor, scaling: float) -> torch.Tensor:
    """``[heads]``: max over batch and causal pairs of ``q_i . k_j * scaling``; q ``[B, H, L, D]``,
    k ``[B, KV, L, D]``."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = (q.double() @ k.double().transpose(-1, -2)) * scaling
    keep = torch.ones(s.shape[-2:], dtype=torch.bool).tril()
    return s.masked_fill(~keep, float("-inf")).amax(dim=(0, 2, 3))


@torch.no_grad()
def hf_max_logits(attn: nn.Module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    b, n, _ = hidden.shape
    d = attn.head_dim

    def side(proj: nn.Linear, norm: nn.Module | None) -> torch.Tensor:
        y = proj(hidden)
        if norm is not None and norm.weight.numel() != d:  # OLMo 2: over all heads at once
            y = norm(y)
        y = y.view(b, n, -1, d)
        if norm is not None and norm.weight.numel() == d:  # Qwen3, Gemma 3: each head
            y = norm(y)
        y = y.transpose(1, 2)
        return y * cos.unsqueeze(1) + _rotate_half(y) * sin.unsqueeze(1)

    q = side(attn.q_proj, getattr(attn, "q_norm", None))
    k = side(attn.k_proj, getattr(attn, "k_norm", None))
    return _causal_max(q, k, attn.scaling)


@torch.no_grad()
def mha_max_logits(mha: nn.MultiheadAttention, x: torch.Tensor) -> torch.Tensor:
    e, h = mha.embed_dim, mha.num_heads
    w, bias = mha.in_proj_weight, mha.in_proj_bias
    q = F.linear(x, w[:e], bias[:e]).view(*x.shape[:2], h, -1).transpose(1, 2)
    k = F.linear(x, w[e: 2 * e], bias[e: 2 * e]).view(*x.shape[:2], h, -1).transpose(1, 2)
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(mha.head_dim)  # no mask
    return s.amax(dim=(0, 2, 3))


class MaxLogitProbe:
    """Pre-hooks that record each attention module's per-head max logit (the formulas above)
    on every forward, grad or not; ``take()`` returns ``[layers, heads]`` float64, MAX-reduced
    over the ranks, and resets.

    With ``replay`` set, each attention module runs on the input it had in the first recorded
    forward (the pre-hook substitutes it): clipping layer 0 changes layer 1's input, so "the
    same batch" means the same input to every attention module, the only input the clip's
    promise is about.
    """

    def __init__(self, model: nn.Module) -> None:
        self.seen: dict[int, torch.Tensor] = {}
        self.inputs: dict[int, tuple] = {}
        self.replay = False
        self.handles = []
        for i, attn in enumerate(attentions(model)):
            self.handles.append(attn.register_forward_pre_hook(self._hook(i), with_kwargs=True))

    def _hook(self, i: int):
        def hook(module, args, kwargs):
            if self.replay:
                args, kwargs = self.inputs[i]
            else:
                self.inputs.setdefault(i, (args, dict(kwargs)))
            if isinstance(module, nn.MultiheadAttention):
                value = mha_max_logits(module, args[0])
            else:
                cos, sin = kwargs["position_embeddings"]
                value = hf_max_logits(module, kwargs["hidden_states"], cos, sin)
            old = self.seen.get(i)
            self.seen[i] = value if old is None else torch.maximum(old, value)
            return (args, kwargs) if self.replay else None
        return hook

    def take(self) -> torch.Tensor:
        out = torch.stack([self.seen[i] for i in sorted(self.seen)])
        self.seen.clear()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(out, op=dist.ReduceOp.MAX)
        return out


def local_batch(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(4500 + rank)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def _loss(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    out = model(idx)
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))


def _shard(model: nn.Module, world_size: int, fsdp: bool):
    mesh = init_device_mesh("cpu", (world_size,))
    if fsdp:
        for block in blocks_of(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    dmuon.dedicate_params(model, mesh, group_cost=0.0)
    return mesh


def clip_only(rank: int, world_size: int, *, kind: str, fsdp: bool = True, alpha: float = 0.5) -> dict:
    """One clip-only step (every learning rate and weight decay 0) with ``tau`` at half the
    smallest layer's max logit of the step's batch (so every layer clips); the same batch's
    max logits before and after (each attention module on its pre-step input),
    from :class:`MaxLogitProbe`.

    Returns:
        ``before`` / ``after``: ``[layers, heads]`` max logits (lists); ``tau``; ``nonfinite``:
        names of parameters holding inf / NaN after the step (local pieces).
    """
    model = MHANet() if kind == "mha" else hf_model(kind)
    _shard(model, world_size, fsdp)
    opt = dmuon.Muon(model, qk_clip_threshold=1e9, qk_clip_alpha=alpha, **CLIP_ONLY)
    probe = MaxLogitProbe(model)
    idx = local_batch(rank)
    loss = _loss(model, idx)
    before = probe.take()
    tau = 0.5 * float(before.amax(dim=1).min())
    opt.param_groups[0]["qk_clip_threshold"] = tau
    loss.backward()
    opt.step()
    opt.zero_grad()
    probe.replay = True
    with torch.no_grad():
        _loss(model, idx)
    after = probe.take()
    nonfinite = [n for n, p in model.named_parameters() if p.numel() and not torch.isfinite(
        p.to_local() if hasattr(p, "to_local") else p).all()]
    return dict(before=before.tolist(), after=after.tolist(), tau=tau, nonfinite=nonfinite)


# ------------------------------------------------------------------ GQA with degenerate groups
HEADS, KV, HEAD_DIM, WIDTH = 6, 3, 4, 8


class EdgeAttention(nn.Module):
    """Llama-named GQA attention (6 query heads, 3 key heads, q/k biases) with eager softmax.

    KV group 0 can only produce logits < 0 (inputs > 0, its query rows and biases > 0, its key
    rows and bias < 0); KV group 1 is masked everywhere (max ``-inf``; its rows attend to
    nothing and output 0); KV group 2 is an ordinary group with large logits.
    """

    def __init__(self) -> None:
        super().__init__()
        self.num_heads, self.num_key_value_heads, self.head_dim = HEADS, KV, HEAD_DIM
        self.q_proj = nn.Linear(WIDTH, HEADS * HEAD_DIM)
        self.k_proj = nn.Linear(WIDTH, KV * HEAD_DIM)
        self.v_proj = nn.Linear(WIDTH, KV * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, WIDTH, bias=False)
        g = HEADS // KV
        with torch.no_grad():
            q0 = slice(0, g * HEAD_DIM)
            self.q_proj.weight[q0] = self.q_proj.weight[q0].abs() + 0.1
            self.q_proj.bias[q0] = self.q_proj.bias[q0].abs() + 0.1
            self.k_proj.weight[:HEAD_DIM] = -(self.k_proj.weight[:HEAD_DIM].abs() + 0.1)
            self.k_proj.bias[:HEAD_DIM] = -(self.k_proj.bias[:HEAD_DIM].abs() + 0.1)
            self.q_proj.weight[2 * g * HEAD_DIM:].mul_(6.0)
            self.k_proj.weight[2 * HEAD_DIM:].mul_(6.0)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, HEADS, HEAD_DIM).transpose(1, 2)
        k = self.k_proj(x).view(b, n, KV, HEAD_DIM).transpose(1, 2).repeat_interleave(HEADS // KV, dim=1)
        s = q @ k.transpose(-1, -2) / math.sqrt(HEAD_DIM)
        masked = torch.zeros(HEADS, 1, 1, dtype=torch.bool)
        masked[2:4] = True  # KV group 1's query heads see nothing
        return s.masked_fill(masked, float("-inf"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        s = self.logits(x)
        p = torch.softmax(s, dim=-1)
        p = torch.where(torch.isfinite(s).any(dim=-1, keepdim=True), p, torch.zeros_like(p))
        v = self.v_proj(x).view(b, n, KV, HEAD_DIM).transpose(1, 2).repeat_interleave(HEADS // KV, dim=1)
        return self.o_proj((p @ v).transpose(1, 2).reshape(b, n, -1))


class EdgeBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = EdgeAttention()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x + self.self_attn(x)).relu() + 0.1  # stays > 0 for the next block


class EdgeNet(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList([EdgeBlock() for _ in range(2)])
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block(x)
        return self.head(x).mean()


def edge_input(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(4600 + rank)
    return torch.rand(BATCH, SEQ, WIDTH, generator=g) + 0.1


def expected_clip(weights: dict[str, torch.Tensor], maxima: torch.Tensor, tau: float, alpha: float
                  ) -> dict[str, torch.Tensor]:
    """Kimi K2's rule with Megatron's GQA groups, only where ``S_g`` is finite and ``> tau``."""
    out = {k: v.clone() for k, v in weights.items()}
    group = HEADS // KV
    for layer, heads in enumerate(maxima):
        for g in range(KV):
            s = float(heads[g * group:(g + 1) * group].max())
            if not (math.isfinite(s) and s > tau):
                continue
            eta = tau / s
            for attr, rows, power in (("q_proj", slice(g * group * HEAD_DIM, (g + 1) * group * HEAD_DIM), alpha),
                                      ("k_proj", slice(g * HEAD_DIM, (g + 1) * HEAD_DIM), 1 - alpha)):
                for kind in ("weight", "bias"):
                    out[f"layers.{layer}.self_attn.{attr}.{kind}"][rows] *= eta ** power
    return out


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (FSDP2 DTensors gathered; dmuon's masters through state_dict)."""
    out = {}
    for name, value in model.state_dict().items():
        out[name] = (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().clone()
    return out


def degenerate_groups(rank: int, world_size: int, *, fsdp: bool = True, alpha: float = 0.3) -> dict:
    """:class:`EdgeNet`, one clip-only step with tau at half of group 2's max: dmuon's weights
    against :func:`expected_clip` of the weights before, and the warnings dmuon logged."""
    model = EdgeNet()
    _shard(model, world_size, fsdp)
    opt = dmuon.Muon(model, qk_clip_threshold=1e9, qk_clip_alpha=alpha, **CLIP_ONLY)
    seen: list[torch.Tensor] = []
    handles = [b.self_attn.register_forward_pre_hook(
        lambda m, args: seen.append(m.logits(args[0]).detach().amax(dim=(0, 2, 3)))) for b in model.layers]
    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handler = Keep(level=logging.WARNING)
    logging.getLogger("dmuon").addHandler(handler)
    try:
        before = _full(model)
        model(edge_input(rank)).backward()
        maxima = torch.stack(seen)
        if world_size > 1:
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
        tau = 0.5 * float(maxima[:, 4:].max(dim=1).values.min())
        opt.param_groups[0]["qk_clip_threshold"] = tau
        opt.step()
        opt.zero_grad()
    finally:
        logging.getLogger("dmuon").removeHandler(handler)
        for h in handles:
            h.remove()
    after = _full(model)
    want = expected_clip(before, maxima, tau, alpha)
    return dict(maxima=maxima.tolist(), tau=tau, messages=messages,
                after={k: v.numpy() for k, v in after.items()}, want={k: v.numpy() for k, v in want.items()},
                before={k: v.numpy() for k, v in before.items()})


# ------------------------------------------------------------------ attention outside the module
class OutsideBlock(nn.Module):
    """Its ``attn`` holds Llama-named projections, but the block computes the attention itself
    (as LeRobot's pi0 does for its VLM layers): the attention module's forward never runs."""

    def __init__(self, observe: int = 0) -> None:
        super().__init__()
        self.attn = nn.Module()
        self.attn.num_heads, self.attn.num_key_value_heads, self.attn.head_dim = 4, 2, 4
        for name, rows in (("q_proj", 16), ("k_proj", 8), ("v_proj", 8)):
            setattr(self.attn, name, nn.Linear(16, rows, bias=False))
        self.out = nn.Linear(16, 16, bias=False)
        self.observe = observe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.attn.q_proj(x).view(b, n, 4, 4).transpose(1, 2)
        k = self.attn.k_proj(x).view(b, n, 2, 4).transpose(1, 2)
        v = self.attn.v_proj(x).view(b, n, 2, 4).transpose(1, 2)
        if self.observe:  # what the error tells such code to do
            dmuon.qk_clip.observe(self.attn, dmuon.qk_clip.max_logits(q, k, is_causal=True)[:self.observe])
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return x + self.out(o.transpose(1, 2).reshape(b, n, 16))


class OutsideNet(nn.Module):
    def __init__(self, observe: int = 0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([OutsideBlock(observe) for _ in range(2)])
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block(x)
        return self.head(x).mean()


def nothing_recorded(rank: int, world_size: int, *, observe: int = 0) -> dict:
    """One step of :class:`OutsideNet` with ``qk_clip_threshold`` set (Muon lr 0.02): the error
    (or ``None``), and which parameters changed. ``observe``: the blocks pass that many head
    maxima (of 4) to ``dmuon.qk_clip.observe`` on rank 0 (on every rank with ``observe=4``)."""
    model = OutsideNet(observe if observe == 4 or rank == 0 else 0)
    _shard(model, world_size, fsdp=True)
    opt = dmuon.Muon(model, lr=0.02, adamw_lr=0.01, qk_clip_threshold=0.5)
    g = torch.Generator().manual_seed(4700 + rank)
    model(torch.randn(BATCH, SEQ, 16, generator=g)).backward()
    before = _full(model)
    error = None
    try:
        opt.step()
    except RuntimeError as exc:
        error = str(exc)
    after = _full(model)
    changed = sorted(k for k in before if not torch.equal(before[k], after[k]))
    return dict(error=error, changed=changed)


# ------------------------------------------------------------------ pieces of biases under FSDP x TP
def local_rows_pieces(rank: int, world_size: int) -> dict:
    """On a ("dp", "tp") = (2, 2) mesh, a ``Linear(6, 10)`` made ``ColwiseParallel`` (weight and
    bias ``Shard(0)`` over tp: 5 rows each) then ``fully_shard`` over dp (``_StridedShard``:
    3 + 2 rows), and a plain FSDP2 ``Linear(6, 5)``: for every parameter, the rows
    :func:`dmuon.owners.slices.local_rows` names must be the ones the local piece holds (values
    ``arange`` by row, so a row's value is its index).

    Returns:
        ``bad``: the mismatches; ``placements``: every parameter's placement type names.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from dmuon.owners.slices import local_rows, local_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = nn.Sequential(nn.Linear(6, 10), nn.Linear(10, 5))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.arange(p.shape[0], dtype=p.dtype).view(-1, *([1] * (p.dim() - 1))).expand_as(p))
    parallelize_module(model[0], mesh["tp"], ColwiseParallel())
    fully_shard(model[0], mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    bad = []
    for name, p in model.named_parameters():
        local = local_tensor(p)
        rows = local_rows(p)
        want = rows.to(local.dtype).view(-1, *([1] * (local.dim() - 1))).expand_as(local)
        if local.shape[0] != rows.numel() or not torch.equal(local, want):
            bad.append(f"rank {rank} {name} {p.placements}: rows {rows.tolist()} vs local "
                       f"{local.reshape(local.shape[0], -1)[:, 0].tolist()}")
    return dict(bad=bad, placements=sorted({type(pl).__name__ for p in model.parameters() for pl in p.placements}))


def plan_is_frozen(rank: int, world_size: int) -> dict:
    """:class:`EdgeNet` on the replicated path: ``prepare`` outside a step gives a frozen plan;
    after it, the param group's threshold is changed and the live masters and biases are scaled
    by ``scale_master`` and ``scale_others`` (as ``step()``); a *copy* of the master taken before
    is scaled by ``scale_master`` on a worker thread. Both must equal the formula of the
    threshold ``prepare`` saw."""
    import dataclasses
    import threading

    model = EdgeNet()
    _shard(model, world_size, fsdp=False)
    opt = dmuon.Muon(model, qk_clip_threshold=1e9, qk_clip_alpha=0.3, **CLIP_ONLY)
    seen: list[torch.Tensor] = []
    handles = [b.self_attn.register_forward_pre_hook(
        lambda m, args: seen.append(m.logits(args[0]).detach().amax(dim=(0, 2, 3)))) for b in model.layers]
    model(edge_input(rank)).backward()
    for h in handles:
        h.remove()
    maxima = torch.stack(seen)
    tau = 0.5 * float(maxima[:, 4:].max(dim=1).values.min())
    group = opt.param_groups[0]
    group["qk_clip_threshold"] = tau
    before = _full(model)
    clip = opt.strategy.qk_clip
    plan = clip.prepare(group)
    frozen = False
    try:
        plan.others = ()
    except dataclasses.FrozenInstanceError:
        frozen = True
    group["qk_clip_threshold"] = 1e-3  # read at prepare, never again
    rec = next(r for r in opt.state_ctx.records if r.fqn == "layers.0.self_attn.q_proj.weight")
    copy = rec.master.detach().clone()
    worker = threading.Thread(target=plan.scale_master, args=(rec, copy))
    worker.start()
    worker.join()
    for r in opt.state_ctx.records:  # every owned master, then the biases
        plan.scale_master(r, r.master.data)
    plan.scale_others()
    want = expected_clip(before, maxima, tau, 0.3)
    return dict(frozen=frozen, clipped=clip.clipped_heads, thread=copy.numpy(),
                live=rec.master.detach().numpy().copy(), full=_full(model)["layers.0.self_attn.q_proj.bias"].numpy(),
                want=want["layers.0.self_attn.q_proj.weight"].numpy(),
                want_bias=want["layers.0.self_attn.q_proj.bias"].numpy())
