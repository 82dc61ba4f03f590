"""Pluggable owner-centric Muon without hooks: ``DistributedConfig`` and its helpers.

For users who keep FSDP2's (or DDP's, TP's) own sharding and want only Muon's step to be
owner-centric::

    cfg = create_dtensor_config()                 # or create_processgroup_config / _devicemesh_
    opt = dmuon.Muon(model.parameters(), distributed_config=cfg, lr=0.02)

The update itself lives in :mod:`dmuon.distconfig.optimizer` (the strategies ``dmuon.Muon``
picks); this package never imports :mod:`dmuon.optim`.
"""

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
