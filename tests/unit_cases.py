"""Rank functions for publication per unit: activation checkpointing, mixed precision, a parent
that reads its child's weight (``nn.MultiheadAttention``). Run by tests/test_units.py.

Every case trains the test model (tests/models.py) or a small attention model with dmuon in fp32
exact mode and returns the full parameters (rank 0) for comparison with an independent
single-process reference, plus what the placeholder contract says must hold after each step:
every dedicated parameter registered on its module is the fp32 master on its owner and a
zero-size placeholder elsewhere.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

import dmuon
from tests import models
from tests.dist_cases import full_params
from tests.thirdparty_cases import contract_violations

EXACT = dict(lr=0.02, adamw_lr=0.01, weight_decay=0.1, ns_method="standard", ns_dtype=torch.float32,
             ns_coefficients="muon")
WRAPPED = "._checkpoint_wrapped_module"


class CheckpointedNet(models.Net):
    """The test model with ``torch.utils.checkpoint`` inside its forward: blocks 0 and 1 form
    one checkpointed region (recomputing it re-runs two FSDP2 units, the first before its own
    pre-backward), block 2 is checkpointed alone."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        x = checkpoint(lambda t: self.blocks[1](self.blocks[0](t)), x, use_reentrant=False)
        x = checkpoint(self.blocks[2], x, use_reentrant=False)
        return self.head(x).mean(dim=(1, 2))


class AttentionNet(nn.Module):
    """Embedding, one ``nn.MultiheadAttention`` (its forward reads ``out_proj.weight`` without
    calling ``out_proj``), a LayerNorm and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(models.VOCAB, models.WIDTH)
        # No in_proj bias: the key bias's gradient is zero in exact arithmetic (softmax ignores
        # a constant added to every key's score), so it is rounding noise, which AdamW's
        # normalization turns into +-lr steps that differ between any two summation orders.
        self.attn = nn.MultiheadAttention(models.WIDTH, num_heads=2, batch_first=True, bias=False)
        self.ln = nn.LayerNorm(models.WIDTH)
        self.head = nn.Linear(models.WIDTH, 1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        x = x + self.attn(x, x, x, need_weights=False)[0]
        return self.head(self.ln(x)).mean(dim=(1, 2))


def make(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "attention":
        return AttentionNet()
    return CheckpointedNet() if kind == "checkpoint-in-forward" else models.Net()


def dedicated_names(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.ndim == 2 and p.requires_grad
            and not n.startswith("emb")]


def reference_optimizers(model: nn.Module) -> tuple[torch.optim.Muon, torch.optim.AdamW]:
    """``torch.optim.Muon`` on :func:`dedicated_names`, ``AdamW`` on the rest (EXACT's values)."""
    names = set(dedicated_names(model))
    muon = torch.optim.Muon([p for n, p in model.named_parameters() if n in names], lr=0.02,
                            weight_decay=0.1, ns_coefficients=models.MUON_COEFFICIENTS)
    adamw = torch.optim.AdamW([p for n, p in model.named_parameters() if n not in names],
                              lr=0.01, weight_decay=0.1)
    return muon, adamw


def reference(kind: str, world_size: int, steps: int) -> dict[str, torch.Tensor]:
    """Single-process ``torch.optim.Muon`` (fp32 iteration) + ``AdamW`` on the global batch."""
    model = make(kind)
    optimizers = reference_optimizers(model)
    with models.reference_ns(torch.float32):
        for step in range(steps):
            models.loss_fn(model, *models.global_batch(step, world_size)).backward()
            for opt in optimizers:
                opt.step()
                opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def contract_holds(model: nn.Module) -> bool:
    """Outside forward and backward every dedicated matrix's module holds the record's fp32
    master (full on the owner, zero-size elsewhere), never the compute copy."""
    return not contract_violations(model) and all(rec.master.dtype == torch.float32
                                                  for rec in model._dmuon_state.records)


def train(rank: int, world_size: int, *, kind: str = "plain", mode: str = "fsdp", ac: str = "none",
          early_stop: bool = True, steps: int = 3) -> dict:
    """Train with dmuon; ``ac``: "none", "wrapper" (``checkpoint_wrapper`` on each block before
    ``fully_shard``) or "in-forward" (``torch.utils.checkpoint`` in the model's forward)."""
    model = make("checkpoint-in-forward" if ac == "in-forward" else kind)
    mesh = init_device_mesh("cpu", (world_size,))
    if ac == "wrapper":
        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    if mode == "fsdp":
        for block in getattr(model, "blocks", []):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    names = set(dedicated_names(make(kind)))
    dmuon.dedicate_params(model, mesh, group_cost=0.0,
                          predicate=lambda name, p: name.replace(WRAPPED, "") in names)
    opt = dmuon.Muon(model, **EXACT)
    contract = []
    for step in range(steps):
        with set_checkpoint_early_stop(early_stop):
            models.loss_fn(model, *models.local_batch(step, rank, world_size)).backward()
        contract.append(contract_holds(model))
        opt.step()
        opt.zero_grad()
        contract.append(contract_holds(model))
    params = {name.replace(WRAPPED, ""): value for name, value in full_params(model, rank).items()}
    return dict(params=params, contract=contract, units=len(model._dmuon_state.units))


def train_mixed_precision(rank: int, world_size: int, *, steps: int = 3,
                          reduce_dtype: torch.dtype = torch.float32) -> dict:
    """FSDP2 ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=...)`` on every unit; also
    record the dtype of the weight each leaf module computes with."""
    model = make("plain")
    mesh = init_device_mesh("cpu", (world_size,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    dmuon.dedicate_params(model, mesh, group_cost=0.0)
    opt = dmuon.Muon(model, **EXACT)
    seen: dict[str, str] = {}

    def record(name, module, args):
        seen[name] = str(module.weight.dtype)

    leaves = {"blocks.0.fc1": model.blocks[0].fc1, "blocks.0.ln": model.blocks[0].ln, "head": model.head}
    for name, module in leaves.items():
        module.register_forward_pre_hook(functools.partial(record, name))
    for step in range(steps):
        models.loss_fn(model, *models.local_batch(step, rank, world_size)).backward()
        opt.step()
        opt.zero_grad()
    state = model._dmuon_state
    return dict(params=full_params(model, rank), seen=seen,
                compute_dtypes=sorted({str(rec.compute.dtype) for rec in state.records}),
                reduce_dtypes=sorted({str(rec.reduce_dtype) for rec in state.records}),
                master_dtypes=sorted({str(rec.master.dtype) for rec in state.records}))


def mixed_precision_reference(world_size: int, steps: int) -> dict[str, torch.Tensor]:
    """FSDP2's mixed-precision semantics emulated in one process, with torch's optimizers.

    For each rank's local batch a bf16 copy of the fp32 weights runs forward and backward (as
    FSDP2 casts its unsharded parameters to ``param_dtype``); the bf16 gradients are cast to
    fp32 (``reduce_dtype``) and averaged over the ranks, and ``torch.optim.Muon`` (fp32
    iteration) + ``AdamW`` step the fp32 weights. Independent of dmuon's code; with two ranks
    the fp32 sum of two terms is order-independent. One thread, as the pool's ranks use: bf16
    matmuls summed in another order differ by ~1e-4 after three steps.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _mixed_precision_reference(world_size, steps)
    finally:
        torch.set_num_threads(threads)


def _mixed_precision_reference(world_size: int, steps: int) -> dict[str, torch.Tensor]:
    model = make("plain")
    optimizers = reference_optimizers(model)
    with models.reference_ns(torch.float32):
        for step in range(steps):
            total: dict[str, torch.Tensor] = {}
            for rank in range(world_size):
                low = make("plain")
                low.load_state_dict(model.state_dict())
                low.to(torch.bfloat16)
                models.loss_fn(low, *models.local_batch(step, rank, world_size)).backward()
                for n, p in low.named_parameters():
                    g = p.grad.to(torch.float32)
                    total[n] = g if n not in total else total[n] + g
            for n, p in model.named_parameters():
                p.grad = total[n] / world_size
            for opt in optimizers:
                opt.step()
                opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def bad_param_dtype(rank: int, world_size: int) -> str:
    """An FSDP2 policy whose ``param_dtype`` dmuon cannot publish."""
    model = make("plain")
    mesh = init_device_mesh("cpu", (world_size,))
    fully_shard(model.blocks[0], mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float8_e4m3fn))
    fully_shard(model, mesh=mesh)
    dmuon.dedicate_params(model, mesh)
    try:
        dmuon.Muon(model, lr=0.02)
    except ValueError as e:
        return str(e)
    return "no error"
