"""The GPU suite's ``overlap`` section (issue 46): does ``Muon(overlap=...)`` run on CUDA as the
code assumes, bit for bit, and how much Newton-Schulz (NS) does it hide?

One GPU, <= 3 minutes (:data:`BUDGET_S`), six items, each recorded as "met", "not met" or
"could not run" (with the reason), never with a figure that was not measured:

1. ``sanitizer``: ``TORCH_CUDA_SANITIZER=1`` (set before CUDA initializes: a subprocess) over 3
   steps of each mode (``off``, ``forward``, ``backward``) and of FSDP2 + AdamW alone (the
   control: what FSDP2 itself trips), world size 1 over NCCL; whether it flagged anything and
   its first lines.
2. ``streams``: where the code runs, recorded by wrapping (here, never in the library)
   :meth:`PendingSteps.submit`'s job, :meth:`PendingSteps.schedule`,
   :func:`dmuon.hooks.unit.issue_groups`, :meth:`Unit.wait`, the optimizer step and a forward
   pre-hook per unit: each job runs on the side stream; every submit (``step()``'s and the
   backward's early ones, on autograd's thread) is called from the compute stream; a
   publication of a group with a job goes out on the side stream, one without on the compute
   stream; forwards and ``step()`` run on the compute stream; and how many jobs of *later*
   units each publication is queued behind on the side stream (a stream runs in order, so
   the broadcast of unit k waits for every job submitted before it).
3. ``parity``: final weights after 4 steps (fp32 NS) of ``forward`` and ``backward`` against
   ``off``, bit for bit, also with every job delayed (``torch.cuda._sleep`` on the side stream,
   a sleep on CPU) so that a missing wait or a buffer freed too early shows; with the caching
   allocator on and off (``PYTORCH_NO_CUDA_MEMORY_CACHING=1``, a second subprocess). A second
   ``off`` run is the A/A control: if it differs, the model is not deterministic here and the
   verdict is "could not run".
4. ``peak_memory``: ``torch.cuda.max_memory_allocated`` over each mode's run (caching on).
5. ``exposed_ns``: the CUDA rank view (:mod:`rank_view`, torch's fake process group) at N = 8
   and 64 with ``dmuon``, ``dmuon-overlap-forward``, ``dmuon-overlap-backward`` and
   ``dmuon-no-ns``; exposed NS = whole step - ``dmuon-no-ns`` whole step, against issue 46's
   targets (``forward`` <= 0.1x and ``backward`` <= 0.2x the exposed NS with overlap off).
6. ``trace``: a ``torch.profiler`` chrome trace of 2 steps of ``overlap="forward"``
   (``overlap_trace.json.gz`` in the suite's output), in which every unit's wait is labelled
   ``overlap_bench::unit<k> <phase> waits on ...`` with the jobs its publication is queued
   behind, and every job and publication is labelled too.

Every item runs in a subprocess with its own time limit (:func:`_run_worker`), so one that
hangs or crashes costs its own result only. On CPU (the dry run) the parity runs on gloo at one
rank, the stream recorder and the trace run on the worker thread's path, the rank view runs at
tiny sizes, and the CUDA-only checks say why they could not run.

    python bench/gpu_suite.py --out /tmp/gpu --sections environment overlap   # one GPU, ~3 min
    python bench/gpu_overlap.py --task parity --device cpu --out /tmp/p.json  # one worker
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
MODES = ("off", "forward", "backward")
#: Seconds the section may take (full, --quick); gpu_suite.SECTIONS gives it 10 s more, so the
#: section writes its record before the suite's limit. The CPU dry run gets CPU_SCALE times more.
BUDGET_S = {False: 170.0, True: 110.0}
CPU_SCALE = 3.0
#: Each item's share of the budget, in run order (what an item leaves unused goes to the next):
#: a subprocess costs ~5 s to import torch and start CUDA and NCCL; the sanitizer runs every op
#: through Python; the rank view builds 4 models per N and runs 32 steps each.
SHARES = {"sanitizer": 0.25, "parity": 0.25, "parity_no_caching": 0.15, "rank_view": 0.35}
#: Model of the world-size-1 runs (InventoryModel, ``blocks`` FSDP2 units of ``per_block``
#: square matrices): on CUDA 32 matrices of 1024 x 1024 (fp32 NS ~4 ms on an H100), tokens
#: enough that forward is not all launch latency; tiny under the sanitizer and on CPU.
SIZES = {"cuda": dict(blocks=8, per_block=4, width=1024, batch=8, tokens=256),
         "sanitizer": dict(blocks=3, per_block=2, width=128, batch=2, tokens=16),
         "cpu": dict(blocks=3, per_block=2, width=32, batch=2, tokens=8)}
STEPS = 4
#: Delay before each job: ~2.3 ms of GPU time at 1.75 GHz (torch.cuda._sleep counts cycles),
#: 5 ms of sleep on the CPU worker thread; longer than a forward of the CUDA model's unit.
DELAY_CYCLES, DELAY_CPU_S = 4_000_000, 0.005
#: The rank view: the suite's 194 M Pi0-style policy (224-pixel image, 16 text tokens, 50
#: actions), 8 samples per rank as in issue 46's short-context example, bf16; tiny on CPU.
RANK_VIEW = {"cuda": ["--model", "gpu", "--batch-per-rank", "8", "--rounds", "2", "--block-steps", "2", "--bf16"],
             "cpu": ["--model", "blocks2", "--width", "32", "--blocks", "3", "--batch-per-rank", "1",
                     "--rounds", "1", "--block-steps", "1"]}
RANK_VIEW_VARIANTS = ("dmuon", "dmuon-overlap-forward", "dmuon-overlap-backward", "dmuon-no-ns")
#: issue 46's targets, as a fraction of the exposed NS with overlap off
EXPOSED_TARGETS = {"dmuon-overlap-forward": 0.1, "dmuon-overlap-backward": 0.2}
TRACE_FILE = "overlap_trace.json.gz"


# ============================================================================ worker side

def _init(device: str, store_path: str):
    """World size 1: NCCL on CUDA, gloo on CPU, a file store (no port to race for)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.FileStore(store_path, 1),
                            rank=0, world_size=1)
    return init_device_mesh(device, (1,))


def _build(mesh, device: str, size: dict, mode: str | None):
    """FSDP2 per block + dmuon with ``Muon(overlap=mode)`` (fp32 standard NS, Muon's
    coefficients), or FSDP2 + AdamW alone with ``mode=None``; the same weights every time."""
    import torch
    from torch.distributed.fsdp import fully_shard

    from inventory_model import InventoryModel, blocks_inventory

    torch.manual_seed(0)
    model = InventoryModel(blocks_inventory(size["blocks"], size["per_block"], size["width"])).to(device)
    for block in model.shardable_blocks():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if mode is None:
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)
    import dmuon

    dmuon.dedicate_params(model, mesh, group_cost=0.0)
    return model, dmuon.Muon(model, lr=0.02, adamw_lr=0.01, weight_decay=0.1, ns_method="standard",
                             ns_dtype=torch.float32, ns_coefficients="muon", overlap=mode)


def _batch(device: str, size: dict, step: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    return {"x": torch.randn(size["batch"], size["tokens"], size["width"], generator=g).to(device)}


def _train(model, opt, device: str, size: dict, steps: int) -> list[float]:
    losses = []
    for step in range(steps):
        loss = model(_batch(device, size, step))
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses


def _final_weights(model, opt) -> dict:
    """Every parameter after the pending updates: the owners' fp32 masters and FSDP2's full
    tensors, on the CPU."""
    opt.wait_pending()
    state = model._dmuon_state
    out = {rec.fqn: rec.master.detach().cpu().clone() for rec in state.records if rec.is_owner}
    for name, p in model.named_parameters():
        if name not in out:
            out[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().clone()
    return out


def _compare(a: dict, b: dict) -> dict:
    """Bitwise comparison of two weight dicts: how many differ, the largest absolute gap."""
    import torch

    differ = [k for k in a if a[k].shape != b[k].shape or not torch.equal(
        a[k].contiguous().view(torch.int32), b[k].contiguous().view(torch.int32))]
    gap = max((float((a[k].double() - b[k].double()).abs().max()) for k in differ if a[k].shape == b[k].shape),
              default=0.0)
    return {"tensors": len(a), "differ": len(differ), "first_differing": differ[:5], "max_abs_diff": gap}


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
                # one side stream runs its work in order: this broadcast, issued there after
                # its own job, also waits for every job step() submitted after that one (the
                # groups after this one in forward order)
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
            "publications_with_job_on_side_stream": all(e["stream"] in side for e in with_job) if with_job else None,
            "publications_without_job_on_compute_stream": all(
                e["stream"] == comp for e in by["publish"] if not e["job"]),
            "forward_on_compute_stream": all(e["stream"] == comp for e in by["forward"]),
            "unit_waits_on_compute_stream": all(e["stream"] == comp for e in by["unit_wait"]),
            "step_on_compute_stream": all(e["stream"] == comp for e in by["step"]),
            "publication_queued_behind_no_later_job": (out["max_later_jobs_before_a_publication"] or 0) == 0,
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


def task_parity(device: str, store: str, trace: str | None) -> dict:
    """World size 1: parity of every mode against ``off`` (and with delayed jobs), peak memory
    per mode (CUDA), the stream recorder (forward and backward) and, with ``trace``, the
    profiler trace of 2 ``forward`` steps."""
    import torch

    mesh = _init(device, store)
    size = SIZES["cuda" if device == "cuda" else "cpu"]
    cuda = device == "cuda"
    out: dict[str, Any] = {"size": size, "steps": STEPS, "caching_allocator": os.environ.get(
        "PYTORCH_NO_CUDA_MEMORY_CACHING") != "1", "runs": {}}
    weights = {}
    runs = [("off", "off", False), ("off_again", "off", False), ("forward", "forward", False),
            ("backward", "backward", False), ("forward_delayed", "forward", True),
            ("backward_delayed", "backward", True)]
    for name, mode, delayed in runs:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        model, opt = _build(mesh, device, size, mode)
        with delayed_jobs(device) if delayed else contextlib.nullcontext():
            losses = _train(model, opt, device, size, STEPS)
            weights[name] = _final_weights(model, opt)
        row: dict[str, Any] = {"mode": mode, "delayed_jobs": delayed, "losses": losses,
                               "kept_speculations": opt.overlap_stats()}
        if cuda:
            torch.cuda.synchronize()
            row["peak_bytes"] = torch.cuda.max_memory_allocated()
        row["started_early"] = model._dmuon_state.pending.started_early
        out["runs"][name] = row
        del model, opt
    for name in weights:
        if name != "off":
            out["runs"][name]["vs_off"] = _compare(weights["off"], weights[name])
            out["runs"][name]["losses_equal_off"] = out["runs"][name]["losses"] == out["runs"]["off"]["losses"]
    if out["caching_allocator"]:
        out["streams"] = {}
        for mode in ("forward", "backward"):
            model, opt = _build(mesh, device, size, mode)
            rec = StreamRecorder(model, opt, device)
            try:
                _train(model, opt, device, size, 3)
                opt.wait_pending()
            finally:
                rec.remove()
            out["streams"][mode] = {**rec.verdicts(), "unit_waits": rec.unit_waits()[:2 * size["blocks"]]}
            del model, opt
        if trace:
            out["trace"] = _trace(mesh, device, size, trace)
    return out


def _trace(mesh, device: str, size: dict, path: str) -> dict:
    """One warm-up step, then 2 profiled steps of ``overlap="forward"`` with the recorder's labels."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    model, opt = _build(mesh, device, size, "forward")
    _train(model, opt, device, size, 1)
    rec = StreamRecorder(model, opt, device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    try:
        with profile(activities=acts) as prof:
            _train(model, opt, device, size, 2)
            opt.wait_pending()
            if device == "cuda":
                torch.cuda.synchronize()
    finally:
        rec.remove()
    raw = Path(path).with_suffix("")  # .json
    prof.export_chrome_trace(str(raw))
    data = raw.read_bytes()
    Path(path).write_bytes(gzip.compress(data))
    raw.unlink()
    labels = sorted({e.get("name", "") for e in json.loads(data)["traceEvents"]
                     if str(e.get("name", "")).startswith("overlap_bench::unit")})
    return {"file": Path(path).name, "bytes": Path(path).stat().st_size, "unit_wait_labels": labels[:40],
            "unit_waits": rec.unit_waits()}


def task_sanitizer(device: str, store: str) -> dict:
    """Under ``TORCH_CUDA_SANITIZER=1``: FSDP2 + AdamW (control), then each mode, 3 steps each;
    per run whether the sanitizer raised and the first lines of what it found."""
    import torch

    enabled = bool(getattr(getattr(torch.cuda, "_sanitizer", None), "cuda_sanitizer", None)
                   and torch.cuda._sanitizer.cuda_sanitizer.enabled)
    mesh = _init(device, store)
    out: dict[str, Any] = {"sanitizer_enabled": enabled, "runs": {}}
    for name, mode in (("fsdp2_adamw_control", None), *((m, m) for m in MODES)):
        try:
            model, opt = _build(mesh, device, SIZES["sanitizer"], mode)
            _train(model, opt, device, SIZES["sanitizer"], 3)
            if mode is not None:
                opt.wait_pending()
            torch.cuda.synchronize()
            out["runs"][name] = {"flagged": False}
        except Exception as exc:  # noqa: BLE001 - the sanitizer's finding is the result
            errors = getattr(exc, "errors", None)
            text = "\n".join(str(e) for e in errors[:2]) if errors else f"{type(exc).__name__}: {exc}"
            out["runs"][name] = {"flagged": errors is not None, "errors": len(errors) if errors else None,
                                 "first_lines": text.splitlines()[:25],
                                 **({} if errors else {"raised_other": True})}
    return out


def task_rank_view(device: str, out_dir: str) -> dict:
    """The rank view at N = 8 and 64, one world after the other, each written as it ends."""
    import rank_view as rv

    res = {}
    for world in (8, 64):
        path = Path(out_dir) / f"rank_view_n{world}.json"
        cfg, _ = rv.parse_args(["--world", str(world), "--device", device, *RANK_VIEW[device],
                                "--variants", *RANK_VIEW_VARIANTS])
        res[f"n{world}"] = view = rv.run(cfg)
        path.write_text(json.dumps(view, default=str))
        if device == "cuda":
            import torch

            torch.cuda.empty_cache()
    return res


def worker_main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="one item of the overlap section, in its own process")
    p.add_argument("--task", choices=("parity", "sanitizer", "rank_view"), required=True)
    p.add_argument("--device", choices=("cuda", "cpu"), required=True)
    p.add_argument("--out", required=True, help="JSON result file (rank_view: a folder)")
    p.add_argument("--trace", default=None, help="parity: also write the profiler trace here (.json.gz)")
    a = p.parse_args(argv)
    sys.path[:0] = [str(BENCH), str(ROOT)]
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    with tempfile.TemporaryDirectory() as tmp:
        store = str(Path(tmp) / "store")
        if a.task == "parity":
            res = task_parity(a.device, store, a.trace)
        elif a.task == "sanitizer":
            res = task_sanitizer(a.device, store)
        else:
            res = task_rank_view(a.device, a.out)
    if a.task != "rank_view":
        Path(a.out).write_text(json.dumps(res, indent=1, default=str))


# ============================================================================ section side

def _run_worker(task: str, device: str, out: Path, timeout_s: float, env: dict | None = None,
                extra: tuple[str, ...] = ()) -> dict:
    """Run one worker in a fresh interpreter; ``{"status": "ok"|"error"|"timeout", ...}``."""
    t0 = time.perf_counter()
    cmd = [sys.executable, str(Path(__file__).resolve()), "--task", task, "--device", device, "--out", str(out),
           *extra]
    full_env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", **(env or {}))
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=max(timeout_s, 1))
    except subprocess.TimeoutExpired as exc:
        return {"status": "timeout", "seconds": time.perf_counter() - t0, "error": f"killed after {timeout_s:.0f} s",
                "output_tail": _text(exc.stdout)[-1500:] + _text(exc.stderr)[-3000:]}
    rec: dict[str, Any] = {"seconds": time.perf_counter() - t0, "returncode": proc.returncode,
                           "output_tail": (proc.stdout[-1500:] + proc.stderr[-3000:])}
    if proc.returncode == 0:
        rec["status"] = "ok"
    else:
        rec.update(status="error", error=(proc.stderr.strip().splitlines() or ["no output"])[-1][:300])
    return rec


def _text(x: Any) -> str:
    return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")


def _verdict(met: bool | None, reason: str = "") -> str:
    if met is None:
        return f"could not run: {reason}" if reason else "could not run"
    return "met" if met else "not met"


def overlap(opts) -> dict:
    """The section (see the module docstring); ``opts`` is ``gpu_sections.SuiteOptions``."""
    cuda = opts.torch_device().type == "cuda"
    device = "cuda" if cuda else "cpu"
    scale = 1.0 if cuda else CPU_SCALE
    deadline = time.perf_counter() + BUDGET_S[opts.quick] * scale
    work = Path(tempfile.mkdtemp(prefix="overlap_", dir=opts.work))
    items: dict[str, dict] = {}
    raw: dict[str, Any] = {}

    total = BUDGET_S[opts.quick] * scale
    order = list(SHARES) if cuda else ["parity", "rank_view"]

    def budget(name: str) -> float:
        """What is left, less the shares of the items after ``name``."""
        later = sum(SHARES[n] for n in order[order.index(name) + 1:])
        return deadline - time.perf_counter() - later * total

    # 1. sanitizer (CUDA only; a fresh process so the variable is read before CUDA starts)
    if cuda:
        res = _run_worker("sanitizer", device, work / "sanitizer.json", budget("sanitizer"),
                          env={"TORCH_CUDA_SANITIZER": "1"})
        raw["sanitizer_process"] = res
        if res["status"] == "ok":
            san = json.loads((work / "sanitizer.json").read_text())
            raw["sanitizer"] = san
            flagged = {n: r for n, r in san["runs"].items() if r["flagged"] or r.get("raised_other")}
            dmuon_flagged = [n for n in flagged if n in MODES]
            items["sanitizer"] = {
                "verdict": _verdict(None, "the sanitizer was not enabled in the subprocess") if not san[
                    "sanitizer_enabled"] else _verdict(not dmuon_flagged),
                "flagged_runs": sorted(flagged), "control_flagged": "fsdp2_adamw_control" in flagged,
                "first_lines": {n: r["first_lines"][:12] for n, r in flagged.items()}}
        else:
            items["sanitizer"] = {"verdict": _verdict(None, f"subprocess {res['status']}: {res.get('error')}"),
                                  "output_tail": res["output_tail"][-800:]}
    else:
        items["sanitizer"] = {"verdict": _verdict(None, "CPU dry run: TORCH_CUDA_SANITIZER checks CUDA streams")}

    # 2-4, 6: parity (+ peak memory, streams, trace) with the caching allocator; parity without
    trace_path = opts.out / TRACE_FILE
    res = _run_worker("parity", device, work / "parity.json", budget("parity"),
                      env={"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}, extra=("--trace", str(trace_path)))
    raw["parity_process"] = res
    par = json.loads((work / "parity.json").read_text()) if res["status"] == "ok" else None
    raw["parity"] = par
    par_nc = None
    if cuda:
        res_nc = _run_worker("parity", device, work / "parity_nc.json", budget("parity_no_caching"),
                             env={"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"})
        raw["parity_no_caching_process"] = res_nc
        par_nc = json.loads((work / "parity_nc.json").read_text()) if res_nc["status"] == "ok" else None
        raw["parity_no_caching"] = par_nc
    items["parity"] = _parity_item(par, res, "caching allocator on" if cuda else "CPU, gloo, 1 rank")
    items["parity_no_caching"] = (_parity_item(par_nc, raw["parity_no_caching_process"], "caching allocator off")
                                  if cuda else {"verdict": _verdict(None, "CPU dry run: no CUDA caching allocator")})
    items["streams"] = _streams_item(par, res, cuda)
    items["peak_memory"] = _peak_item(par, res, cuda)
    items["trace"] = ({"verdict": "written", "file": TRACE_FILE, "bytes": par["trace"]["bytes"],
                       "unit_waits": par["trace"]["unit_waits"][:24]}
                      if par and par.get("trace") else {"verdict": _verdict(None, f"parity process {res['status']}")})

    # 5. exposed NS on the rank view
    rv_dir = work / "rv"
    rv_dir.mkdir()
    res = _run_worker("rank_view", device, rv_dir, budget("rank_view"))
    raw["rank_view_process"] = res
    items["exposed_ns"] = _exposed_item(rv_dir, res, cuda)
    return {"device": device, "budget_s": BUDGET_S[opts.quick] * scale, "items": items,
            "processes": {k: {x: v.get(x) for x in ("status", "seconds", "error", "output_tail")}
                          for k, v in raw.items() if k.endswith("_process")},
            "parity_runs": {k: (v or {}).get("runs") for k, v in (("caching", par), ("no_caching", par_nc))}}


def _parity_item(par: dict | None, proc: dict, what: str) -> dict:
    if par is None:
        return {"verdict": _verdict(None, f"subprocess {proc['status']}: {proc.get('error')}"),
                "output_tail": proc.get("output_tail", "")[-800:]}
    runs = par["runs"]
    rows = {n: {"differ": r["vs_off"]["differ"], "of": r["vs_off"]["tensors"], "max_abs_diff": r["vs_off"]["max_abs_diff"],
                "losses_equal_off": r["losses_equal_off"], "kept_speculations": r["kept_speculations"],
                "started_early": r["started_early"]} for n, r in runs.items() if "vs_off" in r}
    if rows["off_again"]["differ"]:
        return {"verdict": _verdict(None, "off differs from off (the model is not deterministic here)"),
                "setting": what, "rows": rows}
    return {"verdict": _verdict(all(r["differ"] == 0 for r in rows.values())), "setting": what, "rows": rows}


def _streams_item(par: dict | None, proc: dict, cuda: bool) -> dict:
    if par is None or "streams" not in par:
        return {"verdict": _verdict(None, f"parity process {proc['status']}")}
    per_mode = par["streams"]
    if not cuda:
        return {"verdict": _verdict(None, "CPU dry run: no CUDA streams (the recorder ran on the worker "
                                          "thread's path)"), "modes": per_mode}
    checks: dict[str, Any] = {}
    for mode, v in per_mode.items():
        for k, ok in v["checks"].items():
            checks[f"{mode}: {k}"] = ok
    met = all(ok is not False for ok in checks.values())
    return {"verdict": _verdict(met), "checks": checks,
            "not_met": [k for k, ok in checks.items() if ok is False],
            "not_exercised": [k for k, ok in checks.items() if ok is None],
            "modes": {m: {k: v[k] for k in v if k != "checks"} for m, v in per_mode.items()}}


def _peak_item(par: dict | None, proc: dict, cuda: bool) -> dict:
    if not cuda:
        return {"verdict": _verdict(None, "CPU dry run: torch.cuda.max_memory_allocated needs CUDA")}
    if par is None:
        return {"verdict": _verdict(None, f"parity process {proc['status']}")}
    peaks = {n: r["peak_bytes"] for n, r in par["runs"].items() if n in MODES}
    return {"verdict": "measured (no target)", "peak_bytes": peaks,
            "over_off": {m: peaks[m] / peaks["off"] for m in peaks if peaks["off"]}}


def _exposed_item(rv_dir: Path, proc: dict, cuda: bool) -> dict:
    out: dict[str, Any] = {"note": (
        "fake process group: a fake broadcast puts nothing on any stream, so the compute stream "
        "never waits for a publication and the rank view measures contention between the side "
        "stream's NS and the compute, not the waits of a real job (phase times synchronize the "
        "whole device, so NS still running at a phase end is counted)") if cuda else "CPU dry run, tiny model"}
    met_all: list[bool | None] = []
    for world in (8, 64):
        path = rv_dir / f"rank_view_n{world}.json"
        if not path.exists():
            out[f"n{world}"] = {"verdict": _verdict(None, f"rank view process {proc['status']}: {proc.get('error')}")}
            met_all.append(None)
            continue
        view = json.loads(path.read_text())
        r = view["ratios"]
        row: dict[str, Any] = {"exposed_ns_s": r.get("exposed_ns_s"), "exposed_ns_over_off": r.get("exposed_ns_over_off"),
                               "total_median_s": {v: s["total"]["median_s"] for v, s in view["variants"].items()},
                               "transient_peak_bytes": {v: s.get("transient_peak_bytes")
                                                        for v, s in view["variants"].items()},
                               "flops": view.get("flops"), "rank": view["rank"]}
        over = r.get("exposed_ns_over_off")
        if not cuda:
            row["verdict"] = _verdict(None, "CPU dry run: not a GPU figure")
        elif over is None:
            row["verdict"] = _verdict(None, "overlap off leaves no NS exposed here (nothing to hide)")
        else:
            hits = {v: over[v] <= t for v, t in EXPOSED_TARGETS.items() if v in over}
            row["targets"] = {v: f"<= {t}x off" for v, t in EXPOSED_TARGETS.items()}
            row["met_by_variant"] = hits
            row["verdict"] = _verdict(all(hits.values()))
        met_all.append(None if row["verdict"].startswith("could") else row["verdict"] == "met")
        out[f"n{world}"] = row
    if not cuda:
        out["verdict"] = _verdict(None, "CPU dry run: not a GPU figure")
    elif any(m is None for m in met_all):
        out["verdict"] = _verdict(None, "; ".join(f"n{w}: {out[f'n{w}']['verdict']}" for w, m in zip((8, 64), met_all)
                                                  if m is None))
    else:
        out["verdict"] = _verdict(all(met_all))
    return out


def summary_lines(rec: dict | None) -> list[str]:
    """``summary.md``'s overlap table from the section record (any status)."""
    lines = ["", "## Overlap on CUDA (issue 46)", ""]
    if not rec or rec.get("status") != "ok":
        why = (rec or {}).get("error") or (rec or {}).get("status") or "not run"
        return lines + [f"Could not run: section {(rec or {}).get('status', 'not run')}: {str(why).splitlines()[0]}"]
    res = rec["result"]
    lines += ["| item | result | detail |", "|---|---|---|"]
    for name, item in res["items"].items():
        detail = _detail(name, item)
        lines.append(f"| {name} | {item['verdict']} | {'' if detail == item['verdict'] else detail} |")
    return lines


def _detail(name: str, item: dict) -> str:
    if name == "sanitizer" and "flagged_runs" in item:
        first = next(iter(item["first_lines"].values()), [""])
        return (f"flagged: {item['flagged_runs'] or 'none'}; control (FSDP2 + AdamW) flagged: "
                f"{item['control_flagged']}" + (f"; first line: `{first[0][:120]}`" if item["flagged_runs"] else ""))
    if name.startswith("parity") and "rows" in item:
        return f"{item['setting']}: " + ", ".join(f"{n} {r['differ']}/{r['of']} differ" for n, r in item["rows"].items())
    if name == "streams" and "checks" in item:
        return f"not met: {item['not_met'] or 'none'}; not exercised: {item['not_exercised'] or 'none'}"
    if name == "peak_memory" and "peak_bytes" in item:
        return ", ".join(f"{m} {b / 2**20:.1f} MiB" for m, b in item["peak_bytes"].items())
    if name == "exposed_ns":
        parts = []
        for w in ("n8", "n64"):
            row = item.get(w, {})
            ex = row.get("exposed_ns_s")
            parts.append(f"{w}: " + (", ".join(f"{v} {s * 1e3:.1f} ms" for v, s in ex.items()) if ex else row.get(
                "verdict", "-")))
        return "; ".join(parts)
    if name == "trace" and "file" in item:
        return f"`{item['file']}` ({item['bytes'] / 1024:.0f} KiB)"
    return item.get("verdict", "")


if __name__ == "__main__":
    worker_main()
