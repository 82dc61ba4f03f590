"""dmuon as torchtitan 0.3.0's optimizer (issue 32, item 3), run on every rank of the test pool.

torchtitan's llama3 ``debugmodel`` (6 layers, dim 256, vocab 2048, fused QKV) parallelized by
torchtitan's own ``parallelize_llama`` (FSDP2 over ``fsdp``, ``partial_dtensor`` backend, fp32
parameters), ``to_empty`` + weights, then :class:`dmuon.integrations.torchtitan.
DmuonOptimizersContainer` built by its config's ``build(model_parts=...)`` as torchtitan's
trainer does. ``STEPS`` steps of gradient accumulation ``GA`` with torchtitan's loss
normalisation (``set_gradient_divide_factor(1.0)``, set by its ``parallelize``; each
micro-batch's loss the cross-entropy *sum* over the global token count) and torchtitan's own
``dist_utils.clip_grad_norm_`` at ``MAX_NORM`` (every step clips).

**CPU shims** (a user on GPUs needs none): torchtitan's mesh device is set to ``"cpu"``, the
attention is ``ScaledDotProductAttention`` (causal; FlexAttention has no CPU backward), and
FSDP2 reduces with ``SUM`` (``set_force_sum_reduction_for_comms``: gloo has no ``PREMUL_SUM``).

:func:`reference` is single-process ``torch.optim.Muon`` + ``AdamW`` on the unsharded model with
the same initial weights and micro-batches: it shares no code with dmuon.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from tests import models
from tests import thirdparty_cases as tp

STEPS, GA = 4, 2
BATCH, SEQ, VOCAB = 2, 32, 2048
MAX_NORM = 0.05
MUON_KWARGS = dict(tp.OPT_KWARGS)


def _cpu_shims() -> None:
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.models.llama3 as llama3
    from torchtitan.models.common.attention import ScaledDotProductAttention

    parallel_dims.device_type = "cpu"
    llama3.get_attention_config = lambda backend: ScaledDotProductAttention.Config()


def build_model(meta: bool) -> torch.nn.Module:
    """torchtitan's llama3 debug model, on the meta device or with its initial weights (seed 0)."""
    _cpu_shims()
    from torchtitan.models.llama3 import model_registry

    config = model_registry("debugmodel").model
    if meta:
        with torch.device("meta"):
            return config.build()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def micro_batch(step: int, micro: int, rank: int, world_size: int) -> torch.Tensor:
    """Token ids ``[BATCH, SEQ + 1]`` of rank ``rank``'s micro-batch ``micro`` of step ``step``."""
    g = torch.Generator().manual_seed(1000 * step + 100 * micro + rank)
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)


def _loss_sum(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")


def matrix_names(model: torch.nn.Module) -> list[str]:
    """The parameters Muon takes: every 2-D weight of the decoder layers and the output head
    (not the token embedding), as torchtitan's ``DistMuon`` recipes and dmuon's default pick."""
    return [n for n, p in model.named_parameters()
            if p.ndim == 2 and n != "tok_embeddings.weight"]


def reference(world_size: int) -> tuple[dict[str, torch.Tensor], list[float], list[float]]:
    """Single-process ``torch.optim.Muon`` (fp32) + ``AdamW`` on all ranks' micro-batches, the
    loss the global token mean, ``clip_grad_norm_(MAX_NORM)``.

    Returns:
        Final parameters by name, per-step losses (token means), per-step total norms.
    """
    model = build_model(meta=False)
    names = set(matrix_names(model))
    mats = [p for n, p in model.named_parameters() if n in names]
    rest = [p for n, p in model.named_parameters() if n not in names]
    muon = torch.optim.Muon(mats, lr=MUON_KWARGS["lr"], weight_decay=MUON_KWARGS["weight_decay"],
                            ns_coefficients=models.MUON_COEFFICIENTS)
    adamw = torch.optim.AdamW(rest, lr=MUON_KWARGS["adamw_lr"], weight_decay=MUON_KWARGS["weight_decay"])
    tokens = GA * world_size * BATCH * SEQ
    losses, norms = [], []
    with models.reference_ns(torch.float32):
        for step in range(STEPS):
            total = 0.0
            for micro in range(GA):
                for rank in range(world_size):
                    loss = _loss_sum(model, micro_batch(step, micro, rank, world_size)) / tokens
                    loss.backward()
                    total += loss.item()
            losses.append(total)
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
            for o in (muon, adamw):
                o.step()
                o.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, losses, norms


def run(rank: int, world_size: int) -> dict[str, Any]:
    """torchtitan's parallelize + :class:`DmuonOptimizersContainer`, ``STEPS`` steps; returns
    the losses, torchtitan's clip norms, the Muon matrices' names and the full final weights."""
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.utils import clip_grad_norm_
    from torchtitan.models.llama3 import model_registry

    from dmuon.integrations.torchtitan import DmuonOptimizersContainer

    initial = dict(build_model(meta=False).named_parameters())  # the reference's initial weights
    parallelism = ParallelismConfig(spmd_backend="partial_dtensor", data_parallel_shard_degree=world_size)
    parallel_dims = ParallelDims.from_config(parallelism, world_size)
    parallel_dims.build_mesh()
    model = model_registry("debugmodel").parallelize_fn(
        build_model(meta=True), parallel_dims=parallel_dims,
        training=TrainingConfig(mixed_precision_param="float32"), parallelism=parallelism,
        compile_config=CompileConfig(), ac_config=None, dump_folder="")
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)  # buffers (RoPE); the weights are the reference's:
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(distribute_tensor(initial[name].detach(), p.device_mesh, p.placements))
    for module in model.modules():
        if hasattr(module, "set_force_sum_reduction_for_comms"):
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    optimizers = DmuonOptimizersContainer.Config(muon_kwargs=MUON_KWARGS).build(model_parts=[model])
    (muon,) = optimizers.optimizers
    muon_names = sorted(n for g in muon.param_groups if g.get("kind") == "muon" for n in g["param_names"])
    tokens = GA * world_size * BATCH * SEQ
    losses, norms = [], []
    for step in range(STEPS):
        total = 0.0
        for micro in range(GA):
            model.set_requires_gradient_sync(micro == GA - 1)
            loss = _loss_sum(model, micro_batch(step, micro, rank, world_size)) / tokens
            loss.backward()
            total += loss.item()
        t = torch.tensor(total, dtype=torch.float64)
        dist.all_reduce(t)
        losses.append(float(t))
        norm = clip_grad_norm_(model.parameters(), MAX_NORM)
        norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        optimizers.step()
        optimizers.zero_grad()
    # The final weights straight from the parameters: each dedicated matrix from its owner's
    # master, the rest gathered. (model.state_dict() fails here: torchtitan's fused-QKV save
    # hook, _split_qkv_on_save, meets a dedicated wqkv's zero-size placeholder.)
    ctx = model._dmuon_state
    dedicated = {}
    for rec in ctx.records:
        full = rec.master.detach().clone() if rec.is_owner else torch.empty(rec.shape)
        dist.broadcast(full, src=dist.get_global_rank(ctx.roles.shard, rec.owner), group=ctx.roles.shard)
        dedicated[rec.fqn] = full
    final = {n: dedicated[n] if n in dedicated else p.detach().full_tensor()
             for n, p in model.named_parameters()}
    return dict(losses=losses, norms=norms, muon_names=muon_names,
                final={k: v.numpy().copy() for k, v in final.items()} if rank == 0 else {})
