"""dmuon under torch's fake process group, unpatched (issue 25): one process plays rank 0 of 8.

Nothing that needs a live peer may be created when it is not used: the step check's gloo group
(a gloo group cannot be made over a fake store), the plan broadcast (the plan is solved in
process), the plan digest exchange. The case runs in a subprocess (``tests/fake_pg_cases.py``)
so its default process group never meets the pool's; about 5 s on 2 cores.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def rank0() -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "tests.fake_pg_cases", "rank0_of_8"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_nothing_needing_a_peer_is_created(rank0):
    assert rank0["backends"] == ["fake"]  # no gloo group: the step check's is not made
    assert not rank0["steps_group"] and rank0["step_checks"] == 0
    assert any("step check" in o for o in rank0["offline"])
    assert any("plan broadcast" in o for o in rank0["offline"])
    assert rank0["steps_done"] == 3  # the counts still run (the optimizer's step hook)


def test_rank0_owns_what_the_in_process_plan_gives_it(rank0):
    assert rank0["plan_equal"]
    assert rank0["owned"] == rank0["expected_owned"]
    assert 0 < len(rank0["owned"]) < rank0["matrices"]
    # the owner orthogonalizes exactly its own matrices, every step
    assert rank0["ns_matrices"] == 3 * len(rank0["owned"])


def test_every_hook_fired_once_per_unit_or_matrix(rank0):
    calls, units = rank0["calls"], rank0["units"]
    assert calls["dmuon::pre_forward"] == units
    assert calls["dmuon::pre_backward"] == units
    assert calls["dmuon::grad_hook"] == rank0["matrices"]
    assert calls["dmuon::finish_backward"] == 1
    assert calls["dmuon::publish_after_step"] == 1
    assert calls["dmuon::newton_schulz"] >= 1
