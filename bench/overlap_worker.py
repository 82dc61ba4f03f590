"""The worker processes of the GPU suite's ``overlap`` section (``bench/gpu_overlap.py``, issue
46): each task runs in a fresh interpreter, so that ``TORCH_CUDA_SANITIZER`` and
``PYTORCH_NO_CUDA_MEMORY_CACHING`` are read before CUDA starts and a hang costs one item.

* ``parity``: world size 1 (NCCL on CUDA, gloo on CPU), FSDP2 per block + dmuon: the final
  weights of every mode against ``off`` (a second ``off`` is the A/A control), also with
  delayed jobs; peak memory per mode (CUDA); the stream recorder
  (:class:`stream_recorder.StreamRecorder`, jobs delayed) over ``forward`` and ``backward`` at
  the default prefetch of 1 and ``forward`` at prefetch 2, and over ``backward`` with a clip
  that discards every speculation; a 2-step profiler trace.
* ``rank_view``: :func:`rank_view.run` at N = 8 and 64 with the no-NS baseline (on CUDA with
  ``stream_waits``: see :class:`rank_view.ViewConfig`).
* ``sanitizer``: FSDP2 + AdamW (control) and each mode, 3 steps each, under the sanitizer.

    python bench/overlap_worker.py --task parity --device cpu --out /tmp/p.json
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from stream_recorder import StreamRecorder, delayed_jobs

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
MODES = ("off", "forward", "backward")
#: Model of the world-size-1 runs (InventoryModel, ``blocks`` FSDP2 units of ``per_block``
#: square matrices): on CUDA 32 matrices of 1024 x 1024 (fp32 NS ~4 ms on an H100), tokens
#: enough that forward is not all launch latency; tiny under the sanitizer and on CPU.
SIZES = {"cuda": dict(blocks=8, per_block=4, width=1024, batch=8, tokens=256),
         "sanitizer": dict(blocks=3, per_block=2, width=128, batch=2, tokens=16),
         "cpu": dict(blocks=3, per_block=2, width=32, batch=2, tokens=8)}
STEPS = 4
#: The recorder's runs: (name, mode, prefetch, max_norm of dmuon.clip_grad_norm_ or None),
#: every job delayed. At prefetch 2 the step's own issue publishes units 0 and 1 together,
#: where a publication of unit 0 could be ordered behind unit 1's job.
STREAM_RUNS = (("forward", "forward", 1, None), ("backward", "backward", 1, None),
               ("forward_prefetch2", "forward", 2, None))
#: A clip that binds at every step (max_norm far under this model's gradient norm; the section
#: checks that nothing was kept): every speculation is discarded and recomputed. Run without
#: delays (a delay would occupy the worker thread for a discarded job too).
CLIP_RUN = ("backward_clip", "backward", 1, 1e-3)
#: The rank view: the suite's 194 M Pi0-style policy (224-pixel image, 16 text tokens, 50
#: actions), 8 samples per rank as in issue 46's short-context example, bf16; tiny on CPU.
RANK_VIEW = {"cuda": ["--model", "gpu", "--batch-per-rank", "8", "--rounds", "2", "--block-steps", "2", "--bf16",
                      "--stream-waits"],
             "cpu": ["--model", "blocks2", "--width", "32", "--blocks", "3", "--batch-per-rank", "1",
                     "--rounds", "1", "--block-steps", "1"]}
RANK_VIEW_VARIANTS = ("dmuon", "dmuon-overlap-forward", "dmuon-overlap-backward", "dmuon-no-ns")


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


def _build(mesh, device: str, size: dict, mode: str | None, prefetch: int = 1):
    """FSDP2 per block + dmuon with ``Muon(overlap=mode)`` (fp32 standard NS, Muon's
    coefficients), or FSDP2 + AdamW alone with ``mode=None``; the same weights every time.

    Newton-Schulz runs one matrix per batch (``max_batch_bytes``) in every mode: ``off``
    batches all same-shape matrices of the rank, an overlapped job those of one publish group,
    and cuBLAS may pick another kernel (another rounding) for another batch count; bitwise
    parity must test the schedule, not that choice (DESIGN.md promises no equality across
    kernel schedules)."""
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

    dmuon.dedicate_params(model, mesh, group_cost=0.0, prefetch=prefetch)
    return model, dmuon.Muon(model, lr=0.02, adamw_lr=0.01, weight_decay=0.1, ns_method="standard",
                             ns_dtype=torch.float32, ns_coefficients="muon", overlap=mode,
                             max_batch_bytes=size["width"] ** 2 * 4)


def _batch(device: str, size: dict, step: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    return {"x": torch.randn(size["batch"], size["tokens"], size["width"], generator=g).to(device)}


def _train(model, opt, device: str, size: dict, steps: int, clip: float | None = None) -> list[float]:
    losses = []
    for step in range(steps):
        loss = model(_batch(device, size, step))
        loss.backward()
        losses.append(loss.item())
        if clip is not None:
            import dmuon

            dmuon.clip_grad_norm_(model, clip)
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


def task_parity(device: str, store: str, trace: str | None) -> dict:
    """World size 1: parity of every mode against ``off`` (and with delayed jobs), peak memory
    per mode (CUDA), the stream recorder (:data:`STREAM_RUNS`, jobs delayed) and, with
    ``trace``, the profiler trace of 2 ``forward`` steps."""
    import torch

    mesh = _init(device, store)
    size = SIZES["cuda" if device == "cuda" else "cpu"]
    cuda = device == "cuda"
    out: dict[str, Any] = {"size": size, "steps": STEPS, "caching_allocator": os.environ.get(
        "PYTORCH_NO_CUDA_MEMORY_CACHING") != "1", "ns": "fp32, standard, Muon's coefficients, one matrix per batch",
                           "runs": {}}
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
        for name, mode, prefetch, clip in (*STREAM_RUNS, CLIP_RUN):
            model, opt = _build(mesh, device, size, mode, prefetch)
            with delayed_jobs(device) if clip is None else contextlib.nullcontext():
                rec = StreamRecorder(model, opt, device)
                try:
                    _train(model, opt, device, size, 3, clip)
                finally:
                    rec.remove()  # before the reader's wait below, which is no forward's
                opt.wait_pending()
            row = {"mode": mode, "prefetch": prefetch, "clip": clip, **rec.verdicts(),
                   "unit_waits": rec.unit_waits()[:2 * size["blocks"]], "kept_speculations": opt.overlap_stats()}
            if clip is not None:  # its timeline has no delays: its ordering checks mean nothing
                row["checks"] = {k: v for k, v in row["checks"].items() if not k.startswith("unit_starts")}
                out["clip"] = row
            else:
                out["streams"][name] = row
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


if __name__ == "__main__":
    worker_main()
