"""Rank functions for tests/test_keep.py: the DDP-style path (``replicas="keep"``).

:func:`train_counting` trains the plain replicated test model and records every collective
dmuon issues on its process group, per step (by wrapping ``torch.distributed``'s
``all_reduce``/``reduce``/``broadcast``, :func:`tests.replica_cases.counting`), and every rank's
full compute copies after the last step's broadcasts.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import dmuon
from tests import models
from tests.dist_cases import build, full_params
from tests.replica_cases import counting


def train_counting(rank: int, world_size: int, *, steps: int = 4, micro_batches: int = 1,
                   dedicate_kwargs: dict | None = None) -> dict:
    """Train ``steps`` steps on the replicated path; ``micro_batches > 1`` accumulates under
    ``dmuon.no_sync``. Returns params (rank 0), per-step collective counts, the bucket layout
    and this rank's compute copies after the last publication."""
    model, _ = build(world_size, "replicated", **(dedicate_kwargs or {}))
    opt = dmuon.Muon(model, lr=0.02, adamw_lr=0.01, weight_decay=0.1, ns_method="standard",
                     ns_dtype=torch.float32, ns_coefficients="muon")
    state = model._dmuon_state
    per_step = []
    for step in range(steps):
        log: list[tuple[str, str]] = []
        with counting(state.group, log):
            idx, y = models.local_batch(step, rank, world_size)
            chunks = list(zip(idx.chunk(micro_batches), y.chunk(micro_batches)))
            for i, (ci, cy) in enumerate(chunks):
                ctx = contextlib.nullcontext() if i == len(chunks) - 1 else dmuon.no_sync(model)
                with ctx:
                    (models.loss_fn(model, ci, cy) / micro_batches).backward()
            opt.step()
            opt.zero_grad()
        per_step.append(dict(Counter(op for op, _ in log)))
    for group in state.groups:  # the last step's broadcasts, as the next forward would wait
        if group.work is not None:
            group.work.wait()
            group.work = None
    compute = {rec.fqn: rec.buffer.detach().numpy().copy() for rec in state.records}
    allocated = all(rec.buffer.untyped_storage().size() > 0 for rec in state.records)
    return dict(params=full_params(model, rank), per_step=per_step, compute=compute,
                allocated=allocated, keep=state.keep,
                plan_buckets={m.fqn: m.bucket for m in state.plan.matrices},
                plan_owners={m.fqn: m.owner for m in state.plan.matrices},
                reduce_buckets=len(state.buckets), publish_groups=len(state.groups),
                adamw_buckets=len(state.replicated.buckets) if state.replicated else 0,
                shared_buckets=int(state.shared_bucket is not None),
                shared_params=len(state.shared_bucket.shared) if state.shared_bucket else 0)


def bad_input(rank: int, world_size: int, *, case: str) -> str:
    """Run a bad-input case; return ``"<ExceptionType>: <message>"`` (or "no error")."""
    try:
        model = models.make_model()
        mesh = init_device_mesh("cpu", (world_size,))
        if case == "bucket-cap-zero":
            dmuon.dedicate_params(model, mesh, bucket_cap_mb=0)
        elif case == "bucket-cap-negative":
            dmuon.dedicate_params(model, mesh, bucket_cap_mb=-1.5)
        elif case == "replicas-unknown":
            dmuon.dedicate_params(model, mesh, replicas="full")
        elif case == "replicas-on-fsdp":
            build(world_size, "fsdp", replicas="keep")
        elif case == "replicas-keep-then-fully-shard":
            wrapped, _ = build(world_size, "fsdp-before", replicas="keep")
            dmuon.Muon(wrapped, lr=0.02)  # binding finds FSDP2 and refuses
        elif case == "ddp-wrapped":
            from torch.nn.parallel import DistributedDataParallel

            dmuon.dedicate_params(DistributedDataParallel(model), mesh)
        else:
            raise KeyError(case)
    except Exception as e:  # noqa: BLE001 - the test inspects the exact type and message
        return f"{type(e).__name__}: {e}"
    finally:
        dist.barrier()
    return "no error"
