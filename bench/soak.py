"""Soak benchmark: per-rank resident memory over a long run of the default ``dmuon.train`` model.

Runs the job of ``python -m dmuon.train`` (same model, data, FSDP2 wrapping, optimizer
construction and LR schedule, see :mod:`dmuon.train.loop`) for ``--steps`` steps, once with
``dmuon`` and once with FSDP2 + ``torch.optim.AdamW`` on the same model, and samples every
rank's resident set size (RSS, ``/proc/self/statm``, bytes) after every step.

Reported per variant and rank:

* ``objects_step_total_tensors``: ``(step, live Python objects, live tensors)`` every
  ``OBJECT_EVERY`` steps, to tell a Python-level leak from allocator fragmentation;
* ``peak_rss_bytes``: the largest sample (and ``ru_maxrss`` of the process, which also sees
  transient peaks inside a step);
* ``growth_bytes``: median RSS of the last 10% of steps minus median RSS of the 10% of steps
  right after warm-up (``--warmup`` steps, default 10% of the run), and
  ``slope_bytes_per_step``: least-squares slope over the post-warm-up samples. A leak shows
  as a positive slope times the step count well above the allocator's noise (~1 MiB).

Usage (CPU, 2 ranks by default; the machine's cores are shared, so keep it short there)::

    python bench/soak.py --steps 500 --nproc 2 --out bench/results/soak_cpu_2r.json
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import pathlib
import platform
import resource
import statistics
import sys
import time
import warnings
from datetime import timedelta

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # run from a checkout

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from dmuon.train.ranks import launch  # noqa: E402

VARIANTS = ("dmuon", "adamw")
OBJECT_EVERY = 50  # steps between two counts of live Python objects (~20 ms each)


def rss_bytes() -> int:
    """This process's resident set size in bytes (Linux ``/proc/self/statm``, field 2)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def live_objects() -> tuple[int, int]:
    """``(Python objects tracked by gc, of which torch.Tensor)``: a Python-level leak (hooks,
    pending work, graphs kept alive) grows these, allocator fragmentation does not."""
    objs = gc.get_objects()
    with warnings.catch_warnings():  # isinstance() on torch's deprecated aliases warns
        warnings.simplefilter("ignore", FutureWarning)
        return len(objs), sum(1 for o in objs if isinstance(o, torch.Tensor))


def _rank_main(job: tuple[str, int, int, str, bool]) -> None:
    """One rank, started by :func:`dmuon.train.ranks.launch` (gloo group initialized, 1 thread)."""
    variant, steps, batch_size, result_dir, trim = job
    rank, world = dist.get_rank(), dist.get_world_size()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dmuon.train.data import PushTDemos, ensure_run_data
    from dmuon.train.loop import TrainConfig, build_optimizer
    from dmuon.train.model import Pi0Policy

    cfg = TrainConfig(optimizer=variant, steps=steps, batch_size=batch_size, plot=False)
    if rank == 0:
        ensure_run_data(cfg.data, steps=steps, global_batch=batch_size, seed=cfg.seed, progress=False)
    dist.barrier()
    demos = PushTDemos(cfg.data)
    torch.manual_seed(cfg.seed)
    model = Pi0Policy(cfg.model)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.shardable_blocks():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = build_optimizer(cfg, model, mesh, torch.device("cpu"))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, cfg.warmup)))
    samples, losses, objects, trimmed = [rss_bytes()], [], [], []
    t0 = time.perf_counter()
    for step in range(steps):
        batch = demos.batch(step, cfg.batch_size, rank, world, cfg.seed)
        loss = model(batch)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        samples.append(rss_bytes())
        if step % OBJECT_EVERY == 0 or step == steps - 1:
            objects.append((step, *live_objects()))
            if trim:  # give free heap pages back: what stays resident is live, not fragmentation
                ctypes.CDLL("libc.so.6").malloc_trim(0)
                trimmed.append((step, rss_bytes()))
    elapsed = time.perf_counter() - t0
    out = dict(rank=rank, rss_bytes=samples, losses=losses, seconds=elapsed, objects=objects,
               rss_after_malloc_trim=trimmed,
               ru_maxrss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    pathlib.Path(result_dir, f"{variant}_rank{rank}.json").write_text(json.dumps(out))
    dist.barrier()


def summarize(rss: list[int], warmup: int) -> dict:
    """Peak, post-warm-up growth and slope of one rank's RSS series (bytes, one per step)."""
    after = rss[warmup + 1:] or rss
    k = max(1, len(after) // 10)
    growth = statistics.median(after[-k:]) - statistics.median(after[:k])
    xs = list(range(len(after)))
    mx, my = statistics.fmean(xs), statistics.fmean(after)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, after)) / var if var else 0.0
    return dict(peak_rss_bytes=max(rss), growth_bytes=growth, slope_bytes_per_step=slope,
                rss_after_warmup_bytes=after[0], rss_final_bytes=rss[-1])


def run_variant(variant: str, steps: int, nproc: int, batch_size: int, tmp: pathlib.Path,
                trim: bool = False) -> list[dict]:
    launch(_rank_main, (variant, steps, batch_size, str(tmp), trim), nproc, backend="gloo",
           threads=1, timeout=timedelta(minutes=30), torchrun=False)
    return [json.loads((tmp / f"{variant}_rank{r}.json").read_text()) for r in range(nproc)]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64, help="global batch (dmuon.train's default)")
    p.add_argument("--warmup", type=int, default=None, help="default: 10%% of --steps")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", default="bench/results/soak_cpu.json")
    p.add_argument("--trim", action="store_true",
                   help="diagnostic: glibc malloc_trim(0) every %d steps and record the RSS left "
                        "(separates a leak from allocator retention; changes the raw series)" % OBJECT_EVERY)
    a = p.parse_args(argv)
    warmup = a.warmup if a.warmup is not None else max(1, a.steps // 10)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    tmp = pathlib.Path(a.out).with_suffix(".parts")
    tmp.mkdir(parents=True, exist_ok=True)
    result = dict(
        benchmark="soak", trim=a.trim, steps=a.steps, nproc=a.nproc, batch_size=a.batch_size,
        warmup=warmup,
        device="cpu", torch=torch.__version__, python=platform.python_version(),
        machine=platform.machine(), cpus=os.cpu_count(), variants={},
        note="RSS in bytes from /proc/self/statm after each step; growth = median of the last "
             "10% of post-warm-up samples minus median of the first 10%.",
    )
    for variant in a.variants.split(","):
        t0 = time.perf_counter()
        ranks = run_variant(variant, a.steps, a.nproc, a.batch_size, tmp, a.trim)
        per_rank = [dict(rank=r["rank"], ru_maxrss_bytes=r["ru_maxrss_bytes"],
                         objects_step_total_tensors=r["objects"],
                         rss_after_malloc_trim=r["rss_after_malloc_trim"],
                         **summarize(r["rss_bytes"], warmup)) for r in ranks]
        result["variants"][variant] = dict(
            wall_s=time.perf_counter() - t0, per_rank=per_rank,
            first_loss=ranks[0]["losses"][0], last_loss=ranks[0]["losses"][-1],
            rss_bytes_rank0=ranks[0]["rss_bytes"])
        for r in per_rank:
            print(f"{variant:6s} rank {r['rank']}: peak {r['peak_rss_bytes'] / 2**20:8.1f} MiB  "
                  f"growth after warm-up {r['growth_bytes'] / 2**20:+7.2f} MiB  "
                  f"slope {r['slope_bytes_per_step'] / 1024:+7.2f} KiB/step  live objects/tensors "
                  f"{r['objects_step_total_tensors'][1][1:]} -> {r['objects_step_total_tensors'][-1][1:]}",
                  flush=True)
    if {"dmuon", "adamw"} <= set(result["variants"]):
        d, w = (result["variants"][v]["per_rank"] for v in ("dmuon", "adamw"))
        result["peak_ratio_dmuon_over_adamw"] = [x["peak_rss_bytes"] / y["peak_rss_bytes"]
                                                 for x, y in zip(d, w)]
    for f in tmp.glob("*.json"):
        f.unlink()
    tmp.rmdir()
    out = pathlib.Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
