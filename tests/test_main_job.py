"""The README's main job, ``python -m dmuon.train --steps 3``, runs on the installed Python,
torch and PuLP (issue 38: on Python 3.12 with PuLP 4 it died building the owner plan).

The job runs as the README shows it (its default: 4 gloo ranks, the Pi0-style policy, dmuon with
an owner plan solved by rank 0), and once more with ``--optimizer vanilla``, the
gather-then-compute ``torch.optim.Muon`` math (``dmuon.train.baselines.VanillaMuon``, itself checked
against ``torch.optim.Muon`` on one process in tests/test_train.py). The same data and seed
give the same first loss; the two updates agree, so the later losses agree to float32 rounding.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def _main_job(tmp_path: Path, *extra: str) -> tuple[dict, str]:
    out = tmp_path / f"summary{'_'.join(extra)}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "dmuon.train", "--steps", "3", "--no-plot", "--out", str(out), *extra],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "could not build the owner plan" not in proc.stderr
    return json.loads(out.read_text()), proc.stdout


def test_main_job_three_steps_matches_the_gather_then_compute_reference(tmp_path):
    dmuon_run, stdout = _main_job(tmp_path)
    assert dmuon_run["world_size"] == 4 and dmuon_run["optimizer"] == "dmuon"
    assert "step    3/3" in stdout
    ref, _ = _main_job(tmp_path, "--optimizer", "vanilla")
    losses, ref_losses = np.array(dmuon_run["losses"]), np.array(ref["losses"])
    assert losses.shape == (3,) and np.isfinite(losses).all()
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=0)
    assert losses[-1] < losses[0]
