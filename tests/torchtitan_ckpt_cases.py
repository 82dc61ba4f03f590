"""torchtitan 0.3.0's own ``CheckpointManager`` and exports with dmuon (issue 32, item 3), run on
every rank of the test pool.

The setup is ``tests/torchtitan_cases.py``'s (torchtitan's llama3 debug model with its fused
QKV, its ``parallelize_llama`` with FSDP2, :class:`dmuon.integrations.torchtitan.
DmuonOptimizersContainer`, gradient accumulation ``GA``, torchtitan's clip at ``MAX_NORM``),
plus torchtitan's ``LRSchedulersContainer`` (constant: no warmup, no decay, so the
single-process reference's constant learning rate still applies) and its ``CheckpointManager``
(synchronous DCP, ``interval`` 2, model + optimizer + LR scheduler):

* run A trains steps 0-1, ``CheckpointManager.save(2)``, trains steps 2-3, then exports with
  ``model.state_dict()`` (torchtitan's fused-QKV hook splits ``wqkv`` into ``wq``/``wk``/``wv``),
  with ``CheckpointManager.save(4, last_step=True)`` (``last_save_model_only``: a model-only
  DCP checkpoint in float32) and with a second ``CheckpointManager`` whose last step is saved
  in Hugging Face safetensors (``last_save_in_hf``, llama3's state-dict adapter);
* run B is a fresh model (other initial weights), container, schedulers and
  ``CheckpointManager`` on the same folder: ``load(step=2)``, then trains steps 2-3.

Both of dmuon's paths (``DmuonOptimizersContainer.Config.path``).

The CPU shims are ``tests/torchtitan_cases.py``'s.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

import dmuon
from tests import torchtitan_cases as cases
from tests._torchtitan_site import use_site

SAVE_AT = 2


def _parallelized(rank: int, world_size: int, initial: dict[str, torch.Tensor] | None) -> Any:
    """torchtitan's parallelized debug model: ``initial``'s weights (the reference's), or
    torchtitan's own init with seed 123 (``None``: weights a checkpoint load must replace)."""
    from torch.distributed.tensor import distribute_tensor
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3 import model_registry

    parallelism = ParallelismConfig(spmd_backend="partial_dtensor", data_parallel_shard_degree=world_size)
    parallel_dims = ParallelDims.from_config(parallelism, world_size)
    parallel_dims.build_mesh()
    model = model_registry("debugmodel").parallelize_fn(
        cases.build_model(meta=True), parallel_dims=parallel_dims,
        training=TrainingConfig(mixed_precision_param="float32"), parallelism=parallelism,
        compile_config=CompileConfig(), ac_config=None, dump_folder="")
    model.to_empty(device="cpu")
    torch.manual_seed(123)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
        for name, p in model.named_parameters():
            if initial is not None:
                p.copy_(distribute_tensor(initial[name].detach(), p.device_mesh, p.placements))
    for module in model.modules():
        if hasattr(module, "set_force_sum_reduction_for_comms"):
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    return model


def _trainer(rank: int, world_size: int, folder: str, initial: dict[str, torch.Tensor] | None,
             path: str) -> tuple:
    """Model, optimizers (dmuon's container on dmuon's ``path``), LR schedulers and
    ``CheckpointManager``, built in torchtitan's trainer order."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer

    from dmuon.integrations.torchtitan import DmuonOptimizersContainer

    model = _parallelized(rank, world_size, initial)
    optimizers = DmuonOptimizersContainer.Config(muon_kwargs=cases.MUON_KWARGS, path=path).build(
        model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=0, decay_ratio=0.0).build(
        optimizers=optimizers, training_steps=cases.STEPS)
    config = CheckpointManager.Config(enable=True, folder="checkpoint", interval=SAVE_AT, keep_latest_k=0,
                                      last_save_model_only=True, export_dtype="float32")
    checkpointer = CheckpointManager(config, dataloader=None, model_parts=[model], optimizers=optimizers,
                                     lr_schedulers=schedulers, states={}, sd_adapter=None, base_folder=folder)
    return model, optimizers, schedulers, checkpointer


def _train(model: Any, optimizers: Any, schedulers: Any, steps: range, rank: int, world_size: int) -> list[float]:
    """``cases.run``'s steps (GA micro-batches, torchtitan's clip) plus the scheduler step;
    returns the global losses."""
    import torch.distributed as dist
    from torchtitan.distributed.utils import clip_grad_norm_

    tokens = cases.GA * world_size * cases.BATCH * cases.SEQ
    losses = []
    for step in steps:
        total = 0.0
        for micro in range(cases.GA):
            model.set_requires_gradient_sync(micro == cases.GA - 1)
            loss = cases._loss_sum(model, cases.micro_batch(step, micro, rank, world_size)) / tokens
            loss.backward()
            total += loss.item()
        t = torch.tensor(total, dtype=torch.float64)
        dist.all_reduce(t)
        losses.append(float(t))
        clip_grad_norm_(model.parameters(), cases.MAX_NORM)
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
    return losses


def _full(sd: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor entry of ``sd`` as a full plain tensor (collective for DTensors)."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in sd.items() if isinstance(v, torch.Tensor)}


def _hf_export(model: Any, optimizers: Any, schedulers: Any, folder: str) -> None:
    """torchtitan's Hugging Face export: a ``CheckpointManager`` with llama3's state-dict adapter
    (no HF assets) and ``last_save_in_hf``, saving the last step into ``folder/hf/step-N``
    (one consolidated safetensors file)."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    adapter = Llama3StateDictAdapter(model_registry("debugmodel").model, None)
    config = CheckpointManager.Config(enable=True, folder="hf", interval=SAVE_AT, keep_latest_k=0,
                                      last_save_model_only=True, last_save_in_hf=True, export_dtype="float32")
    checkpointer = CheckpointManager(config, dataloader=None, model_parts=[model], optimizers=optimizers,
                                     lr_schedulers=schedulers, states={}, sd_adapter=adapter, base_folder=folder)
    assert checkpointer.save(curr_step=cases.STEPS, last_step=True)
    checkpointer.close()


def hf_export_native(path: str) -> dict[str, torch.Tensor]:
    """The safetensors files of :func:`_hf_export`'s checkpoint at ``path``, read back and mapped
    to torchtitan's native keys by llama3's own adapter (``from_hf``: HF names, Q/K RoPE
    permutation undone)."""
    from safetensors.torch import load_file
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    hf: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            hf.update(load_file(os.path.join(path, name)))
    adapter = Llama3StateDictAdapter(model_registry("debugmodel").model, None)
    return {k: v.contiguous() for k, v in adapter.from_hf(hf).items()}


def run_ckpt(rank: int, world_size: int, folder: str, site: str | None = None,
             path: str = "hooks") -> dict[str, Any]:
    """Run A (save at step 2, export at step 4), run B (load step 2 through torchtitan's
    ``CheckpointManager``, train to 4) and run C (the same through ``dmuon.load`` of a
    ``dmuon.state_dict`` saved at step 2); ``site``:
    the folder holding torchtitan (``tests/_torchtitan_site.py``), or ``None``; ``path``:
    ``DmuonOptimizersContainer.Config.path``.

    Returns:
        ``losses_a`` (steps 0-3), ``losses_b``, ``losses_c`` (steps 2-3), ``last_epoch_b`` (the LR
        scheduler's right after the load), ``saved`` (the checkpoint folders); on rank 0 also
        ``export`` (run A's final ``model.state_dict()``, full tensors as numpy arrays, keyed as
        it names them), ``final_b`` and ``final_c`` (runs B's and C's, the same way).
    """
    use_site(site)
    initial = dict(cases.build_model(meta=False).named_parameters())  # the reference's initial weights
    model, optimizers, schedulers, checkpointer = _trainer(rank, world_size, folder, initial, path)
    losses_a = _train(model, optimizers, schedulers, range(SAVE_AT), rank, world_size)
    assert checkpointer.save(curr_step=SAVE_AT)
    dcp.save(dmuon.state_dict(model, optimizers.optimizers[0]), checkpoint_id=os.path.join(folder, "dmuon"))
    losses_a += _train(model, optimizers, schedulers, range(SAVE_AT, cases.STEPS), rank, world_size)
    export = _full(model.state_dict())  # torchtitan's fused-QKV hook: wq/wk/wv
    assert checkpointer.save(curr_step=cases.STEPS, last_step=True)  # model only, float32
    checkpointer.close()
    _hf_export(model, optimizers, schedulers, folder)
    del model, optimizers, schedulers, checkpointer

    model, optimizers, schedulers, checkpointer = _trainer(rank, world_size, folder, None, path)
    assert checkpointer.load(step=SAVE_AT)
    last_epoch = schedulers.schedulers[0].last_epoch
    losses_b = _train(model, optimizers, schedulers, range(SAVE_AT, cases.STEPS), rank, world_size)
    final_b = _full(model.state_dict())
    checkpointer.close()
    del model, optimizers, schedulers, checkpointer

    # run C: dmuon's own checkpoint of step 2 (dmuon.state_dict + dcp.save, dmuon.load); the
    # constant LR schedule needs no scheduler state
    model, optimizers, schedulers, _ = _trainer(rank, world_size, os.path.join(folder, "c"), None, path)
    dmuon.load(model, optimizers.optimizers[0], os.path.join(folder, "dmuon"))
    losses_c = _train(model, optimizers, schedulers, range(SAVE_AT, cases.STEPS), rank, world_size)
    final_c = _full(model.state_dict())
    out = dict(losses_a=losses_a, losses_b=losses_b, losses_c=losses_c, last_epoch_b=last_epoch,
               saved=sorted(os.listdir(os.path.join(folder, "checkpoint"))))
    if rank == 0:
        out.update(export={k: v.numpy().copy() for k, v in export.items()},
                   final_b={k: v.numpy().copy() for k, v in final_b.items()},
                   final_c={k: v.numpy().copy() for k, v in final_c.items()})
    return out


def reference_state_dict(weights: dict[str, torch.Tensor], site: str | None = None) -> dict[str, torch.Tensor]:
    """``weights`` (the reference's parameters by name) as torchtitan's unsharded model's own
    ``state_dict()`` shows them (its fused-QKV hook splits ``wqkv`` into ``wq``/``wk``/``wv``)."""
    model = cases.build_model(meta=False, site=site)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights[name])
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
