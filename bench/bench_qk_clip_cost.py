"""What QK-clip's logit recording costs: forward + backward of the main job's model with
:class:`dmuon.qk_clip.LogitRecorder` on, against the same model with it off (issue 46: <= 2%).

One process, one thread, no distribution: the recorder's work (the per-head max of
``q k^T * scale`` recomputed beside every ``F.scaled_dot_product_attention`` call of the
recognized attention modules) is the same on every rank of a job. Variants ``off``, ``on`` and
``off2`` (a second ``off``: the A/A spread) are interleaved, one step each per round, after
warm-up; the JSON gives medians and quartiles of each and the ratios ``on / off`` and
``off2 / off``. What is counted: wall time of ``model(batch).backward()``.

Usage::

    python bench/bench_qk_clip_cost.py --batch 16 --rounds 30 --out bench/results/qk_clip_cost_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench"))

from bench_step import synthetic_batch  # noqa: E402
from dmuon.owners.attention import find_attention  # noqa: E402
from dmuon.qk_clip import LogitRecorder  # noqa: E402
from dmuon.train.model import Pi0Policy, PolicyConfig  # noqa: E402


def _quartiles(xs: list[float]) -> dict:
    q = statistics.quantiles(xs, n=4)
    return {"median_s": statistics.median(xs), "q1_s": q[0], "q3_s": q[2], "n": len(xs)}


def run(batch_size: int, rounds: int, warmup: int = 3, threads: int = 1) -> dict:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    pc = PolicyConfig()
    model = Pi0Policy(pc)
    batch = synthetic_batch(pc, 0, batch_size, 0, 1, 0)
    layouts = find_attention(model)
    recorder: list[LogitRecorder] = []

    def step(on: bool) -> float:
        if on and not recorder:
            recorder.append(LogitRecorder(layouts))
        if not on and recorder:
            recorder.pop().remove()
        t0 = time.perf_counter()
        model(batch).backward()
        took = time.perf_counter() - t0
        model.zero_grad(set_to_none=True)
        for lay in layouts:  # what opt.step() would consume
            lay.module.__dict__.pop("_dmuon_max_logits", None)
        return took

    variants = ("off", "on", "off2")
    for _ in range(warmup):
        for v in variants:
            step(v == "on")
    times: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(rounds):
        order = variants[r % 3:] + variants[: r % 3]
        for v in order:
            times[v].append(step(v == "on"))
    summary = {v: _quartiles(xs) for v, xs in times.items()}
    med = {v: s["median_s"] for v, s in summary.items()}
    return {
        "what": "forward + backward of dmuon.train's default Pi0-style policy with QK-clip's logit "
                "recording on vs off (LogitRecorder on every recognized attention module)",
        "device": f"cpu ({platform.machine()}, {os.cpu_count()} cores, shared; {threads} thread(s))",
        "torch": torch.__version__, "python": platform.python_version(),
        "batch": batch_size, "rounds": rounds, "attention_modules": [lay.name for lay in layouts],
        "variants": summary,
        "ratios": {"on_over_off": med["on"] / med["off"], "aa_off2_over_off": med["off2"] / med["off"]},
        "target": "on_over_off <= 1.02 (issue 46)",
        "command": " ".join(["python", "bench/bench_qk_clip_cost.py", *sys.argv[1:]]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    result = run(a.batch, a.rounds, threads=a.threads)
    text = json.dumps(result, indent=1)
    if a.out:
        pathlib.Path(a.out).write_text(text + "\n")
    print(json.dumps(result["ratios"]), {v: round(s["median_s"], 4) for v, s in result["variants"].items()})


if __name__ == "__main__":
    main()
