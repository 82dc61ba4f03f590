"""dmuon's hooks under ``torch.compile``: run them eagerly, as FSDP2 runs its own.

Dynamo would otherwise trace into a hook (a ``Work.wait``, a storage resize, a swap of
``module._parameters``): each unsupported call is a graph break, and since every unit's hook
is a closure over a different unit, the same code object is re-traced once per unit until
dynamo's recompile limit (``torch._dynamo.config.recompile_limit``, 8) makes it give up on the
hook and fall back to eager for good. FSDP2 avoids both by wrapping its forward hooks in
``torch._dynamo.disable(..., recursive=True)`` (``_dynamo_disable`` in
``torch/distributed/fsdp/_fully_shard/_fsdp_common.py``); :func:`dynamo_disable` does the same
for dmuon's hook functions. A disabled hook still splits the graph where it is called, exactly
as FSDP2's own hooks do.
"""

from __future__ import annotations

from typing import Callable, TypeVar

_F = TypeVar("_F", bound=Callable)


def dynamo_disable(fn: _F) -> _F:
    """``torch._dynamo.disable(fn, recursive=True)``: ``torch.compile`` runs the hook eagerly.

    Apply it where a hook is created (dmuon creates its hooks in ``dedicate_params``, so
    ``import dmuon`` still does not import ``torch._dynamo``), to every function dmuon
    registers as a module or autograd hook. The disabled function itself is what gets
    registered, with no Python wrapper of dmuon's around it: dynamo then meets it inside
    ``nn.Module._call_impl``, where it cannot resume a graph, and runs that module's call
    eagerly (its ``forward`` frame is compiled on its own), as it does with FSDP2's hooks. A
    wrapper in dmuon's code would instead be split with a resume function per call site; all
    share one code object, so dynamo recompiles it per unit until its recompile limit.

    Args:
        fn: the hook.

    Returns:
        The disabled hook (same signature).
    """
    import torch._dynamo

    return torch._dynamo.disable(fn, recursive=True, reason="dmuon hook: runs eagerly, as FSDP2's hooks")
