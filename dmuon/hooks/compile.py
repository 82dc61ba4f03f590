"""dmuon's hooks under ``torch.compile``: run them eagerly, as FSDP2 runs its own.

FSDP2 registers its hooks wrapped in ``torch._dynamo.disable(..., recursive=True)``
(``_dynamo_disable`` in ``torch/distributed/fsdp/_fully_shard/_fsdp_common.py``);
:func:`dynamo_disable` does the same for dmuon's, so dynamo does not trace into them (they wait
on works and register autograd hooks) and breaks the graph only at their calls.
"""

from __future__ import annotations

from typing import Callable, TypeVar

_F = TypeVar("_F", bound=Callable)


def dynamo_disable(fn: _F) -> _F:
    """``torch._dynamo.disable(fn, recursive=True)``. Register the result itself: a Python
    wrapper would share one code object across units, which dynamo recompiles per unit."""
    import torch._dynamo

    return torch._dynamo.disable(fn, recursive=True, reason="dmuon hook: runs eagerly, as FSDP2's hooks")
