"""``DistributedConfig``: the three functions that make Muon's step owner-centric (the PyTorch
design "Muon Distributed Training"): each matrix is orthogonalized once, on its assigned rank."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from torch import Tensor


@dataclass(frozen=True, slots=True)
class DistributedConfig:
    """How Muon's matrices are assigned, gathered and redistributed; build one by hand, or
    with :func:`dmuon.create_processgroup_config`, :func:`dmuon.create_devicemesh_config` or
    :func:`dmuon.create_dtensor_config`.

    Attributes:
        assign_fn: ``assign_fn(params, state) -> {param_index: rank}``, called once when the
            optimizer is built, identically on every rank, with the Muon matrices (DTensors or
            local tensors) in param-group order. Must map every index in ``range(len(params))``
            to a rank in ``[0, world_size)`` of ``state["group"]`` (default group if absent).
            May be collective, and may store ``"layouts"`` and ``"full_shapes"`` in ``state``.
        gather_fn: ``gather_fn(momentum_buffer, dst_rank, state) -> Tensor | None``: from this
            rank's shard or replica of one matrix's Newton-Schulz input (a DTensor when the
            parameter is one), the full ``[rows, cols]`` tensor on ``dst_rank``, ``None`` on
            every other rank. Collective over the ranks that hold the matrix.
        redistribute_fn: ``redistribute_fn(update, src_rank, state) -> Tensor``: ``update`` is
            the full orthogonalized ``[rows, cols]`` matrix on ``src_rank`` and ``None``
            elsewhere; returns this rank's local shard or replica (the local shape of the
            parameter). Collective. Called after a round's gathers, before the next round's.
        state: metadata for the three functions (process groups, meshes, layouts, ...). The
            optimizer adds ``"assignments"`` and ``"rank"``.
        async_gpu_parallelism: ranks orthogonalize their own matrices at the same time (rounds
            of one matrix per owner). False: one matrix at a time, in parameter order.
        prefetch_count: rounds whose gathers are issued ahead (0: none; each costs about a full
            matrix per owner). Applies to the helpers' functions only.

    Raises:
        ValueError: a function that is not callable, a ``state`` that is not a dict, a bad
            ``prefetch_count`` or a non-bool ``async_gpu_parallelism``.
    """

    assign_fn: Callable[[list[Tensor], dict[str, Any]], Mapping[int, int]]
    gather_fn: Callable[..., Optional[Tensor]]
    redistribute_fn: Callable[..., Tensor]
    state: dict[str, Any] = field(default_factory=dict)
    async_gpu_parallelism: bool = True
    prefetch_count: int = 1

    def __post_init__(self) -> None:
        for name in ("assign_fn", "gather_fn", "redistribute_fn"):
            if not callable(getattr(self, name)):
                raise ValueError(f"dmuon: DistributedConfig.{name} must be callable; got "
                                 f"{type(getattr(self, name)).__name__}")
        if not isinstance(self.state, dict):
            raise ValueError(f"dmuon: DistributedConfig.state must be a dict; got "
                             f"{type(self.state).__name__}")
        count = self.prefetch_count
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"dmuon: DistributedConfig.prefetch_count must be an int >= 0; got "
                             f"{count!r} (0 disables prefetching, 1-2 recommended)")
        if not isinstance(self.async_gpu_parallelism, bool):
            raise ValueError(f"dmuon: DistributedConfig.async_gpu_parallelism must be a bool; "
                             f"got {self.async_gpu_parallelism!r}")


def validate_assignments(assignments: Any, num_params: int, world_size: int) -> tuple[int, ...]:
    """Check ``assign_fn``'s result (``{param_index: rank}`` or a sequence of ranks) for
    ``num_params`` matrices over ``world_size`` ranks; return the owners in index order. Raises
    ValueError (listing the offending entries) for anything else."""
    if isinstance(assignments, (list, tuple)):
        assignments = dict(enumerate(assignments))
    if not isinstance(assignments, Mapping):
        raise ValueError(f"dmuon: assign_fn must return {{param_index: rank}}; got "
                         f"{type(assignments).__name__}")
    missing = [i for i in range(num_params) if i not in assignments]
    if missing:
        raise ValueError(f"dmuon: assign_fn assigned no rank to parameter indices {missing[:20]} "
                         f"(of {num_params}); every index in range({num_params}) needs one")
    extra = [k for k in assignments if not (isinstance(k, int) and 0 <= k < num_params)]
    if extra:
        raise ValueError(f"dmuon: assign_fn returned unknown parameter indices {extra[:20]}; "
                         f"valid indices are range({num_params})")
    bad = {i: r for i, r in assignments.items()
           if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world_size}
    if bad:
        raise ValueError(f"dmuon: assign_fn assigned ranks outside [0, {world_size}): "
                         f"{dict(list(bad.items())[:20])} (param_index: rank)")
    return tuple(int(assignments[i]) for i in range(num_params))
