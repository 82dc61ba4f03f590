"""Step agreement: a rank that skips or repeats ``opt.step()`` or ``backward()`` fails loudly.

Every rank's step and backward counts are compared at the start of every forward and backward:
one all-reduce of a ``[world, 4]`` int64 tensor (phase, steps, backwards, failure flag) on a
gloo group of its own (no GPU stream sync). A rank ahead of the others fails by name at the
group's timeout. Modes, set at binding: ``deferred`` (no FSDP2) waits in
:meth:`StepCheck.settle`, before dmuon's next collective; ``issue_at_step`` (FSDP2) issues the
forward check at the end of ``opt.step()`` and settles it before FSDP2's root pre-forward.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten

from dmuon.comm.collectives import label
from dmuon.hooks.compile import dynamo_disable  # torch.compile runs dmuon's hooks eagerly

logger = logging.getLogger(__name__)

PHASES = ("forward", "backward")


def in_autograd_backward() -> bool:
    """True while the autograd engine runs a backward pass."""
    return torch._C._current_graph_task_id() != -1


class StepCheck:
    """Per-rank step and backward counts, compared over ``group`` (``None``: no check). The
    failure flag of ``pending`` (:class:`dmuon.owners.overlap.PendingSteps`) travels in every
    check, so every rank raises at the same point."""

    def __init__(self, group: dist.ProcessGroup | None, pending: Any) -> None:
        self.group = group
        self.rank = dist.get_rank(group) if group is not None else 0
        self.world_size = dist.get_world_size(group) if group is not None else 1
        self.steps = 0  # opt.step() calls on this rank
        self.backwards = 0  # backward passes that reached a dmuon hook
        self._last: int | None = None  # phase checked last; None after a step
        self.deferred = False  # issue now, wait at settle() (the runtime sets it at binding)
        self.issue_at_step = False  # FSDP2: the forward check goes out at the step (binding sets it)
        # work, rows, phase, steps, backwards
        self._pending: tuple[Any, torch.Tensor, int, int, int] | None = None
        # the forward pre-hook and its handle (install, to_front)
        self._pre_forward = dynamo_disable(lambda module, args: self.before_forward())
        self._pre_forward_handle: Any = None
        self.pending = pending
        pending.defer_failures = self.group is not None and self.world_size > 1

    def install(self, model: nn.Module) -> list:
        """Check in front of every forward pre-hook of ``model`` and at the first gradient of
        its output; returns the hook handles."""
        def post_forward(module: nn.Module, args: Any, output: Any) -> None:
            needs_grad = [t for t in tree_flatten(output)[0]
                          if isinstance(t, torch.Tensor) and t.requires_grad]
            if needs_grad and not in_autograd_backward():  # the hook lives as long as the graph
                register_multi_grad_hook(needs_grad, lambda grads: self.before_backward(), mode="any")

        self._pre_forward_handle = model.register_forward_pre_hook(self._pre_forward, prepend=True)
        return [self._pre_forward_handle,
                model.register_forward_hook(dynamo_disable(post_forward), prepend=True)]

    def to_front(self, model: nn.Module) -> list:
        """Put the forward pre-hook back in front of FSDP2's; returns the new handle."""
        self._pre_forward_handle.remove()
        self._pre_forward_handle = model.register_forward_pre_hook(self._pre_forward, prepend=True)
        return [self._pre_forward_handle]

    def guard_fsdp_pre_forward(self, fsdp_pre_forward: Callable[..., Any]) -> Callable[..., Any]:
        """FSDP2's forward pre-hook, its failure after a passed forward check (a rank the others
        left) raised as :meth:`waited_in_vain`."""
        def pre_forward(*args: Any, **kwargs: Any) -> Any:
            try:
                return fsdp_pre_forward(*args, **kwargs)
            except RuntimeError as err:
                if (self.group is None or self.world_size == 1 or self._last != 0
                        or isinstance(err, torch.OutOfMemoryError) or in_autograd_backward()):
                    raise
                raise self.waited_in_vain(
                    0, self.steps, self.backwards, err,
                    what="which agreed at this rank's last step; then FSDP2's all-gather of this forward failed",
                ) from err

        return dynamo_disable(pre_forward)

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
        if self.issue_at_step:  # never with deferred (the runtime sets one of them)
            self._last = 0
            self._check(0, wait=False)

    def _check(self, phase: int, wait: bool | None = None) -> None:
        """Issue the check of ``phase``; wait for it now unless deferred (or ``wait=False``)."""
        if self.group is None or self.world_size == 1:
            return
        self.settle()  # at most one check in flight
        rows = torch.zeros(self.world_size, 4, dtype=torch.int64)
        rows[self.rank, 0], rows[self.rank, 1], rows[self.rank, 2] = phase, self.steps, self.backwards
        rows[self.rank, 3] = int(self.pending.failure is not None)
        with label("dmuon::step_check"):
            work = dist.all_reduce(rows, group=self.group, async_op=True)
        self._pending = (work, rows, phase, self.steps, self.backwards)
        if (not self.deferred) if wait is None else wait:
            self.settle()

    def settle(self) -> None:
        """Wait for the check in flight, if any; ``RuntimeError`` if the ranks are out of step,
        an overlapped update failed, or the check timed out."""
        if self._pending is None:
            return
        work, rows, phase, steps, backwards = self._pending
        self._pending = None
        try:
            with label("dmuon::step_check_wait"):
                work.wait()
        except RuntimeError as err:
            raise self.waited_in_vain(phase, steps, backwards, err) from err
        # rows is a CPU tensor on the gloo group: reading it never synchronizes a GPU stream
        values = rows.tolist()
        failed = [i for i, row in enumerate(values) if row[3]]
        if failed:
            raise RuntimeError(self.describe_failure(failed, phase, steps, backwards))
        states = [tuple(int(v) for v in row[:3]) for row in values]
        if len(set(states)) > 1:
            raise RuntimeError(self.describe(states))

    def waited_in_vain(self, phase: int, steps: int, backwards: int, err: BaseException,
                       what: str = "") -> RuntimeError:
        """The error of a rank whose wait for the others failed in ``phase`` (0 forward, 1
        backward); ``what`` names a wait other than the check's own."""
        where = f", {what}" if what else ""
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        return RuntimeError(
            f"dmuon: rank {dist.get_rank()} waited in vain for the other ranks at "
            f"{_at(phase, steps, backwards)} (step check over ranks "
            f"{dist.get_process_group_ranks(self.group)}{where}): {first}. Another rank ran fewer "
            f"steps, stopped, died or is stuck; every rank must run the same forwards, backwards "
            f"and opt.step() calls."
        )

    def describe_failure(self, failed: list[int], phase: int, steps: int, backwards: int) -> str:
        """The error text for a failed overlapped update on ranks ``failed`` (group indices),
        quoting the first one's message from the c10d store."""
        ranks = dist.get_process_group_ranks(self.group)
        names = [ranks[i] for i in failed]
        if self.pending.failure is not None:
            cause = self.pending.failure
        else:
            cause = "its message could not be read"
            try:
                raw = dist.distributed_c10d._get_default_store().get(f"dmuon/failure/{names[0]}")
                cause = raw.decode() if isinstance(raw, bytes) else str(raw)
            except Exception:  # noqa: BLE001 - the rank numbers are the error; the text is a help
                pass
        return (f"dmuon: the overlapped owner update failed on rank(s) {names} (seen on rank "
                f"{dist.get_rank()} at {_at(phase, steps, backwards)}; every rank stops at this "
                f"step check): {cause}")

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


def _at(phase: int, steps: int, backwards: int) -> str:
    return f"its {PHASES[phase]} after {steps} optimizer step(s) and {backwards} backward(s)"
