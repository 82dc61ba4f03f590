"""Models nobody in this project wrote, trained with dmuon on gloo ranks (issue 14, item 7).

Each :class:`Case` builds a tiny, randomly initialised model (torch's ``nn.TransformerEncoder``,
Hugging Face ``transformers`` models from a config: no downloads), names the modules the user
would ``fully_shard`` (the blocks, then the root), its data and its loss. :func:`train` runs on
every rank of the test pool (``tests/_pool.py``); :func:`reference` is single-process
``torch.optim.Muon`` + ``torch.optim.AdamW`` on the global batch, with the Muon matrices listed
by name per case (``Case.embeddings`` are the 2-D weights left to AdamW), so it shares no code
with dmuon's selection or update.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from tests import models

WIDTH, VOCAB, SEQ, LOCAL_BATCH = 16, 32, 6, 2
OPT_KWARGS = dict(lr=0.02, adamw_lr=0.01, weight_decay=0.1, ns_method="standard",
                  ns_dtype=torch.float32, ns_coefficients="muon")


# ---------------------------------------------------------------------------- torch.nn models
class EncoderNet(nn.Module):
    """Embedding + ``nn.TransformerEncoder`` (``nn.MultiheadAttention`` inside) + a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        # bias=False: a key bias has an exactly zero gradient (softmax is shift-invariant), so
        # AdamW would turn rounding noise (~1e-10) into steps of ~lr/10 that differ run to run.
        layer = nn.TransformerEncoderLayer(WIDTH, nhead=2, dim_feedforward=24, dropout=0.0,
                                           batch_first=True, bias=False)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.emb(idx))).mean(dim=(1, 2))


class TwiceBlock(nn.Module):
    """Calls ``self.fc`` twice in one forward."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(torch.tanh(self.fc(self.ln(x))))
        return x + self.out(torch.tanh(h))


def twice_net() -> nn.Module:
    """Two :class:`TwiceBlock` blocks."""
    return models.BlocksNet(VOCAB, WIDTH, lambda: [TwiceBlock(), TwiceBlock()])


class ReuseNet(nn.Module):
    """One block applied three times across depth (weight sharing over layers), then another."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.shared = models.Block(WIDTH, 7)
        self.last = models.Block(WIDTH, 13)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for _ in range(3):
            x = self.shared(x)
        return self.head(self.last(x)).mean(dim=(1, 2))


# ------------------------------------------------------------------------------ the cases
@dataclass(frozen=True)
class Case:
    """A third-party model as a user would train it.

    Attributes:
        build: builds the model (called after ``torch.manual_seed``).
        blocks: the modules ``fully_shard`` is called on before the root.
        batch: ``batch(step, n)`` -> the global batch of ``n`` samples (tuple of tensors,
            batch first).
        loss: ``loss(model, *batch)`` -> scalar mean loss.
        embeddings: names (as ``named_parameters`` lists them) of the 2-D trainable weights
            that stay on AdamW: embedding tables (a tied head is listed once, by its first name).
        checkpointing: turns on activation checkpointing (``None``: the model has none).
    """

    build: Callable[[], nn.Module]
    blocks: Callable[[nn.Module], list[nn.Module]]
    batch: Callable[[int, int], tuple[torch.Tensor, ...]]
    loss: Callable[..., torch.Tensor]
    embeddings: tuple[str, ...]
    checkpointing: Callable[[nn.Module], None] | None = None


def _tokens_and_targets(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    return torch.randint(0, VOCAB, (n, SEQ), generator=g), torch.randn(n, generator=g)


def _tokens(step: int, n: int) -> tuple[torch.Tensor]:
    g = torch.Generator().manual_seed(3000 + step)
    return (torch.randint(0, VOCAB, (n, SEQ), generator=g),)


def _images(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(4000 + step)
    return torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 3, (n,), generator=g)


def _mse(model: nn.Module, idx: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(idx) - y) ** 2).mean()


def _causal_lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def _classifier_loss(model: nn.Module, pixels: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(pixel_values=pixels).logits, labels)


def _llama(tied: bool) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=24,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=2 * SEQ, tie_word_embeddings=tied)
    return LlamaForCausalLM(config)


def _vit() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=WIDTH,
                       num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
                       num_labels=3, qkv_bias=False)  # see EncoderNet: no key bias
    return ViTForImageClassification(config)


def _hf_checkpointing(model: nn.Module) -> None:
    # transformers 5.x's supported spelling; gradient_checkpointing_enable warns that it goes in v6.
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})


CASES: dict[str, Case] = {
    "torch-encoder": Case(build=EncoderNet, blocks=lambda m: list(m.encoder.layers),
                          batch=_tokens_and_targets, loss=_mse, embeddings=("emb.weight",)),
    "linear-twice": Case(build=twice_net, blocks=lambda m: list(m.blocks),
                         batch=_tokens_and_targets, loss=_mse, embeddings=("emb.weight",)),
    "block-reused": Case(build=ReuseNet, blocks=lambda m: [m.shared, m.last],
                         batch=_tokens_and_targets, loss=_mse, embeddings=("emb.weight",)),
    "hf-llama-untied": Case(build=lambda: _llama(False), blocks=lambda m: list(m.model.layers),
                            batch=_tokens, loss=_causal_lm_loss,
                            embeddings=("model.embed_tokens.weight",),
                            checkpointing=_hf_checkpointing),
    "hf-llama-tied": Case(build=lambda: _llama(True), blocks=lambda m: list(m.model.layers),
                          batch=_tokens, loss=_causal_lm_loss,
                          embeddings=("model.embed_tokens.weight",),
                          checkpointing=_hf_checkpointing),
    "hf-vit": Case(build=_vit, blocks=lambda m: list(m.vit.layers), batch=_images,
                   loss=_classifier_loss, embeddings=()),
}


def build(case: str, checkpointing: bool = False, seed: int = 0) -> nn.Module:
    c = CASES[case]
    torch.manual_seed(seed)
    model = c.build()
    model.train()
    if checkpointing:
        if c.checkpointing is None:
            raise ValueError(f"case {case!r} has no activation checkpointing")
        c.checkpointing(model)
    return model


def matrix_names(case: str, model: nn.Module) -> list[str]:
    """The reference's Muon matrices: 2-D trainable parameters not named in ``embeddings``."""
    skip = set(CASES[case].embeddings)
    return [n for n, p in model.named_parameters() if p.ndim == 2 and p.requires_grad and n not in skip]


def local_batch(case: str, step: int, rank: int, world_size: int) -> tuple[torch.Tensor, ...]:
    whole = CASES[case].batch(step, LOCAL_BATCH * world_size)
    return tuple(t[rank * LOCAL_BATCH:(rank + 1) * LOCAL_BATCH] for t in whole)


def contract_violations(model: nn.Module) -> list[str]:
    """Dedicated parameters that are not, outside forward/backward, the master on the owner
    and a zero-size placeholder elsewhere (the module must hold the record's ``master``)."""
    bad = []
    for rec in model._dmuon_state.records:
        held = rec.module._parameters[rec.attr]
        if held is not rec.master:
            bad.append(f"{rec.fqn}: module holds {tuple(held.shape)} (not the master)")
        elif rec.is_owner != (held.numel() > 0) or (rec.is_owner and tuple(held.shape) != rec.shape):
            bad.append(f"{rec.fqn}: master {tuple(held.shape)} on owner={rec.is_owner}")
    return bad


def train(rank: int, world_size: int, *, case: str, steps: int = 3,
          checkpointing: bool = False) -> dict[str, Any]:
    """``fully_shard`` each block and the root, dedicate, train ``steps`` with fp32 exact-mode
    Muon; return full params (rank 0), losses, the dedicated names and contract violations
    after each step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon
    from tests.dist_cases import full_params

    model = build(case, checkpointing)
    mesh = init_device_mesh("cpu", (world_size,))
    for block in CASES[case].blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    dmuon.dedicate_params(model, mesh, group_cost=0.0)  # owners spread inside every block
    opt = dmuon.Muon(model, **OPT_KWARGS)
    losses, violations = train_steps(model, opt, case, steps, rank, world_size)
    return dict(params=full_params(model, rank), losses=losses, violations=violations,
                dedicated=sorted(rec.fqn for rec in model._dmuon_state.records))


def train_steps(model: nn.Module, opt, case: str, steps: int, rank: int, world_size: int
                ) -> tuple[list[float], list[str]]:
    """``steps`` steps of ``case``'s loss; the losses and the contract violations after each."""
    losses, violations = [], []
    for step in range(steps):
        loss = CASES[case].loss(model, *local_batch(case, step, rank, world_size))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        violations += [f"step {step}: {v}" for v in contract_violations(model)]
    return losses, violations


def reference(case: str, world_size: int, steps: int = 3,
              initial: dict[str, Any] | None = None) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Single-process ``torch.optim.Muon`` (fp32 iteration) + ``AdamW`` on the global batch,
    from ``initial`` parameter values (by name) when given."""
    model = build(case)
    if initial is not None:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(torch.as_tensor(initial[n]))
    names = set(matrix_names(case, model))
    mats = [p for n, p in model.named_parameters() if n in names]
    rest = [p for n, p in model.named_parameters() if n not in names and p.requires_grad]
    muon = torch.optim.Muon(mats, lr=OPT_KWARGS["lr"], weight_decay=OPT_KWARGS["weight_decay"],
                            ns_coefficients=models.MUON_COEFFICIENTS)
    adamw = torch.optim.AdamW(rest, lr=OPT_KWARGS["adamw_lr"], weight_decay=OPT_KWARGS["weight_decay"])
    losses = []
    with models.reference_ns(torch.float32):
        for step in range(steps):
            loss = CASES[case].loss(model, *CASES[case].batch(step, LOCAL_BATCH * world_size))
            loss.backward()
            muon.step()
            adamw.step()
            muon.zero_grad()
            adamw.zero_grad()
            losses.append(loss.item())
    return {n: p.detach().clone() for n, p in model.named_parameters()}, losses


def predicate_across_fully_shard(rank: int, world_size: int, *, case: str) -> list[str]:
    """``dmuon.default_predicate`` built before ``fully_shard``, passed to ``dedicate_params``
    after it; returns the dedicated names."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon

    model = build(case)
    pick = dmuon.default_predicate(model)
    mesh = init_device_mesh("cpu", (world_size,))
    for block in CASES[case].blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    dmuon.dedicate_params(model, mesh, predicate=pick)
    return sorted(sel.fqn for sel in model._dmuon_state.selected)


# ------------------------------------------------------------------------- meta-device init
def own_init(model: nn.Module) -> None:
    """The model's own initialisation: Hugging Face ``init_weights()``, else every module's
    ``reset_parameters()``."""
    if hasattr(model, "config") and hasattr(model, "init_weights"):
        model.init_weights()
        return
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()


def meta_build(case: str, mesh: Any, *, dedicate: bool, dedicate_first: bool = False,
               muon_before_to_empty: bool = False) -> nn.Module:
    """The large-model flow: build on meta, ``fully_shard`` each block and the root,
    ``dedicate_params`` (when ``dedicate``; before ``fully_shard`` with ``dedicate_first``),
    ``to_empty(device="cpu")``, the model's own init under a fixed seed."""
    from torch.distributed.fsdp import fully_shard

    import dmuon

    with torch.device("meta"):
        model = CASES[case].build()
    if dedicate and dedicate_first:
        dmuon.dedicate_params(model, mesh, group_cost=0.0)
    for block in CASES[case].blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if dedicate and not dedicate_first:
        dmuon.dedicate_params(model, mesh, group_cost=0.0)
    if muon_before_to_empty:
        dmuon.Muon(model, **OPT_KWARGS)
    model.to_empty(device="cpu")
    torch.manual_seed(1)
    own_init(model)
    return model


def meta_init_train(rank: int, world_size: int, *, case: str, steps: int = 3,
                    dedicate_first: bool = False) -> dict[str, Any]:
    """Meta-device init of FSDP2 alone and of FSDP2 + dmuon (same flow, same seed); train the
    dmuon model. Returns FSDP2's initial full values, dmuon's (rank 0), and the training
    results as :func:`train`."""
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon
    from tests.dist_cases import full_params

    mesh = init_device_mesh("cpu", (world_size,))
    plain = meta_build(case, mesh, dedicate=False)
    fsdp_initial = {n: p.full_tensor().detach().numpy().copy() for n, p in plain.named_parameters()}
    del plain
    model = meta_build(case, mesh, dedicate=True, dedicate_first=dedicate_first)
    opt = dmuon.Muon(model, **OPT_KWARGS)
    dmuon_initial = full_params(model, rank)
    losses, violations = train_steps(model, opt, case, steps, rank, world_size)
    return dict(fsdp_initial=fsdp_initial if rank == 0 else {}, dmuon_initial=dmuon_initial,
                params=full_params(model, rank), losses=losses, violations=violations)


def meta_muon_too_early(rank: int, world_size: int, *, case: str) -> str:
    """``dmuon.Muon`` built while the model is still on meta: the error every rank gets."""
    from torch.distributed.device_mesh import init_device_mesh

    try:
        meta_build(case, init_device_mesh("cpu", (world_size,)), dedicate=True, muon_before_to_empty=True)
    except Exception as e:  # noqa: BLE001 - the test checks the exact type and message
        return f"{type(e).__name__}: {e}"
    return "no error"
