"""dmuon's hooks under ``torch.compile``: run them eagerly, as FSDP2 runs its own.

Traced by dynamo, dmuon's forward hooks break the graph inside themselves (at ``Work.wait``,
and by dynamo's messages at a pybind11 constructor and at a call taking a list and a closure:
the profiler range and ``register_multi_grad_hook``): on a 2-block model with FSDP2,
whole-model compile gave 19 graph breaks and 15 graphs (FSDP2 alone: 0 breaks, 1 graph, and
2 frames dynamo skipped at its own disabled hooks; ``tests/compile_cases.py``, aot_eager,
torch 2.13). FSDP2 registers its hooks wrapped in
``torch._dynamo.disable(..., recursive=True)`` (``_dynamo_disable`` in
``torch/distributed/fsdp/_fully_shard/_fsdp_common.py``); :func:`dynamo_disable` does the same
for dmuon's hooks: 3 breaks and 7 graphs on the same model, every remaining break at a call of
a disabled dmuon hook, no recompile-limit hit. What remains comes from where the hooks sit
(each dedicated leaf module), not from what they do.
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
