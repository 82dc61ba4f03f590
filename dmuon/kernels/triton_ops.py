"""The Triton op set for the Newton-Schulz algorithms, and when ``backend="auto"`` uses it.

``sym_mm`` runs :func:`dmuon.kernels.triton_syrk.triton_sym_mm` (one triangle of tiles, fp32
accumulation); ``mm`` (``Q X`` and ``B X``, unstructured) and ``add_diag`` stay on torch, since
cuBLAS already runs a general GEMM at peak and a Triton GEMM would only match it.

Importing this module imports triton; :mod:`dmuon.kernels.newton_schulz` imports it lazily.
Whether Triton may run on CPU (its interpreter) is triton's own ``TRITON_INTERPRET`` switch,
read here and nowhere else in dmuon.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import Tensor

from dmuon.kernels.launch_configs import min_rows_for_triton
from dmuon.kernels.ops import NSOps, torch_add_diag, torch_mm
from dmuon.kernels.triton_syrk import triton_sym_mm

logger = logging.getLogger(__name__)

__all__ = ["TRITON_OPS", "auto_prefers_triton", "check_supported"]

_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

#: The Triton backend.
TRITON_OPS = NSOps(name="triton", sym_mm=triton_sym_mm, mm=torch_mm, add_diag=torch_add_diag)


def _interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_supported(X: Tensor) -> None:
    """Raise if the Triton kernels cannot run on ``X``.

    Args:
        X: the oriented iterate ``[m, n]`` or ``[batch, m, n]``.

    Raises:
        RuntimeError: ``X`` is on CPU without ``TRITON_INTERPRET=1``, on a device other than
            CUDA/CPU, or in a dtype other than fp16/bf16/fp32.
    """
    if X.dtype not in _TRITON_DTYPES:
        raise RuntimeError(
            f"dmuon: the Triton Newton-Schulz backend runs {_TRITON_DTYPES}; got {X.dtype}. "
            "Pass backend='torch' for this dtype."
        )
    if X.device.type == "cuda":
        return
    if X.device.type == "cpu" and _interpreter_on():
        return
    raise RuntimeError(
        f"dmuon: the Triton Newton-Schulz backend needs a CUDA tensor (got device {X.device}); "
        "on CPU it runs only under TRITON_INTERPRET=1 (tests). Pass backend='torch' or 'auto'."
    )


def auto_prefers_triton(X: Tensor) -> bool:
    """``backend="auto"``: Triton on CUDA in fp16/bf16 when ``m`` reaches the table's threshold.

    Below the threshold (256 rows in the default table, the tile size under which the Gram
    Newton-Schulz reference also keeps torch) the one-triangle saving is eaten by tile waste
    and launch overhead. CPU always uses torch, interpreter or not.
    """
    if X.device.type != "cuda" or X.dtype not in (torch.float16, torch.bfloat16):
        return False
    return X.size(-2) >= min_rows_for_triton(X.device)
