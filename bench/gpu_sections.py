"""The measuring sections of ``bench/gpu_suite.py``: correctness, launch-config tuning, NS speed, step.

Each section is a function ``(opts: SuiteOptions) -> dict`` that the suite runs in its own
forked process under a time limit; the dict goes into the section's JSON file. They reuse the
project's benchmark code: the inventories of :mod:`dmuon.balance.inventories`, the variants,
FLOP counts and peak table of ``bench_newton_schulz.py``, the tuner of ``tune_kernels.py`` and
the step benchmark of ``bench_step.py``.

References (independent of the code under test): a float64 standard Newton-Schulz iteration
with the same coefficients (``_ns_float64``, textbook quintic iteration, per matrix) and
``torch.optim.Muon``'s own bf16 iteration (``torch.optim._muon._zeropower_via_newtonschulz``).
Errors are relative Frobenius errors ``||out - ref|| / ||ref||`` (dimensionless).

On ``device="cpu"`` (the dry run) shapes are tiny and Triton runs under ``TRITON_INTERPRET=1``,
which the suite sets before triton is first imported; CPU times exercise the code, nothing more.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Callable

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))

from bench_newton_schulz import MUON, _model_flops, _peak, _variants  # noqa: E402
from inventories import INVENTORY_NAMES  # noqa: E402
from inventories import inventory as scaled_inventory  # noqa: E402

from dmuon.kernels import newton_schulz, ns_flops, orthogonalize_by_shape, resolve_coefficients  # noqa: E402

#: Relative Frobenius error of one Triton symmetric product vs float64, per input dtype: a few
#: units of roundoff of the output dtype (fp16 2^-11, bf16 2^-8); accumulation is fp32. The
#: same table as tests/test_kernels_triton.py.
PRODUCT_TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}
#: A product's error may also be this many times the error of storing the exact (float64)
#: product in the output dtype: no kernel that writes fp16 can do better. It matters for fp16
#: at large ``m``: with ``||X||_F = 1`` the off-diagonal entries of ``X X^T`` are about
#: ``1 / (m sqrt(n))``, below fp16's smallest normal (6.1e-5), where fewer mantissa bits remain
#: (the first H100 run: 3584 x 18944 gave 3.4e-3 for the kernel and for torch's fp16 product).
ROUNDING_FACTOR = 1.5
#: Triton Gram NS error may be this many times the torch Gram path's (+1e-3): keeping one
#: triangle and mirroring measured 1.2-1.9x torch's error under the interpreter (see
#: tests/test_kernels_triton.py).
NS_FACTOR = 2.5
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
#: Awkward shapes on the GPU: a row, a column, non-multiples of 16 (both orientations), batched.
AWKWARD_CUDA = [(1, 4096), (4096, 1), (257, 1000), (1000, 257), (1153, 4303), (4, 300, 700), (3, 517, 517)]
AWKWARD_CPU = [(1, 40), (20, 36), (2, 12, 20)]
#: Candidates timed on the CPU dry run (small tiles keep the interpreter fast).
CPU_CANDIDATES = [dict(block=16, block_k=16, num_warps=1, num_stages=1),
                  dict(block=32, block_k=32, num_warps=1, num_stages=1)]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SuiteOptions:
    """What the suite runs.

    Args:
        out: results folder (at most 8 files are written there).
        device: ``"cuda"`` (the real run) or ``"cpu"`` (dry run: tiny shapes, Triton interpreter).
        quick: the ~2-minute subset (fewer shapes, candidates and steps).
        install_table: on CUDA, also write the tuned launch table into
            ``dmuon/kernels/configs/launch_configs.json`` so the later sections run with it.
        work: scratch folder for per-section records (not ``out``).
        sync_debug: on CUDA, the ``step`` and ``rank_view`` sections also run one dmuon step
            under ``torch.cuda.set_sync_debug_mode("warn")`` (implicit host synchronisations
            counted) and the step section writes its CUDA-timeline profile as
            ``step_trace.json`` into ``out``.
    """

    out: Path
    device: str = "cuda"
    quick: bool = False
    install_table: bool = True
    work: Path = Path("/tmp")
    sync_debug: bool = False

    def __post_init__(self) -> None:
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"gpu_suite: device={self.device!r}; choose 'cuda' or 'cpu'.")

    def torch_device(self) -> torch.device:
        """The device; raises RuntimeError when CUDA is asked for and absent."""
        if self.device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("gpu_suite: --device cuda but torch.cuda.is_available() is False on this "
                               "machine; run with --device cpu for the dry run.")
        return torch.device(self.device)


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm().clamp(min=1e-300)).item()


def _ns_float64(G: torch.Tensor, coeffs) -> torch.Tensor:
    """Textbook standard quintic Newton-Schulz in float64, each matrix of a batch on its own."""
    if G.dim() == 3:
        return torch.stack([_ns_float64(g, coeffs) for g in G])
    X = G.double()
    tall = X.shape[0] > X.shape[1]
    X = X.T if tall else X
    X = X / X.norm().clamp(min=1e-300)
    for a, b, c in coeffs:
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


def _torch_muon_bf16(G: torch.Tensor) -> torch.Tensor:
    from torch.optim._muon import _zeropower_via_newtonschulz

    if G.dim() == 3:
        return torch.stack([_torch_muon_bf16(g) for g in G])
    return _zeropower_via_newtonschulz(G, MUON, 5, 1e-7)


# ----------------------------------------------------------------------------- environment

def environment(opts: SuiteOptions) -> dict:
    """GPU name, memory, driver/CUDA, torch and triton versions (and the host)."""
    import triton

    env = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "triton": triton.__version__, "host": platform.node(), "cpu_count": os.cpu_count(),
           "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET"), "device": opts.device}
    if opts.device == "cuda":
        dev = opts.torch_device()
        props = torch.cuda.get_device_properties(dev)
        env.update(gpu=props.name, gpu_memory_bytes=props.total_memory, sm_count=props.multi_processor_count,
                   capability=f"{props.major}.{props.minor}", peak_fp16_dense_flops=_peak(dev))
        try:  # a tuple (major, minor, patch) in torch 2.x, an int in older releases
            v = torch.cuda.nccl.version()
            env["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except (AttributeError, RuntimeError) as exc:
            env["nccl"] = f"unavailable ({exc})"
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,power.limit",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
            env["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
        except (OSError, subprocess.SubprocessError) as exc:
            env["nvidia_smi"] = f"unavailable ({exc})"
    else:
        env.update(gpu=None, peak_fp16_dense_flops=None)
    return env


# ----------------------------------------------------------------------------- correctness

def correctness_shapes(device: str, quick: bool) -> list[dict]:
    """The shapes checked: every distinct Muon shape of the Pi0 and Qwen2.5-7B inventories
    (with how many matrices have it) and the awkward ones; tiny awkward shapes on CPU."""
    from dmuon.balance.inventories import inventory

    if device == "cpu":
        shapes = AWKWARD_CPU[:2] if quick else AWKWARD_CPU
        return [{"source": "awkward", "shape": list(s), "count": 1} for s in shapes]
    cases = []
    for name in INVENTORY_NAMES:
        counts = Counter(shape for _, shape in inventory(name))
        cases += [{"source": name, "shape": list(s), "count": c} for s, c in counts.items()]
    awkward = AWKWARD_CUDA[::2] if quick else AWKWARD_CUDA
    return cases + [{"source": "awkward", "shape": list(s), "count": 1} for s in awkward]


def check_shape(shape: list[int], device: torch.device, coefficient_sets: tuple[str, ...] = ("muon",),
                seed: int = 0) -> dict:
    """Errors of the Triton kernels and the Gram NS paths on one shape, against float64.

    Per dtype (fp16, bf16): the Triton SYRK ``X X^T`` (``X`` the oriented input, ``m <= n``)
    against float64 and against torch's product in that dtype, whether it is exactly
    symmetric; the Gram NS (5 steps, each coefficient set) with the Triton and the torch
    backend against a float64 iteration with the same coefficients. Beside them,
    ``torch.optim.Muon``'s bf16 iteration against the float64 Muon-coefficient iteration.

    Args:
        shape: ``[m, n]`` or ``[batch, m, n]``.
        device: ``cuda`` (or ``cpu`` under ``TRITON_INTERPRET=1``).
        coefficient_sets: names for :func:`dmuon.kernels.resolve_coefficients`.
        seed: input seed (fresh normal input; never zeros).

    Returns:
        ``{"errors": {...}, "checks": {name: bool}, "fp16_gram_err", "torch_muon_bf16_err"}``;
        the checks are the tolerances of :data:`PRODUCT_TOL` (or :data:`ROUNDING_FACTOR` times the
        error of rounding the float64 product to the dtype, whichever is larger) and :data:`NS_FACTOR`.
    """
    from dmuon.kernels.triton_syrk import triton_sym_mm

    gen = torch.Generator(device="cpu").manual_seed(seed)
    G = torch.randn(shape, generator=gen).to(device)
    X = G if G.shape[-2] <= G.shape[-1] else G.mT
    X = X / X.norm(dim=(-2, -1), keepdim=True)
    refs = {c: _ns_float64(G, resolve_coefficients(c, 5)) for c in coefficient_sets}
    if "muon" not in refs:
        refs["muon"] = _ns_float64(G, resolve_coefficients("muon", 5))
    errors: dict = {"torch_muon_bf16": _rel(_torch_muon_bf16(G), refs["muon"])}
    checks: dict[str, bool] = {}
    X64 = X.double()
    syrk_ref = X64 @ X64.mT
    for dname, dtype in DTYPES.items():
        Xd = X.to(dtype)
        S = triton_sym_mm(Xd, Xd.mT)
        e = {"syrk_vs_f64": _rel(S, syrk_ref), "syrk_vs_torch": _rel(S, (Xd @ Xd.mT).double()),
             "syrk_symmetric": bool(torch.equal(S, S.mT)), "syrk_finite": bool(torch.isfinite(S).all()),
             "output_rounding": _rel(syrk_ref.to(dtype), syrk_ref)}
        e["syrk_tol"] = max(PRODUCT_TOL[dtype], ROUNDING_FACTOR * e["output_rounding"])
        checks[f"{dname}_syrk"] = (e["syrk_finite"] and e["syrk_symmetric"]
                                   and e["syrk_vs_f64"] <= e["syrk_tol"])
        for c in coefficient_sets:
            kw = dict(coefficients=c, method="gram", dtype=dtype)
            tri = newton_schulz(G, backend="triton", **kw)
            ref_torch = newton_schulz(G, backend="torch", **kw)
            e[f"gram_triton_{c}"] = _rel(tri, refs[c])
            e[f"gram_torch_{c}"] = _rel(ref_torch, refs[c])
            e[f"triton_vs_torch_{c}"] = _rel(tri, ref_torch.double())
            checks[f"{dname}_gram_{c}"] = bool(torch.isfinite(tri).all()) and (
                e[f"gram_triton_{c}"] <= NS_FACTOR * e[f"gram_torch_{c}"] + 1e-3)
        errors[dname] = e
    fp16_gram = max(errors["float16"]["gram_triton_muon"], errors["float16"]["gram_torch_muon"]) \
        if "muon" in coefficient_sets else None
    return {"errors": errors, "checks": checks, "fp16_gram_err": fp16_gram,
            "torch_muon_bf16_err": errors["torch_muon_bf16"]}


def correctness(opts: SuiteOptions) -> dict:
    """:func:`check_shape` on every shape of :func:`correctness_shapes`, fp16 and bf16.

    The target "fp16 Gram error <= bf16 Muon error" is checked per inventory shape with Muon's
    coefficients on both sides (same function approximated), taking the larger of the Triton
    and the torch fp16 Gram errors.
    """
    device = opts.torch_device()
    coefficient_sets = ("muon",) if (opts.quick or opts.device == "cpu") else ("muon", "polar_express")
    rows = []
    for case in correctness_shapes(opts.device, opts.quick):
        res = check_shape(case["shape"], device, coefficient_sets)
        rows.append({**case, **res, "fp16_gram_le_bf16_muon": res["fp16_gram_err"] <= res["torch_muon_bf16_err"]})
        if device.type == "cuda":
            torch.cuda.empty_cache()
    failed = [(r["source"], r["shape"], k) for r in rows for k, ok in r["checks"].items() if not ok]
    inventory_rows = [r for r in rows if r["source"] != "awkward"]
    return {"coefficient_sets": list(coefficient_sets), "tolerances": {
                "syrk_vs_f64": {k: f"<= max({PRODUCT_TOL[v]}, {ROUNDING_FACTOR} x output rounding)"
                                for k, v in DTYPES.items()},
                "gram_triton_vs_f64": f"<= {NS_FACTOR} x torch Gram error + 1e-3"},
            "rows": rows, "failed_checks": failed, "all_checks_pass": not failed,
            "target_fp16_gram_le_bf16_muon": {
                "shapes": len(inventory_rows) if inventory_rows else len(rows),
                "met": all(r["fp16_gram_le_bf16_muon"] for r in (inventory_rows or rows)),
                "worst_ratio": max((r["fp16_gram_err"] / r["torch_muon_bf16_err"] for r in (inventory_rows or rows)),
                                   default=None)}}


# ----------------------------------------------------------------------------- tuning

def tuning_buckets(device: str, quick: bool) -> list[dict]:
    """Buckets of the launch table and, per bucket, the operands to time: the inventory shape
    (oriented ``m <= n``, ``m`` at least the Triton threshold) with the most NS FLOPs in it,
    stacked as the batching does (up to 8 matrices and 1 GiB of fp16)."""
    import tune_kernels

    if device == "cpu":
        reps = [(32, (2, 12, 20)), (None, (1, 40, 72))]
        return [{"max_m": mm, "batch": b, "m": m, "k": k, "source": "cpu dry run"} for mm, (b, m, k) in reps]
    from dmuon.balance.inventories import inventory
    from dmuon.kernels.launch_configs import load_launch_table

    min_rows = load_launch_table().default.min_rows_for_triton
    counts: Counter = Counter()
    for name in INVENTORY_NAMES:
        for _, (r, c) in inventory(name):
            counts[(min(r, c), max(r, c), name)] += 1
    out, lower = [], 0
    for max_m, rep_m in tune_kernels.BUCKETS:
        inside = [(m, n, name, cnt) for (m, n, name), cnt in counts.items()
                  if m >= min_rows and m > lower and (max_m is None or m <= max_m)]
        if inside:
            m, n, name, cnt = max(inside, key=lambda s: s[3] * ns_flops(s[0], s[1], method="gram"))
        else:  # no inventory shape in the bucket: tune_kernels' representative [m, 4m]
            m, n, name, cnt = rep_m, 4 * rep_m, "tune_kernels default", 8
        batch = max(1, min(cnt, 8, (1 << 30) // (m * n * 2)))
        out.append({"max_m": max_m, "batch": batch, "m": m, "k": n, "source": name})
        lower = max_m or lower
    return out[:2] + out[-1:] if quick else out


def _entry_lookup(entry, m: int, k: int):
    for bucket in entry.buckets:
        if bucket.matches(m, k):
            return bucket.config
    return None


def tuning(opts: SuiteOptions) -> dict:
    """Tune every (bucket, dtype), write ``launch_configs.json`` (shipped format) into ``out``,
    and verify the written table gives the winners back through ``dmuon.kernels.launch_configs``.

    On CUDA (``install_table``) the table is also written to the package's copy, so the later
    sections (and ``pytest -m gpu``) run with it; ``installed_lookup_ok`` checks that the
    runtime lookup, reading the shipped path, returns the tuned configs.
    """
    import tune_kernels
    from dmuon.kernels import launch_configs as lc

    device = opts.torch_device()
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        candidates = tune_kernels.CANDIDATES[::3] if opts.quick else tune_kernels.CANDIDATES
        reps = 10
    else:
        name, candidates, reps = "cpu (TRITON_INTERPRET dry run)", CPU_CANDIDATES, 1
    buckets = tuning_buckets(opts.device, opts.quick)
    log: list[str] = []
    results: dict = {}
    winners: dict[str, list[dict]] = {}
    for dname, dtype in DTYPES.items():
        winners[dname] = []
        for b in buckets:
            gen = torch.Generator(device=device).manual_seed(0)
            X = (torch.randn(b["batch"], b["m"], b["k"], generator=gen, device=device) / b["k"] ** 0.5).to(dtype)
            records = tune_kernels.tune_bucket(X, candidates, reps=reps, log=log.append)
            win = tune_kernels.best(records)
            results.setdefault(dname, []).append({**b, "records": records, "best": win})
            if win is None:
                raise RuntimeError(f"gpu_suite: every launch-config candidate failed for bucket {b} in {dname} "
                                   f"on {name}: {log[-3:]}")
            winners[dname].append({"max_m": b["max_m"], "max_k": None, **win["config"]})
            del X
    # The table has no dtype key: fp16, dmuon's iteration dtype, is written.
    table = tune_kernels.tuned_table(name, winners["float16"])
    path = opts.out / "launch_configs.json"
    path.write_text(json.dumps(table, indent=2) + "\n")
    parsed = lc.load_launch_table(str(path))
    entry = dict(parsed.gpus)[name]
    expect = [lc.LaunchConfig(**{k: w[k] for k in ("block", "block_k", "num_warps", "num_stages")})
              for w in winners["float16"]]
    written_ok = all(_entry_lookup(entry, b["m"], b["k"]) == cfg for b, cfg in zip(buckets, expect))
    if device.type == "cuda":  # the runtime's own lookup picks the GPU's entry by name
        written_ok = written_ok and all(lc.lookup_launch_config(device, b["m"], b["k"], parsed) == cfg
                                        for b, cfg in zip(buckets, expect))
    installed = None
    if device.type == "cuda" and opts.install_table:
        tune_kernels.TABLE.write_text(path.read_text())
        lc.load_launch_table.cache_clear()
        installed = all(lc.lookup_launch_config(device, b["m"], b["k"]) == cfg for b, cfg in zip(buckets, expect))
    return {"gpu_name": name, "candidates": candidates, "reps": reps, "buckets": buckets, "results": results,
            "winners": winners, "bf16_winners_differ": winners["bfloat16"] != winners["float16"],
            "table_file": path.name, "written_table_lookup_ok": written_ok, "installed_lookup_ok": installed,
            "log": log}


# ----------------------------------------------------------------------------- NS speed

def _interleaved_ms(fns: dict[str, Callable[[], object]], rounds: int, device: torch.device) -> dict[str, list[float]]:
    """Per-variant times (ms) over ``rounds`` interleaved rounds after one warm-up round:
    CUDA events on CUDA, ``perf_counter`` after a sync otherwise."""
    import time

    times: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(rounds + 1):  # round 0 warms up (Triton compile, cuBLAS heuristics)
        for key, fn in fns.items():
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize(device)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize(device)
                ms = start.elapsed_time(end)
            else:
                t0 = time.perf_counter()
                fn()
                ms = (time.perf_counter() - t0) * 1e3
            if r:
                times[key].append(ms)
    return times


def _stats(ts: list[float], flops: float, std_flops: float, peak: float | None) -> dict:
    med = statistics.median(ts)
    tflops = flops / (med * 1e-3) / 1e12
    return {"ms_median": med, "ms_min": min(ts), "ms_max": max(ts), "rounds": len(ts), "flops": flops,
            "achieved_tflops": tflops, "effective_tflops": std_flops / (med * 1e-3) / 1e12,
            "fraction_of_peak": tflops * 1e12 / peak if peak else None}


def ns_speed(opts: SuiteOptions) -> dict:
    """Whole-inventory NS time of ``torch.optim.Muon`` (bf16), dmuon Gram on torch (fp16) and
    dmuon Gram on Triton (fp16, batched by shape; CUDA only), interleaved, median of >= 10
    rounds on CUDA; and each large Qwen2.5-7B shape (min side >= 2048) alone on Triton.

    ``achieved_tflops`` divides the variant's own FLOPs (``ns_flops``; symmetric products at
    half cost for Triton) by the time, ``effective_tflops`` the standard iteration's count;
    ``fraction_of_peak`` is achieved over the dense fp16 peak of ``bench_newton_schulz.PEAK_FLOPS``.
    """
    from dmuon.kernels.launch_configs import load_launch_table

    device = opts.torch_device()
    cuda = device.type == "cuda"
    rounds = 10 if cuda else 2
    peak = _peak(device)
    table = load_launch_table()
    entry = table.entry(device)
    in_use = next((g for g, e in table.gpus if e is entry), "interpreter" if not cuda else "default")
    out: dict = {"rounds": rounds, "peak_fp16_dense_flops": peak, "launch_table_entry": in_use, "models": {}}
    for name in INVENTORY_NAMES:
        inv = scaled_inventory(name) if cuda else scaled_inventory(name, scale=64, max_layers=1)
        shapes = [s for _, s in inv]
        # Gradients: fp32, full. Drawn on the device: Qwen2.5-7B's 26 GB would take tens of
        # seconds of CPU randn.
        gen = torch.Generator(device=device).manual_seed(0)
        mats = [torch.randn(s, generator=gen, device=device) for s in shapes]
        variants = {k: v for k, v in _variants(device).items() if k != "dmuon_standard"}
        times = _interleaved_ms({k: (lambda f=f, m=mats: f(m)) for k, f in variants.items()}, rounds, device)
        std = _model_flops(shapes, "standard", False)
        own = {"torch_muon_bf16": std, "dmuon_gram_torch": _model_flops(shapes, "gram", False),
               "dmuon_gram_triton": _model_flops(shapes, "gram", True)}
        res = {k: _stats(ts, own[k], std, peak) for k, ts in times.items()}
        base = res["torch_muon_bf16"]["ms_median"]
        for v in res.values():
            v["ratio_to_torch_muon"] = v["ms_median"] / base
        model = {"num_matrices": len(shapes), "standard_flops": std, "variants": res}
        if cuda and name == "qwen2.5-7b":
            large = {}
            for shape in sorted({s for s in shapes if min(s) >= 2048}):
                group = [m for m, s in zip(mats, shapes) if s == shape]
                fn = lambda g=group: orthogonalize_by_shape(g, method="gram", backend="triton", dtype=torch.float16)  # noqa: E731
                flops = len(group) * ns_flops(*shape, method="gram", symmetric=True)
                ts = _interleaved_ms({"t": fn}, rounds, device)["t"]
                large[f"{shape[0]}x{shape[1]}"] = {"count": len(group), **_stats(ts, flops, len(group) * ns_flops(*shape), peak)}
            model["large_shapes_triton"] = large
        out["models"][name] = model
        del mats
        if cuda:
            torch.cuda.empty_cache()
    return out


# ----------------------------------------------------------------------------- step

#: Fields of ``nvidia-smi --query-gpu`` recorded at the start and the end of the step section.
GPU_STATE_FIELDS = ("clocks.sm", "clocks.mem", "clocks.max.sm", "power.draw", "power.limit",
                    "temperature.gpu", "clocks_throttle_reasons.active")


#: Largest ``step_traces.tar`` kept whole: the device returns files of at most 16 MiB. A tiny-model
#: CPU trace of 2 steps is ~15,700 events (~270 KB gzipped); the GPU model has ~6x the modules.
TRACE_TAR_BYTES = 15 << 20


def gpu_state() -> dict:
    """Clocks (MHz), power (W) and temperature (C) of GPU 0 now, from ``nvidia-smi --query-gpu``
    (or pynvml where nvidia-smi is absent); ``{"available": False, "reason": ...}`` when neither
    answers (the CPU dry run). Never raises."""
    import shutil

    if shutil.which("nvidia-smi"):
        try:
            smi = subprocess.run(["nvidia-smi", "--id=0", f"--query-gpu={','.join(GPU_STATE_FIELDS)}",
                                  "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=20)
            if smi.returncode == 0 and smi.stdout.strip():
                values = [v.strip() for v in smi.stdout.strip().splitlines()[0].split(",")]
                return {"available": True, "source": "nvidia-smi", **dict(zip(GPU_STATE_FIELDS, values))}
            reason = f"nvidia-smi exit {smi.returncode}: {(smi.stderr or smi.stdout).strip()[:200]}"
        except (OSError, subprocess.SubprocessError) as exc:
            reason = f"nvidia-smi failed: {exc}"
    else:
        reason = "nvidia-smi not found"
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        return {"available": True, "source": "pynvml",
                "clocks.sm": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
                "clocks.mem": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM),
                "power.draw": pynvml.nvmlDeviceGetPowerUsage(h) / 1e3,
                "temperature.gpu": pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)}
    except Exception as exc:  # noqa: BLE001 - absent or failing NVML is data, not an error
        return {"available": False, "reason": f"{reason}; pynvml: {type(exc).__name__}: {exc}"}


def step(opts: SuiteOptions) -> dict:
    """One GPU, world size 1 over NCCL (gloo on CPU): ``bench_step``'s interleaved run of AdamW,
    AdamW again (the A/A control ``adamw_b``), gather-then-compute Muon, dmuon, dmuon with
    ``Muon(overlap="forward")`` (``dmuon_overlap``, issue 39) and single-process
    ``torch.optim.Muon`` + ``AdamW``, on the ~194 M-parameter ``GPU_MODEL`` (tiny on CPU) with a
    bf16 ``MixedPrecisionPolicy`` and synthetic batches.

    On CUDA: 10 rounds (``step_stats.round_order`` over the 6 variants; before
    ``dmuon_overlap`` they were one Williams cycle of 5) of 3 measured steps (30 per variant; ``--quick`` 20) after 2 discarded
    ones per block, phases timed by CUDA events, the allocator reset before every block, no
    profiled label step (host-side labels mean little there). Every variant then runs 3 steps
    under ``torch.profiler`` (2 traced); the gzipped chrome traces go into one file,
    ``step_traces.tar`` in ``opts.out`` (members ``trace_<variant>.json.gz``). Clocks, power and
    temperature (:func:`gpu_state`) are recorded at the start and the end. The CPU dry run runs
    2 rounds of 1 step on the tiny model, with the same A/A control and traces."""
    import tarfile

    import bench_step

    cuda = opts.torch_device().type == "cuda"
    path = opts.work / "step_raw.json"
    trace_dir = opts.work / "step_traces"
    cfg = bench_step.BenchConfig(
        nproc=1, rounds=10 if cuda else 2, block_steps=(2 if opts.quick else 3) if cuda else 1,
        warmup_steps=2 if cuda else 1, labels=not cuda, trace_dir=str(trace_dir), trace_steps=2,
        batch_size=32 if cuda else 4, tiny=not cuda, model="gpu", calibrate=False,
        extra_variants=("torch_muon", "dmuon_overlap"), device=opts.device, synthetic=True, bf16=True,
        out=str(path))
    state_start = gpu_state()
    raw = bench_step.run(cfg, threads=torch.get_num_threads())  # one rank, in this process
    raw["gpu_state"] = {"start": state_start, "end": gpu_state()}
    raw["dedicated_matrices"] = len(raw["dedicated_matrices"])  # 148 rows on the GPU model
    tar_path = opts.out / "step_traces.tar"
    traces = raw.get("traces") or {}
    if sum(info["bytes"] for info in traces.values()) > TRACE_TAR_BYTES:  # keep the A/A pair and dmuon
        raw["traces_dropped"] = [v for v in traces if v not in ("adamw", "adamw_b", "dmuon")]
        traces = {v: info for v, info in traces.items() if v not in raw["traces_dropped"]}
    with tarfile.open(tar_path, "w") as tar:  # one file: the device returns at most 8 (see gpu_suite)
        for info in traces.values():
            tar.add(trace_dir / info["file"], arcname=info["file"])
    raw["traces_file"] = tar_path.name
    if opts.sync_debug and cuda:
        raw["sync_debug"] = _step_sync_debug(opts)
    return raw


def _step_sync_debug(opts: SuiteOptions) -> dict:
    """World size 1 on the GPU config, one dmuon step under ``set_sync_debug_mode("warn")`` and
    the profiler (CUDA timeline), played by :mod:`rank_view` (at world size 1 the fake process
    group and NCCL both move nothing)."""
    import rank_view as rv

    cfg = rv.ViewConfig(world=1, device=opts.device, model="gpu", batch_per_rank=32, rounds=1, block_steps=1,
                        variants=("dmuon",), bf16=True, sync_debug=True, trace=str(opts.out / "step_trace.json"))
    view = rv.run(cfg)
    return view["sync_debug"]


# ----------------------------------------------------------------------------- rank view

def rank_view(opts: SuiteOptions) -> dict:
    """Rank views (:mod:`rank_view`) at N = 8 and 64 on the GPU config (tiny on CPU), bf16
    mixed precision, FSDP2 + AdamW against dmuon, the busiest owner rank; this GPU plays that
    rank of the N-GPU job (communication not included: fake process group)."""
    import rank_view as rv

    cuda = opts.torch_device().type == "cuda"
    out = {}
    for world in (8, 64):
        cfg = rv.ViewConfig(world=world, device=opts.device, model="gpu" if cuda else "tiny",
                            batch_per_rank=32 if cuda else 1,
                            rounds=(2 if opts.quick else 3) if cuda else 1, block_steps=2 if cuda else 1,
                            variants=("adamw", "dmuon"), bf16=True, sync_debug=opts.sync_debug and cuda)
        view = rv.run(cfg)
        out[f"n{world}"] = view
        if cuda:
            torch.cuda.empty_cache()
    return out
