"""DDP-style gradient averaging of replicated (non-FSDP2) non-dedicated parameters.

Bucketed :class:`~dmuon.comm.collectives.FlatBucket` all-reduces overlapped with backward, as
DDP's reducer (Li et al., VLDB 2020): buckets are filled in reverse registration order and
launched strictly in order. Each backward's incoming gradient is taken by a tensor hook and its
average added at the end, so gradient accumulation stays exact.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from dmuon.comm.collectives import FlatBucket, Pending


class ReplicatedGrads:
    """Bucketed all-reduce over ``group`` of the gradients of ``params`` (replicated, trainable,
    in registration order), in buffers of about ``bucket_bytes``; ``before_issue`` runs before
    each all-reduce (the step check's ``settle``)."""

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup, bucket_bytes: int,
                 before_issue: Callable[[], None] = lambda: None) -> None:
        self.group = group
        self.before_issue = before_issue
        self.params = params
        self.world_size = dist.get_world_size(group)
        self.buckets: list[list[nn.Parameter]] = []
        current, size = [], 0
        for p in reversed(params):  # gradients arrive roughly in reverse order
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= bucket_bytes:
                self.buckets.append(current)
                current, size = [], 0
        if current:
            self.buckets.append(current)
        self.incoming: dict[nn.Parameter, torch.Tensor] = {}  # this backward's, by parameter
        self.unsynced: dict[nn.Parameter, torch.Tensor] = {}  # local sums of no_sync micro-batches
        self.pending: list[tuple[list[nn.Parameter], FlatBucket, Pending]] = []

    def on_grad(self, param: nn.Parameter, grad: torch.Tensor, sync: bool = True) -> torch.Tensor:
        """Tensor hook: stash the incoming gradient (with ``sync=False`` sum it locally for the
        next synchronized backward), launch ready buckets, accumulate zero."""
        earlier = self.unsynced.pop(param, None)
        if earlier is not None:
            grad = earlier + grad
        if sync:
            self.incoming[param] = grad
            self._launch_ready(final=False)
        else:
            self.unsynced[param] = grad
        return torch.zeros_like(grad)

    def _launch_ready(self, final: bool) -> None:
        """Issue the next buckets, in order, while all their gradients are in (``final``: all)."""
        while len(self.pending) < len(self.buckets):
            bucket = self.buckets[len(self.pending)]
            if not final and any(p not in self.incoming for p in bucket):
                return
            # presence flags: a parameter unused everywhere keeps grad=None
            flat = FlatBucket([p.shape for p in bucket], torch.float32, bucket[0].device,
                              [(len(bucket), True)])
            flat.pack([self.incoming.get(p) for p in bucket])
            self.before_issue()
            pend = flat.issue("all_reduce", self.group, what="the gradient all-reduce")
            self.pending.append((bucket, flat, pend))

    def finish(self) -> None:
        """At the end of backward: launch what is left, wait, and add the averages to ``.grad``."""
        self._launch_ready(final=True)
        with torch.no_grad():
            for bucket, flat, pend in self.pending:
                pend.wait()
                for p, avg, count in zip(bucket, flat.views(), flat.flag_values()):
                    if count > 0:
                        avg = avg.div_(self.world_size).to(p.dtype)
                        p.grad = avg if p.grad is None else p.grad.add_(avg)
        self.incoming.clear()
        self.pending.clear()
