"""dmuon as torchtitan 0.3.0's optimizer (issue 32, item 3), run on every rank of the test pool.

torchtitan's llama3 ``debugmodel`` (6 layers, dim 256, vocab 2048, fused QKV) parallelized by
torchtitan's own ``parallelize_llama`` (FSDP2 over ``fsdp``, ``partial_dtensor`` backend, fp32
parameters), ``to_empty`` + weights, then :class:`dmuon.integrations.torchtitan.
DmuonOptimizersContainer` built by its config's ``build(model_parts=...)`` as torchtitan's
trainer does. ``STEPS`` steps of gradient accumulation ``GA`` with torchtitan's loss
normalisation (``set_gradient_divide_factor(1.0)``, set by its ``parallelize``; each
micro-batch's loss the cross-entropy *sum* over the global token count) and torchtitan's own
``dist_utils.clip_grad_norm_`` at ``MAX_NORM`` (every step clips). Options of :func:`run`: dmuon's
path (``Config.path``), torchtitan's ``LRSchedulersContainer`` (warmup then linear decay) and
its activation checkpointing (``FullAC`` / ``SelectiveAC`` through ``parallelize``'s
``ac_config``).

torchtitan comes from the environment or from the folder ``tests/_torchtitan_site.py``
installed it into (``site``: put first on ``sys.path`` here, in the pool worker).

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
from tests.dist_cases import full_params
from tests import thirdparty_cases as tp
from tests._torchtitan_site import use_site

STEPS, GA = 4, 2
BATCH, SEQ, VOCAB = 2, 32, 2048
MAX_NORM = 0.05
MUON_KWARGS = dict(tp.OPT_KWARGS)
#: torchtitan's ``LRSchedulersContainer.Config`` in the LR-schedule case: 2 warmup steps, then
#: linear decay to 0 at step ``STEPS`` (its "virtual last step" keeps step 3 above 0).
LR_CONFIG = dict(warmup_steps=2, decay_type="linear")
#: Its LR factor per step for LR_CONFIG over STEPS steps, worked out by hand from its docstring
#: (warmup (s + 1) / 2 for s < 2; one stable step; then 1 - (s + 1 - 3) / 2): the reference's.
LR_FACTORS = (0.5, 1.0, 1.0, 0.5, 0.0)


def _cpu_shims() -> None:
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.models.llama3 as llama3
    from torchtitan.models.common.attention import ScaledDotProductAttention

    parallel_dims.device_type = "cpu"
    llama3.get_attention_config = lambda backend: ScaledDotProductAttention.Config()


def build_model(meta: bool, site: str | None = None) -> torch.nn.Module:
    """torchtitan's llama3 debug model, on the meta device or with its initial weights (seed 0)."""
    use_site(site)
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


def clip_grad_norm_fp64_(params: Any, max_norm: float) -> float:
    """``torch.nn.utils.clip_grad_norm_`` (2-norm, the same clip coefficient ``max_norm /
    (norm + 1e-6)`` capped at 1, applied in fp32) with the norm summed in float64.

    Not torch's own: its CPU norm kernel accumulates a tensor's squares in fp32 (the error
    grows with the tensor's size); on ``lm_head``'s ``[2048, 256]`` gradient at step 0 it returns
    1.0007751 where the float64 norm is 1.0008426 (6.7e-5 relative; the whole model's norm
    1.0624677 vs 1.0625314). Its error depends on how the tensor is cut (the two FSDP2 halves:
    1.0008177), so it is no reference for a sharded run.

    Returns:
        The total gradient norm (float64, as a float).
    """
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.stack([g.detach().double().pow(2).sum() for g in grads]).sum().sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0).to(torch.float32)
    for g in grads:
        g.mul_(coef)
    return float(total)


def reference(world_size: int, lr_schedule: bool = False, site: str | None = None,
              ) -> tuple[dict[str, torch.Tensor], list[float], list[float]]:
    """Single-process ``torch.optim.Muon`` (fp32) + ``AdamW`` on all ranks' micro-batches, the
    loss the global token mean, :func:`clip_grad_norm_fp64_` at ``MAX_NORM``; with ``lr_schedule`` a
    ``LambdaLR`` of :data:`LR_FACTORS` on both, stepped after each optimizer step.

    Returns:
        Final parameters by name, per-step losses (token means), per-step total norms.
    """
    model = build_model(meta=False, site=site)
    names = set(matrix_names(model))
    mats = [p for n, p in model.named_parameters() if n in names]
    rest = [p for n, p in model.named_parameters() if n not in names]
    muon = torch.optim.Muon(mats, lr=MUON_KWARGS["lr"], weight_decay=MUON_KWARGS["weight_decay"],
                            ns_coefficients=models.MUON_COEFFICIENTS)
    adamw = torch.optim.AdamW(rest, lr=MUON_KWARGS["adamw_lr"], weight_decay=MUON_KWARGS["weight_decay"])
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, LR_FACTORS.__getitem__)
                  for o in (muon, adamw)] if lr_schedule else []
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
            norms.append(clip_grad_norm_fp64_(model.parameters(), MAX_NORM))
            for o in (muon, adamw):
                o.step()
                o.zero_grad()
            for sched in schedulers:
                sched.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, losses, norms


def run(rank: int, world_size: int, site: str | None = None, path: str = "hooks",
        lr_schedule: bool = False, ac: str | None = None) -> dict[str, Any]:
    """torchtitan's parallelize + :class:`DmuonOptimizersContainer`, ``STEPS`` steps.

    Args:
        site: the folder holding torchtitan (``tests/_torchtitan_site.py``), or ``None``.
        path: ``DmuonOptimizersContainer.Config.path``.
        lr_schedule: build torchtitan's ``LRSchedulersContainer`` (:data:`LR_CONFIG`) over the
            container and step it after every optimizer step.
        ac: ``None``, ``"full"`` or ``"selective"``: torchtitan's activation checkpointing.

    Returns:
        The losses, torchtitan's clip norms, the learning rates each step used (every param
        group's), the Muon matrices' names and (rank 0) the full final weights.
    """
    use_site(site)
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor
    from torchtitan.components.checkpointer.utils import canonical_fqn
    from torchtitan.components.optimizer import LRSchedulersContainer
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.distributed.utils import clip_grad_norm_
    from torchtitan.models.llama3 import model_registry

    from dmuon.integrations.torchtitan import DmuonOptimizersContainer

    ac_config = {None: None, "full": FullAC.Config(), "selective": SelectiveAC.Config()}[ac]
    initial = dict(build_model(meta=False).named_parameters())  # the reference's initial weights
    parallelism = ParallelismConfig(spmd_backend="partial_dtensor", data_parallel_shard_degree=world_size)
    parallel_dims = ParallelDims.from_config(parallelism, world_size)
    parallel_dims.build_mesh()
    model = model_registry("debugmodel").parallelize_fn(
        build_model(meta=True), parallel_dims=parallel_dims,
        training=TrainingConfig(mixed_precision_param="float32"), parallelism=parallelism,
        compile_config=CompileConfig(), ac_config=ac_config, dump_folder="")
    if ac is not None:
        wrapped = [n for n, _ in model.named_modules() if n.endswith("_checkpoint_wrapped_module")]
        assert len(wrapped) == len(model.layers), wrapped  # torchtitan wrapped every block
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)  # buffers (RoPE); the weights are the reference's:
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(distribute_tensor(initial[canonical_fqn(name)].detach(), p.device_mesh, p.placements))
    for module in model.modules():
        if hasattr(module, "set_force_sum_reduction_for_comms"):
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    optimizers = DmuonOptimizersContainer.Config(muon_kwargs=MUON_KWARGS, path=path).build(
        model_parts=[model])
    (muon,) = optimizers.optimizers
    schedulers = (LRSchedulersContainer.Config(**LR_CONFIG).build(optimizers=optimizers,
                                                                   training_steps=STEPS)
                  if lr_schedule else None)
    muon_names = sorted(canonical_fqn(n) for g in muon.param_groups
                        if g.get("kind") == "muon" or g.get("use_muon") for n in g["param_names"])
    tokens = GA * world_size * BATCH * SEQ
    losses, norms, lrs = [], [], []
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
        lrs.append([g["lr"] for g in muon.param_groups])
        optimizers.step()
        optimizers.zero_grad()
        if schedulers is not None:
            schedulers.step()
    # straight from the parameters (owners' masters, FSDP2's shards gathered), not through
    # model.state_dict(): the weights are checked independently of the state-dict translation
    final = {canonical_fqn(n): v for n, v in full_params(model, rank).items()}
    import torchtitan

    return dict(losses=losses, norms=norms, lrs=lrs, muon_names=muon_names,
                torchtitan_file=torchtitan.__file__,
                final=final)
