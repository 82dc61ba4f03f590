"""What the installed ``torch.optim.Muon`` does where torch versions differ, found by asking it
(not its version string) once per process: :func:`installed`. ``torch/optim/_muon.py`` of
2.11 to 2.15 differ in two ways:

* ``adjust_lr_fn="spectral_unclamped"`` (``lr * sqrt(rows / cols)``, Bernstein, "Deriving
  Muon") exists from 2.14.
* Up to 2.14, ``_zeropower_via_newtonschulz`` casts with ``grad.bfloat16()`` (the tensor itself
  when bf16) and divides it by its norm in place: with ``nesterov=False`` a bf16 momentum buffer
  is left as ``buf / max(||buf||_F, eps)`` after every step. 2.15 copies first.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

#: The ``adjust_lr_fn`` names dmuon implements (``None`` is ``"original"``), and the first torch
#: release whose ``torch.optim.Muon`` has each (for the error where the installed one lacks it).
TORCH_SINCE = {None: "2.9", "original": "2.9", "match_rms_adamw": "2.9", "spectral_unclamped": "2.14"}


@dataclass(frozen=True, slots=True, kw_only=True)
class TorchMuon:
    """The installed ``torch.optim.Muon``'s version-dependent behaviour: the :data:`TORCH_SINCE`
    names it accepts, and whether a ``nesterov=False`` step leaves a bf16 momentum buffer
    divided by its norm (torch <= 2.14); ``version`` for messages."""

    version: str
    adjust_lr_fns: tuple
    normalizes_bf16_momentum: bool

    def check_adjust_lr_fn(self, adjust_lr_fn: object, where: str = "") -> None:
        """Raise ValueError unless the installed ``torch.optim.Muon`` takes ``adjust_lr_fn``
        (naming the torch release that has it)."""
        if adjust_lr_fn in self.adjust_lr_fns:
            return
        if adjust_lr_fn in TORCH_SINCE:
            raise ValueError(
                f"dmuon: {where}adjust_lr_fn={adjust_lr_fn!r} needs torch>={TORCH_SINCE[adjust_lr_fn]} "
                f"(dmuon follows the installed torch.optim.Muon, and torch {self.version}'s does not "
                f"have it). Upgrade torch, or use one of {self.adjust_lr_fns}.")
        raise ValueError(f"dmuon: {where}adjust_lr_fn must be one of {self.adjust_lr_fns} "
                         f"(torch {self.version}), got {adjust_lr_fn!r}")

    def normalizes_momentum(self, buf: torch.Tensor, nesterov: bool) -> bool:
        """Whether torch's step leaves ``buf`` (a Muon momentum buffer) normalized."""
        return self.normalizes_bf16_momentum and not nesterov and buf.dtype == torch.bfloat16


def _accepts(adjust_lr_fn: str | None) -> bool:
    try:
        torch.optim.Muon([torch.zeros(1, 1)], adjust_lr_fn=adjust_lr_fn)
    except ValueError:
        return False
    return True


def _normalizes_bf16_input() -> bool:
    """Whether torch's Newton-Schulz divides a bf16 input in place (a 3x2 input of 0.2s then
    holds 1/sqrt(6) = 0.408): through the private function, else one public ``Muon`` step."""
    probe = torch.full((3, 2), 0.2, dtype=torch.bfloat16)
    ns = getattr(torch.optim._muon, "_zeropower_via_newtonschulz", None)
    try:
        ns(probe, (3.4445, -4.7750, 2.0315), 1, 1e-7)
    except Exception:  # not there, or another signature: ask the public optimizer
        param = torch.nn.Parameter(torch.zeros(3, 2, dtype=torch.bfloat16))
        param.grad = torch.full((3, 2), 4.0, dtype=torch.bfloat16)  # buffer 0.05 * 4 = 0.2
        opt = torch.optim.Muon([param], lr=0.0, weight_decay=0.0, nesterov=False)
        opt.step()
        probe = opt.state[param]["momentum_buffer"]
    return abs(float(probe[0, 0]) - 0.2) > 0.05


@functools.cache
def installed() -> TorchMuon:
    """The installed torch's :class:`TorchMuon`, probed on first use (then cached)."""
    import torch.optim._muon  # noqa: F401  (the module of torch.optim.Muon, for the probe)

    return TorchMuon(version=torch.__version__,
                     adjust_lr_fns=tuple(fn for fn in TORCH_SINCE if _accepts(fn)),
                     normalizes_bf16_momentum=_normalizes_bf16_input())


@torch.no_grad()
def normalize_momentum_(buf: torch.Tensor, eps: float, norm: torch.Tensor | None = None) -> None:
    """``buf /= max(||buf||_F, eps)`` in place, op for op as torch <= 2.14's Newton-Schulz does
    to its bf16 input (on the transposed view when ``rows > cols``, norm and division in bf16).

    ``buf``: a full ``[rows, cols]`` bf16 buffer, or a local piece of one with ``norm`` (the
    full matrix's Frobenius norm, 0-d); ``eps``: the group's (the norm's floor).
    """
    view = buf.T if buf.dim() == 2 and buf.size(0) > buf.size(1) else buf
    if norm is None:
        norm = view.norm()
    view.div_(norm.to(buf.dtype).clamp(min=eps))
