"""Newton-Schulz behind compute: the owners' updates run after ``opt.step()`` returns.

``dmuon.Muon(model, overlap=...)`` (issue 39):

* ``"off"``: ``opt.step()`` runs momentum, Newton-Schulz and the master update of every owned
  matrix before it returns (:func:`dmuon.owners.update.muon_update_`).
* ``"forward"``: ``opt.step()`` runs the cheap part (momentum on the main thread, AdamW) and
  *schedules* each publish group's Newton-Schulz, master update and refresh of the owner's
  compute copy, in the order the units run forward; it returns at once. The publication of a
  group waits for that group's job only (:meth:`PendingSteps.wait_for`, called by
  :meth:`dmuon.hooks.unit.UnitContext.issue`), so unit 0's forward starts while unit 5's
  matrices are still being orthogonalized. On CUDA a job runs on a side stream and the
  publication's stream waits on its event (no host synchronisation); on CPU it runs on one
  worker thread (torch releases the GIL inside its ops).
* ``"backward"``: as ``"forward"``, and in the backward that precedes a step (with gradient
  sync on) the owners start each matrix's momentum and Newton-Schulz into *scratch* tensors
  (:func:`speculate`): a bucket's matrices as soon as its reduce-to-owner is seen complete
  while the backward goes on (polled, without blocking, whenever a later bucket is issued;
  not under HSDP, whose replica combine comes at the end), the rest at the end of backward.
  ``opt.step()`` keeps a result only when it would have computed the very same bits: the
  gradient is the same tensor at the same version (clipping, a GradScaler's unscale or user
  code bump it) or, for one started during backward, holds the very bits it started from
  (``torch.equal``), the momentum buffer is at the same version, and momentum, nesterov and
  the Newton-Schulz settings are unchanged (the learning rate and weight decay act after
  Newton-Schulz, so they may change). Otherwise it recomputes. :meth:`PendingSteps.stats`
  counts both.

Nothing outside sees a pending update: the next ``step()``, ``dmuon.clip_grad_norm_``,
``model.state_dict()`` / ``load_state_dict`` (and torch's state-dict and DCP APIs, which call
them), the optimizer's ``state_dict`` / ``load_state_dict`` and ``dmuon.state_dict`` /
``dmuon.load`` first call :meth:`PendingSteps.wait_all`. A job that fails re-raises on the main
thread at its wait, naming dmuon and the matrices.

Tensor parallelism orthogonalizes through collectives over the TP group; they cannot run on a
second thread beside the main thread's collectives in a fixed order, so a TP model steps as
with ``"off"`` (the mode is accepted and has no effect there). Expert parallelism overlaps like
any other layout: an expert group's publication waits for its own job as a dense one does.

Code that reads a dedicated parameter's tensor itself (``rec.master``, or a master found
through ``model.parameters()`` outside forward) between ``step()`` and the next forward sees it
mid-update; call :meth:`dmuon.Muon.wait_pending` first. (An earlier "race" under expert
parallelism was exactly that: a test helper read the owners' expert masters directly after the
last step.)
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from dmuon.owners.update import _orthogonalize_stacks, apply_update_, momentum_update_

OVERLAP_MODES = ("off", "forward", "backward")


def check_overlap(overlap: Any) -> str:
    """Return ``overlap`` if it is one of :data:`OVERLAP_MODES`.

    Raises:
        ValueError: naming the value and the choices.
    """
    if overlap not in OVERLAP_MODES:
        raise ValueError(f"dmuon: Muon(overlap={overlap!r}): overlap must be one of {OVERLAP_MODES} "
                         f"('off': Newton-Schulz inside opt.step(); 'forward': behind the next "
                         f"forward; 'backward': also started at the end of the last backward)")
    return overlap


@dataclass(eq=False)
class Job:
    """One scheduled piece of owner work: a worker-thread future (CPU) or a side-stream event
    (CUDA), the tensors it reads or writes (kept alive until waited), and what it does, for
    an error message."""

    what: str
    future: Future | None = None
    event: Any = None
    device: torch.device | None = None
    keep: tuple = ()

    def wait(self) -> None:
        """Block until done (CPU), or make the current stream wait on it (CUDA).

        Raises:
            RuntimeError: the job raised on the worker thread (chained).
        """
        if self.future is not None:
            try:
                self.future.result()
            except Exception as exc:  # re-raised on the main thread, by name
                raise RuntimeError(f"dmuon: the overlapped owner update of {self.what} failed on "
                                   f"dmuon's worker thread: {exc!r}. The masters of these matrices "
                                   f"may be half updated: restore the last checkpoint "
                                   f"(docs/failure.md).") from exc
        elif self.event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.event)
        self.keep = ()


@dataclass(eq=False)
class Speculation:
    """A momentum step and Newton-Schulz started at the end of a backward, for one master.

    Attributes:
        grad: the averaged gradient it read (identity checked at the step).
        grad_version, buf_version: their ``_version`` when it was started.
        settings: ``(momentum, nesterov, ns settings...)`` it used.
        new_buf: the momentum buffer it computed (scratch; committed only when kept).
        ortho: the orthogonalized update, shaped like the master (filled by the job).
        early: started during backward from the bucket's average (:func:`speculate` with
            ``early``): ``grad`` is that average's own copy, compared bit for bit at the step.
    """

    grad: torch.Tensor
    grad_version: int
    buf_version: int
    settings: tuple
    new_buf: torch.Tensor | None = None
    ortho: torch.Tensor | None = None
    early: bool = False


@dataclass(eq=False)
class PendingSteps:
    """Owner work scheduled by ``opt.step()`` (or the last backward) and not yet waited for.

    Attributes:
        jobs: by publish group (any hashable object the publication names): its job.
        speculations: by master: the backward's speculative result (``overlap="backward"``).
        early: the masters whose speculation this backward started during backward.
        kept, recomputed: speculative results used and discarded by ``step()``, summed over
            steps.
        scheduled: jobs :meth:`schedule` submitted, summed over steps (0: nothing overlapped).
        started_early: speculative results started during backward (``early``), summed.
    """

    jobs: dict[Any, Job] = field(default_factory=dict)
    spec_jobs: list[Job] = field(default_factory=list)
    speculations: dict[Any, Speculation] = field(default_factory=dict)
    early: set = field(default_factory=set)
    kept: int = 0
    recomputed: int = 0
    scheduled: int = 0
    started_early: int = 0
    _executor: ThreadPoolExecutor | None = None
    _streams: dict = field(default_factory=dict)

    def stats(self) -> dict[str, int]:
        """``{"kept": int, "recomputed": int}``, summed over steps."""
        return {"kept": self.kept, "recomputed": self.recomputed}

    def submit(self, fn: Callable[[], None], device: torch.device, what: str, keep: tuple = ()) -> Job:
        """Run ``fn`` (no autograd) behind the main thread: on CUDA on a side stream that first
        waits for the current stream; elsewhere on dmuon's one worker thread (jobs run in
        submission order)."""
        if device.type == "cuda":
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream), torch.no_grad():
                fn()
            event = torch.cuda.Event()
            event.record(stream)
            return Job(what, event=event, device=device, keep=keep)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dmuon-overlap")
        return Job(what, future=self._executor.submit(_no_grad, fn), keep=keep)

    def schedule(self, key: Any, fn: Callable[[], None], device: torch.device, what: str,
                 keep: tuple = ()) -> None:
        """Submit ``fn`` as the job the publication of ``key`` waits for."""
        self.jobs[key] = self.submit(fn, device, what, keep)
        self.scheduled += 1

    def pending(self, key: Any) -> bool:
        """Whether ``key`` has a job not yet waited for."""
        return key in self.jobs

    def wait_for(self, keys: Any) -> None:
        """Wait for the jobs of ``keys`` (those that have one), in order."""
        if not self.jobs:
            return
        for key in keys:
            job = self.jobs.pop(key, None)
            if job is not None:
                job.wait()

    def wait_speculation(self) -> None:
        """Wait for the backward's speculative jobs."""
        while self.spec_jobs:
            self.spec_jobs.pop(0).wait()

    def wait_all(self) -> None:
        """Wait for every scheduled job (a reader of masters or optimizer state is next)."""
        self.wait_speculation()
        while self.jobs:
            self.jobs.pop(next(iter(self.jobs))).wait()

    def close(self) -> None:
        """Wait for everything, then stop the worker thread."""
        self.wait_all()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


def _no_grad(fn: Callable[[], None]) -> None:
    """Grad mode is thread-local: the worker thread turns it off itself."""
    with torch.no_grad():
        fn()


def speculation_settings(group: dict, ns_kwargs: dict) -> tuple:
    """What a speculative result depends on besides the gradient and the momentum buffer."""
    return (group["momentum"], group["nesterov"]) + tuple(
        (k, repr(v)) for k, v in sorted(ns_kwargs.items()))


def matches(spec: Speculation | None, grad: torch.Tensor, buf: torch.Tensor, settings: tuple) -> bool:
    """Whether ``spec`` computed exactly what ``step()`` would now (see the module doc)."""
    if spec is None or spec.ortho is None or buf._version != spec.buf_version or spec.settings != settings:
        return False
    if spec.early:  # its input was the bucket's average, copied: the gradient must be those bits
        return grad.shape == spec.grad.shape and grad.dtype == spec.grad.dtype and torch.equal(grad, spec.grad)
    # the same memory (spec.grad keeps it alive, so no other tensor can have taken its address;
    # dmuon.comm.owned_grad may hand out a new view of it) at the same version
    return (grad.data_ptr() == spec.grad.data_ptr() and grad.shape == spec.grad.shape
            and grad.stride() == spec.grad.stride() and grad._version == spec.grad_version)


def step_overlapped(pending: PendingSteps, hp: dict, items: list[tuple], pubs: list[Any],
                    ns_kwargs: dict, orthogonalize: Callable[[list[torch.Tensor]], list[torch.Tensor]]
                    ) -> int:
    """``opt.step()``'s Muon with ``overlap="forward"``/``"backward"``: momentum now (or a
    kept speculation's), then one job per publish group, in ``pubs``' order (forward order):
    Newton-Schulz of its matrices, their master update, and the owner's compute copy
    (``pub.copy_masters()``, the next publication's source).

    Only plain tensors reach the job (no DTensor dispatch off the main thread).

    Args:
        pending: the model's :class:`PendingSteps`.
        hp: the Muon param group (lr, weight_decay, momentum, nesterov, adjust_lr_fn).
        items: ``(master, grad, momentum buffer, record)`` of every owned matrix with a
            gradient; masters ``[rows, cols]`` (or a stack ``[k, rows, cols]``) fp32, full.
        pubs: this rank's owner publish groups, in forward order; each has ``members``
            (records) and ``copy_masters()``.
        ns_kwargs: the Newton-Schulz settings (compared by a speculation).
        orthogonalize: batched Newton-Schulz over a list of matrices.

    Returns:
        The number of matrices whose Newton-Schulz runs now (kept speculations excluded).
    """
    settings = speculation_settings(hp, ns_kwargs)
    ortho_of, update_of = {}, {}
    for master, grad, buf, rec in items:
        spec = pending.speculations.pop(master, None)
        if spec is not None and matches(spec, grad, buf, settings):
            buf.copy_(spec.new_buf)  # the speculation's momentum, committed only now
            ortho_of[rec] = spec.ortho
            pending.kept += 1
            continue
        if spec is not None:
            pending.recomputed += 1
        update_of[rec] = momentum_update_(grad, buf, momentum=hp["momentum"], nesterov=hp["nesterov"])
    pending.speculations.clear()
    master_of = {rec: master for master, _, _, rec in items}
    for pub in pubs:
        mine = [rec for rec in pub.members if rec in master_of]
        # the compute copy's plain local tensors, taken here: an expert-parallel compute weight
        # is a DTensor, and DTensor dispatch (to_local) is not for a second thread
        dsts, srcs = [rec.buffer for rec in pub.members], [rec.master for rec in pub.members]

        def job(pub=pub, mine=mine, dsts=dsts, srcs=srcs) -> None:
            todo = [rec for rec in mine if rec in update_of]
            if todo:
                outs = _orthogonalize_stacks([update_of[r] for r in todo], [r.matrix_shape for r in todo],
                                             orthogonalize)
                ortho_of.update(zip(todo, outs))
            for rec in mine:
                apply_update_(master_of[rec], ortho_of[rec], lr=hp["lr"], weight_decay=hp["weight_decay"],
                              adjust_lr_fn=hp["adjust_lr_fn"], shape=rec.matrix_shape)
            with torch.autograd._unsafe_preserve_version_counter(pub.flat):  # as pub.copy_masters()
                torch._foreach_copy_(dsts, srcs)

        what = f"{[r.fqn for r in mine][:4]} (owner rank {pub.owner})"
        pending.schedule(pub, job, pub.flat.device, what,
                         keep=tuple(update_of[r] for r in mine if r in update_of))
    return len(update_of)


def speculate(pending: PendingSteps, hp: dict, items: list[tuple], ns_kwargs: dict,
              orthogonalize: Callable[[list[torch.Tensor]], list[torch.Tensor]], early: bool = False) -> None:
    """A synced backward with ``overlap="backward"``: start each owned matrix's momentum step
    and Newton-Schulz into scratch tensors, one job for ``items`` (read by
    :func:`step_overlapped`, which keeps them only when :func:`matches`).

    With ``early``, during backward, once a bucket's reduce-to-owner has completed (``grad``:
    the owner's average, a copy :func:`dmuon.comm.grad_buckets.owned_averages`
    made); else at the end of backward, for the masters not started early in it.

    Args:
        items: ``(master, grad, momentum buffer, record)`` as in :func:`step_overlapped`.
    """
    pending.wait_for(list(pending.jobs))  # the last step's (done by now: the forward waited)
    settings = speculation_settings(hp, ns_kwargs)
    specs = []
    for master, grad, buf, rec in items:
        if not early and master in pending.early:
            continue  # started during this backward
        spec = Speculation(grad, grad._version, buf._version, settings, early=early)
        pending.speculations[master] = spec
        specs.append((spec, grad, buf, rec))
        if early:
            pending.early.add(master)
            pending.started_early += 1
    if not early:
        pending.early.clear()  # the next backward starts afresh
    if not specs:
        return

    def job() -> None:
        updates = []
        for spec, grad, buf, _ in specs:
            spec.new_buf = buf.lerp(grad, 1 - hp["momentum"])
            updates.append(grad.lerp(spec.new_buf, hp["momentum"]) if hp["nesterov"] else spec.new_buf)
        outs = _orthogonalize_stacks(updates, [rec.matrix_shape for _, _, _, rec in specs], orthogonalize)
        for (spec, _, _, _), out in zip(specs, outs):
            spec.ortho = out

    pending.spec_jobs.append(pending.submit(job, specs[0][1].device, "the speculative Newton-Schulz "
                                            f"of {[rec.fqn for _, _, _, rec in specs][:4]}"))


__all__ = ["OVERLAP_MODES", "PendingSteps", "Speculation", "check_overlap", "matches",
           "speculation_settings"]
