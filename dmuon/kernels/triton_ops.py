"""The Triton op set for the Newton-Schulz algorithms, and when ``backend="auto"`` uses it.

``sym_mm`` is :func:`dmuon.kernels.triton_syrk.triton_sym_mm` (one triangle of tiles); ``mm``
and ``add_diag`` stay on torch (cuBLAS runs a general GEMM at peak). Importing this module
imports triton. triton's ``TRITON_INTERPRET`` switch is read here and nowhere else in dmuon.
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
    """Raise ``RuntimeError`` if the Triton kernels cannot run on ``X`` (``[m, n]`` or
    ``[batch, m, n]``): a dtype other than fp16/bf16/fp32, or not CUDA (CPU only under
    ``TRITON_INTERPRET=1``)."""
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
    """``backend="auto"``: Triton on CUDA in fp16/bf16 when ``m`` reaches the table's
    ``min_rows_for_triton`` (256 by default: below, tile waste and launches eat the saving)."""
    if X.device.type != "cuda" or X.dtype not in (torch.float16, torch.bfloat16):
        return False
    return X.size(-2) >= min_rows_for_triton(X.device)
