"""Stub CBC solvers that fail on purpose, and the multi-rank case that runs dedicate_params
(no plan given) under them (issue 28 item 4).

Each stub replaces PuLP's CBC class (``PULP_CBC_CMD`` on PuLP 3, ``COIN_CMD`` on PuLP 4: what
:func:`dmuon.balance.milp.cbc` calls) and counts its calls, so a test can tell that the
MILP really ran and failed, rather than never being tried. The stubs answer in the installed
PuLP's own terms (PuLP 3: a status on the problem; PuLP 4: an ``LpSolveStats``).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

#: The stubs' own failure texts; the warning and ``milp_status`` must carry them.
CRASH_TEXT = "stub CBC: terminate called after throwing an instance of 'CoinError'"
GARBAGE_VALUE = 0.5


def pulp_major() -> int:
    import pulp

    from dmuon.balance import milp

    return milp.pulp_major(pulp)


def _answer(lp, outcome: str):
    """What PuLP's CBC returns for ``outcome`` ("optimal", "not_solved", "infeasible")."""
    import pulp

    if pulp_major() >= 4:
        status = {"optimal": pulp.LpSolveStatus.Optimal, "not_solved": pulp.LpSolveStatus.NotSolved,
                  "infeasible": pulp.LpSolveStatus.Infeasible}[outcome]
        return pulp.LpSolveStats(solver="stub", status=status, has_solution=outcome == "optimal")
    status, solution = {
        "optimal": (pulp.LpStatusOptimal, pulp.LpSolutionOptimal),
        "not_solved": (pulp.LpStatusNotSolved, pulp.LpSolutionNoSolutionFound),
        "infeasible": (pulp.LpStatusInfeasible, pulp.LpSolutionInfeasible)}[outcome]
    lp.assignStatus(status, solution)
    return status


class _Stub:
    """Takes the CBC class's arguments; ``actualSolve`` is what PuLP 3's ``LpProblem.solve``
    calls, ``solve`` what PuLP 4's calls."""

    calls: list[bool] = []  # warmStart of every call, in order (reset by ``stub_cbc``)
    procs: list = []  # the "hang" stub's child processes
    kind = ""

    def __init__(self, *args, warmStart: bool = False, **kwargs) -> None:
        import os
        import sys

        self.warm_start = warmStart
        # what dmuon's hang watchdog kills by name: the "hang" stub's child runs this binary
        self.path = os.path.realpath(sys.executable)

    def solve(self, lp, **kwargs):
        return self.actualSolve(lp, **kwargs)

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
            return _answer(lp, "optimal")
        if self.kind == "zeros":  # integral but places no matrix (a blank solution file)
            for var in lp.variables():
                var.varValue = 0.0
            return _answer(lp, "optimal")
        if self.kind == "not_solved":  # time limit struck before any plan
            return _answer(lp, "not_solved")
        if self.kind == "hang":  # a CBC that never returns: a child process that sleeps
            import subprocess

            proc = subprocess.Popen([self.path, "-c", "import time; time.sleep(300)"])
            type(self).procs.append(proc)
            proc.wait()
            raise pulp.PulpSolverError(f"stub CBC exited {proc.returncode}")
        if self.kind == "infeasible":
            return _answer(lp, "infeasible")
        raise AssertionError(f"unknown stub kind {self.kind!r}")


@contextlib.contextmanager
def stub_cbc(kind: str) -> Iterator[type[_Stub]]:
    """Replace PuLP's CBC class by a stub of ``kind`` ("raise", "garbage", "zeros",
    "not_solved", "infeasible", "unreadable", "hang") inside the block; yields the stub class
    (``.calls``, ``.procs``)."""
    import pulp

    from dmuon.balance import milp

    name = milp.cbc_class_name(pulp)
    stub = type(f"Stub_{kind}", (_Stub,), {"kind": kind, "calls": [], "procs": []})
    real = getattr(pulp, name)
    setattr(pulp, name, stub)
    try:
        yield stub
    finally:
        setattr(pulp, name, real)
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
    """``dedicate_params(solver="milp")`` without a plan while every rank's CBC is the ``kind`` stub; returns
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
    log = logging.getLogger("dmuon.balance")  # the fallback's warning: dmuon.balance.milp
    log.addHandler(records)
    try:
        with stub_cbc(kind) as stub:
            plan = dmuon.dedicate_params(model, mesh, group_cost=0.0, solver="milp")
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

    real = dedicate.default_plan
    dedicate.default_plan = broken
    try:
        dmuon.dedicate_params(model, mesh, group_cost=0.0)
    except Exception as e:  # returned, so the pool need not kill the world
        return f"{type(e).__name__}: {e}"
    finally:
        dedicate.default_plan = real
    return "no error"


def dedicate_with_real_cbc(rank: int, world_size: int) -> dict:
    """``dedicate_params(solver="milp")`` without a plan, with the installed PuLP's real CBC (counted: a
    subclass that records each construction's warm start); the plan's digest, method,
    makespan and per-matrix costs, this rank's CBC runs and its warnings."""
    import pulp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon
    from dmuon.balance import milp

    name = milp.cbc_class_name(pulp)
    real = getattr(pulp, name)
    calls: list[bool] = []

    class Counted(real):
        def __init__(self, *args, warmStart: bool = False, **kwargs) -> None:
            calls.append(warmStart)
            super().__init__(*args, warmStart=warmStart, **kwargs)

    model = make_tower()
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    records = _Records()
    loggers = [logging.getLogger(n) for n in ("dmuon.balance.solver", "dmuon.balance.milp")]
    for log in loggers:
        log.addHandler(records)
    setattr(pulp, name, Counted)
    try:
        plan = dmuon.dedicate_params(model, mesh, group_cost=0.0, solver="milp")
    finally:
        setattr(pulp, name, real)
        for log in loggers:
            log.removeHandler(records)
    return dict(digest=plan.digest(), method=plan.method, extra=dict(plan.extra),
                makespan=plan.makespan, costs=[m.cost for m in plan.matrices],
                owners=[m.owner for m in plan.matrices], calls=calls, warnings=records.lines,
                pulp=milp.pulp_version(pulp))


def dedicate_when_rank0_error_does_not_pickle(rank: int, world_size: int) -> str:
    """Like :func:`dedicate_when_rank0_plan_raises`, with an exception that cannot be pickled
    (its class is local to this function): rank 0 must not be left alone in the broadcast."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon
    import dmuon.hooks.dedicate as dedicate

    class LocalError(RuntimeError):  # pickle cannot find it by name
        pass

    model = make_tower()
    mesh = init_device_mesh("cpu", (world_size,))
    fully_shard(model, mesh=mesh)

    def broken(*args, **kwargs):
        raise LocalError("dmuon: stub build_plan: an error pickle cannot carry")

    real = dedicate.default_plan
    dedicate.default_plan = broken
    try:
        dmuon.dedicate_params(model, mesh, group_cost=0.0)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    finally:
        dedicate.default_plan = real
    return "no error"
