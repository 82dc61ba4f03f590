"""Checks of an owner plan against the model and the mesh it is to run on.

A plan solved for one model, world size or expert-parallel layout must not run on another: its
owners would be the wrong ranks, or name matrices the model does not have. These checks raise
a ``ValueError`` naming the first mismatch and the fix (re-solve the plan). They reach
:class:`dmuon.owners.owner_plan.OwnerPlan` as its :meth:`~PlanChecks.check_matches` (a mixin,
so that this module does not import the plan's and the plan's does not import it back).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping


class PlanChecks:
    """:class:`dmuon.owners.owner_plan.OwnerPlan`'s checks against a model and a mesh."""

    __slots__ = ()

    def check_matches(self, shape_by_fqn: Mapping[str, Any], world_size: int,
                      tp_size: int = 1, *, ep_size: int = 1, expert_parallel: Iterable[str] = ()) -> None:
        """Check that this plan fits a model's dedicated matrices and a mesh.

        Args:
            shape_by_fqn: every dedicated parameter of the model, by FQN: its full shape
                (``(rows, cols)`` or a stack's ``(*lead, rows, cols)``) or its
                :class:`dmuon.owners.stacks.ParamLayout` (with row blocks); a stack's expert
                ranges must cover its experts once each.
            world_size: size of the data-parallel mesh the plan will run on.
            ep_size: size of its expert-parallel ``"ep"`` dimension (1 without one).
            expert_parallel: the FQNs of the stacks split over ``"ep"`` (their
                ``shape_by_fqn`` entry is one rank's local stack, ``[E / ep_size, rows, cols]``).

        Raises:
            ValueError: naming the first mismatch (world size, ep size, missing or extra
                matrix, shape, a stack expert-parallel in the model and not in the plan or the
                other way round) and how to fix it.
        """
        _check_plan_matches(self, shape_by_fqn, world_size, tp_size)
        _check_expert_parallel(self, ep_size, set(expert_parallel))


def _check_expert_parallel(plan: PlanChecks, ep_size: int, expert_parallel: set[str]) -> None:
    """The plan's expert-parallel grouping is the mesh's and the model's (a plan solved for one
    layout must not run on another: its owners would be ranks of different groups)."""
    if ep_size != plan.ep_size:
        raise ValueError(
            f"dmuon: the plan was solved for an expert-parallel ('ep') size of {plan.ep_size} but "
            f"the mesh has {ep_size}; re-solve the plan for this mesh")
    for fqn, specs in plan.specs_by_fqn().items():
        in_plan, in_model = specs[0].ep, fqn in expert_parallel
        if any(m.ep != in_plan for m in specs) or in_plan != in_model:
            raise ValueError(
                f"dmuon: parameter {fqn!r} is {'' if in_model else 'not '}split over the 'ep' "
                f"mesh dimension in this model but the plan {'does not treat' if in_model else 'treats'} "
                f"it as expert-parallel; re-solve the plan for this model and mesh")


def _check_plan_matches(plan: PlanChecks, shape_by_fqn: Mapping[str, Any], world_size: int,
                        tp_size: int) -> None:
    """:meth:`OwnerPlan.check_matches`: the first mismatch raises ``ValueError``."""
    if world_size != plan.world_size:
        raise ValueError(
            f"dmuon: the plan was solved for {plan.world_size} ranks but the mesh has "
            f"{world_size}; re-solve it with `python -m dmuon.profile --nodes N "
            f"--gpus-per-node G` for this world size"
        )
    if tp_size != plan.tp_size:
        raise ValueError(
            f"dmuon: the plan was solved for TP size {plan.tp_size} but the mesh has TP size "
            f"{tp_size}; re-solve it for this mesh"
        )
    from dmuon.owners.stacks import ParamLayout

    layouts = {fqn: (v if isinstance(v, ParamLayout) else ParamLayout(tuple(int(x) for x in v)))
               for fqn, v in shape_by_fqn.items()}
    mine = plan.specs_by_fqn()
    missing = [f for f in layouts if f not in mine]
    if missing:
        raise ValueError(
            f"dmuon: the plan assigns no owner to {len(missing)} dedicated matrices of this "
            f"model, e.g. {missing[:3]}; it was solved for another model or predicate"
        )
    extra = [f for f in mine if f not in layouts]
    if extra:
        raise ValueError(
            f"dmuon: the plan names {len(extra)} matrices this model does not dedicate, "
            f"e.g. {extra[:3]}; it was solved for another model or predicate"
        )
    for fqn, layout in layouts.items():
        specs = mine[fqn]
        got = (tuple(specs[0].shape), specs[0].blocks)
        if got != (layout.matrix_shape, layout.blocks) or any(
                (tuple(m.shape), m.blocks) != got for m in specs):
            raise ValueError(
                f"dmuon: parameter {fqn!r} has shape {layout.shape} (Newton-Schulz matrices "
                f"{layout.matrix_shape}, {layout.blocks} row block(s) each) but the plan was "
                f"solved for matrices {tuple(specs[0].shape)} with {specs[0].blocks} block(s); "
                f"re-solve the plan for this model"
            )
        ranges = [m.experts for m in specs]
        if layout.is_stack:
            covered = ranges[0] is not None and ranges[0][0] == 0 and ranges[-1][1] == layout.count and all(
                a is not None and b is not None and a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            if not covered:
                raise ValueError(
                    f"dmuon: parameter {fqn!r} is a stack of {layout.count} matrices (shape "
                    f"{layout.shape}) but the plan's expert ranges {ranges} do not cover 0..{layout.count} "
                    f"once each; re-solve the plan for this model"
                )
        elif ranges != [None]:
            raise ValueError(
                f"dmuon: parameter {fqn!r} is one matrix (shape {layout.shape}) but the plan "
                f"gives it expert ranges {ranges}; re-solve the plan for this model"
            )
