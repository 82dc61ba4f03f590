"""dmuon: owner-centric distributed Muon for PyTorch FSDP2.

Three lines over a stock FSDP2 program::

    import dmuon
    dmuon.dedicate_params(model, mesh)        # one owner per matrix, hooks, placeholders
    opt = dmuon.Muon(model, lr=0.02)          # matrices: Muon on owners; the rest: AdamW

Importing dmuon changes nothing in torch.
"""

from dmuon.checkpoint import load, load_state_dict, state_dict
from dmuon.distconfig import (
    DistributedConfig,
    create_devicemesh_config,
    create_dtensor_config,
    create_processgroup_config,
)
from dmuon.faults import Heartbeat
from dmuon.hooks.dedicate import dedicate_params, default_predicate, no_sync
from dmuon import qk_clip
from dmuon.optim import Muon, clip_grad_norm_
from dmuon.owners.blocks import Split
from dmuon.owners.plan import MatrixSpec, OwnerPlan, build_plan

__all__ = [
    "DistributedConfig",
    "Heartbeat",
    "MatrixSpec",
    "Muon",
    "OwnerPlan",
    "Split",
    "build_plan",
    "clip_grad_norm_",
    "create_devicemesh_config",
    "create_dtensor_config",
    "create_processgroup_config",
    "dedicate_params",
    "default_predicate",
    "load",
    "load_state_dict",
    "no_sync",
    "qk_clip",
    "state_dict",
]
__version__ = "0.1.0"
