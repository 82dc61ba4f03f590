"""One-command GPU suite: kernels, launch configs, NS speed and the NCCL step on one GPU, <= 9 minutes.

    python bench/gpu_suite.py --out bench/results/gpu_h100           # the real run (CUDA)
    python bench/gpu_suite.py --out DIR --quick                      # ~2-minute subset
    python bench/gpu_suite.py --out DIR --device cpu --quick         # CPU dry run (CI runs it)
    python bench/gpu_suite.py --out DIR --sections environment overlap   # issue 46's overlap run, ~3 min

On a lent GPU machine (one command of at most 10 minutes; what is under ``$OUT`` comes back, at
most 8 files, and the suite writes 11, so bundle them):
``python bench/gpu_suite.py --out /tmp/gpu; tar -C /tmp/gpu -cf $OUT/gpu_suite.tar .``, then unpack
and commit the files under ``bench/results/gpu_<device>/``
and copy ``launch_configs.json`` over ``dmuon/kernels/configs/launch_configs.json``.

Sections, in order, each in its own forked process under a time limit (a section that fails,
crashes or overruns is recorded with its error and the suite goes on; the parent never touches
CUDA, so the forks start clean):

* ``environment``: GPU name, memory, driver, CUDA, NCCL, torch and triton versions.
* ``gpu_tests``: ``pytest -m gpu tests/test_gpu.py`` (skipped cleanly without CUDA).
* ``correctness``: Triton SYRK and Gram NS (fp16, bf16) vs the torch Gram path and float64, with
  ``torch.optim.Muon``'s bf16 error beside it, on every Pi0 / Qwen2.5-7B shape and awkward ones.
* ``tuning``: every (bucket, dtype) of both inventories with ``bench/tune_kernels.py``; writes
  ``launch_configs.json`` (the shipped format) and installs it for the later sections.
* ``ns_speed``: whole-inventory NS, ``torch.optim.Muon`` vs dmuon Gram (torch, Triton), CUDA events.
* ``step``: world size 1 over NCCL, ~194 M-parameter Pi0-style policy, bf16 mixed precision,
  dmuon vs ``torch.optim.Muon`` + AdamW vs AdamW (``bench/bench_step.py``), with the A/A control
  (AdamW twice: every ratio carries its noise floor), 30 interleaved measured steps per variant,
  CUDA-event phase times, one gzipped chrome trace per variant (``step_traces.tar``) and the
  GPU's clocks, power and temperature at start and end; with
  ``--sync-debug`` also one dmuon step under ``torch.cuda.set_sync_debug_mode("warn")`` and its
  CUDA-timeline trace.
* ``rank_view``: this GPU plays the busiest owner rank of an 8- and a 64-GPU job on the same
  policy (``bench/rank_view.py``: torch's fake process group), FSDP2 + AdamW vs dmuon.
* ``overlap`` (issue 46, ``bench/gpu_overlap.py``, <= 3 minutes; a full run rarely leaves it
  that, so run ``--sections environment overlap``): does ``Muon(overlap=...)`` run on CUDA as the
  code assumes? ``TORCH_CUDA_SANITIZER=1`` over 3 steps of each mode; the streams that jobs,
  publications, forwards, ``step()`` and the backward's submits run on (recorded by wrapping
  them in the bench); whether a unit's compute waits for a later unit's Newton-Schulz (the
  order of the streams' waits, and CUDA-event times with every job delayed; prefetch 1 and 2);
  whether a recompute after a binding clip waits for the discarded speculation;
  bitwise overlap-vs-off parity (jobs delayed too) with the caching allocator on and off; peak
  memory per mode; exposed NS on the CUDA rank view at N = 8 and 64 (``dmuon-no-ns`` baseline,
  ``--stream-waits``); a labelled 2-step profiler trace (``overlap_trace.json.gz``). Each item
  is met, not met or could not run, with the reason; on the CPU dry run the parity and the
  ordering checks run on gloo at one rank (the worker thread's path), the rank view at tiny
  sizes, and the CUDA-only items say why they did not run.

``DIR`` receives 11 files: ``suite.json`` (environment, tests, section status, targets),
``correctness.json``, ``tuning.json``, ``launch_configs.json``, ``ns_speed.json``, ``step.json``,
``step_traces.tar``, ``rank_view.json``, ``overlap.json``, ``overlap_trace.json.gz`` and
``summary.md``, which is also printed; with
``--sync-debug`` a twelfth, ``step_trace.json`` (the CUDA timeline of one dmuon step, Chrome trace format). Every target of issue 17 is listed there as met or
missed, or "not measured" with the reason; CPU figures are marked as a dry run.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent

#: (section, time limit in seconds for the full run, for --quick). The first H100 run
#: (2026-11-22) took 76, 8, 39 and 37 s for tests, correctness, tuning and NS speed; the step
#: section overran 90 s, so it gets the rest of the 540 s budget (the suite's deadline caps it).
SECTIONS = (("environment", 30, 20), ("gpu_tests", 150, 50), ("correctness", 60, 30),
            ("tuning", 100, 30), ("ns_speed", 100, 50), ("step", 200, 60), ("rank_view", 150, 60),
            ("overlap", 180, 120))
#: rank_view (issue 25) runs under its own limit, with what is left of the budget (the device
#: allows 600 s a command); overlap (issue 46) last: a full run rarely leaves it its 180 s, so it
#: is meant to run on its own (``--sections environment overlap``, ~3 minutes). Its own budget
#: (gpu_overlap.BUDGET_S) is 10 s under these limits, so it writes its record before the kill.
TOTAL_BUDGET_S = {False: 570.0, True: 250.0}
#: The CPU dry run's limits are this many times longer: its times mean nothing, and a shared
#: CPU must not turn a slow section into a recorded timeout.
CPU_LIMIT_SCALE = 3.0
#: Sections whose result is written to DIR as ``<name>.json`` (the rest go into suite.json).
OWN_FILE = ("correctness", "tuning", "ns_speed", "step", "rank_view", "overlap")

TARGETS = (
    ("ns_pi0", "Pi0 whole-inventory NS, dmuon Gram + Triton fp16 / torch.optim.Muon", "<= 0.45"),
    ("ns_qwen", "Qwen2.5-7B whole-inventory NS, dmuon Gram + Triton fp16 / torch.optim.Muon", "<= 0.45"),
    ("peak_qwen_large", "Qwen2.5-7B large shapes (min side >= 2048), Triton Gram, fraction of dense fp16 peak",
     ">= 0.50 (each shape)"),
    ("fp16_error", "fp16 Gram NS error <= torch.optim.Muon bf16 error, every inventory shape (Muon coefficients)",
     "ratio <= 1"),
    ("step_opt", "World size 1: dmuon optimizer step / torch.optim.Muon + AdamW step", "<= 0.6"),
    ("step_total", "World size 1: dmuon whole step / AdamW whole step", "<= 1.05"),
    ("step_forward", "World size 1: dmuon forward / AdamW forward (issue 25)", "<= 1.05"),
    ("step_backward", "World size 1: dmuon backward / AdamW backward (issue 25)", "<= 1.05"),
    ("rank_view_n8_total", "Rank view N = 8, GPU config: dmuon whole step / FSDP2 + AdamW whole step", "<= 1.05"),
    ("kernels_correct", "Triton SYRK and Gram NS within tolerance of float64 on every shape", "all pass"),
    ("table_picked_up", "Tuned launch table written in the shipped format and picked up", "yes"),
    ("gpu_tests", "pytest -m gpu", "all pass"),
)


def _child(name: str, fn: Callable, opts, record_path: Path, timeout_s: float) -> None:
    """Body of a section's forked process: run, then write the record (result or error).

    Shortly before the parent kills it at ``timeout_s``, every thread's stack goes to stderr,
    so an overrun says where it was.
    """
    faulthandler.dump_traceback_later(max(timeout_s - 3.0, 1.0), exit=False)
    t0 = time.perf_counter()
    try:
        rec = {"status": "ok", "result": fn(opts)}
    except BaseException as exc:  # noqa: BLE001 - every failure is data for the report
        rec = {"status": "error", "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    rec.update(section=name, seconds=time.perf_counter() - t0)
    record_path.write_text(json.dumps(rec, indent=1, default=str))


def run_section(name: str, fn: Callable, opts, timeout_s: float) -> dict:
    """Run ``fn(opts)`` in a forked process with a time limit; never raises.

    Returns:
        ``{"section", "status": "ok"|"error"|"timeout"|"crashed", "seconds", "result" |
        "error"}``; a process still running at ``timeout_s`` seconds is killed.
    """
    record = opts.work / f"{name}.record.json"
    record.unlink(missing_ok=True)
    ctx = multiprocessing.get_context("fork")
    t0 = time.perf_counter()
    proc = ctx.Process(target=_child, args=(name, fn, opts, record, timeout_s), name=f"gpu_suite-{name}")
    proc.start()
    proc.join(timeout_s)
    if proc.is_alive():
        proc.kill()
        proc.join()
        return {"section": name, "status": "timeout", "seconds": time.perf_counter() - t0,
                "error": f"killed after its time limit of {timeout_s:.0f} s"}
    if record.exists():
        return json.loads(record.read_text())
    return {"section": name, "status": "crashed", "seconds": time.perf_counter() - t0,
            "error": f"process ended with exit code {proc.exitcode} and wrote no record"}


def gpu_tests(opts) -> dict:
    """``pytest -m gpu tests/test_gpu.py`` in a subprocess; the counts from its summary line."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider",
                           str(ROOT / "tests" / "test_gpu.py")], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    lines = [ln for ln in proc.stdout.strip().splitlines() if ln.strip()]
    summary = lines[-1] if lines else ""
    counts = {}
    for part in summary.strip("= ").split(" in ")[0].split(", "):
        bits = part.split()
        if len(bits) == 2 and bits[0].isdigit():
            counts[bits[1]] = int(bits[0])
    out = {"returncode": proc.returncode, "summary": summary, "counts": counts,
           "output_tail": proc.stdout[-4000:] + proc.stderr[-2000:]}
    if proc.returncode not in (0, 5):  # 5: nothing collected/selected
        raise RuntimeError(f"pytest -m gpu failed (exit {proc.returncode}): {summary}\n{proc.stdout[-3000:]}")
    return out


def _sections() -> dict[str, Callable]:
    import gpu_overlap
    import gpu_sections as gs

    return {"environment": gs.environment, "gpu_tests": gpu_tests, "correctness": gs.correctness,
            "tuning": gs.tuning, "ns_speed": gs.ns_speed, "step": gs.step, "rank_view": gs.rank_view,
            "overlap": gpu_overlap.overlap}


# ----------------------------------------------------------------------------- targets

def _target(key: str, value, met: bool | None, note: str = "") -> dict:
    return {"key": key, "value": value, "met": met, "note": note}


def evaluate_targets(records: dict[str, dict], gpu: bool) -> list[dict]:
    """Every target of issue 17 from the section records: value, met (True/False, None when not
    measured) and a note (why not measured; "CPU dry run" when not a GPU figure)."""
    def result(name):
        rec = records.get(name) or {}
        return rec.get("result") if rec.get("status") == "ok" else None

    def missing(name):
        rec = records.get(name) or {"status": "not run"}
        return f"section {name} {rec['status']}" + (f": {rec['error'].splitlines()[0]}" if rec.get("error") else "")

    out = []
    ns = result("ns_speed")
    for key, model in (("ns_pi0", "pi0"), ("ns_qwen", "qwen2.5-7b")):
        tri = ns and ns["models"].get(model, {}).get("variants", {}).get("dmuon_gram_triton")
        if tri:
            r = tri["ratio_to_torch_muon"]
            out.append(_target(key, round(r, 4), r <= 0.45))
        else:
            out.append(_target(key, None, None, missing("ns_speed") if not ns else "Triton variant runs on CUDA only"))
    large = ns and ns["models"].get("qwen2.5-7b", {}).get("large_shapes_triton")
    if large:
        worst = min(v["fraction_of_peak"] or 0.0 for v in large.values())
        out.append(_target("peak_qwen_large", {k: round(v["fraction_of_peak"] or 0.0, 4) for k, v in large.items()},
                           worst >= 0.5 if all(v["fraction_of_peak"] for v in large.values()) else None,
                           "" if all(v["fraction_of_peak"] for v in large.values()) else "device not in the peak table"))
    else:
        out.append(_target("peak_qwen_large", None, None, missing("ns_speed") if not ns else "CUDA only"))
    cor = result("correctness")
    if cor:
        t = cor["target_fp16_gram_le_bf16_muon"]
        out.append(_target("fp16_error", {"shapes": t["shapes"], "worst_ratio": t["worst_ratio"]}, t["met"]))
        out.append(_target("kernels_correct", {"failed": cor["failed_checks"][:10]}, cor["all_checks_pass"]))
    else:
        out += [_target("fp16_error", None, None, missing("correctness")),
                _target("kernels_correct", None, None, missing("correctness"))]
    st = result("step")
    rr = ((st or {}).get("round_ratios") or {}).get("ratios")
    if st and rr:  # median of per-round ratios; the note gives the quartiles and the A/A verdict
        def aa_note(s):
            return (f"[{s['q1']:.3f}, {s['q3']:.3f}] over {s['rounds']} rounds, A/A floor {s['noise_floor']:.3f}: "
                    f"{s['verdict']}")

        rows = (("step_opt", rr.get("dmuon_over_torch_muon", {}).get("step"), 0.6),
                ("step_total", rr["dmuon_over_adamw"]["total"], 1.05),
                ("step_forward", rr["dmuon_over_adamw"]["forward"], 1.05),
                ("step_backward", rr["dmuon_over_adamw"]["backward"], 1.05))
        for key, s, limit in rows:
            out.append(_target(key, round(s["median"], 4), s["median"] <= limit, aa_note(s)) if s else
                       _target(key, None, None, "no torch_muon variant in the step record"))
    elif st:
        r = st["ratios"]
        out.append(_target("step_opt", round(r["dmuon_step_over_torch_muon_step"], 4),
                           r["dmuon_step_over_torch_muon_step"] <= 0.6))
        out.append(_target("step_total", round(r["dmuon_total_over_adamw_total"], 4),
                           r["dmuon_total_over_adamw_total"] <= 1.05))
        med = {v: {p: st["variants"][v][p]["median_s"] for p in ("forward", "backward")}
               for v in ("adamw", "dmuon")} if "variants" in st else None
        for key, phase in (("step_forward", "forward"), ("step_backward", "backward")):
            if med:
                r = med["dmuon"][phase] / med["adamw"][phase]
                out.append(_target(key, round(r, 4), r <= 1.05, "" if gpu else "CPU dry run"))
            else:
                out.append(_target(key, None, None, "no per-variant phases in the step record"))
    else:
        out += [_target(k, None, None, missing("step")) for k in ("step_opt", "step_total", "step_forward",
                                                                  "step_backward")]
    rv = result("rank_view")
    if rv and "n8" in rv and rv["n8"].get("ratios"):
        r = rv["n8"]["ratios"]["dmuon_total_over_adamw_total"]
        out.append(_target("rank_view_n8_total", round(r, 4), r <= 1.05, "" if gpu else "CPU dry run (tiny model)"))
    else:
        out.append(_target("rank_view_n8_total", None, None, missing("rank_view")))
    tu = result("tuning")
    if tu:
        ok = tu["written_table_lookup_ok"] and tu["installed_lookup_ok"] is not False
        in_use = ns and ns.get("launch_table_entry")
        note = f"NS speed ran with launch-table entry {in_use!r}" if in_use else ""
        out.append(_target("table_picked_up", {"written": tu["written_table_lookup_ok"],
                                               "installed": tu["installed_lookup_ok"]}, ok, note))
    else:
        out.append(_target("table_picked_up", None, None, missing("tuning")))
    gt = result("gpu_tests")
    if gt:
        c = gt["counts"]
        ran = c.get("passed", 0) + c.get("failed", 0)
        out.append(_target("gpu_tests", c, (c.get("failed", 0) == 0 and gt["returncode"] == 0) if ran else None,
                           "" if ran else "all skipped (no CUDA)"))
    else:
        out.append(_target("gpu_tests", None, None if (records.get("gpu_tests") or {}).get("status") != "error" else False,
                           missing("gpu_tests")))
    order = [k for k, _, _ in TARGETS]
    out.sort(key=lambda t: order.index(t["key"]))
    if not gpu:
        for t in out:
            t["note"] = ("CPU dry run: not a GPU figure" + (f"; {t['note']}" if t["note"] else ""))
    return out


# ----------------------------------------------------------------------------- summary

def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, dict):
        return ", ".join(f"{k}={_fmt(x)}" for k, x in v.items())
    return "-" if v is None else str(v)


def summary_markdown(suite: dict, records: dict[str, dict]) -> str:
    """``summary.md``: environment, section status, targets (met/missed), the main tables."""
    env = (records.get("environment") or {}).get("result") or {}
    gpu = suite["device"] == "cuda"
    title = env.get("gpu") or ("CPU dry run" if not gpu else "CUDA run (environment section failed)")
    lines = [f"# dmuon GPU suite: {title}", "",
             f"{suite['finished_utc']}, mode {'quick' if suite['quick'] else 'full'}, device {suite['device']}, "
             f"{suite['wall_s']:.0f} s. torch {env.get('torch')}, triton {env.get('triton')}, CUDA "
             f"{env.get('torch_cuda')}, NCCL {env.get('nccl', '-')}, driver/clock/power {env.get('nvidia_smi', '-')}.",
             "" if gpu else "**CPU dry run**: tiny shapes, Triton under TRITON_INTERPRET=1; no figure here is a GPU figure.",
             "", "## Targets (issue 17)", "", "| target | wanted | measured | result |", "|---|---|---|---|"]
    wanted = {k: (d, w) for k, d, w in TARGETS}
    for t in suite["targets"]:
        desc, want = wanted[t["key"]]
        verdict = {True: "met", False: "**missed**", None: "not measured"}[t["met"]]
        lines.append(f"| {desc} | {want} | {_fmt(t['value'])} | {verdict}{' (' + t['note'] + ')' if t['note'] else ''} |")
    lines += ["", "## Sections", "", "| section | status | s | error |", "|---|---|---|---|"]
    for name, _, _ in SECTIONS:
        rec = records.get(name) or {"status": "not run", "seconds": 0.0}
        err = (rec.get("error") or "").splitlines()[0][:160] if rec.get("error") else ""
        lines.append(f"| {name} | {rec['status']} | {rec.get('seconds', 0.0):.1f} | {err} |")
    ns = (records.get("ns_speed") or {}).get("result")
    if ns:
        lines += ["", f"## Newton-Schulz, whole inventory (median of {ns['rounds']}, launch table "
                      f"{ns['launch_table_entry']!r})", "",
                  "| inventory | variant | ms | achieved TFLOP/s | of peak | x torch.optim.Muon |", "|---|---|---|---|---|---|"]
        for model, res in ns["models"].items():
            for v, s in res["variants"].items():
                lines.append(f"| {model} | {v} | {s['ms_median']:.2f} | {s['achieved_tflops']:.1f} | "
                             f"{_fmt(s['fraction_of_peak'])} | {s['ratio_to_torch_muon']:.3f} |")
            for shape, s in res.get("large_shapes_triton", {}).items():
                lines.append(f"| {model} {shape} x{s['count']} | dmuon_gram_triton | {s['ms_median']:.2f} | "
                             f"{s['achieved_tflops']:.1f} | {_fmt(s['fraction_of_peak'])} | - |")
    st = (records.get("step") or {}).get("result")
    if st:
        lines += ["", f"## Step, world size 1 ({st['backend']}), {st['model']}, {st['params'] / 1e6:.1f} M params", ""]
        if st.get("round_ratios"):
            import step_stats

            lines += ["```", step_stats.format_ratios(st["round_ratios"]), "```", ""]
        for when, state in (st.get("gpu_state") or {}).items():
            lines.append(f"- GPU at {when}: " + (", ".join(f"{k} {v}" for k, v in state.items() if k != "available")
                                                 if state.get("available") else f"unavailable ({state.get('reason')})"))
        if st.get("traces_file"):
            lines.append(f"- one chrome trace per variant (gzipped) in `{st['traces_file']}`")
        lines += ["",
                  "| variant | optimizer step ms | whole step ms | peak GiB |", "|---|---|---|---|"]
        for v, s in st["variants"].items():
            peak = s.get("peak_bytes")
            lines.append(f"| {v} | {s['step']['median_s'] * 1e3:.1f} | {s['total']['median_s'] * 1e3:.1f} | "
                         f"{peak / 2**30:.2f} |" if peak is not None else
                         f"| {v} | {s['step']['median_s'] * 1e3:.1f} | {s['total']['median_s'] * 1e3:.1f} | - |")
    cor = (records.get("correctness") or {}).get("result")
    if cor:
        worst = sorted(cor["rows"], key=lambda r: -r["fp16_gram_err"] / r["torch_muon_bf16_err"])[:5]
        lines += ["", f"## Correctness ({len(cor['rows'])} shapes; failed checks: {len(cor['failed_checks'])})", "",
                  "| source | shape | fp16 Gram err | bf16 torch Muon err | fp16 SYRK err | bf16 SYRK err |",
                  "|---|---|---|---|---|---|"]
        for r in worst:
            e = r["errors"]
            lines.append(f"| {r['source']} | {r['shape']} | {r['fp16_gram_err']:.2e} | {r['torch_muon_bf16_err']:.2e} | "
                         f"{e['float16']['syrk_vs_f64']:.1e} | {e['bfloat16']['syrk_vs_f64']:.1e} |")
    tu = (records.get("tuning") or {}).get("result")
    if tu:
        lines += ["", f"## Launch configs for {tu['gpu_name']!r} (fp16 winners written; bf16 winners differ: "
                      f"{tu['bf16_winners_differ']})", ""]
        for w, b in zip(tu["winners"]["float16"], tu["buckets"]):
            lines.append(f"- max_m={w['max_m']} (timed on [{b['batch']}, {b['m']}, {b['k']}] from {b['source']}): "
                         f"block {w['block']}, block_k {w['block_k']}, warps {w['num_warps']}, stages {w['num_stages']}")
        if gpu:
            lines.append("- commit: copy `launch_configs.json` over `dmuon/kernels/configs/launch_configs.json`.")
    if "overlap" in records:
        import gpu_overlap

        lines += gpu_overlap.summary_lines(records["overlap"])
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- main

def run_suite(opts, sections: tuple[str, ...] | None = None, limits: dict[str, float] | None = None) -> dict:
    """Run the sections (all by default) and write DIR's files; returns suite.json's content."""
    opts.out.mkdir(parents=True, exist_ok=True)
    fns = _sections()
    t_start = time.perf_counter()
    scale = CPU_LIMIT_SCALE if opts.device == "cpu" else 1.0
    deadline = t_start + TOTAL_BUDGET_S[opts.quick] * scale
    records: dict[str, dict] = {}
    for name, full_s, quick_s in SECTIONS:
        if sections is not None and name not in sections:
            continue
        left = deadline - time.perf_counter()
        limit = min((limits or {}).get(name, (quick_s if opts.quick else full_s) * scale), left)
        if limit < 5:
            records[name] = {"section": name, "status": "skipped", "seconds": 0.0,
                             "error": f"suite time budget of {TOTAL_BUDGET_S[opts.quick]:.0f} s spent"}
            continue
        print(f"[gpu_suite] {name} (limit {limit:.0f} s) ...", flush=True)
        records[name] = rec = run_section(name, fns[name], opts, limit)
        print(f"[gpu_suite] {name}: {rec['status']} in {rec['seconds']:.1f} s"
              + (f" - {rec['error'].splitlines()[0]}" if rec.get("error") else ""), flush=True)
        if name in OWN_FILE:
            (opts.out / f"{name}.json").write_text(json.dumps(rec, indent=1, default=str) + "\n")
    suite = {"suite": "bench/gpu_suite.py", "device": opts.device, "quick": opts.quick,
             "finished_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
             "wall_s": time.perf_counter() - t_start,
             "environment": records.get("environment"), "gpu_tests": records.get("gpu_tests"),
             "sections": {n: {k: r.get(k) for k in ("status", "seconds", "error")} for n, r in records.items()}}
    suite["targets"] = evaluate_targets(records, gpu=opts.device == "cuda")
    (opts.out / "suite.json").write_text(json.dumps(suite, indent=1, default=str) + "\n")
    text = summary_markdown(suite, records)
    (opts.out / "summary.md").write_text(text)
    return suite


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="results folder (e.g. bench/results/gpu_h100)")
    p.add_argument("--quick", action="store_true", help="~2-minute subset")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda: the real run; cpu: dry run with tiny shapes and the Triton interpreter")
    p.add_argument("--sections", nargs="+", choices=[s for s, _, _ in SECTIONS], default=None)
    p.add_argument("--no-install-table", action="store_true",
                   help="do not write the tuned table into dmuon/kernels/configs/ (later sections use the shipped one)")
    p.add_argument("--sync-debug", action="store_true",
                   help="CUDA: one dmuon step under torch.cuda.set_sync_debug_mode('warn') in the step and "
                        "rank_view sections, and the step's CUDA-timeline trace (step_trace.json)")
    a = p.parse_args(argv)
    if a.device == "cpu":
        # The interpreter must be on before triton is first imported (in the section processes).
        os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_sections import SuiteOptions

    with tempfile.TemporaryDirectory(prefix="gpu_suite_") as work:
        opts = SuiteOptions(out=a.out, device=a.device, quick=a.quick,
                            install_table=not a.no_install_table, work=Path(work), sync_debug=a.sync_debug)
        suite = run_suite(opts, tuple(a.sections) if a.sections else None)
    print((a.out / "summary.md").read_text())
    return suite


if __name__ == "__main__":
    main()
