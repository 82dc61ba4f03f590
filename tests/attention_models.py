"""A tiny two-block transformer for per-head Muon and QK-clip (issue 40), its data, and the
single-process references, written from the formulas (not from dmuon's code).

Block 0: Hugging Face Llama-style attention (``q_proj`` / ``k_proj`` / ``v_proj`` / ``o_proj``,
grouped-query: 4 query heads, 2 key/value heads, head_dim 3) through
``F.scaled_dot_product_attention``. Block 1: torchtitan-style fused ``wqkv`` (KV-group-major:
per group its 2 query heads, its key head, its value head) with eager softmax attention. Both
heads counts are read with ``view(..., -1, ...)`` so a TP rank runs its local heads.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tests import models

VOCAB, WIDTH, SEQ, LOCAL_BATCH = 11, 12, 6, 2
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 3
GROUP = HEADS // KV_HEADS


def causal_logits(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``[B, H, L, L]`` scaled logits with ``-inf`` above the diagonal (GQA: key head
    ``h // GROUP``)."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    keep = torch.ones(s.shape[-2:], dtype=torch.bool).tril()
    return s.masked_fill(~keep, float("-inf"))


class LlamaAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.num_heads, self.num_key_value_heads, self.head_dim = HEADS, KV_HEADS, HEAD_DIM
        self.q_proj = nn.Linear(WIDTH, HEADS * HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(WIDTH, KV_HEADS * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(WIDTH, KV_HEADS * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, WIDTH, bias=False)
        self.track: list | None = None  # the reference's own record of the max logits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, -1, HEAD_DIM).transpose(1, 2)
        k = self.k_proj(x).view(b, n, -1, HEAD_DIM).transpose(1, 2)
        v = self.v_proj(x).view(b, n, -1, HEAD_DIM).transpose(1, 2)
        if self.track is not None:
            self.track.append(causal_logits(q.detach(), k.detach()).amax(dim=(0, 2, 3)))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


class FusedAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = HEADS, KV_HEADS, HEAD_DIM
        self.wqkv = nn.Linear(WIDTH, (HEADS + 2 * KV_HEADS) * HEAD_DIM, bias=False)
        self.wo = nn.Linear(HEADS * HEAD_DIM, WIDTH, bias=False)
        self.track: list | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        qkv = self.wqkv(x).view(b, n, -1, GROUP + 2, HEAD_DIM)
        q = qkv[:, :, :, :GROUP].reshape(b, n, -1, HEAD_DIM).transpose(1, 2)
        k = qkv[:, :, :, GROUP].transpose(1, 2)
        v = qkv[:, :, :, GROUP + 1].transpose(1, 2)
        s = causal_logits(q, k)
        if self.track is not None:
            self.track.append(s.detach().amax(dim=(0, 2, 3)))
        p = torch.softmax(s, dim=-1)
        out = p @ v.repeat_interleave(GROUP, dim=1)
        return self.wo(out.transpose(1, 2).reshape(b, n, -1))


class Block(nn.Module):
    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(WIDTH)
        self.attn = attn
        self.fc = nn.Linear(WIDTH, 7)
        self.out = nn.Linear(7, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln(x))
        return x + self.out(torch.tanh(self.fc(x)))


def make_model(seed: int = 0, gain: float = 1.0) -> nn.Module:
    """``gain`` scales the q / k projections at init (large logits for QK-clip)."""
    torch.manual_seed(seed)
    model = models.BlocksNet(VOCAB, WIDTH, lambda: [Block(LlamaAttention()), Block(FusedAttention())])
    with torch.no_grad():
        model.blocks[0].attn.q_proj.weight.mul_(gain)
        model.blocks[0].attn.k_proj.weight.mul_(gain)
        model.blocks[1].attn.wqkv.weight.mul_(gain)
    return model


def global_batch(step: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    n = LOCAL_BATCH * world_size
    return torch.randint(0, VOCAB, (n, SEQ), generator=g), torch.randn(n, generator=g)


def local_batch(step: int, index: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx, y = global_batch(step, count)
    sl = slice(index * LOCAL_BATCH, (index + 1) * LOCAL_BATCH)
    return idx[sl], y[sl]


def head_rows() -> dict[str, list[tuple[str, int]]]:
    """Rows of each head, by parameter: ``(kind, kv group)`` per ``HEAD_DIM`` rows, in order."""
    q = [("q", h // GROUP) for h in range(HEADS)]
    kv = [("k", g) for g in range(KV_HEADS)]
    fused = []
    for g in range(KV_HEADS):
        fused += [("q", g)] * GROUP + [("k", g), ("v", g)]
    return {"blocks.0.attn.q_proj.weight": q, "blocks.0.attn.k_proj.weight": kv,
            "blocks.0.attn.v_proj.weight": [("v", g) for g in range(KV_HEADS)],
            "blocks.1.attn.wqkv.weight": fused}


def run_reference(world_size: int, steps: int, *, per_head: bool, tau: float | None = None,
                  alpha: float = 0.5, micro_batches: int = 1, gain: float = 1.0,
                  lr: float = 0.02, adamw_lr: float = 0.01, weight_decay: float = 0.1
                  ) -> tuple[dict[str, torch.Tensor], list[int]]:
    """Single-process ``torch.optim.Muon`` (fp32 iteration) + AdamW on the global batch.

    ``per_head``: every head block of the q / k / v weights is an ``nn.Parameter`` of its own
    that ``torch.optim.Muon`` steps (values and gradients copied between the blocks and the
    model). ``tau``: after each step, Kimi's MuonClip with Megatron's GQA rule, from the logits
    the model's forwards recorded (``eta_g = min(1, tau / max over group g's query heads)``;
    q rows ``*= eta_g ** alpha``, k rows ``*= eta_g ** (1 - alpha)``).

    Returns:
        Final parameters by name, and per step how many key/value groups were clipped.
    """
    model = make_model(gain=gain)
    named = dict(model.named_parameters())
    mats = [n for n, p in named.items() if p.ndim == 2 and not n.startswith("emb")]
    rows = head_rows()
    blocks: dict[str, list[nn.Parameter]] = {}
    muon_params = []
    for name in mats:
        if per_head and name in rows:
            blocks[name] = [nn.Parameter(c.detach().clone()) for c in named[name].split(HEAD_DIM)]
            muon_params += blocks[name]
        else:
            muon_params.append(named[name])
    rest = [p for n, p in named.items() if n not in mats]
    muon = torch.optim.Muon(muon_params, lr=lr, weight_decay=weight_decay,
                            ns_coefficients=models.MUON_COEFFICIENTS)
    adamw = torch.optim.AdamW(rest, lr=adamw_lr, weight_decay=weight_decay)
    attns = [model.blocks[0].attn, model.blocks[1].attn]
    clipped: list[int] = []
    with models.reference_ns(torch.float32):
        for step in range(steps):
            for a in attns:
                a.track = []
            idx, y = global_batch(step, world_size)
            for ci, cy in zip(idx.chunk(micro_batches), y.chunk(micro_batches)):
                (((model(ci) - cy) ** 2).mean() / micro_batches).backward()
            for name, parts in blocks.items():
                for part, g in zip(parts, named[name].grad.split(HEAD_DIM)):
                    part.grad = g.clone()
            muon.step()
            adamw.step()
            clipped.append(0)
            with torch.no_grad():
                for name, parts in blocks.items():
                    named[name].copy_(torch.cat([p.detach() for p in parts]))
                if tau is not None:
                    for a, (qname, kname) in zip(attns, [("blocks.0.attn.q_proj.weight", "blocks.0.attn.k_proj.weight"),
                                                         ("blocks.1.attn.wqkv.weight",) * 2]):
                        s = torch.stack(a.track).amax(dim=0)
                        eta = [min(1.0, tau / float(s[g * GROUP:(g + 1) * GROUP].max())) for g in range(KV_HEADS)]
                        clipped[-1] += sum(e < 1 for e in eta)
                        for name, kinds in ((qname, "q"), (kname, "k")):
                            w = named[name].view(-1, HEAD_DIM, WIDTH)
                            for i, (kind, g) in enumerate(rows[name]):
                                if kind == kinds:
                                    w[i] *= eta[g] ** (alpha if kind == "q" else 1 - alpha)
                    for name, parts in blocks.items():  # the clip moved the blocks too
                        for part, w in zip(parts, named[name].split(HEAD_DIM)):
                            part.copy_(w)
            for o in (muon, adamw):
                o.zero_grad()
            for p in named.values():
                p.grad = None
    for a in attns:
        a.track = None
    return {n: p.detach().clone() for n, p in model.named_parameters()}, clipped
