"""Gradient averaging for replicated (non-FSDP2) non-dedicated parameters.

On a plain module replicated on every rank with ``replicas="placeholder"`` (with
``replicas="keep"`` they ride in a gradient bucket instead, :mod:`dmuon.hooks.keep`, unless
their dtype or device differs from it), dmuon averages the gradients of the parameters AdamW
steps in :class:`dmuon.comm.collectives.FlatBucket` all-reduces overlapped with backward, like
DDP's reducer (Li et al., "PyTorch Distributed", VLDB 2020): buckets are filled in reverse
registration order and launched strictly in bucket order, so every rank issues the same
all-reduces in the same order even if a parameter is unused on some ranks.

Exact under gradient accumulation: each backward's *incoming* gradient is taken by a tensor
hook (the accumulated ``.grad`` is left as it was) and the average is added at the end.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from dmuon.comm.collectives import FlatBucket, Pending


class ReplicatedGrads:
    """Bucketed all-reduce of replicated parameters' gradients.

    Args:
        params: replicated parameters that require grad, in registration order.
        group: process group over which the replicas live.
        bucket_bytes: target size of one flat all-reduce buffer (bytes).
        before_issue: called before each all-reduce is issued (the runtime's deferred step
            check, :meth:`dmuon.hooks.step_check.StepCheck.settle`).
    """

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
        """Tensor hook: stash the incoming gradient, launch ready buckets, accumulate zero.

        With ``sync=False`` (``no_sync`` micro-batches) the gradient is only summed locally and
        goes out with the next synchronized backward.
        """
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
            # one flag per parameter counts the ranks that produced a gradient, so a parameter
            # unused everywhere keeps grad=None, as in single-process training
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
