"""What ``opt.state_dict()`` / ``opt.load_state_dict()`` show of a :class:`dmuon.Muon`.

torch's state-dict utilities (``get_/set_optimizer_state_dict``, full or sharded), ``dcp.save``
and the trainers built on them expect what FSDP2 + a torch optimizer gives. The hooks here give
it, on every ``dmuon.Muon`` (the ``distributed_config`` and single-device paths install them
without a model state: only ``param_groups`` are translated):

* **param_groups:** ``ns_dtype`` as a string (``"float16"``; torch's utilities refuse a
  ``torch.dtype``), parsed back on load (:func:`plain_groups`, :func:`parsed_groups`).
* **Muon momentum** (owner runtime): each dedicated matrix's ``momentum_buffer`` enters on every
  rank in torch's view of the parameter (:func:`dmuon.hooks.state_dict.entries`; collective,
  one broadcast per matrix; HSDP ``"broadcast"`` mode: replica 0's buffer, the only one
  stepped). An owner that has not stepped the matrix offers zeros (``torch.optim.Muon``'s
  start), unless no owner holds a buffer: a fresh optimizer shows no Muon state, as a fresh
  torch optimizer shows none. On load each entry is staged, checked and agreed on
  (:meth:`dmuon.hooks.state_dict.StateDictHooks.stage_all`), then given to its owner only; a
  bad entry raises ``ValueError`` naming dmuon on every rank before anything is written.
* AdamW state of FSDP2 parameters is a DTensor already; it passes unchanged.

``get_optimizer_state_dict`` steps an optimizer without state with zero gradients and
``lr = 0`` (``_init_optim_state``); dmuon's step then changes no parameter.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from dmuon.hooks.state_dict import canonical_fqn, momentum_replica
from dmuon.owners.update import dtype_name, parse_dtype


def param_names(model: torch.nn.Module, params: list[torch.Tensor], state: Any = None) -> list[str]:
    """Canonical FQNs of ``params`` (dedicated masters by their plan key)."""
    names = {id(p): canonical_fqn(n) for n, p in model.named_parameters()}
    if state is not None:
        names.update({id(rec.master): canonical_fqn(rec.key or rec.fqn) for rec in state.records})
    return [names.get(id(p), f"param{i}") for i, p in enumerate(params)]


def plain_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copies of ``groups`` with a ``torch.dtype`` ``ns_dtype`` written as its name."""
    groups = [dict(g) for g in groups]
    for g in groups:
        if isinstance(g.get("ns_dtype"), torch.dtype):
            g["ns_dtype"] = dtype_name(g["ns_dtype"])
    return groups


def parsed_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copies of ``groups`` with ``ns_dtype`` parsed back (``None`` kept: torch's
    ``load_state_dict`` takes the saved groups as they are, and a Muon group needs the key)."""
    groups = [dict(g) for g in groups]
    for g in groups:
        if "ns_dtype" in g:
            g["ns_dtype"] = parse_dtype(g["ns_dtype"])
    return groups


class OptimizerStateHooks:
    """The optimizer state-dict hooks of one :class:`dmuon.Muon`.

    Args:
        opt: the optimizer.
        state: the model's :class:`dmuon.hooks.state.DedicateState` (owner runtime), or ``None``
            (only ``param_groups`` are translated).
    """

    def __init__(self, opt: torch.optim.Optimizer, state: Any = None) -> None:
        self.opt, self.state = opt, state

    def install(self) -> list[Any]:
        """Register the hooks on the optimizer; returns their handles."""
        cls = OptimizerStateHooks
        return [self.opt.register_state_dict_post_hook(functools.partial(cls.on_state_dict, self)),
                self.opt.register_load_state_dict_pre_hook(functools.partial(cls.on_load, self))]

    def _muon_records(self) -> list[tuple[int, int, Any]]:
        """``(group index, position, record)`` of every trainable dedicated matrix (``[]``
        without a model state or before binding).

        Raises:
            RuntimeError: a matrix torch's view cannot show (see ``StateDictHooks.records``).
        """
        if self.state is None or not self.state.state_dict_hooks.records():
            return []
        return [(gi, pos, self.state.record_of_master[master])
                for gi, group in enumerate(self.opt.param_groups) if group.get("kind") == "muon"
                for pos, master in enumerate(group["params"]) if master.requires_grad]

    @torch.no_grad()
    def on_state_dict(self, opt: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
        """Post-hook: plain ``param_groups``, momentum in torch's view (collective on the owner
        runtime)."""
        groups = plain_groups(sd["param_groups"])
        out = {**sd, "param_groups": groups}
        records = self._muon_records()
        if not records:
            return out
        ctx, state = self.state, dict(sd["state"])
        # whether any owner holds a momentum buffer (a fresh optimizer shows none, so torch's
        # get_optimizer_state_dict initialises the whole state; collective)
        held = torch.tensor([float(any(rec.is_owner and "momentum_buffer" in opt.state.get(rec.master, {})
                                       for _, _, rec in records))],
                            device=records[0][2].master.device)  # NCCL reduces on the GPU
        if dist.is_initialized() and dist.get_world_size(ctx.roles.world) > 1:
            dist.all_reduce(held, op=dist.ReduceOp.MAX, group=ctx.roles.world)
        if not held.item():
            return out
        for gi, pos, rec in records:
            buf = None
            if rec.is_owner:
                buf = opt.state.get(rec.master, {}).get("momentum_buffer")
                if buf is None:  # not stepped yet: torch.optim.Muon starts from zeros
                    buf = torch.zeros(rec.shape, dtype=torch.float32, device=rec.master.device)
                src = momentum_replica(rec, ctx)
                if src is not None:
                    buf = buf.clone()
                    dist.broadcast(buf, src=dist.get_global_rank(ctx.roles.replicate, src),
                                   group=ctx.roles.replicate)
            pid = groups[gi]["params"][pos]
            state[pid] = {**state.get(pid, {}), "momentum_buffer": ctx.state_dict_hooks.entry(rec, buf)}
        # parameter order: torch's full state dict gathers entry by entry in dict order
        out["state"] = {pid: state[pid] for g in groups for pid in g["params"] if pid in state}
        return out

    @torch.no_grad()
    def on_load(self, opt: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
        """Pre-hook: ``ns_dtype`` parsed back; each momentum staged, checked, agreed on, then
        given to its owner only (collective on the owner runtime).

        Raises:
            ValueError: on every rank, if on any rank an entry has the wrong shape, or the
                ranks' entries differ in kind; nothing is written.
        """
        groups = parsed_groups(sd["param_groups"])
        out = {**sd, "param_groups": groups}
        records = self._muon_records()
        if not records:
            return out
        state, present = dict(sd["state"]), []
        for gi, pos, rec in records:
            saved = groups[gi]["params"] if gi < len(groups) else []
            if pos >= len(saved):
                continue  # torch's load_state_dict names the group-size mismatch
            entry = state.get(saved[pos])
            if isinstance(entry, dict) and "momentum_buffer" in entry:
                present.append((saved[pos], rec, entry))
        staged = self.state.state_dict_hooks.stage_all(
            [(rec, f"optimizer state {canonical_fqn(rec.fqn)!r}/momentum_buffer", entry["momentum_buffer"])
             for _, rec, entry in present],
            "Nothing was loaded: the optimizer state is unchanged on every rank.",
            source="the optimizer state dict", target="this optimizer")
        for (pid, rec, entry), full in zip(present, staged):
            if rec.is_owner:
                state[pid] = {**entry, "momentum_buffer": full.to(torch.float32)}
            else:
                state.pop(pid)
        out["state"] = state
        return out
