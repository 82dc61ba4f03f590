"""Mesh layouts of the main job: ``--mesh fsdp | replicate | hsdp:RxS | fsdp-tp:DxT``.

* ``fsdp``: a 1-D mesh over every rank, ``fully_shard`` per block and root.
* ``replicate``: a 1-D mesh and a plain module replicated on every rank (the DDP setting):
  ``--optimizer dmuon`` runs dmuon's DDP-style path (``replicas="keep"``), ``adamw`` and
  ``vanilla`` run under torch ``DistributedDataParallel`` (:func:`wrap_data_parallel`).
* ``hsdp:RxS``: a ``("replicate", "shard")`` mesh; ``fully_shard`` on it replicates over R
  and shards over S.
* ``fsdp-tp:DxT``: a ``("dp", "tp")`` mesh; every MLP's ``fc1`` is column-parallel and ``fc2``
  row-parallel on ``tp`` (attention stays whole, so the model mixes TP and non-TP matrices),
  then ``fully_shard`` on ``dp``. The TP ranks of one ``dp`` index see the same batch slice.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


@dataclass(frozen=True, slots=True)
class Layout:
    """Parsed ``--mesh``: ``kind`` in {"fsdp", "replicate", "hsdp", "fsdp-tp"} and its sizes."""

    kind: str
    sizes: tuple[int, ...]

    @classmethod
    def parse(cls, text: str, world: int) -> "Layout":
        """Raises ValueError on a malformed spec or sizes whose product is not ``world``."""
        if text in ("fsdp", "replicate"):
            return cls(text, (world,))
        m = re.fullmatch(r"(hsdp|fsdp-tp):(\d+)x(\d+)", text)
        if not m:
            raise ValueError(f"dmuon.train: --mesh {text!r}; use fsdp, replicate, hsdp:RxS or fsdp-tp:DxT")
        sizes = (int(m.group(2)), int(m.group(3)))
        if sizes[0] * sizes[1] != world:
            raise ValueError(f"dmuon.train: --mesh {text} needs {sizes[0] * sizes[1]} ranks, "
                             f"the job has {world}; pass --nproc {sizes[0] * sizes[1]}")
        return cls(m.group(1), sizes)

    @property
    def names(self) -> tuple[str, ...]:
        return {"fsdp": ("dp",), "replicate": ("dp",), "hsdp": ("replicate", "shard"), "fsdp-tp": ("dp", "tp")}[self.kind]


def shard_model(model: nn.Module, blocks: list[nn.Module], layout: Layout, device: torch.device):
    """Apply the layout's TP and FSDP2 to ``model``; return ``(mesh, dp_index, dp_count)``."""
    mesh = init_device_mesh(device.type, layout.sizes, mesh_dim_names=layout.names)
    if layout.kind == "replicate":  # nothing to shard: the module stays whole on every rank
        return mesh, mesh.get_coordinate()[0], layout.sizes[0]
    dp_mesh = mesh
    if layout.kind == "fsdp-tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        # fc1's output stays a DTensor so uneven hidden sizes keep their true global shape.
        plan = {"fc1": ColwiseParallel(use_local_output=False), "fc2": RowwiseParallel()}
        for module in model.modules():
            if hasattr(module, "fc1") and hasattr(module, "fc2"):
                parallelize_module(module, mesh["tp"], plan)
        dp_mesh = mesh["dp"]
    for block in blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    coord = dict(zip(layout.names, mesh.get_coordinate()))
    if layout.kind == "hsdp":
        return mesh, coord["replicate"] * layout.sizes[1] + coord["shard"], layout.sizes[0] * layout.sizes[1]
    return mesh, coord["dp"], layout.sizes[0]


def wrap_data_parallel(model: nn.Module, layout: Layout, optimizer: str, device: torch.device) -> nn.Module:
    """``--mesh replicate``: torch ``DistributedDataParallel`` around ``model`` for the
    ``adamw`` and ``vanilla`` baselines (``bucket_cap_mb`` 25, DDP's default); dmuon takes the
    plain module (it averages gradients itself). Other layouts: ``model`` unchanged."""
    if layout.kind != "replicate" or optimizer == "dmuon":
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
