"""What QK-clip's logit recording costs: forward + backward of the main job's model with
:class:`dmuon.qk_clip.LogitRecorder` on, against the same model with it off (issue 46: <= 2%).

One process, one torch thread, no distribution: the recorder's work (the per-head max of
``q k^T * scale`` recomputed beside every ``F.scaled_dot_product_attention`` call of the
recognized attention modules) is the same on every rank of a job, at the rank's batch
(``dmuon.train``'s default: global batch 64 over 4 CPU ranks, so 16).

Variants, interleaved: one round runs each ``--repeat`` times, in the order of row ``round`` of
a Williams design (:func:`step_stats.round_order`: over 4 rounds every variant holds every
position and follows every other one once; take ``--rounds`` a multiple of 4):

* ``off``, ``off2``: no recorder (``off2 / off`` is the A/A pair: the noise floor);
* ``on``: the recorder as it is (:func:`dmuon.qk_clip.max_logits`);
* ``on_e6e933c``: the recorder with the recomputation of e6e933c (the one before this bench's
  commit, kept below as :func:`max_logits_e6e933c`: one fp32 product over the whole call).

What is counted, two ways:

* the step: ``model(batch).backward()`` on two clocks, the thread's CPU time (the main figure:
  the two cores are shared with other jobs, and time spent waiting for a core is not the step's
  cost; one torch thread, and CPU autograd runs on the calling thread) and wall time; per clock
  and variant the median and quartiles of every step, and the ratio to ``off`` two ways: of the
  medians, and the median (with quartiles) of the per-round ratios of each variant's fastest
  step in the round (interference only adds time; pairing within a round cancels drift), with
  the noise floor of ``off2 / off`` and a verdict (:func:`step_stats.noise_floor`, ``verdict``);
* the recomputation inside those steps: the thread CPU time spent in ``max_logits`` per step
  (per attention call too), with the model's caches as a training step leaves them; steadier
  than a difference of two step times, and it leaves out the hooks' own cost (their
  ``TorchFunctionMode`` dispatch, ~1 us for each of the 164 torch calls inside the attention
  modules). FLOPs per call: ``2 * batch * heads * rows * keys * dim`` (the fp32 ``Q K^T``).

Usage::

    python bench/bench_qk_clip_cost.py --rounds 60 --out bench/results/qk_clip_cost_cpu.json
"""

from __future__ import annotations

import argparse
import json
import math
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

import dmuon.qk_clip as qk_clip  # noqa: E402
from bench_step import synthetic_batch  # noqa: E402
from step_stats import noise_floor, round_order, verdict  # noqa: E402
from dmuon.owners.attention import find_attention  # noqa: E402
from dmuon.train.model import Pi0Policy, PolicyConfig  # noqa: E402

MAX_LOGITS = qk_clip.max_logits  # the recorder's, while the harness swaps in a timed one
VARIANTS = ("off", "on", "on_e6e933c", "off2")
CLOCKS = ("thread_cpu", "wall")


@torch.no_grad()
def max_logits_e6e933c(query, key, *, scale=None, attn_mask=None, is_causal=False, mask_true_keeps=True):
    """The recomputation as of e6e933c (the baseline): one fp32 ``[batch, heads, rows, keys]``
    product per call (row chunks only past 16 Mi logits), masked and reduced."""
    if query.dim() == 3:
        query, key = query.unsqueeze(0), key.unsqueeze(0)
    batch, heads, rows, dim = query.shape
    if key.shape[1] > 1 and key.stride(1) == 0:
        key = key[:, :1]
    kv = key.shape[1]
    group = heads // kv
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    late = scale > 0 and (attn_mask is None or attn_mask.dtype == torch.bool)
    keys = key.float().transpose(-1, -2)
    step = max(1, (1 << 24) // max(1, batch * heads * key.shape[2]))
    best = torch.full((heads,), float("-inf"), device=query.device)
    for start in range(0, rows, step):
        chunk = query[:, :, start: start + step].float()
        count = chunk.shape[2]
        scores = torch.matmul(chunk.reshape(batch, kv, group * count, dim), keys).view(batch, heads, count, -1)
        if not late:
            scores.mul_(scale)
        best = torch.maximum(best, qk_clip._masked_max_(scores, start, attn_mask, is_causal, mask_true_keeps))
    return best * scale if late else best


def _quartiles(xs: list[float]) -> dict:
    q = statistics.quantiles(xs, n=4)
    return {"median": statistics.median(xs), "q1": q[0], "q3": q[2], "n": len(xs)}


def _cpu_name() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class Harness:
    """The model, one batch, and a recorder switched per step whose ``max_logits`` calls are
    timed (thread CPU seconds, per call) and described."""

    def __init__(self, batch_size: int) -> None:
        torch.manual_seed(0)
        self.cfg = PolicyConfig()
        self.model = Pi0Policy(self.cfg)
        self.batch = synthetic_batch(self.cfg, 0, batch_size, 0, 1, 0)
        self.layouts = find_attention(self.model)
        self.recorder: qk_clip.LogitRecorder | None = None
        self.impls = {"on": MAX_LOGITS, "on_e6e933c": max_logits_e6e933c}
        self.impl = MAX_LOGITS
        self.call_seconds: list[float] = []
        self.calls: list[dict] = []

    def _timed(self, query, key, **kwargs):
        c0 = time.thread_time()
        out = self.impl(query, key, **kwargs)
        self.call_seconds.append(time.thread_time() - c0)
        if len(self.calls) < len(self.call_seconds):
            self.calls.append(describe(query, key, kwargs))
        return out

    def step(self, variant: str) -> tuple[float, float, list[float]]:
        """(thread CPU s, wall s, recomputation CPU s per call) of one forward + backward."""
        if variant in self.impls:
            self.impl = self.impls[variant]
            qk_clip.max_logits = self._timed  # what the recorder's hooks call
            if self.recorder is None:
                self.recorder = qk_clip.LogitRecorder(self.layouts)
        elif self.recorder is not None:
            self.recorder.remove()
            self.recorder = None
        self.call_seconds = []
        c0, t0 = time.thread_time(), time.perf_counter()
        self.model(self.batch).backward()
        took, cpu = time.perf_counter() - t0, time.thread_time() - c0
        self.model.zero_grad(set_to_none=True)
        for lay in self.layouts:  # what opt.step() would consume
            lay.module.__dict__.pop("_dmuon_max_logits", None)
        return cpu, took, self.call_seconds

    def close(self) -> None:
        if self.recorder is not None:
            self.recorder.remove()
        qk_clip.max_logits = MAX_LOGITS


def describe(query: torch.Tensor, key: torch.Tensor, kwargs: dict) -> dict:
    q4 = query if query.dim() == 4 else query.unsqueeze(0)
    b, h, t, d = q4.shape
    mask = kwargs.get("attn_mask")
    return {"query": list(query.shape), "key": list(key.shape), "dtype": str(query.dtype).removeprefix("torch."),
            "key_heads_expanded": bool(key.dim() == 4 and key.shape[1] > 1 and key.stride(1) == 0),
            "mask": None if mask is None else [list(mask.shape), str(mask.dtype).removeprefix("torch.")],
            "is_causal": bool(kwargs.get("is_causal", False)), "flops": 2 * b * h * t * key.shape[-2] * d}


def _ratios(per_round: dict[str, list[float]], steps: dict[str, list[float]]) -> dict:
    off = statistics.median(steps["off"])
    paired = {v: _quartiles([a / b for a, b in zip(per_round[v], per_round["off"])]) for v in VARIANTS if v != "off"}
    floor = noise_floor({"q1": paired["off2"]["q1"], "median": paired["off2"]["median"], "q3": paired["off2"]["q3"]})
    return {"seconds": {v: _quartiles(xs) for v, xs in steps.items()},
            "ratio_of_medians": {v: statistics.median(steps[v]) / off for v in VARIANTS if v != "off"},
            "paired_ratio_of_round_minima": paired, "noise_floor": floor,
            "verdict": {v: verdict(paired[v], floor) for v in VARIANTS if v not in ("off", "off2")}}


def run(batch_size: int, rounds: int, repeat: int, warmup: int = 3, threads: int = 1) -> dict:
    torch.set_num_threads(threads)
    h = Harness(batch_size)
    try:
        for _ in range(warmup):
            for v in VARIANTS:
                h.step(v)
        steps = {c: {v: [] for v in VARIANTS} for c in CLOCKS}
        best = {c: {v: [] for v in VARIANTS} for c in CLOCKS}  # per round: the fastest step
        inside: dict[str, list[list[float]]] = {v: [] for v in h.impls}
        for r in range(rounds):
            for v in round_order(VARIANTS, r):
                xs = [h.step(v) for _ in range(repeat)]
                for j, c in enumerate(CLOCKS):
                    steps[c][v].extend(x[j] for x in xs)
                    best[c][v].append(min(x[j] for x in xs))
                if v in inside:
                    inside[v].extend(x[2] for x in xs)
    finally:
        h.close()
    off_cpu = statistics.median(steps["thread_cpu"]["off"])
    recompute = {}
    for v, per_step in inside.items():
        totals = [sum(xs) for xs in per_step]
        recompute[v] = {"cpu_seconds_per_step": _quartiles(totals),
                        "share_of_off_step": statistics.median(totals) / off_cpu,
                        "cpu_ms_per_call": [round(statistics.median(xs[i] for xs in per_step) * 1e3, 3)
                                            for i in range(len(per_step[0]))]}
    return {
        "what": "forward + backward of dmuon.train's default Pi0-style policy with QK-clip's logit "
                "recording on vs off (LogitRecorder on every recognized attention module)",
        "counted": "model(batch).backward() on the thread's CPU clock (main figure: shared cores) and "
                   "the wall clock; and the thread CPU time inside max_logits during those steps. "
                   "FLOPs per call = 2*batch*heads*rows*keys*dim (fp32 Q K^T)",
        "device": f"cpu: {_cpu_name()}, {os.cpu_count()} cores shared with other jobs, {threads} torch thread(s)",
        "torch": torch.__version__, "python": platform.python_version(),
        "model": "dmuon.train.model.PolicyConfig() defaults, fp32", "batch": batch_size,
        "rounds": rounds, "repeat": repeat, "warmup_rounds": warmup,
        "attention_modules": [lay.name for lay in h.layouts],
        "attention_calls": h.calls,
        **{c: _ratios(best[c], steps[c]) for c in CLOCKS},
        "recomputation_in_steps": recompute,
        "target": "on / off <= 1.02 (issue 46)",
        "command": " ".join(["python", "bench/bench_qk_clip_cost.py", *sys.argv[1:]]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--repeat", type=int, default=2, help="steps per variant per round")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    result = run(a.batch, a.rounds, a.repeat, threads=a.threads)
    text = json.dumps(result, indent=1)
    if a.out:
        pathlib.Path(a.out).write_text(text + "\n")
    for clock in CLOCKS:
        paired = result[clock]["paired_ratio_of_round_minima"]
        print(f"{clock}: paired ratio to off, median [q1, q3]:",
              {v: [round(q["median"], 4), round(q["q1"], 4), round(q["q3"], 4)] for v, q in paired.items()},
              "ratio of medians:", {v: round(x, 4) for v, x in result[clock]["ratio_of_medians"].items()},
              "noise floor:", round(result[clock]["noise_floor"], 4), result[clock]["verdict"])
    for v, r in result["recomputation_in_steps"].items():
        s = r["cpu_seconds_per_step"]
        print(f"{v}: recomputation {s['median'] * 1e3:.2f} ms/step [{s['q1'] * 1e3:.2f}, {s['q3'] * 1e3:.2f}] "
              f"= {r['share_of_off_step']:.4f} of off; ms per call {r['cpu_ms_per_call']}")


if __name__ == "__main__":
    main()
