"""The Triton backend of Newton-Schulz: a batched symmetric-product kernel (``X X^T`` and
``alpha A B + beta C``, symmetric since Gram-polynomial products commute), and when
``backend="auto"`` uses it (``mm`` and ``add_diag`` stay on torch).

The kernel computes the ``T (T + 1) / 2`` tiles on or below the diagonal and mirrors them
(about half the FLOPs; exactly symmetric output). fp16/bf16/fp32 in and out, fp32 accumulator,
launch configs from :mod:`dmuon.kernels.launch_configs`. Reference:
:func:`dmuon.kernels.newton_schulz.torch_mm`. Imports triton; the only reader of
``TRITON_INTERPRET`` in dmuon.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from dmuon.kernels.launch_configs import LaunchConfig, lookup_launch_config, min_rows_for_triton

__all__ = ["auto_prefers_triton", "check_supported", "triton_sym_mm"]

_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Grid axis 1 (the batch) is limited to 65535 programs by CUDA.
_MAX_GRID_BATCH = 65535


@triton.jit
def _sym_mm_kernel(
    a_ptr, b_ptr, c_ptr, out_ptr,
    M, K,
    stride_ab, stride_am, stride_ak,
    stride_bb, stride_bk, stride_bn,
    stride_cb, stride_cm, stride_cn,
    stride_ob, stride_om, stride_on,
    alpha, beta,
    HAS_C: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One ``BLOCK x BLOCK`` lower tile of ``alpha * A @ B + beta * C`` (``A`` ``[M, K]``, ``B``
    ``[K, M]``, ``C`` and output ``[M, M]``) and its mirror. Program ``(t, batch)``, lower tiles
    row by row: ``t = i (i + 1) / 2 + j``, ``j <= i``. ``UPCAST`` (bf16 under the CPU
    interpreter) converts operand tiles to fp32 before ``tl.dot``, exact for bf16 products.
    """
    t = tl.program_id(0)
    pid_b = tl.program_id(1)
    # Invert t = i (i + 1) / 2 + j; float sqrt, then fix an off-by-one from rounding.
    i = ((tl.sqrt(8.0 * t.to(tl.float32) + 1.0) - 1.0) * 0.5).to(tl.int32)
    i = tl.where((i + 1) * (i + 2) // 2 <= t, i + 1, i)
    i = tl.where(i * (i + 1) // 2 > t, i - 1, i)
    j = t - i * (i + 1) // 2

    rm = i * BLOCK + tl.arange(0, BLOCK)
    rn = j * BLOCK + tl.arange(0, BLOCK)
    rk = tl.arange(0, BLOCK_K)
    a_base = a_ptr + pid_b.to(tl.int64) * stride_ab
    b_base = b_ptr + pid_b.to(tl.int64) * stride_bb
    a_ptrs = a_base + rm[:, None] * stride_am + rk[None, :] * stride_ak
    b_ptrs = b_base + rk[:, None] * stride_bk + rn[None, :] * stride_bn
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + rk) < K
        a = tl.load(a_ptrs, mask=(rm[:, None] < M) & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & (rn[None, :] < M), other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(a, b)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    acc = acc * alpha
    if HAS_C:
        c_base = c_ptr + pid_b.to(tl.int64) * stride_cb
        c_ptrs = c_base + rm[:, None] * stride_cm + rn[None, :] * stride_cn
        c = tl.load(c_ptrs, mask=(rm[:, None] < M) & (rn[None, :] < M), other=0.0)
        acc += beta * c.to(tl.float32)
    # Diagonal tile: keep its lower triangle and mirror it, so the output is exactly symmetric.
    acc = tl.where((rm[:, None] >= rn[None, :]) | (i != j), acc, tl.trans(acc))
    out = acc.to(out_ptr.dtype.element_ty)
    o_base = out_ptr + pid_b.to(tl.int64) * stride_ob
    in_bounds = (rm[:, None] < M) & (rn[None, :] < M)
    tl.store(o_base + rm[:, None] * stride_om + rn[None, :] * stride_on, out, mask=in_bounds)
    # Mirror tile (j, i): element (r, c) of the transposed tile is out[c, r].
    if i != j:
        mirror_ok = (rn[:, None] < M) & (rm[None, :] < M)
        tl.store(o_base + rn[:, None] * stride_om + rm[None, :] * stride_on, tl.trans(out), mask=mirror_ok)


def _as_batched(x: Tensor) -> Tensor:
    return x if x.dim() == 3 else x.unsqueeze(0)


def triton_sym_mm(
    A: Tensor,
    B: Tensor,
    C: Optional[Tensor] = None,
    alpha: float = 1.0,
    beta: float = 0.0,
    *,
    config: Optional[LaunchConfig] = None,
) -> Tensor:
    """``alpha * A @ B + beta * C`` for a result the caller knows is symmetric (lower tiles
    computed with fp32 accumulation, then mirrored).

    Args:
        A: ``[m, k]`` or ``[batch, m, k]``, fp16/bf16/fp32, any strides.
        B: ``[k, m]`` or ``[batch, k, m]``, same dtype.
        C: ``None`` or a symmetric ``[m, m]`` / ``[batch, m, m]``, same dtype.
        alpha, beta: scales of ``A @ B`` and ``C`` (dimensionless).
        config: launch config; ``None`` looks it up for the device and ``(m, k)``.

    Returns:
        New ``[m, m]`` or ``[batch, m, m]`` tensor in the input dtype, exactly symmetric.

    Raises:
        ValueError: mismatched shapes or dtypes, or a batch above 65535.
    """
    squeeze = A.dim() == 2
    A3, B3 = _as_batched(A), _as_batched(B)
    batch, m, k = A3.shape
    if B3.shape != (batch, k, m):
        raise ValueError(
            f"dmuon: triton_sym_mm needs B of shape {(batch, k, m)} for A of shape "
            f"{tuple(A3.shape)} (square symmetric result); got {tuple(B3.shape)}."
        )
    if A3.dtype != B3.dtype or (C is not None and C.dtype != A3.dtype):
        raise ValueError(
            f"dmuon: triton_sym_mm needs one dtype; got A {A.dtype}, B {B.dtype}, "
            f"C {None if C is None else C.dtype}."
        )
    if batch > _MAX_GRID_BATCH:
        raise ValueError(
            f"dmuon: triton_sym_mm batch {batch} exceeds {_MAX_GRID_BATCH}; split the batch "
            "(orthogonalize_by_shape's max_batch_bytes does)."
        )
    # The CPU interpreter (triton 3.9) mishandles bf16 (tl.dot, fp32 -> bf16 rounding): there the
    # kernel upcasts, writes fp32 and torch rounds to bf16, as the GPU kernel does.
    emulate_bf16 = A3.device.type != "cuda" and A3.dtype == torch.bfloat16
    out = torch.empty((batch, m, m), dtype=torch.float32 if emulate_bf16 else A3.dtype, device=A3.device)
    if batch == 0 or m == 0:
        return out[0] if squeeze else out
    if config is None:
        config = lookup_launch_config(A3.device, m, k)
    C3 = _as_batched(C) if C is not None else out  # dummy pointer when HAS_C is False
    tiles_per_row = triton.cdiv(m, config.block)
    grid = (tiles_per_row * (tiles_per_row + 1) // 2, batch)
    _sym_mm_kernel[grid](
        A3, B3, C3, out,
        m, k,
        A3.stride(0), A3.stride(1), A3.stride(2),
        B3.stride(0), B3.stride(1), B3.stride(2),
        C3.stride(0), C3.stride(1), C3.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        float(alpha), float(beta),
        HAS_C=C is not None,
        UPCAST=emulate_bf16,
        BLOCK=config.block,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if emulate_bf16:
        out = out.to(torch.bfloat16)
    return out[0] if squeeze else out


def check_supported(X: Tensor) -> None:
    """``RuntimeError`` unless ``X`` is fp16/bf16/fp32 on CUDA (or CPU under ``TRITON_INTERPRET=1``)."""
    if X.dtype not in _TRITON_DTYPES:
        raise RuntimeError(
            f"dmuon: the Triton Newton-Schulz backend runs {_TRITON_DTYPES}; got {X.dtype}. "
            "Pass backend='torch' for this dtype."
        )
    if X.device.type == "cuda":
        return
    if X.device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") == "1":
        return
    raise RuntimeError(
        f"dmuon: the Triton Newton-Schulz backend needs a CUDA tensor (got device {X.device}); "
        "on CPU it runs only under TRITON_INTERPRET=1 (tests). Pass backend='torch' or 'auto'."
    )


def auto_prefers_triton(X: Tensor) -> bool:
    """``backend="auto"``: Triton on CUDA in fp16/bf16 when ``m`` reaches the launch table's
    ``min_rows_for_triton`` (below it tile waste and launches eat the saving)."""
    if X.device.type != "cuda" or X.dtype not in (torch.float16, torch.bfloat16):
        return False
    return X.size(-2) >= min_rows_for_triton(X.device)
