"""PushT study: closed-loop success and coverage vs training steps and wall-clock seconds.

For each optimizer (``dmuon``, ``vanilla``, ``adamw``; ``--optimizers``) and seed, trains the
Pi0-style state policy with ``python -m dmuon.train --preset pusht-state`` (same demonstrations,
same global batches, same steps; the preset's cosine schedule runs over ``--steps``),
checkpointing every ``--save-every`` steps, then rolls every checkpoint out in PushT on the same
held-out initial states for gym-pusht's 300 steps (:mod:`dmuon.train.eval`, one process) and the
scripted expert once on them. ``--gif`` writes rollouts of the best dmuon checkpoint, successful
episodes first.

The learning rate comes from a small sweep on seed 0 (``--sweep-dmuon``, ``--sweep-adamw``; the
first value is the default, run on every seed first), picked by the mean final coverage of the
last checkpoint (success rate, then final coverage). ``vanilla`` is the same update rule as ``dmuon``
(``torch.optim.Muon`` math, gather-then-compute; the parity tests show equal parameters), so it
uses dmuon's lr; it is here for the wall-clock axis. ``--summarize-only`` writes the JSON and
plot from the runs finished so far (``seeds_done`` per optimizer says how many).

Wall-clock seconds are the sum of the training steps' measured times (``step_s_all`` of the
run summary; forward + backward + optimizer step, excluding checkpoint writes and start-up).

    python bench/pusht_study.py                     # the full study (3 seeds x sweep: hours on 2 cores)
    python bench/pusht_study.py --quick --out-dir /tmp/q   # CI smoke variant (tests/test_train.py)

Writes ``<out-dir>/pusht_study.json`` and ``<out-dir>/pusht_study.png``; runs are kept under
``--work-dir`` so an interrupted study resumes.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dmuon.train import ckpt  # noqa: E402
from dmuon.train.data import DataConfig  # noqa: E402
from dmuon.train.eval import EvalConfig, evaluate, summarize  # noqa: E402

OPTIMIZERS = ("dmuon", "vanilla", "adamw")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny smoke variant (CI)")
    p.add_argument("--summarize-only", action="store_true",
                   help="train nothing: report the runs already in --work-dir (an unfinished study)")
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="comma-separated subset of "
                   + ",".join(OPTIMIZERS))
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--save-every", type=int, default=1000)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--eval-episodes", type=int, default=50)
    p.add_argument("--eval-max-steps", type=int, default=300, help="gym-pusht's registered episode length")
    p.add_argument("--demo-episodes", type=int, default=DataConfig().episodes)
    p.add_argument("--gif", default=None, help="write a GIF of the best dmuon checkpoint's rollouts here")
    p.add_argument("--sweep-dmuon", default="0.02,0.05", help="Muon matrix lrs to sweep (first: default)")
    p.add_argument("--sweep-adamw", default="1e-3,3e-3", help="AdamW lrs to sweep (first: default)")
    p.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    p.add_argument("--work-dir", default="/tmp/dmuon_pusht_study")
    a = p.parse_args(argv)
    if a.quick:
        a.seeds, a.steps, a.save_every, a.nproc, a.batch_size = 1, 4, 2, 1, 8
        a.eval_episodes, a.eval_max_steps, a.demo_episodes = 2, 20, 1
        a.sweep_dmuon, a.sweep_adamw = "0.02", "1e-3"
    a.optimizers = tuple(o for o in a.optimizers.split(",") if o)
    bad = [o for o in a.optimizers if o not in OPTIMIZERS]
    if bad:
        p.error(f"--optimizers {bad}: choose from {OPTIMIZERS}")
    return a


def train(a, opt: str, lr: float, seed: int) -> pathlib.Path:
    """Trains one run (skipped if its summary exists); returns its directory."""
    run = pathlib.Path(a.work_dir) / f"{opt}_lr{lr:g}_s{seed}"
    if (run / "summary.json").exists():
        return run
    cmd = [sys.executable, "-m", "dmuon.train", "--preset", "pusht-state", "--nproc", str(a.nproc),
           "--optimizer", opt, "--lr", str(lr), "--warmup", str(min(200, max(1, a.steps // 10))), "--no-eval",
           "--seed", str(seed), "--steps", str(a.steps), "--episodes", str(a.demo_episodes),
           "--save", str(run / "ckpt"), "--save-every", str(a.save_every), "--no-plot",
           "--out", str(run / "summary.tmp.json")]
    cmd += ["--batch-size", str(a.batch_size)]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    os.replace(run / "summary.tmp.json", run / "summary.json")
    print(f"trained {run.name} in {time.perf_counter() - t0:.0f} s", flush=True)
    return run


def evaluate_run(a, run: pathlib.Path, eval_cfg: EvalConfig, steps: list[int]) -> list[dict]:
    """Rolls out the run's checkpoints at ``steps`` (cached in ``run/eval_<step>.json``)."""
    out = []
    summary = json.loads((run / "summary.json").read_text())
    for step in steps:
        cache = run / f"eval_{step:06d}.json"
        if not cache.exists():
            policy, meta = ckpt.load_policy(ckpt.step_dir(run / "ckpt", step))
            res = evaluate(policy, eval_cfg, ckpt.configs_from(meta)[1], progress=False, expert=False)
            cache.write_text(json.dumps(res["policy"]))
        res = json.loads(cache.read_text())
        out.append({"step": step, "train_s": float(sum(summary["step_s_all"][:step])),
                    "loss": summary["losses"][step - 1], **res})
    return out


def write_gif(a, evals: list[dict], step: int, eval_cfg: EvalConfig, lr: float) -> dict:
    """GIF of seed 0's dmuon run at checkpoint ``step``: up to 3 episodes, successful ones first."""
    import dataclasses

    from dmuon.train.eval import write_video

    episodes = next(e for e in evals if e["step"] == step)["episodes"]
    chosen = [e["seed"] for e in episodes if e["success"]][:3]
    chosen += [e["seed"] for e in episodes if not e["success"]][: 3 - len(chosen)]
    run = pathlib.Path(a.work_dir) / f"dmuon_lr{lr:g}_s0"
    policy, meta = ckpt.load_policy(ckpt.step_dir(run / "ckpt", step))
    cfg = dataclasses.replace(eval_cfg, video=a.gif, video_episodes=len(chosen))
    write_video(policy, cfg, ckpt.configs_from(meta)[1], chosen)
    return {"path": a.gif, "step": step, "seeds": chosen,
            "success": [bool(next(e["success"] for e in episodes if e["seed"] == s)) for s in chosen]}


def pooled(evals: list[dict]) -> dict:
    """Success (Wilson) and coverage (normal 95% CI) pooled over seeds x episodes."""
    return summarize([e for ev in evals for e in ev["episodes"]])


def plot(result: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    expert = result["expert"]["summary"]
    for opt, rec in result["optimizers"].items():
        curve = rec["curve"]
        x_steps = [c["step"] * result["settings"]["batch_size"] for c in curve]  # samples seen
        x_wall = [c["train_s_mean"] for c in curve]
        for ax, x, key in ((axes[0], x_steps, "final_coverage"), (axes[1], x_wall, "final_coverage"),
                           (axes[2], x_steps, "success_rate")):
            m = [c[key]["mean"] for c in curve]
            lo = [c[key]["ci95"][0] for c in curve]
            hi = [c[key]["ci95"][1] for c in curve]
            ax.plot(x, m, marker="o", label=f"{opt} (lr {rec['lr']:g})")
            ax.fill_between(x, lo, hi, alpha=0.15)
    for ax, key in ((axes[0], "final_coverage"), (axes[1], "final_coverage"), (axes[2], "success_rate")):
        ax.axhline(expert[key]["mean"], color="k", ls="--", lw=1, label="scripted expert")
    axes[0].set(xlabel="samples seen (steps x global batch)", ylabel="final coverage of the goal")
    axes[1].set(xlabel="training wall-clock s (sum of step times)", ylabel="final coverage of the goal")
    axes[2].set(xlabel="samples seen (steps x global batch)", ylabel="success rate (coverage > 0.95)")
    axes[0].legend(fontsize=7)
    n = result["settings"]
    fig.suptitle(f"PushT closed loop: {n['seeds']} seeds x {n['eval_episodes']} held-out episodes per "
                 f"point, 95% CI (pooled); {result['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    a = parse_args(argv)
    import torch

    steps = list(range(a.save_every, a.steps + 1, a.save_every))
    if steps[-1] != a.steps:
        steps.append(a.steps)
    from dmuon.train.launch import parse_args as train_args

    data = train_args(["--preset", "pusht-state", "--episodes", str(a.demo_episodes)])[0].data
    eval_cfg = EvalConfig(episodes=a.eval_episodes, max_steps=a.eval_max_steps)
    seeds = list(range(a.seeds))
    t_start = time.perf_counter()

    # Order: the seed grid at the default lrs first (interleaved seed, then optimizer, so the
    # machine's load drifts over all optimizers alike), then the sweep's other lrs on seed 0.
    default_lr = {"dmuon": float(a.sweep_dmuon.split(",")[0]), "adamw": float(a.sweep_adamw.split(",")[0])}
    default_lr["vanilla"] = default_lr["dmuon"]
    jobs = [(opt, default_lr[opt], seed) for seed in seeds for opt in a.optimizers]
    jobs += [(opt, float(lr), 0) for opt, text in (("dmuon", a.sweep_dmuon), ("adamw", a.sweep_adamw))
             if opt in a.optimizers for lr in text.split(",")[1:]]
    done: dict[tuple, list[dict]] = {}
    for opt, lr, seed in jobs:
        run = pathlib.Path(a.work_dir) / f"{opt}_lr{lr:g}_s{seed}"
        if a.summarize_only and not (run / "summary.json").exists():
            continue
        done[(opt, lr, seed)] = evaluate_run(a, train(a, opt, lr, seed), eval_cfg, steps)

    # The sweep (seed 0): the last checkpoint's mean final coverage picks the lr.
    sweep: dict[str, list[dict]] = {}
    for (opt, lr, seed), evs in sorted(done.items()):
        if seed == 0 and opt != "vanilla":
            sweep.setdefault(opt, []).append({"lr": lr, "loss": evs[-1]["loss"], **pooled([evs[-1]])})
    best_lr = {opt: max(rows, key=lambda r: (r["success_rate"]["mean"], r["final_coverage"]["mean"]))["lr"]
               for opt, rows in sweep.items()}
    best_lr["vanilla"] = best_lr.get("dmuon")  # the same update rule (see the module docstring)
    runs = {opt: [done[(opt, best_lr.get(opt), s)] for s in seeds if (opt, best_lr.get(opt), s) in done]
            for opt in a.optimizers}
    print(f"chosen lrs: {best_lr}; seeds done: { {o: len(r) for o, r in runs.items()} }", flush=True)
    expert_cache = pathlib.Path(a.work_dir) / f"expert_{eval_cfg.episodes}_{eval_cfg.max_steps}.json"
    if not expert_cache.exists():
        expert_cache.write_text(json.dumps(evaluate(None, eval_cfg, data, progress=False)["expert"]))
    expert = json.loads(expert_cache.read_text())

    result = {
        "device": f"cpu ({os.cpu_count()} cores, shared with other jobs), {a.nproc} gloo ranks",
        "torch": torch.__version__,
        "settings": {k: v for k, v in vars(a).items() if k not in ("out_dir", "work_dir")},
        "eval": {"episodes": eval_cfg.episodes, "flow_steps": eval_cfg.flow_steps,
                 "exec_horizon": eval_cfg.exec_horizon, "max_steps": eval_cfg.max_steps,
                 "seeds": eval_cfg.seeds(data)},
        "sweep": sweep,
        "expert": expert,
        "optimizers": {},
        "study_wall_s": None if a.summarize_only else time.perf_counter() - t_start,
    }
    for opt in OPTIMIZERS:
        if not runs.get(opt):
            continue
        curve = []
        for i, step in enumerate(steps):
            at = [r[i] for r in runs[opt]]
            curve.append({"step": step, "train_s_mean": float(np.mean([x["train_s"] for x in at])),
                          "loss_mean": float(np.mean([x["loss"] for x in at])), **pooled(at)})
        best = max(curve, key=lambda c: c["final_coverage"]["mean"])
        result["optimizers"][opt] = {
            "lr": best_lr[opt], "seeds_done": len(runs[opt]), "curve": curve, "last": curve[-1], "best": best,
            "per_seed_last_final_coverage": [float(np.mean([e["final_coverage"] for e in r[-1]["episodes"]]))
                                             for r in runs[opt]],
        }
    ref = expert["summary"]["final_coverage"]["mean"]
    if "dmuon" in result["optimizers"]:
        best_dmuon = result["optimizers"]["dmuon"]["best"]["final_coverage"]["mean"]
        result["dmuon_best_over_expert_coverage"] = best_dmuon / ref if ref > 0 else None
        if a.gif:
            result["gif"] = write_gif(a, runs["dmuon"][0], result["optimizers"]["dmuon"]["best"]["step"],
                                      eval_cfg, best_lr["dmuon"])
    out_dir = pathlib.Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = "pusht_quick" if a.quick else "pusht_study"
    (out_dir / f"{name}.json").write_text(json.dumps(result, indent=1))
    plot(result, out_dir / f"{name}.png")
    print(table(result), flush=True)
    print(sweep_table(result), flush=True)
    return result


def _interval(s: dict) -> str:
    """``mean [low, high]`` of a summary with a 95% interval."""
    return f"{s['mean']:.2f} [{s['ci95'][0]:.2f}, {s['ci95'][1]:.2f}]"


def table(result: dict) -> str:
    """Markdown table: success and final coverage at the last and the best checkpoint."""
    rows = ["| policy | lr | checkpoint | success rate | final coverage | max coverage | train s |",
            "|---|---|---|---|---|---|---|"]
    for opt, rec in result["optimizers"].items():
        for which in ("last", "best"):
            c = rec[which]
            rows.append(f"| {opt} | {rec['lr']:g} | {which} (step {c['step']}) | "
                        f"{_interval(c['success_rate'])} | {_interval(c['final_coverage'])} | "
                        f"{_interval(c['max_coverage'])} | {c['train_s_mean']:.0f} |")
    e = result["expert"]["summary"]
    rows.append(f"| scripted expert | | | {_interval(e['success_rate'])} | {_interval(e['final_coverage'])} | "
                f"{_interval(e['max_coverage'])} | |")
    return "\n".join(rows)


def sweep_table(result: dict) -> str:
    """Markdown table of the lr sweep (seed 0, last checkpoint)."""
    rows = ["| optimizer | lr | final loss | success rate | final coverage | max coverage |",
            "|---|---|---|---|---|---|"]
    for opt, entries in result["sweep"].items():
        for r in entries:
            rows.append(f"| {opt} | {r['lr']:g} | {r['loss']:.3f} | {_interval(r['success_rate'])} | "
                        f"{_interval(r['final_coverage'])} | {_interval(r['max_coverage'])} |")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
