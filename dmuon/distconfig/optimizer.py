""":class:`dmuon.Muon`'s update strategies (no hooks): single-device Muon, and owner-centric
Muon through a :class:`~dmuon.distconfig.config.DistributedConfig`: momentum on local pieces,
``gather_fn`` to the owner, Newton-Schulz there, ``redistribute_fn`` back (the math of
:mod:`dmuon.owners.update`). Matrices go in rounds of one per owner; the helpers' functions move
a round in one ``all_to_all`` each way, gathers ``prefetch_count`` rounds ahead.
"""

from __future__ import annotations

import collections
import hashlib
import logging
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import Tensor

from dmuon.comm.collectives import Pending, all_reduce, check_same_on_all_ranks, label
from dmuon.distconfig import strategies
from dmuon.distconfig.config import DistributedConfig, validate_assignments
from dmuon.comm.exchange import gather_to_owners, scatter_from_owners
from dmuon.hooks.state_dict import (
    OptimizerStateHooks,
    init_state,
    local_state,
)
from dmuon.kernels import default_ns_dtype
from dmuon.owners import torch_muon
from dmuon.owners.clip import clip_by_total_norm_, is_first_copy
from dmuon.owners.slices import local_tensor
from dmuon.owners.update import (
    MuonHyper,
    adamw_update_,
    apply_update_,
    first_step_state,
    momentum_update_,
    muon_update_,
    parse_dtype,
    validate_hyperparameters,
)

logger = logging.getLogger(__name__)

#: the Muon hyper-parameters a param group's own keys are checked for
MUON_KEYS = ("lr", "weight_decay", "momentum", "ns_coefficients", "eps", "ns_steps", "adjust_lr_fn",
             "ns_method", "ns_dtype")


def split_param_groups(params: Iterable[Any], muon_defaults: dict, adamw_defaults: dict) -> list[dict]:
    """Param groups for ``dmuon.Muon(params, ...)`` (tensors, ``(name, tensor)`` pairs or param
    groups of either), each marked ``use_muon``: a group's own ``use_muon`` (True: every tensor
    2-D), else 2-D tensors to Muon, the rest to AdamW. A group's keys override the defaults
    (``muon_defaults`` / ``adamw_defaults``) and are checked like them.

    Raises:
        ValueError: an empty parameter list, a non-2-D tensor in a ``use_muon=True`` group, or a
            bad hyper-parameter of a group (naming the group).
        TypeError: a group hyper-parameter that is not a number.
    """
    items = list(params)
    if not items:
        raise ValueError("dmuon: Muon got an empty parameter list")
    raw = items if isinstance(items[0], dict) else [{"params": items}]
    groups = []
    for gi, group in enumerate(raw):
        entries = [group["params"]] if isinstance(group["params"], Tensor) else list(group["params"])
        options = {k: v for k, v in group.items() if k not in ("params", "use_muon")}
        use = group.get("use_muon")
        if use is True:
            bad = [tuple(_tensor(t).shape) for t in entries if _tensor(t).ndim != 2]
            if bad:
                raise ValueError(f"dmuon: param group {gi} has use_muon=True but holds tensors of "
                                 f"shapes {bad}; Muon takes 2-D matrices. Put them in a group "
                                 f"with use_muon=False (AdamW).")
        split = ([(True, entries)] if use is True else [(False, entries)] if use is False else
                 [(True, [t for t in entries if _tensor(t).ndim == 2]),
                  (False, [t for t in entries if _tensor(t).ndim != 2])])
        for is_muon, ts in split:
            if ts or use is not None:
                defaults = muon_defaults if is_muon else adamw_defaults
                groups.append({**defaults, **options, "params": ts, "use_muon": is_muon})
    for gi, group in enumerate(groups):  # a group's own keys override the checked defaults
        if group["use_muon"]:
            validate_hyperparameters(**{k: group[k] for k in MUON_KEYS}, where=f"param group {gi}: ")
        else:
            validate_hyperparameters(adamw_lr=group["lr"], adamw_betas=group["betas"],
                                     adamw_eps=group["eps"], adamw_weight_decay=group["weight_decay"],
                                     where=f"param group {gi}: ")
    return groups


def _tensor(entry: Any) -> Tensor:
    """The tensor of a param-group entry: a tensor or a ``(name, tensor)`` pair."""
    return entry[1] if isinstance(entry, tuple) else entry


class SingleDeviceUpdate:
    """``distributed_config=None``: Muon on plain full tensors, AdamW on the rest, over
    ``opt``'s ``param_groups`` (:func:`split_param_groups`) and ``state``."""

    group: Any = None  # the process group of collective helpers (none: single device)

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.opt = opt
        self._state_dict_handles = OptimizerStateHooks(opt).install()  # ns_dtype as a string

    def step(self) -> None:
        """AdamW on the ``use_muon=False`` groups, then Muon on the others."""
        self.step_adamw()
        for group in self.opt.param_groups:
            if group["use_muon"]:
                ps = [p for p in group["params"] if p.grad is not None]
                bufs = [first_step_state(self.opt.state[p], p, use_muon=True)["momentum_buffer"] for p in ps]
                muon_update_(ps, [p.grad for p in ps], bufs, self.hyper(group))

    def step_adamw(self) -> None:
        """AdamW on every ``use_muon=False`` group, element-wise on local shards."""
        for group in (g for g in self.opt.param_groups if not g["use_muon"]):
            ps = [p for p in group["params"] if p.grad is not None]
            states = [first_step_state(self.opt.state[p], p, use_muon=False) for p in ps]
            for p, st in zip(ps, states):
                for name in ("exp_avg", "exp_avg_sq"):
                    local_state(st[name], local_tensor(p.grad).shape, name,
                                f"AdamW parameter of shape {tuple(p.shape)}")
            # DTensor parameters stay DTensors: adamw_update_ steps their local pieces in place
            adamw_update_(ps, [p.grad for p in ps], states, lr=group["lr"], betas=group["betas"],
                          eps=group["eps"], weight_decay=group["weight_decay"])

    def hyper(self, group: dict) -> MuonHyper:
        """The frozen hyper-parameters of a Muon param group for this step."""
        return MuonHyper.of(group, backend=self.opt.ns_backend, max_batch_bytes=self.opt.max_batch_bytes)

    def clip_grad_norm_(self, max_norm: float, norm_type: float, error_if_nonfinite: bool) -> Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over every parameter of the optimizer."""
        params = [p for g in self.opt.param_groups for p in g["params"]]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type,
                                              error_if_nonfinite=error_if_nonfinite)


class ConfiguredUpdate(SingleDeviceUpdate):
    """Owner-centric Muon of ``opt`` through ``config`` (module docstring). Collective at
    construction: ``assign_fn`` runs on every rank, which compare the results.

    Raises:
        ValueError: an ``assign_fn`` result that misses indices or names ranks out of range.
        RuntimeError: ranks computed different assignments (on every rank).
    """

    def __init__(self, opt: torch.optim.Optimizer, config: DistributedConfig) -> None:
        super().__init__(opt)
        self.config = config
        params = [p for p, _ in self.muon_params()]
        state = config.state
        self.group = state.get("group")
        self.world, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.owners = owners = validate_assignments(config.assign_fn(params, state), len(params),
                                                    self.world)
        check_same_on_all_ranks(hashlib.sha256(repr(owners).encode()).hexdigest(),
                                "Muon matrix assignment of assign_fn", self.group,
                                fix="assign_fn must be deterministic (the same result on every rank).")
        state["assignments"], state["rank"] = dict(enumerate(owners)), self.rank
        shapes = state.get("full_shapes") or [p.shape for p in params]
        self.full_shapes = [tuple(int(s) for s in shape) for shape in shapes]
        # the helpers' own pair: each round moves in one all_to_all, prefetched
        helpers = (config.gather_fn is strategies.gather_fn
                   and config.redistribute_fn is strategies.redistribute_fn)
        self.layouts = state.get("layouts") if helpers else None
        self.prefetch = config.prefetch_count if self.layouts is not None else 0
        self.rounds: list[list[int]] = []  # async: round k holds the k-th matrix of every owner
        taken: collections.Counter = collections.Counter()
        for i, owner in enumerate(owners):
            k = taken[owner] if config.async_gpu_parallelism else i
            taken[owner] += 1
            if k == len(self.rounds):
                self.rounds.append([])
            self.rounds[k].append(i)
        init_state(opt)  # laid out like the parameters, before any state-dict read (state.py)
        logger.debug("dmuon: %d matrices in %d rounds on rank %d", len(params), len(self.rounds),
                     self.rank)

    def muon_params(self) -> list[tuple[Tensor, dict]]:
        """``(matrix, its group)`` in param-group order (the indices ``assign_fn`` saw)."""
        return [(p, g) for g in self.opt.param_groups if g["use_muon"] for p in g["params"]]

    def step(self) -> None:
        """AdamW on the ``use_muon=False`` groups, then distributed Muon on the rest. Raises
        RuntimeError for a matrix without a gradient, or a gathered or redistributed tensor of
        the wrong shape (naming the parameter index, rank and shapes)."""
        self.step_adamw()
        entries = self.muon_params()
        if not entries:
            return
        with label("dmuon::configured_muon"):
            inputs = self._ns_inputs(entries)
            device = inputs[0].device
            gathers: dict[int, Pending] = {}
            scatters: list[tuple[list[int], Pending]] = []
            for k, rnd in enumerate(self.rounds):
                for j in range(len(gathers) + k, min(k + self.prefetch + 1, len(self.rounds))):
                    with label("dmuon::gather"):
                        gathers[j] = self._gather(self.rounds[j], entries, inputs)
                updates = self._orthogonalize(rnd, gathers.pop(k).wait(), entries)
                dtype = parse_dtype(entries[rnd[0]][1]["ns_dtype"]) or default_ns_dtype(device)
                with label("dmuon::redistribute"):
                    scatters.append((rnd, self._redistribute(rnd, updates, dtype, device)))
                if not self.config.async_gpu_parallelism:
                    self._apply(*scatters.pop(), entries)
            for rnd, pending in scatters:
                self._apply(rnd, pending, entries)
            self._normalize_like_torch(entries)

    def _ns_inputs(self, entries: list[tuple[Tensor, dict]]) -> list[Tensor]:
        """The momentum update on local pieces; returns the local Newton-Schulz inputs."""
        inputs = []
        for i, (p, g) in enumerate(entries):
            if p.grad is None:
                raise RuntimeError(f"dmuon: Muon matrix {i} (shape {self.full_shapes[i]}) has no "
                                   f"gradient on rank {self.rank}; with a distributed_config every "
                                   f"matrix takes part in every step (use zeros, or a use_muon=False group)")
            grad = local_tensor(p.grad)
            buf = first_step_state(self.opt.state[p], p, use_muon=True)["momentum_buffer"]
            buf = local_state(buf, grad.shape, "momentum_buffer",
                              f"Muon matrix {i} (shape {self.full_shapes[i]})")
            inputs.append(momentum_update_(grad, buf, momentum=g["momentum"], nesterov=g["nesterov"]))
        return inputs

    def _gather(self, rnd: list[int], entries: list[tuple[Tensor, dict]],
                inputs: list[Tensor]) -> Pending:
        """Round ``rnd``'s full inputs on their owners (``None`` elsewhere), one per matrix."""
        owners, state = [self.owners[i] for i in rnd], self.config.state
        if self.layouts is not None:
            return gather_to_owners([inputs[i] for i in rnd], [self.layouts[i] for i in rnd], owners,
                                    group=self.group, rank=self.rank, world_size=self.world,
                                    dtype=inputs[rnd[0]].dtype)
        fulls = []
        for i, owner in zip(rnd, owners):
            p, x = entries[i][0], inputs[i]
            if hasattr(p, "device_mesh"):  # hand user functions a DTensor, as the parameter is
                from torch.distributed.tensor import DTensor

                x = DTensor.from_local(x, p.device_mesh, p.placements, run_check=False,
                                       shape=p.shape, stride=p.stride())
            fulls.append(self.config.gather_fn(x, dst_rank=owner, state=state))
        return Pending(None, (), finish=lambda: fulls)

    def _redistribute(self, rnd: list[int], updates: list[Tensor | None], dtype: torch.dtype,
                      device: torch.device) -> Pending:
        """This rank's piece of each update of round ``rnd`` (the owners pass the full ones)."""
        owners, state = [self.owners[i] for i in rnd], self.config.state
        if self.layouts is not None:
            return scatter_from_owners(updates, [self.layouts[i] for i in rnd], owners,
                                       group=self.group, rank=self.rank, world_size=self.world,
                                       dtype=dtype, device=device)
        pieces = [self.config.redistribute_fn(u, src_rank=o, state=state)
                  for u, o in zip(updates, owners)]
        return Pending(None, (), finish=lambda: pieces)

    def _orthogonalize(self, rnd: list[int], fulls: list[Tensor | None],
                       entries: list[tuple[Tensor, dict]]) -> list[Tensor | None]:
        """Newton-Schulz of the round's matrices this rank owns (``None`` for the others);
        RuntimeError unless ``gather_fn`` gave the full matrix on its owner, ``None`` elsewhere."""
        for i, full in zip(rnd, fulls):
            want = self.full_shapes[i] if self.owners[i] == self.rank else None
            got = None if full is None else tuple(full.shape)
            if got != want:
                expect = f"the full matrix of shape {want}" if want else "None (not its assigned rank)"
                raise RuntimeError(
                    f"dmuon: gather_fn returned {got} for Muon matrix {i} on rank {self.rank} "
                    f"(assigned rank {self.owners[i]}); expected {expect}. gather_fn must return "
                    f"the whole [rows, cols] tensor on dst_rank and None elsewhere "
                    f"(state['full_shapes'] gives the full shapes of plain shards).")
        updates: list[Tensor | None] = [None] * len(rnd)
        mine = [j for j, full in enumerate(fulls) if full is not None]
        with label("dmuon::newton_schulz"):
            for group in {id(entries[rnd[j]][1]): entries[rnd[j]][1] for j in mine}.values():
                js = [j for j in mine if entries[rnd[j]][1] is group]
                for j, out in zip(js, self.hyper(group).orthogonalizer()([fulls[j] for j in js])):
                    updates[j] = out
        return updates

    def _apply(self, rnd: list[int], pending: Pending, entries: list[tuple[Tensor, dict]]) -> None:
        """Apply round ``rnd``'s redistributed update pieces to this rank's local pieces
        (RuntimeError for a piece not of the local piece's shape)."""
        for i, update in zip(rnd, pending.wait()):
            p, g = entries[i]
            local = local_tensor(p)
            if update is None or tuple(update.shape) != tuple(local.shape):
                got = None if update is None else tuple(update.shape)
                raise RuntimeError(
                    f"dmuon: redistribute_fn returned {got} for Muon matrix {i} on rank "
                    f"{self.rank}; expected this rank's local piece of shape "
                    f"{tuple(local.shape)} (full {self.full_shapes[i]}).")
            apply_update_(local, update, lr=g["lr"], weight_decay=g["weight_decay"],
                          adjust_lr_fn=g["adjust_lr_fn"], shape=self.full_shapes[i])

    def _normalize_like_torch(self, entries: list[tuple[Tensor, dict]]) -> None:
        """torch <= 2.14's bf16 ``nesterov=False`` momentum normalization
        (:mod:`dmuon.owners.torch_muon`): one all-reduce of the full norms, after the gathers."""
        semantics = torch_muon.installed()
        todo = []
        for i, (p, g) in enumerate(entries):
            buf = self.opt.state[p]["momentum_buffer"]
            if semantics.normalizes_momentum(buf, g["nesterov"]):
                todo.append((i, local_tensor(buf)))
        if not todo:
            return
        sq = torch.stack([b.float().pow(2).sum() if self._counted(entries[i][0], i)
                          else b.new_zeros((), dtype=torch.float32) for i, b in todo])
        all_reduce(sq, dist.ReduceOp.SUM, self.group, "the all-reduce of the momentum norms")
        for (i, b), norm in zip(todo, sq.sqrt()):
            torch_muon.normalize_momentum_(b, entries[i][1]["eps"], norm=norm)

    def clip_grad_norm_(self, max_norm: float, norm_type: float, error_if_nonfinite: bool) -> Tensor:
        """Clip every gradient of the optimizer by the norm of the full gradients (collective
        over the group); see :func:`dmuon.clip_grad_norm_`."""
        counted, clipped = [], []
        index = {id(p): i for i, (p, _) in enumerate(self.muon_params())}
        for group in self.opt.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                local = local_tensor(p.grad)
                clipped.append(local)
                if self._counted(p, index.get(id(p))):
                    counted.append(local)
        return clip_by_total_norm_(counted, clipped, max_norm=max_norm, norm_type=norm_type,
                                   error_if_nonfinite=error_if_nonfinite, group=self.group)

    def _counted(self, param: Tensor, muon_index: int | None) -> bool:
        """Whether this rank's piece of ``param`` is the copy a sum over the group counts: a
        DTensor's first copy, a plain Muon matrix's layout source, or group rank 0's replica.
        ValueError for a plain Muon matrix without ``state["layouts"]``."""
        if hasattr(param, "device_mesh"):
            return is_first_copy(param, dist.get_process_group_ranks(
                self.group if self.group is not None else dist.group.WORLD))
        if muon_index is None:
            return self.rank == 0
        layouts = self.config.state.get("layouts")
        if layouts is None:
            raise ValueError(
                f"dmuon: Muon matrix {muon_index} (local shape {tuple(param.shape)}) is a plain "
                f"tensor and the distributed_config's state has no 'layouts', so dmuon cannot "
                f"tell which ranks hold copies of it. Use a helper config (create_*_config) or "
                f"store state['layouts'] (dmuon.owners.slices.MatrixLayout per matrix) in assign_fn.")
        return layouts[muon_index].sources[self.rank] == self.rank
