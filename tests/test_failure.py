"""The failure contract (issue 15): no hang past the user's timeout, a desynchronised rank
fails every rank by name, torch's argument checks, all-or-nothing loads, errors that name
the fix. Rank functions: ``tests/failure_cases.py``."""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch import nn

import dmuon
from tests._pool import spawn_world

PG_TIMEOUT_S = 5.0  # the "user's" timeout in the desync tests: init_process_group(timeout=5 s)
SLACK_S = 4.0  # scheduling on 2 shared cores
# gloo's timeout, in either wording: "Application timeout caused pair closure" or "Timed out
# waiting 5000ms for recv operation", depending on which side of the pair gives up first
GLOO_TIMEOUT = re.compile(r"[Tt]ime(d )?out")


# ----------------------------------------------------------------------------- 1. timeouts
@pytest.mark.parametrize("world_size,shape,names", [
    (2, (2,), None),
    (4, (2, 2), ("replicate", "shard")),
    (4, (2, 2), ("dp", "tp")),
])
def test_dmuon_groups_inherit_the_user_timeout(dist_pool, world_size, shape, names):
    """The pool's default group has a 300 s timeout; torch would give dmuon's groups 1800 s."""
    out = dist_pool.run(world_size, "tests.failure_cases:group_timeouts",
                        dict(mesh_shape=shape, names=names), timeout_s=120, fresh=len(shape) > 1)
    for result in out:
        assert result["default"] == dist_pool.pg_timeout_s
        assert result["dmuon"] and set(result["dmuon"].values()) == {dist_pool.pg_timeout_s}, result


@pytest.mark.parametrize("step_check,words", [
    (True, ["dmuon: rank 1 waited in vain for the other ranks at its forward after 3 optimizer step(s)",
            "step check over ranks [0, 1]", GLOO_TIMEOUT, "ran fewer steps"]),
    # without the check, the default replicas="keep" waits on a gradient bucket (a reduce-to-owner,
    # or the last bucket's all-reduce, which carries the other parameters too and names the
    # owner too), which gloo ends with its timeout: "Application timeout caused pair closure" or
    # "Timed out waiting 5000ms for recv operation", depending on which side of the pair gives up
    (False, ["dmuon: rank 1 waited in vain for the ", "owner rank", "dmuon group of ranks [0, 1]",
             GLOO_TIMEOUT, "out of step"]),
])
def test_extra_step_fails_within_the_user_timeout(step_check, words):
    """The issue's hang: on the plain replicated path, rank 1 runs one step more; the others
    stay alive (waiting on the store), so only the timeout can end its wait: the step check's,
    or without it a reduce-to-owner's (replicas="keep") or publication's: it names the matrices
    and their owner."""
    out = spawn_world(2, "tests.failure_cases:desync",
                      dict(fault="extra_step", victim=1, mode="replicated", step_check=step_check),
                      timeout_s=120, pg_timeout_s=PG_TIMEOUT_S)
    assert out[0]["error"] is None, out[0]
    victim = out[1]
    assert victim["type"] == "RuntimeError", victim
    for word in words:
        found = word.search(victim["error"]) if isinstance(word, re.Pattern) else word in victim["error"]
        assert found, (word, victim["error"])
    assert PG_TIMEOUT_S - 0.5 <= victim["after_s"] <= PG_TIMEOUT_S + SLACK_S, victim


@pytest.mark.parametrize("mode", ["fsdp", "fsdp-before"])
def test_extra_step_under_fsdp2_fails_by_name_within_the_user_timeout(mode):
    """Under FSDP2 the forward step check goes out at the end of opt.step() (issue 25), so a
    rank running one step more passes it with the others' last one; the first thing that waits
    for them is FSDP2's all-gather of the next forward, whose timeout dmuon raises as the
    check's error (StepCheck.guard_fsdp_pre_forward), with dedicate_params after or before
    fully_shard."""
    out = spawn_world(2, "tests.failure_cases:desync",
                      dict(fault="extra_step", victim=1, mode=mode, step_check=True),
                      timeout_s=120, pg_timeout_s=PG_TIMEOUT_S)
    assert out[0]["error"] is None, out[0]
    victim = out[1]
    assert victim["type"] == "RuntimeError", victim
    for word in ["dmuon: rank 1 waited in vain for the other ranks at its forward after 3 optimizer step(s)",
                 "step check over ranks [0, 1]", "FSDP2's all-gather", GLOO_TIMEOUT, "ran fewer steps"]:
        found = word.search(victim["error"]) if isinstance(word, re.Pattern) else word in victim["error"]
        assert found, (word, victim["error"])
    assert PG_TIMEOUT_S - 0.5 <= victim["after_s"] <= PG_TIMEOUT_S + SLACK_S, victim


@pytest.mark.parametrize("mode", ["fsdp", "fsdp-before"])
def test_forward_check_settles_before_fsdp2_root_all_gather(dist_pool, mode):
    """fully_shard(model) prepends FSDP2's root pre-forward hook too (FSDPState.init), so with
    dedicate_params called first it would run before the step check's: binding moves the
    check back in front, so a rank out of step fails in the check before FSDP2 issues a
    collective."""
    out = dist_pool.run(2, "tests.failure_cases:check_order", dict(mode=mode), timeout_s=60)
    assert out == [["dmuon::step_check_wait", "FSDP::root_pre_forward"]] * 2, out


# ----------------------------------------------------------------------------- 2. desync
DESYNC = [("skip_step", "replicated"), ("skip_step", "fsdp"),
          ("skip_backward", "replicated"), ("skip_backward", "fsdp")]


@pytest.fixture(scope="module")
def desync_runs():
    """Every :data:`DESYNC` scenario, in turn, in one fresh 2-rank world (one process start)."""
    out = spawn_world(2, "tests.failure_cases:desync_all", dict(scenarios=DESYNC),
                      timeout_s=180, pg_timeout_s=PG_TIMEOUT_S)
    assert all(isinstance(o, list) for o in out), out
    return {scenario: [out[r][i] for r in range(2)] for i, scenario in enumerate(DESYNC)}


@pytest.mark.parametrize("fault,mode", DESYNC)
def test_desynchronised_rank_fails_every_rank_by_name(desync_runs, fault, mode):
    """Rank 1 skips ``opt.step()`` or ``backward()`` in step 1: both ranks raise at once (no
    timeout), naming both ranks' step and backward counts; stock FSDP2/DDP train on silently
    (skipped step) or abort in gloo (skipped backward)."""
    # skip_step: both meet at step 2's forward, rank 1 with one opt.step() fewer.
    # skip_backward: rank 0's backward of step 1 meets rank 1's forward of step 2.
    expected = {"skip_step": ["ranks [0] are at a forward after 2 opt.step() call(s) and 2 backward(s)",
                              "ranks [1] are at a forward after 1 opt.step() call(s) and 2 backward(s)"],
                "skip_backward": ["ranks [0] are at a backward after 1 opt.step() call(s) and 1 backward(s)",
                                  "ranks [1] are at a forward after 2 opt.step() call(s) and 1 backward(s)"]}
    for rank, result in enumerate(desync_runs[(fault, mode)]):
        assert result["type"] == "RuntimeError", (rank, result)
        assert result["error"].startswith(f"dmuon: ranks are out of step (seen on rank {rank})"), result
        for words in expected[fault] + ["skipped or repeated opt.step() or loss.backward()"]:
            assert words in result["error"], (words, result["error"])
        assert result["after_s"] < PG_TIMEOUT_S, result  # by the check, not by a timeout


@pytest.mark.parametrize("step_check,checks", [(True, 7), (False, 0)])
def test_step_check_costs_two_collectives_per_step(dist_pool, step_check, checks):
    """Two per step; under FSDP2 the next forward's check is issued at the end of each step
    (StepCheck.issue_at_step), so the last step's goes out too: 2 * 3 + 1."""
    out = dist_pool.run(2, "tests.failure_cases:no_desync_counts",
                        dict(steps=3, step_check=step_check), timeout_s=60)
    # step_check=False creates no gloo group for the check at all (issue 25)
    assert out == [dict(checks=checks, steps=3, backwards=3, gloo_group=step_check)] * 2


# ----------------------------------------------------------------------------- 3. argument checks
NAN, INF = float("nan"), float("inf")
ARGUMENTS = [  # (kwargs, error, words); torch.optim.Muon / AdamW reject the negative ones too
    (dict(lr=NAN), ValueError, ["lr", "nan"]),
    (dict(lr=-1.0), ValueError, ["lr", "-1.0", ">= 0"]),
    (dict(lr=INF), ValueError, ["lr", "inf"]),
    (dict(weight_decay=NAN), ValueError, ["weight_decay", "nan"]),
    (dict(weight_decay=-0.1), ValueError, ["weight_decay", "-0.1"]),
    (dict(momentum=1.0), ValueError, ["momentum", "[0, 1)", "1.0"]),
    (dict(momentum=NAN), ValueError, ["momentum", "nan"]),
    (dict(eps=-1e-7), ValueError, ["eps", "-1e-07"]),
    (dict(ns_steps=0), ValueError, ["ns_steps", ">= 1", "0"]),
    (dict(ns_steps=2.5), ValueError, ["ns_steps", "2.5"]),
    (dict(adamw_lr=NAN), ValueError, ["adamw_lr", "nan"]),
    (dict(adamw_weight_decay=-0.5), ValueError, ["adamw_weight_decay", "-0.5"]),
    (dict(adamw_eps=-1e-3), ValueError, ["adamw_eps", "-0.001"]),
    (dict(adamw_eps=NAN), ValueError, ["adamw_eps", "nan"]),
    (dict(adamw_betas=(0.9, 1.0)), ValueError, ["adamw_betas[1]", "[0, 1)"]),
    (dict(adamw_betas=(-0.1, 0.99)), ValueError, ["adamw_betas[0]", "-0.1"]),
    (dict(lr="0.1"), TypeError, ["lr", "real number", "str"]),
]


@pytest.mark.parametrize("entry", ["model", "distributed_config"])
@pytest.mark.parametrize("kwargs,error,words", ARGUMENTS, ids=[str(a[0]) for a in ARGUMENTS])
def test_bad_hyperparameters_are_refused_by_both_entry_points(entry, kwargs, error, words):
    """Checked before anything else (no dedicate_params or process group needed)."""
    target = nn.Linear(4, 4) if entry == "model" else list(nn.Linear(4, 4).parameters())
    with pytest.raises(error) as info:
        dmuon.Muon(target, **kwargs)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


@pytest.mark.parametrize("group,words", [
    (dict(lr=NAN), ["param group 0", "lr", "nan"]),
    (dict(use_muon=False, weight_decay=-1.0), ["param group 0", "adamw_weight_decay", "-1.0"]),
    (dict(use_muon=False, betas=(0.9, 1.5)), ["param group 0", "adamw_betas[1]", "1.5"]),
])
def test_param_group_overrides_are_checked(group, words):
    with pytest.raises(ValueError) as info:
        dmuon.Muon([{"params": [torch.zeros(4, 4, requires_grad=True)], **group}], distributed_config=None)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_torch_refuses_what_the_issue_lists():
    """The reference behaviour the checks follow (not dmuon's code): torch.optim.AdamW refuses
    negative eps and weight decay; torch.optim.Muon refuses NaN lr only when the test
    ``not 0.0 <= lr`` catches it (it does)."""
    w = [torch.zeros(4, 4, requires_grad=True)]
    for kwargs in (dict(eps=-1e-3), dict(weight_decay=-0.5)):
        with pytest.raises(ValueError):
            torch.optim.AdamW(w, **kwargs)
    with pytest.raises(ValueError):
        torch.optim.Muon(w, lr=math.nan)


# ----------------------------------------------------------------------------- 4. loads
LOADS = [  # (fault, error, words)
    ("missing_file", "RuntimeError", ["loading checkpoint", "failed on ranks [0, 1]", "FileNotFoundError", ".distcp"]),
    ("corrupt_metadata", "RuntimeError", ["loading checkpoint", "failed on ranks [0, 1]", "metadata"]),
    ("missing_key", "RuntimeError", ["loading checkpoint", "Missing key", "model.spare.weight"]),
    ("wrong_shape", "RuntimeError", ["loading checkpoint", "Size mismatch", "blocks.0.fc1"]),
    ("sd_wrong_shape", "ValueError", ["does not fit this model on ranks [1]", "shape (3, 3)", "expects"]),
    ("sd_wrong_dtype", "ValueError", ["does not fit this model on ranks [0]", "torch.float64"]),
]


@pytest.mark.parametrize("fault,error,words", LOADS, ids=[c[0] for c in LOADS])
def test_failed_load_leaves_every_tensor_bitwise_unchanged(dist_pool, tmp_path, fault, error, words):
    out = dist_pool.run(2, "tests.failure_cases:failed_load", dict(path=str(tmp_path / "ck"), fault=fault),
                        timeout_s=120)
    for rank, result in enumerate(out):
        assert result["error"] is not None and result["error"].startswith(f"{error}: dmuon: "), (rank, result)
        for word in words + ["Nothing was loaded"]:
            assert word in result["error"], (word, result["error"])
        assert result["tensors"] > 40 and result["changed"] == [], (rank, result["changed"])


def test_successful_load_restores_the_saved_state_bitwise(dist_pool, tmp_path):
    """The control for the test above: the same job, no fault; one more step changed every
    tensor, and dmuon.load puts back exactly what was saved (scheduler included)."""
    out = dist_pool.run(2, "tests.failure_cases:failed_load", dict(path=str(tmp_path / "ck"), fault="none"),
                        timeout_s=120)
    for rank, result in enumerate(out):
        assert result["error"] is None, result
        assert len(result["changed"]) > 10, result  # the load did write
        assert result["differs_from_saved"] == [], (rank, result["differs_from_saved"])


# ----------------------------------------------------------------------------- 5. clear errors
@pytest.mark.parametrize("case,world_size,error,words", [
    ("process-group-mesh", 2, "TypeError", ["DeviceMesh", "ProcessGroup", "DeviceMesh.from_group"]),
    ("list-model", 2, "TypeError", ["nn.Module", "got list", "model.parameters()"]),
    ("partial-mesh", 3, "ValueError", ["holds ranks [0, 1]", "job has 3 ranks", "ranks [2] are outside",
                                       "init_device_mesh(device_type, (3,))"]),
])
def test_misuse_raises_a_clear_error_on_every_rank(dist_pool, case, world_size, error, words):
    out = dist_pool.run(world_size, "tests.failure_cases:bad_call", dict(case=case), timeout_s=60)
    for rank, message in enumerate(out):
        assert message.startswith(f"{error}: dmuon: "), (rank, message)
        for word in words:
            assert word in message, (word, message)


@pytest.mark.parametrize("text,error,words", [
    ('{"schema_version": 1, "world_size": 2, "matrices": [{"fqn": "a.weight', ValueError,
     ["not valid JSON", "line 1", "plan.json"]),
    ("[1, 2]", ValueError, ["holds a JSON list", "plan.json"]),
    (('{"schema_version": 1, "world_size": 2, "matrices": [{"fqn": "a.weight", "shape": [4, 4], '
      '"owner": "rank0"}]}'), ValueError, ["'a.weight'", "owner='rank0'", "integer", "plan.json"]),
])
def test_bad_plan_file_names_the_file_and_the_field(tmp_path, text, error, words):
    from dmuon.owners.plan import PLAN_SCHEMA_VERSION

    path = tmp_path / "plan.json"
    path.write_text(text.replace('"schema_version": 1', f'"schema_version": {PLAN_SCHEMA_VERSION}'))
    with pytest.raises(error) as info:
        dmuon.OwnerPlan.load(path)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


@pytest.mark.parametrize("argv,words", [
    (["--steps", "-1"], ["--steps -1", "must be >= 1"]),
    (["--nproc", "4", "--mesh", "hsdp:3x3"], ["--mesh hsdp:3x3 needs 9 ranks", "the job has 4", "--nproc 9"]),
    (["--nproc", "0"], ["--nproc 0"]),
    (["--optimizer", "adamw", "--overlap", "forward"], ["--overlap forward needs --optimizer dmuon"]),
    (["--clip-grad-norm", "0"], ["--clip-grad-norm 0.0 must be > 0"]),
])
def test_train_cli_answers_bad_values_with_a_usage_error(capsys, monkeypatch, argv, words):
    from dmuon.train.launch import parse_args

    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m dmuon.train") and "Traceback" not in err, err
    for word in words:
        assert word in err, (word, err)
