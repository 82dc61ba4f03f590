"""Rank functions for tests/test_torch_parity.py (run by the gloo pool, see tests/_pool.py).

The reference is the *installed* ``torch.optim.Muon``, untouched (its own bf16 iteration), on
the full tensors in one process: whatever that torch version does, dmuon must do.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon
from dmuon.distconfig import create_dtensor_config, create_processgroup_config
from tests import models

#: torch.optim.Muon's own iteration: standard Newton-Schulz, bf16, Keller Jordan's coefficients.
TORCH_NS = dict(ns_method="standard", ns_dtype=torch.bfloat16, ns_coefficients="muon", ns_backend="torch")


def _fulls() -> list[torch.Tensor]:
    """Seeded full bf16 matrices: tall, wide (the lr adjustments differ there) and square."""
    g = torch.Generator().manual_seed(11)
    return [torch.randn(r, c, generator=g).to(torch.bfloat16) for r, c in ((9, 5), (5, 9), (6, 6))]


def _chunk_rows(t: torch.Tensor, n: int, i: int) -> torch.Tensor:
    parts = list(torch.chunk(t, n, dim=0))
    return parts[i].clone() if i < len(parts) else t.new_zeros((0, t.shape[1]))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def bf16_ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """Max |got - want| in bf16 spacings at |want| (``2^(floor(log2|x|) - 7)``)."""
    want = want.float()
    ulp = torch.exp2(torch.floor(torch.log2(want.abs().clamp(min=2.0 ** -100))) - 7)
    return float(((got.float() - want).abs() / ulp).max()) if want.numel() else 0.0


def bf16_distconfig(rank: int, world_size: int, *, strategy: str, nesterov: bool,
                    adjust_lr_fn: str | None, steps: int = 4) -> dict:
    """bf16 matrices through ``dmuon.Muon(params, distributed_config=...)`` vs the installed
    ``torch.optim.Muon`` on the full bf16 matrices, on this rank's pieces: the parameters' max
    |diff| in bf16 ulps of torch's values, the momentum buffers' max |diff| relative to the
    buffer's max |value| (torch <= 2.14 leaves a bf16 buffer normalized with ``nesterov=False``;
    2.15 does not), and torch's buffer norms."""
    fulls = _fulls()
    if strategy == "fsdp":  # FSDP2 DTensors, Shard(0)
        holder = nn.ParameterList([nn.Parameter(f.clone()) for f in fulls])
        fully_shard(holder, mesh=init_device_mesh("cpu", (world_size,)))
        mats, cfg = list(holder), create_dtensor_config()
    else:  # plain row chunks, uneven and empty included
        mats = [nn.Parameter(_chunk_rows(f, world_size, rank)) for f in fulls]
        cfg = create_processgroup_config(fsdp_pg=dist.group.WORLD)
    ref = [nn.Parameter(f.clone()) for f in fulls]
    kwargs = dict(lr=0.02, weight_decay=0.1, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    opt = dmuon.Muon(mats, distributed_config=cfg, **kwargs, **TORCH_NS)
    muon = torch.optim.Muon(ref, ns_coefficients=models.MUON_COEFFICIENTS, **kwargs)
    for step in range(steps):
        for p in mats + ref:  # element-wise in the parameter: commutes with any sharding
            p.grad = torch.sin(3 * p.detach() + step)
        opt.step()
        muon.step()
    ulps, buf_rel = [], []
    for p, r in zip(mats, ref):
        want = _chunk_rows(r.detach(), world_size, rank).float()
        want_buf = _chunk_rows(muon.state[r]["momentum_buffer"], world_size, rank).float()
        got, got_buf = _local(p.detach()), _local(opt.state[p]["momentum_buffer"]).float()
        assert got.shape == want.shape and got.dtype == torch.bfloat16, (got.shape, want.shape, got.dtype)
        if not got.numel():
            continue
        ulps.append(bf16_ulps(got, want))
        buf_rel.append(float((got_buf - want_buf).abs().max() / want_buf.abs().max().clamp(min=1e-30)))
    return dict(max_ulps=max(ulps, default=0.0), max_buf_rel=max(buf_rel, default=0.0),
                buf_norms=[float(muon.state[r]["momentum_buffer"].float().norm()) for r in ref])
