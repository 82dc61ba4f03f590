"""``dmuon.Muon(params, distributed_config=...)``: owner-centric Muon without hooks, over the
sharding FSDP2 / DDP / TP already did (:mod:`dmuon.distconfig.optimizer`). Never imports
:mod:`dmuon.optim`."""

from dmuon.distconfig.config import DistributedConfig
from dmuon.distconfig.strategies import (
    create_devicemesh_config,
    create_dtensor_config,
    create_processgroup_config,
)

__all__ = [
    "DistributedConfig",
    "create_devicemesh_config",
    "create_dtensor_config",
    "create_processgroup_config",
]
