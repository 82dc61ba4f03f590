"""Whole-model Newton-Schulz time for Pi0 and Qwen2.5-7B matrix inventories.

Variants, interleaved round by round (one warm-up round first):

* ``torch_muon_bf16``: ``torch.optim.Muon``'s own iteration (``_zeropower_via_newtonschulz``,
  bf16, Muon coefficients, 5 steps), one matrix at a time, as ``torch.optim.Muon`` runs it.
* ``dmuon_standard``: dmuon standard iteration, fp16, Polar Express, batched by shape, torch ops.
* ``dmuon_gram_torch``: dmuon Gram iteration, fp16, Polar Express, batched by shape, torch ops.
* ``dmuon_gram_triton``: the same with the Triton symmetric kernels (CUDA only).

FLOP formula (``dmuon.kernels.ns_flops``, ``2 M N K`` per product, ``p = min``, ``q = max``
side, 5 steps): standard ``20 p^2 q + 10 p^3``; Gram ``8 p^2 q + 28 p^3``, or
``6 p^2 q + 14 p^3`` counting symmetric products at half cost (one-triangle kernels).
"Effective TFLOP/s" divides the *standard* count by the time, so variants compare on the same
work. "FLOP-limited ms" is the variant's own count (half-cost symmetric products for Triton)
divided by the GPU's dense fp16/bf16 tensor-core peak; ``ratio_to_flop_limit`` is measured / that.

Accuracy: for one matrix per distinct shape, relative Frobenius error against a float64
standard iteration with the same coefficients, for dmuon fp16 Gram (Polar Express) and for
``torch.optim.Muon`` bf16 (Muon coefficients, against a float64 Muon-coefficient iteration).

Usage::

    python bench/bench_newton_schulz.py --small    # CPU smoke run, a few seconds
    python bench/bench_newton_schulz.py            # full inventories (GPU)

Writes ``bench/results/ns_<device>_<mode>.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from torch.optim._muon import _zeropower_via_newtonschulz

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inventories import INVENTORY_NAMES, inventory  # noqa: E402

from dmuon.kernels import newton_schulz, ns_flops, orthogonalize_by_shape, resolve_coefficients  # noqa: E402

MUON = (3.4445, -4.7750, 2.0315)
# Dense fp16/bf16 tensor-core peak (no sparsity), FLOP/s, from NVIDIA datasheets.
# First key contained in the device name wins; a bare "H100" (another SXM naming) comes last.
PEAK_FLOPS = {"H100 80GB HBM3": 989.4e12, "H200": 989.4e12, "H100 PCIe": 756.5e12, "H100 NVL": 835.5e12,
              "A100": 312e12, "H100": 989.4e12}


def _peak(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_FLOPS.items():
        if key in name:
            return value
    return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _ns_float64(G: torch.Tensor, coeffs) -> torch.Tensor:
    X = G.double()
    tall = X.shape[-2] > X.shape[-1]
    X = X.mT if tall else X
    X = X / X.norm()
    for a, b, c in coeffs:
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X.mT if tall else X


def _variants(device: torch.device):
    def muon(ms):
        return [_zeropower_via_newtonschulz(m, MUON, 5, 1e-7) for m in ms]

    def dmuon(method, backend):
        return lambda ms: orthogonalize_by_shape(ms, method=method, backend=backend, dtype=torch.float16)

    out = {"torch_muon_bf16": muon, "dmuon_standard": dmuon("standard", "torch"),
           "dmuon_gram_torch": dmuon("gram", "torch")}
    if device.type == "cuda":
        out["dmuon_gram_triton"] = dmuon("gram", "triton")
    return out


def _model_flops(shapes, method: str, symmetric: bool) -> float:
    return sum(ns_flops(m, n, method=method, symmetric=symmetric) for m, n in shapes)


def bench_model(name: str, device: torch.device, small: bool, rounds: int) -> dict:
    inv = inventory(name, scale=64, max_layers=1) if small else inventory(name)
    shapes = [s for _, s in inv]
    gen = torch.Generator(device="cpu").manual_seed(0)
    mats = [torch.randn(s, generator=gen).to(device) for s in shapes]  # gradients: fp32, full
    variants = _variants(device)
    times: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(rounds + 1):  # round 0 warms up (Triton compile, cuBLAS heuristics)
        for key, fn in variants.items():
            _sync(device)
            t0 = time.perf_counter()
            fn(mats)
            _sync(device)
            if r:
                times[key].append((time.perf_counter() - t0) * 1e3)
    std_flops = _model_flops(shapes, "standard", False)
    peak = _peak(device)
    own_flops = {"torch_muon_bf16": std_flops, "dmuon_standard": std_flops,
                 "dmuon_gram_torch": _model_flops(shapes, "gram", False),
                 "dmuon_gram_triton": _model_flops(shapes, "gram", True)}
    base = statistics.median(times["torch_muon_bf16"])
    results = {}
    for key, ts in times.items():
        med = statistics.median(ts)
        limit_ms = own_flops[key] / peak * 1e3 if peak else None
        results[key] = {"ms_median": med, "ms_min": min(ts), "ms_max": max(ts),
                        "effective_tflops": std_flops / (med * 1e-3) / 1e12, "ratio_to_torch_muon": med / base,
                        "flops": own_flops[key], "flop_limited_ms": limit_ms,
                        "ratio_to_flop_limit": med / limit_ms if limit_ms else None}
    # Accuracy on one matrix per distinct shape.
    pe, accuracy = resolve_coefficients("polar_express", 5), []
    for shape in sorted(set(shapes)):
        G = mats[shapes.index(shape)]
        ref_pe, ref_mu = _ns_float64(G, pe), _ns_float64(G, [MUON] * 5)
        rel = lambda o, ref: ((o.double() - ref).norm() / ref.norm()).item()  # noqa: E731
        accuracy.append({"shape": list(shape),
                         "dmuon_gram_fp16_vs_f64": rel(newton_schulz(G, backend="auto"), ref_pe),
                         "dmuon_gram_fp16_muon_coeffs_vs_f64": rel(newton_schulz(G, coefficients="muon"), ref_mu),
                         "torch_muon_bf16_vs_f64": rel(_zeropower_via_newtonschulz(G, MUON, 5, 1e-7), ref_mu)})
    return {"inventory": name, "num_matrices": len(shapes),
            "shapes": [[list(s), c] for s, c in Counter(shapes).items()],
            "standard_flops": std_flops, "variants": results, "accuracy": accuracy}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="scaled-down inventories (width/64, 1 layer) for CPU")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per variant (default 3 small, 10 full)")
    parser.add_argument("--models", nargs="+", default=list(INVENTORY_NAMES), choices=INVENTORY_NAMES)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rounds = args.rounds or (3 if args.small else 10)
    torch.manual_seed(0)
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
        "peak_flops": _peak(device), "torch": torch.__version__, "python": platform.python_version(),
        "triton": None, "mode": "small" if args.small else "full", "rounds": rounds,
        "ns": {"steps": 5, "dtype": "float16 (dmuon) / bfloat16 (torch.optim.Muon)",
               "coefficients": "polar_express (dmuon) / muon (torch.optim.Muon)"},
        "models": [],
    }
    try:
        import triton

        report["triton"] = triton.__version__
    except ImportError:
        pass
    for name in args.models:
        t0 = time.perf_counter()
        res = bench_model(name, device, args.small, rounds)
        report["models"].append(res)
        print(f"{name}: {res['num_matrices']} matrices ({time.perf_counter() - t0:.1f} s)")
        for key, v in res["variants"].items():
            lim = f", {v['ratio_to_flop_limit']:.2f}x FLOP limit" if v["ratio_to_flop_limit"] else ""
            print(f"  {key:18s} {v['ms_median']:9.2f} ms [{v['ms_min']:.2f}, {v['ms_max']:.2f}]  "
                  f"{v['effective_tflops']:7.3f} eff TFLOP/s  {v['ratio_to_torch_muon']:.3f}x torch Muon{lim}")
        worst = max(res["accuracy"], key=lambda a: a["dmuon_gram_fp16_muon_coeffs_vs_f64"])
        print(f"  worst fp16 Gram (muon coeffs) error {worst['dmuon_gram_fp16_muon_coeffs_vs_f64']:.2e} vs "
              f"torch Muon bf16 {worst['torch_muon_bf16_vs_f64']:.2e} at {worst['shape']}")
    tag = "cuda_" + report["device"].replace(" ", "_") if device.type == "cuda" else "cpu"
    out = args.out or Path(__file__).resolve().parent / "results" / f"ns_{tag}_{report['mode']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
