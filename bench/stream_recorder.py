"""Bench-side instruments for ``Muon(overlap=...)`` (issue 46's GPU suite section): a recorder
of the CUDA stream (``None`` on CPU), thread and time at which each piece of the overlap runs,
a delay before every job, and the CUDA stream semantics of a real broadcast for the fake
process group's publications (``rank_view --stream-waits``). Each wraps dmuon's pieces for one
run and puts them back; the library is never changed."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Iterator

#: Delay before each job: ~2.3 ms of GPU time at 1.75 GHz (torch.cuda._sleep counts cycles),
#: 5 ms of sleep on the CPU worker thread; longer than a forward of the CUDA model's unit
#: (4 fp32 matmuls of 2048 x 1024 x 1024, ~0.4 ms on an H100), so that a unit that waits for a
#: later unit's job shows as a start after that job's end.
DELAY_CYCLES, DELAY_CPU_S = 4_000_000, 0.005


@contextlib.contextmanager
def delayed_jobs(device: str) -> Iterator[None]:
    """Every overlapped job starts late: ``torch.cuda._sleep`` on the side stream (CUDA) or a
    sleep on the worker thread (CPU). Restored on exit."""
    import torch

    from dmuon.owners.overlap import PendingSteps

    submit = PendingSteps.submit

    def slowed(self, fn, dev, what, keep=(), **kw):
        def late() -> None:
            if dev.type == "cuda":
                torch.cuda._sleep(DELAY_CYCLES)
            else:
                time.sleep(DELAY_CPU_S)
            fn()
        return submit(self, late, dev, what, keep, **kw)

    PendingSteps.submit = slowed
    try:
        yield
    finally:
        PendingSteps.submit = submit


@contextlib.contextmanager
def publication_events(enabled: bool) -> Iterator[None]:
    """``ViewConfig.stream_waits`` on CUDA: every publish group's issue records an event on the
    current stream (the publication stream when the group has an overlapped job, which has
    waited for that job's event; else the compute stream), and its first wait puts that event
    on the waiting stream, as a real NCCL broadcast's ``work.wait()`` does. Bench-side: dmuon's
    :class:`dmuon.hooks.unit.PublishGroup` is wrapped for the run and restored."""
    if not enabled:
        yield
        return
    import torch

    from dmuon.hooks.unit import PublishGroup

    issue, wait = PublishGroup.issue, PublishGroup.wait
    marks: dict[int, Any] = {}

    def issue_(self, group):
        work = issue(self, group)
        ev = torch.cuda.Event()
        ev.record()
        marks[id(self)] = ev
        return work

    def wait_(self) -> None:
        ev = marks.pop(id(self), None)
        if ev is not None:
            torch.cuda.current_stream().wait_event(ev)
        wait(self)

    PublishGroup.issue, PublishGroup.wait = issue_, wait_
    try:
        yield
    finally:
        PublishGroup.issue, PublishGroup.wait = issue, wait


class StreamRecorder:
    """Records, per event, the current CUDA stream (``None`` on CPU), the thread and a time mark
    where ``overlap``'s pieces run, by wrapping them for the run (bench-side; restored by
    :meth:`remove`), and labels them for ``torch.profiler``.

    Time marks are CUDA events recorded on the current stream (so a mark says when *that
    stream* got there, after whatever it was made to wait for) or ``time.perf_counter()`` on
    CPU; :meth:`timeline` reads them after the run.

    Attributes:
        events: dicts with ``kind`` (``submit``, ``job``, ``job_end``, ``job_wait``,
            ``publish``, ``unit_wait``, ``forward``, ``step``), ``stream``, ``thread`` and
            ``main_thread``, and per kind the job sequence number, origin, group and unit
            indices, and time mark.
    """

    def __init__(self, model, opt, device: str) -> None:
        import torch
        from torch.profiler import record_function

        import dmuon.hooks.unit as unit_mod
        from dmuon.hooks.step_check import in_autograd_backward
        from dmuon.owners.overlap import Job, PendingSteps

        self.cuda = device == "cuda"
        self.events: list[dict] = []
        self.marks: list[Any] = []
        self._lock = threading.Lock()  # the CPU worker thread marks too
        self.compute = self._stream()
        self._mark()  # mark 0: the origin of every time
        state = model._dmuon_state
        group_index = {id(g): i for i, g in enumerate(state.groups)}
        self.seq = 0
        self.job_of_group: dict[int, int] = {}  # group index -> its job's seq, until published
        self.step_jobs: list[int] = []  # seqs of the jobs the last step() scheduled (forward order)
        self.waited: dict[Any, list[int]] = {}  # stream (None: the host) -> jobs waited since the step
        self.side: set = set()
        self.pub_streams: set = set()
        rec = self
        submit, schedule, job_wait = PendingSteps.submit, PendingSteps.schedule, Job.wait
        issue_groups, unit_wait = unit_mod.issue_groups, unit_mod.Unit.wait
        self._restore = [(PendingSteps, "submit", submit), (PendingSteps, "schedule", schedule),
                         (Job, "wait", job_wait), (unit_mod, "issue_groups", issue_groups),
                         (unit_mod.Unit, "wait", unit_wait)]
        self._scheduling: int | None = None
        self._in_schedule = False
        self._origin: str | None = None  # "early" / "end_of_backward" while the backward submits

        def w_submit(pending, fn, dev, what, keep=(), **kw):
            seq = rec.seq = rec.seq + 1
            group = rec._scheduling
            origin = "step" if rec._in_schedule else (rec._origin or "other")
            # when the submitting stream (CUDA) or the host (CPU) got there: a job can start no
            # earlier; it starts later if the side stream / worker thread is still busy
            rec._log("submit", seq=seq, group=group, origin=origin, mark=rec._mark())

            def job() -> None:
                rec._log("job", seq=seq, group=group)
                with record_function(f"overlap_bench::job#{seq} " + (f"group {group}" if group is not None
                                                                      else f"speculation ({origin})")):
                    fn()
                rec._log("job_end", seq=seq, group=group, mark=rec._mark())
            handle = submit(pending, job, dev, what, keep, **kw)
            handle.bench_seq = seq  # Job is a plain dataclass: read back by w_job_wait
            if dev.type == "cuda":  # the jobs' side stream, or the speculations' own
                streams = pending._spec_streams if kw.get("speculative") else pending._streams
                rec.side.add(streams[dev].stream_id)
            return handle

        def w_schedule(pending, key, fn, dev, what, keep=()):
            rec._scheduling, rec._in_schedule = group_index.get(id(key)), True
            try:
                schedule(pending, key, fn, dev, what, keep)
            finally:
                rec.job_of_group[rec._scheduling] = rec.seq
                rec.step_jobs.append(rec.seq)
                rec._scheduling, rec._in_schedule = None, False

        def w_job_wait(job):
            # CUDA: the current stream is made to wait (it is ordered behind the job from now
            # on); CPU: the host blocks only if the worker thread has not finished it
            blocking = job.future is not None and not job.future.done()
            seq = getattr(job, "bench_seq", None)
            rec._log("job_wait", seq=seq, blocking=blocking)
            if seq is not None and (rec.cuda or blocking):
                rec.waited.setdefault(rec._stream(), []).append(seq)
            return job_wait(job)

        def w_issue_groups(groups, pg):
            stream = rec._stream()
            behind = set(rec.waited.get(stream, ())) & set(rec.step_jobs)
            rows = []
            for g in dict.fromkeys(groups):
                gi = group_index.get(id(g))
                own = rec.job_of_group.pop(gi, None)
                # the step's jobs of later groups (forward order = submission order) that this
                # publication is ordered behind: waited on its stream before it (CUDA), or
                # blocked on by the host before it (CPU). Unit k's forward waits for this.
                later = None if own is None else sorted(j for j in behind if j > own)
                rows.append((gi, own, later))
            if rec.cuda and any(own for _, own, _ in rows) and stream != rec.compute:
                rec.pub_streams.add(stream)
            for gi, own, later in rows:
                rec._log("publish", group=gi, job=own, later_jobs_before=None if later is None else len(later),
                         later_jobs=later, together=len(rows))
            with record_function("overlap_bench::publish " + "; ".join(
                    f"group {gi}" + (f" after job#{own}" + (f", behind later job(s) {later}" if later else "")
                                     if own else " (no job)") for gi, own, later in rows)):
                issue_groups(groups, pg)

        def w_unit_wait(unit):
            groups = [group_index.get(id(g)) for g in unit.groups]
            phase = "backward" if unit.in_backward or in_autograd_backward() else "forward"
            rec._log("unit_wait", unit=unit.index, groups=groups, phase=phase)
            with record_function(f"overlap_bench::unit{unit.index} {phase} waits on publication of groups "
                                 f"{groups}" + rec._behind_text(groups)):
                unit_wait(unit)

        PendingSteps.submit, PendingSteps.schedule, Job.wait = w_submit, w_schedule, w_job_wait
        unit_mod.issue_groups, unit_mod.Unit.wait = w_issue_groups, w_unit_wait
        bw = state.backward.speculator  # overlap="backward": who submits during / after backward
        for attr, origin in (("speculate_early", "early"), ("speculate", "end_of_backward")):
            fn = getattr(bw, attr, None) if bw is not None else None
            if fn is not None:
                self._restore.append((bw, attr, fn))
                setattr(bw, attr, self._tagged(fn, origin))

        def on_forward(unit) -> None:  # after dmuon's and FSDP2's pre-hooks: when compute starts
            if not (unit.in_backward or in_autograd_backward()):
                rec._log("forward", unit=unit.index, groups=[group_index.get(id(g)) for g in unit.groups],
                         mark=rec._mark())
        self._handles = [u.module.register_forward_pre_hook(lambda m, a, u=u: on_forward(u)) for u in state.units]
        self._handles.append(opt.register_step_pre_hook(lambda o, a, kw: rec._on_step()))

    def _tagged(self, fn, origin: str):
        def wrapped(*args, **kwargs):
            self._origin = origin
            try:
                return fn(*args, **kwargs)
            finally:
                self._origin = None
        return wrapped

    def _behind_text(self, groups: list) -> str:
        last = {e["group"]: e for e in self.events if e["kind"] == "publish"}
        parts = [f"group {g}: after job#{last[g]['job']}" + (f", behind later job(s) {last[g]['later_jobs']}"
                                                            if last[g]["later_jobs"] else "")
                 for g in groups if g in last and last[g]["job"]]
        return (" (" + "; ".join(parts) + ")") if parts else ""

    def _on_step(self) -> None:
        self._log("step", mark=self._mark())
        self.step_jobs = []
        self.waited = {}

    def _stream(self):
        import torch

        return torch.cuda.current_stream().stream_id if self.cuda else None

    def _mark(self) -> int:
        import torch

        if self.cuda:
            mark: Any = torch.cuda.Event(enable_timing=True)
            mark.record()
        else:
            mark = time.perf_counter()
        with self._lock:
            self.marks.append(mark)
            return len(self.marks) - 1

    def _log(self, kind: str, **kw: Any) -> None:
        t = threading.current_thread()
        self.events.append({"kind": kind, "stream": self._stream(), "thread": t.name,
                            "main_thread": t is threading.main_thread(), **kw})

    def remove(self) -> None:
        for owner, name, fn in self._restore:
            setattr(owner, name, fn)
        for h in self._handles:
            h.remove()

    def times_ms(self) -> list[float]:
        """Every mark in ms after mark 0 (CUDA: synchronizes the device first)."""
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            return [self.marks[0].elapsed_time(ev) for ev in self.marks]
        return [(t - self.marks[0]) * 1e3 for t in self.marks]

    def timeline(self) -> dict:
        """When each unit's compute started in the forwards after a step, against the ends of
        that step's jobs (run with :func:`delayed_jobs`, so each job outlasts a unit's forward):

        * ``unit_starts_after_its_own_job``: every unit started after its own groups' jobs
          ended (its publication waited for them: on CUDA through the publication stream and
          the broadcast's event; a start before is a missing wait, a race);
        * ``unit_starts_before_next_units_job_ends``: none waited for the next unit's job (for
          a later unit's Newton-Schulz: issue 46, review finding 1).

        Returns:
            ``{"rows": [{step, unit, start_ms, own_job_end_ms, next_job_end_ms}], "checks":
            {name: bool | None}}`` (``None``: nothing to check).
        """
        ms = self.times_ms()
        job_end = {e["seq"]: ms[e["mark"]] for e in self.events if e["kind"] == "job_end"}
        rows: list[dict] = []
        step, job_of = 0, {}
        forwards: list[dict] = []

        def close() -> None:
            for i, f in enumerate(forwards):
                own = [job_end[job_of[g]] for g in f["groups"] if job_of.get(g) in job_end]
                nxt = forwards[i + 1]["groups"] if i + 1 < len(forwards) else []
                later = [job_end[job_of[g]] for g in nxt if job_of.get(g) in job_end]
                rows.append({"step": step, "unit": f["unit"], "start_ms": ms[f["mark"]],
                             "own_job_end_ms": max(own, default=None), "next_job_end_ms": min(later, default=None)})

        for e in self.events:
            if e["kind"] == "step":
                if step:
                    close()
                step, forwards, job_of = step + 1, [], {}
            elif e["kind"] == "submit" and e.get("origin") == "step" and step:
                job_of[e["group"]] = e["seq"]
            elif e["kind"] == "forward" and step:
                forwards.append(e)
        if step:
            close()
        after = [r["start_ms"] >= r["own_job_end_ms"] for r in rows if r["own_job_end_ms"] is not None]
        before = [r["start_ms"] < r["next_job_end_ms"] for r in rows if r["next_job_end_ms"] is not None]
        return {"rows": rows, "checks": {"unit_starts_after_its_own_job": all(after) if after else None,
                                         "unit_starts_before_next_units_job_ends": all(before) if before else None}}

    def speculation_wait(self) -> list[dict]:
        """Per step: how long the speculative jobs submitted in the backward before it kept the
        side stream (CUDA) or the worker thread (CPU) busy after ``step()`` submitted its first
        job (``wait_ms``, >= 0; times as in :meth:`timeline`). With a clip that binds, every
        speculation is discarded and issue 46 wants the recompute not to wait for them."""
        ms = self.times_ms()
        job_end = {e["seq"]: ms[e["mark"]] for e in self.events if e["kind"] == "job_end"}
        rows: list[dict] = []
        specs: list[int] = []  # speculative jobs submitted since the last step (its backward's)
        cur: dict | None = None
        for e in self.events + [{"kind": "step"}]:  # a last "step" closes the last one
            if e["kind"] == "step":
                if cur is not None and cur["first"] is not None and cur["specs"]:
                    ends = [job_end[s] for s in cur["specs"] if s in job_end]
                    rows.append({"step": cur["step"], "speculative_jobs": len(cur["specs"]),
                                 "wait_ms": max(0.0, max(ends, default=0.0) - ms[cur["first"]["mark"]])})
                cur = {"step": (cur or {"step": 0})["step"] + 1, "specs": specs, "first": None}
                specs = []
            elif e["kind"] == "submit" and e["origin"] in ("early", "end_of_backward"):
                specs.append(e["seq"])
            elif e["kind"] == "submit" and e["origin"] == "step" and cur is not None and cur["first"] is None:
                cur["first"] = e
        return rows

    def verdicts(self) -> dict:
        """The stream assertions (CUDA), what ran where, and the ordering checks (both)."""
        ev = self.events
        by = {k: [e for e in ev if e["kind"] == k]
              for k in ("submit", "job", "job_wait", "publish", "unit_wait", "forward", "step")}
        counts = {k: len(v) for k, v in by.items()}
        origins = {o: [e for e in by["submit"] if e["origin"] == o] for o in ("step", "early", "end_of_backward")}
        with_job = [e for e in by["publish"] if e["job"]]
        out: dict[str, Any] = {
            "counts": counts, "submits_by_origin": {o: len(v) for o, v in origins.items()},
            "backward_submit_threads": sorted({e["thread"] for o in ("early", "end_of_backward") for e in origins[o]}),
            "job_threads": sorted({e["thread"] for e in by["job"]}),
            "max_later_jobs_before_a_publication": max((e["later_jobs_before"] for e in with_job), default=None),
            "largest_publication_call": max((e["together"] for e in by["publish"]), default=None)}
        checks: dict[str, bool | None] = {
            # issue 46, finding 1, read from the order of waits: no publication is ordered behind
            # a later unit's job (CUDA: its stream waited on it; CPU: the host blocked on it)
            "publication_behind_no_later_job": all(e["later_jobs_before"] == 0 for e in with_job) if with_job else None}
        if self.cuda:
            comp, side = self.compute, self.side

            def on(es, pred):
                return all(pred(e["stream"]) for e in es) if es else None
            checks.update({
                "jobs_on_side_stream": on(by["job"], lambda s: s in side and s != comp),
                "step_submits_from_compute_stream": on(origins["step"], lambda s: s == comp),
                "early_submits_from_compute_stream": on(origins["early"], lambda s: s == comp),
                "end_of_backward_submits_from_compute_stream": on(origins["end_of_backward"], lambda s: s == comp),
                # their own stream, which waits for the group's job event alone (not the side
                # stream, where a broadcast would queue behind every job submitted before it)
                "publications_with_job_on_publication_stream": on(with_job, lambda s: s not in side and s != comp),
                "publications_without_job_on_compute_stream": on([e for e in by["publish"] if not e["job"]],
                                                                 lambda s: s == comp),
                "forward_on_compute_stream": on(by["forward"], lambda s: s == comp),
                "unit_waits_on_compute_stream": on(by["unit_wait"], lambda s: s == comp),
                "step_on_compute_stream": on(by["step"], lambda s: s == comp),
            })
            out.update(compute_stream=comp, side_streams=sorted(side), publication_streams=sorted(self.pub_streams))
        tl = self.timeline()
        checks.update(tl["checks"])
        out.update(checks=checks, timeline=tl["rows"], speculation_wait=self.speculation_wait())
        return out

    def unit_waits(self) -> list[dict]:
        """What each unit's compute waited on, in order, from the first ``step()`` on: the
        publications of its groups, each with the job it was issued after and the jobs of
        later groups it was ordered behind (see ``later_jobs`` in :meth:`__init__`)."""
        last_pub: dict[int, dict] = {}
        rows = []
        stepped = False
        for e in self.events:
            stepped = stepped or e["kind"] == "step"
            if not stepped:
                continue
            if e["kind"] == "publish":
                last_pub[e["group"]] = e
            elif e["kind"] == "unit_wait":
                rows.append({"unit": e["unit"], "phase": e["phase"], "publications": [
                    {"group": g, "job": last_pub.get(g, {}).get("job"),
                     "later_jobs_before": last_pub.get(g, {}).get("later_jobs_before"),
                     "issued_with": last_pub.get(g, {}).get("together")} for g in e["groups"]]})
        return rows
