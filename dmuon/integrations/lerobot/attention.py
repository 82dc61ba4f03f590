"""QK-clip's logits for LeRobot's pi0 / pi05 / SmolVLA, recorded where LeRobot computes them.

These policies run decoder attention outside the attention modules' ``forward``: pi0 / pi05 in
``modeling_pi0.compute_layer_complete`` (one joint attention over the VLM's and the action
expert's tokens), SmolVLA in ``SmolVLMWithExpertModel.forward_attn_layer`` (joint) and
``forward_cross_attn_layer``. :func:`record_attention` reads each call's softmax input under a
:class:`dmuon.qk_clip.LogitMode` and passes per-head maxima to :func:`dmuon.qk_clip.observe`:

* joint attention of trained models: the whole call's maxima for both modules (one ``eta`` for
  every block of the joint logits);
* next to a frozen model: each module the maxima of its own query rows;
* SmolVLA's cross-attention: the expert its own maxima; the VLM's module its largest head for
  every head (one factor on the VLM's keys scales the expert's keys uniformly).
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, Callable

import torch
from torch import nn

from dmuon.qk_clip import LogitMode, observe, watched

__all__ = ["AttentionRecording", "record_attention"]

_ATTR = "_dmuon_attention_recording"


def _run_and_record(fn: Callable[..., Any], pending: list[tuple[nn.Module, int]], uniform: Any,
                    args: tuple, kwargs: dict) -> Any:
    """``fn(*args, **kwargs)``, an eager attention call over the query rows ``pending`` noted
    (``(module, rows)``; emptied), observing its per-head maxima for each module (module doc;
    ``uniform``: ids of modules whose heads all take their largest). A call whose softmax cannot
    be read records nothing (QK-clip then reports the layer)."""
    members = list(pending)
    pending.clear()
    if not members or not torch.is_grad_enabled() or not any(watched(m) for m, _ in members):
        return fn(*args, **kwargs)  # no QK-clip reads this layer: no extra work
    mode = LogitMode()
    with mode:
        out = fn(*args, **kwargs)
    if len(mode.rows) != 1 or mode.rows[0].shape[1] != sum(r for _, r in members):
        return out
    per_row = mode.rows[0]
    joint = all(attn.q_proj.weight.requires_grad and attn.k_proj.weight.requires_grad for attn, _ in members)
    same = len(members) == 1 and id(members[0][0]) in uniform
    start = 0
    for module, count in members:
        maxima = (per_row if joint else per_row[:, start: start + count]).amax(dim=1)
        start += count
        observe(module, maxima.amax().expand_as(maxima) if same else maxima)
    return out


def _pending_hook(pending: list[tuple[nn.Module, int]], attn: nn.Module) -> Callable[..., None]:
    """A forward pre-hook for ``attn.q_proj``: note ``attn`` and its query rows in ``pending``."""
    def hook(_module: nn.Module, args: tuple) -> None:
        if torch.is_grad_enabled():
            if any(m is attn for m, _ in pending):  # a call that never reached attention
                pending.clear()
            pending.append((attn, int(args[0].shape[-2])))
    return hook


# pi0 / pi05: transformers' Gemma eager attention, as LeRobot's compute_layer_complete calls it.
# The VLM layer's attention module it is called with -> the members its q_proj hooks noted.
_PI_PENDING: "weakref.WeakKeyDictionary[nn.Module, list[tuple[nn.Module, int]]]" = weakref.WeakKeyDictionary()
_PI_CALLER = "compute_layer_complete"
_pi_original: list[Callable[..., Any]] = []  # transformers' function while ours stands in


def _pi_eager(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Stands in for ``transformers.models.gemma.modeling_gemma.eager_attention_forward``,
    recording only LeRobot's joint calls (from ``compute_layer_complete``, gradients on)."""
    original = _pi_original[0]
    pending = _PI_PENDING.get(module)
    if pending is None or not torch.is_grad_enabled() or sys._getframe(1).f_code.co_name != _PI_CALLER:
        return original(module, *args, **kwargs)
    return _run_and_record(original, pending, (), (module, *args), kwargs)


class AttentionRecording:
    """What :func:`record_attention` installed on one policy; :meth:`remove` takes it out."""

    def __init__(self, policy: nn.Module) -> None:
        self.policy = policy
        self.groups: list[tuple[nn.Module, ...]] = []  # the attention groups recorded, in layer order
        self._handles: list[Any] = []
        self._pi_keys: list[nn.Module] = []
        self._smolvla: Any = None

    def _note(self, pending: list[tuple[nn.Module, int]], group: tuple[nn.Module, ...]) -> None:
        for attn in group:
            self._handles.append(attn.q_proj.register_forward_pre_hook(_pending_hook(pending, attn)))

    def _on_pi(self, pwe: nn.Module) -> None:
        from transformers.models.gemma import modeling_gemma

        vlm_layers = pwe.paligemma.model.language_model.layers
        for vlm, expert in zip(vlm_layers, pwe.gemma_expert.model.layers, strict=True):
            group = (vlm.self_attn, expert.self_attn)
            pending: list[tuple[nn.Module, int]] = []
            _PI_PENDING[vlm.self_attn] = pending
            self._pi_keys.append(vlm.self_attn)
            self.groups.append(group)
            self._note(pending, group)
        if not _pi_original:
            _pi_original.append(modeling_gemma.eager_attention_forward)
            modeling_gemma.eager_attention_forward = _pi_eager

    def _on_smolvla(self, vwe: nn.Module) -> None:
        models = [vwe.get_vlm_model().text_model, vwe.lm_expert]
        vlm_layers, expert_layers = vwe.get_model_layers(models)
        every = vwe.self_attn_every_n_layers
        uniform: set[int] = set()  # VLM modules whose keys a cross-attending expert projects
        for idx, (vlm, expert) in enumerate(zip(vlm_layers, expert_layers)):
            cross = "cross" in vwe.attention_mode and not (every > 0 and idx % every == 0)
            if expert is not None and cross:
                uniform.add(id(vlm.self_attn))
                self.groups += [(vlm.self_attn,), (expert.self_attn,)]
            else:
                self.groups.append((vlm.self_attn,) + (() if expert is None else (expert.self_attn,)))
        pending: list[tuple[nn.Module, int]] = []  # members of the next attention call
        for group in self.groups:
            self._note(pending, group)

        def eager(*args: Any, **kwargs: Any) -> Any:
            original = type(vwe).eager_attention_forward.__get__(vwe)
            return _run_and_record(original, pending, uniform, args, kwargs)

        vwe.eager_attention_forward = eager  # the instance's: get_attention_interface returns it
        self._smolvla = vwe

    def remove(self) -> None:
        """Stop recording on this policy (and restore transformers' Gemma attention function
        once no policy records through it)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for key in self._pi_keys:
            _PI_PENDING.pop(key, None)
        if self._pi_keys:
            self._pi_keys.clear()
            from transformers.models.gemma import modeling_gemma

            if _pi_original and not len(_PI_PENDING):
                if modeling_gemma.eager_attention_forward is _pi_eager:
                    modeling_gemma.eager_attention_forward = _pi_original[0]
                _pi_original.clear()
        if self._smolvla is not None:
            self._smolvla.__dict__.pop("eager_attention_forward", None)
            self._smolvla = None
        if self.policy.__dict__.get(_ATTR) is self:
            del self.policy.__dict__[_ATTR]


def record_attention(policy: nn.Module) -> AttentionRecording | None:
    """Record the decoder attention logits of a LeRobot pi0 / pi05 / SmolVLA policy for QK-clip
    (module doc). Idempotent; :func:`~dmuon.integrations.lerobot.fully_shard_policy` calls it.
    Costs one ``amax`` per decoder layer and training forward while QK-clip reads it.

    Args:
        policy: a LeRobot policy (``policy.name`` ``"pi0"``, ``"pi05"`` or ``"smolvla"``;
            other types compute attention in their modules and need nothing).

    Returns:
        The recording (``remove()`` undoes it), or ``None`` for a policy type that needs none.
    """
    name = getattr(policy, "name", None) or getattr(getattr(policy, "config", None), "type", None)
    if name not in ("pi0", "pi05", "smolvla"):
        return None
    existing = policy.__dict__.get(_ATTR)
    if existing is not None:
        return existing
    recording = AttentionRecording(policy)
    if name == "smolvla":
        recording._on_smolvla(policy.model.vlm_with_expert)
    else:
        recording._on_pi(policy.model.paligemma_with_expert)
    object.__setattr__(policy, _ATTR, recording)
    return recording
