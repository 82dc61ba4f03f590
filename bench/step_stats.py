"""Per-round ratios and the A/A control of ``bench/bench_step.py``: every ratio with its noise floor.

A step benchmark compares variants that run in *rounds*: each round runs every variant for a
block of steps, in an order that changes from round to round (:func:`round_order`). The
baseline runs twice, as two variants (``adamw`` and ``adamw_b``: the same model, optimizer and
data, built twice), so ``adamw_b / adamw`` (the *A/A ratio*) shows how much a ratio moves when
nothing changes: the machine's other load, the allocator, clocks, the order.

Method (all ratios, every phase):

* a variant's time in a round is the median over that round's measured steps of the per-step
  time (a step's phase time is the maximum over ranks);
* a ratio's value in a round is ``numerator's time / baseline's time`` of that round (both ran
  within seconds of each other, so slow drifts of the machine cancel);
* the reported ratio is the **median of the per-round ratios**, its spread their first and
  third quartiles (``q1``, ``q3``);
* the **noise floor** of a phase is the A/A ratio's largest distance from 1 over its median and
  quartiles, ``max(|q1 - 1|, |median - 1|, |q3 - 1|)``; a ratio whose median lies within the
  noise floor of 1 (``|median - 1| <= floor``) is "not distinguishable" from the baseline.

With one round the quartiles are the single value (no spread; nothing is then distinguishable
from noise in any meaningful sense, and the verdict says so).
"""

from __future__ import annotations

import math
import statistics

#: The A/A control's second copy of the baseline (built exactly like ``adamw``).
CONTROL = "adamw_b"
BASELINE = "adamw"
PHASES = ("forward", "backward", "step", "total")
#: One line of the method, written into every result (the module docstring says it at length).
METHOD = ("ratio = median over rounds of (variant's median measured step in the round / baseline's in "
          "the same round), q1/q3 their quartiles; A/A = adamw_b/adamw, both the same baseline; noise "
          "floor = max(|q1-1|, |median-1|, |q3-1|) of A/A; |ratio median - 1| <= floor: not distinguishable")


def round_order(variants: tuple[str, ...], rnd: int) -> tuple[str, ...]:
    """The order in which round ``rnd`` runs the variants: row ``rnd mod rows`` of a Williams
    design (Williams 1949, "Experimental designs balanced for the estimation of residual effects
    of treatments").

    Row ``i`` is the first row ``0, 1, n-1, 2, n-2, ...`` plus ``i`` (mod ``n``); for odd ``n``
    the ``n`` mirrored rows follow. Over a full cycle (``n`` rounds for even ``n``, ``2 n`` for
    odd) every variant takes every position equally often, and every variant runs right after
    every other one equally often: leftovers of the previous block (a variant's in-flight
    collectives, allocator or cache state) fall on every variant alike. A plain rotation fixes
    each variant's predecessor; rotation plus reversal (this module's first version) still never
    put ``adamw`` right after ``dmuon`` while ``adamw_b`` followed it in 6 of 16 rounds, and the
    A/A ratio of that run read 1.33 (``bench/results/history/step_cpu_4r_fsdp_aa_rotation.json``).

    Args:
        variants: Variant names, in their listed order.
        rnd: Round index (0-based).

    Returns:
        The variants in this round's order.
    """
    n = len(variants)
    first = [0 if j == 0 else (j + 1) // 2 if j % 2 else n - j // 2 for j in range(n)]
    rows = [[(b + i) % n for b in first] for i in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    return tuple(variants[j] for j in rows[rnd % len(rows)])


def design_rounds(n: int) -> int:
    """Rounds in one full cycle of :func:`round_order` for ``n`` variants (``n`` or ``2 n``)."""
    return n if n % 2 == 0 else 2 * n


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], statistics.median(xs), q[2]


def per_round_times(per_rank: list[list[dict]], phase: str) -> dict[int, float]:
    """A variant's time per round: median over the round's measured steps of the max over ranks.

    Args:
        per_rank: For each rank, that variant's step records (``round``, ``measured`` and the
            phase times in seconds, as :func:`step_timing.timed_step` writes them).
        phase: ``"forward"``, ``"backward"``, ``"step"`` or ``"total"``.

    Returns:
        ``{round: seconds}`` for every round with at least one measured step.
    """
    by_round: dict[int, list[float]] = {}
    for i, rec in enumerate(per_rank[0]):
        if rec["measured"]:
            by_round.setdefault(rec["round"], []).append(max(recs[i][phase] for recs in per_rank))
    return {r: statistics.median(ts) for r, ts in by_round.items()}


def ratio_stats(num: dict[int, float], den: dict[int, float]) -> dict:
    """Median and quartiles of the per-round ratios ``num[r] / den[r]`` over the common rounds.

    Returns:
        ``{"median", "q1", "q3", "per_round": [ratio, ...], "rounds": n}`` (ratios unitless).

    Raises:
        ValueError: If the two share no round, or a baseline time is not positive.
    """
    rounds = sorted(set(num) & set(den))
    if not rounds:
        raise ValueError(f"step_stats: no common round between {sorted(num)} and {sorted(den)}.")
    if any(den[r] <= 0 for r in rounds):
        raise ValueError(f"step_stats: baseline times {[den[r] for r in rounds]} must be > 0 s.")
    per_round = [num[r] / den[r] for r in rounds]
    q1, med, q3 = _quartiles(per_round)
    return {"median": med, "q1": q1, "q3": q3, "per_round": per_round, "rounds": len(rounds)}


def noise_floor(aa: dict) -> float:
    """The A/A ratio's largest distance from 1 over its median and quartiles (unitless)."""
    return max(abs(aa["q1"] - 1.0), abs(aa["median"] - 1.0), abs(aa["q3"] - 1.0))


def verdict(stats: dict, floor: float) -> str:
    """``"not distinguishable"`` when ``|median - 1| <= floor``, else ``"slower"``/``"faster"``
    (than the baseline: the ratio is numerator / baseline)."""
    if abs(stats["median"] - 1.0) <= floor:
        return "not distinguishable"
    return "slower" if stats["median"] > 1.0 else "faster"


def round_ratios(per_rank: dict[str, list[list[dict]]]) -> dict:
    """Every variant against the baseline, per phase, with the A/A control's noise floor.

    Args:
        per_rank: ``{variant: [records of rank 0, records of rank 1, ...]}``; must hold
            :data:`BASELINE` and :data:`CONTROL`.

    Returns:
        ``{"method": str, "baseline": "adamw", "control": "adamw_b", "rounds": n,
        "noise_floor": {phase: float}, "ratios": {"<v>_over_adamw": {phase: {"median", "q1",
        "q3", "per_round", "rounds", "noise_floor", "verdict"}}, "dmuon_over_vanilla": {"step":
        ...}, "dmuon_over_torch_muon": {"step": ..., "total": ...} (when torch_muon ran)}}``; the A/A ratio is ``ratios["adamw_b_over_adamw"]``.

    Raises:
        ValueError: If the baseline or the control is missing.
    """
    missing = {BASELINE, CONTROL} - set(per_rank)
    if missing:
        raise ValueError(f"step_stats: variants {sorted(per_rank)} lack {sorted(missing)}; the A/A "
                         f"control needs both '{BASELINE}' and '{CONTROL}'.")
    times = {v: {ph: per_round_times(recs, ph) for ph in PHASES} for v, recs in per_rank.items()}
    aa = {ph: ratio_stats(times[CONTROL][ph], times[BASELINE][ph]) for ph in PHASES}
    floors = {ph: noise_floor(aa[ph]) for ph in PHASES}
    ratios: dict[str, dict] = {}
    pairs = [(v, BASELINE, PHASES) for v in per_rank if v != BASELINE]
    if "dmuon" in per_rank and "vanilla" in per_rank:
        pairs.append(("dmuon", "vanilla", ("step",)))
    if "dmuon" in per_rank and "torch_muon" in per_rank:  # the single-GPU reference (gpu_suite)
        pairs.append(("dmuon", "torch_muon", ("step", "total")))
    for num, den, phases in pairs:
        row = {}
        for ph in phases:
            s = aa[ph] if num == CONTROL else ratio_stats(times[num][ph], times[den][ph])
            row[ph] = {**s, "noise_floor": floors[ph], "verdict": verdict(s, floors[ph])}
        ratios[f"{num}_over_{den}"] = row
    return {"method": METHOD, "baseline": BASELINE, "control": CONTROL, "rounds": aa["total"]["rounds"],
            "noise_floor": floors, "ratios": ratios}


def format_ratios(rr: dict) -> str:
    """Printable lines: each ratio per phase as ``median [q1, q3]``, ``~`` marking the ones
    within the A/A noise floor ("not distinguishable")."""
    lines = [f"per-round ratios over {rr['rounds']} rounds, median [q1, q3]; A/A control "
             f"{rr['control']}/{rr['baseline']}; '~' = within the A/A noise floor (not distinguishable)",
             f"{'ratio':22s} " + " ".join(f"{ph:>22s}" for ph in PHASES)]
    for name, row in rr["ratios"].items():
        cells = []
        for ph in PHASES:
            s = row.get(ph)
            cells.append(f"{'-':>22s}" if s is None else
                         f"{s['median']:6.3f} [{s['q1']:.3f}, {s['q3']:.3f}]{'~' if s['verdict'] == 'not distinguishable' else ' '}")
        lines.append(f"{name:22s} " + " ".join(f"{c:>22s}" for c in cells))
    lines.append("A/A noise floor (|ratio - 1| within which nothing is distinguishable): "
                 + ", ".join(f"{ph} {rr['noise_floor'][ph]:.3f}" for ph in PHASES))
    return "\n".join(lines)


def all_finite_positive(rr: dict) -> bool:
    """True when every ratio and quartile is a finite positive number (a sanity check)."""
    vals = [s[k] for row in rr["ratios"].values() for s in row.values() for k in ("median", "q1", "q3")]
    return bool(vals) and all(math.isfinite(x) and x > 0 for x in vals)
