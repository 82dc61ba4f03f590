"""``replicas="keep"``: the DDP-style path, full weights on every rank, collectives in buckets.

On a plain replicated module every rank keeps every dedicated matrix whole. A step is DDP's
all-reduce cut in two (Li et al., "PyTorch Distributed", VLDB 2020): in backward, gradients
go to their owner in size-capped buckets (one ``reduce`` each); after ``step()``, each bucket is
broadcast from its owner. The runtime's publication machinery runs it with publish groups keyed
by bucket (:func:`bucket_keys`); this module decides the mode and the buckets.
"""

from __future__ import annotations

from typing import Any

REPLICAS = ("keep", "placeholder")


def keeps_replicas(replicas: str | None, *, fsdp_wrapped: bool, roles: Any) -> bool:
    """Whether every rank keeps every matrix whole: ``replicas`` ``"keep"`` or ``None`` (the
    default) on a plain replicated module on a 1-D mesh. ``ValueError``: an unknown value, or
    one given for another model or mesh."""
    if replicas is not None and replicas not in REPLICAS:
        raise ValueError(f"dmuon: replicas must be 'keep' or 'placeholder' (or None for the default), "
                         f"got {replicas!r}")
    if fsdp_wrapped or roles.tp is not None or roles.replicate is not None or roles.expert is not None:
        if replicas is not None:
            where = "an FSDP2 (fully_shard) model" if fsdp_wrapped else "an HSDP or tensor-parallel mesh"
            raise ValueError(
                f"dmuon: replicas={replicas!r} applies to a plain replicated module on a 1-D mesh, "
                f"but dedicate_params got {where}; there FSDP2 decides what each rank holds. Drop "
                f"replicas=..., or call dedicate_params on the module without fully_shard."
            )
        return False
    return replicas != "placeholder"


def bucket_keys(plan, specs, bucket_bytes: int) -> list[int]:
    """Each plan entry's bucket (``specs`` in binding order): the plan's, or for a plan
    without buckets, cut here by the same cap (fp32 bytes)."""
    if all(spec.bucket is not None for spec in specs):
        return [spec.bucket for spec in specs]
    from dmuon.balance.buckets import cut_buckets

    return cut_buckets([4 * spec.matrices * spec.shape[0] * spec.shape[1] for spec in specs], bucket_bytes)
