"""Newton-Schulz behind compute: the owners' updates run after ``opt.step()`` returns.

``dmuon.Muon(model, overlap=...)``:

* ``"off"``: ``opt.step()`` runs the whole update (:func:`dmuon.owners.update.muon_update_`).
* ``"forward"``: ``opt.step()`` runs the momentum step and AdamW and schedules one job per
  publish group (Newton-Schulz, master update, compute copy; :func:`step_overlapped`), on a
  CUDA side stream or one CPU worker thread; a publication waits for its own job only.
* ``"backward"``: also, a synced backward starts momentum and Newton-Schulz on copies
  (:func:`speculate`), kept only if bit-identical to the step's input (:func:`take_proven`).

Every reader of masters or optimizer state first calls :meth:`PendingSteps.wait_all`. A TP
model steps as with ``"off"`` (its Newton-Schulz is collective over the TP group).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from dmuon.owners.update import MuonHyper, muon_finish_, muon_momentum_, orthogonalize_updates

OVERLAP_MODES = ("off", "forward", "backward")


def check_overlap(overlap: Any) -> str:
    """Return ``overlap`` if it is one of :data:`OVERLAP_MODES`, else raise ValueError."""
    if overlap not in OVERLAP_MODES:
        raise ValueError(f"dmuon: Muon(overlap={overlap!r}): overlap must be one of {OVERLAP_MODES} "
                         f"('off': Newton-Schulz inside opt.step(); 'forward': behind the next "
                         f"forward; 'backward': also started at the end of the last backward)")
    return overlap


@dataclass(eq=False)
class Job:
    """One scheduled piece of owner work: a worker-thread future (CPU) or a side-stream event
    (CUDA), the tensors it uses (kept alive until waited), and an error to raise at :meth:`wait`."""

    what: str
    future: Future | None = None
    event: Any = None
    device: torch.device | None = None
    keep: tuple = ()
    error: BaseException | None = None

    def wait(self) -> None:
        """Block until done (CPU), or make the current stream wait on it (CUDA); a RuntimeError
        naming the matrices (chained) if the job raised."""
        error = self.error
        self.error = None
        if self.future is not None:
            try:
                self.future.result()
            except Exception as exc:  # re-raised on the main thread, by name
                error = exc
            self.future = None
        elif self.event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.event)
            self.event = None
        self.keep = ()
        if error is not None:
            where = "dmuon's worker thread" if self.device is None else "the side stream"
            raise RuntimeError(f"dmuon: rank {_rank()}: the overlapped owner update of {self.what} failed "
                               f"on {where}: {error!r}. The masters of these matrices may be half "
                               f"updated: restore the last checkpoint (docs/failure.md).") from error


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


@dataclass(eq=False)
class Speculation:
    """A momentum step (on a copy of the buffer) and Newton-Schulz of one owned master, started
    in a backward: ``update`` the NS input, ``ortho`` its result (filled by ``job``),
    ``discarded`` set when the proof fails (a job not yet started skips it)."""

    update: torch.Tensor
    layout: Any
    ns: tuple
    ortho: torch.Tensor | None = None
    discarded: bool = False
    job: Any = None


@dataclass(eq=False)
class PendingSteps:
    """Owner work scheduled by ``opt.step()`` (or the last backward) and not yet waited for.

    Attributes:
        jobs: by publish group: its job.
        speculations: by master: the backward's speculative result (``overlap="backward"``).
        early: the masters whose speculation started during this backward.
        kept, recomputed, started_early: speculative results used, discarded, and started
            during backward, summed over steps.
        defer_failures: a job failing on the way to a publication is recorded in ``failure``,
            not raised, so every rank raises together at the next step check; readers raise.
        failure: the first failed job's error message on this rank, or ``None``.
    """

    jobs: dict[Any, Job] = field(default_factory=dict)
    spec_jobs: list[Job] = field(default_factory=list)
    speculations: dict[Any, Speculation] = field(default_factory=dict)
    early: set = field(default_factory=set)
    kept: int = 0
    recomputed: int = 0
    started_early: int = 0
    defer_failures: bool = False
    failure: str | None = None
    _executor: ThreadPoolExecutor | None = None
    _streams: dict = field(default_factory=dict)
    _publish_streams: dict = field(default_factory=dict)
    _spec_streams: dict = field(default_factory=dict)

    def stats(self) -> dict[str, int]:
        """``{"kept": int, "recomputed": int}``, summed over steps."""
        return {"kept": self.kept, "recomputed": self.recomputed}

    def submit(self, fn: Callable[[], None], device: torch.device, what: str, keep: tuple = (),
               speculative: bool = False) -> Job:
        """Run ``fn`` (no autograd) behind the main thread: on CUDA on a side stream after the
        current stream's work (``speculative`` on its own stream, so that a step's jobs never
        queue behind a discarded speculation); elsewhere on one worker thread."""
        if device.type == "cuda":
            streams = self._spec_streams if speculative else self._streams
            stream = streams.get(device)
            if stream is None:
                stream = streams[device] = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            for t in keep:  # made on the compute stream, read here: not reused before this stream
                if isinstance(t, torch.Tensor) and t.is_cuda:  # is past them (caching allocator)
                    t.record_stream(stream)
            error = None
            with torch.cuda.stream(stream), torch.no_grad():
                try:
                    fn()
                except Exception as exc:  # raised at the job's wait, like a worker thread's
                    error = exc
            event = torch.cuda.Event()
            event.record(stream)
            return Job(what, event=event, device=device, keep=keep, error=error)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dmuon-overlap")
        # torch.no_grad() as a decorator: grad mode is thread-local, set in the worker thread
        return Job(what, future=self._executor.submit(torch.no_grad()(fn)), keep=keep)

    def schedule(self, key: Any, fn: Callable[[], None], device: torch.device, what: str,
                 keep: tuple = ()) -> None:
        """Submit ``fn`` as the job the publication of ``key`` waits for (bench/stream_recorder.py
        wraps it)."""
        self.jobs[key] = self.submit(fn, device, what, keep)

    def pending(self, key: Any) -> bool:
        """Whether ``key`` has a job not yet waited for."""
        return key in self.jobs

    def done(self, key: Any) -> bool:
        """Whether ``key``'s publication can go out without blocking the host: no job, a
        finished worker-thread job, or a CUDA job (its stream orders the broadcast after it)."""
        job = self.jobs.get(key)
        return job is None or job.future is None or job.future.done()

    def stream_for(self, keys: Any) -> Any:
        """A publication stream for the broadcasts of ``keys`` when one has a CUDA job, else
        ``None``; not the jobs' side stream, where a broadcast would wait for every earlier job."""
        for key in keys:
            job = self.jobs.get(key)
            if job is not None and job.event is not None:
                stream = self._publish_streams.get(job.device)
                if stream is None:
                    stream = self._publish_streams[job.device] = torch.cuda.Stream(job.device)
                return stream
        return None

    def wait_for(self, keys: Any) -> None:
        """Wait for the jobs of ``keys`` (those that have one), in order, on the way to their
        publication: a failure is deferred to the next step check (``defer_failures``)."""
        if not self.jobs:
            return
        for key in keys:
            job = self.jobs.pop(key, None)
            if job is not None:
                self._wait(job, defer=self.defer_failures)

    def _wait(self, job: Job, defer: bool) -> None:
        """Wait for ``job``; keep the first failure, raised now unless ``defer`` (then posted to
        the c10d store as ``dmuon/failure/<rank>`` for the other ranks' step-check error)."""
        try:
            job.wait()
        except RuntimeError as exc:
            if not defer:
                self.failure = self.failure or str(exc)
                raise
            if self.failure is not None:
                return
            self.failure = str(exc)
            if dist.is_available() and dist.is_initialized():
                try:
                    dist.distributed_c10d._get_default_store().set(f"dmuon/failure/{dist.get_rank()}",
                                                                   self.failure)
                except Exception:  # noqa: BLE001 - a message for others; the flag is what fails them
                    pass

    def retire_speculation(self) -> None:
        """Forget the speculative jobs that have finished (re-raising a failure), without
        waiting for the others."""
        running = []
        for job in self.spec_jobs:
            if job.future is None:  # CUDA: ordered on the side stream; nothing to re-raise
                continue
            if job.future.done():
                self._wait(job, defer=self.defer_failures)
            else:
                running.append(job)
        self.spec_jobs = running

    def clear_speculations(self) -> None:
        """Drop every speculative result (a state dict was loaded: the buffers are new)."""
        for spec in self.speculations.values():
            spec.discarded = True
        self.speculations.clear()
        self.early.clear()

    def wait_all(self) -> None:
        """Wait for every scheduled job (a reader of masters or optimizer state is next); a
        RuntimeError if a job failed, now or earlier."""
        while self.spec_jobs:
            self._wait(self.spec_jobs.pop(0), defer=False)
        while self.jobs:
            self._wait(self.jobs.pop(next(iter(self.jobs))), defer=False)
        if self.failure is not None:
            raise RuntimeError(self.failure)


def same_bits(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[bool]:
    """For each ``(a, b)``: whether they have the same shape, dtype and bits (``-0.0`` is not
    ``0.0``, a NaN equals only the same NaN), with one host synchronisation for all pairs."""
    flags: list[Any] = []
    for a, b in pairs:
        if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
            flags.append(False)
        else:
            ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
            flags.append(torch.eq(a.contiguous().view(ints), b.contiguous().view(ints)).all())
    tensors = [f for f in flags if isinstance(f, torch.Tensor)]
    values = iter(torch.stack(tensors).tolist() if tensors else [])
    return [next(values) if isinstance(f, torch.Tensor) else f for f in flags]


def take_proven(pending: PendingSteps, masters: list[torch.Tensor], updates: list[torch.Tensor],
                layouts: list[Any], hp: MuonHyper) -> dict[int, Speculation]:
    """The speculations ``step()`` keeps, by index into ``masters``: same Newton-Schulz input bit
    for bit, same settings and layout. The others are discarded."""
    found = [(i, pending.speculations.pop(m, None)) for i, m in enumerate(masters)]
    found = [(i, spec) for i, spec in found if spec is not None]
    pending.clear_speculations()  # the rest: speculated, but no gradient at the step
    alike = [spec.ns == hp.ns and spec.layout == layouts[i] for i, spec in found]
    bits = same_bits([(updates[i], spec.update) for (i, spec), ok in zip(found, alike) if ok])
    flags = iter(bits)
    kept: dict[int, Speculation] = {}
    for (i, spec), ok in zip(found, alike):
        if ok and next(flags):
            kept[i] = spec
            pending.kept += 1
        else:
            spec.discarded = True
            pending.recomputed += 1
    return kept


def step_overlapped(pending: PendingSteps, hp: MuonHyper, items: list[tuple], layouts: list[Any],
                    pubs: list[Any], scale_master: Callable[[Any, torch.Tensor], None] | None = None) -> None:
    """``opt.step()``'s Muon with ``overlap="forward"``/``"backward"``: the momentum step now,
    then one job per publish group, in forward order: Newton-Schulz (or a proven speculation's
    result), :func:`dmuon.owners.update.muon_finish_`, QK-clip scaling and the compute copy.
    Only plain tensors and frozen records reach a job (no DTensor dispatch off the main thread).

    ``items``: ``(master, grad, momentum buffer, record)`` of every owned matrix with a
    gradient, masters fp32 ``[rows, cols]`` or ``[k, rows, cols]``; ``layouts`` their
    :class:`dmuon.owners.update.MatrixLayout`; ``pubs`` this rank's owner publish groups in
    forward order; ``scale_master(record, master)``: QK-clip's, before the compute copy, or None.
    """
    masters = [item[0] for item in items]
    bufs = [item[2] for item in items]
    updates = muon_momentum_([item[1] for item in items], bufs, hp)
    kept = take_proven(pending, masters, updates, layouts, hp)
    index_of = {item[3]: i for i, item in enumerate(items)}
    ns = hp.orthogonalizer()
    for pub in pubs:
        mine = [index_of[rec] for rec in pub.members if rec in index_of]
        # the compute copy's plain local tensors, taken here: an expert-parallel compute weight
        # is a DTensor, and DTensor dispatch (to_local) is not for a second thread
        dsts, srcs = [rec.buffer for rec in pub.members], [rec.master for rec in pub.members]
        todo = [i for i in mine if i not in kept]
        specs = {i: kept[i] for i in mine if i in kept}
        work = dict(updates=[updates[i] for i in todo], layouts=[layouts[i] for i in todo])

        def job(pub=pub, mine=mine, todo=todo, specs=specs, work=work, dsts=dsts, srcs=srcs) -> None:
            ortho = dict(zip(todo, orthogonalize_updates(work["updates"], work["layouts"], ns)))
            for i, spec in specs.items():
                if spec.job is not None and spec.job.event is not None:  # CUDA: its own stream
                    torch.cuda.current_stream(spec.job.device).wait_event(spec.job.event)
                if spec.ortho is None:  # its job failed (raised where it is waited) or never ran
                    raise RuntimeError(f"dmuon: the kept speculative Newton-Schulz of "
                                       f"{items[i][3].fqn!r} has no result")
                ortho[i] = spec.ortho
            muon_finish_([masters[i] for i in mine], [ortho[i] for i in mine], [bufs[i] for i in mine],
                         [layouts[i] for i in mine], hp)
            if scale_master is not None:
                for i in mine:
                    scale_master(items[i][3], masters[i])
            with torch.autograd._unsafe_preserve_version_counter(pub.flat):  # as pub.copy_masters()
                torch._foreach_copy_(dsts, srcs)

        what = f"{[items[i][3].fqn for i in mine][:4]} (owner rank {pub.owner})"
        pending.schedule(pub, job, pub.flat.device, what, keep=tuple(work["updates"]))


def speculate(pending: PendingSteps, hp: MuonHyper, items: list[tuple], layouts: list[Any],
              early: bool = False) -> None:
    """A synced backward with ``overlap="backward"``: each owned matrix's momentum step into a
    copy of its buffer, and one job orthogonalizing them all (read by :func:`take_proven`).
    ``early``: during backward, once a bucket's reduce-to-owner is done; else at its end, for
    the masters not started early. ``items`` and ``layouts`` as in :func:`step_overlapped`."""
    pending.wait_for(list(pending.jobs))  # the last step's (its jobs may write the buffers)
    chosen = [(item, lay) for item, lay in zip(items, layouts) if early or item[0] not in pending.early]
    if not early:
        pending.early.clear()  # the next synced backward starts afresh
    if not chosen:
        return
    updates = muon_momentum_([item[1] for item, _ in chosen], [item[2].clone() for item, _ in chosen], hp)
    specs = [Speculation(u, lay, hp.ns) for u, (_, lay) in zip(updates, chosen)]
    for (item, _), spec in zip(chosen, specs):
        old = pending.speculations.get(item[0])
        if old is not None:
            old.discarded = True
        pending.speculations[item[0]] = spec
        if early:
            pending.early.add(item[0])
            pending.started_early += 1
    ns = hp.orthogonalizer()

    def job() -> None:
        live = [spec for spec in specs if not spec.discarded]
        if not live:
            return  # step() has already recomputed them all
        outs = orthogonalize_updates([s.update for s in live], [s.layout for s in live], ns)
        for spec, out in zip(live, outs):
            spec.ortho = out

    what = f"the speculative Newton-Schulz of {[item[3].fqn for item, _ in chosen][:4]}"
    handle = pending.submit(job, updates[0].device, what, keep=tuple(updates), speculative=True)
    for spec in specs:
        spec.job = handle
    pending.spec_jobs.append(handle)

