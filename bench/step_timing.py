"""Timing one step of ``bench/bench_step.py``: per-phase times, dmuon's profiler labels, chrome traces.

A step is ``loss = model(batch)`` (forward), ``loss.backward()`` (backward), ``opt.step()`` +
``opt.zero_grad()`` (step). On CPU the phases are timed by the host clock; on CUDA by CUDA events
recorded on the current stream at the phase boundaries and read after the step, so the host
never synchronises between phases. :func:`switch_variant` resets the CUDA allocator between
variants; :func:`write_traces` writes one ``torch.profiler`` chrome trace per variant.
"""

from __future__ import annotations

import pathlib
import time

import torch
import torch.distributed as dist

#: Labels whose inclusive CPU time the profiled step reports (dmuon's ``record_function``
#: names; ``vanilla_*`` are :class:`dmuon.train.baselines.VanillaMuon`'s).
LABELS = ("dmuon::step_check", "dmuon::step_check_wait", "dmuon::pre_forward", "dmuon::pre_backward", "dmuon::reduce_bucket", "dmuon::all_reduce",
          "dmuon::finish_backward", "dmuon::optimizer_step", "dmuon::newton_schulz", "dmuon::adamw",
          "dmuon::publish_after_step", "dmuon::publish", "dmuon::vanilla_all_gather",
          "dmuon::vanilla_newton_schulz", "dmuon::vanilla_adamw")
NS_LABELS = ("dmuon::newton_schulz", "dmuon::vanilla_newton_schulz")


def label_times(prof) -> dict[str, float]:
    """Inclusive CPU seconds per dmuon label recorded by ``prof`` (0-size labels omitted)."""
    out: dict[str, float] = {}
    for evt in prof.key_averages():
        if evt.key in LABELS:
            out[evt.key] = out.get(evt.key, 0.0) + evt.cpu_time_total * 1e-6
    return out


def drain(model) -> None:
    """Wait for dmuon's publications still in flight. c10d records a collective's end in the
    profiler from gloo's worker thread when it completes; one still running when the profiler
    stops crashed rank 0 (SIGSEGV) in two runs, both right after a profiled dmuon step whose
    broadcasts were in flight (with Kineto, and without it)."""
    state = getattr(model, "_dmuon_state", None)
    for group in getattr(state, "groups", ()):
        if group.work is not None:
            group.work.wait()
    # The step check's all-reduce, issued at the end of opt.step() under FSDP2 (issue 25), is
    # in flight when the "step" phase's profiler stops too: waited for here, not settled (the
    # next forward still compares the counts). A 16-round 4-rank run and the 2-round tiny test
    # each died once with "malloc(): unsorted double linked list corrupted" before this wait.
    pending = getattr(getattr(state, "step_check", None), "_pending", None)
    if pending is not None:
        pending[0].wait()


def timed_step(model, opt, batch, device: torch.device, profile: bool = False) -> dict:
    """One step, timed per phase (CPU: wall clock; CUDA: CUDA events recorded on the current
    stream between the phases, read after the step, so the host never waits between phases);
    with ``profile`` each phase also runs under
    ``torch.profiler`` and the record carries ``label_<name>_<phase>`` (seconds inside that
    dmuon ``record_function`` label) and ``ns``. A profiled step's wall times carry the
    profiler's overhead: the caller does not count them as measured."""
    # torch's CPU profiler without Kineto (use_kineto=False): no libkineto in the crash path
    # (see drain) and no USDT lines on stderr.
    from torch.autograd.profiler import profile as torch_profile

    cuda = device.type == "cuda"
    events = [torch.cuda.Event(enable_timing=True) for _ in range(4)] if cuda else []
    host: list[float] = []

    def mark() -> None:  # phase boundary: a CUDA event on the current stream, or the host clock
        if cuda:
            events[len(host)].record()
        host.append(time.perf_counter())

    labels: dict[str, float] = {}

    def phase(name: str, fn):
        if not profile:
            return fn()
        with torch_profile(use_kineto=False) as prof:
            out = fn()
            drain(model)
        for key, s in label_times(prof).items():
            labels[f"label_{key.removeprefix('dmuon::')}_{name}"] = s
        return out

    def step():
        opt.step()
        opt.zero_grad(set_to_none=True)

    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start_bytes = torch.cuda.memory_allocated(device)
    mark()
    loss = phase("forward", lambda: model(batch))
    mark()
    phase("backward", loss.backward)
    mark()
    phase("step", step)
    mark()
    if cuda:  # elapsed_time is in ms, between events on the same stream
        events[-1].synchronize()
        t = [0.0] + [events[0].elapsed_time(e) * 1e-3 for e in events[1:]]
    else:
        t = [h - host[0] for h in host]
    rec = {"forward": t[1] - t[0], "backward": t[2] - t[1], "step": t[3] - t[2], "total": t[3] - t[0],
           "loss": float(loss.detach())}
    if device.type == "cuda":  # bytes: see _summarize
        rec["transient_peak_bytes"] = float(torch.cuda.max_memory_allocated(device) - start_bytes)
        rec["alloc_delta_bytes"] = float(torch.cuda.memory_allocated(device) - start_bytes)
    if profile:
        rec.update(labels)
        rec["ns"] = sum(s for k, s in labels.items() if any(k == f"label_{n.removeprefix('dmuon::')}_step"
                                                            for n in NS_LABELS))
    return rec


def switch_variant(device: torch.device) -> None:
    """Before a variant's block on CUDA: finish the previous block's work and return its cached
    blocks, so each variant starts from the same allocator state (the H100 run of 2026-11-22
    had AdamW's forward 52% faster than torch_muon's identical forward, after torch_muon's
    10.5 GB peak against AdamW's 6.9 GB); peak statistics restart. Nothing to do on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def write_traces(models: dict, opts: dict, variants: tuple[str, ...], get_batch, next_batch: dict,
                  device: torch.device, trace_dir: str, trace_steps: int, rank: int) -> dict | None:
    """One ``torch.profiler`` chrome trace per variant, written by rank 0 as
    ``trace_dir/trace_<variant>.json.gz``: one untraced step after the switch, then
    ``trace_steps`` steps traced (CPU activity, and CUDA on a GPU). Every rank steps (the
    collectives need them all); dmuon's in-flight publications are waited for before the
    profiler stops (see :func:`drain`).

    Returns:
        On rank 0 ``{variant: {"file": name, "bytes": gzipped size}}``; ``None`` elsewhere.
    """
    import contextlib
    import gzip
    import shutil
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    folder = pathlib.Path(trace_dir)
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for variant in variants:
        switch_variant(device)
        for k in range(1 + trace_steps):
            if k == 1:
                prof = profile(activities=acts) if rank == 0 else contextlib.nullcontext()
                prof.__enter__()
            timed_step(models[variant], opts[variant], get_batch(next_batch[variant]), device)
            next_batch[variant] += 1
        drain(models[variant])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        prof.__exit__(None, None, None)
        if rank == 0:
            name = f"trace_{variant}.json.gz"
            with tempfile.TemporaryDirectory() as tmp:
                raw = pathlib.Path(tmp) / "trace.json"
                prof.export_chrome_trace(str(raw))
                with raw.open("rb") as src, gzip.open(folder / name, "wb") as dst:
                    shutil.copyfileobj(src, dst)
            out[variant] = {"file": name, "bytes": (folder / name).stat().st_size, "steps": trace_steps}
    return out if rank == 0 else None
