"""Third-party gradient clipping on a dmuon model, on every rank of the test pool (issue 31,
items 7-9): torch's ``clip_grad_norm_``, Accelerate's ``Accelerator.clip_grad_norm_``, the
transformers ``Trainer``'s ``_clip_grad_norm`` and torchtitan's ``dist_utils.clip_grad_norm_``,
each called the way its trainer calls it (``model.parameters()``), on the FSDP2 path and the
replicated path. The reference is single-process ``torch.nn.utils.clip_grad_norm_`` +
``torch.optim.Muon`` + ``AdamW`` (``tests/models.run_reference``).

Accelerate runs no FSDP on CPU: ``Accelerator()`` in a gloo job is ``MULTI_CPU``, whose
``clip_grad_norm_`` goes straight to ``_clip_grad_norm_dtensor_aware``. The ``"accelerate-fsdp2"``
consumer forces the state an FSDP2 job has (``distributed_type = FSDP``, an FSDP2 plugin, the
model in ``_models``), so ``clip_grad_norm_`` takes its FSDP2 branch, which calls the same
function.
"""

from __future__ import annotations

import types
from typing import Any, Callable

import torch

import dmuon
from tests import models
from tests._torchtitan_site import use_site
from tests.dist_cases import build, full_params

OPT_KWARGS = dict(lr=0.02, adamw_lr=0.01, weight_decay=0.1, ns_method="standard",
                  ns_dtype=torch.float32, ns_coefficients="muon")
CONSUMERS = ("dmuon", "torch", "torch-foreach", "accelerate", "accelerate-fsdp2", "trainer", "torchtitan")


def _accelerator(model: torch.nn.Module, force_fsdp2: bool) -> Any:
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    acc = Accelerator(cpu=True)
    if force_fsdp2:  # Accelerate does no FSDP on CPU: the state an FSDP2 job has, by hand
        acc.state.distributed_type = DistributedType.FSDP
        acc.state.fsdp_plugin = types.SimpleNamespace(fsdp_version=2)
        acc._models.append(model)
    return acc


def clipper(consumer: str, model: torch.nn.Module, opt: Any) -> Callable[[float], torch.Tensor]:
    """``clip(max_norm) -> total norm`` as ``consumer`` clips ``model``'s gradients."""
    if consumer == "dmuon":
        return lambda max_norm: dmuon.clip_grad_norm_(model, max_norm)
    if consumer == "torch":
        return lambda max_norm: torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if consumer == "torch-foreach":
        return lambda max_norm: torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=True)
    if consumer in ("accelerate", "accelerate-fsdp2"):
        acc = _accelerator(model, consumer == "accelerate-fsdp2")
        return lambda max_norm: acc.clip_grad_norm_(model.parameters(), max_norm)
    if consumer == "trainer":
        import tempfile

        from transformers import Trainer, TrainingArguments

        args = TrainingArguments(output_dir=tempfile.mkdtemp(), use_cpu=True, report_to=[],
                                 max_grad_norm=1.0)
        trainer = Trainer(model=model, args=args, optimizers=(opt, None))

        def clip(max_norm: float) -> torch.Tensor:
            trainer.args.max_grad_norm = max_norm
            return trainer._clip_grad_norm(model)  # what its training step calls
        return clip
    if consumer == "torchtitan":
        from torchtitan.distributed.utils import clip_grad_norm_

        return lambda max_norm: clip_grad_norm_(model.parameters(), max_norm)
    raise KeyError(consumer)


def _as_float(norm: Any) -> float:
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


def clip_train(rank: int, world_size: int, *, mode: str, consumer: str, steps: int = 3,
               max_norm: float = 0.05, variant: str = "", dedicate_kwargs: dict | None = None,
               site: str | None = None) -> dict[str, Any]:
    """Train the test model ``steps`` steps, clipping with ``consumer`` between backward and
    step. Returns the norms it reported, the final parameters (rank 0), or the error
    (``"<Type>: <message>"``) of the first step that raised. ``variant``: of
    ``tests/models.Net`` ("unused": a matrix no rank uses, whose owner shows absent zeros).
    ``site``: where the test installed torchtitan (``tests/_torchtitan_site.py``), if it did."""
    use_site(site)
    model, _ = build(world_size, mode, variant=variant, **(dedicate_kwargs or {}))
    out = _clipped_steps(model, consumer, steps, max_norm, rank, world_size)
    return out if out["error"] else dict(out, params=full_params(model, rank))


def _clipped_steps(model: torch.nn.Module, consumer: str, steps: int, max_norm: float,
                   dp_index: int, dp_count: int) -> dict[str, Any]:
    """``steps`` steps of ``dmuon.Muon`` on ``model``, clipping with ``consumer`` between
    backward and step, on data-parallel batch ``dp_index`` of ``dp_count``. Returns the norms
    and ``error`` (``"<Type>: <message>"`` of the first clip that raised, else ``None``)."""
    opt = dmuon.Muon(model, **OPT_KWARGS)
    clip = clipper(consumer, model, opt)
    norms = []
    for step in range(steps):
        idx, y = models.local_batch(step, dp_index, dp_count)
        models.loss_fn(model, idx, y).backward()
        try:
            norms.append(_as_float(clip(max_norm)))
        except Exception as e:  # noqa: BLE001 - the test reads the type and message
            return dict(error=f"{type(e).__name__}: {e}", norms=norms)
        opt.step()
        opt.zero_grad()
    return dict(error=None, norms=norms)


def reference_norms(world_size: int, steps: int, max_norm: float, variant: str = "") -> tuple[dict, list[float]]:
    """Single-process final parameters and per-step total norms with clipping."""
    ref, _, norms = models.run_reference(world_size, steps, clip=max_norm, variant=variant)
    return ref, norms



def mesh_clip_train(rank: int, world_size: int, *, layout: str, consumer: str, steps: int = 3,
                    max_norm: float = 0.05, replicate_mode: str = "auto") -> dict[str, Any]:
    """:func:`clip_train` on an HSDP / FSDP x TP mesh (``tests/mesh_cases.py``'s layouts)."""
    from tests import mesh_cases

    model, mesh, dp_names = mesh_cases.build(layout, replicate_mode=replicate_mode)
    dp_index, dp_count = mesh_cases.dp_coordinate(mesh, dp_names)
    out = dict(_clipped_steps(model, consumer, steps, max_norm, dp_index, dp_count), dp_count=dp_count)
    return out if out["error"] else dict(out, params=full_params(model, rank))


def split_stack_norms(rank: int, world_size: int, *, case: str = "hf-qwen3-moe", consumer: str = "torch",
                      steps: int = 2) -> dict[str, Any]:
    """A Mixture-of-Experts model whose expert stacks are split into ranges with different
    owners (``tests/moe_cases.spread_plan``; the module shows the first range's master): the
    norm ``consumer`` reports with no clipping (``max_norm=inf``) after each step's backward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tests import moe_cases

    model = moe_cases.build(case)
    mesh = init_device_mesh("cpu", (world_size,))
    for block in moe_cases.CASES[case].blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    predicate = dmuon.default_predicate(model)
    plan = moe_cases.spread_plan(model, predicate, world_size)
    dmuon.dedicate_params(model, mesh, predicate=predicate, plan=plan, group_cost=0.0)
    opt = dmuon.Muon(model, **moe_cases.OPT_KWARGS)
    clip = clipper(consumer, model, opt)
    split = sum(1 for rec in model._dmuon_state.records if rec.stack is not None)
    norms = []
    for step in range(steps):
        moe_cases.CASES[case].loss(model, *moe_cases.local_batch(case, step, rank, world_size)).backward()
        norms.append(_as_float(clip(float("inf"))))
        opt.step()
        opt.zero_grad()
    return dict(norms=norms, split_records=split, params=moe_cases.full_params(model, rank))


def expert_parallel_norm(rank: int, world_size: int, *, consumer: str, ep: int = 2,
                         case: str = "ep-moe") -> float:
    """torchtitan's expert-parallel layout (``tests/ep_cases.parallelize``: experts ``Shard(0)``
    over "ep", ``fully_shard`` over "efsdp", dense blocks over every rank) with expert stacks
    split into owner ranges: the step-0 gradient norm ``consumer`` reports (no clipping)."""
    from tests import ep_cases, moe_cases

    model = moe_cases.build(case)
    predicate = dmuon.default_predicate(model)
    mesh = ep_cases.parallelize(model, world_size, ep, case=case)
    dmuon.dedicate_params(model, mesh, predicate=predicate, group_cost=0.0,
                          plan=ep_cases.spread_plan(model, predicate, world_size, ep))
    opt = dmuon.Muon(model, **moe_cases.OPT_KWARGS)
    clip = clipper(consumer, model, opt)
    moe_cases.CASES[case].loss(model, *moe_cases.local_batch(case, 0, rank, world_size)).backward()
    return _as_float(clip(float("inf")))
