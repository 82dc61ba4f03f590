"""Expert parallelism for Hugging Face MoE models (recipe: docs/usage.md).

transformers 5 keeps a MoE layer's experts as two stacks, ``gate_up_proj`` ``[E, 2 * I, H]`` and
``down_proj`` ``[E, H, I]``, with a forward over all experts. :func:`shard_experts` cuts them as
torchtitan's ``ExpertParallel`` does (``Shard(0)`` over ``"ep"``, all-to-all dispatch and
combine: :func:`ep_dispatch`) before ``fully_shard``; :func:`dmuon.dedicate_params` then finds
the stacks on the ``("efsdp", "ep")`` mesh.
"""

from __future__ import annotations

import types
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["ep_dispatch", "experts_forward", "shard_experts"]

_STACKS = ("gate_up_proj", "down_proj")


def ep_dispatch(routed: torch.Tensor, counts: torch.Tensor, group: dist.ProcessGroup | None,
                compute: Callable[[torch.Tensor, list[int]], torch.Tensor]) -> torch.Tensor:
    """Send each row to the rank holding its expert, run ``compute`` there, bring the rows back
    (torchtitan's ``ExpertParallel`` dispatch and combine; autograd all-to-all).

    Args:
        routed: ``[rows, hidden]``, any float dtype, sorted by global expert index; not mutated.
        counts: ``[E]`` int64, rows per global expert on this rank (``counts.sum() == rows``).
            Rank ``r`` of ``group`` holds experts ``r * E / ep`` to ``(r + 1) * E / ep - 1``.
        group: the ``"ep"`` process group, or ``None`` when every expert is local.
        compute: ``compute(rows, rows_per_local_expert) -> [rows, out]``, with ``rows`` sorted
            by local expert; it must keep the row order.

    Returns:
        ``[rows, out]``: ``compute``'s output for each row, in ``routed``'s order.

    Raises:
        ValueError: ``counts`` has a number of experts the group size does not divide.
    """
    if group is None:
        return compute(routed, counts.tolist())
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    ep = dist.get_world_size(group)
    if counts.numel() % ep:
        raise ValueError(f"dmuon: ep_dispatch got counts for {counts.numel()} experts, which the "
                         f"expert-parallel group of {ep} ranks does not divide; use an 'ep' size "
                         f"that divides the number of experts")
    local = counts.numel() // ep
    got = torch.empty_like(counts)  # [source rank, local expert]: rows coming here
    dist.all_to_all_single(got, counts, group=group)
    send = counts.view(ep, local).sum(1).tolist()
    recv = got.view(ep, local).sum(1).tolist()
    arrived = all_to_all_single_autograd(routed, recv, send, group)
    # arrived rows are source-major; the local experts want them expert-major, and back
    expert_of = torch.arange(local, device=counts.device).repeat(ep).repeat_interleave(got)
    perm = torch.argsort(expert_of, stable=True)
    done = compute(arrived[perm], got.view(ep, local).sum(0).tolist())
    back = torch.empty_like(done).index_copy(0, perm, done)
    return all_to_all_single_autograd(back, send, recv, group)


def experts_forward(experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers 5's ``Qwen3MoeExperts.forward``, ``sum_k w_k * down[e_k] (act(gate[e_k] x) *
    up[e_k] x)`` (``gate_up_proj[e]`` is ``gate`` above ``up``), each (token, expert) pair sent
    by :func:`ep_dispatch` over ``experts.ep_group``.

    Args:
        experts: the experts module (``gate_up_proj`` ``[E, 2 * I, H]``, ``down_proj``
            ``[E, H, I]``, ``act_fn``, ``num_experts``, ``ep_group``).
        hidden_states: ``[tokens, H]``.
        top_k_index: ``[tokens, k]`` int64, each token's experts (global indices).
        top_k_weights: ``[tokens, k]``, the router's weights.

    Returns:
        ``[tokens, H]`` in ``hidden_states``' dtype.
    """
    tokens, k = top_k_index.shape
    expert = top_k_index.reshape(-1)
    token = torch.arange(tokens, device=hidden_states.device).repeat_interleave(k)
    order = torch.argsort(expert, stable=True)
    counts = torch.bincount(expert, minlength=experts.num_experts)
    gate_up, down = (w.to_local() if hasattr(w, "to_local") else w
                     for w in (experts.gate_up_proj, experts.down_proj))

    def compute(x: torch.Tensor, per_expert: list[int]) -> torch.Tensor:
        outs = []
        for e, chunk in enumerate(torch.split(x, per_expert)):
            gate, up = nn.functional.linear(chunk, gate_up[e]).chunk(2, dim=-1)
            outs.append(nn.functional.linear(experts.act_fn(gate) * up, down[e]))
        return torch.cat(outs) if outs else x[:0]

    out = ep_dispatch(hidden_states[token[order]], counts, experts.ep_group, compute)
    out = out * top_k_weights.reshape(-1)[order, None]
    return torch.zeros_like(hidden_states).index_add(0, token[order], out.to(hidden_states.dtype))


def shard_experts(experts: nn.Module, ep_mesh: Any) -> nn.Module:
    """Lay a Hugging Face experts module out for expert parallelism, in place, before
    ``fully_shard``: each stack becomes a DTensor ``Shard(0)`` over ``ep_mesh``, and
    ``experts.ep_group`` and ``experts.forward`` (:func:`experts_forward`) are set.

    Args:
        experts: a transformers 5 experts module (``layer.mlp.experts``), its parameters full
            and equal on every rank (they are cut, not broadcast).
        ep_mesh: a 1-D ``DeviceMesh`` over the expert-parallel ranks (``mesh["ep"]``).

    Returns ``experts``.

    Raises:
        ValueError: ``experts`` lacks a stack, ``act_fn`` or ``num_experts``; a stack is not
            ``[num_experts, rows, cols]``; ``ep_mesh`` is not 1-D or does not divide ``num_experts``.
    """
    from torch.distributed.tensor import Shard, distribute_tensor

    name = type(experts).__name__
    missing = [a for a in (*_STACKS, "act_fn", "num_experts") if not hasattr(experts, a)]
    if missing:
        raise ValueError(f"dmuon: shard_experts needs a transformers 5 experts module with "
                         f"gate_up_proj, down_proj, act_fn and num_experts; {name} has no "
                         f"{', '.join(missing)}. For another MoE layout, call ep_dispatch from "
                         f"its own forward")
    if ep_mesh.ndim != 1:
        raise ValueError(f"dmuon: shard_experts takes the 1-D expert-parallel mesh (mesh['ep']), "
                         f"got a mesh of shape {tuple(ep_mesh.shape)}")
    ep, n = ep_mesh.size(), experts.num_experts
    if n % ep:
        raise ValueError(f"dmuon: {name} has {n} experts, which the expert-parallel mesh of "
                         f"{ep} ranks does not divide; use an 'ep' size that divides {n} "
                         f"({[d for d in range(1, n + 1) if n % d == 0]})")
    for attr in _STACKS:
        p = getattr(experts, attr)
        if p.dim() != 3 or p.shape[0] != n:
            raise ValueError(f"dmuon: {name}.{attr} has shape {tuple(p.shape)}; expected a "
                             f"[num_experts={n}, rows, cols] stack")
        experts.register_parameter(attr, nn.Parameter(distribute_tensor(p.data, ep_mesh, [Shard(0)]),
                                                       requires_grad=p.requires_grad))
    experts.ep_group = ep_mesh.get_group()
    experts.forward = types.MethodType(experts_forward, experts)
    return experts
