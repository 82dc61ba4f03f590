"""Bench-side instruments for ``Muon(overlap=...)`` (issue 46's GPU suite section): a recorder
of the CUDA stream (``None`` on CPU) and thread each piece of the overlap runs on, and a delay
before every job. Both wrap dmuon's pieces for one run and put them back; the library is never
changed."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Iterator

#: Delay before each job: ~2.3 ms of GPU time at 1.75 GHz (torch.cuda._sleep counts cycles),
#: 5 ms of sleep on the CPU worker thread; longer than a forward of the CUDA model's unit.
DELAY_CYCLES, DELAY_CPU_S = 4_000_000, 0.005


@contextlib.contextmanager
def delayed_jobs(device: str) -> Iterator[None]:
    """Every overlapped job starts late: ``torch.cuda._sleep`` on the side stream (CUDA) or a
    sleep on the worker thread (CPU). Restored on exit."""
    import torch

    from dmuon.owners.overlap import PendingSteps

    submit = PendingSteps.submit

    def slowed(self, fn, dev, what, keep=()):
        def late() -> None:
            if dev.type == "cuda":
                torch.cuda._sleep(DELAY_CYCLES)
            else:
                time.sleep(DELAY_CPU_S)
            fn()
        return submit(self, late, dev, what, keep)

    PendingSteps.submit = slowed
    try:
        yield
    finally:
        PendingSteps.submit = submit


class StreamRecorder:
    """Records, per event, the current CUDA stream (``None`` on CPU) and thread where
    ``overlap``'s pieces run, by wrapping them for the run (bench-side; restored by
    :meth:`remove`), and labels them for ``torch.profiler``.

    Attributes:
        events: dicts with ``kind`` (``submit``, ``job``, ``publish``, ``unit_wait``,
            ``forward``, ``step``), ``stream``, ``thread`` and ``main_thread``, and per kind
            the job sequence number, group and unit indices.
    """

    def __init__(self, model, opt, device: str) -> None:
        import torch
        from torch.profiler import record_function

        import dmuon.hooks.unit as unit_mod
        from dmuon.hooks.step_check import in_autograd_backward
        from dmuon.owners.overlap import PendingSteps

        self.cuda = device == "cuda"
        self.events: list[dict] = []
        self.compute = self._stream()
        state = model._dmuon_state
        group_index = {id(g): i for i, g in enumerate(state.groups)}
        self.seq = 0
        self.job_of_group: dict[int, int] = {}  # group index -> its job's seq, until published
        self.step_jobs: list[int] = []  # seqs of the jobs the last step() scheduled (forward order)
        self.side: set = set()
        rec = self
        submit, schedule = PendingSteps.submit, PendingSteps.schedule
        issue_groups, unit_wait = unit_mod.issue_groups, unit_mod.Unit.wait
        self._restore = [(PendingSteps, "submit", submit), (PendingSteps, "schedule", schedule),
                         (unit_mod, "issue_groups", issue_groups), (unit_mod.Unit, "wait", unit_wait)]
        self._scheduling: int | None = None

        def w_submit(pending, fn, dev, what, keep=()):
            seq = rec.seq = rec.seq + 1
            group = rec._scheduling
            rec._log("submit", seq=seq, group=group, speculation=group is None)

            def job() -> None:
                rec._log("job", seq=seq, group=group)
                with record_function(f"overlap_bench::job#{seq} " + (f"group {group}" if group is not None
                                                                      else "speculation")):
                    fn()
            job_handle = submit(pending, job, dev, what, keep)
            if dev.type == "cuda":
                rec.side.add(pending._streams[dev].stream_id)
            return job_handle

        def w_schedule(pending, key, fn, dev, what, keep=()):
            rec._scheduling = group_index.get(id(key))
            try:
                schedule(pending, key, fn, dev, what, keep)
            finally:
                rec.job_of_group[rec._scheduling] = rec.seq
                rec.step_jobs.append(rec.seq)
                rec._scheduling = None

        def w_issue_groups(groups, pg):
            rows = []
            for g in dict.fromkeys(groups):
                gi = group_index.get(id(g))
                own = rec.job_of_group.pop(gi, None)
                # the jobs step() submitted after this group's (later groups in forward order):
                # on CUDA a broadcast issued on the jobs' side stream would wait for them all;
                # dmuon issues it on a publication stream that waits for its own job's event
                ahead = [j for j in rec.step_jobs if own is not None and j > own]
                rows.append((gi, own, ahead))
            for gi, own, ahead in rows:
                rec._log("publish", group=gi, job=own, later_jobs_before=len(ahead))
            with record_function("overlap_bench::publish " + "; ".join(
                    f"group {gi}" + (f" after job#{own}, {len(ahead)} later jobs before it" if own else " (no job)")
                    for gi, own, ahead in rows)):
                issue_groups(groups, pg)

        def w_unit_wait(unit):
            groups = [group_index.get(id(g)) for g in unit.groups]
            phase = "backward" if unit.in_backward or in_autograd_backward() else "forward"
            rec._log("unit_wait", unit=unit.index, groups=groups, phase=phase)
            with record_function(f"overlap_bench::unit{unit.index} {phase} waits on publication of groups {groups}"):
                unit_wait(unit)

        PendingSteps.submit, PendingSteps.schedule = w_submit, w_schedule
        unit_mod.issue_groups, unit_mod.Unit.wait = w_issue_groups, w_unit_wait
        self._handles = [u.module.register_forward_pre_hook(
            lambda m, a, k=u.index: rec._log("forward", unit=k)) for u in state.units]
        self._handles.append(opt.register_step_pre_hook(lambda o, a, kw: rec._on_step()))

    def _on_step(self) -> None:
        self._log("step")
        self.step_jobs = []

    def _stream(self):
        import torch

        return torch.cuda.current_stream().stream_id if self.cuda else None

    def _log(self, kind: str, **kw: Any) -> None:
        t = threading.current_thread()
        self.events.append({"kind": kind, "stream": self._stream(), "thread": t.name,
                            "main_thread": t is threading.main_thread(), **kw})

    def remove(self) -> None:
        for owner, name, fn in self._restore:
            setattr(owner, name, fn)
        for h in self._handles:
            h.remove()

    def verdicts(self) -> dict:
        """The stream assertions (CUDA) or what ran where (CPU), from :attr:`events`."""
        ev = self.events
        by = {k: [e for e in ev if e["kind"] == k] for k in ("submit", "job", "publish", "unit_wait", "forward", "step")}
        counts = {k: len(v) for k, v in by.items()}
        early = [e for e in by["submit"] if e["speculation"] and not e["main_thread"]]
        out: dict[str, Any] = {"counts": counts, "early_submits_off_main_thread": len(early),
                               "job_threads": sorted({e["thread"] for e in by["job"]}),
                               "max_later_jobs_before_a_publication": max(
                                   (e["later_jobs_before"] for e in by["publish"] if e["job"]), default=None)}
        if not self.cuda:
            return out
        comp, side = self.compute, self.side
        with_job = [e for e in by["publish"] if e["job"]]
        checks = {
            "jobs_on_side_stream": all(e["stream"] in side and e["stream"] != comp for e in by["job"]),
            "submits_from_compute_stream": all(e["stream"] == comp for e in by["submit"]),
            "early_submits_from_compute_stream": all(e["stream"] == comp for e in early) if early else None,
            # their own stream, which waits for the group's job event alone (not the side stream)
            "publications_with_job_on_publication_stream": all(
                e["stream"] not in side and e["stream"] != comp for e in with_job) if with_job else None,
            "publications_without_job_on_compute_stream": all(
                e["stream"] == comp for e in by["publish"] if not e["job"]),
            "forward_on_compute_stream": all(e["stream"] == comp for e in by["forward"]),
            "unit_waits_on_compute_stream": all(e["stream"] == comp for e in by["unit_wait"]),
            "step_on_compute_stream": all(e["stream"] == comp for e in by["step"]),
            "publication_queued_behind_no_later_job": all(e["stream"] not in side for e in with_job),
        }
        out.update(checks=checks, compute_stream=comp, side_streams=sorted(side))
        return out

    def unit_waits(self) -> list[dict]:
        """What each unit's compute waited on, in order, from the first ``step()`` on: the
        publications of its groups, each with the job it was issued after and how many jobs of
        later groups were submitted before it (on CUDA: queued ahead of it on the side stream)."""
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
                     "later_jobs_before": last_pub.get(g, {}).get("later_jobs_before")} for g in e["groups"]]})
        return rows
