"""Newton-Schulz coefficients (one odd quintic ``p(x) = a x + b x^3 + c x^5`` per step, applied
to every singular value) and Gram restart placement.

Sources:
    * Polar Express: N. Amsel, D. Persson, C. Musco, R. M. Gower, "The Polar Express: Optimal
      Matrix Sign Methods and Their Application to the Muon Algorithm", arXiv:2505.16932 (2025),
      the per-step list published with the paper's code, and its 1.01 safety factor.
    * Muon: K. Jordan, https://kellerjordan.github.io/posts/muon/ (``torch.optim.Muon`` defaults).
    * Restart placement: J. Zhang, N. Amsel, B. Chen, T. Dao, "Gram Newton-Schulz" (2026),
      https://github.com/Dao-AILab/gram-newton-schulz, ``gram_newton_schulz/restart_autotune.py``.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
from collections.abc import Sequence

import numpy as np

logger = logging.getLogger(__name__)

__all__ = [
    "MUON_COEFFICIENTS",
    "POLAR_EXPRESS_COEFFICIENTS",
    "POLAR_EXPRESS_SAFETY",
    "choose_gram_restarts",
    "resolve_coefficients",
]

#: ``torch.optim.Muon``'s constant quintic (Keller Jordan's Muon post).
MUON_COEFFICIENTS: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)

#: Polar Express per-step coefficients as published (arXiv:2505.16932, degree 5, l = 1e-3),
#: before the safety factor. Steps past the last entry repeat the last entry, which is the
#: fixed point ``p(x) = (15x - 10x^3 + 3x^5) / 8`` of the classical quintic.
_POLAR_EXPRESS_RAW: tuple[tuple[float, float, float], ...] = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)

#: Safety factor of the Polar Express code: ``(a/s, b/s^3, c/s^5)`` is ``x -> p(x / s)``, which
#: stretches ``p``'s design interval ``[l, 1]`` to ``[s*l, s]`` so that a singular value rounded
#: slightly above 1 (bf16: 0.39%) is still mapped back near 1 rather than diverging.
POLAR_EXPRESS_SAFETY: float = 1.01

#: The published list with the safety factor applied (all but the final fixed point).
POLAR_EXPRESS_COEFFICIENTS: tuple[tuple[float, float, float], ...] = tuple(
    (a / POLAR_EXPRESS_SAFETY, b / POLAR_EXPRESS_SAFETY**3, c / POLAR_EXPRESS_SAFETY**5)
    for (a, b, c) in _POLAR_EXPRESS_RAW[:-1]
) + (_POLAR_EXPRESS_RAW[-1],)

_PRESETS = ("polar_express", "muon")


def _check_triple(triple: object, where: str) -> tuple[float, float, float]:
    """``triple`` as three floats; ``ValueError`` unless three finite real numbers."""
    if isinstance(triple, (str, bytes)) or not isinstance(triple, Sequence) or len(triple) != 3:
        raise ValueError(
            f"dmuon: Newton-Schulz coefficients {where} must be three numbers (a, b, c); "
            f"got {triple!r}. Pass e.g. (3.4445, -4.7750, 2.0315)."
        )
    try:
        values = tuple(float(v) for v in triple)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"dmuon: Newton-Schulz coefficients {where} must be real numbers; got {triple!r}."
        ) from exc
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"dmuon: Newton-Schulz coefficients {where} must be finite; got {values}.")
    return values  # type: ignore[return-value]


def resolve_coefficients(
    coefficients: str | Sequence[float] | Sequence[Sequence[float]], steps: int
) -> list[tuple[float, float, float]]:
    """Turn a coefficient spec into one ``(a, b, c)`` per Newton-Schulz step.

    Args:
        coefficients: ``"polar_express"`` (the per-step Polar Express list with the 1.01 safety
            factor; steps past its 8 entries repeat the fixed point ``(1.875, -1.25, 0.375)``),
            ``"muon"`` (``(3.4445, -4.7750, 2.0315)`` every step), one ``(a, b, c)`` used every
            step, or a per-step list of ``(a, b, c)`` whose length equals ``steps``.
        steps: number of Newton-Schulz steps, an integer >= 1.

    Returns:
        A list of ``steps`` tuples of Python floats.

    Raises:
        ValueError: unknown preset, a triple not three finite numbers, a per-step list whose
            length is not ``steps``, or ``steps`` not a positive integer.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"dmuon: Newton-Schulz steps must be an integer >= 1; got {steps!r}.")
    if isinstance(coefficients, str):
        if coefficients == "muon":
            return [MUON_COEFFICIENTS] * steps
        if coefficients == "polar_express":
            table = POLAR_EXPRESS_COEFFICIENTS
            return [table[min(i, len(table) - 1)] for i in range(steps)]
        raise ValueError(
            f"dmuon: unknown Newton-Schulz coefficient preset {coefficients!r}; "
            f"choose one of {_PRESETS}, or pass (a, b, c) or a per-step list."
        )
    if not isinstance(coefficients, Sequence) or len(coefficients) == 0:
        raise ValueError(
            "dmuon: Newton-Schulz coefficients must be a preset name, (a, b, c), or a per-step "
            f"list of (a, b, c); got {coefficients!r}."
        )
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in coefficients):
        return [_check_triple(coefficients, "")] * steps
    if len(coefficients) != steps:
        raise ValueError(
            f"dmuon: got {len(coefficients)} per-step Newton-Schulz coefficient triples for "
            f"steps={steps}; pass exactly one (a, b, c) per step or set steps={len(coefficients)}."
        )
    return [_check_triple(t, f"for step {i}") for i, t in enumerate(coefficients)]


def _max_q_magnitude(
    coefficients: Sequence[tuple[float, float, float]],
    restarts: Sequence[int],
    singular_values: np.ndarray,
    gram_perturbation: float,
) -> float:
    """Largest ``|Q_t(x)|`` of the scalar Gram iteration (``z = a + b r + c r^2``, ``q <- q z``,
    ``r <- r z^2`` from ``r_0 = x^2 + delta``, reset at restarts) over steps and singular values:
    Dao-AILab ``restart_autotune.run_gram_newton_schulz``'s model, in float64."""
    x = singular_values.astype(np.float64)
    q = np.ones_like(x)
    r = x * x + gram_perturbation
    worst = 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        for i, (a, b, c) in enumerate(coefficients):
            if i != 0 and i in restarts:
                x = q * x
                r = x * x + gram_perturbation
                q = np.ones_like(x)
            z = a + b * r + c * r * r
            q = q * z
            r = r * z * z
            step_worst = float(np.max(np.abs(q)))
            if not math.isfinite(step_worst):
                return math.inf
            worst = max(worst, step_worst)
    return worst


@functools.lru_cache(maxsize=64)
def choose_gram_restarts(
    coefficients: tuple[tuple[float, float, float], ...],
    num_restarts: int | None = None,
    gram_perturbation: float = -4e-4,
) -> tuple[int, ...]:
    """Choose the step indices at which the Gram-space iteration restarts.

    Tries every placement of ``num_restarts`` restarts in steps ``1..steps-1`` and keeps the one
    minimizing the largest ``|Q|`` over singular values ``logspace(0, -10, 10000)`` with Gram
    eigenvalues perturbed by ``gram_perturbation`` (fp16 unit roundoff 4.9e-4): the argument and
    grid of Dao-AILab/gram-newton-schulz ``restart_autotune.find_best_restarts``. For the 5-step
    Polar Express list it returns ``(2,)``, their shipped default.

    Args:
        coefficients: one ``(a, b, c)`` per step (hashable tuple of tuples).
        num_restarts: how many; ``None``: one per 5 steps (at least 1 when ``steps >= 2``).
        gram_perturbation: the modeled most-negative Gram eigenvalue (dimensionless, <= 0).

    Returns:
        Sorted step indices ``1 <= i < steps``, each restart happening before step ``i``.

    Raises:
        ValueError: ``num_restarts`` outside ``0..steps-1``, or every placement overflows.
    """
    steps = len(coefficients)
    if num_restarts is None:
        num_restarts = min(max(1, round(steps / 5)), steps - 1)
    if num_restarts < 0 or num_restarts > max(steps - 1, 0):
        raise ValueError(
            f"dmuon: cannot place {num_restarts} Gram restarts in {steps} Newton-Schulz steps; "
            f"use 0..{max(steps - 1, 0)}."
        )
    if num_restarts == 0:
        return ()
    grid = np.logspace(0, -10, 10000)
    best: tuple[int, ...] = ()
    best_q = math.inf
    for combo in itertools.combinations(range(1, steps), num_restarts):
        q = _max_q_magnitude(coefficients, combo, grid, gram_perturbation)
        if q < best_q:
            best, best_q = combo, q
    if not best:
        raise ValueError(
            f"dmuon: every placement of {num_restarts} Gram restarts overflows for coefficients "
            f"{coefficients}; use more restarts or method='standard'."
        )
    logger.debug("Gram restarts %s (max |Q| = %.3g) for %d steps", best, best_q, steps)
    return best
