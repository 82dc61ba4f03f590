"""``ConfiguredMuon``: Muon over parameters or param groups, owner-centric via a
:class:`~dmuon.distconfig.config.DistributedConfig`, without hooks.

The step follows the PyTorch design "Muon Distributed Training": momentum is updated on each
rank's local shard, ``gather_fn`` assembles the Newton-Schulz input on the matrix's assigned
rank, that rank alone orthogonalizes it, ``redistribute_fn`` sends every rank its piece of the
update, and each rank applies it to its shard. The math is ``torch.optim.Muon``'s
(:mod:`dmuon.owners.update`): with ``distributed_config=None`` this is
:func:`~dmuon.owners.update.muon_update_` verbatim; the distributed path runs the same three
element-wise lines around the communication.

Schedule: the matrices are processed in *rounds*. With ``async_gpu_parallelism`` a round holds
the next matrix of every owner, so all ranks orthogonalize at once and the scatters are awaited
only at the end of the step; without it a round is one matrix, finished before the next.
``prefetch_count`` rounds of gathers are in flight ahead of the round being orthogonalized.
Collectives are issued in the same order on every rank: ``G(0..p)``, then per round ``k``:
``R(k)``, ``G(k+p+1)``.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import Tensor

from dmuon.distconfig.config import DistributedConfig, validate_assignments
from dmuon.distconfig.strategies import supports_async
from dmuon.optim import Muon, validate_hyperparameters
from dmuon.owners.update import adamw_update_, apply_update_, momentum_update_, muon_update_

logger = logging.getLogger(__name__)

_MUON_KEYS = ("lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps",
              "adjust_lr_fn", "ns_method", "ns_dtype")


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class _Done:
    """A finished result dressed as a handle (for synchronous user functions)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def wait(self) -> Any:
        return self.value


class ConfiguredMuon(Muon):
    """Muon for parameters or param groups; distributed through a ``DistributedConfig``.

    Args:
        params: parameters or param groups (dicts with ``"params"``). A group may set
            ``"use_muon": False`` (AdamW) or ``True`` (Muon; every tensor must be 2-D); without
            it, 2-D tensors go to Muon and the rest to AdamW. Group keys override the defaults.
        distributed_config: how matrices are assigned, gathered and redistributed; ``None``:
            single-device Muon (plain full tensors).
        lr ... max_batch_bytes: as :class:`dmuon.Muon` (the same defaults and meanings).

    Raises:
        ValueError: bad hyper-parameters, a non-2-D tensor in a ``use_muon=True`` group, or an
            ``assign_fn`` result that misses indices or names ranks out of range.
        RuntimeError: ranks computed different assignments.
    """

    def __init__(self, params: Iterable[Any], *, distributed_config: DistributedConfig | None = None,
                 lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients: Any = "polar_express", eps: float = 1e-7,
                 ns_steps: int = 5, adjust_lr_fn: str | None = None, ns_method: str = "gram",
                 ns_dtype: torch.dtype = torch.float16, adamw_lr: float | None = None,
                 adamw_betas: tuple[float, float] = (0.9, 0.999), adamw_eps: float = 1e-8,
                 adamw_weight_decay: float | None = None, ns_backend: str = "auto",
                 max_batch_bytes: int = 1 << 30) -> None:
        validate_hyperparameters(lr=lr, weight_decay=weight_decay, momentum=momentum,
                                 adjust_lr_fn=adjust_lr_fn, ns_method=ns_method, ns_dtype=ns_dtype,
                                 adamw_lr=adamw_lr, adamw_betas=adamw_betas,
                                 ns_coefficients=ns_coefficients, ns_steps=ns_steps, eps=eps,
                                 adamw_eps=adamw_eps, adamw_weight_decay=adamw_weight_decay)
        if distributed_config is not None and not isinstance(distributed_config, DistributedConfig):
            raise ValueError(f"dmuon: distributed_config must be a DistributedConfig or None; got "
                             f"{type(distributed_config).__name__}")
        muon_defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                             ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps,
                             adjust_lr_fn=adjust_lr_fn, ns_method=ns_method, ns_dtype=ns_dtype)
        adamw_defaults = dict(lr=lr if adamw_lr is None else adamw_lr, betas=tuple(adamw_betas),
                              eps=adamw_eps,
                              weight_decay=weight_decay if adamw_weight_decay is None else adamw_weight_decay)
        groups = self._split_groups(params, muon_defaults, adamw_defaults)
        for gi, group in enumerate(groups):  # a group's own keys override the checked defaults
            if group["use_muon"]:
                validate_hyperparameters(**{k: group[k] for k in _MUON_KEYS if k != "nesterov"},
                                         where=f"param group {gi}: ")
            else:
                validate_hyperparameters(adamw_lr=group["lr"], adamw_betas=group["betas"],
                                         adamw_eps=group["eps"], adamw_weight_decay=group["weight_decay"],
                                         where=f"param group {gi}: ")
        self.ns_backend = ns_backend
        self.max_batch_bytes = max_batch_bytes
        self.distributed_config = distributed_config
        torch.optim.Optimizer.__init__(self, groups, defaults={})
        self._setup_distributed()

    @staticmethod
    def _split_groups(params: Iterable[Any], muon_defaults: dict, adamw_defaults: dict) -> list[dict]:
        items = list(params)
        if not items:
            raise ValueError("dmuon: Muon got an empty parameter list")
        raw = items if isinstance(items[0], dict) else [{"params": items}]
        groups = []
        for gi, group in enumerate(raw):
            tensors = [group["params"]] if isinstance(group["params"], Tensor) else list(group["params"])
            options = {k: v for k, v in group.items() if k not in ("params", "use_muon")}
            use = group.get("use_muon")
            if use is True:
                bad = [tuple(t.shape) for t in tensors if t.ndim != 2]
                if bad:
                    raise ValueError(f"dmuon: param group {gi} has use_muon=True but holds tensors of "
                                     f"shapes {bad}; Muon takes 2-D matrices. Put them in a group "
                                     f"with use_muon=False (AdamW).")
            split = ([(True, tensors)] if use is True else [(False, tensors)] if use is False else
                     [(True, [t for t in tensors if t.ndim == 2]), (False, [t for t in tensors if t.ndim != 2])])
            for is_muon, ts in split:
                if not ts and use is None:
                    continue
                base = dict(muon_defaults if is_muon else adamw_defaults)
                base.update(options)
                base.update(params=ts, use_muon=is_muon)
                groups.append(base)
        return groups

    def _muon_params(self) -> list[tuple[Tensor, dict]]:
        return [(p, g) for g in self.param_groups if g["use_muon"] for p in g["params"]]

    def _setup_distributed(self) -> None:
        cfg = self.distributed_config
        self._rounds: list[list[int]] = []
        if cfg is None:
            return
        params = [p for p, _ in self._muon_params()]
        state = cfg.state
        group = state.get("group")
        world = dist.get_world_size(group)
        rank = dist.get_rank(group)
        owners = validate_assignments(cfg.assign_fn(params, state), len(params), world)
        digests: list[Any] = [None] * world
        dist.all_gather_object(digests, owners, group=group)
        if any(d != owners for d in digests):
            differ = [r for r, d in enumerate(digests) if d != owners]
            raise RuntimeError(f"dmuon: assign_fn gave different owners on ranks {differ} than on "
                               f"rank {rank}; it must be deterministic (same result on every rank)")
        state["assignments"] = dict(enumerate(owners))
        state["rank"] = rank
        self._owners, self._rank, self._world = owners, rank, world
        shapes = state.get("full_shapes")
        self._full_shapes = [tuple(int(s) for s in (shapes[i] if shapes is not None else p.shape))
                             for i, p in enumerate(params)]
        if cfg.async_gpu_parallelism:  # round k: the k-th matrix of every owner
            per_owner: list[list[int]] = [[] for _ in range(world)]
            for i, o in enumerate(owners):
                per_owner[o].append(i)
            depth = max((len(x) for x in per_owner), default=0)
            self._rounds = [sorted(x[k] for x in per_owner if k < len(x)) for k in range(depth)]
        else:
            self._rounds = [[i] for i in range(len(params))]
        self._async_fns = supports_async(cfg.gather_fn) and supports_async(cfg.redistribute_fn)
        logger.debug("dmuon: %d matrices in %d rounds on rank %d", len(params), len(self._rounds), rank)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One step: AdamW on the ``use_muon=False`` groups, Muon (distributed) on the rest.

        Raises:
            RuntimeError: a gathered or redistributed tensor of the wrong shape (names the
                parameter index, rank and shapes). Collective failures propagate unchanged.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if not group["use_muon"]:
                ps = [p for p in group["params"] if p.grad is not None]
                adamw_update_([_local(p) for p in ps], [_local(p.grad) for p in ps],
                              [self.state[p] for p in ps], lr=group["lr"], betas=group["betas"],
                              eps=group["eps"], weight_decay=group["weight_decay"])
        if self.distributed_config is None:
            for group in self.param_groups:
                if group["use_muon"]:
                    self._step_single(group)
        else:
            with torch.profiler.record_function("dmuon::configured_muon"):
                self._step_distributed()
        return loss

    def _ns_kwargs(self, group: dict) -> dict:
        return dict(steps=group["ns_steps"], coefficients=group["ns_coefficients"],
                    method=group["ns_method"], dtype=group["ns_dtype"], eps=group["eps"],
                    backend=self.ns_backend)

    def _step_single(self, group: dict) -> None:
        ps = [p for p in group["params"] if p.grad is not None]
        bufs = []
        for p in ps:
            st = self.state[p]
            if "momentum_buffer" not in st:
                st["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            bufs.append(st["momentum_buffer"])
        muon_update_(ps, [p.grad for p in ps], bufs, lr=group["lr"], weight_decay=group["weight_decay"],
                     momentum=group["momentum"], nesterov=group["nesterov"],
                     adjust_lr_fn=group["adjust_lr_fn"], ns_kwargs=self._ns_kwargs(group),
                     max_batch_bytes=self.max_batch_bytes)

    def _ns_inputs(self, entries: list[tuple[Tensor, dict]]) -> list[Tensor]:
        """Momentum update on local shards; the Newton-Schulz inputs (local), as muon_update_."""
        inputs = []
        for i, (p, g) in enumerate(entries):
            if p.grad is None:
                raise RuntimeError(f"dmuon: Muon matrix {i} (shape {self._full_shapes[i]}) has no "
                                   f"gradient on rank {self._rank}; with a distributed_config every "
                                   f"matrix takes part in every step (use zeros, or a use_muon=False group)")
            st = self.state[p]
            if "momentum_buffer" not in st:
                st["momentum_buffer"] = torch.zeros_like(_local(p), memory_format=torch.preserve_format)
            inputs.append(momentum_update_(_local(p.grad), st["momentum_buffer"],
                                           momentum=g["momentum"], nesterov=g["nesterov"]))
        return inputs

    def _issue_gather(self, k: int, entries, inputs) -> Any:
        cfg, rnd = self.distributed_config, self._rounds[k]
        owners = [self._owners[i] for i in rnd]
        if cfg.batch_gather_fn is not None:
            return cfg.batch_gather_fn([inputs[i] for i in rnd], rnd, owners, cfg.state,
                                       dtype=inputs[rnd[0]].dtype, async_op=True)
        handles = []
        for i, o in zip(rnd, owners):
            p = entries[i][0]
            x = inputs[i]
            if hasattr(p, "device_mesh"):  # hand user functions a DTensor, as the parameter is
                from torch.distributed.tensor import DTensor
                x = DTensor.from_local(x, p.device_mesh, p.placements, run_check=False,
                                       shape=p.shape, stride=p.stride())
            if self._async_fns:
                handles.append(cfg.gather_fn(x, dst_rank=o, state=cfg.state, async_op=True))
            else:
                handles.append(_Done(cfg.gather_fn(x, dst_rank=o, state=cfg.state)))
        return _Done(handles)

    def _wait_gather(self, handle: Any) -> list[Any]:
        cfg = self.distributed_config
        if cfg.batch_gather_fn is not None:
            return handle.wait()
        return [h.wait() for h in handle.wait()]

    def _issue_redistribute(self, k: int, updates: list[Any], device: torch.device, dtype) -> Any:
        cfg, rnd = self.distributed_config, self._rounds[k]
        owners = [self._owners[i] for i in rnd]
        if cfg.batch_redistribute_fn is not None:
            return cfg.batch_redistribute_fn(updates, rnd, owners, cfg.state, dtype=dtype,
                                             device=device, async_op=True)
        if self._async_fns:
            return _Done([cfg.redistribute_fn(u, src_rank=o, state=cfg.state, async_op=True)
                          for u, o in zip(updates, owners)])
        return _Done([_Done(cfg.redistribute_fn(u, src_rank=o, state=cfg.state))
                      for u, o in zip(updates, owners)])

    def _wait_redistribute(self, handle: Any) -> list[Tensor]:
        if self.distributed_config.batch_redistribute_fn is not None:
            return handle.wait()
        return [h.wait() for h in handle.wait()]

    def _check_full(self, i: int, full: Any) -> None:
        expected = self._full_shapes[i]
        if self._owners[i] == self._rank:
            if full is None or tuple(full.shape) != expected:
                got = None if full is None else tuple(full.shape)
                raise RuntimeError(
                    f"dmuon: gather_fn returned {got} for Muon matrix {i} on its assigned rank "
                    f"{self._rank}; expected the full matrix of shape {expected}. gather_fn must "
                    f"return the whole [rows, cols] tensor on dst_rank (state['full_shapes'] "
                    f"gives the full shapes of plain shards).")
        elif full is not None:
            raise RuntimeError(
                f"dmuon: gather_fn returned a tensor of shape {tuple(full.shape)} for Muon matrix "
                f"{i} on rank {self._rank}, which is not its assigned rank {self._owners[i]}; it "
                f"must return None there.")

    def _apply(self, i: int, entry: tuple[Tensor, dict], update: Tensor) -> None:
        p, g = entry
        local = _local(p)
        if update is None or tuple(update.shape) != tuple(local.shape):
            got = None if update is None else tuple(update.shape)
            raise RuntimeError(
                f"dmuon: redistribute_fn returned {got} for Muon matrix {i} on rank {self._rank}; "
                f"expected this rank's local piece of shape {tuple(local.shape)} (full "
                f"{self._full_shapes[i]}).")
        apply_update_(local, update, lr=g["lr"], weight_decay=g["weight_decay"],
                      adjust_lr_fn=g["adjust_lr_fn"], shape=self._full_shapes[i])

    def _step_distributed(self) -> None:
        from dmuon.kernels import orthogonalize_by_shape

        cfg = self.distributed_config
        entries = self._muon_params()
        if not entries:
            return
        inputs = self._ns_inputs(entries)
        rounds, prefetch = self._rounds, cfg.prefetch_count
        gathers: dict[int, Any] = {}
        scatters: list[tuple[int, Any]] = []
        issued = 0
        for k, rnd in enumerate(rounds):
            while issued < len(rounds) and issued <= k + prefetch:
                with torch.profiler.record_function("dmuon::gather"):
                    gathers[issued] = self._issue_gather(issued, entries, inputs)
                issued += 1
            fulls = self._wait_gather(gathers.pop(k))
            mine = []
            for i, full in zip(rnd, fulls):
                self._check_full(i, full)
                if full is not None:
                    mine.append(i)
            updates: list[Any] = [None] * len(rnd)
            with torch.profiler.record_function("dmuon::newton_schulz"):
                for group in {id(entries[i][1]): entries[i][1] for i in mine}.values():
                    ids = [i for i in mine if entries[i][1] is group]
                    outs = orthogonalize_by_shape([fulls[rnd.index(i)] for i in ids],
                                                  max_batch_bytes=self.max_batch_bytes,
                                                  **self._ns_kwargs(group))
                    for i, out in zip(ids, outs):
                        updates[rnd.index(i)] = out
            ns_dtype = entries[rnd[0]][1]["ns_dtype"]
            with torch.profiler.record_function("dmuon::redistribute"):
                handle = self._issue_redistribute(k, updates, inputs[rnd[0]].device, ns_dtype)
            if cfg.async_gpu_parallelism:
                scatters.append((k, handle))
            else:
                self._finish_round(k, handle, entries)
        for k, handle in scatters:
            self._finish_round(k, handle, entries)

    def _finish_round(self, k: int, handle: Any, entries) -> None:
        for i, update in zip(self._rounds[k], self._wait_redistribute(handle)):
            self._apply(i, entries[i], update)
