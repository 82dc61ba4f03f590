"""Stub CBC solvers that fail on purpose, and the multi-rank case that runs dedicate_params
(no plan given) under them (issue 28 item 4).

Each stub replaces ``pulp.PULP_CBC_CMD`` (what :mod:`dmuon.balance.milp` calls) and counts its
calls, so a test can tell that the MILP really ran and failed, rather than never being tried.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

#: The stubs' own failure texts; the warning and ``milp_status`` must carry them.
CRASH_TEXT = "stub CBC: terminate called after throwing an instance of 'CoinError'"
GARBAGE_VALUE = 0.5


class _Stub:
    """Takes PULP_CBC_CMD's arguments; ``actualSolve`` is what ``LpProblem.solve`` calls."""

    calls: list[bool] = []  # warmStart of every call, in order (reset by ``stub_cbc``)
    procs: list = []  # the "hang" stub's child processes
    kind = ""

    def __init__(self, *args, warmStart: bool = False, **kwargs) -> None:
        import os
        import sys

        self.warm_start = warmStart
        # what dmuon's hang watchdog kills by name: the "hang" stub's child runs this binary
        self.path = os.path.realpath(sys.executable)

    def actualSolve(self, lp, **kwargs):
        import pulp

        type(self).calls.append(self.warm_start)
        if self.kind == "raise":  # what PuLP raises when CBC aborts
            raise pulp.PulpSolverError(CRASH_TEXT)
        if self.kind == "unreadable":  # what parsing a truncated solution file raises
            raise ValueError("could not convert string to float: '**'")
        if self.kind == "garbage":  # "optimal", with values that are no plan
            for var in lp.variables():
                var.varValue = GARBAGE_VALUE
            lp.assignStatus(pulp.LpStatusOptimal, pulp.LpSolutionOptimal)
            return pulp.LpStatusOptimal
        if self.kind == "zeros":  # integral but places no matrix (a blank solution file)
            for var in lp.variables():
                var.varValue = 0.0
            lp.assignStatus(pulp.LpStatusOptimal, pulp.LpSolutionOptimal)
            return pulp.LpStatusOptimal
        if self.kind == "not_solved":  # time limit struck before any plan
            lp.assignStatus(pulp.LpStatusNotSolved, pulp.LpSolutionNoSolutionFound)
            return pulp.LpStatusNotSolved
        if self.kind == "hang":  # a CBC that never returns: a child process that sleeps
            import subprocess

            proc = subprocess.Popen([self.path, "-c", "import time; time.sleep(300)"])
            type(self).procs.append(proc)
            proc.wait()
            raise pulp.PulpSolverError(f"stub CBC exited {proc.returncode}")
        if self.kind == "infeasible":
            lp.assignStatus(pulp.LpStatusInfeasible, pulp.LpSolutionInfeasible)
            return pulp.LpStatusInfeasible
        raise AssertionError(f"unknown stub kind {self.kind!r}")


@contextlib.contextmanager
def stub_cbc(kind: str) -> Iterator[type[_Stub]]:
    """Replace ``pulp.PULP_CBC_CMD`` by a stub of ``kind`` ("raise", "garbage", "zeros",
    "not_solved", "infeasible", "unreadable", "hang") inside the block; yields the stub class
    (``.calls``, ``.procs``)."""
    import pulp

    stub = type(f"Stub_{kind}", (_Stub,), {"kind": kind, "calls": [], "procs": []})
    real = pulp.PULP_CBC_CMD
    pulp.PULP_CBC_CMD = stub
    try:
        yield stub
    finally:
        pulp.PULP_CBC_CMD = real
        for proc in stub.procs:  # never leave a sleeper behind, whatever the test did
            if proc.poll() is None:
                proc.kill()
                proc.wait()


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


#: Hidden widths of :func:`make_tower`: picked so that on 2, 3 and 4 ranks no heuristic plan
#: meets the lower bound, so ``solve`` does call the MILP (the stubs count the calls).
TOWER_HIDDEN = (25, 27, 19, 12, 38)


def make_tower():
    """Blocks of ``tests.models.Block(12, h)`` for ``h`` in :data:`TOWER_HIDDEN` and a
    ``[1, 12]`` head: 11 matrices, on CPU, seeded."""
    import torch
    from torch import nn

    from tests import models

    class Tower(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([models.Block(12, h) for h in TOWER_HIDDEN])
            self.head = nn.Linear(12, 1)

    torch.manual_seed(0)
    return Tower()


def tower_shapes() -> list[tuple[str, tuple[int, int]]]:
    """The matrices ``dedicate_params`` dedicates on :func:`make_tower` (2-D weights)."""
    return [(name, tuple(p.shape)) for name, p in make_tower().named_parameters() if p.ndim == 2]


def dedicate_under_stub(rank: int, world_size: int, *, kind: str) -> dict:
    """``dedicate_params`` without a plan while every rank's CBC is the ``kind`` stub; returns
    the plan's digest, method and ``milp_status``, this rank's stub calls and its warnings."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon
    model = make_tower()
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    records = _Records()
    log = logging.getLogger("dmuon.balance.solver")
    log.addHandler(records)
    try:
        with stub_cbc(kind) as stub:
            plan = dmuon.dedicate_params(model, mesh, group_cost=0.0)
    finally:
        log.removeHandler(records)
    return dict(digest=plan.digest(), method=plan.method,
                milp_status=plan.extra.get("milp_status"), calls=list(stub.calls),
                warnings=records.lines, named_shapes=[(m.fqn, m.shape) for m in plan.matrices],
                owners=[m.owner for m in plan.matrices])


def dedicate_when_rank0_plan_raises(rank: int, world_size: int) -> str:
    """``dedicate_params`` (no plan) while rank 0's ``build_plan`` raises a ValueError of its
    own (not a solver failure): every rank must raise, none may wait for the broadcast."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon
    import dmuon.hooks.dedicate as dedicate

    model = make_tower()
    mesh = init_device_mesh("cpu", (world_size,))
    fully_shard(model, mesh=mesh)  # FSDP2: the owner-plan path (a plain module takes buckets)

    def broken(*args, **kwargs):
        raise ValueError("dmuon: stub build_plan: bad cost table on rank 0")

    real = dedicate.build_plan
    dedicate.build_plan = broken
    try:
        dmuon.dedicate_params(model, mesh, group_cost=0.0)
    except Exception as e:  # returned, so the pool need not kill the world
        return f"{type(e).__name__}: {e}"
    finally:
        dedicate.build_plan = real
    return "no error"
