"""The one place in dmuon that touches FSDP2's private state: dedicated matrices are taken
from FSDP2's parameter groups, and FSDP2's settings read at call time (nothing cached). Tested
against torch 2.11 (one ``_fsdp_param_group``) and 2.13 (a list, ``_fsdp_param_groups``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)


def _fsdp_state(module: nn.Module) -> Any | None:
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state
    except ImportError:  # pragma: no cover - torch without FSDP2
        return None
    return _get_module_fsdp_state(module)


def _param_groups(state: Any) -> list[Any]:
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [group] if group is not None else []


def _remove_group(state: Any, group: Any) -> None:
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        groups.remove(group)
    else:
        state._fsdp_param_group = None
    # the group's settings stay readable (its divide factor), and the module's later
    # set_gradient_divide_factor calls, which reach only the groups FSDP2 still holds, reach it
    taken = state.__dict__.setdefault(_TAKEN, [])
    taken.append(group)
    if len(taken) == 1:
        for module in getattr(state, "_modules", ()):
            _follow_divide_factor(module, taken)


#: attribute of an FSDP2 state holding the parameter groups dmuon emptied and removed
_TAKEN = "_dmuon_taken_groups"
_DIVIDE_FACTOR_NAMES = ("gradient_divide_factor", "_gradient_divide_factor")


def _follow_divide_factor(module: nn.Module, taken: list[Any]) -> None:
    """Make ``module.set_gradient_divide_factor`` also reach the groups dmuon removed."""
    original = getattr(module, "set_gradient_divide_factor", None)
    if original is None or getattr(original, "_dmuon_follows", False):
        return

    def set_gradient_divide_factor(factor: float) -> None:
        original(factor)
        for group in taken:
            group.gradient_divide_factor = factor

    set_gradient_divide_factor._dmuon_follows = True  # type: ignore[attr-defined]
    set_gradient_divide_factor.__doc__ = original.__doc__
    object.__setattr__(module, "set_gradient_divide_factor", set_gradient_divide_factor)


def gradient_divide_factor(block: nn.Module) -> float | None:
    """FSDP2's gradient divide factor of ``block`` (``set_gradient_divide_factor``), or ``None``
    when unset (FSDP2 then averages over its data-parallel ranks): the divisor of a gradient's
    sum over every data-parallel rank (``_fsdp_collectives._get_gradient_divide_factors``).
    """
    state = _fsdp_state(block)
    if state is None:
        return None
    for group in _param_groups(state) + list(getattr(state, _TAKEN, ())):
        for name in _DIVIDE_FACTOR_NAMES:
            factor = getattr(group, name, None)
            if factor is not None:
                return float(factor)
    return None


def fsdp_states(model: nn.Module) -> list[Any]:
    """FSDP2 states of ``model`` and its submodules, each once, in module order."""
    seen, states = set(), []
    for module in model.modules():
        state = _fsdp_state(module)
        if state is not None and id(state) not in seen:
            seen.add(id(state))
            states.append(state)
    return states


def parent_map(model: nn.Module) -> dict[int, nn.Module]:
    """``id(child) -> parent`` for every submodule of ``model`` (build once, pass around)."""
    parents: dict[int, nn.Module] = {}
    for module in model.modules():
        for child in module.children():
            parents.setdefault(id(child), module)
    return parents


def enclosing_fsdp_module(module: nn.Module, parents: dict[int, nn.Module]) -> nn.Module | None:
    """The innermost module at or above ``module`` that FSDP2 wrapped (its block), or None."""
    node: nn.Module | None = module
    while node is not None:
        if _fsdp_state(node) is not None:
            return node
        node = parents.get(id(node))
    return None


# torch modules whose forward reads their children's weights without calling the children:
# nn.MultiheadAttention reads out_proj.weight; the encoder and decoder layers' inference fast
# path (torch._transformer_encoder_layer_fwd) reads linear1/linear2 and the attention weights.
READS_CHILD_WEIGHTS = (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)


def publish_block(module: nn.Module, parents: dict[int, nn.Module]) -> nn.Module:
    """The unit a dedicated matrix of ``module`` is published for and reduced with: the
    enclosing ``fully_shard`` module (all code that may read the weight runs inside it); without
    FSDP2, ``module`` or its outermost ancestor among :data:`READS_CHILD_WEIGHTS` (not any
    parent: a container's forward may never run).
    """
    block = enclosing_fsdp_module(module, parents)
    if block is not None:
        return block
    unit, node = module, parents.get(id(module))
    while node is not None:
        if isinstance(node, READS_CHILD_WEIGHTS):
            unit = node
        node = parents.get(id(node))
    return unit


def reshards_after_forward(block: nn.Module | None, parents: dict[int, nn.Module]) -> bool:
    """Whether FSDP2 frees ``block``'s unsharded parameters after forward (its
    ``reshard_after_forward``; the root keeps them unless set, ``FSDPState._lazy_init``); True
    without FSDP2. Read it before dmuon takes the block's matrices (its group may go).
    """
    state = _fsdp_state(block) if block is not None else None
    if state is None:
        return True
    parent = parents.get(id(block))
    is_root = parent is None or enclosing_fsdp_module(parent, parents) is None
    if is_root and getattr(state, "_auto_reshard_after_forward", True):
        return False
    groups = _param_groups(state)
    return not groups or any(g.post_forward_mesh_info is not None for g in groups)


def mixed_precision_dtypes(block: nn.Module | None) -> tuple[torch.dtype | None, torch.dtype | None]:
    """``(param_dtype, reduce_dtype)`` of ``block``'s FSDP2 policy; ``None`` where unset."""
    state = _fsdp_state(block) if block is not None else None
    policy = getattr(state, "_mp_policy", None)
    if policy is None:
        return None, None
    return policy.param_dtype, policy.reduce_dtype


def take_from_fsdp(model: nn.Module, module: nn.Module, attr: str) -> torch.Tensor | None:
    """Remove ``module.<attr>`` from FSDP2's management; returns its sharded DTensor, or
    ``None`` when FSDP2 does not manage it (tied weights were refused at selection)."""
    for state in fsdp_states(model):
        for group in _param_groups(state):
            for fsdp_param in list(group.fsdp_params):
                info = fsdp_param._module_info
                if info.module is not module or info.param_name != attr:
                    continue
                sharded = fsdp_param.sharded_param
                group.fsdp_params.remove(fsdp_param)
                # FSDPParam re-shards "its" parameter after load_state_dict; it is ours now.
                handle = getattr(fsdp_param, "_post_load_hook_handle", None)
                if handle is not None:
                    handle.remove()
                if not group.fsdp_params:
                    _remove_group(state, group)
                logger.debug("dmuon: took %s.%s from FSDP2", type(module).__name__, attr)
                return sharded
    return None


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """FSDP2's ``set_requires_gradient_sync`` on every FSDP2 module of ``model``."""
    for module in model.modules():
        setter = getattr(module, "set_requires_gradient_sync", None)
        if setter is not None and _fsdp_state(module) is not None:
            setter(enabled, recurse=False)


def gradient_sync_enabled(states: list[Any]) -> bool:
    """False when the user turned FSDP2's gradient sync off on a group of ``states``."""
    for state in states:
        for group in _param_groups(state):
            if not getattr(group, "reduce_grads", True):
                return False
    return True


class _Restore:
    """A handle whose ``remove()`` puts ``table[key]`` back to ``original`` (``None``: pops it)."""

    def __init__(self, table: dict, key: Any, original: Any = None) -> None:
        self.table, self.key, self.original = table, key, original

    def remove(self) -> None:
        if self.original is None:
            self.table.pop(self.key, None)
        elif self.key in self.table:  # FSDP2 may have removed its hook since
            self.table[self.key] = self.original


def wrap_final_callback(states: list[Any], after: Any) -> list[_Restore]:
    """Call ``after()`` whenever FSDP2 has finished a backward's gradient reduction, whoever
    made it finish (``torch.distributed.pipelining`` calls it itself): wraps, as an instance
    attribute, ``FSDPState.wait_for_gradient_reduction`` (torch 2.15) or
    ``_root_post_backward_final_callback`` (2.11, 2.13). Returns the restoring handles.
    """
    handles = []
    for state in states:
        name = next((n for n in ("wait_for_gradient_reduction", "_root_post_backward_final_callback")
                     if callable(getattr(state, n, None))), None)
        if name is None:
            logger.debug("dmuon: neither of FSDP2's wait_for_gradient_reduction and "
                         "_root_post_backward_final_callback was found")
            continue
        original = getattr(state, name)

        def callback(*args: Any, original: Any = original, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            after()
            return out

        state.__dict__[name] = callback
        handles.append(_Restore(state.__dict__, name))
    return handles


def _wraps(hook: Any, target: Any, depth: int = 8) -> bool:
    """Whether ``hook`` is ``target`` or wraps it (``functools.wraps`` chains, ``depth`` deep)."""
    for _ in range(depth):
        if hook is None:
            return False
        if hook == target:
            return True
        hook = getattr(hook, "__wrapped__", None)
    return False


def wrap_pre_forward(states: list[Any], wrap: Any) -> list[_Restore]:
    """Replace FSDP2's forward pre-hook on each module of ``states`` by ``wrap(hook)``, under
    the same hook id (same position, flags and handle). FSDP2's hook is
    ``FSDPState._pre_forward`` or a ``functools.wraps`` chain around it (grouped
    ``fully_shard([a, b])``, ``_dynamo_disable``). Returns the restoring handles.
    """
    handles = []
    for state in states:
        own = getattr(state, "_pre_forward", None)
        for module in getattr(state, "_modules", ()):
            hooks = module._forward_pre_hooks
            for hook_id, hook in list(hooks.items()):
                if own is not None and _wraps(hook, own):
                    hooks[hook_id] = wrap(hook)
                    handles.append(_Restore(hooks, hook_id, hook))
    if states and not handles:
        logger.debug("dmuon: FSDP2's forward pre-hooks not found; its errors pass unchanged")
    return handles
