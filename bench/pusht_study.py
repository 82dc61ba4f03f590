"""PushT study: closed-loop success and coverage vs training steps and wall-clock seconds.

For each optimizer (``dmuon``, ``vanilla``, ``adamw``; ``--optimizers``) and seed, trains the
Pi0-style state policy with ``python -m dmuon.train --preset pusht-state`` (same demonstrations,
same global batches, same steps; the preset's cosine schedule runs over ``--steps``),
checkpointing every ``--save-every`` steps, then rolls every checkpoint out in PushT on the same
held-out initial states for gym-pusht's 300 steps (:mod:`dmuon.train.eval`, one process) and the
scripted expert once on them. ``--gif`` writes rollouts of the best dmuon checkpoint, successful
episodes first.

The learning rate comes from a small sweep on seed 0 (``--sweep-dmuon``, ``--sweep-adamw``; run
first), picked by the success rate of the last checkpoint, then its mean final coverage; the
chosen lr then runs on every seed (seed-major, each seed's optimizers back to back, so the
machine's load drifts over all optimizers alike). ``vanilla`` is the same update rule as
``dmuon`` (``torch.optim.Muon`` math, gather-then-compute; the parity tests show equal
parameters), so it uses dmuon's lr; it is here for the wall-clock axis. ``--summarize-only``
writes the JSON and plot from the runs finished so far (``seeds_done`` per optimizer says how
many).

``--prior FILE`` reuses the runs of an earlier study (FILE names its JSON, the commit its runs
were trained at and how that code was checked against this one): they count as seeds the work
dir does not hold. Such a run has per-checkpoint summaries only (success count, mean coverage,
no per-episode list), which is all the intervals below need. A run in ``--work-dir`` replaces a
prior run of the same (optimizer, lr, seed); the prior one's last checkpoint is kept beside it.

Intervals over seeds x episodes (``optimizers.<opt>.curve``): success pools the episodes of all
seeds (k of n, Wilson 95%; this treats the seeds' episodes as one sample, so it leaves out
seed-to-seed variation) and also gives the per-seed rates with a Student-t 95% interval over
the seed means (n - 1 degrees of freedom: wide with 3 seeds, but it is the interval that covers
training-seed variation); coverage gives the mean over seeds with that t interval (one seed:
the normal interval over its episodes). Every run's own per-checkpoint numbers are in ``runs``.

Wall-clock seconds are the sum of the training steps' measured times (``step_s_all`` of the
run summary; forward + backward + optimizer step, excluding checkpoint writes and start-up).

    python bench/pusht_study.py                     # the full study (3 seeds x sweep: hours on 2 cores)
    python bench/pusht_study.py --quick --out-dir /tmp/q   # CI smoke variant (tests/test_train_eval.py)

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
from dmuon.train.eval import EvalConfig, evaluate, summarize, wilson_ci  # noqa: E402

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
    p.add_argument("--prior", default=None,
                   help="JSON naming an earlier study's results and code commit whose runs count as done")
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


def _code_version() -> dict:
    """The commit of this checkout and whether the training path (dmuon/, bench/) has edits."""
    def git(*args: str) -> str:
        proc = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return proc.stdout.strip() if proc.returncode == 0 else ""
    return {"commit": git("rev-parse", "HEAD") or None,
            "dirty": bool(git("status", "--porcelain", "dmuon", "bench/pusht_study.py"))}


def train(a, opt: str, lr: float, seed: int) -> pathlib.Path:
    """Trains one run (skipped if its summary exists); returns its directory.

    Writes ``code.json`` (commit, dirty flag, start time) beside the run before training, so the
    study JSON can say which code produced each run.
    """
    run = pathlib.Path(a.work_dir) / f"{opt}_lr{lr:g}_s{seed}"
    if (run / "summary.json").exists():
        return run
    run.mkdir(parents=True, exist_ok=True)
    (run / "code.json").write_text(json.dumps(
        {**_code_version(), "started_utc": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())}))
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


def run_record(a, opt: str, lr: float, seed: int, run: pathlib.Path, evals: list[dict]) -> dict:
    """One run's per-checkpoint results, with each episode's success and final coverage."""
    summary = json.loads((run / "summary.json").read_text())
    code = json.loads((run / "code.json").read_text()) if (run / "code.json").exists() else {}
    curve = []
    for ev in evals:
        eps = ev["episodes"]
        curve.append({"step": ev["step"], "samples": ev["step"] * a.batch_size, "train_s": ev["train_s"],
                      "loss": ev["loss"], "successes": int(sum(e["success"] for e in eps)),
                      **summarize(eps),
                      "episode_success": [bool(e["success"]) for e in eps],
                      "episode_final_coverage": [float(e["final_coverage"]) for e in eps]})
    return {"optimizer": opt, "lr": lr, "seed": seed,
            "source": {"kind": "this study", "code": code or None, "run": run.name},
            "median_step_s": float(np.median(summary["step_s_all"])), "curve": curve}


def prior_records(path: str) -> dict[tuple, dict]:
    """Run records of an earlier study, from the JSON that ``--prior`` names.

    The prior file is ``{"study_json": ..., "code_commit": ..., ...}``; the study JSON it names is
    this script's older format (one seed, per-checkpoint summaries pooled over that seed only):
    its chosen lrs' curves give every checkpoint, the other sweep points the last one. Success
    counts are ``round(rate x episodes)``, exact for a rate of k / n.
    """
    meta = json.loads(pathlib.Path(path).read_text())
    old = json.loads((ROOT / meta["study_json"]).read_text())
    (seed,) = range(old["settings"]["seeds"])  # the old format holds one seed's numbers only
    batch = old["settings"]["batch_size"]
    source = {"kind": "prior", **{k: v for k, v in meta.items() if k != "note"}}

    def point(c: dict, step: int) -> dict:
        n = c["episodes"]
        return {"step": step, "samples": step * batch, "train_s": c.get("train_s_mean"),
                "loss": c.get("loss_mean", c.get("loss")), "successes": round(c["success_rate"]["mean"] * n),
                **{k: c[k] for k in ("episodes", "success_rate", "final_coverage", "max_coverage")}}

    out: dict[tuple, dict] = {}
    for opt, rows in old["sweep"].items():
        for r in rows:
            out[(opt, r["lr"], seed)] = {"optimizer": opt, "lr": r["lr"], "seed": seed, "source": source,
                                         "median_step_s": None, "curve": [point(r, old["settings"]["steps"])]}
    for opt, rec in old["optimizers"].items():
        out[(opt, rec["lr"], seed)] = {"optimizer": opt, "lr": rec["lr"], "seed": seed, "source": source,
                                       "median_step_s": None, "curve": [point(c, c["step"]) for c in rec["curve"]]}
    return out


# Student-t 0.975 quantiles by degrees of freedom (the 95% two-sided interval over seed means).
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def seed_ci(xs: list[float], bounds: tuple[float, float] = (0.0, 1.0)) -> dict:
    """Mean over seeds and its Student-t 95% interval ``mean +- t(n-1) s / sqrt(n)`` in ``bounds``.

    Raises:
        ValueError: fewer than 2 values (no spread to estimate) or more than 11 (no table entry).
    """
    n = len(xs)
    if not 2 <= n <= 11:
        raise ValueError(f"seed_ci: {n} values; the table covers 2 to 11 seeds")
    mean = float(np.mean(xs))
    half = _T975[n - 1] * float(np.std(xs, ddof=1)) / np.sqrt(n)
    return {"mean": mean, "ci95": [max(bounds[0], mean - half), min(bounds[1], mean + half)]}


def aggregate(recs: list[dict], step: int) -> dict:
    """The checkpoint ``step`` over the runs ``recs`` (one per seed): see the module docstring."""
    at = [next(c for c in r["curve"] if c["step"] == step) for r in recs]
    k, n = sum(c["successes"] for c in at), sum(c["episodes"] for c in at)
    rates = [c["successes"] / c["episodes"] for c in at]
    out = {"step": step, "samples": at[0]["samples"], "seeds": [r["seed"] for r in recs],
           "train_s_mean": float(np.mean([c["train_s"] for c in at])),
           "loss_mean": float(np.mean([c["loss"] for c in at])),
           "episodes": n, "successes": k, "success_rate": wilson_ci(k, n), "success_rate_per_seed": rates}
    for key in ("final_coverage", "max_coverage"):
        means = [c[key]["mean"] for c in at]
        out[f"{key}_per_seed"] = means
        out[key] = {**(seed_ci(means) if len(at) > 1 else at[0][key]),
                    "ci95_over": "seeds (t)" if len(at) > 1 else "episodes (normal)"}
    if len(at) > 1:
        out["success_rate_over_seeds"] = seed_ci(rates)
    return out


def write_gif(a, run: pathlib.Path, step: int, eval_cfg: EvalConfig) -> dict:
    """GIF of ``run``'s checkpoint ``step``: up to 3 episodes, successful ones first."""
    import dataclasses

    from dmuon.train.eval import write_video

    episodes = json.loads((run / f"eval_{step:06d}.json").read_text())["episodes"]
    chosen = [e["seed"] for e in episodes if e["success"]][:3]
    chosen += [e["seed"] for e in episodes if not e["success"]][: 3 - len(chosen)]
    policy, meta = ckpt.load_policy(ckpt.step_dir(run / "ckpt", step))
    cfg = dataclasses.replace(eval_cfg, video=a.gif, video_episodes=len(chosen))
    write_video(policy, cfg, ckpt.configs_from(meta)[1], chosen)
    return {"path": a.gif, "run": run.name, "step": step, "seeds": chosen,
            "success": [bool(next(e["success"] for e in episodes if e["seed"] == s)) for s in chosen]}


def plot(result: dict, path: pathlib.Path) -> None:
    """2 x 2: success and final coverage against samples seen and against training seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    expert = result["expert"]["summary"]
    for i, (opt, rec) in enumerate(result["optimizers"].items()):
        color = f"C{i}"
        curve = rec["curve"]
        for col, xkey in enumerate(("samples", "train_s_mean")):
            x = [c[xkey] for c in curve]
            for row, key in enumerate(("success_rate", "final_coverage")):
                ax = axes[row, col]
                ax.plot(x, [c[key]["mean"] for c in curve], marker="o", color=color,
                        label=f"{opt} (lr {rec['lr']:g}, {rec['seeds_done']} seeds)")
                ax.fill_between(x, [c[key]["ci95"][0] for c in curve], [c[key]["ci95"][1] for c in curve],
                                color=color, alpha=0.15)
                per_seed = [c[f"{key}_per_seed"] for c in curve]
                for s in range(len(per_seed[0])):  # each seed's own value, as dots
                    ax.plot(x, [p[s] for p in per_seed], ls="none", marker=".", color=color, alpha=0.5)
    for col in range(2):
        for row, key in enumerate(("success_rate", "final_coverage")):
            axes[row, col].axhline(expert[key]["mean"], color="k", ls="--", lw=1, label="scripted expert")
    axes[0, 0].set(ylabel="success rate (coverage > 0.95)\nband: Wilson 95%, episodes of all seeds pooled")
    axes[1, 0].set(ylabel="final coverage of the goal\nband: t 95% over seed means (1 seed: its episodes)")
    for row in range(2):
        axes[row, 0].set(xlabel="samples seen (steps x global batch)")
        axes[row, 1].set(xlabel="training wall-clock s (sum of step times, mean over seeds)")
    axes[0, 0].legend(fontsize=7)
    n = result["settings"]
    fig.suptitle(f"PushT closed loop: {n['eval_episodes']} held-out episodes per checkpoint and seed "
                 f"(dots: single seeds); {result['device']}", fontsize=9)
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
    records: dict[tuple, dict] = prior_records(a.prior) if a.prior else {}

    def run_job(opt: str, lr: float, seed: int) -> None:
        run = pathlib.Path(a.work_dir) / f"{opt}_lr{lr:g}_s{seed}"
        if records.get((opt, lr, seed), {}).get("source", {}).get("kind") == "this study":
            return  # recorded already (the sweep's seed 0 is also the seed grid's)
        if not (run / "summary.json").exists() and (a.summarize_only or (opt, lr, seed) in records):
            return  # not run yet, or a prior run stands for it
        rec = run_record(a, opt, lr, seed, train(a, opt, lr, seed), evaluate_run(a, run, eval_cfg, steps))
        if (opt, lr, seed) in records:
            rec["replaces_prior"] = records[(opt, lr, seed)]["curve"][-1]
        records[(opt, lr, seed)] = rec

    # The sweep on seed 0 first; its last checkpoint picks each optimizer's lr.
    for opt, text in (("dmuon", a.sweep_dmuon), ("adamw", a.sweep_adamw)):
        if opt in a.optimizers:
            for lr in text.split(","):
                run_job(opt, float(lr), 0)
    sweep: dict[str, list[dict]] = {}
    for (opt, lr, seed), rec in sorted(records.items()):
        if seed == 0 and opt != "vanilla" and opt in a.optimizers and rec["curve"][-1]["step"] == a.steps:
            last = rec["curve"][-1]
            sweep.setdefault(opt, []).append({"lr": lr, **{k: last[k] for k in (
                "loss", "episodes", "successes", "success_rate", "final_coverage", "max_coverage")}})
    best_lr = {opt: max(rows, key=lambda r: (r["success_rate"]["mean"], r["final_coverage"]["mean"]))["lr"]
               for opt, rows in sweep.items()}
    if "dmuon" in best_lr:
        best_lr["vanilla"] = best_lr["dmuon"]  # the same update rule (see the module docstring)
    for seed in seeds:
        for opt in a.optimizers:
            if opt in best_lr:
                run_job(opt, best_lr[opt], seed)
    runs = {opt: [records[(opt, best_lr[opt], s)] for s in seeds if (opt, best_lr[opt], s) in records]
            for opt in a.optimizers if opt in best_lr}
    print(f"chosen lrs: {best_lr}; seeds done: { {o: len(r) for o, r in runs.items()} }", flush=True)
    expert_cache = pathlib.Path(a.work_dir) / f"expert_{eval_cfg.episodes}_{eval_cfg.max_steps}.json"
    if not expert_cache.exists():
        expert_cache.parent.mkdir(parents=True, exist_ok=True)
        expert_cache.write_text(json.dumps(evaluate(None, eval_cfg, data, progress=False)["expert"]))
    expert = json.loads(expert_cache.read_text())

    result = {
        "device": f"cpu ({os.cpu_count()} cores, shared with other jobs), {a.nproc} gloo ranks",
        "torch": torch.__version__,
        "code": _code_version(),
        "settings": {k: v for k, v in vars(a).items() if k not in ("out_dir", "work_dir")},
        "eval": {"episodes": eval_cfg.episodes, "flow_steps": eval_cfg.flow_steps,
                 "exec_horizon": eval_cfg.exec_horizon, "max_steps": eval_cfg.max_steps,
                 "seeds": eval_cfg.seeds(data)},
        "sweep": sweep,
        "expert": expert,
        "optimizers": {},
        "runs": [rec for _, rec in sorted(records.items())],
        "study_wall_s": None if a.summarize_only else time.perf_counter() - t_start,
    }
    for opt in OPTIMIZERS:
        if not runs.get(opt):
            continue
        common = [s for s in steps if all(any(c["step"] == s for c in r["curve"]) for r in runs[opt])]
        curve = [aggregate(runs[opt], s) for s in common]
        best = max(curve, key=lambda c: c["final_coverage"]["mean"])
        result["optimizers"][opt] = {
            "lr": best_lr[opt], "seeds_done": len(runs[opt]), "seeds": [r["seed"] for r in runs[opt]],
            "curve": curve, "last": curve[-1], "best": best,
        }
    ref = expert["summary"]["final_coverage"]["mean"]
    if "dmuon" in result["optimizers"]:
        best_dmuon = result["optimizers"]["dmuon"]["best"]
        result["dmuon_best_over_expert_coverage"] = best_dmuon["final_coverage"]["mean"] / ref if ref > 0 else None
        on_disk = [pathlib.Path(a.work_dir) / r["source"]["run"] for r in runs["dmuon"] if r["source"].get("run")]
        if a.gif and on_disk:  # a prior run's checkpoints are not kept: the first seed trained here
            result["gif"] = write_gif(a, on_disk[0], best_dmuon["step"], eval_cfg)
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
    """Markdown table: every checkpoint of the chosen lrs, pooled over seeds, and each seed's rate."""
    rows = ["| policy | lr | seeds | step | samples | train s | success k/n | success (Wilson, pooled) | "
            "success per seed | success (t over seeds) | final coverage (t over seeds) |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for opt, rec in result["optimizers"].items():
        for c in rec["curve"]:
            over = c.get("success_rate_over_seeds")
            rows.append(f"| {opt} | {rec['lr']:g} | {','.join(map(str, c['seeds']))} | {c['step']} | "
                        f"{c['samples']:,} | {c['train_s_mean']:.0f} | {c['successes']}/{c['episodes']} | "
                        f"{_interval(c['success_rate'])} | "
                        f"{', '.join(f'{r:.2f}' for r in c['success_rate_per_seed'])} | "
                        f"{_interval(over) if over else '-'} | {_interval(c['final_coverage'])} |")
    e = result["expert"]["summary"]
    rows.append(f"| scripted expert | | | | | | | {_interval(e['success_rate'])} | | | "
                f"{_interval(e['final_coverage'])} |")
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
