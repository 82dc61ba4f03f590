"""Low-precision matrix products with fp32 accumulation, whatever the CPU's kernels do.

The claim "fp16 Gram-space Newton-Schulz is no less accurate than ``torch.optim.Muon``'s bf16
iteration" is a claim about GPU numerics: tensor cores (and dmuon's Triton kernels) read fp16 /
bf16 operands, accumulate in fp32 and round the result once. A CPU gives that only sometimes:
one without native fp16 arithmetic converts to fp32 and accumulates there, but one with
AVX512-FP16 / AMX (oneDNN) may accumulate in the operands' dtype, and then fp16 loses more than
bf16's wider exponent does (issue 24: 0.0125 against 0.0119 on such a CPU, 0.0093 against 0.0146
with ``ATEN_CPU_CAPABILITY=default`` on the same machine).

The op set here makes the accumulation ours: each product upcasts its operands to fp32 (exact:
fp16 and bf16 are subsets of fp32), multiplies there (CPU fp32 GEMMs accumulate in fp32 on every
ISA torch dispatches to), applies ``alpha`` / ``beta`` in fp32 (a GEMM epilogue) and rounds once
to the operands' dtype. The only machine dependence left is the order of fp32 additions, ~2^-24
relative, far below one fp16 (2^-11) or bf16 (2^-8) rounding.

Used by the precision tests on both sides of a comparison: dmuon's iteration (through
:func:`fp32_accumulation`, which swaps the torch op set of :mod:`dmuon.kernels.newton_schulz`)
and ``torch.optim.Muon``'s (tests/models.py builds its iteration from :func:`mm`).
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Iterator, Optional

import torch
from torch import Tensor

from dmuon.kernels.newton_schulz import NSOps, torch_add_diag


def mm(A: Tensor, B: Tensor, C: Optional[Tensor] = None, alpha: float = 1.0, beta: float = 0.0) -> Tensor:
    """``alpha * A @ B + beta * C`` computed in fp32 and rounded once to ``A.dtype``.

    Args:
        A: ``[m, k]`` or ``[batch, m, k]``, any floating dtype (not mutated).
        B: ``[k, n]`` or ``[batch, k, n]``, same dtype as ``A``.
        C: ``None`` or ``[m, n]`` / ``[batch, m, n]``.
        alpha: scale of ``A @ B``; beta: scale of ``C`` (dimensionless).

    Returns:
        ``[m, n]`` or ``[batch, m, n]`` in ``A.dtype`` (float64 stays float64).
    """
    wide = torch.float64 if A.dtype == torch.float64 else torch.float32
    out = A.to(wide) @ B.to(wide)
    if alpha != 1.0:
        out = out * alpha
    if C is not None:
        out = out + beta * C.to(wide)
    return out.to(A.dtype)


#: dmuon's torch op set with every product accumulated in fp32 (GPU tensor-core numerics).
FP32_ACCUMULATE_OPS = NSOps(name="torch-fp32-accumulate", sym_mm=mm, mm=mm, add_diag=torch_add_diag)


@contextlib.contextmanager
def fp32_accumulation() -> Iterator[None]:
    """Within the block, dmuon's torch Newton-Schulz backend accumulates products in fp32.

    Restores the original op set on exit (the test pool's worker processes are reused).
    """
    # The module, not the function of the same name that dmuon.kernels re-exports.
    ns_module = importlib.import_module("dmuon.kernels.newton_schulz")
    original = ns_module.TORCH_OPS
    ns_module.TORCH_OPS = FP32_ACCUMULATE_OPS
    try:
        yield
    finally:
        ns_module.TORCH_OPS = original
