"""Exact makespan minimization as a MILP over matrix classes, solved by CBC through PuLP.

Matrices of one *class* are interchangeable, so instead of one binary per (matrix, rank) the
model counts them: ``x[s, r]`` is the number of class-``s`` matrices rank ``r`` owns. A class
here is one (cost, memory) pair, so a shape and its transpose (``[16384, 2048]`` and ``[2048,
16384]``: equal FLOPs, equal bytes) share one; only a shape with a batch overhead ``f_s > 0``
stays a class of its own, as it pays ``f_s`` once per rank. For Qwen2.5-7B (196 matrices, 4
shapes, 3 classes) at 256 ranks that is 768 integers instead of 50,176 binaries. Splitting
interchangeable matrices into several classes (one per shape, as ``build_plan`` passes them)
only adds symmetric solutions: measured on the 2-core dev machine, Qwen2.5-7B on 32 ranks is
proven optimal in 0.2 s with 3 classes and not within 5 s with 4 (issue 28).

    minimize    T
    subject to  sum_r x[s, r] = n_s                                   for every class s
                L_r = sum_s c_s x[s, r] + f_s z[s, r] <= T              for every rank r
                x[s, r] <= n_s z[s, r]        (z binary, only where f_s > 0: batch overhead)
                sum_s m_s x[s, r] <= cap                                (memory cap, optional)
                L_0 >= L_1 >= ... >= L_{D-1}                            (breaks rank symmetry)
                T >= proven lower bound                                 (lets CBC stop early)

With publish groups (``groups`` and ``group_cost > 0``, see :mod:`dmuon.balance.grouping`) a
class is a (group, shape) pair, a binary ``y[g, r]`` marks that rank ``r`` owns part of group
``g`` (``x[(g, s), r] <= n_(g, s) y[g, r]``), and the objective becomes
``T + group_cost * sum y``: the makespan plus the step time of one publication per pair.

``c_s`` is the marginal NS cost of one class-``s`` matrix, ``f_s`` the fixed cost of running a
batch of them (see :func:`dmuon.balance.cost.fit_batch_costs`), ``m_s`` its bytes. Solved by
CBC (bundled with PuLP) with one thread, so an untimed-out solve is reproducible.

Every way the solver path can fail (PuLP cannot be imported or finds no CBC binary, building
the model raises, CBC crashes, PuLP raises, the solution file is missing or holds values that
are not a plan, no plan by the time limit, an infeasible status, no return at all) raises
:class:`MilpFailure` with the reason; :func:`dmuon.balance.solve` then retries once without the
warm start (not when PuLP or CBC is missing: :class:`PulpUnusable`) and falls back to the
heuristic plan with a warning. PuLP 3.x and 4.x differ in how a variable is made, which class
runs CBC and how a solve reports its status: :mod:`dmuon.balance.pulp_api` hides that.
"""

from __future__ import annotations

import logging
import os
import signal
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Hashable, Mapping, Sequence

from dmuon.balance import pulp_api
from dmuon.balance.assignment import effective_costs
from dmuon.balance.bounds import makespan_lower_bound

logger = logging.getLogger(__name__)


class MilpFailure(RuntimeError):
    """CBC gave no usable plan; the message says why (PuLP missing or unusable, model build,
    crash, status, bad solution values)."""


class PulpUnusable(MilpFailure):
    """PuLP cannot be imported or finds no CBC to run: a retry cannot help."""


def _class_table(costs, classes, memory):
    """Unique classes in first-appearance order with count, cost and memory; validated."""
    order: list[Hashable] = []
    table: dict[Hashable, list] = {}
    for i, s in enumerate(classes):
        m = 0.0 if memory is None else float(memory[i])
        if s not in table:
            order.append(s)
            table[s] = [0, float(costs[i]), m, []]
        row = table[s]
        if row[1] != float(costs[i]) or row[2] != m:
            raise ValueError(
                f"dmuon: matrices {row[3][0]} and {i} share class {s!r} but have costs "
                f"{row[1]} vs {costs[i]} and memory {row[2]} vs {m}; one class must be one "
                f"cost and one memory size (give classes=None to group by (cost, memory))"
            )
        row[0] += 1
        row[3].append(i)
    return order, table


def solve_milp(
    costs: Sequence[float],
    num_ranks: int,
    *,
    classes: Sequence[Hashable],
    memory: Sequence[float] | None = None,
    memory_cap: float | None = None,
    batch_overhead: Mapping[Hashable, float] | None = None,
    warm_start: Sequence[int] | None = None,
    time_limit_s: float = 10.0,
    groups: Sequence[int] | None = None,
    group_cost: float = 0.0,
    merge_classes: bool = True,
) -> tuple[tuple[int, ...], bool]:
    """Solve the class-count MILP above with CBC.

    Args:
        costs: per-matrix marginal cost, ``>= 0``; equal within a class.
        num_ranks: number of ranks ``D``.
        classes: per-matrix class key (interchangeable matrices share one).
        memory: per-matrix bytes on the owner, equal within a class, or None.
        memory_cap: bytes per rank, or None.
        batch_overhead: per-class fixed cost of owning any matrix of that class.
        warm_start: an initial plan (owners per matrix) for CBC, e.g. greedy's.
        time_limit_s: CBC wall-clock limit, seconds.
        groups: per-matrix publish-group id; used only with ``group_cost > 0``.
        group_cost: step time of one (group, owner) pair, in the unit of ``costs``.
        merge_classes: one MILP class per (cost, memory) pair (default); False keeps one per
            given class, the model that exposed CBC's RINS abort (issue 28's regression test).

    Returns:
        ``(owners, optimal)``: owners per matrix in input order, ``optimal`` True when CBC
        proved it (False: CBC's incumbent at the time limit).

    Raises:
        ValueError: when matrices of one class differ in cost or memory.
        MilpFailure: when CBC gives no usable plan: PuLP or CBC is missing
            (:class:`PulpUnusable`), PuLP raises while the model is built, CBC exits with an
            error (e.g. its ``CoinError`` abort), writes no solution or hangs, the status is
            infeasible or "not solved" (no plan by the time limit), or the values it returns
            are not a plan (not integral, negative, or not summing to each class's count) or
            cannot be read.
    """
    with warnings.catch_warnings():
        # PuLP 3.x announces API changes for 4.0 (PULP_CBC_CMD's removal); pulp_api handles both.
        warnings.simplefilter("ignore", DeprecationWarning)
        return _solve_milp(costs, num_ranks, classes=classes, memory=memory,
                           memory_cap=memory_cap, batch_overhead=batch_overhead,
                           warm_start=warm_start, time_limit_s=time_limit_s,
                           groups=groups if group_cost > 0 else None,
                           group_cost=float(group_cost), merge_classes=merge_classes)


def _solve_milp(costs, num_ranks, *, classes, memory, memory_cap, batch_overhead, warm_start,
                time_limit_s, groups, group_cost, merge_classes):
    _class_table(costs, classes, memory)  # one class must be one cost and one memory size

    def build(pulp):
        model = _build(pulp, costs, num_ranks, classes=classes, memory=memory,
                       memory_cap=memory_cap, batch_overhead=batch_overhead,
                       warm_start=warm_start, groups=groups, group_cost=group_cost,
                       merge_classes=merge_classes)
        return model.prob, model

    owners, optimal, model, seconds = solve_with_cbc(
        build, lambda m: _read_plan(m.x, m.order, m.table, num_ranks, len(costs)),
        time_limit_s=time_limit_s, warm_start=warm_start is not None)
    logger.debug("dmuon: CBC %s in %.2fs (%d classes x %d ranks, %d groups)",
                 "optimal" if optimal else "incumbent", seconds, len(model.order), num_ranks,
                 model.groups)
    return tuple(owners), optimal


def solve_with_cbc(build, read, *, time_limit_s: float, warm_start: bool):
    """The CBC solve the owner MILPs share (this module's makespan model and
    :mod:`dmuon.balance.deadline_milp`'s exposed-time model).

    Args:
        build: ``pulp -> (problem, handle)``: the PuLP problem, warm start set, and whatever
            ``read`` needs.
        read: ``handle -> owners`` (``owners[i]``: the rank of matrix ``i``) from the solved
            variables.
        time_limit_s: CBC's time limit (seconds); the solve is abandoned after twice that.
        warm_start: whether ``build`` set initial values for CBC to start from.

    Returns:
        ``(owners, proven optimal, handle, seconds)``.

    Raises:
        PulpUnusable: PuLP cannot be imported or finds no CBC (a retry fails the same way).
        MilpFailure: the model cannot be built, CBC gives no plan (crash, status, time limit,
            no return), or its values cannot be read; the message names the stage.
    """
    try:
        pulp = pulp_api.load()
    except Exception as e:  # ImportError, or PuLP 4's Rust core failing to load
        raise PulpUnusable(f"PuLP could not be imported ({type(e).__name__}: {_first_line(e)}); "
                           f"pip install 'pulp>=3.3.2,<5' (on Python >= 3.12: 'pulp[cbc]', "
                           f"whose CBC PuLP 4 needs)") from e
    start = time.perf_counter()
    try:
        prob, handle = build(pulp)
        # No ``threads`` option: CBC then runs serially. With ``threads=1`` it starts one
        # worker thread that, about once in 200 solves here, never starts: CBC's log then shows
        # "Thread 0 used 0 times, waiting to start 10.0" and the solve stops at the time limit
        # with gap 0, unproven.
        # ``rins off``: CBC 2.10.3 (PuLP 3.3's bundled binary) aborts with an uncaught
        # CoinError inside its RINS heuristic: CbcHeuristicRINS::solution ->
        # smallBranchAndBound -> ClpSimplex::borrowModel -> ClpPrimalColumnSteepest's copy ->
        # CoinIndexedVector::gutsOfSetVector (gdb backtrace, issue 28: Pi0 with one class per
        # shape on 32 ranks, warm-started). RINS only runs once there is an incumbent, which is
        # why the same model solved without the warm start. Our warm start is already a
        # local-search optimum, the neighbourhood RINS searches; off, no measured plan got
        # worse (Pi0, Qwen2.5-7B, 8-64 ranks).
        solver = pulp_api.cbc(pulp, time_limit_s=max(1, int(round(time_limit_s))),
                              warm_start=warm_start, options=["rins off"])
    except Exception as e:  # a PuLP whose modelling API this code does not know
        raise MilpFailure(f"PuLP {pulp_api.version(pulp)} could not build the model: "
                          f"{type(e).__name__}: {_first_line(e)}") from e
    missing = pulp_api.cbc_available(pulp, solver)
    if missing is not None:
        raise PulpUnusable(missing)
    # PuLP writes the model, warm start and solution next to each other in $TMPDIR and deletes
    # them only after a solve that returned: a CBC that aborted left ~160 KB per failed solve
    # behind. A directory of our own is removed whatever happened.
    with tempfile.TemporaryDirectory(prefix="dmuon-cbc-", ignore_cleanup_errors=True) as tmp:
        solver.tmpDir = tmp
        outcome = _solve_with_deadline(pulp, prob, solver, time_limit_s)
    if not outcome.has_plan:
        raise MilpFailure(
            f"CBC returned no plan: {outcome.status} after "
            f"{time.perf_counter() - start:.1f} s (time limit {time_limit_s} s)")
    try:
        owners = read(handle)
    except MilpFailure:
        raise
    except Exception as e:  # a value PuLP hands back in a form this code does not know
        raise MilpFailure(f"CBC's solution could not be read through PuLP "
                          f"{pulp_api.version(pulp)}: {type(e).__name__}: {_first_line(e)}") from e
    return owners, outcome.optimal, handle, time.perf_counter() - start


@dataclass(frozen=True, slots=True)
class _Model:
    """The PuLP problem and what reading its solution needs."""

    prob: object
    x: dict  # (class index, rank) -> integer variable: matrices of the class on the rank
    order: list  # class keys in first-appearance order
    table: dict  # class key -> [count, cost, memory, member indices]
    groups: int  # publish groups in the model (0 without)


def _build(pulp, costs, num_ranks, *, classes, memory, memory_cap, batch_overhead, warm_start,
           groups, group_cost, merge_classes) -> _Model:
    """The MILP of the module docstring as a PuLP problem, warm start set."""
    # Integer variables count matrices per key: the shape, or (group, shape) with groups, as
    # same-shape matrices of different groups are then no longer interchangeable. The batch
    # overhead stays per shape: z[s, r] marks that rank r runs a batch of shape s at all.
    overhead_of = {s: float((batch_overhead or {}).get(s, 0.0)) for s in classes}
    # Interchangeable matrices share one MILP class: (cost, memory), or the shape itself where
    # it pays a batch overhead (see the module docstring).
    merged = [("shape", s) if overhead_of[s] > 0 or not merge_classes else
              ("cost", float(costs[i]), 0.0 if memory is None else float(memory[i]))
              for i, s in enumerate(classes)]
    keys = merged if groups is None else list(zip(groups, merged))
    kind_of = (lambda key: key) if groups is None else (lambda key: key[1])

    def shape_of(key):  # the batched shape a key pays overhead for, or None
        kind = kind_of(key)
        return kind[1] if kind[0] == "shape" else None

    order, table = _class_table(costs, keys, memory)
    shapes = [s for s in dict.fromkeys(shape_of(key) for key in order) if s is not None]
    shape_index = {s: j for j, s in enumerate(shapes)}
    shape_index[None] = -1
    overhead = {s: overhead_of[s] for s in shapes}
    ranks = range(num_ranks)
    prob = pulp.LpProblem("dmuon_owner_makespan", pulp.LpMinimize)
    var = pulp_api.variable
    x = {(k, r): var(prob, f"x_{k}_{r}", 0, table[key][0], "Integer")
         for k, key in enumerate(order) for r in ranks}
    z = {(j, r): var(prob, f"z_{j}_{r}", cat="Binary")
         for j, s in enumerate(shapes) if overhead[s] > 0 for r in ranks}
    gids = [] if groups is None else list(dict.fromkeys(groups))
    y = {(g, r): var(prob, f"y_{n}_{r}", cat="Binary")
         for n, g in enumerate(gids) for r in ranks}
    t = var(prob, "makespan", 0)
    prob += t + group_cost * pulp.lpSum(y.values())
    prob += t >= makespan_lower_bound(effective_costs(costs, classes, overhead), num_ranks)
    if gids:
        prob += pulp.lpSum(y.values()) >= len(gids)  # every group has at least one owner
    for k, key in enumerate(order):
        prob += pulp.lpSum(x[k, r] for r in ranks) == table[key][0]
        j = shape_index[shape_of(key)]
        for r in ranks:
            if (j, r) in z:
                prob += x[k, r] <= table[key][0] * z[j, r]
            if groups is not None:
                prob += x[k, r] <= table[key][0] * y[key[0], r]
    for (g, r), v in y.items():  # a pair exists only where the rank owns part of the group
        prob += v <= pulp.lpSum(x[k, r] for k, key in enumerate(order) if key[0] == g)
    for (j, r), v in z.items():  # a batch is paid only where a matrix of its shape is owned
        prob += v <= pulp.lpSum(x[k, r] for k, key in enumerate(order)
                                if shape_index[shape_of(key)] == j)
    load = []
    for r in ranks:
        expr = pulp.lpSum(table[key][1] * x[k, r] for k, key in enumerate(order))
        expr += pulp.lpSum(overhead[s] * z[j, r] for j, s in enumerate(shapes) if (j, r) in z)
        load.append(expr)
        prob += expr <= t
        if memory_cap is not None:
            prob += pulp.lpSum(table[key][2] * x[k, r] for k, key in enumerate(order)) <= memory_cap
    for r in range(num_ranks - 1):
        prob += load[r] >= load[r + 1]

    if warm_start is not None:
        _set_warm_start(warm_start, order, keys, shapes, shape_of, costs, overhead, num_ranks,
                        x, z, y, t)
    return _Model(prob=prob, x=x, order=order, table=table, groups=len(gids))


#: Seconds past twice CBC's own time limit after which a CBC that has not returned counts as
#: hung: it is killed and the solve fails (CBC stops itself at the limit; reading the model and
#: writing the solution took under 1 s for Pi0 at 256 ranks, and a loaded 2-core machine can
#: stretch the wall clock 2-3x).
HANG_MARGIN_S = 30.0


def _solve_with_deadline(pulp, prob, solver, time_limit_s: float) -> pulp_api.Outcome:
    """:func:`dmuon.balance.pulp_api.solve` in a worker thread, waited on for ``2 * time_limit_s +``
    :data:`HANG_MARGIN_S` seconds. PuLP waits on CBC's process without a timeout, so a CBC that
    never returns would hang the caller (on ``dedicate_params``' rank 0: the whole job).

    Raises:
        MilpFailure: when CBC raised (``PulpSolverError``: it aborted or wrote no solution;
            ``OSError``...), or did not return in time (its processes, children of this one
            named like the solver binary, are then killed where ``/proc`` exists).
    """
    done = threading.Event()
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["outcome"] = pulp_api.solve(pulp, prob, solver)
        except BaseException as e:  # handed to the caller below
            box["error"] = e
        finally:
            done.set()

    thread = threading.Thread(target=run, name="dmuon-cbc", daemon=True)
    thread.start()
    deadline_s = 2 * time_limit_s + HANG_MARGIN_S
    if not done.wait(deadline_s):
        killed = _kill_child_processes(os.path.basename(str(getattr(solver, "path", "cbc"))))
        raise MilpFailure(
            f"CBC did not return within {deadline_s:.0f} s (time limit {time_limit_s} s): "
            f"hung; killed {killed} process(es)")
    if "error" in box:
        e = box["error"]
        # PuLP raises PulpSolverError when CBC exits non-zero or leaves no solution file; any
        # other error came from running CBC (OSError) or reading its solution (ValueError...).
        what = "crashed" if type(e).__name__ == "PulpSolverError" else "failed"
        raise MilpFailure(f"CBC {what}: {type(e).__name__}: {_first_line(e)}") from e
    return box["outcome"]


def _kill_child_processes(name: str) -> int:
    """SIGKILL this process's children whose command name is ``name`` (Linux ``/proc``; 0
    elsewhere). Returns how many were signalled."""
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


def _read_plan(x, order, table, num_ranks, n):
    """Owners per matrix from CBC's counts ``x[k, r]``, checked: every value a non-negative
    integer (within 1e-6) and every class's counts summing to its size.

    Raises:
        MilpFailure: naming the first variable or class whose values are not a plan.
    """
    owners = [0] * n
    for k, key in enumerate(order):
        counts = []
        for r in range(num_ranks):
            value = pulp_api.value(x[k, r])
            ok = isinstance(value, (int, float)) and value == value and abs(value) != float("inf")
            if not ok or abs(value - round(value)) > 1e-6 or round(value) < 0:
                raise MilpFailure(
                    f"CBC returned an unusable solution: {x[k, r].name} = {value!r} is not a "
                    f"count of matrices (a non-negative integer)")
            counts.append(int(round(value)))
        members = table[key][3]
        if sum(counts) != len(members):
            raise MilpFailure(
                f"CBC returned an unusable solution: class {key!r} has {len(members)} matrices "
                f"but its counts sum to {sum(counts)}")
        it = iter(members)
        for r, count in enumerate(counts):
            for _ in range(count):
                owners[next(it)] = r
    return owners


def _set_warm_start(owners, order, keys, shapes, shape_of, costs, overhead, num_ranks, x, z, y, t):
    """Feed a plan to CBC, relabelling ranks by decreasing load to satisfy symmetry breaking."""
    index = {key: k for k, key in enumerate(order)}
    counts = [[0] * len(order) for _ in range(num_ranks)]
    loads = [0.0] * num_ranks
    for i, r in enumerate(owners):
        counts[r][index[keys[i]]] += 1
        loads[r] += float(costs[i])
    held = [{shape_of(order[k]) for k in range(len(order)) if counts[r][k]} - {None}
            for r in range(num_ranks)]
    for r in range(num_ranks):
        loads[r] += sum(overhead[s] for s in held[r])
    relabel = sorted(range(num_ranks), key=lambda r: (-loads[r], r))
    for new, old in enumerate(relabel):
        for k in range(len(order)):
            x[k, new].setInitialValue(counts[old][k])
        for j, s in enumerate(shapes):
            if (j, new) in z:
                z[j, new].setInitialValue(1 if s in held[old] else 0)
        for (g, r), var in y.items():
            if r == new:
                var.setInitialValue(1 if any(counts[old][k] for k, key in enumerate(order)
                                             if key[0] == g) else 0)
    t.setInitialValue(max(loads))


def milp_fallback(costs, num_ranks, *, warm_start, fallback, score, solve_fn=None, **milp_args):
    """:func:`dmuon.balance.milp.solve_milp` (or ``solve_fn``, the same contract:
    :func:`dmuon.balance.deadline_milp.solve_deadline_milp`) that never raises for a solver
    failure.

    CBC is tried with the warm start, then once more without it (a warm start is what
    brought CBC's RINS abort to light, issue 28; not when PuLP cannot be imported or finds no
    CBC). When both fail, one warning line says why and names the plan kept instead.

    Args:
        costs, num_ranks, milp_args: passed to ``solve_milp`` (``solve_fn``).
        warm_start: the heuristic plan (owners per matrix), or None.
        fallback: the heuristic's name (e.g. ``"multifit+local_search"``) for the warning,
            or None when there is no plan to fall back to (the caller then raises).
        score: ``owners -> makespan (or objective) / bound`` of a plan, for the warning.

    Returns:
        ``(result, status)``: ``solve_milp``'s ``(owners, optimal)`` or None after two
        failures; ``status`` is :attr:`Assignment.milp_status`.

    Raises:
        ValueError: from ``solve_milp`` on inconsistent classes (a caller's bug, not CBC's).
    """
    solve = solve_milp if solve_fn is None else solve_fn

    def ok(res, note=""):
        return res, ("optimal" if res[1] else "time limit") + note

    first = None
    status = None
    if warm_start is not None:
        try:
            return ok(solve(costs, num_ranks, warm_start=warm_start, **milp_args))
        except PulpUnusable as e:  # no PuLP or no CBC: a retry would fail the same way
            status = f"failed: {e}"
        except MilpFailure as e:
            first = str(e)
    if status is None:
        try:
            res = solve(costs, num_ranks, warm_start=None, **milp_args)
            if first is not None:  # the plan is CBC's after all: worth a note, not a warning
                logger.info("dmuon: owner MILP with warm start failed (%s); without it, it "
                            "worked", first)
            return ok(res, "" if first is None else
                      f" (retried without the warm start after: {first})")
        except MilpFailure as e:
            status = (f"failed: {e}" if first is None else
                      f"failed: {first}; the retry without warm start failed the same way"
                      if str(e) == first else
                      f"failed: {first}; retry without warm start failed: {e}")
    if fallback is not None:
        logger.warning("dmuon: owner MILP %s. Using the %s plan instead (%.4fx the bound)",
                       status, fallback, score(warm_start))
    return None, status
