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

from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torchtitan.components.optimizer import OptimizersContainer

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

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torchtitan's flat, FQN-keyed optimizer state dict (``state.{fqn}.{name}``,
        ``param_groups.{fqn}.{key}``), as ``OptimizersContainer.load_state_dict`` does, with
        every Muon matrix's ``momentum_buffer`` handed to :class:`dmuon.Muon` on every rank.

        torchtitan's ``_unflatten_optim_state_dict`` keeps, per parameter, the state names this
        rank's optimizer holds: a Muon matrix's momentum is held by its owner only, so the other
        ranks would leave it out, while :class:`dmuon.Muon`'s load needs every rank's piece of
        the FSDP2-laid-out entry (it gathers them to the owner; collective). torchtitan's
        ``CheckpointManager`` calls this on load; every other method (``state_dict`` included)
        is ``OptimizersContainer``'s.

        Raises:
            ValueError: what :class:`dmuon.Muon`'s ``load_state_dict`` raises (an entry that
                does not fit, on every rank, before anything is written).
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
