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
        --out bench/results/torchtitan_trainer_cpu_2r.json \\
        --checkpoint dmuon_flag dmuon_flag_distconfig

Every run is one torchtitan command line (stored in the JSON): ``--module
bench.torchtitan_cpu_shim`` is the CPU shim (see that module), ``--debug.seed 0`` gives every run
the same initial weights and data, so step 1's loss and gradient norm must agree across runs;
``--training.global_batch_size 16`` is 2 micro-batches of 4 per rank (gradient accumulation 2);
``--metrics.enable_tensorboard`` makes torchtitan log each optimizer group's learning rate, read
back here from its TensorBoard files.

Runs: ``adamw`` (torchtitan's ``default_adamw``, lr 8e-4); ``dmuon_config`` (the three config
lines, ``llama3_debugmodel_cpu_dmuon``); ``dmuon_flag`` (the one flag ``--override.imports
dmuon.integrations.torchtitan.muon``, Muon at AdamW's lr with ``match_rms_adamw``);
``dmuon_flag_distconfig`` (the same on dmuon's ``distributed_config`` path). With
``--checkpoint RUN ...``, each such run again with ``CheckpointManager`` (interval 5), then the
same command once more with ``step-10`` moved aside, so that it resumes from ``step-5``: its
logged steps 6-10 and its ``step-10`` checkpoint (model, optimizer, LR scheduler, dataloader,
train state) are compared with the uninterrupted run's, exactly.
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
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BASE = ["--module", "bench.torchtitan_cpu_shim", "--debug.seed", "0",
        "--training.global_batch_size", "16", "--metrics.enable_tensorboard"]
RUNS = {
    "adamw": ["--config", "llama3_debugmodel_cpu"],
    "dmuon_config": ["--config", "llama3_debugmodel_cpu_dmuon"],
    "dmuon_flag": ["--config", "llama3_debugmodel_cpu",
                   "--override.imports", "dmuon.integrations.torchtitan.muon"],
    "dmuon_flag_distconfig": ["--config", "llama3_debugmodel_cpu", "--override.imports",
                              'dmuon.integrations.torchtitan.muon={"path": "distributed_config"}'],
}
CHECKPOINT = ["--checkpoint.enable", "--checkpoint.interval", "5"]
NUMBER = r"([-\d.eE+naif]+)"
STEP_LINE = re.compile(r"^\[titan\] (\S+ \S+) - root - INFO - step:\s*(\d+)\s+"
                       rf"loss:\s*{NUMBER}\s+grad_norm:\s*{NUMBER}.*?tps:\s*([\d,]+)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def torchrun(python: str, nproc: int, port: int, args: list[str], dump: Path, log: Path) -> dict:
    """One ``torchrun ... -m torchtitan.train`` (rank 0's output kept), parsed."""
    cmd = [python, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(port), "--local-ranks-filter", "0", "-m", "torchtitan.train", *BASE, *args,
           "--dump_folder", str(dump)]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    load_start = [round(x, 2) for x in os.getloadavg()]
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
    lrs = learning_rates(python, dump)
    shown = " ".join(a if re.fullmatch(r"[\w./=:,-]+", a) else f"'{a}'" for a in cmd[1:])
    return dict(command=f"PYTHONPATH=. OMP_NUM_THREADS=1 python {shown}", returncode=rc,
                wall_s=round(wall, 1), loadavg_start=load_start,
                loadavg_end=[round(x, 2) for x in os.getloadavg()], steps=order,
                loss=[steps[s]["loss"] for s in order],
                grad_norm=[steps[s]["grad_norm"] for s in order],
                tps=[steps[s]["tps"] for s in order], step_s=step_s, lr=lrs,
                errors=errors[-12:] if rc else [])


def cpu_model() -> str:
    """lscpu's model name, CPU family, model and hypervisor (``"AMD EPYC, family 25, model 17,
    KVM"``)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return platform.processor()
    fields = dict(ln.split(":", 1) for ln in out.splitlines() if ":" in ln)
    parts = [fields.get("Model name", platform.processor()).strip()]
    parts += [f"{k.lower()} {fields[k].strip()}" for k in ("CPU family", "Model") if k in fields]
    parts += [fields["Hypervisor vendor"].strip()] if "Hypervisor vendor" in fields else []
    return ", ".join(parts)


def git_commit() -> str:
    """The checkout's commit, ``+dirty`` when it has uncommitted changes."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                          text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                           capture_output=True, text=True).stdout.strip()
    return head + ("+dirty" if dirty else "")


def versions(python: str) -> dict:
    code = ("import json, sys, torch, importlib.metadata as m; print(json.dumps(dict("
            "torch=torch.__version__, torchtitan=m.version('torchtitan'), "
            "python='.'.join(map(str, sys.version_info[:3])))))")
    return json.loads(subprocess.run([python, "-c", code], capture_output=True, text=True,
                                     check=True).stdout)


TENSORBOARD = """
import glob, json, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
out = {}
for path in sorted(glob.glob(sys.argv[1] + "/**/events.out.tfevents.*", recursive=True)):
    acc = EventAccumulator(path, size_guidance={"scalars": 0})
    acc.Reload()
    for tag in acc.Tags()["scalars"]:
        if tag.startswith("lr/"):
            out[tag] = {e.step: e.value for e in acc.Scalars(tag)}
print(json.dumps(out))
"""


def learning_rates(python: str, dump: Path) -> dict:
    """torchtitan's logged learning rates (``lr/<optimizer>[/<group>]``) by step, from the
    TensorBoard files under ``dump`` (empty if there are none)."""
    out = subprocess.run([python, "-c", TENSORBOARD, str(dump)], capture_output=True, text=True)
    if out.returncode:
        return dict(error=out.stderr.strip().splitlines()[-1:])
    return {tag: [round(v, 9) for _, v in sorted(by_step.items(), key=lambda kv: int(kv[0]))]
            for tag, by_step in json.loads(out.stdout).items()}


COMPARE = """
import json, sys, tempfile, torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
def flat(d, pre=""):
    for k, v in d.items():
        yield from flat(v, f"{pre}{k}.") if isinstance(v, dict) else [(f"{pre}{k}", v)]
sds = []
for path in sys.argv[1:3]:
    with tempfile.NamedTemporaryFile(suffix=".pt") as f:
        dcp_to_torch_save(path, f.name)
        sds.append(dict(flat(torch.load(f.name, weights_only=False))))
a, b = sds
tensors = [k for k in a if isinstance(a[k], torch.Tensor)]
same = lambda k: torch.equal(a[k], b[k]) if k in tensors else a[k] == b[k]
differ = [k for k in a if k not in b or not same(k)]
parts = ("optimizer", "lr_scheduler", "dataloader", "train_state")
by_part = {}
for k in a:
    part = next((p for p in parts if k.startswith(p + ".")), "model")
    by_part[part] = by_part.get(part, 0) + 1
print(json.dumps(dict(entries=len(a), tensors=len(tensors), entries_by_part=by_part,
                      same_keys=sorted(a) == sorted(b), differing=differ[:20],
                      n_differing=len(differ))))
"""


def compare_checkpoints(python: str, a: Path, b: Path) -> dict:
    """Every entry of two DCP checkpoints (model, optimizer, LR schedulers, dataloader, train
    state), compared exactly (``torch.equal``) in the trainer's interpreter."""
    out = subprocess.run([python, "-c", COMPARE, str(a), str(b)], capture_output=True, text=True)
    if out.returncode:
        return dict(error=out.stderr.strip().splitlines()[-3:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def checkpoint_runs(a: argparse.Namespace, work: Path, run: str) -> dict:
    """Run ``run`` with ``CheckpointManager`` (interval 5: ``step-5``, ``step-10``); then its
    ``step-10`` moved aside and the same command run again (it resumes from ``step-5``); the two
    ``step-10`` checkpoints compared entry by entry."""
    args = RUNS[run] + CHECKPOINT
    work = work / f"ckpt_{run}"
    work.mkdir()
    dump = work / "dump"
    print(f"run {run} + checkpoint (save)", flush=True)
    save = torchrun(a.python, a.nproc, a.port, args, dump, work / "checkpoint_save.log")
    folder = dump / "checkpoint"
    saved = sorted(p.name for p in folder.glob("step-*")) if folder.exists() else []
    ckpt = dict(command_extra=CHECKPOINT, save=save, saved=saved)
    if save["returncode"] or saved != ["step-10", "step-5"]:
        return ckpt
    shutil.move(folder / "step-10", work / "uninterrupted_step-10")
    print(f"run {run} + checkpoint (resume)", flush=True)
    resume = torchrun(a.python, a.nproc, a.port, args, dump, work / "checkpoint_resume.log")
    full = {s: (l, g) for s, l, g in zip(save["steps"], save["loss"], save["grad_norm"])}
    ckpt.update(resume=resume, resumed_steps=resume["steps"],
                resume_logs_equal=[full.get(s) == (l, g) for s, l, g in
                                   zip(resume["steps"], resume["loss"], resume["grad_norm"])])
    if resume["returncode"] == 0:
        ckpt["step10_compare"] = compare_checkpoints(a.python, work / "uninterrupted_step-10",
                                                     folder / "step-10")
    return ckpt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", required=True, help="interpreter with torch>=2.14 and torchtitan")
    ap.add_argument("--out", required=True, help="result JSON")
    ap.add_argument("--work", default="/tmp/torchtitan_trainer", help="dump folders and logs")
    ap.add_argument("--runs", nargs="*", default=list(RUNS), choices=list(RUNS))
    ap.add_argument("--checkpoint", nargs="*", default=[], choices=list(RUNS),
                    help="runs to repeat with the checkpoint save/resume")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--port", type=int, default=29631)
    a = ap.parse_args()
    work = Path(a.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    out = Path(a.out)
    result = json.loads(out.read_text()) if out.exists() else {}
    result.update(device=dict(cpu=cpu_model(), cores=os.cpu_count(), ranks=a.nproc,
                              backend="gloo", threads_per_rank=1),
                  versions=versions(a.python), commit=git_commit(),
                  date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    runs = result.setdefault("runs", {})
    for name in a.runs:
        print(f"run {name}", flush=True)
        runs[name] = torchrun(a.python, a.nproc, a.port, RUNS[name], work / name,
                              work / f"{name}.log")
        print({k: runs[name][k] for k in ("returncode", "wall_s", "loss")}, flush=True)
    for run in a.checkpoint:
        ckpt = result.setdefault("checkpoint", {})
        ckpt[run] = checkpoint_runs(a, work, run)
        print({k: v for k, v in ckpt[run].items() if k not in ("save", "resume")}, flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
