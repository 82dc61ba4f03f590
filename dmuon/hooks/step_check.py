"""Step agreement: a rank that skips or repeats ``opt.step()`` or ``backward()`` fails loudly.

Stock FSDP2/DDP let a rank that skips ``opt.step()`` train on silently (the replicas diverge),
and a rank that skips backward meets the others' gradient collectives with different ones
(gloo aborts on a size mismatch). dmuon counts, on every rank, the optimizer steps and the
backward passes, and compares the counts across ranks at the start of every forward (the
model's forward pre-hook, placed first) and every backward (the first gradient of the model's
output, or else dmuon's first pre-backward or gradient hook): one
all-reduce of a ``[world, 3]`` int64 tensor (phase, steps, backwards) on a group of its own, so
the check can only pair with another rank's check, never with a publication or a reduce.

Why these two points: they are the first things a rank does in each phase, before it issues a
collective that could pair with a different one on a rank that is out of step. A rank that
skipped ``opt.step()`` meets the others at the next forward with one step fewer; a rank that
skipped backward meets the others' backward check with its next forward's. A rank that runs
more steps than the others waits at its next check; the group's timeout (the user's, see
:func:`dmuon.comm.mesh_roles.inherited_timeout`) ends the wait with a named error.

The group is gloo (CPU tensors) even in NCCL jobs, so the check never synchronizes a GPU
stream; without gloo there is no check.

Deferred checks (``deferred=True``, set by the runtime on a module without FSDP2, where dmuon
issues every collective of the step itself): the check's all-reduce is *issued* at the same two
points but waited on only at :meth:`StepCheck.settle`, which the runtime calls right before it
issues or blocks on a collective of the dmuon group (a unit's publication it must wait for, a
gradient bucket's reduce-to-owner, the end of backward), and before the next check. So no rank
issues or waits on a step's collective before the ranks agreed, as with a blocking check, but
the check's round trips overlap forward and backward compute instead of stopping every rank.

Under FSDP2 (``issue_at_step=True``, set by the runtime when the model is FSDP2-wrapped) FSDP2
issues its own all-gathers at the start of every forward and backward, so a check must be
settled before the model's first hook lets FSDP2 go; a check that a rank out of step has not
settled before then would let FSDP2's collectives pair with different ones (gloo aborts on a
size mismatch). So the forward check is *issued at the end of* ``opt.step()`` (the counts it
carries, ``(forward, steps, backwards)``, cannot change before the next forward) and settled in
the model's forward pre-hook: its round trip overlaps whatever runs between the step and the
next forward (``zero_grad``, the data loader, logging), and the pre-hook finds it done. A rank
that skipped ``opt.step()`` issues its forward check in that pre-hook instead (blocking) and
pairs with the others' early one, and a rank that skipped backward issues its forward check at
its step, which pairs with the others' backward check: every desync is caught at the same point
with the same counts as with blocking checks. The backward check stays blocking there: it cannot
be issued before backward starts (a rank that skips backward must not have sent it), and FSDP2's
first backward all-gather follows at once. The first forward (no step before it) is checked
blocking too. One case loses its name: a rank that runs *more* steps than the others (they
stopped) passes its forward check, issued with theirs at the last common step, and its wait ends
in FSDP2's first all-gather, by the same user timeout but with gloo's own message
("Timed out waiting ... for send operation") instead of dmuon's "waited in vain ... at its
forward after N optimizer step(s)" (which the replicated path and a blocking check still give).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten

from dmuon.comm.collectives import label

logger = logging.getLogger(__name__)

PHASES = ("forward", "backward")


def in_autograd_backward() -> bool:
    """True while the autograd engine runs a backward pass (activation checkpointing re-runs
    forwards there); the runtime's unit hooks ask the same."""
    return torch._C._current_graph_task_id() != -1


class StepCheck:
    """Per-rank step and backward counts, compared across ranks at each forward and backward.

    Args:
        group: the check's own process group over every rank of the mesh, or ``None`` (no
            check: a single rank, or no gloo).
    """

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.rank = dist.get_rank(group) if group is not None else 0
        self.world_size = dist.get_world_size(group) if group is not None else 1
        self.steps = 0  # opt.step() calls on this rank
        self.backwards = 0  # backward passes that reached a dmuon hook
        self._last: int | None = None  # phase checked last; None after a step
        self.checks = 0  # collectives issued (for tests)
        self.deferred = False  # issue now, wait at settle() (the runtime sets it at binding)
        self.issue_at_step = False  # FSDP2: the forward check goes out at the step (binding sets it)
        self._pending: tuple[Any, torch.Tensor, int, int, int] | None = None  # work, rows, phase, steps, backwards

    def install(self, model: nn.Module) -> list:
        """Check at the model's own forward, in front of every other hook (FSDP2's root
        all-gather included, when ``dedicate_params`` runs after ``fully_shard``), and at the
        first gradient of its output, before FSDP2's pre-backward all-gathers.

        Returns:
            The hook handles (``remove()`` them to uninstall).
        """
        def post_forward(module: nn.Module, args: Any, output: Any) -> None:
            needs_grad = [t for t in tree_flatten(output)[0]
                          if isinstance(t, torch.Tensor) and t.requires_grad]
            if needs_grad and not in_autograd_backward():  # the hook lives as long as the graph
                register_multi_grad_hook(needs_grad, lambda grads: self.before_backward(), mode="any")

        from dmuon.hooks.compile import dynamo_disable  # torch.compile runs them eagerly

        def pre_forward(module: nn.Module, args: Any) -> None:
            self.before_forward()

        return [model.register_forward_pre_hook(dynamo_disable(pre_forward), prepend=True),
                model.register_forward_hook(dynamo_disable(post_forward), prepend=True)]

    def before_forward(self) -> None:
        """The first dmuon forward hook since the last backward or step (not inside backward)."""
        if in_autograd_backward():
            return
        if self._last == 0:
            if self.issue_at_step:
                self.settle()  # the check issued at the step, before FSDP2's first all-gather
            return
        self._last = 0
        self._check(0)

    def before_backward(self) -> None:
        """The first dmuon backward hook since the last forward."""
        if self._last == 1:
            return
        self._last = 1
        self._check(1)
        self.backwards += 1

    def after_step(self) -> None:
        """``opt.step()`` finished on this rank (under FSDP2: issue the next forward's check)."""
        self.steps += 1
        self._last = None
        if self.issue_at_step and not self.deferred:
            self._last = 0
            self._check(0, wait=False)

    def _check(self, phase: int, wait: bool | None = None) -> None:
        """Issue the check of ``phase``; wait for it now unless deferred (or ``wait=False``)."""
        if self.group is None or self.world_size == 1:
            return
        self.settle()  # at most one check in flight
        rows = torch.zeros(self.world_size, 3, dtype=torch.int64)
        rows[self.rank, 0], rows[self.rank, 1], rows[self.rank, 2] = phase, self.steps, self.backwards
        self.checks += 1
        with label("dmuon::step_check"):
            work = dist.all_reduce(rows, group=self.group, async_op=True)
        self._pending = (work, rows, phase, self.steps, self.backwards)
        if (not self.deferred) if wait is None else wait:
            self.settle()

    def settle(self) -> None:
        """Wait for the check in flight, if any, and raise if the ranks disagree.

        Raises:
            RuntimeError: the ranks are out of step (:meth:`describe`), or the check timed out
                or failed (naming this rank, its phase and counts, and the check's ranks).
        """
        if self._pending is None:
            return
        work, rows, phase, steps, backwards = self._pending
        self._pending = None
        try:
            with label("dmuon::step_check_wait"):
                work.wait()
        except RuntimeError as err:
            global_rank = dist.get_rank()
            raise RuntimeError(
                f"dmuon: rank {global_rank} waited in vain for the other ranks at its "
                f"{PHASES[phase]} after {steps} optimizer step(s) and {backwards} "
                f"backward(s) (step check over ranks {dist.get_process_group_ranks(self.group)}): "
                f"{_first_line(err)}. Another rank ran fewer steps, stopped, died or is stuck; "
                f"every rank must run the same forwards, backwards and opt.step() calls."
            ) from err
        # rows is a CPU tensor on the gloo group: reading it never synchronizes a GPU stream
        states = [tuple(int(v) for v in row) for row in rows.tolist()]
        if len(set(states)) > 1:
            raise RuntimeError(self.describe(states))

    def describe(self, states: list[tuple[int, int, int]]) -> str:
        """The error text for disagreeing ``(phase, steps, backwards)`` rows, one per rank."""
        ranks = dist.get_process_group_ranks(self.group)
        counts = Counter(states).most_common()
        by_state = {s: [ranks[i] for i, x in enumerate(states) if x == s] for s, _ in counts}
        where = "; ".join(f"ranks {r} are at a {PHASES[s[0]]} after {s[1]} opt.step() call(s) "
                          f"and {s[2]} backward(s)" for s, r in by_state.items())
        if len(counts) > 1 and counts[0][1] > counts[1][1]:
            odd = sorted(r for s, rs in by_state.items() if s != counts[0][0] for r in rs)
            culprit = f"Ranks {odd} skipped or repeated opt.step() or loss.backward()"
        else:
            culprit = "Some ranks skipped or repeated opt.step() or loss.backward()"
        return (f"dmuon: ranks are out of step (seen on rank {dist.get_rank()}): {where}. "
                f"{culprit}; every rank must run the same forwards, backwards and steps. "
                f"Restart from the last checkpoint.")


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__
