"""A small model with the shapes distributed Muon keeps tripping on, its data, and references.

Shapes: an embedding (AdamW), LayerNorms and biases (AdamW), matrices of several shapes
including dimensions not divisible by 2 or 4 (7, 13), a ``[1, 12]`` matrix (the head) and a
tall one (``[20, 12]``). The references are single-process ``torch.optim.Muon`` +
``torch.optim.AdamW`` on the concatenated global batch: independent of dmuon's code.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
from torch import nn

from tests import ns_accumulation

VOCAB, WIDTH, SEQ, LOCAL_BATCH = 11, 12, 5, 3
MUON_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


class Block(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(self.ln(x))))


class BlocksNet(nn.Module):
    """An embedding, ``blocks()`` applied in turn (an ``nn.ModuleList``), a scalar head
    averaged over tokens: the shape of most test models (built in that order, so the seeded
    initialisation does not depend on who builds it)."""

    def __init__(self, vocab: int, width: int, blocks: Callable[[], list[nn.Module]]) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(blocks())
        self.head = nn.Linear(width, 1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x).mean(dim=(1, 2))


class Net(nn.Module):
    """``variant``: "" (plain), "frozen" (one matrix and one LayerNorm frozen), "unused" (a
    matrix never used in forward), "tied" (an output projection tied to the embedding),
    "reversed" (the blocks run last to first: execution order is not registration order)."""

    def __init__(self, variant: str = "") -> None:
        super().__init__()
        self.variant = variant
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([Block(WIDTH, 7), Block(WIDTH, 20), Block(WIDTH, 13)])
        self.head = nn.Linear(WIDTH, 1)
        if variant == "frozen":
            self.blocks[1].fc1.weight.requires_grad_(False)
            self.blocks[0].ln.weight.requires_grad_(False)
        elif variant == "unused":
            self.spare = nn.Linear(WIDTH, 9, bias=False)
        elif variant == "tied":
            self.out = nn.Linear(WIDTH, VOCAB, bias=False)
            self.out.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in (reversed(self.blocks) if self.variant == "reversed" else self.blocks):
            x = block(x)
        y = self.head(x).mean(dim=(1, 2))
        if self.variant == "tied":
            y = y + 0.1 * self.out(x).mean(dim=(1, 2))
        return y


def make_model(seed: int = 0, variant: str = "") -> Net:
    torch.manual_seed(seed)
    return Net(variant)


def matrix_names(model: nn.Module) -> list[str]:
    """Names of the parameters Muon takes (2-D, trainable, not the embedding)."""
    return [n for n, p in model.named_parameters()
            if p.ndim == 2 and p.requires_grad and not n.startswith("emb")]


def global_batch(step: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: ``world_size * LOCAL_BATCH`` sequences and targets."""
    g = torch.Generator().manual_seed(1000 + step)
    n = LOCAL_BATCH * world_size
    return torch.randint(0, VOCAB, (n, SEQ), generator=g), torch.randn(n, generator=g)


def local_batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx, y = global_batch(step, world_size)
    sl = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    return idx[sl], y[sl]


def loss_fn(model: nn.Module, idx: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(idx) - y) ** 2).mean()


def _ns_reference(dtype: torch.dtype, coefficients: list[tuple[float, float, float]] | None,
                  fp32_accumulate: bool = False):
    """torch.optim.Muon's iteration op for op, in ``dtype`` and with per-step coefficients.

    ``fp32_accumulate``: every product reads ``dtype`` operands, accumulates in fp32 and rounds
    once (tests/ns_accumulation.py), as on a GPU, instead of whatever the CPU's kernels do.
    """

    def zeropower(grad, ns_coefficients, ns_steps, eps):
        coeffs = coefficients or [tuple(ns_coefficients)] * ns_steps
        x = grad.to(dtype)
        if grad.size(0) > grad.size(1):
            x = x.T
        x = x / x.norm().clamp(min=eps)
        for a, b, c in coeffs[:ns_steps]:
            if fp32_accumulate:
                gram = ns_accumulation.mm(x, x.T)
                x = ns_accumulation.mm(ns_accumulation.mm(gram, gram, gram, beta=b, alpha=c), x, x, beta=a)
                continue
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        if grad.size(0) > grad.size(1):
            x = x.T
        return x.to(grad.dtype)

    return zeropower


@contextlib.contextmanager
def reference_ns(dtype: torch.dtype | None, coefficients=None, fp32_accumulate: bool = False) -> Iterator[None]:
    """Within the block, ``torch.optim.Muon`` iterates in ``dtype`` (None: unchanged, bf16)."""
    import torch.optim._muon as muon_module

    original = muon_module._zeropower_via_newtonschulz
    if dtype is not None:
        muon_module._zeropower_via_newtonschulz = _ns_reference(dtype, coefficients, fp32_accumulate)
    try:
        yield
    finally:
        muon_module._zeropower_via_newtonschulz = original


def run_reference(
    world_size: int,
    steps: int,
    *,
    lr: float = 0.02,
    adamw_lr: float = 0.01,
    weight_decay: float = 0.1,
    ns_dtype: torch.dtype | None = torch.float32,
    coefficients=None,
    clip: float | None = None,
    lr_gamma: float | None = None,
    micro_batches: int = 1,
    variant: str = "",
    fp32_accumulate: bool = False,
    muon_kwargs: dict | None = None,
    grad_scale: float | None = None,
    ema_decay: float | None = None,
    out: dict | None = None,
) -> tuple[dict[str, torch.Tensor], list[float], list[float]]:
    """Single-process Muon + AdamW on the global batch.

    ``muon_kwargs``: more ``torch.optim.Muon`` keyword arguments (``nesterov``, ``adjust_lr_fn``).

    ``grad_scale``: every gradient multiplied by it after backward (before the clip).
    ``ema_decay``: an exponential moving average of every parameter, updated after each step
    (``ema.lerp_(p, 1 - decay)``, starting from the initial weights), stored in ``out["ema"]``.

    ``fp32_accumulate`` (with an ``ns_dtype``): the iteration's products accumulate in fp32
    whatever the CPU's kernels do (tests/ns_accumulation.py).

    Returns:
        Final parameters by name, the per-step losses, and the per-step total grad norms
        (when ``clip`` is set).
    """
    model = make_model(variant=variant)
    names = set(matrix_names(model))
    mats = [p for n, p in model.named_parameters() if n in names]
    rest = [p for n, p in model.named_parameters() if n not in names and p.requires_grad]
    muon = torch.optim.Muon(mats, lr=lr, weight_decay=weight_decay, ns_coefficients=MUON_COEFFICIENTS,
                            **(muon_kwargs or {}))
    adamw = torch.optim.AdamW(rest, lr=adamw_lr, weight_decay=weight_decay)
    scheds = []
    if lr_gamma is not None:
        scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=lr_gamma) for o in (muon, adamw)]
    losses, norms = [], []
    ema = {n: p.detach().clone() for n, p in model.named_parameters()}
    with reference_ns(ns_dtype, coefficients, fp32_accumulate):
        for step in range(steps):
            idx, y = global_batch(step, world_size)
            for chunk_idx, chunk_y in zip(idx.chunk(micro_batches), y.chunk(micro_batches)):
                loss = loss_fn(model, chunk_idx, chunk_y) / micro_batches
                loss.backward()
            losses.append(loss.item())
            if grad_scale is not None:
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.mul_(grad_scale)
            if clip is not None:
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
            muon.step()
            adamw.step()
            muon.zero_grad()
            adamw.zero_grad()
            for s in scheds:
                s.step()
            if ema_decay is not None:
                for n, p in model.named_parameters():
                    ema[n].lerp_(p.detach(), 1 - ema_decay)
    if out is not None:
        out["ema"] = ema
    return {n: p.detach().clone() for n, p in model.named_parameters()}, losses, norms
