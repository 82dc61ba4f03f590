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
size mismatch, and two all-gathers of equal size pair silently). So the forward check is
*issued at the end of* ``opt.step()`` (the counts it carries, ``(forward, steps, backwards)``,
cannot change before the next forward) and settled in the model's forward pre-hook, which
binding puts in front of FSDP2's root pre-forward (``fully_shard`` prepends its hook too, so
when ``dedicate_params`` ran first FSDP2's was in front: :meth:`StepCheck.to_front`): its round
trip overlaps whatever runs between the step and the next forward (``zero_grad``, the data
loader, logging), and the pre-hook finds it done. A rank that skipped ``opt.step()`` issues its
forward check in that pre-hook instead (blocking) and pairs with the others' early one, and a
rank that skipped backward issues its forward check at its step, which pairs with the others'
backward check: every desync is caught at the same point with the same counts as with
blocking checks. The first forward (no step before it) is checked blocking too.

A rank that runs *more* steps than the others (they stopped) passes its forward check, issued
with theirs at the last common step; no check issued before that forward can tell that the
others will not come, and one issued at the forward would have to be waited on there, a round
trip every step. The first thing that waits for them is FSDP2's all-gather of that forward:
its failure (the user's timeout) is raised as this check's error, "waited in vain for the
other ranks at its forward after N optimizer step(s)", by a wrapper around FSDP2's forward
pre-hook (:meth:`StepCheck.guard_fsdp_pre_forward`, installed by the FSDP2 adapter).

The backward check stays blocking under FSDP2, and cannot be deferred: FSDP2's root
pre-backward is a hook on the same output tensors as the check's (registered after it, in
FSDP2's post-forward, ``t.register_hook(self._pre_backward)``), and it issues the backward
prefetch all-gather of the last resharded block at once (``FSDPParamGroup.pre_backward`` ->
``_backward_prefetch``); nothing runs between the two hooks for a round trip to overlap. Nor can
it be issued earlier (at the end of forward): a rank that then skips backward would have sent
it, the others' check would pass, and their backward all-gathers would meet that rank's next
forward all-gathers (same sizes pair silently). Tried (issue 25): with the backward check
issued without waiting and settled at dmuon's next collective, a rank skipping backward under
FSDP2 still failed by name (its step's check met the others' backward one), but the rank that
ran backward was already inside FSDP2's backward collectives and failed there with gloo's own
error ("Connection closed by peer", after the other rank had raised and left), where the
blocking check names both ranks' counts on both.
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
        self._pre_forward: Any = None  # the forward pre-hook and its handle (install, to_front)
        self._pre_forward_handle: Any = None
        # the owners' overlapped work (dmuon.owners.overlap.PendingSteps): its deferred failure
        # travels in every check, so every rank raises at the same point
        self.pending: Any = None

    def watch(self, pending: Any) -> None:
        """Carry ``pending``'s (:class:`dmuon.owners.overlap.PendingSteps`) failure flag in every
        check; with peers to tell, it then defers a failure met on the way to a publication."""
        self.pending = pending
        pending.defer_failures = self.group is not None and self.world_size > 1

    def install(self, model: nn.Module) -> list:
        """Check at the model's own forward, in front of every other hook (FSDP2's root
        all-gather included: at once when ``dedicate_params`` runs after ``fully_shard``, from
        binding on otherwise, :meth:`to_front`), and at the first gradient of its output,
        before FSDP2's pre-backward all-gathers.

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

        self._pre_forward = dynamo_disable(pre_forward)
        self._pre_forward_handle = model.register_forward_pre_hook(self._pre_forward, prepend=True)
        return [self._pre_forward_handle,
                model.register_forward_hook(dynamo_disable(post_forward), prepend=True)]

    def to_front(self, model: nn.Module) -> list:
        """Put the forward pre-hook back in front of every hook of ``model``.

        ``fully_shard(model)`` registers FSDP2's root pre-forward (its all-gather) with
        ``prepend=True`` too (``FSDPState.init``), so when ``dedicate_params`` ran before
        ``fully_shard`` FSDP2's hook sits in front of the check's. The runtime calls this at
        binding (after the user's ``fully_shard`` calls).

        Returns:
            The new hook handle (``remove()`` it to uninstall).
        """
        self._pre_forward_handle.remove()
        self._pre_forward_handle = model.register_forward_pre_hook(self._pre_forward, prepend=True)
        return [self._pre_forward_handle]

    def guard_fsdp_pre_forward(self, fsdp_pre_forward: Callable[..., Any]) -> Callable[..., Any]:
        """FSDP2's forward pre-hook (its all-gather) wrapped so that a rank the others have left
        fails with this check's error instead of the backend's bare timeout.

        Why: a rank that runs one step more than the others passes the forward check, which
        went out at the end of its last common step together with theirs (see the module
        docstring), so the first thing that waits for the missing ranks is FSDP2's all-gather
        of the next forward. Only a blocking check issued at that forward could catch it
        first, costing every step a round trip. Here the all-gather's failure (the user's
        timeout, or a closed connection) is raised as :meth:`waited_in_vain` at that forward,
        chained to the backend's error. Inside backward (activation checkpointing
        re-running a forward) and out of memory, FSDP2's error passes through unchanged.

        Args:
            fsdp_pre_forward: the hook FSDP2 registered (``FSDPState._pre_forward`` or its
                grouped wrapper), called unchanged.

        Returns:
            The hook to register in its place (same signature).
        """
        from dmuon.hooks.compile import dynamo_disable

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
        if self.issue_at_step and not self.deferred:
            self._last = 0
            self._check(0, wait=False)

    def _check(self, phase: int, wait: bool | None = None) -> None:
        """Issue the check of ``phase``; wait for it now unless deferred (or ``wait=False``)."""
        if self.group is None or self.world_size == 1:
            return
        self.settle()  # at most one check in flight
        rows = torch.zeros(self.world_size, 4, dtype=torch.int64)
        rows[self.rank, 0], rows[self.rank, 1], rows[self.rank, 2] = phase, self.steps, self.backwards
        rows[self.rank, 3] = int(self.pending is not None and self.pending.failure is not None)
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
        backward) after ``steps`` steps and ``backwards`` backwards: the check's own wait, or
        (``what`` names it) FSDP2's first collective of a forward after the check passed."""
        where = f", {what}" if what else ""
        return RuntimeError(
            f"dmuon: rank {dist.get_rank()} waited in vain for the other ranks at its "
            f"{PHASES[phase]} after {steps} optimizer step(s) and {backwards} "
            f"backward(s) (step check over ranks {dist.get_process_group_ranks(self.group)}{where}): "
            f"{_first_line(err)}. Another rank ran fewer steps, stopped, died or is stuck; "
            f"every rank must run the same forwards, backwards and opt.step() calls."
        )

    def describe_failure(self, failed: list[int], phase: int, steps: int, backwards: int) -> str:
        """The error text when the ranks at ``failed`` (indices in the check's group) recorded a
        failed overlapped owner update: every rank raises it at the same check, quoting the
        first failing rank's own message (from the c10d store, where it left it)."""
        ranks = dist.get_process_group_ranks(self.group)
        names = [ranks[i] for i in failed]
        if self.pending is not None and self.pending.failure is not None:
            cause = self.pending.failure
        else:
            cause = "its message could not be read"
            try:
                raw = dist.distributed_c10d._get_default_store().get(f"dmuon/failure/{names[0]}")
                cause = raw.decode() if isinstance(raw, bytes) else str(raw)
            except Exception:  # noqa: BLE001 - the rank numbers are the error; the text is a help
                pass
        return (f"dmuon: the overlapped owner update failed on rank(s) {names} (seen on rank "
                f"{dist.get_rank()} at its {PHASES[phase]} after {steps} optimizer step(s) and "
                f"{backwards} backward(s); every rank stops at this step check): {cause}")

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
