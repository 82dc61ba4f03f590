"""dmuon's collectives, as plain functions over the dmuon process group.

Every function only *issues* asynchronous work and returns it with the tensors that must stay
alive until ``wait()`` (freeing a buffer under an in-flight collective corrupts memory).
All ranks of the group must call them in the same order, which holds because they are issued
from module hooks that run in the same order on every rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function


def label(name: str) -> contextlib.AbstractContextManager:
    """``torch.profiler.record_function(name)`` while a profiler is running, else a no-op.

    dmuon's hooks run about a hundred times a step; an unconditional ``record_function``
    costs about 8 us each on CPU (a dispatcher call in and out), the check 0.1 us.
    """
    return record_function(name) if torch.autograd._profiler_enabled() else contextlib.nullcontext()


@dataclass(eq=False)
class Pending:
    """An in-flight collective, the buffers it reads or writes, and how to unpack its result.

    The one handle of every dmuon collective: the runtime's publish / reduce-to-owner /
    all-reduce and the ``distributed_config`` path's all-to-all exchanges
    (:mod:`dmuon.distconfig.exchange`).

    Attributes:
        work: the ``dist.Work`` (or NCCL group call) to wait on; ``None`` once waited (or when
            nothing was issued).
        tensors: buffers that must stay alive until the wait.
        what: what the collective does, for the error text (a string, or a callable that
            builds it only on failure, e.g. naming the matrices).
        group: the process group it runs on (its ranks are named on failure).
        finish: called once after the wait; its value is what :meth:`wait` returns (e.g. the
            received pieces unpacked into full matrices). ``None``: :meth:`wait` returns ``None``.
    """

    work: Any
    tensors: tuple[torch.Tensor, ...]
    what: str | Callable[[], str] = "a collective"
    group: dist.ProcessGroup | None = None
    finish: Callable[[], Any] | None = None
    result: Any = field(default=None, init=False, repr=False)

    def wait(self) -> Any:
        """Wait; the group's timeout (the user's, :func:`dmuon.comm.mesh_roles.inherited_timeout`)
        bounds it. Waiting again returns the same result without waiting.

        Returns:
            ``finish()``'s value (computed on the first wait), or ``None`` without ``finish``.

        Raises:
            RuntimeError: the collective failed or timed out, naming this rank, what dmuon was
                waiting for, the group's ranks, and the backend's own message (chained).
        """
        if self.work is not None:
            try:
                self.work.wait()
            except RuntimeError as err:  # DistBackendError and gloo's timeouts subclass it
                raise RuntimeError(wait_failure(self.what, self.group, err)) from err
            self.work = None
        if self.finish is not None:
            self.result, self.finish = self.finish(), None
        return self.result


def wait_failure(what: str | Callable[[], str], group: dist.ProcessGroup | None,
                 err: BaseException) -> str:
    """The message for a dmuon collective that failed or timed out."""
    what = what() if callable(what) else what
    ranks = dist.get_process_group_ranks(group) if group is not None else "?"
    lines = str(err).strip().splitlines() or [type(err).__name__]
    return (f"dmuon: rank {dist.get_rank()} waited in vain for {what} (dmuon group of ranks "
            f"{ranks}): {lines[0]}. A rank is out of step (skipped or repeated opt.step() or "
            f"backward), died or is stuck; the other ranks' errors say which.")


def is_complete(work: Any) -> bool:
    """Whether ``work`` is known complete, by non-blocking queries (gloo reads a flag; NCCL
    queries the work's CUDA event, no host synchronisation): ``None`` (nothing in flight) is;
    a coalesced NCCL group call (``torch.distributed._coalescing_manager``, what
    :func:`issued_together` rebinds its :class:`Pending` objects to) is when each of its works
    is; a work that cannot be queried never is."""
    if work is None:
        return True
    works = getattr(work, "works", None)
    if works is not None:
        return all(is_complete(w) for w in works)
    done = getattr(work, "is_completed", None)
    return done is not None and bool(done())


@contextlib.contextmanager
def issued_together(group: dist.ProcessGroup, device: torch.device, pendings: list[Pending]) -> Iterator[None]:
    """Issue the collectives started inside as one NCCL group call where the backend can.

    On NCCL (CUDA tensors) the block runs under ``torch.distributed._coalescing_manager``: the
    broadcasts or reduces it issues, to or from different owners, launch as one
    ``ncclGroupStart``/``ncclGroupEnd`` and pay the launch latency once. Afterwards every
    :class:`Pending` in ``pendings`` waits on the whole group. Other backends (gloo cannot
    coalesce) issue them one by one, unchanged.

    Args:
        group: the process group every collective inside uses.
        device: the device of their tensors.
        pendings: the caller's list; the :class:`Pending` objects appended inside are rebound
            to the group's work.
    """
    if device.type != "cuda" or dist.get_backend(group) != "nccl":
        yield
        return
    first = len(pendings)
    with dist._coalescing_manager(group, device=device, async_ops=True) as manager:
        yield
    for pend in pendings[first:]:
        pend.work = manager


def publish(tensor: torch.Tensor, owner: int, group: dist.ProcessGroup,
            names: Callable[[], list[str]] | None = None) -> Pending:
    """Broadcast the owner's full weight into every rank's buffer (phase 1/4: publish).

    Args:
        tensor: full weight ``[rows, cols]`` in the compute dtype; read on the owner, written
            elsewhere (its storage must be allocated).
        owner: owner's rank within ``group``.
        names: returns the FQNs of the matrices in ``tensor`` (called only for an error).
    """
    src = dist.get_global_rank(group, owner)
    with label("dmuon::publish"), torch.no_grad():
        work = dist.broadcast(tensor, src=src, group=group, async_op=True)
    return Pending(work, (tensor,), lambda: f"the publication of {_names(names)} by owner rank {src}", group)


def reduce_to_owner(grad: torch.Tensor, owner: int, group: dist.ProcessGroup,
                    names: Callable[[], list[str]] | None = None) -> Pending:
    """Sum a full local gradient onto its owner (phase 2: reduce-to-owner).

    Args:
        grad: this rank's local gradient ``[rows, cols]``; after ``wait()`` it holds the sum
            over the group on the owner and is undefined elsewhere. The caller divides.
        owner: owner's rank within ``group``.
        names: returns the FQNs of the matrices in ``grad`` (called only for an error).
    """
    dst = dist.get_global_rank(group, owner)
    with label("dmuon::reduce_to_owner"):
        work = dist.reduce(grad, dst=dst, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return Pending(work, (grad,), lambda: f"the reduce-to-owner of {_names(names)} to owner rank {dst}",
                   group)


def all_reduce_sum(flat: torch.Tensor, group: dist.ProcessGroup,
                   what: str | Callable[[], str] = "the gradient all-reduce") -> Pending:
    """Sum a flat buffer over the group: the gradients of replicated (non-dedicated) parameters,
    or a gradient bucket under ``reduce_mode="all_reduce"``."""
    with label("dmuon::all_reduce"):
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return Pending(work, (flat,), what, group)


def _names(names: Callable[[], list[str]] | None) -> str:
    if names is None:
        return "a weight"
    listed = names()
    return f"{listed[:4]}{f' (+{len(listed) - 4} more)' if len(listed) > 4 else ''}"


_SAME_MODEL = ("Every rank must build the same model and pass the same predicate and plan to "
               "dedicate_params.")


def check_same_on_all_ranks(value: str, what: str, group: dist.ProcessGroup | None,
                            fix: str = _SAME_MODEL) -> None:
    """Raise on every rank if ``value`` (a digest string) differs between ranks of ``group``.

    Args:
        value: this rank's digest.
        what: what the digest is of, for the message (``"owner plan digest"``).
        group: the process group (``None``: the default group).
        fix: the last sentence of the message: how to make the ranks agree.

    Raises:
        RuntimeError: naming each rank whose value differs from rank 0's, on every rank
            (the exchange is one all-gather, so no rank is left waiting).
    """
    values: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    bad = [r for r, v in enumerate(values) if v != values[0]]
    if bad:
        raise RuntimeError(
            f"dmuon: the {what} differs between ranks: rank 0 has {values[0][:16]}..., ranks "
            f"{bad} have {[str(values[r])[:16] + '...' for r in bad]}. {fix}"
        )
