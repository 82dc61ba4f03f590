"""dmuon's collectives: each issues asynchronous work and returns a :class:`Pending`, whose
``wait()`` names dmuon on a failure. Ranks issue them in one order (from module hooks)."""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function
from torch.distributed.distributed_c10d import _CoalescingManager


def label(name: str) -> contextlib.AbstractContextManager:
    """``record_function(name)`` while a profiler runs, else a no-op (8 us saved on CPU)."""
    return record_function(name) if torch.autograd._profiler_enabled() else contextlib.nullcontext()


@dataclass(eq=False)
class Pending:
    """The one handle of every dmuon collective.

    Attributes:
        work: the ``dist.Work`` (or group call) to wait on; ``None`` once waited or never issued.
        tensors: buffers that must stay alive until the wait.
        what: what the collective does, for the error text (or a callable building it).
        group: the process group it runs on (its ranks are named on failure).
        finish: called once after the wait; its value is what :meth:`wait` returns.
    """

    work: Any
    tensors: tuple[torch.Tensor, ...]
    what: str | Callable[[], str] = "a collective"
    group: dist.ProcessGroup | None = None
    finish: Callable[[], Any] | None = None
    result: Any = field(default=None, init=False, repr=False)

    def wait(self) -> Any:
        """Wait (bounded by the group's timeout); return ``finish()``'s value, computed once.
        Raises RuntimeError on a failure or timeout, naming this rank, ``what``, the group's
        ranks and the backend's message (chained)."""
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
    """Whether ``work`` (``None``, a work or a ``_CoalescingManager``) is known complete, by
    non-blocking queries; a work that cannot be queried never is."""
    if work is None:
        return True
    works = getattr(work, "works", None)
    if works is not None:
        return all(is_complete(w) for w in works)
    done = getattr(work, "is_completed", None)
    return done is not None and bool(done())


@contextlib.contextmanager
def issued_together(group: dist.ProcessGroup, device: torch.device,
                    pendings: list[Pending]) -> Iterator[None]:
    """Issue the collectives started inside as one NCCL group call (``_coalescing_manager``);
    the :class:`Pending` objects appended to ``pendings`` inside then wait on the whole group.
    Gloo issues them one by one."""
    if device.type != "cuda" or dist.get_backend(group) != "nccl":
        yield
        return
    first = len(pendings)
    with dist._coalescing_manager(group, device=device, async_ops=True) as manager:
        yield
    for pend in pendings[first:]:
        pend.work = manager


def all_reduce(t: torch.Tensor, op: Any, group: dist.ProcessGroup, what: str) -> None:
    """``dist.all_reduce(t, op, group)`` in place, waited through :class:`Pending`."""
    Pending(dist.all_reduce(t, op=op, group=group, async_op=True), (t,), what, group).wait()


def all_gather_object(value: Any, group: dist.ProcessGroup | None, what: str) -> list[Any]:
    """Every rank's ``value`` (``dist.all_gather_object``); a failure names dmuon and ``what``."""
    values: list[Any] = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(values, value, group=group)
    except RuntimeError as err:
        raise RuntimeError(wait_failure(what, group, err)) from err
    return values


def publish(tensor: torch.Tensor, owner: int, group: dist.ProcessGroup,
            names: Callable[[], list[str]] | None = None) -> Pending:
    """Broadcast the owner's full weight ``tensor`` (``[rows, cols]``, compute dtype, storage
    allocated) from ``owner`` (a rank of ``group``) into every rank's (phase 1/4); ``names()``
    lists its matrices' FQNs for an error."""
    src = dist.get_global_rank(group, owner)
    with label("dmuon::publish"), torch.no_grad():
        work = dist.broadcast(tensor, src=src, group=group, async_op=True)
    return Pending(work, (tensor,), lambda: f"the publication of {_names(names)} by owner rank {src}",
                   group)


_OPS = ("all_reduce", "reduce", "broadcast")


@dataclass(eq=False)
class FlatBucket:
    """Tensors packed into one flat buffer of one dtype and device that crosses a process group
    as one collective (gradient buckets, replicated parameters, HSDP replicas).

    ``flat`` holds the segments in order: a segment's tensors, flattened, then, if flagged, one
    flag per tensor (default 1.0 where given, 0.0 where zeros stand in: summed, how many ranks
    had it).

    Attributes:
        shapes: each tensor's shape, in buffer order.
        dtype, device: the buffer's (tensors are cast as they are packed).
        segments: ``(number of tensors, flagged)`` per segment; ``None``: one unflagged segment.
        flat: ``[numel]`` in ``dtype``; allocated by the first :meth:`pack`.
        slots: ``(start, numel)`` of each tensor in ``flat``.
        flag_at: each tensor's flag position in ``flat`` (``None`` in an unflagged segment).
        spans: ``(start, numel)`` of each segment, its flags included.
    """

    shapes: list[torch.Size]
    dtype: torch.dtype
    device: torch.device
    segments: list[tuple[int, bool]] | None = None
    flat: torch.Tensor | None = None
    slots: list[tuple[int, int]] = field(default_factory=list, init=False)
    flag_at: list[int | None] = field(default_factory=list, init=False)
    spans: list[tuple[int, int]] = field(default_factory=list, init=False)
    numel: int = field(default=0, init=False)
    _ones: torch.Tensor | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.segments = self.segments or [(len(self.shapes), False)]
        start, sizes = 0, iter(math.prod(shape) for shape in self.shapes)
        for count, flagged in self.segments:
            seg_start = start
            for numel in itertools.islice(sizes, count):
                self.slots.append((start, numel))
                start += numel
            self.flag_at += list(range(start, start + count)) if flagged else [None] * count
            start += count if flagged else 0
            self.spans.append((seg_start, start - seg_start))
        self.numel = start

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor], flags: Sequence[float] | None = None, *,
           pack: bool = True) -> FlatBucket:
        """One segment of ``tensors`` (flagged when ``flags`` is given), packed, or with
        ``pack=False`` an uninitialized receive buffer. Raises ValueError if ``tensors`` is
        empty or mixes dtypes or devices."""
        tensors = list(tensors)
        if not tensors:
            raise ValueError("dmuon: FlatBucket needs at least one tensor; skip empty batches")
        dtypes, devices = {t.dtype for t in tensors}, {t.device for t in tensors}
        if len(dtypes) > 1 or len(devices) > 1:
            raise ValueError(
                f"dmuon: FlatBucket.of takes one dtype and one device, got dtypes "
                f"{sorted(map(str, dtypes))} and devices {sorted(map(str, devices))}; group the "
                f"tensors with batches_by_dtype")
        bucket = cls([t.shape for t in tensors], tensors[0].dtype, tensors[0].device,
                     [(len(tensors), flags is not None)])
        if pack:
            bucket.pack(tensors, flags)
        else:
            bucket.flat = torch.empty(bucket.numel, dtype=bucket.dtype, device=bucket.device)
        return bucket

    def pack(self, tensors: Sequence[torch.Tensor | None],
             flags: Sequence[float] | None = None) -> None:
        """Write ``tensors`` (any dtype; ``None``: zeros) and the flagged segments' ``flags``
        (one per tensor; default: whether given) into ``flat`` with one ``torch._chunk_cat``."""
        if self.flat is None:
            self.flat = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        if flags is None:
            flags = [float(t is not None) for t in tensors]
        values = [f for f, at in zip(flags, self.flag_at) if at is not None]
        if values and all(f == 1.0 for f in values):
            # no host-to-device copy, which would synchronize the host with the GPU stream
            if self._ones is None:
                self._ones = torch.ones(len(values), dtype=self.dtype, device=self.device)
            values = self._ones
        elif values:
            values = torch.tensor(values, dtype=self.dtype, device=self.device)
        counts = [n for n, flagged in self.segments if flagged]
        flag_parts = iter(values.split(counts) if counts else ())
        parts, first = [], 0
        for count, flagged in self.segments:
            for t, shape in zip(tensors[first: first + count], self.shapes[first: first + count]):
                if t is None:
                    t = torch.zeros(shape, dtype=self.dtype, device=self.device)
                elif t.requires_grad:  # a gradient of a create_graph backward; no op per tensor else
                    t = t.detach()
                parts.append(t if t.dim() else t.reshape(1))
            if flagged:
                parts.append(next(flag_parts))
            first += count
        if len({p.dtype for p in parts}) > 1:  # _chunk_cat takes one input dtype
            parts = [p.to(self.dtype) for p in parts]
        torch._chunk_cat(parts, dim=0, num_chunks=1, out=self.flat.view(1, self.numel))

    def issue(self, op: str, group: dist.ProcessGroup, root: int | Sequence[int] = 0,
              what: str | Callable[[], str] = "a flat collective") -> Pending:
        """Start ``op`` on ``flat`` over ``group``; the :class:`Pending` holds ``flat``.

        Args:
            op: ``"all_reduce"`` (the sum on every rank), ``"reduce"`` (each segment's sum on
                its root, one group call) or ``"broadcast"`` (``root``'s ``flat`` to every rank).
            root: the root's rank within ``group``, or for ``"reduce"`` one per segment.
            what: what the collective does, for a failure's message.

        Raises:
            ValueError: an unknown ``op``.
        """
        if op not in _OPS:
            raise ValueError(f"dmuon: FlatBucket op must be one of {_OPS}, got {op!r}")
        with label(f"dmuon::{op}"):
            if op == "all_reduce":
                work = dist.all_reduce(self.flat, group=group, async_op=True)
            elif op == "broadcast":
                src = dist.get_global_rank(group, root)
                work = dist.broadcast(self.flat, src=src, group=group, async_op=True)
            else:
                roots = [root] * len(self.spans) if isinstance(root, int) else root
                parts: list[Pending] = []
                with issued_together(group, self.device, parts):
                    for (start, numel), dst in zip(self.spans, roots):
                        dst = dist.get_global_rank(group, dst)
                        parts.append(Pending(dist.reduce(self.flat[start: start + numel], dst=dst,
                                                         group=group, async_op=True), ()))
                work = parts[0].work
                if any(p.work is not work for p in parts):  # one handle for the segments' works
                    work = _CoalescingManager()
                    for p in parts:
                        work.append(p.work)
        return Pending(work, (self.flat,), what, group)

    def view(self, i: int) -> torch.Tensor:
        """Tensor ``i``'s slot of ``flat``, in its shape."""
        start, numel = self.slots[i]
        return self.flat[start: start + numel].view(self.shapes[i])

    def views(self) -> list[torch.Tensor]:
        """Every tensor's slot of ``flat``, in its shape, in order."""
        return [self.view(i) for i in range(len(self.shapes))]

    def flag_values(self) -> list[float | None]:
        """Each tensor's flag read from ``flat`` (``None`` if unflagged); one host copy."""
        runs = [(start + numel - count, count)  # a segment's flags are its last elements
                for (start, numel), (count, flagged) in zip(self.spans, self.segments) if flagged]
        if not runs:
            return [None] * len(self.shapes)
        values = iter(torch.cat([self.flat[at: at + n] for at, n in runs]).tolist())
        return [None if at is None else next(values) for at in self.flag_at]


def _names(names: Callable[[], list[str]] | None) -> str:
    if names is None:
        return "a weight"
    listed = names()
    return f"{listed[:4]}{f' (+{len(listed) - 4} more)' if len(listed) > 4 else ''}"


_SAME_MODEL = ("Every rank must build the same model and pass the same predicate and plan to "
               "dedicate_params.")


def check_same_on_all_ranks(value: str, what: str, group: dist.ProcessGroup | None,
                            fix: str = _SAME_MODEL) -> None:
    """Raise RuntimeError on every rank (one all-gather) if the digest ``value`` differs
    between ranks of ``group``, naming the ranks that differ from rank 0; ``what`` names the
    digest, ``fix`` ends the message."""
    values = all_gather_object(value, group, f"the exchange of the {what}")
    bad = [r for r, v in enumerate(values) if v != values[0]]
    if bad:
        raise RuntimeError(
            f"dmuon: the {what} differs between ranks: rank 0 has {values[0][:16]}..., ranks "
            f"{bad} have {[str(values[r])[:16] + '...' for r in bad]}. {fix}"
        )
