"""``dedicate_params``: choose the dedicated matrices, agree on owners, install the hooks."""

from __future__ import annotations

import logging
import math
import os
import pickle
from typing import Any, Callable, Mapping

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dmuon.balance.cost import ReplicaCost, default_group_cost, matrix_costs
from dmuon.comm.collectives import check_same_on_all_ranks
from dmuon.comm.grad_buckets import REDUCE_MODES
from dmuon.comm.mesh_roles import build_roles
from dmuon.hooks import fsdp_adapter as fsdp
from dmuon.hooks.keep import keeps_replicas
from dmuon.hooks.bind import Selected
from dmuon.hooks.state import DedicateState
from dmuon.hooks.state_dict import StateDictHooks
from dmuon.hooks.default_plan import DEFAULT_FORWARD_TOKENS, default_plan
from dmuon.owners.plan import OwnerPlan, build_plan
from dmuon.owners.stacks import (check_expert_stack, declared_experts, expert_module_names,
                                 expert_parallel_size, in_expert, param_layout)

logger = logging.getLogger(__name__)

STATE_ATTR = "_dmuon_state"
#: Where :func:`declare_predicate` keeps a model's own default predicate.
PREDICATE_ATTR = "_dmuon_predicate"
Predicate = Callable[[str, nn.Parameter], "bool | int"]


def default_predicate(model: nn.Module, *, fused_blocks: Mapping[str, int] | None = None) -> Predicate:
    """Muon's usual scope: every trainable 2-D parameter except embedding weights (and a head
    tied to one), and every trainable expert stack (>= 3 dims, its module's ``num_experts``
    equal to its leading dim(s); one Muon matrix per expert). The rest go to AdamW. Stable
    across ``fully_shard`` (embeddings and stacks are recognised by name). To leave one more
    parameter on AdamW, wrap it: ``lambda name, p: pick(name, p) and name != "lm_head.weight"``.

    Args:
        model: the model whose parameters the predicate will be asked about.
        fused_blocks: ``{attribute name: k}`` cuts each matrix of a parameter so named (e.g.
            ``{"gate_up_proj": 2}``) into ``k`` row blocks, each its own Newton-Schulz matrix.

    Returns:
        ``predicate(fqn, param) -> bool | int``: false to leave the parameter to AdamW, true
        to select it, a positive int ``k`` to select it cut into ``k`` row blocks.

    Raises:
        ValueError: a ``fused_blocks`` count that is not a positive int.
    """
    fused = dict(fused_blocks or {})
    for attr, k in fused.items():
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"dmuon: fused_blocks[{attr!r}] must be a positive int (row blocks), got {k!r}")
    embeddings = [(name, m) for name, m in model.named_modules()
                  if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]
    embedding_names = {f"{name}.weight" if name else "weight" for name, _ in embeddings}
    stacks = set()  # names of expert stacks: stable under fully_shard, like the embeddings'
    for name, module in model.named_modules():
        experts = declared_experts(module)
        if experts is None or isinstance(module, nn.modules.conv._ConvNd):
            continue
        for attr, p in module._parameters.items():
            if p is not None and p.ndim >= 3 and experts in (math.prod(p.shape[:-2]), p.shape[0]):
                stacks.add(f"{name}.{attr}" if name else attr)

    def predicate(name: str, param: nn.Parameter) -> bool | int:
        if not param.requires_grad or name in embedding_names:
            return False
        if param.ndim != 2 and name not in stacks:
            return False
        if any(m.weight is param for _, m in embeddings):
            return False
        k = fused.get(name.rsplit(".", 1)[-1], 1)
        return True if k == 1 else k

    return predicate


def declare_predicate(model: nn.Module, predicate: Predicate) -> None:
    """Make ``predicate`` the one :func:`dedicate_params` uses for ``model`` when the caller
    passes none (e.g. the LeRobot integration's, which leaves the unused ``lm_head`` out).

    Args:
        model: the model later passed to :func:`dedicate_params`.
        predicate: ``predicate(fqn, param) -> bool | int``, the same answer before and after
            ``fully_shard``.

    Raises:
        TypeError: ``predicate`` is not callable.
    """
    if not callable(predicate):
        raise TypeError(f"dmuon: declare_predicate takes a callable predicate(fqn, param), got "
                        f"{type(predicate).__name__}")
    object.__setattr__(model, PREDICATE_ATTR, predicate)


def select_matrices(model: nn.Module, predicate: Predicate, *, ep_name: str | None = None,
                    ep_size: int = 1) -> list[Selected]:
    """The dedicated parameters (matrices and stacks of them) in model order. ``ValueError``,
    on every rank alike: a selected tensor under 2-D, a >2-D one that is no expert stack, row
    blocks that do not divide the rows, tied weights, an expert-parallel stack dmuon refuses."""
    experts = expert_module_names(model)
    names_by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_by_id.setdefault(id(p), []).append(name)
    selected: list[Selected] = []
    for module_name, module in model.named_modules():
        for attr, param in list(module._parameters.items()):
            if param is None:
                continue
            fqn = f"{module_name}.{attr}" if module_name else attr
            picked = predicate(fqn, param)
            if not picked:
                continue
            names = names_by_id.get(id(param), [])
            if len(names) > 1:
                raise ValueError(
                    f"dmuon: parameter {fqn!r} is shared under the names {names} (tied weights); "
                    f"a dedicated matrix must belong to one module. Pass predicate=... to leave it "
                    f"on AdamW."
                )
            blocks = 1 if picked is True else picked
            layout = param_layout(fqn, param.shape, blocks)  # >= 2-D, blocks divide the rows
            check_expert_stack(fqn, module, param.shape)
            ep = expert_parallel_size(fqn, param, ep_name, ep_size)
            selected.append(Selected(fqn=fqn, module=module, attr=attr, shape=layout.shape,
                                     blocks=layout.blocks, optional=in_expert(module_name, experts), ep=ep))
    return selected


def dedicate_params(
    model: nn.Module,
    mesh,
    *,
    predicate: Predicate | None = None,
    plan: OwnerPlan | str | os.PathLike | None = None,
    prefetch: int = 1,
    reshard_after_forward: bool | None = None,
    bucket_cap_mb: float = 25.0,
    replicate_mode: str = "auto",
    reduce_mode: str = "reduce",
    group_cost: float | str = "auto",
    step_check: bool = True,
    replicas: str | None = None,
    replica_cost: ReplicaCost | None = None,
    forward_tokens: int = DEFAULT_FORWARD_TOKENS,
    solver: str = "heuristic",
) -> OwnerPlan:
    """Give every dedicated matrix of ``model`` one owner rank and install dmuon's hooks.

    Call it on every rank, before or after ``fully_shard``; then build :class:`dmuon.Muon`
    over the model. Collective over ``mesh``.

    Args:
        model: an ``nn.Module`` wrapped by FSDP2 ``fully_shard`` (HSDP and FSDP x TP
            included), a tensor-parallel module, or a plain module replicated on a 1-D mesh
            (dmuon then averages the other gradients DDP-style; not a DDP wrapper).
        mesh: the ``DeviceMesh``, roles by dimension name (:mod:`dmuon.comm.mesh_roles`): 1-D
            data parallel; ``("replicate", "shard")`` HSDP; ``("dp", "tp")`` FSDP x TP;
            ``("replicate", "shard", "tp")``; ``("tp",)``; expert parallelism's
            ``("efsdp", "ep")`` or ``("ep",)`` (HSDP in front); with pipeline parallelism, the
            stage's mesh or one with a ``"pp"`` dimension (call it once per stage module).
        predicate: ``predicate(fqn, param) -> bool | int`` picks the Muon matrices (an int
            ``k``: cut each stored matrix into ``k`` row blocks); default: the one declared on
            the model (:func:`declare_predicate`), else :func:`default_predicate`.
        plan: an :class:`OwnerPlan` or its JSON path (``python -m dmuon.profile``); default:
            solved on rank 0 and broadcast (:mod:`dmuon.hooks.default_plan`).
        prefetch: units whose publication is issued ahead of the one running (>= 1).
        reshard_after_forward: free non-owners' full weights between forward and backward;
            ``None``: as FSDP2 does with each block (without FSDP2, free).
        bucket_cap_mb: plain replicated module only: DDP's gradient bucket cap (MiB, > 0).
        replicate_mode: HSDP: ``"compute"`` (every replica's owner runs Newton-Schulz),
            ``"broadcast"`` (replica 0's owner runs it and broadcasts) or ``"auto"`` (per
            matrix, the cheaper by ``replica_cost``; keeps a given plan's modes); all exact.
        reduce_mode: ``"reduce"`` (one reduce per owner of an FSDP2 block) or ``"all_reduce"``
            (one all-reduce, twice the bytes); both exact (:mod:`dmuon.comm.grad_buckets`).
        group_cost: default plan only: the cost (FLOP-model units) of one more owner in an
            FSDP2 block; ``"auto"``: by backend (:func:`dmuon.balance.cost.default_group_cost`).
        step_check: compare every rank's step and backward counts at each forward and
            backward (:mod:`dmuon.hooks.step_check`).
        replicas: plain replicated module on a 1-D mesh only: ``"keep"`` (default there):
            every rank keeps every matrix whole; ``"placeholder"``: non-owners hold zero-size
            placeholders (:mod:`dmuon.hooks.keep`).
        replica_cost: HSDP, ``replicate_mode="auto"`` only: the cost model that picks each
            matrix's mode (default :class:`dmuon.balance.cost.ReplicaCost`).
        forward_tokens: default plan only: tokens per rank per micro-batch through each
            dedicated matrix (>= 1), which set the deadlines (:mod:`dmuon.hooks.default_plan`).
        solver: default plan only: ``"heuristic"`` (under a second) or ``"milp"`` (CBC
            warm-started from it, 5 s limit; never worse).

    Returns:
        The owner plan in use (identical on every rank).

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` or ``mesh`` not a ``DeviceMesh``.
        ValueError: a mesh that does not hold every rank or whose roles cannot be told apart,
            a predicate selecting a non-2-D or tied tensor, a plan for another model or world
            size, a bad option value, or a model wrapped in ``DistributedDataParallel``.
        RuntimeError: ``dedicate_params`` already called on this model, or ranks that disagree
            on the plan (raised on every rank, naming the ranks).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"dmuon: dedicate_params takes the model (an nn.Module), got {type(model).__name__}; "
                        f"pass the module itself, not model.parameters() or a list of tensors")
    if getattr(model, STATE_ATTR, None) is not None:
        raise RuntimeError(
            "dmuon: dedicate_params was already called on this model; call it once per model"
        )
    if prefetch < 1:
        raise ValueError(f"dmuon: prefetch must be >= 1, got {prefetch}")
    if replicate_mode not in ("auto", "compute", "broadcast"):
        raise ValueError(f"dmuon: replicate_mode must be 'auto', 'compute' or 'broadcast', got {replicate_mode!r}")
    if reshard_after_forward not in (None, True, False):
        raise ValueError(f"dmuon: reshard_after_forward must be None (follow FSDP2), True or False, "
                         f"got {reshard_after_forward!r}")
    if reduce_mode not in REDUCE_MODES:
        raise ValueError(f"dmuon: reduce_mode must be one of {REDUCE_MODES}, got {reduce_mode!r}")
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0:
        raise ValueError(f"dmuon: bucket_cap_mb must be a number of MiB > 0 (DDP's default is 25), "
                         f"got {bucket_cap_mb!r}")
    bucket_bytes = max(1, int(bucket_cap_mb * 2**20))
    if isinstance(forward_tokens, bool) or not isinstance(forward_tokens, int) or forward_tokens < 1:
        raise ValueError(f"dmuon: forward_tokens must be a positive int (tokens per rank per "
                         f"micro-batch through each matrix), got {forward_tokens!r}")
    # DDP's reducer would wait forever for the gradients of the parameters dmuon swaps in
    for name, module in model.named_modules():
        if isinstance(module, DistributedDataParallel):
            where = "the model" if not name else f"its submodule {name!r}"
            raise ValueError(
                f"dmuon: {where} is wrapped in torch DistributedDataParallel; dedicate_params needs "
                f"the plain module (dedicate_params(ddp_model.module, mesh)). dmuon averages the "
                f"gradients of the other parameters itself, in DDP-style buckets (bucket_cap_mb)."
            )
    if not dist.is_initialized():
        raise RuntimeError("dmuon: torch.distributed is not initialized; call init_process_group first")
    # Groups of our own keep dmuon's broadcasts and reduces out of FSDP2's collective order.
    roles = build_roles(mesh, step_check=step_check)
    keep = keeps_replicas(replicas, fsdp_wrapped=bool(fsdp.fsdp_states(model)), roles=roles)
    if predicate is None:
        predicate = getattr(model, PREDICATE_ATTR, None) or default_predicate(model)
    selected = select_matrices(model, predicate, ep_name=roles.ep_name, ep_size=roles.ep_size)
    shapes = {s.fqn: s.layout for s in selected}  # under expert parallelism, this rank's local stacks
    expert_parallel = [s.fqn for s in selected if s.ep > 1]
    blocks = {s.fqn: s.blocks for s in selected if s.blocks != 1}
    world_size, tp_size = roles.shard_size, roles.tp_size
    if group_cost == "auto":
        cost = default_group_cost(str(dist.get_backend(roles.shard)), "flops")
    elif isinstance(group_cost, str) or not float(group_cost) >= 0 or float(group_cost) == float("inf"):
        raise ValueError(f"dmuon: group_cost must be 'auto' or a finite number >= 0 (FLOPs per "
                         f"(block, owner) pair), got {group_cost!r}")
    else:
        cost = float(group_cost)
    if plan is None and keep:  # DDP-style path: one owner per bucket, deterministic
        device = selected[0].param.device.type if selected else "cpu"
        costs = matrix_costs([s.layout.matrix_shape for s in selected], device)
        plan = build_plan([(s.fqn, s.shape) for s in selected], world_size, bucket_bytes=bucket_bytes,
                          element_size=max((s.param.element_size() for s in selected), default=4),
                          blocks=blocks,
                          costs=[c * s.layout.count * s.blocks for s, c in zip(selected, costs)])
    # What this rank does not do because no peer is there to answer (the fake backend).
    offline: list[str] = []
    if plan is None:
        def solve() -> OwnerPlan:
            return default_plan(model, selected, world_size, tp_size=tp_size, blocks=blocks,
                                expert_parallel=expert_parallel, ep_size=roles.ep_size,
                                group_cost=cost, forward_tokens=forward_tokens, solver=solver)

        if roles.fake:  # the plan rank 0 of the real job would solve and broadcast, solved here
            plan = solve()
            offline.append("plan broadcast (plan solved in process, as rank 0 would)")
        else:
            # A time-limited solve is not reproducible across ranks: rank 0 solves and sends the
            # plan, or its error's name and text (an exception may not pickle), so no rank waits
            solved: list[Any] = [None]
            error: Exception | None = None
            if dist.get_rank(roles.world) == 0:
                try:
                    solved[0] = solve()
                    pickle.dumps(solved[0])
                except Exception as e:  # sent to the other ranks, raised below on all
                    error = e
                    solved[0] = f"{type(e).__name__}: {e}"
            dist.broadcast_object_list(solved, src=dist.get_global_rank(roles.world, 0), group=roles.world)
            if error is not None:
                raise error
            if isinstance(solved[0], str):
                raise RuntimeError(f"dmuon: rank 0 could not build the owner plan: {solved[0]}")
            plan = solved[0]
    elif not isinstance(plan, OwnerPlan):
        plan = OwnerPlan.load(plan)
    plan = plan.with_replicate_modes(replicate_mode if roles.replicate_dim is not None else None, replica_cost)
    plan.check_matches(shapes, world_size, tp_size, ep_size=roles.ep_size, expert_parallel=expert_parallel)
    if roles.fake:  # an all_gather_object would unpickle bytes no peer sent
        offline.append("plan digest check (no peers to compare with)")
    else:
        check_same_on_all_ranks(plan.digest(), "owner plan digest", roles.world)
    if step_check and roles.fake:
        offline.append("step check (no gloo group over a fake store; no peers to agree with)")
    state = DedicateState(model, roles, plan, selected, prefetch=prefetch,
                          reshard_after_forward=reshard_after_forward, bucket_bytes=bucket_bytes,
                          reduce_mode=reduce_mode, replicas=replicas,
                          step_check=step_check and roles.steps is not None)
    state.offline = tuple(offline)
    # model.state_dict() / load_state_dict() show FSDP2's (DDP's) view (dmuon.hooks.state_dict)
    state.state_dict_hooks = StateDictHooks(state)
    state.handles += state.state_dict_hooks.install()
    object.__setattr__(model, STATE_ATTR, state)
    if dist.get_rank(roles.world) == 0:
        loads = plan.loads()
        logger.info(
            "dmuon: %d dedicated matrices over %d ranks (%s); makespan %.3g %s, lower bound %.3g, "
            "per-rank load min/max %.3g/%.3g",
            len(selected), world_size, plan.method, plan.makespan, plan.cost_unit,
            plan.lower_bound, min(loads) if loads else 0, max(loads) if loads else 0,
        )
        if "exposed" in plan.extra:
            logger.info("dmuon: Newton-Schulz exposed to the next forward under overlap %.3g %s "
                        "(bound %.3g; objective %s)", plan.extra["exposed"], plan.cost_unit,
                        plan.extra.get("exposed_bound", float("nan")), plan.extra.get("objective"))
    return plan


def get_state(model: nn.Module) -> DedicateState:
    """The :class:`DedicateState` of a model passed to ``dedicate_params`` (else ``ValueError``)."""
    state = getattr(model, STATE_ATTR, None)
    if state is None:
        raise ValueError(
            "dmuon: this model has no owners; call dmuon.dedicate_params(model, mesh) on every "
            "rank before building dmuon.Muon(model, ...)"
        )
    return state


class no_sync:
    """Context manager: backward passes inside accumulate gradients locally, no communication.

    The next backward outside reduces them to their owners (and, on FSDP2, reduce-scatters the
    rest); FSDP2's ``set_requires_gradient_sync(False)`` is honored the same way. Memory: a
    full-size gradient per dedicated matrix on every rank while accumulating.

    Args:
        model: the model given to ``dedicate_params``.
    """

    def __init__(self, model: nn.Module) -> None:
        self.state = get_state(model)
        self.model = model

    def __enter__(self) -> "no_sync":
        self._sync(False)
        return self

    def __exit__(self, *exc: object) -> None:
        self._sync(True)

    def _sync(self, enabled: bool) -> None:
        self.state.backward.sync_enabled = enabled
        if fsdp.fsdp_states(self.model):
            fsdp.set_gradient_sync(self.model, enabled)
