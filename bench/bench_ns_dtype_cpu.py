"""Newton-Schulz time on this CPU by iteration dtype: float32, bfloat16, float16.

Chooses dmuon's default NS dtype on CPU (``dmuon.kernels.default_ns_dtype``). CPUs without
native half-precision GEMMs convert fp16/bf16 operands to fp32 and back around every product,
so a half-precision iteration can be slower than fp32 there; ATen picks its kernels by the CPU's
capability, so the same machine is measured three times: as it is; with
``ATEN_CPU_CAPABILITY=default`` (ATen's kernels without AVX2/AVX512); and with that and
``ONEDNN_MAX_CPU_ISA=AVX2`` (oneDNN, which runs the bf16 GEMMs and picks its own ISA, also
without AVX512-BF16): a CPU without AVX512-FP16/BF16.

Per capability a fresh interpreter (the variable is read when torch loads) times
``dmuon.kernels.newton_schulz`` (Gram method, Polar Express, 5 steps, torch backend, one
thread) on batches of Pi0-like shapes; the dtypes are interleaved round by round after one
warm-up round, and the median of the rounds is reported with its min and max. FLOPs: the
standard count ``dmuon.kernels.ns_flops(method="standard")`` over the time, so the dtypes compare
on the same work. Ratios within one capability are the result; absolute times depend on the
machine's load.

Usage::

    python bench/bench_ns_dtype_cpu.py [--rounds 5] [--out bench/results/ns_dtype_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

SHAPES = [(8, 128, 128), (4, 256, 768), (2, 512, 512)]  # [batch, rows, cols]: Pi0-like aspect ratios, small enough for a loaded 2-core machine
DTYPES = ("float32", "bfloat16", "float16")


def _measure(rounds: int) -> dict:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from dmuon.kernels import newton_schulz, ns_flops

    torch.set_num_threads(1)
    torch.manual_seed(0)
    inputs = {s: torch.randn(*s) for s in SHAPES}
    times = {d: {s: [] for s in SHAPES} for d in DTYPES}
    for r in range(rounds + 1):  # round 0 warms up
        for d in DTYPES:
            for s, g in inputs.items():
                t0 = time.perf_counter()
                newton_schulz(g, method="gram", dtype=getattr(torch, d), backend="torch")
                if r:
                    times[d][s].append(time.perf_counter() - t0)
    out = {}
    for d in DTYPES:
        rows = []
        for s in SHAPES:
            ms = [1e3 * t for t in times[d][s]]
            flops = s[0] * ns_flops(s[1], s[2], method="standard")
            rows.append(dict(shape=list(s), median_ms=statistics.median(ms), min_ms=min(ms), max_ms=max(ms),
                             effective_gflops=flops / statistics.median(ms) / 1e6))
        out[d] = dict(shapes=rows, total_median_ms=sum(r["median_ms"] for r in rows))
    fp32 = out["float32"]["total_median_ms"]
    for d in DTYPES:
        out[d]["time_vs_float32"] = out[d]["total_median_ms"] / fp32
    from torch.backends import cpu as cpu_backend

    return dict(capability=cpu_backend.get_cpu_capability(), torch=torch.__version__, dtypes=out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "ns_dtype_cpu.json"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(_measure(a.rounds)))
        return
    runs = {}
    configs = (("native", {}), ("ATEN_CPU_CAPABILITY=default", {"ATEN_CPU_CAPABILITY": "default"}),
               # oneDNN, which runs the bf16 GEMMs, picks its ISA itself: cap it below AVX512-BF16
               ("ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=AVX2",
                {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "AVX2"}))
    for label, extra in configs:
        env = {**os.environ, "OMP_NUM_THREADS": "1", **extra}
        for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"):
            if name not in extra:
                env.pop(name, None)
        proc = subprocess.run([sys.executable, __file__, "--child", "--rounds", str(a.rounds)], env=env,
                              capture_output=True, text=True, check=True)
        runs[label] = json.loads(proc.stdout.strip().splitlines()[-1])
        for d, res in runs[label]["dtypes"].items():
            print(f"{label:28s} ({runs[label]['capability']}) {d:9s} {res['total_median_ms']:9.1f} ms "
                  f"= {res['time_vs_float32']:.2f} x float32", flush=True)
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next(line.split(":", 1)[1].strip() for line in fh if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    result = dict(benchmark="newton_schulz by dtype on CPU (gram, polar_express, 5 steps, torch, 1 thread)",
                  cpu=cpu, python=platform.python_version(), load_average=load, rounds=a.rounds,
                  shapes=[list(s) for s in SHAPES], runs=runs)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"written to {a.out}")


if __name__ == "__main__":
    main()
