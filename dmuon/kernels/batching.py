"""Same-shape batching: one batched Newton-Schulz call per shape, under a memory cap."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from dmuon.kernels.newton_schulz import default_ns_dtype, newton_schulz

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_MAX_BATCH_BYTES", "orthogonalize_by_shape"]

#: Default cap on the bytes of one stacked ``[batch, m, n]`` input in the iteration dtype (the
#: peak is a small multiple of it).
DEFAULT_MAX_BATCH_BYTES = 1 << 30


def orthogonalize_by_shape(
    tensors: Sequence[Tensor],
    *,
    max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
    **newton_schulz_kwargs: Any,
) -> list[Tensor]:
    """Run :func:`~dmuon.kernels.newton_schulz` over many matrices, batching equal shapes.

    Matrices are grouped by ``(shape, dtype, device)`` in order of first appearance, stacked into
    ``[batch, m, n]`` chunks whose size in the iteration dtype stays under ``max_batch_bytes``
    (a single matrix larger than the cap goes alone), and each chunk is one ``newton_schulz``
    call. Batching does not change the math: each matrix is normalized by its own norm.

    Args:
        tensors: 2-D tensors ``[m, n]``, full (not shards), any floating dtype; not mutated.
        max_batch_bytes: cap on one chunk's stacked input, in bytes (>= 1).
        **newton_schulz_kwargs: passed to ``newton_schulz`` (``steps``, ``coefficients``,
            ``method``, ``dtype``, ``eps``, ``backend``, ``restarts``).

    Returns:
        One tensor per input, in input order, each of its input's shape in the iteration dtype.

    Raises:
        ValueError: a tensor that is not 2-D (naming its index and shape), a non-positive cap,
            or a bad ``newton_schulz`` argument.
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
        logger.debug("orthogonalize_by_shape: %d x %s in chunks of %d", len(indices), shape, chunk)
    return out  # type: ignore[return-value]
