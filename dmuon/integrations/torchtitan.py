"""dmuon as torchtitan's optimizer (torchtitan 0.3.0).

torchtitan builds its optimizer with ``config.optimizer.build(model_parts=...)`` after
``parallelize``, ``to_empty`` and ``init_weights``: the moment :func:`dmuon.dedicate_params`
needs (the model sharded by FSDP2, its weights final). :class:`DmuonOptimizersContainer` is an
``OptimizersContainer`` whose optimizer, per model part, is :class:`dmuon.Muon` (Muon on the
matrices ``dedicate_params`` picks, AdamW on the rest), built there. In a torchtitan config::

    from dmuon.integrations.torchtitan import DmuonOptimizersContainer

    config.optimizer = DmuonOptimizersContainer.Config(
        muon_kwargs=dict(lr=0.02, adamw_lr=3e-4, weight_decay=0.1))

Everything else is torchtitan's: its FSDP2 ``parallelize`` (dmuon follows the
``set_gradient_divide_factor(1.0)`` it sets), and the container's ``step`` / ``zero_grad``.

``torchtitan`` is imported when this module is (``import dmuon`` does not import it).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from torch import nn
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config.override import derive, override

import dmuon
from dmuon.integrations.accelerate import fsdp_mesh


class DmuonOptimizersContainer(OptimizersContainer):
    """torchtitan's ``OptimizersContainer`` holding one :class:`dmuon.Muon` per model part.

    Collective: every rank builds it, with the same config, after the model parts are
    parallelized and initialised (as torchtitan's trainer does).

    Args:
        config: :class:`DmuonOptimizersContainer.Config`; ``param_groups`` is ignored (dmuon
            assigns Muon and AdamW itself).
        model_parts: torchtitan's model parts (one without pipeline parallelism).

    Raises:
        ValueError: a model part has no FSDP2 parameter and no ``mesh`` was given in
            ``dedicate_kwargs``; or what :func:`dmuon.dedicate_params` / :class:`dmuon.Muon`
            raise.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        muon_kwargs: dict[str, Any] = field(default_factory=dict)
        """Keyword arguments for :class:`dmuon.Muon` (``lr``, ``adamw_lr``, ``weight_decay``, ...)."""

        dedicate_kwargs: dict[str, Any] = field(default_factory=dict)
        """Keyword arguments for :func:`dmuon.dedicate_params`; ``mesh``: the mesh to dedicate
        over (default: the one FSDP2 sharded the part over)."""

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        self.optimizers = []
        self.model_parts = model_parts
        all_params = []
        for model in model_parts:
            kwargs = dict(config.dedicate_kwargs)
            mesh = kwargs.pop("mesh", None) or fsdp_mesh(model)
            dmuon.dedicate_params(model, mesh, **kwargs)
            optimizer = dmuon.Muon(model, **config.muon_kwargs)
            self.optimizers.append(optimizer)
            all_params.extend(p for g in optimizer.param_groups for p in g["params"])
        self._post_init(all_params)


@override(target=OptimizersContainer.Config,
          description="dmuon.Muon: Muon on the matrices, AdamW on the rest (dmuon.integrations.torchtitan)")
def muon(config: OptimizersContainer.Config, **kwargs: Any) -> DmuonOptimizersContainer.Config:
    """torchtitan override: the trainer's optimizer becomes :class:`DmuonOptimizersContainer`.

    One command-line flag, with torchtitan's own override mechanism (``torchtitan.config.
    override``)::

        --override.imports dmuon.integrations.torchtitan.muon
        --override.imports 'dmuon.integrations.torchtitan.muon={"lr": 0.02, "adamw_lr": 8e-4}'

    Without ``lr``, Muon takes the replaced AdamW's learning rate and weight decay with
    ``adjust_lr_fn="match_rms_adamw"`` (the update's RMS matched to AdamW's, so AdamW's
    hyper-parameters carry over); the other parameters' AdamW keeps the replaced one's ``lr``,
    ``betas``, ``eps`` and ``weight_decay``. That AdamW is the config's first ``AdamW``/``Adam``
    param group (torchtitan's ``default_adamw`` has one, matching every parameter); without
    one, dmuon.Muon's defaults apply.

    Args:
        config: the ``OptimizersContainer.Config`` being replaced (torchtitan passes it).
        **kwargs: :class:`dmuon.Muon` keyword arguments; a name that is a field of
            :class:`DmuonOptimizersContainer.Config` (e.g. ``dedicate_kwargs``) sets that field.

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
