"""What ``opt.state_dict()`` / ``opt.load_state_dict()`` show of a :class:`dmuon.Muon`.

torch's state-dict utilities (``get_optimizer_state_dict`` / ``set_optimizer_state_dict``, full
or sharded, with ``cpu_offload``), ``dcp.save`` and the trainers built on them (Accelerate,
torchtitan, the transformers ``Trainer``) read ``opt.state_dict()`` and expect what FSDP2 + a
torch optimizer would give: every parameter's state laid out like the parameter, and
``param_groups`` of plain values. The hooks installed here (by :class:`dmuon.Muon`) give that:

* **param_groups:** ``ns_dtype`` is written as a string (``"float16"``; torch's utilities
  refuse a ``torch.dtype``) and read back; every group carries ``param_names`` (canonical FQNs,
  :func:`dmuon.hooks.state_dict.canonical_fqn`; set on the live groups at construction).
* **Muon state** (owner runtime only): each dedicated matrix's ``momentum_buffer`` (the owner's
  fp32 ``[rows, cols]``; nothing elsewhere) enters on every rank laid out like the parameter in
  ``model.state_dict()`` (an FSDP2-like DTensor, or the full tensor on a plain replicated
  module); an owner that has not stepped the matrix yet offers zeros (what ``torch.optim.Muon``
  starts from), unless no owner on any rank holds a momentum buffer: a fresh optimizer shows no
  Muon state, as a fresh torch optimizer shows none. **Collective**: one broadcast per matrix from its owner (HSDP ``"broadcast"``
  mode: first one from replica 0's owner, the only one that steps it). On load, each entry is
  staged in the owner's shape (:meth:`dmuon.hooks.state_dict.StateDictHooks.staged`,
  collective), checked on every rank, the ranks
  agree, and only then the owner's entry becomes its full buffer (the others' are dropped);
  a bad entry raises ``ValueError`` naming dmuon on every rank before anything is written.
* AdamW state of FSDP2 parameters is a DTensor already (created ``zeros_like`` the parameter);
  it passes unchanged.

``torch.distributed.checkpoint.state_dict`` calls ``opt.step()`` with zero gradients and
``lr = 0`` when the optimizer has no state yet (``_init_optim_state``): dmuon's step then changes
no parameter (Muon's update of a zero gradient is zero and the decay ``1 - lr * wd`` is 1), as
with a torch optimizer.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from dmuon.hooks.state_dict import canonical_fqn
from dmuon.owners.update import dtype_name, parse_dtype


def param_names(model: torch.nn.Module, params: list[torch.Tensor], state: Any = None) -> list[str]:
    """Canonical FQNs of ``params`` (dedicated masters by their plan key)."""
    names = {id(p): canonical_fqn(n) for n, p in model.named_parameters()}
    if state is not None:
        names.update({id(rec.master): canonical_fqn(rec.key or rec.fqn) for rec in state.records})
    return [names.get(id(p), f"param{i}") for i, p in enumerate(params)]


class OptimizerStateHooks:
    """The optimizer state-dict hooks of one :class:`dmuon.Muon`.

    Args:
        opt: the optimizer.
        state: the model's :class:`dmuon.hooks.state.DedicateState` (owner runtime), or ``None``
            (``distributed_config`` and single-device paths: only ``param_groups`` are
            translated).
    """

    def __init__(self, opt: torch.optim.Optimizer, state: Any = None) -> None:
        self.opt, self.state = opt, state

    def install(self) -> list[Any]:
        """Register the hooks on the optimizer; returns their handles."""
        return [self.opt.register_state_dict_post_hook(functools.partial(OptimizerStateHooks.on_state_dict, self)),
                self.opt.register_load_state_dict_pre_hook(functools.partial(OptimizerStateHooks.on_load, self))]

    def _muon_records(self) -> list[tuple[int, int, Any]]:
        """``(group index, position, record)`` of every trainable dedicated matrix, or ``[]``
        when nothing is to be translated (no owner runtime, or not bound yet)."""
        state = self.state
        if state is None:
            return []
        records = state.state_dict_hooks._records()  # raises for the kinds it cannot show
        if not records:
            return []
        out = []
        for gi, group in enumerate(self.opt.param_groups):
            if group.get("kind") != "muon":
                continue
            for pos, master in enumerate(group["params"]):
                if master.requires_grad:
                    out.append((gi, pos, state.record_of_master[master]))
        return out

    @torch.no_grad()
    def on_state_dict(self, opt: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
        """Post-hook: plain ``param_groups``, momentum laid out like the parameters
        (collective on the owner runtime)."""
        groups = [dict(g) for g in sd["param_groups"]]
        for g in groups:
            if isinstance(g.get("ns_dtype"), torch.dtype):
                g["ns_dtype"] = dtype_name(g["ns_dtype"])
        out = {**sd, "param_groups": groups}
        records = self._muon_records()
        if not records:
            return out
        state = dict(sd["state"])
        ctx = self.state
        # A fresh optimizer (no owner holds a momentum buffer yet) shows no Muon state, as a
        # fresh torch optimizer shows none: torch's get_optimizer_state_dict then initialises
        # the whole state with a zero step (_init_optim_state), and a state_dict/load_state_dict
        # round trip (Accelerate's AcceleratedOptimizer does one) creates no zero buffers that
        # would keep it from doing so. Collective, like the broadcasts below.
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
            if rec.replicate_mode == "broadcast" and ctx.roles.replicate is not None:
                # only replica 0 steps this matrix; the other replicas' owners hold stale zeros
                if rec.is_owner:
                    buf = buf.clone()
                    dist.broadcast(buf, src=dist.get_global_rank(ctx.roles.replicate, 0),
                                   group=ctx.roles.replicate)
            pid = groups[gi]["params"][pos]
            state[pid] = {**state.get(pid, {}), "momentum_buffer": ctx.state_dict_hooks.entry(rec, buf)}
        # every rank in parameter order: torch's full state dict gathers entry by entry in
        # dict order (owners held their momentum entries before the others got theirs)
        order = [pid for g in groups for pid in g["params"]]
        out["state"] = {pid: state[pid] for pid in order if pid in state}
        return out

    @torch.no_grad()
    def on_load(self, opt: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
        """Pre-hook: ``ns_dtype`` parsed back; each momentum staged as a full tensor, checked,
        agreed on, then given to its owner only (collective on the owner runtime).

        Raises:
            ValueError: on every rank, if on any rank an entry has the wrong shape, or the
                ranks' entries differ in kind; nothing is written.
        """
        groups = [dict(g) for g in sd["param_groups"]]
        for g in groups:
            # keep a Muon group's ns_dtype=None (by device): torch's load_state_dict takes the
            # saved groups as they are, so a dropped key fails the next step (KeyError)
            if "ns_dtype" in g:
                g["ns_dtype"] = parse_dtype(g["ns_dtype"])
        out = {**sd, "param_groups": groups}
        records = self._muon_records()
        if not records:
            return out
        ctx = self.state
        state = dict(sd["state"])
        present = []
        for gi, pos, rec in records:
            saved = groups[gi]["params"] if gi < len(groups) else []
            if pos >= len(saved):
                continue  # torch's load_state_dict names the group-size mismatch
            entry = state.get(saved[pos])
            if isinstance(entry, dict) and "momentum_buffer" in entry:
                present.append((saved[pos], rec, entry))
        staged = ctx.state_dict_hooks.stage_all(
            [(rec, f"optimizer state {canonical_fqn(rec.fqn)!r}/momentum_buffer", entry["momentum_buffer"])
             for _, rec, entry in present], "Nothing was loaded: the optimizer state is unchanged on every rank.",
            source="the optimizer state dict", target="this optimizer")
        for (pid, rec, entry), full in zip(present, staged):
            if rec.is_owner:
                state[pid] = {**entry, "momentum_buffer": full.to(torch.float32)}
            else:
                state.pop(pid)
        out["state"] = state
        return out
