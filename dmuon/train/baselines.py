"""The baseline dmuon is measured against: gather-then-compute distributed Muon (every rank
all-gathers and orthogonalizes every matrix, D-fold redundant NS work)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.profiler import record_function

from dmuon.distconfig.optimizer import MUON_KEYS
from dmuon.kernels import newton_schulz
from dmuon.owners import torch_muon
from dmuon.owners.update import apply_update_, momentum_update_, validate_hyperparameters

logger = logging.getLogger(__name__)

__all__ = ["VanillaMuon"]


def _default_matrices(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """Splits trainable parameters into (2-D non-embedding matrices, everything else)."""
    embedding_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    matrices, others = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        (matrices if p.ndim == 2 and id(p) not in embedding_ids else others).append(p)
    return matrices, others


class VanillaMuon(torch.optim.Optimizer):
    """Gather-then-compute Muon for FSDP2 (or single-process) models; AdamW for the rest.

    For each 2-D non-embedding parameter ``W`` (an FSDP2 shard or a plain tensor), as
    ``torch.optim.Muon`` (https://kellerjordan.github.io/posts/muon/): momentum ``B`` on the
    local shard, ``U`` = Nesterov combination (or ``B``) all-gathered, ``O = NS(U)`` on every
    rank, ``W <- W (1 - lr * wd) - lr * adjust(shape) * O`` on the shard. The rest is AdamW;
    ``param_groups`` = ``[matrices, rest]``.

    Args:
        model: The model (after ``fully_shard``, or plain on one process).
        lr, weight_decay, momentum, nesterov, ns_coefficients, ns_steps, eps, adjust_lr_fn,
            ns_method, ns_dtype, adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: as
            :class:`dmuon.Muon` (same defaults); ``ns_method="standard"``,
            ``ns_dtype=torch.bfloat16`` and ``ns_coefficients="muon"`` is ``torch.optim.Muon``'s
            iteration bit for bit.

    Raises:
        ValueError: If a hyper-parameter is out of range or the model has no parameters.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: str | Sequence[float] | Sequence[Sequence[float]] = "polar_express",
        ns_steps: int = 5,
        eps: float = 1e-7,
        adjust_lr_fn: str | None = None,
        ns_method: str = "gram",
        ns_dtype: torch.dtype | None = None,
        adamw_lr: float | None = None,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float | None = None,
    ) -> None:
        defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
            ns_coefficients=ns_coefficients, ns_steps=ns_steps, eps=eps,
            adjust_lr_fn=adjust_lr_fn, ns_method=ns_method, ns_dtype=ns_dtype, kind="muon",
        )
        validate_hyperparameters(**{k: defaults[k] for k in MUON_KEYS}, adamw_lr=adamw_lr,
                                 adamw_betas=adamw_betas, adamw_eps=adamw_eps,
                                 adamw_weight_decay=adamw_weight_decay)
        matrices, others = _default_matrices(model)
        if not matrices and not others:
            raise ValueError("dmuon: VanillaMuon got a model with no trainable parameters.")
        super().__init__([{"params": matrices}], defaults)
        self._adamw = None
        if others:
            self._adamw = torch.optim.AdamW(
                others,
                lr=lr if adamw_lr is None else adamw_lr,
                betas=adamw_betas,
                eps=adamw_eps,
                weight_decay=weight_decay if adamw_weight_decay is None else adamw_weight_decay,
            )
            # One state and one group list: schedulers and state_dict() see both optimizers.
            self._adamw.param_groups[0]["kind"] = "adamw"
            self.param_groups.append(self._adamw.param_groups[0])
            self._adamw.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group.get("kind") == "muon":
                self._muon_group(group)
        if self._adamw is not None:
            with record_function("dmuon::vanilla_adamw"):
                self._adamw.step()
        return loss

    def _muon_group(self, group: dict) -> None:
        mu, lr, wd = group["momentum"], group["lr"], group["weight_decay"]
        for p in group["params"]:
            if p.grad is None:
                continue
            grad = p.grad
            is_dt = isinstance(grad, DTensor)
            g_local = grad.to_local() if is_dt else grad
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(g_local)
            update = momentum_update_(g_local, state["momentum_buffer"], momentum=mu,
                                      nesterov=group["nesterov"])
            if is_dt:
                with record_function("dmuon::vanilla_all_gather"):
                    update = DTensor.from_local(
                        update, grad.device_mesh, grad.placements,
                        run_check=False, shape=grad.shape, stride=grad.stride(),
                    ).full_tensor()
            with record_function("dmuon::vanilla_newton_schulz"):
                orth = newton_schulz(
                    update, steps=group["ns_steps"], coefficients=group["ns_coefficients"],
                    method=group["ns_method"], dtype=group["ns_dtype"], eps=group["eps"],
                )
            if torch_muon.installed().normalizes_momentum(state["momentum_buffer"], group["nesterov"]):
                # torch <= 2.14 leaves a bf16 buffer normalized (nesterov=False is when
                # ``update`` is the buffer, gathered whole)
                torch_muon.normalize_momentum_(state["momentum_buffer"], group["eps"],
                                               norm=update.norm() if is_dt else None)
            if is_dt:  # keep this rank's shard; src_data_rank=None: no communication
                orth = distribute_tensor(orth, p.device_mesh, p.placements, src_data_rank=None)
            with record_function("dmuon::vanilla_apply"):
                apply_update_(p, orth, lr=lr, weight_decay=wd, adjust_lr_fn=group["adjust_lr_fn"],
                              shape=p.shape)
