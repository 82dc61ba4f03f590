"""Tune launch configs of the Triton symmetric-product kernels offline, per GPU and shape bucket.

For every bucket (upper bound on the output side ``m``; the reduction length does not split
buckets yet) it times each candidate config on representative products of the Gram iteration,
``X X^T`` with ``X: [m, 4m]`` and ``R @ Z + R`` with ``[m, m]`` operands, in fp16, and keeps
the fastest (median of CUDA-event timings, after a warm-up that includes compilation). The result
is written under ``gpus[torch.cuda.get_device_name()]`` of
``dmuon/kernels/configs/launch_configs.json``; other GPUs' entries are kept.

Usage (GPU)::

    python bench/tune_kernels.py                 # tune and write the table
    python bench/tune_kernels.py --dry-run       # print the winners, write nothing

Without CUDA it only lists the candidates (a CPU cannot time GPU kernels).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TABLE = Path(__file__).resolve().parent.parent / "dmuon" / "kernels" / "configs" / "launch_configs.json"
# (max_m of the bucket, representative m). The last bucket is unbounded.
BUCKETS = [(512, 512), (2048, 2048), (None, 4096)]
CANDIDATES = [
    dict(block=b, block_k=bk, num_warps=w, num_stages=s)
    for b, bk, w, s in itertools.product((64, 128), (32, 64), (4, 8), (3, 4))
    if not (b == 64 and w == 8)
]


def _time_ms(fn, reps: int = 10) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(f"no CUDA device: {len(CANDIDATES)} candidate configs, buckets {BUCKETS}; nothing tuned.")
        return
    from dmuon.kernels.launch_configs import LaunchConfig
    from dmuon.kernels.triton_syrk import triton_sym_mm, triton_syrk

    name = torch.cuda.get_device_name()
    buckets = []
    for max_m, m in BUCKETS:
        X = torch.randn(8, m, 4 * m, device="cuda", dtype=torch.float16) / (4 * m) ** 0.5
        R = X @ X.mT
        results = []
        for cand in CANDIDATES:
            cfg = LaunchConfig(**cand)
            try:
                ms = _time_ms(lambda: triton_syrk(X, config=cfg)) + _time_ms(lambda: triton_sym_mm(R, R, R, beta=0.5, config=cfg))
            except Exception as exc:  # out of shared memory / registers for this config
                print(f"  m={m} {cand}: failed ({type(exc).__name__})")
                continue
            results.append((ms, cand))
        ms, best = min(results, key=lambda r: r[0])
        print(f"{name} bucket max_m={max_m} (m={m}): best {best} {ms:.3f} ms")
        buckets.append({"max_m": max_m, "max_k": None, **best})
    if args.dry_run:
        return
    table = json.loads(TABLE.read_text())
    table["gpus"][name] = {"min_rows_for_triton": table["default"]["min_rows_for_triton"], "buckets": buckets}
    TABLE.write_text(json.dumps(table, indent=2) + "\n")
    print(f"wrote {TABLE}")


if __name__ == "__main__":
    main()
