"""torchtitan 0.3.0's full ``Trainer`` (``python -m torchtitan.train``) on 2 CPU gloo ranks, with
torchtitan's AdamW and with dmuon, each run parsed from torchtitan's own log lines.

The trainer needs torch >= 2.14, so this driver runs it with another interpreter (``--python``,
a venv with torch 2.14.1, ``torchtitan==0.3.0`` and dmuon)::

    python -m venv /tmp/v2141
    touch /tmp/empty.txt  # in case a global pip constraints file pins torch
    PIP_CONSTRAINT=/tmp/empty.txt /tmp/v2141/bin/pip install torch==2.14.1 torchtitan==0.3.0 \\
        numpy pulp tqdm
    /tmp/v2141/bin/pip install -e . --no-deps
    python bench/torchtitan_trainer.py --python /tmp/v2141/bin/python \\
        --out bench/results/torchtitan_trainer_cpu_2r.json

Every run is one torchtitan command line (stored in the JSON): ``--module
bench.torchtitan_cpu_shim`` is the CPU shim (see that module), ``--debug.seed 0`` gives every run
the same initial weights and data, so step 1's loss and gradient norm must agree across runs.

Runs: ``adamw`` (torchtitan's ``default_adamw``, lr 8e-4); ``dmuon_config`` (the three config
lines, ``llama3_debugmodel_cpu_dmuon``); ``dmuon_flag`` (the one flag ``--override.imports
dmuon.integrations.torchtitan.muon``, Muon at AdamW's lr with ``match_rms_adamw``); and, with
``--checkpoint``, ``dmuon_flag`` with ``CheckpointManager`` (interval 5), then the same command
again after deleting ``step-10`` (so it resumes from step 5), its steps 6-10 compared with the
uninterrupted run's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BASE = ["--module", "bench.torchtitan_cpu_shim", "--debug.seed", "0"]
RUNS = {
    "adamw": ["--config", "llama3_debugmodel_cpu"],
    "dmuon_config": ["--config", "llama3_debugmodel_cpu_dmuon"],
    "dmuon_flag": ["--config", "llama3_debugmodel_cpu",
                   "--override.imports", "dmuon.integrations.torchtitan.muon"],
}
CHECKPOINT = ["--checkpoint.enable", "--checkpoint.interval", "5"]
STEP_LINE = re.compile(r"^\[titan\] (\S+ \S+) - root - INFO - step:\s*(\d+)\s+loss:\s*([-\d.eE+naif]+)\s+"
                       r"grad_norm:\s*([-\d.eE+naif]+).*?tps:\s*([\d,]+)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def torchrun(python: str, nproc: int, port: int, args: list[str], dump: Path, log: Path) -> dict:
    """One ``torchrun ... -m torchtitan.train`` (rank 0's output kept), parsed."""
    cmd = [python, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(port), "--local-ranks-filter", "0", "-m", "torchtitan.train", *BASE, *args,
           "--dump_folder", str(dump)]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - t0
    text = ANSI.sub("", log.read_text())
    steps = {}
    for line in text.splitlines():
        m = STEP_LINE.match(line.strip())
        if m:
            stamp = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f")
            steps[int(m.group(2))] = dict(loss=float(m.group(3)), grad_norm=float(m.group(4)),
                                          tps=int(m.group(5).replace(",", "")), at=stamp)
    order = sorted(steps)
    step_s = [None] + [round((steps[b]["at"] - steps[a]["at"]).total_seconds(), 3)
                       for a, b in zip(order, order[1:])]
    errors = [ln for ln in text.splitlines() if re.search(r"Error|error:|Traceback", ln)]
    shown = " ".join(a if re.fullmatch(r"[\w./=:,-]+", a) else f"'{a}'" for a in cmd[1:])
    return dict(command=f"PYTHONPATH=. OMP_NUM_THREADS=1 python {shown}", returncode=rc,
                wall_s=round(wall, 1), steps=order, loss=[steps[s]["loss"] for s in order],
                grad_norm=[steps[s]["grad_norm"] for s in order],
                tps=[steps[s]["tps"] for s in order], step_s=step_s,
                errors=errors[-12:] if rc else [])


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(ln.split(":", 1)[1].strip() for ln in out.splitlines()
                    if ln.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor()


def versions(python: str) -> dict:
    code = ("import json, torch, importlib.metadata as m; print(json.dumps(dict(torch=torch.__version__, "
            "torchtitan=m.version('torchtitan'), dmuon=m.version('dmuon'), "
            "python='.'.join(map(str, __import__('sys').version_info[:3])))))")
    return json.loads(subprocess.run([python, "-c", code], capture_output=True, text=True,
                                     check=True).stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", required=True, help="interpreter with torch>=2.14 and torchtitan")
    ap.add_argument("--out", required=True, help="result JSON")
    ap.add_argument("--work", default="/tmp/torchtitan_trainer", help="dump folders and logs")
    ap.add_argument("--runs", nargs="*", default=list(RUNS), choices=list(RUNS))
    ap.add_argument("--checkpoint", action="store_true", help="also the checkpoint save/resume runs")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--port", type=int, default=29631)
    a = ap.parse_args()
    work = Path(a.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    out = Path(a.out)
    result = json.loads(out.read_text()) if out.exists() else {}
    result.update(device=dict(cpu=cpu_model(), cores=os.cpu_count(), ranks=a.nproc,
                              backend="gloo", threads_per_rank=1,
                              loadavg_start=os.getloadavg()),
                  versions=versions(a.python), date=datetime.utcnow().strftime("%Y-%m-%d %H:%M UTC"))
    runs = result.setdefault("runs", {})
    for name in a.runs:
        print(f"run {name}", flush=True)
        runs[name] = torchrun(a.python, a.nproc, a.port, RUNS[name], work / name, work / f"{name}.log")
        print({k: runs[name][k] for k in ("returncode", "wall_s", "loss")}, flush=True)
    if a.checkpoint:
        args = RUNS["dmuon_flag"] + CHECKPOINT
        dump = work / "ckpt"
        print("run checkpoint_save", flush=True)
        save = torchrun(a.python, a.nproc, a.port, args, dump, work / "checkpoint_save.log")
        saved = sorted(p.name for p in (dump / "checkpoint").glob("step-*")) if (dump / "checkpoint").exists() else []
        ckpt = dict(save=save, saved=saved)
        if save["returncode"] == 0 and "step-5" in saved:
            shutil.rmtree(dump / "checkpoint" / "step-10", ignore_errors=True)
            print("run checkpoint_resume", flush=True)
            resume = torchrun(a.python, a.nproc, a.port, args, dump, work / "checkpoint_resume.log")
            ckpt["resume"] = resume
            full = dict(zip(save["steps"], save["loss"]))
            ckpt["resume_equal_losses"] = [full.get(s) == l for s, l in zip(resume["steps"], resume["loss"])]
        result["checkpoint"] = ckpt
        print({k: v for k, v in ckpt.items() if k not in ("save", "resume")}, flush=True)
    result["device"]["loadavg_end"] = os.getloadavg()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
