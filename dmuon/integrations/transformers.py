"""dmuon in the transformers ``Trainer`` under FSDP2.

``DmuonTrainer`` is a ``transformers.Trainer`` that trains with :class:`dmuon.Muon`::

    from transformers import TrainingArguments
    from dmuon.integrations.transformers import DmuonTrainer

    args = TrainingArguments(output_dir, fsdp="full_shard",
                             fsdp_config={"fsdp_version": 2,
                                          "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
                             max_grad_norm=1.0, gradient_accumulation_steps=2, save_steps=500)
    trainer = DmuonTrainer(model=model, args=args, train_dataset=ds,
                           muon_kwargs=dict(lr=0.02, adamw_lr=3e-4))
    trainer.train()                       # or train(resume_from_checkpoint=True)
    trainer.save_model()                  # full weights, save_pretrained / push_to_hub ready

**Why a subclass.** ``optimizers=(opt, sched)`` is refused under FSDP, and
``optimizer_cls_and_kwargs=(dmuon.Muon, kw)`` hands ``dmuon.Muon`` the Trainer's param groups
of DTensors without :func:`dmuon.dedicate_params` (plain Muon on shards, embeddings on Muon:
silently wrong). Under FSDP2 the Trainer builds its optimizer *before* ``accelerator.prepare``
shards the model and its scheduler right *after*: ``create_scheduler`` is the first hook that
sees the FSDP2 model, so it calls ``dedicate_params`` there, builds ``dmuon.Muon`` and hands it
to the accelerator in place of the stand-in optimizer, then builds the stock scheduler on it.

**Overrides (until issue 31's state-dict and clipping transparency is on main)**, each a method
of its own that can be deleted once the stock one sees FSDP2-like values:

* ``_clip_grad_norm`` -> :func:`dmuon.clip_grad_norm_` (stock: Accelerate's FSDP2 clip, a
  rank-dependent norm); the logged ``grad_norm`` is the global one.
* ``save_model`` -> :func:`dmuon.integrations.full_weights.full_state_dict` then the stock
  ``_save`` (stock: DCP's full state dict, zero-size tensors for the matrices another rank
  owns, written as such by ``save_pretrained``).
* ``_save_optimizer_and_scheduler`` / ``_load_from_checkpoint`` /
  ``_load_optimizer_and_scheduler``: the model and optimizer go to ``<checkpoint>/dmuon``
  through ``dcp.save(dmuon.state_dict(...))`` and come back through :func:`dmuon.load`
  (all-or-nothing); the scheduler, RNG, scaler and trainer state stay the Trainer's own
  (stock: DCP's sharded state dicts, which cannot hold an owner's full matrix: the save fails).

``transformers`` is imported when this module is (``import dmuon`` does not import it).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import transformers

import dmuon
from dmuon.integrations.full_weights import full_state_dict, is_dedicated_model

#: Sub-directory of a Trainer checkpoint that holds dmuon's DCP checkpoint.
DMUON_DIR = "dmuon"


class DmuonTrainer(transformers.Trainer):
    """``transformers.Trainer`` with :class:`dmuon.Muon` (Muon on the matrices, AdamW on the
    rest) under FSDP2 (``TrainingArguments(fsdp=..., fsdp_config={"fsdp_version": 2})``).

    Args:
        *args: as ``transformers.Trainer``.
        muon_kwargs: keyword arguments for :class:`dmuon.Muon`. Defaults taken from
            ``TrainingArguments`` where not given: ``lr`` = ``learning_rate``, ``weight_decay``,
            ``adamw_betas`` = ``(adam_beta1, adam_beta2)``, ``adamw_eps`` = ``adam_epsilon``.
        dedicate_kwargs: keyword arguments for :func:`dmuon.dedicate_params` (``mesh``: the
            mesh to dedicate over; default the one FSDP2 sharded the model over).
        **kwargs: as ``transformers.Trainer``; ``optimizers`` and
            ``optimizer_cls_and_kwargs`` are refused (dmuon builds the optimizer).

    Raises:
        ValueError: ``optimizers`` or ``optimizer_cls_and_kwargs`` given; at ``train()``,
            when the Trainer is not on FSDP2.
    """

    def __init__(self, *args: Any, muon_kwargs: dict[str, Any] | None = None,
                 dedicate_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        given = [k for k in ("optimizers", "optimizer_cls_and_kwargs") if kwargs.get(k) not in (None, (None, None))]
        if given:
            raise ValueError(f"dmuon: DmuonTrainer builds dmuon.Muon itself; drop {given} and pass "
                             f"its hyper-parameters as muon_kwargs=dict(...)")
        super().__init__(*args, **kwargs)
        self.muon_kwargs = dict(muon_kwargs or {})
        self.dedicate_kwargs = dict(dedicate_kwargs or {})

    # ------------------------------------------------------------------ optimizer
    def _muon_kwargs(self) -> dict[str, Any]:
        args = self.args
        return {"lr": args.learning_rate, "weight_decay": args.weight_decay,
                "adamw_betas": (args.adam_beta1, args.adam_beta2), "adamw_eps": args.adam_epsilon,
                **self.muon_kwargs}

    def create_optimizer(self, model: Any = None) -> torch.optim.Optimizer:
        """A stand-in until :meth:`create_scheduler`: Accelerate's FSDP2 ``prepare`` needs an
        optimizer beside the model, and ``dmuon.Muon`` needs the sharded model."""
        if self.optimizer is None:
            opt_model = self.model if model is None else model
            params = [p for p in opt_model.parameters() if p.requires_grad]
            self.optimizer = torch.optim.SGD(params or [torch.nn.Parameter(torch.zeros(1))], lr=0.0)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int,
                         optimizer: torch.optim.Optimizer | None = None) -> Any:
        """The first hook after FSDP2 sharded the model: ``dedicate_params``, ``dmuon.Muon``
        (prepared by the accelerator in place of the stand-in), then the stock scheduler.

        Raises:
            ValueError: the Trainer is not on FSDP2 (``fsdp_config={"fsdp_version": 2}``).
        """
        if optimizer is None and not is_dedicated_model(self.model):
            self._dedicate_and_build_muon()
        return super().create_scheduler(num_training_steps, optimizer=optimizer)

    def _dedicate_and_build_muon(self) -> None:
        plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
        if not self.is_fsdp_enabled or getattr(plugin, "fsdp_version", 1) != 2:
            raise ValueError(
                "dmuon: DmuonTrainer needs FSDP2: TrainingArguments(fsdp='full_shard', "
                "fsdp_config={'fsdp_version': 2, ...}) and a distributed launch (torchrun / "
                "accelerate launch)")
        from dmuon.integrations.accelerate import fsdp_mesh

        model = self.model  # fully_shard converted it in place
        kwargs = dict(self.dedicate_kwargs)
        mesh = kwargs.pop("mesh", None) or fsdp_mesh(model)
        dmuon.dedicate_params(model, mesh, **kwargs)
        stand_in = self.optimizer
        if stand_in in self.accelerator._optimizers:
            self.accelerator._optimizers.remove(stand_in)  # save_state pairs _optimizers[i] with _models[i]
        self.optimizer = self.accelerator.prepare_optimizer(dmuon.Muon(model, **self._muon_kwargs()))

    def _muon(self) -> dmuon.Muon:
        """The :class:`dmuon.Muon` inside the accelerator's wrapper."""
        opt = self.optimizer
        while not isinstance(opt, dmuon.Muon) and hasattr(opt, "optimizer"):
            opt = opt.optimizer
        return opt

    # ------------------------------------------------------------- the overrides
    # Each can go once stock Accelerate / torch see FSDP2-like values for a dmuon model (issue 31).

    def _clip_grad_norm(self, model: Any) -> torch.Tensor:
        """Why: the stock clip (Accelerate's FSDP2 clip) takes owner-only gradients for
        replicated ones and returns a rank-dependent norm; dmuon's is the global one."""
        if not is_dedicated_model(self.model):
            return super()._clip_grad_norm(model)
        self.accelerator.unscale_gradients()
        return dmuon.clip_grad_norm_(self.model, self.args.max_grad_norm)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Full weights, written by ``save_pretrained`` on the main process (collective).

        Why: the stock FSDP2 export (DCP's full state dict) returns zero-size tensors for the
        matrices another rank owns."""
        if not is_dedicated_model(self.model):
            return super().save_model(output_dir, _internal_call)
        output_dir = self.args.output_dir if output_dir is None else output_dir
        state_dict = full_state_dict(self.model, rank0_only=True, cpu_offload=True)
        self._save(output_dir, state_dict=state_dict)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """dmuon's DCP checkpoint of the model and optimizer, then the stock scheduler file.

        Why: the stock FSDP2 save goes through DCP's sharded state dicts, which cannot hold an
        owner's full matrix beside the other ranks' placeholders."""
        if not is_dedicated_model(self.model):
            return super()._save_optimizer_and_scheduler(output_dir)
        import torch.distributed.checkpoint as dcp

        dcp.save(dmuon.state_dict(self.model, self._muon()),
                 checkpoint_id=os.path.join(output_dir, DMUON_DIR))
        if self.args.should_save:
            with warnings.catch_warnings(record=True):
                torch.save(self.lr_scheduler.state_dict(),
                           os.path.join(output_dir, transformers.trainer.SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """The model *and* optimizer from ``<checkpoint>/dmuon`` (:func:`dmuon.load`,
        all-or-nothing on every rank): dmuon's checkpoint holds both."""
        if not is_dedicated_model(self.model):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        dmuon.load(self.model, self._muon(), os.path.join(resume_from_checkpoint, DMUON_DIR))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """The scheduler only (:meth:`_load_from_checkpoint` loaded the optimizer)."""
        if checkpoint is None or not is_dedicated_model(self.model):
            return super()._load_optimizer_and_scheduler(checkpoint)
        path = os.path.join(checkpoint, transformers.trainer.SCHEDULER_NAME)
        self.lr_scheduler.load_state_dict(torch.load(path, weights_only=True))
