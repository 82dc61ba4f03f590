"""Newton-Schulz orthogonalization: the standard and the Gram-space iteration, their FLOPs, and
same-shape batching under a memory cap.

Both algorithms are written once over a small op set (:class:`NSOps`); the torch op set is the
spec, the Triton one (:mod:`dmuon.kernels.triton_syrk`) a faster backend.

Math (DESIGN.md "Newton-Schulz"). ``M`` ``m x n``, transposed so ``m <= n``,
``X_0 = M / max(||M||_F, eps)``, per step ``(a, b, c)``:

* Standard (K. Jordan, Muon): ``A = X X^T; B = b A + c A^2; X <- a X + B X``.
* Gram space (J. Zhang, N. Amsel, B. Chen, T. Dao, "Gram Newton-Schulz", 2026,
  https://github.com/Dao-AILab/gram-newton-schulz): ``X_t = Q_t X_0`` with ``Q_t`` a polynomial
  in ``R_0 = X_0 X_0^T``, so iterate on ``m x m`` matrices: ``Z = b R + c R^2;
  Q <- Q (Z + a I); R <- (Z + a I) R (Z + a I)``, and form ``Q X`` at the end. Restarts
  (``X <- Q X; R <- X X^T; Q <- I``, :func:`~dmuon.kernels.coefficients.choose_gram_restarts`)
  bound ``Q``'s growth on small singular values in half precision. Square matrices use the
  standard iteration.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch
from torch import Tensor

from dmuon.kernels.coefficients import choose_gram_restarts, resolve_coefficients

__all__ = ["DEFAULT_MAX_BATCH_BYTES", "NSOps", "TORCH_OPS", "default_ns_dtype", "newton_schulz",
           "ns_flops", "orthogonalize_by_shape", "torch_add_diag", "torch_mm"]

_METHODS = ("standard", "gram")
_BACKENDS = ("auto", "torch", "triton")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

#: Default cap on the bytes of one stacked ``[batch, m, n]`` input in the iteration dtype.
DEFAULT_MAX_BATCH_BYTES = 1 << 30


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class NSOps:
    """A Newton-Schulz backend (``name``: ``"torch"`` or ``"triton"``): ops on ``[m, k]`` or
    ``[batch, m, k]`` operands of one floating dtype, returning that dtype. ``mm(A, B, C=None,
    alpha=1.0, beta=0.0)`` is ``alpha*A@B + beta*C``; ``sym_mm``, the same for a result the caller
    promises symmetric (a kernel may compute one triangle); ``add_diag(A, value)``,
    ``A + value * I`` (a new tensor).
    """

    name: str
    sym_mm: Callable[..., Tensor]
    mm: Callable[..., Tensor]
    add_diag: Callable[[Tensor, float], Tensor]


def torch_mm(
    A: Tensor, B: Tensor, C: Optional[Tensor] = None, alpha: float = 1.0, beta: float = 0.0
) -> Tensor:
    """``alpha * A @ B + beta * C`` (``A`` ``[.., m, k]``, ``B`` ``[.., k, n]``, ``C`` ``None`` or
    ``[.., m, n]``, one dtype) with ``torch.optim.Muon``'s calls (``@``, ``addmm``, ``baddbmm``), so
    the bf16 standard iteration is bitwise ``torch.optim.Muon``. Also the reference ``sym_mm``."""
    if C is None:
        if alpha == 1.0:
            return A @ B
        return torch.mul(A @ B, alpha)
    if A.dim() == 2:
        return torch.addmm(C, A, B, beta=beta, alpha=alpha)
    return torch.baddbmm(C, A, B, beta=beta, alpha=alpha)


def torch_add_diag(A: Tensor, value: float) -> Tensor:
    """``A + value * I`` for ``A`` ``[.., m, m]`` (a new tensor)."""
    out = A.clone()
    out.diagonal(dim1=-2, dim2=-1).add_(value)
    return out


#: The reference backend.
TORCH_OPS = NSOps(name="torch", sym_mm=torch_mm, mm=torch_mm, add_diag=torch_add_diag)


def _standard_iteration(X: Tensor, coefficients: Sequence[tuple[float, float, float]], ops: NSOps) -> Tensor:
    """Standard quintic Newton-Schulz on ``X`` of shape ``[.., m, n]`` (``m <= n``)."""
    for a, b, c in coefficients:
        A = ops.sym_mm(X, X.mT)
        B = ops.sym_mm(A, A, A, alpha=c, beta=b)
        X = ops.mm(B, X, X, beta=a)
    return X


def _gram_iteration(
    X: Tensor,
    coefficients: Sequence[tuple[float, float, float]],
    restarts: Sequence[int],
    ops: NSOps,
) -> Tensor:
    """Gram-space Newton-Schulz on ``X`` ``[.., m, n]`` (``m < n``), as Dao-AILab's
    ``GramNewtonSchulz._gram_newton_schulz``: ``R`` is not updated when it would be unused."""
    last = len(coefficients) - 1
    R = ops.sym_mm(X, X.mT)
    Q: Optional[Tensor] = None
    for i, (a, b, c) in enumerate(coefficients):
        if i in restarts and Q is not None:
            X = ops.mm(Q, X)
            R = ops.sym_mm(X, X.mT)
            Q = None
        Z = ops.sym_mm(R, R, R, alpha=c, beta=b)
        Q = ops.add_diag(Z, a) if Q is None else ops.sym_mm(Q, Z, Q, beta=a)
        if i < last and (i + 1) not in restarts:
            RZ = ops.sym_mm(R, Z, R, beta=a)
            R = ops.sym_mm(Z, RZ, RZ, beta=a)
    assert Q is not None  # len(coefficients) >= 1 is checked by resolve_coefficients
    return ops.mm(Q, X)


def _select_ops(backend: str, X: Tensor) -> NSOps:
    """Pick the op set for ``backend`` and the (already oriented) iterate ``X``."""
    if backend == "torch" or (backend == "auto" and X.device.type != "cuda"):
        return TORCH_OPS  # "auto" never uses Triton on CPU: do not even import it
    try:
        from dmuon.kernels import triton_syrk
    except ImportError as exc:
        if backend == "triton":
            raise RuntimeError(
                f"dmuon: backend='triton' needs the triton package, which failed to import ({exc}). "
                "Install dmuon[triton] or pass backend='torch'."
            ) from exc
        return TORCH_OPS
    if backend == "auto" and not triton_syrk.auto_prefers_triton(X):
        return TORCH_OPS
    if backend == "triton":
        triton_syrk.check_supported(X)
    return NSOps(name="triton", sym_mm=triton_syrk.triton_sym_mm, mm=torch_mm, add_diag=torch_add_diag)


def default_ns_dtype(device: torch.device | str) -> torch.dtype:
    """The default Newton-Schulz dtype on ``device``: ``torch.float32`` on CPU (half precision is
    slower there: ``bench/results/ns_dtype_cpu.json``), else ``torch.float16`` (bf16's
    tensor-core rate, 3 more mantissa bits)."""
    return torch.float32 if torch.device(device).type == "cpu" else torch.float16


def newton_schulz(
    G: Tensor,
    *,
    steps: int = 5,
    coefficients: str | Sequence[float] | Sequence[Sequence[float]] = "polar_express",
    method: str = "gram",
    dtype: torch.dtype | None = None,
    eps: float = 1e-7,
    backend: str = "auto",
    restarts: Optional[Sequence[int]] = None,
) -> Tensor:
    """Approximate the orthogonal polar factor ``U V^T`` of ``G`` by Newton-Schulz.

    ``X = G / max(||G||_F, eps)`` per matrix; with ``dtype=torch.bfloat16, method="standard",
    coefficients="muon", backend="torch"`` a 2-D ``G`` gives bitwise ``torch.optim.Muon``.

    Args:
        G: ``[m, n]`` or ``[batch, m, n]``, any floating dtype, any device; not mutated.
        steps: number of iterations (>= 1).
        coefficients: ``"polar_express"`` (default), ``"muon"``, one ``(a, b, c)`` or a per-step
            list; see :func:`~dmuon.kernels.coefficients.resolve_coefficients`.
        method: ``"gram"`` (default; square matrices use ``"standard"``) or ``"standard"``.
        dtype: iteration dtype (float16, bfloat16, float32 or float64); ``None``:
            :func:`default_ns_dtype` of ``G``'s device.
        eps: floor of the Frobenius norm (same units as ``G``); a zero ``G`` maps to zero.
        backend: ``"torch"`` (the reference), ``"triton"`` (CUDA), or ``"auto"`` (Triton on
            CUDA when importable and the shape is large enough).
        restarts: Gram restart steps; ``None`` chooses them with
            :func:`~dmuon.kernels.coefficients.choose_gram_restarts`. Ignored for ``"standard"``.

    Returns:
        Tensor of ``G``'s shape in the iteration ``dtype``.

    Raises:
        ValueError: bad ``G`` rank, ``method``, ``backend``, ``dtype``, ``eps``, ``steps``,
            ``coefficients`` or ``restarts``.
        RuntimeError: ``backend="triton"`` without triton or on an unsupported device/dtype.
    """
    if G.dim() not in (2, 3):
        raise ValueError(
            f"dmuon: newton_schulz takes [m, n] or [batch, m, n]; got shape {tuple(G.shape)}. "
            "Reshape higher-rank parameters to 2-D first."
        )
    if not G.is_floating_point():
        raise ValueError(f"dmuon: newton_schulz needs a floating tensor; got dtype {G.dtype}.")
    if method not in _METHODS:
        raise ValueError(f"dmuon: unknown Newton-Schulz method {method!r}; choose one of {_METHODS}.")
    if backend not in _BACKENDS:
        raise ValueError(f"dmuon: unknown Newton-Schulz backend {backend!r}; choose one of {_BACKENDS}.")
    if dtype is None:
        dtype = default_ns_dtype(G.device)
    if dtype not in _DTYPES:
        raise ValueError(f"dmuon: Newton-Schulz dtype must be one of {_DTYPES} or None; got {dtype}.")
    if not eps > 0:
        raise ValueError(f"dmuon: Newton-Schulz eps must be > 0; got {eps!r}.")
    coeffs = resolve_coefficients(coefficients, steps)

    transpose = G.size(-2) > G.size(-1)
    if G.numel() == 0:
        return torch.zeros(G.shape, dtype=dtype, device=G.device)
    # fp16 normalizes in fp32 (it overflows above 65504); bf16 op for op as torch.optim.Muon.
    X = G.to(torch.float32 if dtype == torch.float16 else dtype)
    if transpose:
        X = X.mT
    if dtype == torch.bfloat16 and X.dim() == 2:
        norm = X.norm()
    else:
        norm = X.norm(dim=(-2, -1), keepdim=True)
    X = X.div(norm.clamp(min=eps)).to(dtype)

    ops = _select_ops(backend, X)
    if method == "gram" and X.size(-2) != X.size(-1):
        if restarts is None:
            chosen = choose_gram_restarts(tuple(coeffs))
        else:
            chosen = tuple(int(r) for r in restarts)
            if any(r < 1 or r >= steps for r in chosen):
                raise ValueError(
                    f"dmuon: Gram restarts must be step indices in 1..{steps - 1}; got {list(restarts)}."
                )
        X = _gram_iteration(X, coeffs, chosen, ops)
    else:
        X = _standard_iteration(X, coeffs, ops)
    return X.mT if transpose else X


def ns_flops(
    m: int,
    n: int,
    *,
    steps: int = 5,
    method: str = "standard",
    batch: int = 1,
    symmetric: bool = False,
) -> float:
    """FLOPs of one Newton-Schulz call, ``2 * M * N * K`` per ``[M, K] @ [K, N]`` product
    (elementwise work not counted). With ``p = min(m, n)``, ``q = max(m, n)``:

    * standard: ``steps * (4 p^2 q + 2 p^3)`` (``X X^T``, ``A^2``, ``B X``).
    * gram (one restart): ``8 p^2 q + (8 steps - 12) p^3``; the standard count for square
      matrices (which :func:`newton_schulz` runs standard) and for ``steps=1`` (equal).

    ``symmetric=True`` counts the symmetric products (``X X^T``, ``A^2``, every ``p x p`` Gram
    product) at half, as a one-triangle kernel: standard ``steps * (3 p^2 q + p^3)``, gram
    (5 steps) ``6 p^2 q + 14 p^3``. ``batch`` matrices of shape ``[m, n]``; returns a float.

    Raises:
        ValueError: negative sizes, ``steps < 1`` or an unknown ``method``.
    """
    if m < 0 or n < 0 or batch < 0:
        raise ValueError(f"dmuon: ns_flops needs m, n, batch >= 0; got m={m}, n={n}, batch={batch}.")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"dmuon: ns_flops needs steps >= 1; got {steps!r}.")
    if method not in _METHODS:
        raise ValueError(f"dmuon: unknown Newton-Schulz method {method!r}; choose one of {_METHODS}.")
    p, q = min(m, n), max(m, n)
    half = 0.5 if symmetric else 1.0
    syrk, gemm_pq, cube = 2.0 * p * p * q * half, 2.0 * p * p * q, 2.0 * p**3 * half
    if method == "standard" or p == q or steps == 1:
        return float(batch * steps * (syrk + cube + gemm_pq))
    # One restart (anywhere): X X^T and Q X twice; Z every step, Q Z on steps 2.., R on 1..steps-2.
    return float(batch * (2 * (syrk + gemm_pq) + (4 * steps - 6) * cube))


def orthogonalize_by_shape(
    tensors: Sequence[Tensor],
    *,
    max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
    **newton_schulz_kwargs: Any,
) -> list[Tensor]:
    """Run :func:`newton_schulz` over many matrices: equal ``(shape, dtype, device)`` are stacked
    into ``[batch, m, n]`` chunks of at most ``max_batch_bytes`` in the iteration dtype (a larger
    matrix goes alone), one call per chunk; each matrix is still normalized by its own norm.

    Args:
        tensors: 2-D tensors ``[m, n]``, full (not shards), any floating dtype; not mutated.
        max_batch_bytes: cap on one chunk's stacked input, in bytes (>= 1).
        **newton_schulz_kwargs: passed to :func:`newton_schulz`.

    Returns:
        One tensor per input, in order, of its input's shape in the iteration dtype.

    Raises:
        ValueError: a tensor not 2-D, a non-positive cap, or a bad ``newton_schulz`` argument.
    """
    if not isinstance(max_batch_bytes, int) or max_batch_bytes < 1:
        raise ValueError(f"dmuon: max_batch_bytes must be a positive int; got {max_batch_bytes!r}.")
    groups: dict[tuple, list[int]] = {}
    for index, t in enumerate(tensors):
        if t.dim() != 2:
            raise ValueError(
                f"dmuon: orthogonalize_by_shape takes 2-D matrices; tensor {index} has shape "
                f"{tuple(t.shape)}. Reshape it to 2-D first."
            )
        groups.setdefault((tuple(t.shape), t.dtype, t.device), []).append(index)

    out: list[Tensor | None] = [None] * len(tensors)
    for (shape, _, device), indices in groups.items():
        dtype = newton_schulz_kwargs.get("dtype") or default_ns_dtype(device)
        per_matrix = max(1, shape[0] * shape[1] * torch.empty((), dtype=dtype).element_size())
        chunk = max(1, max_batch_bytes // per_matrix)
        for start in range(0, len(indices), chunk):
            part = indices[start : start + chunk]
            if len(part) == 1:
                results = [newton_schulz(tensors[part[0]], **newton_schulz_kwargs)]
            else:
                stacked = torch.stack([tensors[i] for i in part])
                results = list(newton_schulz(stacked, **newton_schulz_kwargs).unbind(0))
            for i, r in zip(part, results):
                out[i] = r
    return out  # type: ignore[return-value]
