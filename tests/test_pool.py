"""Tests of the multi-rank test pool (tests/_pool.py) and of the launcher it stands on
(dmuon/train/ranks.py): right answers, loud failures, recovery.

The ``_case_*`` functions run inside the gloo workers (``fn="tests.test_pool:_case_..."``),
``_launched_*`` in ranks started by :func:`dmuon.train.ranks.launch`. Failure tests shorten the
pool's grace period so that the whole file stays within ~35 s.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from dmuon.train.ranks import init_rank, launch, start_ranks
from tests._pool import DistPool, DistPoolError, RankExit, RankTimeoutError, spawn_world

_HERE = "tests.test_pool"


# ----- functions that run on the ranks ---------------------------------------------------------

def _case_allreduce(rank: int, world_size: int, length: int) -> dict:
    """All-reduce a rank-dependent float64 vector; report who ran it and what it drew."""
    mine = torch.arange(length, dtype=torch.float64) * (rank + 1)
    total = mine.clone()
    dist.all_reduce(total)  # SUM
    return {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "pid": os.getpid(),
        "threads": torch.get_num_threads(),
        "total": total,
        "torch_draw": torch.rand(3, dtype=torch.float64),
        "numpy_draw": np.random.rand(3),
    }


def _case_raise_on(rank: int, world_size: int, bad_rank: int, then_collective: bool) -> int:
    """``bad_rank`` raises; the others return, or wait in an all-reduce that never completes."""
    if rank == bad_rank:
        raise ValueError(f"deliberate failure on rank {rank}")
    if then_collective:
        dist.all_reduce(torch.ones(1))
    return rank


def _case_sleep_on(rank: int, world_size: int, slow_rank: int, sleep_s: float) -> int:
    """``slow_rank`` sleeps past the call's timeout; the others answer at once."""
    if rank == slow_rank:
        time.sleep(sleep_s)
    return rank


def _case_skip_collective(rank: int, world_size: int, skipping_rank: int) -> int:
    """Every rank but ``skipping_rank`` enters an all-reduce, which therefore never completes."""
    if rank != skipping_rank:
        dist.all_reduce(torch.ones(1))
    return rank


def _case_exit_on(rank: int, world_size: int, dying_rank: int, code: int) -> int:
    """``dying_rank`` exits abruptly (as if killed); the others return their rank."""
    if rank == dying_rank:
        os._exit(code)
    return rank


def _case_subgroup(rank: int, world_size: int) -> float:
    """Create a subgroup of the even ranks and all-reduce in it (it is destroyed afterwards)."""
    evens = dist.new_group(list(range(0, world_size, 2)))
    value = torch.tensor([float(rank)])
    if rank % 2 == 0:
        dist.all_reduce(value, group=evens)
    return value.item()


def _launched_rank(out_dir: str) -> None:
    """A rank of :func:`dmuon.train.ranks.launch`: all-reduce ``rank + 1`` and write what it saw."""
    import json

    total = torch.tensor([float(dist.get_rank() + 1)], dtype=torch.float64)
    dist.all_reduce(total)
    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(dict(
        rank=dist.get_rank(), world_size=dist.get_world_size(), backend=dist.get_backend(),
        env=[os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR")],
        threads=torch.get_num_threads(), total=total.item())))


def _launched_raise(arg: int) -> None:
    """Rank 1 raises; rank 0 waits in a barrier that breaks off when rank 1's group goes down.

    (Rank 0 returning at once instead could destroy its group while rank 1 was still connecting
    gloo's full mesh, and rank 1 then failed in ``init_process_group``, not here.)"""
    if dist.get_rank() == 1:
        raise ValueError(f"deliberate failure on launched rank 1 (arg {arg})")
    dist.barrier()


def _launched_root_cause_exits_last(marker_dir: str) -> None:
    """Rank 1 raises first but exits last (an exit handler holds it 3 s); the other ranks raise
    only once it has failed (the handler's marker file), as peers whose collectives broke off.
    torch's own join names whichever process it reaps first: here always a peer."""
    import atexit
    import time

    marker = Path(marker_dir, "rank1_failed")
    dist.barrier()  # every rank is connected: a peer's failure below is not one in init
    if dist.get_rank() == 1:
        atexit.register(time.sleep, 3.0)  # runs after the marker: LIFO
        atexit.register(marker.touch)
        raise ValueError("the root cause, raised on rank 1")
    deadline = time.monotonic() + 60
    while not marker.exists():
        if time.monotonic() > deadline:
            return  # rank 1 never got there: the test's assertions say so
        time.sleep(0.01)
    raise RuntimeError(f"a consequence on rank {dist.get_rank()}: the peer went away")


# ----- tests -----------------------------------------------------------------------------------

@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_allreduce_sums_and_ranks_come_back_in_order(dist_pool: DistPool, world_size: int):
    length = 5
    results = dist_pool.run(world_size, f"{_HERE}:_case_allreduce", {"length": length},
                            timeout_s=60)
    # Independent reference: sum_r (r + 1) * i = i * W (W + 1) / 2, in float64.
    expected = np.arange(length, dtype=np.float64) * world_size * (world_size + 1) / 2
    assert len(results) == world_size
    assert [r["rank"] for r in results] == list(range(world_size))
    assert len({r["pid"] for r in results}) == world_size  # one process per rank
    for r in results:
        assert r["world_size"] == world_size and r["backend"] == "gloo" and r["threads"] == 1
        np.testing.assert_array_equal(r["total"].numpy(), expected)


def test_every_rank_is_seeded_identically_per_call(dist_pool: DistPool):
    seed = 1234
    first = dist_pool.run(2, f"{_HERE}:_case_allreduce", {"length": 1}, seed=seed)
    again = dist_pool.run(2, f"{_HERE}:_case_allreduce", {"length": 1}, seed=seed)
    torch.manual_seed(seed)  # reference draws, made here in the test process
    np.random.seed(seed)
    torch_ref, numpy_ref = torch.rand(3, dtype=torch.float64), np.random.rand(3)
    for r in first + again:
        torch.testing.assert_close(r["torch_draw"], torch_ref, rtol=0, atol=0)
        np.testing.assert_array_equal(r["numpy_draw"], numpy_ref)


def test_isolated_call_runs_in_a_world_of_its_own_and_stops_it(dist_pool: DistPool):
    """``isolated=True``: new processes for the call, and they are gone before the next call."""
    def pids(**kwargs) -> set[int]:
        return {r["pid"] for r in dist_pool.run(2, f"{_HERE}:_case_allreduce", {"length": 1}, **kwargs)}

    before = pids()
    assert pids() == before  # the pool reuses a world between plain calls
    isolated = pids(isolated=True)
    after = pids()
    assert isolated.isdisjoint(before) and after.isdisjoint(isolated) and after.isdisjoint(before)


def test_subgroups_are_usable_and_cleaned_between_calls(dist_pool: DistPool):
    for _ in range(2):  # a second call must not trip over the first call's subgroup
        results = dist_pool.run(3, f"{_HERE}:_case_subgroup", timeout_s=30)
        assert results == [2.0, 1.0, 2.0]  # ranks 0 and 2 sum 0 + 2; rank 1 keeps its value


def test_raising_rank_is_named_with_its_traceback_and_pool_recovers(dist_pool: DistPool):
    starts = dist_pool.starts
    with pytest.raises(DistPoolError) as info:
        dist_pool.run(2, f"{_HERE}:_case_raise_on", {"bad_rank": 1, "then_collective": False})
    message = str(info.value)
    assert not isinstance(info.value, RankTimeoutError)
    assert "ranks [1] raised" in message and "ranks [0] returned" in message
    assert "ValueError: deliberate failure on rank 1" in message
    assert dist_pool.run(2, f"{_HERE}:_case_sleep_on", {"slow_rank": -1, "sleep_s": 0}) == [0, 1]
    assert dist_pool.starts == starts + 1  # the failed world was replaced by a fresh one


def test_raise_while_others_wait_in_a_collective_ends_after_grace(dist_pool: DistPool,
                                                                   monkeypatch):
    monkeypatch.setattr(dist_pool, "grace_s", 0.5)
    began = time.monotonic()
    with pytest.raises(RankTimeoutError) as info:
        dist_pool.run(4, f"{_HERE}:_case_raise_on", {"bad_rank": 2, "then_collective": True},
                      timeout_s=60)
    elapsed = time.monotonic() - began
    message = str(info.value)
    assert elapsed < 10, f"grace of 0.5 s was not applied: the call took {elapsed:.1f} s"
    assert "ranks [2] raised" in message and "deliberate failure on rank 2" in message
    assert "ranks [0, 1, 3] did not answer" in message
    assert "all_reduce" in message  # faulthandler stacks of the stuck ranks
    assert dist_pool.run(4, f"{_HERE}:_case_sleep_on", {"slow_rank": -1, "sleep_s": 0}) == [
        0, 1, 2, 3]


def test_sleeping_rank_times_out_by_name_and_pool_recovers(dist_pool: DistPool):
    began = time.monotonic()
    with pytest.raises(RankTimeoutError) as info:
        dist_pool.run(2, f"{_HERE}:_case_sleep_on", {"slow_rank": 1, "sleep_s": 120},
                      timeout_s=1.5)
    elapsed = time.monotonic() - began
    assert elapsed < 8, f"timeout_s=1.5 but the call took {elapsed:.1f} s"
    assert "ranks [1] did not answer within 1.5 s" in str(info.value)
    assert "_case_sleep_on" in str(info.value)  # where rank 1 was stuck
    results = dist_pool.run(2, f"{_HERE}:_case_allreduce", {"length": 2})
    np.testing.assert_array_equal(results[0]["total"].numpy(), [0.0, 3.0])


def test_rank_skipping_a_collective_hangs_the_others_and_is_reported(dist_pool: DistPool):
    with pytest.raises(RankTimeoutError, match=r"ranks \[1, 2, 3\] did not answer"):
        dist_pool.run(4, f"{_HERE}:_case_skip_collective", {"skipping_rank": 0}, timeout_s=1.5)
    assert dist_pool.run(4, f"{_HERE}:_case_sleep_on", {"slow_rank": -1, "sleep_s": 0}) == [
        0, 1, 2, 3]


def test_dying_rank_is_reported_with_its_exit_code(dist_pool: DistPool):
    with pytest.raises(DistPoolError, match=r"ranks 1 \(exitcode 7\) died without answering"):
        dist_pool.run(2, f"{_HERE}:_case_exit_on", {"dying_rank": 1, "code": 7}, timeout_s=30)


def test_world_of_eight(dist_pool: DistPool):
    results = dist_pool.run(8, f"{_HERE}:_case_allreduce", {"length": 2}, timeout_s=120)
    assert [r["rank"] for r in results] == list(range(8))
    np.testing.assert_array_equal(results[7]["total"].numpy(), [0.0, 36.0])


def test_bad_arguments_raise_value_error(dist_pool: DistPool):
    with pytest.raises(ValueError, match="world_size must be an int >= 1, got 0"):
        dist_pool.run(0, f"{_HERE}:_case_allreduce")
    with pytest.raises(ValueError, match="'package.module:function', got 'tests.test_pool'"):
        dist_pool.run(2, _HERE)
    with pytest.raises(ValueError, match=r"must not contain 'rank' or 'world_size'.*\['rank'\]"):
        dist_pool.run(2, f"{_HERE}:_case_allreduce", {"rank": 3})
    with pytest.raises(ValueError, match="start_method must be 'forkserver' or 'spawn'"):
        DistPool(start_method="fork")


def test_spawn_world_reports_killed_and_raising_ranks():
    results = spawn_world(3, f"{_HERE}:_case_exit_on", {"dying_rank": 1, "code": 5}, timeout_s=30)
    assert results[0] == 0 and results[2] == 2
    assert results[1] == RankExit(rank=1, exitcode=5, traceback=None)
    results = spawn_world(2, f"{_HERE}:_case_raise_on", {"bad_rank": 0, "then_collective": False},
                          timeout_s=30)
    assert results[1] == 1
    assert isinstance(results[0], RankExit) and results[0].exitcode == 1
    assert "deliberate failure on rank 0" in results[0].traceback
    with pytest.raises(RankTimeoutError, match=r"ranks \[1\] did not answer within 1.5 s"):
        spawn_world(2, f"{_HERE}:_case_sleep_on", {"slow_rank": 1, "sleep_s": 120}, timeout_s=1.5)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc to find zombies")
def test_close_reaps_every_worker():
    pool = DistPool()
    pids = [r["pid"] for r in pool.run(2, f"{_HERE}:_case_allreduce", {"length": 1})]
    pool.close()
    # A zombie keeps its /proc entry until reaped, so this also catches unreaped children.
    assert [pid for pid in pids if Path(f"/proc/{pid}").exists()] == []


# ----- dmuon.train.ranks: the one launcher of local ranks ------------------------------------------

def test_launch_runs_every_rank_in_one_gloo_group(tmp_path):
    launch(_launched_rank, str(tmp_path), 2, backend="gloo", threads=1, torchrun=False)
    import json

    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r, rank in enumerate(seen):
        assert (rank["rank"], rank["world_size"], rank["backend"]) == (r, 2, "gloo")
        assert rank["env"] == [str(r), str(r), "2", "127.0.0.1"] and rank["threads"] == 1
        assert rank["total"] == 3.0  # 1 + 2, the reference sum of rank + 1


def test_launch_reraises_a_rank_exception_with_its_traceback():
    with pytest.raises(torch.multiprocessing.ProcessRaisedException,
                       match="deliberate failure on launched rank 1 \\(arg 7\\)"):
        launch(_launched_raise, 7, 2, backend="gloo", threads=1, torchrun=False)


def test_launch_reports_the_first_failing_rank_first_whole(tmp_path):
    """Issue 33: the rank that raised first is the root cause, reported first with its whole
    traceback, even though it exits after the others; their errors follow as consequences.
    (On the old launcher, torch's join named rank 0's or 2's consequence instead.)"""
    with pytest.raises(torch.multiprocessing.ProcessRaisedException) as info:
        launch(_launched_root_cause_exits_last, str(tmp_path), 3, backend="gloo", threads=1,
               torchrun=False)
    report = str(info.value)
    assert info.value.error_index == 1, report
    head, _, tail = report.partition("after rank 1, most likely in consequence")
    assert head.startswith("rank 1 of 3 failed first:"), report
    assert "Traceback (most recent call last):" in head and "_launched_root_cause_exits_last" in head
    assert head.rstrip().endswith("ValueError: the root cause, raised on rank 1"), report
    assert "consequence on rank" not in head
    lines = tail.strip().splitlines()[1:]
    assert sorted(line.split(",")[0].strip() for line in lines) == ["rank 0", "rank 2"], report
    assert all("RuntimeError: a consequence on rank" in line and " s: " in line for line in lines)


def test_failure_report_orders_by_time_and_names_deaths_without_exceptions():
    """The report alone: recorded times order the ranks (not rank numbers, not exit order); a
    rank killed by a signal counts from when it was seen; ranks the launcher stopped come last."""
    from dmuon.train.ranks import failure_report

    records = {2: dict(time=10.0, error="RuntimeError: boom", traceback="Traceback ...\nRuntimeError: boom\n"),
               0: dict(time=10.5, error="RuntimeError: Connection closed by peer", traceback="...")}
    report, first = failure_report(records, {0: 11.0, 1: 10.2, 2: 12.0}, [1, -9, 1, None], stopped=[3])
    assert first == 2
    assert report.startswith("rank 2 of 4 failed first:\n\nTraceback ...\nRuntimeError: boom\n")
    tail = [line.strip() for line in report.split("in consequence", 1)[1].splitlines()[1:]]
    assert tail == ["rank 1, +0.200 s: killed by SIGKILL",
                    "rank 0, +0.500 s: RuntimeError: Connection closed by peer",
                    "rank 3: still running, stopped by the launcher"]
    report, first = failure_report({}, {1: 3.0}, [0, 7])
    assert first == 1 and report == "rank 1 of 2 failed first (exited with code 7 without a Python exception)\n"
    with pytest.raises(ValueError, match="needs a failed rank"):
        failure_report({}, {}, [0, 0])


def test_launch_under_torchrun_runs_in_this_process(tmp_path, monkeypatch):
    from dmuon.train.ranks import free_port

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("LOCAL_RANK", "0")
    launch(_launched_rank, str(tmp_path), 5, backend="gloo")  # nproc ignored under torchrun
    assert not dist.is_initialized()  # destroyed after fn
    import json

    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.json"]
    assert json.loads((tmp_path / "rank0.json").read_text())["total"] == 1.0


def test_launcher_refuses_bad_arguments():
    with pytest.raises(ValueError, match="nproc must be an int >= 1, got 0"):
        launch(_launched_rank, "", 0, torchrun=False)
    with pytest.raises(ValueError, match="nproc must be an int >= 1, got 0"):
        start_ranks(_launched_rank, 0)
    with pytest.raises(ValueError, match="start_method must be 'forkserver' or 'spawn'"):
        start_ranks(_launched_rank, 2, start_method="fork")
    with pytest.raises(ValueError, match="rank 2 is outside 0..1"):
        init_rank(2, 2, port=1)
    with pytest.raises(ValueError, match="rank 0 needs a rendezvous"):
        init_rank(0, 2)
