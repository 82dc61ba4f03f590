"""dmuon as torchtitan's optimizer (torchtitan 0.3.0; recipe: docs/integrations.md).

torchtitan builds its optimizer after ``parallelize`` and ``init_weights``, the moment
:func:`dmuon.dedicate_params` needs: set ``config.optimizer =
DmuonOptimizersContainer.Config(muon_kwargs=..., path="hooks" | "distributed_config")``, or pass
``--override.imports dmuon.integrations.torchtitan.muon`` (:func:`muon`). Schedulers, ``step``
and checkpointing stay torchtitan's.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from torch import nn
from torchtitan.components.checkpointer.utils import canonical_fqn
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config.override import derive, override

import dmuon
from dmuon.integrations.accelerate import dedicate

PATHS = ("hooks", "distributed_config")


class DmuonOptimizersContainer(OptimizersContainer):
    """torchtitan's ``OptimizersContainer`` holding one :class:`dmuon.Muon` per model part.
    Collective.

    Args:
        config: :class:`DmuonOptimizersContainer.Config` (its ``param_groups`` and
            ``implementation`` are ignored).
        model_parts: torchtitan's model parts.

    Raises:
        ValueError: ``config.path`` not in :data:`PATHS`; hooks path: a part with no FSDP2
            parameter and no ``mesh``; ``distributed_config`` path: ``dedicate_kwargs`` other
            than ``predicate``, a predicate asking for row blocks or a non-2-D parameter, or a
            ``distributed_config`` not a :class:`dmuon.DistributedConfig`; or what
            :func:`dmuon.dedicate_params` / :class:`dmuon.Muon` raise.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        muon_kwargs: dict[str, Any] = field(default_factory=dict)
        """Keyword arguments for :class:`dmuon.Muon` (``lr``, ``adamw_lr``, ``weight_decay``, ...)."""

        path: str = "hooks"
        """dmuon's path: ``"hooks"`` (:func:`dmuon.dedicate_params`, one owner per matrix) or
        ``"distributed_config"`` (FSDP2's sharding kept, ``dmuon.Muon(params,
        distributed_config=...)``)."""

        dedicate_kwargs: dict[str, Any] = field(default_factory=dict)
        """Hooks path: keyword arguments for :func:`dmuon.dedicate_params` (``mesh`` default: the
        one FSDP2 sharded the part over). ``distributed_config`` path: only ``predicate``."""

        distributed_config: Any = None
        """``distributed_config`` path: a :class:`dmuon.DistributedConfig` (default
        :func:`dmuon.create_dtensor_config`)."""

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        if config.path not in PATHS:
            raise ValueError(f"dmuon: DmuonOptimizersContainer.Config.path is {config.path!r}; "
                             f"use one of {PATHS} (\"hooks\": dedicate_params + dmuon.Muon(model); "
                             f"\"distributed_config\": dmuon.Muon(params, distributed_config=...))")
        self.optimizers = []
        self.model_parts = model_parts
        all_params = []
        for model in model_parts:
            if config.path == "hooks":
                dedicate(model, config.dedicate_kwargs)  # collective
                optimizer = dmuon.Muon(model, **config.muon_kwargs)
            else:
                optimizer = _distributed_config_optimizer(model, config)
            self.optimizers.append(optimizer)
            all_params.extend(p for g in optimizer.param_groups for p in g["params"])
        self._post_init(all_params)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """``OptimizersContainer.load_state_dict``, but every Muon matrix's ``momentum_buffer``
        goes to :class:`dmuon.Muon` on every rank (torchtitan's unflattening keeps only the
        owner's). Collective.

        Raises:
            ValueError: what :class:`dmuon.Muon`'s ``load_state_dict`` raises.
        """
        from torchtitan.components.optimizer.utils import _unflatten_optim_state_dict, init_optim_state

        for optim in self.optimizers:
            init_optim_state(optim)
            sd = _unflatten_optim_state_dict(optim, state_dict)
            pid = 0
            for group in optim.param_groups:
                for fqn in group["param_names"]:
                    key = f"state.{fqn}.momentum_buffer"
                    if group.get("kind") == "muon" and pid not in sd["state"] and key in state_dict:
                        sd["state"][pid] = {"momentum_buffer": state_dict[key]}
                    pid += 1
            optim.load_state_dict(sd)


def _distributed_config_optimizer(model: nn.Module,
                                  config: DmuonOptimizersContainer.Config) -> dmuon.Muon:
    """``dmuon.Muon`` over ``model``'s trainable parameters as FSDP2 left them: a Muon group (the
    ``predicate``'s matrices) and an AdamW group, named by torchtitan's canonical FQNs."""
    extra = sorted(set(config.dedicate_kwargs) - {"predicate"})
    if extra:
        raise ValueError(f"dmuon: DmuonOptimizersContainer.Config.dedicate_kwargs has {extra}, "
                         f"which only the hooks path takes; with path=\"distributed_config\" "
                         f"pass only 'predicate' (or set path=\"hooks\")")
    dist_config = config.distributed_config
    if dist_config is not None and not isinstance(dist_config, dmuon.DistributedConfig):
        raise ValueError(f"dmuon: DmuonOptimizersContainer.Config.distributed_config is a "
                         f"{type(dist_config).__name__}; pass a dmuon.DistributedConfig (e.g. "
                         f"dmuon.create_dtensor_config()) or None")
    predicate = config.dedicate_kwargs.get("predicate") or dmuon.default_predicate(model)
    muon, adamw = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        pick = predicate(name, p)
        if pick not in (False, True):  # 0 and 1 compare equal to these
            raise ValueError(f"dmuon: the predicate asks for {pick!r} row blocks of {name!r}; the "
                             f"distributed_config path orthogonalizes whole 2-D matrices only. "
                             f"Use path=\"hooks\" for row blocks")
        if pick and p.ndim != 2:
            raise ValueError(f"dmuon: {name!r} of shape {tuple(p.shape)} is picked for Muon, but the "
                             f"distributed_config path orthogonalizes 2-D matrices only (not "
                             f"expert stacks). Use path=\"hooks\", or a predicate that leaves it "
                             f"to AdamW")
        (muon if pick else adamw).append((canonical_fqn(name), p))
    groups = [{"params": muon, "use_muon": True}] * bool(muon) + [
        {"params": adamw, "use_muon": False}] * bool(adamw)
    if dist_config is None:
        dist_config = dmuon.create_dtensor_config()
    return dmuon.Muon(groups, distributed_config=dist_config, **config.muon_kwargs)


@override(target=OptimizersContainer.Config,
          description="dmuon.Muon: Muon on the matrices, AdamW on the rest")
def muon(config: OptimizersContainer.Config, **kwargs: Any) -> DmuonOptimizersContainer.Config:
    """torchtitan override (``--override.imports dmuon.integrations.torchtitan.muon[={...}]``):
    the optimizer becomes :class:`DmuonOptimizersContainer`. Without ``lr``, Muon takes the
    replaced AdamW's ``lr`` and ``weight_decay`` with ``adjust_lr_fn="match_rms_adamw"``; the
    other parameters' AdamW keeps its ``lr``, ``betas``, ``eps`` and ``weight_decay`` (the
    config's first ``AdamW`` / ``Adam`` param group).

    Args:
        config: the ``OptimizersContainer.Config`` being replaced (torchtitan passes it).
        **kwargs: :class:`dmuon.Muon` keyword arguments; a name that is a field of
            :class:`DmuonOptimizersContainer.Config` (``path``, ``dedicate_kwargs``) sets that
            field, e.g. ``{"path": "distributed_config"}``.

    Returns:
        The :class:`DmuonOptimizersContainer.Config` torchtitan builds in its place.
    """
    container_fields = {f.name for f in fields(DmuonOptimizersContainer.Config)} - {"muon_kwargs"}
    container = {k: v for k, v in kwargs.items() if k in container_fields}
    muon_kwargs = dict(getattr(config, "muon_kwargs", {}))
    adamw = next((dict(g.optimizer_kwargs) for g in getattr(config, "param_groups", [])
                  if g.optimizer_name in ("AdamW", "Adam")), None)
    if adamw is not None:
        inherited = {f"adamw_{k}": adamw[k] for k in ("lr", "betas", "eps", "weight_decay")
                     if k in adamw}
        if "lr" not in kwargs and "lr" not in muon_kwargs and "lr" in adamw:
            inherited.update(lr=adamw["lr"], adjust_lr_fn="match_rms_adamw",
                             weight_decay=adamw.get("weight_decay", 0.1))
        if "adamw_betas" in inherited:
            inherited["adamw_betas"] = tuple(inherited["adamw_betas"])
        muon_kwargs = {**inherited, **muon_kwargs}
    muon_kwargs.update({k: v for k, v in kwargs.items() if k not in container_fields})
    return derive(config, DmuonOptimizersContainer.Config, muon_kwargs=muon_kwargs, **container)
