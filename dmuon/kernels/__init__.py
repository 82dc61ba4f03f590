"""Newton-Schulz kernels: reference, Gram-space iteration, Triton SYRK, batching, launch configs.
Triton is imported only for ``backend="triton"``/``"auto"`` on CUDA.
"""

from dmuon.kernels.coefficients import choose_gram_restarts, resolve_coefficients
from dmuon.kernels.newton_schulz import (
    default_ns_dtype,
    newton_schulz,
    ns_flops,
    orthogonalize_by_shape,
)

__all__ = [
    "choose_gram_restarts",
    "default_ns_dtype",
    "newton_schulz",
    "ns_flops",
    "orthogonalize_by_shape",
    "resolve_coefficients",
]
