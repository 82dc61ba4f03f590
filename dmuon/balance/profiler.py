"""Measure Newton-Schulz and forward matmul times per shape, cached on disk.

Times are medians in ms (CUDA events on GPU, a wall clock otherwise). The JSON cache is keyed by
``device name | torch version | shape | batch or tokens``, so a new GPU or torch measures again.
With ``measure=False`` (CPU) the FLOP model stands in.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Iterable, Sequence

from dmuon.balance.cost import fit_batch_costs, flop_costs

DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "dmuon", "ns_profile.json")


def device_name(device) -> str:
    """The device's name in the cache key (GPU model, or ``cpu``)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def _key(dev: str, shape: tuple[int, int], batch: int, steps: int) -> str:
    import torch

    return f"{dev}|torch {torch.__version__}|{shape[0]}x{shape[1]}|b{batch}|s{steps}"


def _median_ms(run, device, warmup: int, repeats: int) -> float:
    """Median ms of ``run()`` over ``repeats`` timed calls after ``warmup`` untimed ones."""
    import torch

    cuda = torch.device(device).type == "cuda"
    times = []
    for it in range(warmup + repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            run()
            ms = (time.perf_counter() - t0) * 1e3
        if it >= warmup:
            times.append(ms)
    return float(statistics.median(times))


def _cached(cache_path, measure: dict, desc: str | None = None) -> dict[str, float]:
    """The cache with every key of ``measure`` (``{key: () -> ms}``) in it: missing ones are
    measured and the file replaced atomically (concurrent ranks never read half a file)."""
    cache: dict[str, float] = {}
    if cache_path is not None and os.path.exists(cache_path):
        with open(cache_path) as f:
            cache = json.load(f)
    todo = [k for k in measure if k not in cache]
    if todo:
        from tqdm.auto import tqdm

        for k in tqdm(todo, desc=desc, disable=desc is None):
            cache[k] = measure[k]()
        if cache_path is not None:
            os.makedirs(os.path.dirname(os.path.abspath(cache_path)), exist_ok=True)
            tmp = f"{cache_path}.tmp{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump(cache, f, indent=1, sort_keys=True)
            os.replace(tmp, cache_path)
    return cache


def time_ns(shape: tuple[int, int], batch: int, *, device, steps: int = 5, warmup: int = 2,
            repeats: int = 5, seed: int = 0) -> float:
    """Median ms of one :func:`dmuon.kernels.newton_schulz` of a random fp32 ``[batch, rows,
    cols]``."""
    import torch

    from dmuon.kernels import newton_schulz

    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(batch, *shape, generator=gen).to(device)
    return _median_ms(lambda: newton_schulz(x, steps=steps), device, warmup, repeats)


def profile_shapes(
    shapes: Iterable[tuple[int, int]],
    *,
    device="cpu",
    batch_sizes: Sequence[int] = (1, 2, 4),
    steps: int = 5,
    cache_path: str | os.PathLike | None = DEFAULT_CACHE,
    progress: bool = True,
) -> dict[tuple[int, int], dict[int, float]]:
    """``{shape: {batch: ms}}`` of NS per distinct ``(rows, cols)`` shape and batch size on
    ``device``, read from and added to the JSON cache ``cache_path`` (None: no cache);
    ``progress`` shows a tqdm bar."""
    dev = device_name(device)
    distinct = sorted({(int(r), int(c)) for r, c in shapes})
    todo = {_key(dev, s, b, steps): (lambda s=s, b=b: time_ns(s, b, device=device, steps=steps))
            for s in distinct for b in batch_sizes}
    cache = _cached(cache_path, todo, f"dmuon: profiling NS on {dev}" if progress else None)
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
    """Solver inputs ``(costs, batch_overhead, unit)`` for matrix shapes: per-matrix marginal
    cost, per-shape fixed batch cost (:func:`dmuon.balance.cost.fit_batch_costs`) and ``"ms"``
    when ``measure``, else the FLOP model (:func:`dmuon.balance.cost.flop_costs`), ``{}`` and
    ``"flops"``."""
    shapes = [(int(r), int(c)) for r, c in shapes]
    if not measure:
        return flop_costs(shapes, steps=steps), {}, "flops"
    timings = profile_shapes(shapes, device=device, steps=steps, cache_path=cache_path,
                             progress=progress)
    fits = {s: fit_batch_costs(t) for s, t in timings.items()}
    return [fits[s][1] for s in shapes], {s: fits[s][0] for s in fits if fits[s][0] > 0}, "ms"


def time_matmul(shape: tuple[int, int], tokens: int, *, device, warmup: int = 2, repeats: int = 5,
                seed: int = 0) -> float:
    """Median ms of the forward matmul ``x[tokens, cols] @ W[rows, cols].T`` (bf16 on CUDA,
    fp32 elsewhere)."""
    import torch

    cuda = torch.device(device).type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(tokens, shape[1], generator=gen).to(device, dtype)
    w = torch.randn(shape[0], shape[1], generator=gen).to(device, dtype)
    return _median_ms(lambda: x @ w.T, device, warmup, repeats)


def unit_times(
    unit_shapes: Sequence[Sequence[tuple[int, int]]],
    *,
    tokens: int,
    measure: bool,
    device="cpu",
    cache_path: str | os.PathLike | None = DEFAULT_CACHE,
) -> tuple[list[float], list[float], str]:
    """Forward and backward (twice forward) time per unit (FSDP2 block), for the deadlines of
    :mod:`dmuon.balance.deadline`. Only the dedicated matrices count, each a linear layer over
    ``tokens`` tokens: lower bounds, so the exposed time is overestimated, never hidden.

    Args:
        unit_shapes: per unit, forward order, the ``(rows, cols)`` of its matrices (an expert
            stack counts as one matrix).
        tokens: tokens through each matrix per micro-batch on one GPU.
        measure: time each distinct shape's matmul on ``device`` (cached in ``cache_path``),
            in ms; else the FLOP model ``2 tokens rows cols`` per matrix, in FLOPs.

    Returns:
        ``(forward, backward, unit)``: per-unit times, ``"ms"`` or ``"flops"``.

    Raises:
        ValueError: when ``tokens < 1``.
    """
    if int(tokens) < 1:
        raise ValueError(f"dmuon: unit_times(tokens={tokens!r}) must be >= 1 (tokens per GPU "
                         f"per micro-batch through each matrix)")
    tokens = int(tokens)
    if not measure:
        fwd = [float(sum(2.0 * tokens * r * c for r, c in shapes)) for shapes in unit_shapes]
        return fwd, [2.0 * f for f in fwd], "flops"
    import torch

    dev = device_name(device)

    def key(s):
        return f"{dev}|torch {torch.__version__}|matmul {s[0]}x{s[1]}|t{tokens}"

    distinct = sorted({(int(r), int(c)) for shapes in unit_shapes for r, c in shapes})
    cache = _cached(cache_path, {key(s): (lambda s=s: time_matmul(s, tokens, device=device))
                                 for s in distinct})
    fwd = [float(sum(cache[key((int(r), int(c)))] for r, c in shapes)) for shapes in unit_shapes]
    return fwd, [2.0 * f for f in fwd], "ms"
