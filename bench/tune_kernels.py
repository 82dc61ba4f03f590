"""Tune launch configs of the Triton symmetric-product kernels offline, per GPU and shape bucket.

For every bucket (upper bound on the output side ``m``; the reduction length does not split
buckets yet) it times each candidate config on representative products of the Gram iteration,
``X X^T`` with ``X: [batch, m, k]`` and ``R @ Z + R`` with ``[batch, m, m]`` operands, and
keeps the fastest (sum of the two medians of CUDA-event timings, after a warm-up that includes
compilation). The result is written under ``gpus[torch.cuda.get_device_name()]`` of
``dmuon/kernels/configs/launch_configs.json``; other GPUs' entries are kept. The table has no
dtype key: the winners of the iteration dtype (fp16, dmuon's default) are written.

Usage (GPU)::

    python bench/tune_kernels.py                 # tune and write the table
    python bench/tune_kernels.py --dry-run       # print the winners, write nothing

Without CUDA it only lists the candidates (a CPU cannot time GPU kernels). ``bench/gpu_suite.py``
reuses :func:`tune_bucket` and :func:`tuned_table` with buckets drawn from the model inventories.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TABLE = Path(__file__).resolve().parent.parent / "dmuon" / "kernels" / "configs" / "launch_configs.json"
# (max_m of the bucket, representative m). The last bucket is unbounded.
BUCKETS = [(512, 512), (2048, 2048), (None, 4096)]
CANDIDATES = [
    dict(block=b, block_k=bk, num_warps=w, num_stages=s)
    for b, bk, w, s in itertools.product((64, 128), (32, 64), (4, 8), (3, 4))
    if not (b == 64 and w == 8)
] + [dict(block=128, block_k=128, num_warps=8, num_stages=s) for s in (2, 3)]  # 64-192 KB of smem


def _time_ms(fn: Callable[[], object], reps: int = 10) -> float:
    """Median milliseconds of ``fn`` over ``reps`` calls after one warm-up call.

    CUDA events on a CUDA device; ``time.perf_counter`` otherwise (the suite's CPU dry run,
    where the number only exercises the code path).
    """
    fn()
    times = []
    if not torch.cuda.is_available():
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def tune_bucket(X: torch.Tensor, candidates: list[dict], reps: int = 10,
                log: Callable[[str], None] = print) -> list[dict]:
    """Time every candidate config on one bucket's representative operands.

    Args:
        X: ``[batch, m, k]`` (fp16/bf16 on CUDA; CPU only under ``TRITON_INTERPRET=1``), the
            input of the SYRK; the ``[batch, m, m]`` product ``R = X X^T`` is the operand of the
            ``R @ R + 0.5 R`` product timed beside it.
        candidates: ``LaunchConfig`` keyword dicts.
        reps: timed calls per kernel (median).
        log: where a failing candidate is reported.

    Returns:
        One record per candidate, ``{"config": dict, "ms": float | None, "error": str | None}``
        (``ms`` is SYRK + sym_mm medians, milliseconds); a candidate that fails to compile or
        launch (out of shared memory) has ``ms=None`` and its error.
    """
    from dmuon.kernels.launch_configs import LaunchConfig
    from dmuon.kernels.triton_syrk import triton_sym_mm

    R = X @ X.mT
    out = []
    for cand in candidates:
        cfg = LaunchConfig(**cand)
        try:
            ms = (_time_ms(lambda: triton_sym_mm(X, X.mT, config=cfg), reps)
                  + _time_ms(lambda: triton_sym_mm(R, R, R, beta=0.5, config=cfg), reps))
            out.append({"config": dict(cand), "ms": ms, "error": None})
        except Exception as exc:  # out of shared memory / registers for this config
            log(f"  {tuple(X.shape)} {cand}: failed ({type(exc).__name__}: {exc})")
            out.append({"config": dict(cand), "ms": None, "error": f"{type(exc).__name__}: {exc}"})
    return out


def best(records: list[dict]) -> Optional[dict]:
    """The fastest record of :func:`tune_bucket` (``None`` when every candidate failed)."""
    timed = [r for r in records if r["ms"] is not None]
    return min(timed, key=lambda r: r["ms"]) if timed else None


def tuned_table(name: str, buckets: list[dict], base: Optional[dict] = None) -> dict:
    """The launch table (schema 1, as shipped) with ``gpus[name]`` set to ``buckets``.

    Args:
        name: GPU name (``torch.cuda.get_device_name()``).
        buckets: ``{"max_m", "max_k", "block", "block_k", "num_warps", "num_stages"}`` dicts,
            the last one unbounded.
        base: the table to extend; ``None`` reads the shipped one. Other GPUs are kept.
    """
    table = json.loads(TABLE.read_text()) if base is None else json.loads(json.dumps(base))
    table["gpus"][name] = {"min_rows_for_triton": table["default"]["min_rows_for_triton"], "buckets": buckets}
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(f"no CUDA device: {len(CANDIDATES)} candidate configs, buckets {BUCKETS}; nothing tuned.")
        return
    name = torch.cuda.get_device_name()
    buckets = []
    for max_m, m in BUCKETS:
        X = torch.randn(8, m, 4 * m, device="cuda", dtype=torch.float16) / (4 * m) ** 0.5
        win = best(tune_bucket(X, CANDIDATES))
        if win is None:
            raise RuntimeError(f"tune_kernels: every candidate failed for bucket max_m={max_m} on {name}.")
        print(f"{name} bucket max_m={max_m} (m={m}): best {win['config']} {win['ms']:.3f} ms")
        buckets.append({"max_m": max_m, "max_k": None, **win["config"]})
    if args.dry_run:
        return
    TABLE.write_text(json.dumps(tuned_table(name, buckets), indent=2) + "\n")
    print(f"wrote {TABLE}")


if __name__ == "__main__":
    main()
