"""``torch.compile`` over FSDP2 alone and FSDP2 + dmuon (issue 14, item 5), run on every rank
of the test pool: the numbers, and dynamo's graph breaks, graphs and recompile-limit hits."""

from __future__ import annotations

import logging
from typing import Any


from tests import thirdparty_cases as tc


class _LimitHits(logging.Handler):
    """Counts dynamo's "hit config.recompile_limit" warnings (it then runs the frame eagerly)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.functions: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if "torch._dynamo hit config." in msg:
            self.functions.append(msg.split("function:")[1].split("\n")[0].strip())


def compile_train(rank: int, world_size: int, *, case: str, compile: str, with_dmuon: bool,
                  steps: int = 3, backend: str = "aot_eager") -> dict[str, Any]:
    """FSDP2 per block + root (and dmuon when ``with_dmuon``), then ``compile``: ``"none"``
    (eager), ``"model"`` (``torch.compile(model)``) or ``"blocks"`` (``block.compile()`` per
    FSDP2 block, as torchtitan does); train ``steps`` steps (dmuon: fp32 exact mode; FSDP2
    alone: AdamW, only its dynamo counts are used)."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon
    from tests.dist_cases import full_params

    torch._dynamo.reset()
    counters.clear()
    hits = _LimitHits()
    logging.getLogger("torch._dynamo.convert_frame").addHandler(hits)
    try:
        model = tc.build(case)
        mesh = init_device_mesh("cpu", (world_size,))
        blocks = tc.CASES[case].blocks(model)
        for block in blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if with_dmuon:
            dmuon.dedicate_params(model, mesh, group_cost=0.0)
            opt = dmuon.Muon(model, **tc.OPT_KWARGS)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        run = model
        if compile == "model":
            run = torch.compile(model, backend=backend)
        elif compile == "blocks":
            for block in blocks:
                block.compile(backend=backend)
        losses = []
        for step in range(steps):
            loss = tc.CASES[case].loss(run, *tc.local_batch(case, step, rank, world_size))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    finally:
        logging.getLogger("torch._dynamo.convert_frame").removeHandler(hits)
    breaks = dict(counters["graph_break"])
    # A break dynamo cannot resume from (inside torch's own code, as FSDP2's hooks) is not a
    # "graph_break": the whole frame is skipped and counted under "unimplemented".
    out = dict(losses=losses, graph_breaks=sum(breaks.values()), break_reasons=breaks,
               skipped_frames=sum(counters["unimplemented"].values()),
               frames=dict(counters["frames"]),
               unique_graphs=counters["stats"]["unique_graphs"], limit_hits=hits.functions)
    if with_dmuon:
        out["params"] = full_params(model, rank)
        out["violations"] = tc.contract_violations(model)
    torch._dynamo.reset()
    return out
