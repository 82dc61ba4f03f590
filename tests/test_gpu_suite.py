"""CPU dry run of bench/gpu_suite.py (tiny shapes, Triton under the interpreter), so the one-command
GPU suite cannot rot before a GPU comes; and its failure handling and target verdicts.

The dry run costs ~13 s of CPU without the overlap section (the section processes fork from
the suite; ``pytest -m gpu`` is one more interpreter); the overlap section (issue 46) adds ~9-10 s
of wall time on the shared 2-core VM (two worker interpreters: parity + recorder + trace, and the
rank view at N = 8 and 64); the other tests well under a second.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_suite  # noqa: E402


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_suite")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)  # the suite must switch the interpreter on itself
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_suite.py"), "--device", "cpu", "--quick",
                           "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=360)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return out, proc.stdout


def _section(out: Path, name: str) -> dict:
    rec = json.loads((out / f"{name}.json").read_text())
    assert rec["status"] == "ok", rec.get("traceback") or rec
    return rec["result"]


def test_dry_run_writes_the_files_and_prints_the_summary(dry_run):
    out, stdout = dry_run
    names = sorted(p.name for p in out.iterdir())
    assert names == ["correctness.json", "launch_configs.json", "ns_speed.json", "overlap.json", "overlap_trace.json.gz",
                     "rank_view.json", "step.json", "step_traces.tar", "suite.json", "summary.md", "tuning.json"]
    # a lent GPU machine returns at most 8 files: gpu_suite's docstring bundles them with tar
    suite = json.loads((out / "suite.json").read_text())
    assert {n: s["status"] for n, s in suite["sections"].items()} == {n: "ok" for n, _, _ in gpu_suite.SECTIONS}
    assert [t["key"] for t in suite["targets"]] == [k for k, _, _ in gpu_suite.TARGETS]
    assert all(t["note"].startswith("CPU dry run") for t in suite["targets"])
    assert "## Targets (issue 17)" in stdout and "CPU dry run" in stdout
    assert suite["environment"]["result"]["TRITON_INTERPRET"] == "1"
    # pytest -m gpu ran and skipped every GPU test cleanly (no CUDA here)
    counts = suite["gpu_tests"]["result"]["counts"]
    assert counts.get("skipped", 0) >= 3 and "failed" not in counts and "error" not in counts


def test_dry_run_kernels_against_float64_and_torch_muon(dry_run):
    out, _ = dry_run
    cor = _section(out, "correctness")
    assert cor["all_checks_pass"], cor["failed_checks"]
    for row in cor["rows"]:
        for dtype, tol in (("float16", 2e-3), ("bfloat16", 1e-2)):
            e = row["errors"][dtype]
            assert e["syrk_symmetric"] and 0 <= e["syrk_vs_f64"] < tol
            assert 0 < e["gram_triton_muon"] < 0.1  # an NS iterate, not a copy of the reference
        # the fp16 Gram iteration beats torch.optim.Muon's bf16 one on these shapes (~5x)
        assert row["fp16_gram_err"] < row["torch_muon_bf16_err"]


def test_dry_run_tuned_table_is_in_the_shipped_format(dry_run):
    from dmuon.kernels.launch_configs import load_launch_table

    out, _ = dry_run
    tu = _section(out, "tuning")
    table = load_launch_table(str(out / "launch_configs.json"))  # dmuon's own parser
    entry = dict(table.gpus)[tu["gpu_name"]]
    assert len(entry.buckets) == len(tu["buckets"]) and entry.buckets[-1].max_m is None
    for res, bucket in zip(tu["results"]["float16"], entry.buckets):
        fastest = min((r for r in res["records"] if r["ms"] is not None), key=lambda r: r["ms"])
        assert {k: getattr(bucket.config, k) for k in fastest["config"]} == fastest["config"]
    assert tu["written_table_lookup_ok"] and tu["installed_lookup_ok"] is None  # never installed on CPU


def test_dry_run_step_and_ns_speed(dry_run):
    out, _ = dry_run
    st = _section(out, "step")
    assert st["backend"] == "gloo" and st["world_size"] == 1 and "bf16 MixedPrecisionPolicy" in st["model"]
    first = {v: s["losses"][0] for v, s in st["variants"].items()}
    assert set(first) == {"adamw", "vanilla", "dmuon", "torch_muon", "adamw_b", "dmuon_overlap"}
    # overlap="forward" moves Newton-Schulz behind the next forward, not its math (issue 39)
    assert st["variants"]["dmuon_overlap"]["losses"] == pytest.approx(st["variants"]["dmuon"]["losses"],
                                                                     rel=1e-6)
    # same weights, same first batch: FSDP2 variants agree exactly; the unsharded fp32 torch_muon
    # to bf16 precision
    assert first["vanilla"] == pytest.approx(first["adamw"], rel=1e-6)
    assert first["dmuon"] == pytest.approx(first["adamw"], rel=1e-6)
    assert first["torch_muon"] == pytest.approx(first["dmuon"], rel=3e-2)
    ns = _section(out, "ns_speed")
    for model in ("pi0", "qwen2.5-7b"):
        v = ns["models"][model]["variants"]
        assert set(v) == {"torch_muon_bf16", "dmuon_gram_torch"} and v["torch_muon_bf16"]["ratio_to_torch_muon"] == 1.0


def test_dry_run_step_aa_control_traces_and_gpu_state(dry_run):
    """Issue 34: the step section's A/A control (AdamW twice, interleaved), per-round ratios
    with quartiles, one gzipped chrome trace per variant, the GPU state at start and end, and
    the targets quoted with the A/A floor."""
    import gzip
    import tarfile

    import step_stats

    out, stdout = dry_run
    st = _section(out, "step")
    rr = st["round_ratios"]
    assert rr["rounds"] == 2 and st["round_orders"][0] != st["round_orders"][1]
    assert st["variants"]["adamw_b"]["losses"] == st["variants"]["adamw"]["losses"]
    assert step_stats.all_finite_positive(rr)
    assert {"adamw_b_over_adamw", "dmuon_over_adamw", "dmuon_over_torch_muon"} <= set(rr["ratios"])
    assert all(0 <= f < float("inf") for f in rr["noise_floor"].values())
    with tarfile.open(out / st["traces_file"]) as tar:
        names = sorted(tar.getnames())
        assert names == sorted(f"trace_{v}.json.gz" for v in st["variants"])
        trace = json.loads(gzip.decompress(tar.extractfile("trace_dmuon.json.gz").read()))
    assert any(e.get("name", "").startswith("dmuon::") for e in trace["traceEvents"])  # dmuon's labels
    for when in ("start", "end"):
        state = st["gpu_state"][when]
        assert state["available"] or state["reason"]  # no GPU here: recorded as unavailable, with why
    suite = json.loads((out / "suite.json").read_text())
    notes = {t["key"]: t["note"] for t in suite["targets"]}
    assert all("A/A floor" in notes[k] for k in ("step_opt", "step_total", "step_forward", "step_backward"))
    assert "adamw_b_over_adamw" in stdout and "chrome trace per variant" in stdout


def test_dry_run_rank_view_section(dry_run):
    """The rank_view section (issue 25): rank views at N = 8 and 64, the busiest owner rank,
    FSDP2 + AdamW against dmuon (tiny policy on the CPU dry run)."""
    out, _ = dry_run
    rv = _section(out, "rank_view")
    for world in (8, 64):
        view = rv[f"n{world}"]
        assert view["world"] == world and view["rank"] == view["busiest_rank"]
        assert set(view["variants"]) == {"adamw", "dmuon"} and view["config"]["bf16"]
        assert view["ratios"]["dmuon_total_over_adamw_total"] > 0


def test_dry_run_overlap_section(dry_run):
    """Issue 46's overlap section on CPU: bitwise parity of every mode (and with delayed jobs)
    against overlap off on gloo at one rank; the stream recorder's counts on the worker-thread
    path; the labelled trace; the rank view's exposed NS at N = 8 and 64; the CUDA-only items
    say why they could not run; the summary carries the table."""
    import gzip

    import gpu_overlap
    import overlap_worker

    out, stdout = dry_run
    ov = _section(out, "overlap")
    items = ov["items"]
    assert ov["device"] == "cpu"
    par = items["parity"]
    assert par["verdict"] == "met", par
    assert set(par["rows"]) == {"off_again", "forward", "backward", "forward_delayed", "backward_delayed"}
    for row in par["rows"].values():
        assert row["differ"] == 0 and row["of"] > 0 and row["losses_equal_off"]
    # overlap="backward" kept speculations (proven bit for bit), and none elsewhere
    assert par["rows"]["backward"]["kept_speculations"]["kept"] > 0
    assert par["rows"]["forward"]["kept_speculations"] == {"kept": 0, "recomputed": 0}
    for name in ("sanitizer", "parity_no_caching", "streams", "peak_memory"):
        assert items[name]["verdict"].startswith("could not run: CPU dry run"), items[name]
    # the recorder ran (jobs delayed): step()'s jobs on dmuon's worker thread, the backward's
    # speculations submitted from autograd's thread (the caller's, on CPU)
    blocks = overlap_worker.SIZES["cpu"]["blocks"]
    runs = items["streams"]["runs"]
    assert set(runs) == {name for name, _, _, _ in overlap_worker.STREAM_RUNS}
    for run in runs.values():
        assert run["counts"]["job"] == run["counts"]["submit"] and run["counts"]["step"] == 3
        assert run["submits_by_origin"]["step"] == 3 * blocks and run["job_threads"] == ["dmuon-overlap_0"]
    spec = runs["backward"]["submits_by_origin"]
    assert spec["early"] + spec["end_of_backward"] > 0 and runs["backward"]["backward_submit_threads"] == ["MainThread"]
    # issue 46, finding 1 on the worker-thread path: no publication behind a later unit's job,
    # every unit started after its own job (timed); the other timed check is recorded
    order = items["unit_order"]
    for run, v in order["runs"].items():
        assert order["checks"][f"{run}: publication_behind_no_later_job"] is True
        assert order["checks"][f"{run}: unit_starts_after_its_own_job"] is True
        assert isinstance(order["checks"][f"{run}: unit_starts_before_next_units_job_ends"], bool)
        assert v["max_later_jobs_before_a_publication"] == 0
        assert len(v["timeline"]) == 2 * blocks  # the forwards after steps 1 and 2
        waits = [w for w in v["unit_waits"] if w["phase"] == "forward"]
        assert [w["unit"] for w in waits] == list(range(blocks))  # the first step's forward
        assert all(p["job"] is not None for w in waits for p in w["publications"])
    # issue 46, finding 3: a binding clip discards every speculation; the wait of step()'s first
    # job for them is measured (on CPU a discarded job not yet started is skipped)
    clip = items["clip_recompute"]
    assert clip["kept_speculations"]["kept"] == 0 and clip["kept_speculations"]["recomputed"] > 0
    assert len(clip["speculation_wait"]) == 3 and clip["verdict"] in ("met", "not met")
    tr = items["trace"]
    assert tr["verdict"] == "written"
    trace = json.loads(gzip.decompress((out / gpu_overlap.TRACE_FILE).read_bytes()))
    names = {e.get("name", "") for e in trace["traceEvents"]}
    for k in range(blocks):  # each unit's wait names the job its publication was issued after
        assert any(n.startswith(f"overlap_bench::unit{k} forward waits on publication of groups [{k}] "
                                f"(group {k}: after job#") for n in names), k
    # (the jobs' own labels are recorded on CUDA, where jobs are issued from the main thread; the
    # CPU profiler does not see dmuon's worker thread)
    assert any(n.startswith("overlap_bench::publish group 0 after job#") for n in names)
    ex = items["exposed_ns"]
    assert ex["verdict"] == "could not run: CPU dry run: not a GPU figure"
    for world in ("n8", "n64"):
        assert set(ex[world]["exposed_ns_s"]) == {"dmuon", "dmuon-overlap-forward", "dmuon-overlap-backward"}
    assert "## Overlap on CUDA (issue 46)" in stdout and "| parity | met |" in stdout


def _cuda_streams_record(later_jobs_before: int) -> dict:
    import gpu_overlap as go

    checks = {"jobs_on_side_stream": True, "step_submits_from_compute_stream": True,
              "early_submits_from_compute_stream": None,
              "publications_with_job_on_publication_stream": True,
              "publication_behind_no_later_job": later_jobs_before == 0,
              "unit_starts_after_its_own_job": True,
              "unit_starts_before_next_units_job_ends": later_jobs_before == 0}
    assert set(go.ORDER_CHECKS) <= set(checks)
    run = {"checks": checks, "counts": {}, "max_later_jobs_before_a_publication": later_jobs_before,
           "timeline": [], "unit_waits": []}
    return {"streams": {"forward": run, "forward_prefetch2": run}}


def test_overlap_verdicts_on_gpu_shaped_records(tmp_path):
    """The section's reading of CUDA results, without a GPU: a publication ordered behind a
    later unit's job is "not met" in unit_order (not in streams), an unexercised check is
    listed as such, a non-deterministic A/A pair makes parity "could not run", and the
    exposed-NS targets are read per N."""
    import gpu_overlap as go

    ok = {"status": "ok"}
    good = go._streams_item(_cuda_streams_record(0), ok, cuda=True)
    assert good["verdict"] == "met" and "forward: early_submits_from_compute_stream" in good["not_exercised"]
    assert not any(k.endswith(go.ORDER_CHECKS) for k in good["checks"])
    assert go._order_item(_cuda_streams_record(0), ok, cuda=True)["verdict"] == "met"
    late = _cuda_streams_record(1)
    assert go._streams_item(late, ok, cuda=True)["verdict"] == "met"
    bad = go._order_item(late, ok, cuda=True)
    assert bad["verdict"] == "not met"
    assert bad["not_met"] == [f"{run}: {check}" for run in ("forward", "forward_prefetch2")
                              for check in ("publication_behind_no_later_job", "unit_starts_before_next_units_job_ends")]
    assert go._order_item(None, {"status": "timeout"}, cuda=True)["verdict"] == "could not run: parity process timeout"
    clip = {"clip": {"clip": 1e-3, "kept_speculations": {"kept": 0, "recomputed": 64},
                     "speculation_wait": [{"step": 1, "speculative_jobs": 1, "wait_ms": 0.1}]}}
    assert go._clip_item(clip, ok, cuda=True)["verdict"] == "met"
    clip["clip"]["speculation_wait"].append({"step": 2, "speculative_jobs": 8, "wait_ms": 19.5})
    assert go._clip_item(clip, ok, cuda=True)["verdict"] == "not met"
    clip["clip"]["kept_speculations"]["kept"] = 3
    assert go._clip_item(clip, ok, cuda=True)["verdict"].startswith("could not run: the clip did not discard")
    same = {"differ": 0, "tensors": 5, "max_abs_diff": 0.0}
    runs = {"off": {}, **{n: {"vs_off": dict(same), "losses_equal_off": True, "kept_speculations": {},
                              "started_early": 0} for n in ("off_again", "forward", "backward")}}
    assert go._parity_item({"runs": runs}, ok, "x")["verdict"] == "met"
    runs["backward"]["vs_off"]["differ"] = 2
    assert go._parity_item({"runs": runs}, ok, "x")["verdict"] == "not met"
    runs["off_again"]["vs_off"]["differ"] = 1
    assert go._parity_item({"runs": runs}, ok, "x")["verdict"].startswith("could not run: off differs from off")
    assert go._parity_item(None, {"status": "timeout", "error": "killed after 40 s"}, "x")["verdict"] == \
        "could not run: subprocess timeout: killed after 40 s"

    def view(exposed):
        total = {v: {"total": {"median_s": 1.0}} for v in exposed}
        return {"ratios": {"exposed_ns_s": exposed, "exposed_ns_over_off": {v: e / exposed["dmuon"] for v, e in
                                                                              exposed.items()}},
                "variants": total, "rank": 3}

    (tmp_path / "rank_view_n8.json").write_text(json.dumps(view(
        {"dmuon": 0.010, "dmuon-overlap-forward": 0.0005, "dmuon-overlap-backward": 0.001})))
    (tmp_path / "rank_view_n64.json").write_text(json.dumps(view(
        {"dmuon": 0.010, "dmuon-overlap-forward": 0.004, "dmuon-overlap-backward": 0.001})))
    ex = go._exposed_item(tmp_path, ok, cuda=True)
    assert ex["n8"]["verdict"] == "met" and ex["n64"]["verdict"] == "not met" and ex["verdict"] == "not met"
    assert ex["n64"]["met_by_variant"] == {"dmuon-overlap-forward": False, "dmuon-overlap-backward": True}
    (tmp_path / "rank_view_n64.json").unlink()
    ex = go._exposed_item(tmp_path, {"status": "timeout", "error": "killed after 60 s"}, cuda=True)
    assert ex["n64"]["verdict"].startswith("could not run: rank view process timeout")
    assert ex["verdict"].startswith("could not run: n64: could not run")
    lines = go.summary_lines({"status": "timeout", "error": "killed after its time limit of 180 s"})
    assert lines[-1] == "Could not run: section timeout: killed after its time limit of 180 s"


def test_rank_view_stream_waits_put_each_publication_on_its_waiter(monkeypatch):
    """``rank_view --stream-waits`` (the overlap section's exposed NS on CUDA), without a GPU:
    each publish group's issue records an event on the stream current at the issue, its first
    wait (and only that) makes the waiting stream wait on it, and PublishGroup is restored."""
    import torch

    import stream_recorder
    from dmuon.hooks.unit import PublishGroup

    log: list = []

    class Event:
        def record(self):
            log.append(("record", id(self)))

    class Stream:
        def wait_event(self, ev):
            log.append(("wait_event", id(ev)))

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: Stream())
    monkeypatch.setattr(PublishGroup, "issue", lambda self, pg: log.append(("issue", self.owner)) or "work")
    monkeypatch.setattr(PublishGroup, "wait", lambda self: log.append(("wait", self.owner)))
    issue, wait = PublishGroup.issue, PublishGroup.wait
    a, b = (PublishGroup(owner=r, is_owner=r == 0, flat=torch.zeros(1)) for r in (0, 1))
    with stream_recorder.publication_events(True):
        assert a.issue(None) == "work"
        b.issue(None)
        a.wait(), a.wait(), b.wait()
    ev_a, ev_b = log[1][1], log[3][1]
    assert log == [("issue", 0), ("record", ev_a), ("issue", 1), ("record", ev_b), ("wait_event", ev_a),
                   ("wait", 0), ("wait", 0), ("wait_event", ev_b), ("wait", 1)]
    assert (PublishGroup.issue, PublishGroup.wait) == (issue, wait)
    with stream_recorder.publication_events(False):  # the default: nothing wrapped
        assert PublishGroup.issue is issue


def _raises(opts):
    raise ValueError("broken on purpose")


def _hangs(opts):
    time.sleep(60)


def _dies(opts):
    os._exit(3)


def test_failing_hanging_and_crashing_sections_are_recorded(tmp_path):
    from gpu_sections import SuiteOptions

    opts = SuiteOptions(out=tmp_path, device="cpu", work=tmp_path)
    err = gpu_suite.run_section("a", _raises, opts, 30)
    assert err["status"] == "error" and "ValueError: broken on purpose" in err["error"]
    t0 = time.perf_counter()
    hung = gpu_suite.run_section("b", _hangs, opts, 1.0)
    assert hung["status"] == "timeout" and time.perf_counter() - t0 < 20
    assert gpu_suite.run_section("c", _dies, opts, 30)["status"] == "crashed"


def test_targets_report_missed_and_not_measured():
    ns = {"launch_table_entry": "NVIDIA H100 80GB HBM3", "models": {
        "pi0": {"variants": {"dmuon_gram_triton": {"ratio_to_torch_muon": 0.40}}},
        "qwen2.5-7b": {"variants": {"dmuon_gram_triton": {"ratio_to_torch_muon": 0.50}},
                       "large_shapes_triton": {"3584x18944": {"fraction_of_peak": 0.55},
                                               "3584x3584": {"fraction_of_peak": 0.45}}}}}
    step = {"ratios": {"dmuon_step_over_torch_muon_step": 0.7, "dmuon_total_over_adamw_total": 1.02}}
    records = {"ns_speed": {"status": "ok", "result": ns}, "step": {"status": "ok", "result": step},
               "correctness": {"status": "timeout", "error": "killed after its time limit of 90 s"}}
    got = {t["key"]: t for t in gpu_suite.evaluate_targets(records, gpu=True)}
    assert [got[k]["met"] for k in ("ns_pi0", "ns_qwen", "peak_qwen_large", "step_opt", "step_total")] == \
        [True, False, False, False, True]
    assert got["fp16_error"]["met"] is None and "timeout" in got["fp16_error"]["note"]
    assert got["table_picked_up"]["met"] is None and "not run" in got["table_picked_up"]["note"]
