"""The parts of PuLP the owner MILP uses, for PuLP 3.x and 4.x alike.

PuLP 4 (Python >= 3.12) rebuilt its modelling layer on a Rust core: ``LpVariable(name, low,
up, cat=...)`` raises ``TypeError`` there (a variable is made by its problem,
``LpProblem.add_variable``), ``LpProblem.solve`` returns an ``LpSolveStats`` instead of a status
int and the problem has no ``status``/``sol_status`` any more, and the CBC binary that PuLP 3
bundled (``PULP_CBC_CMD``) is gone: ``COIN_CMD`` runs the ``cbcbox`` package's CBC (PuLP's
``cbc`` extra) or a ``cbc`` on ``PATH``. Everything :mod:`dmuon.balance.milp` needs from PuLP
goes through the functions below; the expression operators (``+``, ``<=``, ``lpSum``) and
``setInitialValue`` are the same in both. Read in PuLP 3.3.2's ``pulp.py`` / ``apis/coin_api.py``
and PuLP 4.0.0 / 4.2.0's ``core/lp_problem.py``, ``core/lp_variable.py``, ``core/lp_stats.py``,
``apis/coin.py`` (4.0.0 and 4.2.0 agree on all of these).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a CBC solve gave back, the same for both PuLPs.

    Attributes:
        has_plan: CBC returned a feasible solution (optimal or its incumbent at a limit).
        optimal: CBC proved that solution optimal.
        status: PuLP's own words for it, for messages (e.g. ``"status 'Not Solved',
            solution 'No Solution Found'"`` from PuLP 3, ``"status 'TimeLimit', no solution"``
            from PuLP 4).
    """

    has_plan: bool
    optimal: bool
    status: str


def load() -> ModuleType:
    """``import pulp``. Raises whatever importing it raises (ImportError, or an error of the
    Rust core of PuLP 4)."""
    import pulp

    return pulp


def major(pulp: ModuleType) -> int:
    """PuLP's major version (3 or 4); 3 when the version string cannot be read."""
    try:
        return int(str(getattr(pulp, "__version__", "3")).split(".")[0])
    except ValueError:
        return 3


def version(pulp: ModuleType) -> str:
    return str(getattr(pulp, "__version__", "unknown"))


def variable(prob, name: str, low: float | None = None, up: float | None = None,
             cat: str = "Continuous"):
    """A variable of ``prob``: ``LpProblem.add_variable`` (PuLP 4, and 3.3 on), else the
    PuLP 3 constructor ``LpVariable(name, low, up, cat)``."""
    add = getattr(prob, "add_variable", None)
    if add is not None:
        return add(name, low, up, cat)
    import pulp

    return pulp.LpVariable(name, low, up, cat)


def cbc_class_name(pulp: ModuleType) -> str:
    """Name of the CBC solver class in ``pulp`` that :func:`cbc` calls: PuLP 3's
    ``PULP_CBC_CMD`` (its bundled CBC binary), PuLP 4's ``COIN_CMD`` (cbcbox's or PATH's)."""
    return "PULP_CBC_CMD" if hasattr(pulp, "PULP_CBC_CMD") else "COIN_CMD"


def cbc(pulp: ModuleType, *, time_limit_s: int, warm_start: bool, options: list[str]):
    """A silent CBC command solver with a time limit (seconds), warm start and extra options.
    PuLP 3.x announces ``PULP_CBC_CMD``'s removal with a DeprecationWarning, which the caller
    silences."""
    cls = getattr(pulp, cbc_class_name(pulp))
    return cls(msg=False, timeLimit=time_limit_s, warmStart=warm_start, options=options)


def cbc_available(pulp: ModuleType, solver) -> str | None:
    """None when ``solver`` can run, else why not and what to install."""
    available = getattr(solver, "available", None)
    if available is None or available():
        return None
    if major(pulp) >= 4:
        return (f"PuLP {version(pulp)} finds no CBC binary ({getattr(solver, 'path', 'cbc')!r}):"
                f" PuLP 4 bundles none; pip install 'pulp[cbc]' (the cbcbox package) or put "
                f"'cbc' on PATH")
    return f"PuLP {version(pulp)}'s CBC binary {getattr(solver, 'path', 'cbc')!r} cannot run"


def solve(pulp: ModuleType, prob, solver) -> Outcome:
    """``prob.solve(solver)`` and what came back, for both PuLPs.

    PuLP 3 records the outcome on the problem (``prob.sol_status``: ``LpSolutionOptimal``,
    ``LpSolutionIntegerFeasible`` = an incumbent at the time limit); PuLP 4 returns an
    ``LpSolveStats`` (``status``: why CBC stopped, ``has_solution``: whether it returned a
    feasible point; CBC's "Optimal" line is ``LpSolveStatus.Optimal``).

    Raises:
        whatever ``prob.solve`` raises (``PulpSolverError`` when CBC exits non-zero or writes
        no solution file; ``ValueError`` when the file does not parse), and ``TypeError`` when
        the solve returns something neither PuLP returns.
    """
    result = prob.solve(solver)
    if hasattr(result, "has_solution"):  # PuLP 4's LpSolveStats
        optimal = bool(result.has_solution) and int(result.status) == int(
            pulp.LpSolveStatus.Optimal)
        name = getattr(result, "status_str", str(result.status))
        return Outcome(has_plan=bool(result.has_solution), optimal=optimal,
                       status=f"status {name!r}, "
                              f"{'a solution' if result.has_solution else 'no solution'}")
    if not hasattr(prob, "sol_status"):
        raise TypeError(f"PuLP {version(pulp)}'s solve returned {result!r}, neither a PuLP 3 "
                        f"status nor a PuLP 4 LpSolveStats")
    status = pulp.LpStatus.get(prob.status, prob.status)
    solution = pulp.LpSolution.get(prob.sol_status, prob.sol_status)
    optimal = prob.sol_status == pulp.LpSolutionOptimal
    has_plan = optimal or prob.sol_status == pulp.LpSolutionIntegerFeasible
    return Outcome(has_plan=has_plan, optimal=optimal,
                   status=f"status {status!r}, solution {solution!r}")


def value(var) -> float | None:
    """A variable's value after the solve (None when the solver gave it none)."""
    return var.value()
