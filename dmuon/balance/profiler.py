"""Measure Newton-Schulz time per shape and batch size, cached on disk.

Times go through the optimizer's own NS path (:func:`dmuon.kernels.newton_schulz`, Gram
method, fp16, default backend), on a ``[batch, rows, cols]`` random fp32 input, as the median
of ``repeats`` timed runs after ``warmup`` untimed ones (CUDA events on GPU, a wall clock
otherwise). The cache is a JSON file keyed by ``device name | torch version | rows x cols |
batch | steps``, so a re-run on the same hardware re-uses every measurement and a new GPU or
torch version measures again. On CPU the FLOP model stands in (:func:`profile_costs` with
``measure=False``) because CPU times say nothing about the GPUs a plan is for.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from typing import Iterable, Sequence

from dmuon.balance.cost import fit_batch_costs, ns_flops

logger = logging.getLogger(__name__)

DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "dmuon", "ns_profile.json")


def device_name(device) -> str:
    """Human-readable device name used in the cache key (GPU model, or ``cpu``)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def _key(dev: str, shape: tuple[int, int], batch: int, steps: int) -> str:
    import torch

    return f"{dev}|torch {torch.__version__}|{shape[0]}x{shape[1]}|b{batch}|s{steps}"


def time_ns(shape: tuple[int, int], batch: int, *, device, steps: int = 5, warmup: int = 2,
            repeats: int = 5, seed: int = 0) -> float:
    """Median milliseconds of one batched NS of ``batch`` matrices ``[rows, cols]`` (fp32 in)."""
    import torch

    from dmuon.kernels import newton_schulz

    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(batch, *shape, generator=gen).to(device)
    cuda = torch.device(device).type == "cuda"
    times = []
    for it in range(warmup + repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            newton_schulz(x, steps=steps)
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            newton_schulz(x, steps=steps)
            ms = (time.perf_counter() - t0) * 1e3
        if it >= warmup:
            times.append(ms)
    return float(statistics.median(times))


def profile_shapes(
    shapes: Iterable[tuple[int, int]],
    *,
    device="cpu",
    batch_sizes: Sequence[int] = (1, 2, 4),
    steps: int = 5,
    cache_path: str | os.PathLike | None = DEFAULT_CACHE,
    progress: bool = True,
) -> dict[tuple[int, int], dict[int, float]]:
    """Measured ms per distinct shape and batch size, reading and extending the disk cache.

    Args:
        shapes: ``(rows, cols)`` shapes (duplicates are measured once).
        device: torch device to time on.
        batch_sizes: batch sizes to time per shape (for the batching model).
        steps: NS steps.
        cache_path: JSON cache file, or None for no cache.
        progress: show a tqdm progress bar.

    Returns:
        ``{shape: {batch: ms}}``.
    """
    dev = device_name(device)
    cache: dict[str, float] = {}
    if cache_path is not None and os.path.exists(cache_path):
        with open(cache_path) as f:
            cache = json.load(f)
    distinct = sorted({(int(r), int(c)) for r, c in shapes})
    todo = [(s, b) for s in distinct for b in batch_sizes if _key(dev, s, b, steps) not in cache]
    if todo:
        from tqdm.auto import tqdm

        for shape, batch in tqdm(todo, desc=f"dmuon: profiling NS on {dev}", disable=not progress):
            cache[_key(dev, shape, batch, steps)] = time_ns(shape, batch, device=device, steps=steps)
        if cache_path is not None:
            os.makedirs(os.path.dirname(os.path.abspath(cache_path)), exist_ok=True)
            tmp = f"{cache_path}.tmp{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump(cache, f, indent=1, sort_keys=True)
            os.replace(tmp, cache_path)  # atomic: concurrent ranks never read half a file
    return {s: {b: cache[_key(dev, s, b, steps)] for b in batch_sizes} for s in distinct}


def profile_costs(
    shapes: Sequence[tuple[int, int]],
    *,
    measure: bool,
    device="cpu",
    steps: int = 5,
    cache_path: str | os.PathLike | None = DEFAULT_CACHE,
    progress: bool = True,
) -> tuple[list[float], dict[tuple[int, int], float], str]:
    """Solver inputs for a list of matrix shapes.

    Returns:
        ``(costs, batch_overhead, unit)``: per-matrix marginal cost, per-shape fixed batch cost
        (empty for FLOPs) and the unit, ``"ms"`` when ``measure`` else ``"flops"`` (Gram FLOP
        model, :func:`dmuon.balance.cost.ns_flops`).
    """
    shapes = [(int(r), int(c)) for r, c in shapes]
    if not measure:
        per = {s: ns_flops(*s, steps=steps, method="gram") for s in set(shapes)}
        return [per[s] for s in shapes], {}, "flops"
    timings = profile_shapes(shapes, device=device, steps=steps, cache_path=cache_path,
                             progress=progress)
    fits = {s: fit_batch_costs(t) for s, t in timings.items()}
    return [fits[s][1] for s in shapes], {s: fits[s][0] for s in fits if fits[s][0] > 0}, "ms"
