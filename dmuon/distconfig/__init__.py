"""Pluggable owner-centric Muon without hooks: ``DistributedConfig`` and its helpers.

For users who keep FSDP2's (or DDP's, TP's) own sharding and want only Muon's step to be
owner-centric::

    cfg = create_dtensor_config()                 # or create_processgroup_config / _devicemesh_
    opt = ConfiguredMuon(model.parameters(), distributed_config=cfg, lr=0.02)
"""

from dmuon.distconfig.config import DistributedConfig
from dmuon.distconfig.optimizer import ConfiguredMuon
from dmuon.distconfig.strategies import (
    create_devicemesh_config,
    create_dtensor_config,
    create_processgroup_config,
)

__all__ = [
    "ConfiguredMuon",
    "DistributedConfig",
    "create_devicemesh_config",
    "create_dtensor_config",
    "create_processgroup_config",
]
