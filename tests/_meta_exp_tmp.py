import sys, traceback
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
import dmuon
from tests import models, thirdparty_cases as tc

def init_(model):
    if hasattr(model, "init_weights") and hasattr(model, "config"):
        model.init_weights()
    else:
        for m in model.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()

def flow(rank, world_size, *, order, case="net"):
    mesh = init_device_mesh("cpu", (world_size,))
    with torch.device("meta"):
        model = models.Net() if case == "net" else tc.CASES[case].build()
    blocks = list(model.blocks) if case == "net" else tc.CASES[case].blocks(model)
    log = []
    try:
        if "dedicate-first" in order:
            dmuon.dedicate_params(model, mesh)
        for b in blocks: fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if order == "fsdp-only":
            pass
        elif "dedicate-first" not in order:
            dmuon.dedicate_params(model, mesh)
        if order == "muon-before-empty":
            opt = dmuon.Muon(model, lr=0.02)
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        if order == "muon-before-init":
            opt = dmuon.Muon(model, lr=0.02)
        init_(model)
        if order in ("documented", "dedicate-first"):
            opt = dmuon.Muon(model, lr=0.02)
        out = {}
        if order == "fsdp-only":
            for n, p in model.named_parameters():
                out[n] = p.full_tensor().detach().clone()
        else:
            from tests.dist_cases import full_params
            out = {k: torch.from_numpy(v) for k, v in full_params(model, rank).items()}
        return out
    except Exception as e:
        return f"{type(e).__name__}: {e}\n" + traceback.format_exc()[-1500:]
