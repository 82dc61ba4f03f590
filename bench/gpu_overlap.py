"""The GPU suite's ``overlap`` section (issue 46): does ``Muon(overlap=...)`` run on CUDA as the
code assumes, bit for bit, and how much Newton-Schulz (NS) does it hide?

One GPU, <= 3 minutes (:data:`BUDGET_S`), six items, each recorded as "met", "not met" or
"could not run" (with the reason), never with a figure that was not measured:

1. ``sanitizer``: ``TORCH_CUDA_SANITIZER=1`` (set before CUDA initializes: a subprocess) over 3
   steps of each mode (``off``, ``forward``, ``backward``) and of FSDP2 + AdamW alone (the
   control: what FSDP2 itself trips), world size 1 over NCCL; whether it flagged anything and
   its first lines.
2. ``streams`` (CUDA) and ``unit_order`` (both): where and when the code runs, recorded by
   wrapping (here, never in the library) :meth:`PendingSteps.submit`'s job,
   :meth:`PendingSteps.schedule`, :meth:`Job.wait`, :func:`dmuon.hooks.unit.issue_groups`,
   :meth:`Unit.wait`, the backward's speculation callbacks, the optimizer step and a forward
   pre-hook per unit, over 3 steps with every job delayed, for ``forward`` and ``backward``
   (prefetch 1, the default) and ``forward`` at prefetch 2. ``streams``: each job runs on the
   side stream; ``step()``'s submits, the backward's early submits and its end-of-backward ones
   (both on autograd's thread) come from the compute stream; a publication of a group with a
   job goes out on dmuon's publication stream (which waits for that job's event only), never
   on the side stream, where it would queue behind every job submitted before it; one without
   a job on the compute stream; forwards, unit waits and ``step()`` on the compute stream.
   ``unit_order`` (issue 46, review finding 1): no publication is ordered behind a later
   unit's job (its stream waited on it, CUDA; the host blocked on it, CPU); and, timed (CUDA
   events on the streams, host clock on CPU), every unit's compute starts after its own job
   ends (else a wait is missing) and before the next unit's job ends.
   ``clip_recompute`` (both; issue 46, finding 3): ``backward`` with a clip that binds at every
   step (so every speculation is discarded), jobs not delayed: how long ``step()``'s first job
   found the discarded speculative Newton-Schulz still occupying the side stream (CUDA) or the
   worker thread (CPU); met if never over :data:`CLIP_WAIT_MS`.
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
   It runs with ``stream_waits`` (:class:`rank_view.ViewConfig`): phases end on the compute
   stream, and each fake publication puts an event on it, so a forward waits for its unit's
   job as in a real job whose broadcasts take no time.
6. ``trace``: a ``torch.profiler`` chrome trace of 2 steps of ``overlap="forward"``
   (``overlap_trace.json.gz`` in the suite's output), in which every unit's wait is labelled
   ``overlap_bench::unit<k> <phase> waits on publication of groups [...]`` with the job each
   publication was issued after and any later job it is ordered behind, and every job and
   publication is labelled too.

Every item runs in a subprocess (``bench/overlap_worker.py``; the wrappers are in
``bench/stream_recorder.py``) with its own time limit (:func:`_run_worker`), so one that hangs
or crashes costs its own result only. On CPU (the dry run) the parity runs on gloo at one
rank, the recorder (``unit_order``) and the trace run on the worker thread's path, the rank
view runs at tiny sizes, and the CUDA-only checks say why they could not run.

    python bench/gpu_suite.py --out /tmp/gpu --sections environment overlap   # one GPU, ~3 min
    python bench/overlap_worker.py --task parity --device cpu --out /tmp/p.json  # one worker
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from overlap_worker import MODES

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
WORKER = BENCH / "overlap_worker.py"
#: Seconds the section may take (full, --quick); gpu_suite.SECTIONS gives it 10 s more, so the
#: section writes its record before the suite's limit. The CPU dry run gets CPU_SCALE times more.
BUDGET_S = {False: 170.0, True: 110.0}
CPU_SCALE = 3.0
#: Each item's share of the budget, in run order (what an item leaves unused goes to the next):
#: a subprocess costs ~5 s to import torch and start CUDA and NCCL; the sanitizer runs every op
#: through Python; the rank view builds 4 models per N and runs 32 steps each.
SHARES = {"sanitizer": 0.25, "parity": 0.25, "parity_no_caching": 0.15, "rank_view": 0.35}
#: issue 46's targets, as a fraction of the exposed NS with overlap off
EXPOSED_TARGETS = {"dmuon-overlap-forward": 0.1, "dmuon-overlap-backward": 0.2}
TRACE_FILE = "overlap_trace.json.gz"
#: What the sanitizer can and cannot see (torch.cuda._sanitizer: an op's accesses are put on the
#: stream current when it is dispatched)
SANITIZER_SCOPE = ("orders the jobs (side stream), publications (publication stream) and compute by "
                   "their event waits; a collective counts as running on the stream it was issued "
                   "from, so a missing work.wait() on a stream that issued it is not seen")


def _run_worker(task: str, device: str, out: Path, timeout_s: float, env: dict | None = None,
                extra: tuple[str, ...] = ()) -> dict:
    """Run one worker in a fresh interpreter; ``{"status": "ok"|"error"|"timeout", ...}``."""
    t0 = time.perf_counter()
    cmd = [sys.executable, str(WORKER), "--task", task, "--device", device, "--out", str(out),
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
                "first_lines": {n: r["first_lines"][:12] for n, r in flagged.items()}, "scope": SANITIZER_SCOPE}
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
    items["unit_order"] = _order_item(par, res, cuda)
    items["clip_recompute"] = _clip_item(par, res, cuda)
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


#: the recorder's checks that ``unit_order`` reads, on both devices (``streams`` reads the rest, CUDA)
ORDER_CHECKS = ("publication_behind_no_later_job", "unit_starts_after_its_own_job",
                "unit_starts_before_next_units_job_ends")


def _checks(per_run: dict, names: tuple[str, ...] | None, exclude: tuple[str, ...] = ()) -> dict:
    return {f"{run}: {k}": ok for run, v in per_run.items() for k, ok in v["checks"].items()
            if (names is None or k in names) and k not in exclude}


def _check_verdict(checks: dict) -> dict:
    met = all(ok is not False for ok in checks.values()) if checks else None
    return {"verdict": _verdict(met, "no check was exercised"), "checks": checks,
            "not_met": [k for k, ok in checks.items() if ok is False],
            "not_exercised": [k for k, ok in checks.items() if ok is None]}


def _streams_item(par: dict | None, proc: dict, cuda: bool) -> dict:
    if par is None or "streams" not in par:
        return {"verdict": _verdict(None, f"parity process {proc['status']}")}
    per_run = par["streams"]
    keep = ("mode", "prefetch", "counts", "submits_by_origin", "backward_submit_threads", "job_threads",
            "compute_stream", "side_streams", "publication_streams", "largest_publication_call")
    runs = {r: {k: v[k] for k in keep if k in v} for r, v in per_run.items()}
    if not cuda:
        return {"verdict": _verdict(None, "CPU dry run: no CUDA streams (the recorder ran on the worker "
                                          "thread's path; see unit_order)"), "runs": runs}
    return {**_check_verdict(_checks(per_run, None, exclude=ORDER_CHECKS)), "runs": runs}


def _order_item(par: dict | None, proc: dict, cuda: bool) -> dict:
    """Issue 46's finding 1 on this device: no unit's compute waits for a later unit's job."""
    if par is None or "streams" not in par:
        return {"verdict": _verdict(None, f"parity process {proc['status']}")}
    per_run = par["streams"]
    out = _check_verdict(_checks(per_run, ORDER_CHECKS))
    out["setting"] = ("CUDA: waits on the publication stream, CUDA-event times" if cuda else
                      "CPU: the worker thread and host waits, host clock")
    out["runs"] = {r: {"max_later_jobs_before_a_publication": v.get("max_later_jobs_before_a_publication"),
                       "timeline": v.get("timeline", [])[:24], "unit_waits": v.get("unit_waits", [])}
                   for r, v in per_run.items()}
    return out


#: Most time (ms) a recompute may find the discarded speculation still running on the side
#: stream (CUDA) or the worker thread (CPU) and count as not waiting for it
CLIP_WAIT_MS = 0.5


def _clip_item(par: dict | None, proc: dict, cuda: bool) -> dict:
    """Issue 46, finding 3: with a clip that binds, ``step()`` recomputes every speculation and
    its jobs do not first wait for the discarded speculative Newton-Schulz."""
    run = (par or {}).get("clip")
    if run is None:
        return {"verdict": _verdict(None, f"parity process {proc['status']}")}
    stats, waits = run["kept_speculations"], run["speculation_wait"]
    out = {"setting": ("CUDA: side stream, CUDA-event times" if cuda else "CPU: worker thread, host clock"),
           "clip_max_norm": run["clip"], "kept_speculations": stats, "speculation_wait": waits,
           "threshold_ms": CLIP_WAIT_MS}
    if stats.get("recomputed", 0) == 0 or stats.get("kept", 0) > 0:
        return {"verdict": _verdict(None, f"the clip did not discard every speculation ({stats})"), **out}
    if not waits:
        return {"verdict": _verdict(None, "no speculation was started"), **out}
    return {"verdict": _verdict(all(w["wait_ms"] <= CLIP_WAIT_MS for w in waits)), **out}


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
        "fake process group with stream_waits: every publication records an event on the stream "
        "it is issued on (the publication stream, behind its own job), which the unit's wait puts "
        "on the compute stream, as NCCL's work.wait() does, and each phase ends when the compute "
        "stream is done; the broadcasts themselves take no time") if cuda else "CPU dry run, tiny model"}
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
    if name in ("streams", "unit_order") and "checks" in item:
        return (f"{item['setting']}: " if "setting" in item else "") + \
            f"not met: {item['not_met'] or 'none'}; not exercised: {item['not_exercised'] or 'none'}"
    if name == "clip_recompute" and "speculation_wait" in item:
        return f"{item['setting']}: recompute waited " + ", ".join(
            f"{w['wait_ms']:.2f} ms" for w in item["speculation_wait"]) + f" for the discarded speculation " \
            f"(<= {item['threshold_ms']} ms to pass; {item['kept_speculations']})"
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
