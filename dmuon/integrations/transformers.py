"""``DmuonTrainer``: the transformers ``Trainer`` with :class:`dmuon.Muon` under FSDP2 (recipe:
docs/integrations.md). A subclass, because the Trainer refuses ``optimizers=`` under FSDP and
shards the model only between ``create_optimizer`` and ``create_scheduler``.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers

from dmuon.hooks.dedicate import STATE_ATTR
from dmuon.integrations.accelerate import replace_stand_in, stand_in_optimizer


class DmuonTrainer(transformers.Trainer):
    """``transformers.Trainer`` with :class:`dmuon.Muon` under FSDP2
    (``TrainingArguments(fsdp=..., fsdp_config={"fsdp_version": 2})``).

    Args:
        *args: as ``transformers.Trainer``.
        muon_kwargs: keyword arguments for :class:`dmuon.Muon`; ``lr``, ``weight_decay``,
            ``adamw_betas`` and ``adamw_eps`` default to ``TrainingArguments``'.
        dedicate_kwargs: keyword arguments for :func:`dmuon.dedicate_params` (``mesh``
            default: the one FSDP2 sharded the model over).
        **kwargs: as ``transformers.Trainer`` but ``optimizers`` / ``optimizer_cls_and_kwargs``.

    Raises:
        ValueError: ``optimizers`` or ``optimizer_cls_and_kwargs`` given; at ``train()``,
            when the Trainer is not on FSDP2.
    """

    def __init__(self, *args: Any, muon_kwargs: dict[str, Any] | None = None,
                 dedicate_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        given = [k for k in ("optimizers", "optimizer_cls_and_kwargs")
                 if kwargs.get(k) not in (None, (None, None))]
        if given:
            raise ValueError(f"dmuon: DmuonTrainer builds dmuon.Muon itself; drop {given} and pass "
                             f"its hyper-parameters as muon_kwargs=dict(...)")
        super().__init__(*args, **kwargs)
        self.muon_kwargs = dict(muon_kwargs or {})
        self.dedicate_kwargs = dict(dedicate_kwargs or {})

    def create_optimizer(self, model: Any = None) -> torch.optim.Optimizer:
        """A stand-in until :meth:`create_scheduler` (see ``accelerate.stand_in_optimizer``)."""
        if self.optimizer is None:
            self.optimizer = stand_in_optimizer(self.model if model is None else model)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int,
                         optimizer: torch.optim.Optimizer | None = None) -> Any:
        """The first hook after FSDP2 sharded the model: ``dedicate_params`` and ``dmuon.Muon``
        in place of the stand-in, then the stock scheduler.

        Raises:
            ValueError: the Trainer is not on FSDP2 (``fsdp_config={"fsdp_version": 2}``).
        """
        if optimizer is None and getattr(self.model, STATE_ATTR, None) is None:  # not dedicated yet
            plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
            if not self.is_fsdp_enabled or getattr(plugin, "fsdp_version", 1) != 2:
                raise ValueError(
                    "dmuon: DmuonTrainer needs FSDP2: TrainingArguments(fsdp='full_shard', "
                    "fsdp_config={'fsdp_version': 2, ...}) and a distributed launch (torchrun / "
                    "accelerate launch)")
            args = self.args
            muon_kwargs = {"lr": args.learning_rate, "weight_decay": args.weight_decay,
                           "adamw_betas": (args.adam_beta1, args.adam_beta2),
                           "adamw_eps": args.adam_epsilon, **self.muon_kwargs}
            # fully_shard converted self.model in place
            self.optimizer = replace_stand_in(self.accelerator, self.model, self.optimizer,
                                              self.dedicate_kwargs, muon_kwargs)
        return super().create_scheduler(num_training_steps, optimizer=optimizer)
