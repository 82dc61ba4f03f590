"""The owner MILP: exposed Newton-Schulz time, with the makespan as its one-unit case, by CBC.

Matrices of one key ``q = (unit, group, class)`` are interchangeable, so the model counts them:
``x[q, r]`` is how many rank ``r`` owns (Qwen2.5-7B at 256 ranks: 768 integers, not 50,176
binaries). A class is a (cost, memory) pair (:func:`milp_class`), or the shape where it pays a
batch overhead ``f_s > 0`` once per (rank, unit).

    minimize    E + w M + group_cost * sum y
    subject to  sum_r x[q, r] = n_q                                        for every key q
                U[k, r] = sum_(q in unit k) c_q x[q, r] + f_s z[(k, s), r]   (per-unit NS load)
                x[q, r] <= n_q z[(k, s), r],  z <= sum of those x     (z binary, where f_s > 0)
                C[k, r] = C[k-1, r] + U[k, r],  C[-1, r] = 0                      (completion)
                C[k, r] - d_k <= E                              for every unit k and rank r
                C[K-1, r] <= M,   C[K-1, 0] >= C[K-1, 1] >= ...    (makespan; rank symmetry)
                sum_q m_q x[q, r] <= cap                                (memory cap, optional)
                x[q, r] <= n_q y[g, r],  y[g, r] <= sum_(q in g) x[q, r],  sum y >= #groups
                E >= a proven lower bound                                (lets CBC stop early)

``E`` is the exposed time of :mod:`dmuon.balance.deadline`; with one unit and ``d_0 = 0`` it
is the makespan (``P || C_max``). The publish-group binaries ``y`` (:mod:`dmuon.balance.grouping`)
enter only with ``group_cost > 0``. ``c`` is a matrix's marginal NS cost, ``f`` a batch's fixed
cost (:func:`dmuon.balance.cost.fit_batch_costs`), ``m`` its bytes.

CBC comes with PuLP 3 (``PULP_CBC_CMD``) or, on PuLP 4, from ``pulp[cbc]`` or ``PATH``
(``COIN_CMD``); the functions under "PuLP" below are the only calls that differ. Every failure
of the solver path raises :class:`MilpFailure`; :func:`milp_fallback` retries once without the
warm start and falls back to the heuristic plan with a warning.
"""

from __future__ import annotations

import logging
import os
import signal
import tempfile
import threading
import time
import warnings
from types import ModuleType
from typing import Hashable, Mapping, Sequence

from dmuon.balance.assignment import effective_costs, makespan_lower_bound

logger = logging.getLogger(__name__)


class MilpFailure(RuntimeError):
    """CBC gave no usable plan; the message says why."""


class PulpUnusable(MilpFailure):
    """PuLP cannot be imported or finds no CBC to run: a retry cannot help."""


def milp_class(shape: Hashable, cost: float, memory: float, overhead: float) -> tuple:
    """A matrix's MILP class: its (cost, memory), or its shape where it pays a batch overhead."""
    return ("shape", shape) if overhead > 0 else ("cost", cost, memory)


def solve_milp(
    costs: Sequence[float],
    num_ranks: int,
    *,
    classes: Sequence[Hashable],
    units: Sequence[int] | None = None,
    deadlines: Sequence[float] = (0.0,),
    memory: Sequence[float] | None = None,
    memory_cap: float | None = None,
    batch_overhead: Mapping[Hashable, float] | None = None,
    warm_start: Sequence[int] | None = None,
    time_limit_s: float = 10.0,
    groups: Sequence[int] | None = None,
    group_cost: float = 0.0,
    makespan_weight: float = 0.0,
    bound: float = 0.0,
) -> tuple[tuple[int, ...], bool]:
    """Solve the MILP above with CBC (arguments as :func:`dmuon.balance.solve`'s).

    Args:
        units: default all in unit 0; ``deadlines`` default ``[0]``: the makespan.
        warm_start: an initial plan (owners per matrix), e.g. the heuristic's.
        groups: used only with ``group_cost > 0``.
        makespan_weight: ``w``; ``bound``: a proven lower bound on ``E``.

    Returns:
        ``(owners, optimal)``: owners per matrix, ``optimal`` False for CBC's incumbent at the
        time limit.

    Raises:
        ValueError: when matrices of one class differ in cost or memory.
        PulpUnusable: PuLP cannot be imported or finds no CBC (a retry fails the same way).
        MilpFailure: the model cannot be built, CBC gives no plan, or its values cannot be
            read; the message names the stage.
    """
    n = len(costs)
    units = [0] * n if units is None else [int(u) for u in units]
    overhead = {s: float((batch_overhead or {}).get(s, 0.0)) for s in classes}
    # Several units: costs scaled by the largest (raw FLOP deadlines ~1e13 made CBC return all
    # zeros); one unit: raw costs, which CBC proves optimal faster.
    scale = max([float(c) for c in costs] + list(overhead.values()) + [0.0]) or 1.0
    scale = scale if len(deadlines) > 1 else 1.0
    mem = [0.0] * n if memory is None else [float(m) for m in memory]
    keys = [(units[i], groups[i] if group_cost > 0 else None,
             milp_class(s, float(costs[i]), mem[i], overhead[s])) for i, s in enumerate(classes)]
    table: dict = {}  # key -> [count, cost, memory, batched shape or None, members]
    for i, q in enumerate(keys):
        row = table.setdefault(q, [0, float(costs[i]) / scale, mem[i],
                                   classes[i] if overhead[classes[i]] > 0 else None, []])
        if row[1] != float(costs[i]) / scale or row[2] != mem[i]:
            raise ValueError(
                f"dmuon: matrices {row[4][0]} and {i} share class {classes[i]!r} but have costs "
                f"{row[1] * scale} vs {costs[i]} and memory {row[2]} vs {mem[i]}; one class must "
                f"be one cost and one memory size (give classes=None to group by (cost, memory))")
        row[0] += 1
        row[4].append(i)
    if len(deadlines) == 1:  # the makespan: its pigeonhole bound lets CBC stop early
        eff = effective_costs(costs, classes, overhead)
        bound = max(float(bound), makespan_lower_bound(eff, num_ranks) - float(deadlines[0]))
    try:
        import pulp
    except Exception as e:  # ImportError, or PuLP 4's Rust core failing to load
        raise PulpUnusable(f"PuLP could not be imported ({type(e).__name__}: {_first_line(e)}); "
                           f"pip install 'pulp>=3.3.2,<5' (on Python >= 3.12: 'pulp[cbc]', "
                           f"whose CBC PuLP 4 needs)") from e
    start = time.perf_counter()
    with warnings.catch_warnings():
        # PuLP 3.x announces API changes for 4.0 (PULP_CBC_CMD's removal); both are handled.
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            prob, x = _build(pulp, table=table, keys=keys, num_ranks=num_ranks,
                             memory_cap=memory_cap, deadlines=[float(d) / scale for d in deadlines],
                             w=float(makespan_weight), group_cost=float(group_cost) / scale,
                             bound=float(bound) / scale, warm_start=warm_start,
                             overhead={s: f / scale for s, f in overhead.items()})
            # No ``threads``: with threads=1 CBC's worker sometimes never starts. ``rins off``:
            # CBC 2.10.3's RINS aborts on warm-started models (issue 28).
            solver = cbc(pulp, time_limit_s=max(1, int(round(time_limit_s))),
                         warm_start=warm_start is not None, options=["rins off"])
        except Exception as e:  # a PuLP whose modelling API this code does not know
            raise MilpFailure(f"PuLP {pulp_version(pulp)} could not build the model: "
                              f"{type(e).__name__}: {_first_line(e)}") from e
        missing = cbc_available(pulp, solver)
        if missing is not None:
            raise PulpUnusable(missing)
        # PuLP deletes its files only after a solve that returned; our directory always goes
        with tempfile.TemporaryDirectory(prefix="dmuon-cbc-", ignore_cleanup_errors=True) as tmp:
            solver.tmpDir = tmp
            has_plan, optimal, status = _solve_with_deadline(pulp, prob, solver, time_limit_s)
        if not has_plan:
            raise MilpFailure(f"CBC returned no plan: {status} after {time.perf_counter() - start:.1f}"
                              f" s (time limit {time_limit_s} s)")
        try:
            owners = _read(x, table, num_ranks, n)
        except MilpFailure:
            raise
        except Exception as e:  # a value PuLP hands back in a form this code does not know
            raise MilpFailure(f"CBC's solution could not be read through PuLP {pulp_version(pulp)}:"
                              f" {type(e).__name__}: {_first_line(e)}") from e
    logger.debug("dmuon: CBC %s in %.2fs (%d keys x %d ranks)", "optimal" if optimal else
                 "incumbent", time.perf_counter() - start, len(table), num_ranks)
    return tuple(owners), optimal


def _build(pulp, *, table, keys, num_ranks, memory_cap, deadlines, w, group_cost, bound, overhead,
           warm_start):
    """The MILP of the module docstring as a PuLP problem, warm start set; ``(problem, x)``."""
    order = list(table)
    K, ranks = len(deadlines), range(num_ranks)
    prob = pulp.LpProblem("dmuon_owner_plan", pulp.LpMinimize)
    x = {(n, r): prob.add_variable(f"x_{n}_{r}", 0, table[q][0], "Integer")
         for n, q in enumerate(order) for r in ranks}
    batches = list(dict.fromkeys((q[0], table[q][3]) for q in order if table[q][3] is not None))
    z = {(j, r): prob.add_variable(f"z_{j}_{r}", 0, 1, "Binary") for j in range(len(batches)) for r in ranks}
    batch_of = {q: batches.index((q[0], table[q][3])) for q in order if table[q][3] is not None}
    gids = list(dict.fromkeys(q[1] for q in order if q[1] is not None))
    y = {(g, r): prob.add_variable(f"y_{m}_{r}", 0, 1, "Binary") for m, g in enumerate(gids) for r in ranks}
    # C[k, r] as variables where there are several units; one unit's is its load expression
    comp = {(k, r): prob.add_variable(f"C_{k}_{r}", 0, None, "Continuous")
            for k in range(K) for r in ranks} if K > 1 else {}
    e = prob.add_variable("exposed", 0, None, "Continuous")
    m = prob.add_variable("makespan", 0, None, "Continuous") if w else None
    prob += e + (w * m if w else 0) + group_cost * pulp.lpSum(y.values())
    prob += e >= max(0.0, bound)
    if gids:
        prob += pulp.lpSum(y.values()) >= len(gids)  # every group has at least one owner
    for n, q in enumerate(order):
        prob += pulp.lpSum(x[n, r] for r in ranks) == table[q][0]
        for r in ranks:
            if q in batch_of:
                prob += x[n, r] <= table[q][0] * z[batch_of[q], r]
            if q[1] is not None:
                prob += x[n, r] <= table[q][0] * y[q[1], r]
    for (g, r), v in y.items():  # a pair exists only where the rank owns part of the group
        prob += v <= pulp.lpSum(x[n, r] for n, q in enumerate(order) if q[1] == g)
    for (j, r), v in z.items():  # a batch is paid only where a matrix of its shape is owned
        prob += v <= pulp.lpSum(x[n, r] for n, q in enumerate(order) if batch_of.get(q) == j)
    for r in ranks:
        for k in range(K):
            unit = pulp.lpSum(table[q][1] * x[n, r] for n, q in enumerate(order) if q[0] == k)
            unit += pulp.lpSum(overhead[s] * z[j, r] for j, (u, s) in enumerate(batches) if u == k)
            if K == 1:
                comp[k, r] = unit
            else:
                prob += comp[k, r] == (comp[k - 1, r] if k else 0) + unit
            prob += comp[k, r] - deadlines[k] <= e
    for r in ranks:
        if w:
            prob += comp[K - 1, r] <= m
        if r + 1 < num_ranks:
            prob += comp[K - 1, r] >= comp[K - 1, r + 1]
        if memory_cap is not None:
            prob += pulp.lpSum(table[q][2] * x[n, r] for n, q in enumerate(order)) <= memory_cap
    if warm_start is not None:
        _warm(warm_start, keys, order, table, batches, deadlines, overhead, num_ranks,
              x, z, y, comp, e, m)
    return prob, x


def _warm(owners, keys, order, table, batches, deadlines, overhead, num_ranks, x, z, y, comp, e, m):
    """Feed a plan to CBC, ranks relabelled by decreasing load (the symmetry constraint)."""
    index = {q: n for n, q in enumerate(order)}
    K = len(deadlines)
    counts = [[0] * len(order) for _ in range(num_ranks)]
    for i, r in enumerate(owners):
        counts[r][index[keys[i]]] += 1
    held = [{(q[0], table[q][3]) for n, q in enumerate(order) if counts[r][n]} for r in range(num_ranks)]
    cum = []
    for r in range(num_ranks):
        per = [0.0] * K
        for n, q in enumerate(order):
            per[q[0]] += table[q][1] * counts[r][n]
        for u, s in held[r]:
            if s is not None:
                per[u] += overhead[s]
        cum.append([sum(per[:k + 1]) for k in range(K)])
    relabel = sorted(range(num_ranks), key=lambda r: (-cum[r][-1], r))
    for new, old in enumerate(relabel):
        for n in range(len(order)):
            x[n, new].setInitialValue(counts[old][n])
        for j, batch in enumerate(batches):
            z[j, new].setInitialValue(1 if batch in held[old] else 0)
        for (g, r), v in y.items():
            if r == new:
                v.setInitialValue(1 if any(counts[old][n] for n, q in enumerate(order) if q[1] == g)
                                  else 0)
        for k in range(K if K > 1 else 0):
            comp[k, new].setInitialValue(cum[old][k])
    e.setInitialValue(max(0.0, max(c - d for row in cum for c, d in zip(row, deadlines))))
    if m is not None:
        m.setInitialValue(max(row[-1] for row in cum))


def _read(x, table, num_ranks, n):
    """Owners per matrix from CBC's counts ``x[k, r]``.

    Raises:
        MilpFailure: naming the first count that is not a non-negative integer (within 1e-6)
            or the first key whose counts do not sum to its size.
    """
    owners = [0] * n
    for k, key in enumerate(table):
        counts = []
        for r in range(num_ranks):
            value = x[k, r].value()
            ok = isinstance(value, (int, float)) and value == value and abs(value) != float("inf")
            if not ok or abs(value - round(value)) > 1e-6 or round(value) < 0:
                raise MilpFailure(
                    f"CBC returned an unusable solution: {x[k, r].name} = {value!r} is not a "
                    f"count of matrices (a non-negative integer)")
            counts.append(int(round(value)))
        members = table[key][4]
        if sum(counts) != len(members):
            raise MilpFailure(
                f"CBC returned an unusable solution: class {key!r} has {len(members)} matrices "
                f"but its counts sum to {sum(counts)}")
        it = iter(members)
        for r, count in enumerate(counts):
            for _ in range(count):
                owners[next(it)] = r
    return owners


#: Seconds past twice CBC's time limit after which a CBC that has not returned is killed as hung
#: (reading and writing took under 1 s for Pi0 at 256 ranks; load can stretch wall time 2-3x).
HANG_MARGIN_S = 30.0


def _solve_with_deadline(pulp, prob, solver, time_limit_s: float) -> tuple[bool, bool, str]:
    """:func:`_solve_pulp` in a worker thread, waited on for ``2 * time_limit_s +``
    :data:`HANG_MARGIN_S` seconds (PuLP waits on CBC without a timeout).

    Raises:
        MilpFailure: when CBC raised, or did not return in time (its processes are then
            killed where ``/proc`` exists).
    """
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["outcome"] = _solve_pulp(pulp, prob, solver)
        except BaseException as e:  # handed to the caller below
            box["error"] = e

    thread = threading.Thread(target=run, name="dmuon-cbc", daemon=True)
    thread.start()
    deadline_s = 2 * time_limit_s + HANG_MARGIN_S
    thread.join(deadline_s)
    if thread.is_alive():
        killed = _kill_child_processes(os.path.basename(str(getattr(solver, "path", "cbc"))))
        raise MilpFailure(
            f"CBC did not return within {deadline_s:.0f} s (time limit {time_limit_s} s): "
            f"hung; killed {killed} process(es)")
    if "error" in box:
        e = box["error"]
        # PulpSolverError: CBC exited non-zero or wrote no solution
        what = "crashed" if type(e).__name__ == "PulpSolverError" else "failed"
        raise MilpFailure(f"CBC {what}: {type(e).__name__}: {_first_line(e)}") from e
    return box["outcome"]


def _kill_child_processes(name: str) -> int:
    """SIGKILL this process's children named ``name`` (Linux ``/proc``); how many."""
    killed = 0
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            comm = stat[stat.index("(") + 1:stat.rindex(")")]
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])
            if ppid == os.getpid() and comm == name[:15]:  # the kernel keeps 15 characters
                os.kill(pid, signal.SIGKILL)
                killed += 1
        except (OSError, ValueError):
            continue
    return killed


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else "(no message)"


# ------------------------------------------------------------------ PuLP 3.x and 4.x


def pulp_major(pulp: ModuleType) -> int:
    """PuLP's major version (3 or 4); 3 when the version string cannot be read."""
    try:
        return int(str(getattr(pulp, "__version__", "3")).split(".")[0])
    except ValueError:
        return 3


def pulp_version(pulp: ModuleType) -> str:
    return str(getattr(pulp, "__version__", "unknown"))


def cbc_class_name(pulp: ModuleType) -> str:
    """PuLP 3's ``PULP_CBC_CMD`` (its bundled CBC binary), else PuLP 4's ``COIN_CMD``."""
    return "PULP_CBC_CMD" if hasattr(pulp, "PULP_CBC_CMD") else "COIN_CMD"


def cbc(pulp: ModuleType, *, time_limit_s: int, warm_start: bool, options: list[str]):
    """A silent CBC command solver with a time limit (seconds), warm start and extra options."""
    cls = getattr(pulp, cbc_class_name(pulp))
    return cls(msg=False, timeLimit=time_limit_s, warmStart=warm_start, options=options)


def cbc_available(pulp: ModuleType, solver) -> str | None:
    """None when ``solver`` can run, else why not and what to install."""
    available = getattr(solver, "available", None)
    if available is None or available():
        return None
    path = getattr(solver, "path", "cbc")
    if pulp_major(pulp) >= 4:
        return (f"PuLP {pulp_version(pulp)} finds no CBC binary ({path!r}): PuLP 4 bundles "
                f"none; pip install 'pulp[cbc]' (the cbcbox package) or put 'cbc' on PATH")
    return f"PuLP {pulp_version(pulp)}'s CBC binary {path!r} cannot run"


def _solve_pulp(pulp: ModuleType, prob, solver) -> tuple[bool, bool, str]:
    """``prob.solve(solver)``: ``(has_plan, optimal, status)``, ``status`` in PuLP's words, from
    PuLP 3's ``prob.sol_status`` or PuLP 4's returned ``LpSolveStats``.

    Raises:
        whatever ``prob.solve`` raises, and ``TypeError`` when it returns neither PuLP's result.
    """
    result = prob.solve(solver)
    if hasattr(result, "has_solution"):  # PuLP 4's LpSolveStats
        has_plan = bool(result.has_solution)
        optimal = has_plan and int(result.status) == int(pulp.LpSolveStatus.Optimal)
        name = getattr(result, "status_str", str(result.status))
        return has_plan, optimal, f"status {name!r}, {'a' if has_plan else 'no'} solution"
    if not hasattr(prob, "sol_status"):
        raise TypeError(f"PuLP {pulp_version(pulp)}'s solve returned {result!r}, neither a "
                        f"PuLP 3 status nor a PuLP 4 LpSolveStats")
    status = pulp.LpStatus.get(prob.status, prob.status)
    solution = pulp.LpSolution.get(prob.sol_status, prob.sol_status)
    optimal = prob.sol_status == pulp.LpSolutionOptimal
    has_plan = optimal or prob.sol_status == pulp.LpSolutionIntegerFeasible
    return has_plan, optimal, f"status {status!r}, solution {solution!r}"


def milp_fallback(costs, num_ranks, *, warm_start, fallback, score, what="owner", **milp_args):
    """:func:`solve_milp` that never raises for a solver failure: CBC with the warm start, then
    once more without it (not for :class:`PulpUnusable`); after two failures, one warning line
    says why and names the plan kept.

    Args:
        warm_start: the heuristic plan, or None.
        fallback: the heuristic's name for the warning (None: no plan to fall back to).
        score: ``owners -> str``, how good a plan is, for the warning.
        what: the objective's name in the warning (``"owner"``, ``"deadline"``).

    Returns:
        ``(result, status)``: ``solve_milp``'s ``(owners, optimal)`` or None, and
        :attr:`dmuon.balance.solver.Assignment.milp_status`.

    Raises:
        ValueError: from ``solve_milp`` on inconsistent classes (a caller's bug).
    """

    def ok(res, note=""):
        return res, ("optimal" if res[1] else "time limit") + note

    first = None
    status = None
    if warm_start is not None:
        try:
            return ok(solve_milp(costs, num_ranks, warm_start=warm_start, **milp_args))
        except PulpUnusable as e:  # no PuLP or no CBC: a retry would fail the same way
            status = f"failed: {e}"
        except MilpFailure as e:
            first = str(e)
    if status is None:
        try:
            res = solve_milp(costs, num_ranks, warm_start=None, **milp_args)
            if first is not None:  # the plan is CBC's after all: worth a note, not a warning
                logger.info("dmuon: %s MILP with warm start failed (%s); without it, it "
                            "worked", what, first)
            return ok(res, "" if first is None else
                      f" (retried without the warm start after: {first})")
        except MilpFailure as e:
            status = (f"failed: {e}" if first is None else
                      f"failed: {first}; the retry without warm start failed the same way"
                      if str(e) == first else
                      f"failed: {first}; retry without warm start failed: {e}")
    if fallback is not None:
        logger.warning("dmuon: %s MILP %s. Using the %s plan instead (%s)", what, status,
                       fallback, score(warm_start))
    return None, status
