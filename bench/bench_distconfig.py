"""Optimizer-step time of ``dmuon.Muon(params, distributed_config=...)`` by schedule.

4 gloo ranks (started by :func:`dmuon.train.ranks.launch`, one thread each), FSDP-style ``Shard(0)`` DTensor
matrices from ``create_dtensor_config()``; variants ``prefetch_count`` 0/1/2 x
``async_gpu_parallelism`` on/off, plus the per-matrix (unbatched) gather path, interleaved step
by step in one run; medians and spread over the timed steps; ratios against
``prefetch_count=0, async off`` (the debugging schedule). Newton-Schulz: Gram, fp32, 5 steps;
FLOPs per step ``sum(ns_flops(rows, cols, method="gram"))`` (:func:`dmuon.kernels.ns_flops`).

    python bench/bench_distconfig.py [--steps 7] [--out bench/results/distconfig_cpu.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SHAPES = [(256, 512)] * 8 + [(512, 256)] * 4 + [(384, 384)] * 4
VARIANTS = [(p, a, True) for a in (False, True) for p in (0, 1, 2)] + [(1, True, False)]


def rank_fn(job: tuple[int, str]) -> None:
    """Runs on every rank: build the matrices and one optimizer per variant, time each step;
    rank 0 writes ``{"times_ms": [[ms per timed step] per variant]}`` to ``job[1]`` (JSON)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import dmuon
    from dmuon.distconfig import create_dtensor_config

    steps, times_path = job
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    g = torch.Generator().manual_seed(0)
    fulls = [torch.randn(*s, generator=g) for s in SHAPES]
    opts, params = [], []
    for prefetch, async_, batched in VARIANTS:
        ps = [torch.nn.Parameter(distribute_tensor(f.clone(), mesh, [Shard(0)])) for f in fulls]
        cfg = dataclasses.replace(create_dtensor_config(), prefetch_count=prefetch,
                                  async_gpu_parallelism=async_)
        if not batched:  # the helpers' functions wrapped: dmuon.Muon calls them per matrix
            gather, redistribute = cfg.gather_fn, cfg.redistribute_fn
            cfg = dataclasses.replace(cfg, gather_fn=lambda *a, **k: gather(*a, **k),
                                      redistribute_fn=lambda *a, **k: redistribute(*a, **k))
        opts.append(dmuon.Muon(ps, distributed_config=cfg, lr=0.02, ns_method="gram",
                               ns_dtype=torch.float32))
        params.append(ps)
    times = [[] for _ in VARIANTS]
    for step in range(steps + 1):  # step 0: warm-up
        for v, (opt, ps) in enumerate(zip(opts, params)):
            for p in ps:
                p.grad = torch.sin(p.detach() + step)
            dist.barrier()
            t0 = time.perf_counter()
            opt.step()
            dist.barrier()
            if step:
                times[v].append((time.perf_counter() - t0) * 1e3)
    if dist.get_rank() == 0:
        Path(times_path).write_text(json.dumps(dict(times_ms=times)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--out", default=str(ROOT / "bench/results/distconfig_cpu.json"))
    args = parser.parse_args()
    import torch

    from dmuon.kernels import ns_flops
    from dmuon.train.ranks import launch

    with tempfile.TemporaryDirectory() as tmp:
        times_path = f"{tmp}/times.json"
        launch(rank_fn, (args.steps, times_path), 4, backend="gloo", threads=1,
               timeout=timedelta(seconds=540), torchrun=False)
        times = json.loads(Path(times_path).read_text())["times_ms"]  # barriers: same on every rank
    base = statistics.median(times[0])
    rows = []
    for (prefetch, async_, batched), ts in zip(VARIANTS, times):
        med = statistics.median(ts)
        rows.append(dict(prefetch_count=prefetch, async_gpu_parallelism=async_, batched_all_to_all=batched,
                         median_ms=round(med, 2), min_ms=round(min(ts), 2), max_ms=round(max(ts), 2),
                         ratio_vs_p0_sync=round(med / base, 3)))
        print(f"prefetch={prefetch} async={async_!s:5} batched={batched!s:5} median {med:8.1f} ms "
              f"[{min(ts):.1f}, {max(ts):.1f}]  x{med / base:.3f} vs prefetch=0,async=off")
    result = dict(
        device="cpu", world_size=4, backend="gloo", threads_per_rank=1,
        cpu=platform.processor() or platform.machine(), python=platform.python_version(),
        torch=torch.__version__, shapes=SHAPES, ns=dict(method="gram", dtype="float32", steps=5),
        ns_gflops_per_step=round(sum(ns_flops(r, c, method="gram") for r, c in SHAPES) / 1e9, 3),
        timed_steps=args.steps, variants=rows,
        note="one run, variants interleaved step by step; 4 ranks share 2 CPU cores, so "
             "async/prefetch gains are bounded by core count, not by communication",
    )
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
