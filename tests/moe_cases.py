"""Mixture-of-Experts models trained with dmuon on gloo ranks (issue 26).

Each case builds a tiny, randomly initialised MoE model (Hugging Face ``Qwen3MoeForCausalLM``,
``MixtralForCausalLM``, ``DeepseekV3ForCausalLM`` from a config: no downloads; a torch.nn model
whose experts are a ``ModuleList`` of ``nn.Linear`` pairs, routed so that some experts get no
tokens on some ranks). :func:`train` runs on every rank of the test pool under FSDP2 (1-D) or
HSDP; :func:`reference` is single-process ``torch.optim.Muon`` on each expert's 2-D slice as a
parameter of its own (copied in and out of the stack around each step) + ``torch.optim.AdamW``
on the rest, on the global batch. The reference lists its Muon matrices by name per case and
shares no code with dmuon's selection, plan or update.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from dmuon.integrations.hf_moe import ep_dispatch
from tests import models

VOCAB, SEQ, LOCAL_BATCH = 32, 6, 2
OPT_KWARGS = dict(lr=0.02, adamw_lr=0.01, weight_decay=0.1, ns_method="standard",
                  ns_dtype=torch.float32, ns_coefficients="muon")


# --------------------------------------------------------------------- a ModuleList MoE
class Expert(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


class ListMoE(nn.Module):
    """Top-1 routed experts kept as separate modules (a ``ModuleList``); only the experts that
    get tokens run, so the others take no gradient on that rank (as in many hand-written MoEs)."""

    def __init__(self, width: int, hidden: int, experts: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.router = nn.Linear(width, experts, bias=False)
        self.experts = nn.ModuleList([Expert(width, hidden) for _ in range(experts)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        flat = h.reshape(-1, h.shape[-1])
        probs = torch.softmax(self.router(flat), dim=-1)
        weight, choice = probs.max(dim=-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            idx = (choice == e).nonzero().flatten()
            if idx.numel():  # no tokens: the expert does not run (no gradient on this rank)
                out.index_add_(0, idx, expert(flat[idx]) * weight[idx, None])
        return x + out.view_as(x)


def list_moe_net() -> nn.Module:
    """Two :class:`ListMoE` blocks of 4 experts."""
    return models.BlocksNet(VOCAB, 16, lambda: [ListMoE(16, 12, 4), ListMoE(16, 12, 4)])


# ------------------------------------------------------- an expert-parallel MoE (torchtitan-like)
class GroupedExperts(nn.Module):
    """Expert stacks ``w1 [E, hidden, width]``, ``w2 [E, width, hidden]`` as torchtitan's
    ``GroupedExperts`` holds them; under expert parallelism they are DTensors ``Shard(0)`` over
    ``"ep"`` and the forward computes with the local experts (``to_local()``), as torchtitan's
    does. ``counts``: tokens per local expert, ``x`` sorted by local expert."""

    def __init__(self, width: int, hidden: int, experts: int) -> None:
        super().__init__()
        self.num_experts = experts
        self.w1 = nn.Parameter(torch.randn(experts, hidden, width) / width ** 0.5)
        self.w2 = nn.Parameter(torch.randn(experts, width, hidden) / hidden ** 0.5)

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        w1, w2 = (w.to_local() if hasattr(w, "to_local") else w for w in (self.w1, self.w2))
        outs = [torch.tanh(chunk @ w1[e].T) @ w2[e].T for e, chunk in enumerate(torch.split(x, counts))]
        return torch.cat(outs) if outs else x[:0]


class EPMoE(nn.Module):
    """Top-1 routed :class:`GroupedExperts` with an optional expert-parallel token dispatch:
    with ``ep_group`` set, the tokens for expert ``e`` go (all-to-all, autograd through
    ``torch.distributed.nn.functional.all_to_all_single``) to the ``"ep"`` rank holding it,
    ``e // (E / ep)``, and come back the same way (torchtitan's ``ExpertParallel`` token
    dispatch and combine, with torch's autograd all-to-all as torchtitan's). Without it every
    expert is local: the single-process reference."""

    def __init__(self, width: int, hidden: int, experts: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.router = nn.Linear(width, experts, bias=False)
        self.proj = nn.Linear(width, width, bias=False)  # a dense matrix in every block
        self.experts = GroupedExperts(width, hidden, experts)
        self.ep_group: Any = None  # set by tests.ep_cases.parallelize

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        flat = h.reshape(-1, h.shape[-1])
        weight, choice = torch.softmax(self.router(flat), dim=-1).max(dim=-1)
        order = torch.argsort(choice, stable=True)
        counts = torch.bincount(choice, minlength=self.experts.num_experts)
        routed = self._dispatch(flat[order], counts)
        out = torch.zeros_like(flat).index_copy(0, order, routed * weight[order, None])
        return x + self.proj(out).view_as(x)

    def _dispatch(self, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return ep_dispatch(routed, counts, self.ep_group, self.experts)


def ep_moe_net(experts: int = 4) -> nn.Module:
    """Two :class:`EPMoE` blocks of ``experts`` experts: the expert parallelism test model
    (``tests/ep_cases.py``)."""
    return models.BlocksNet(VOCAB, 16, lambda: [EPMoE(16, 12, experts), EPMoE(16, 12, experts)])


def _ep_batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7000 + step)
    return torch.randint(0, VOCAB, (n, 4), generator=g), torch.randn(n, generator=g)


def _list_batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Few tokens per rank (2 x 3) over 4 experts x 2 layers: some experts get none on a rank.
    g = torch.Generator().manual_seed(5000 + step)
    return torch.randint(0, VOCAB, (n, 3), generator=g), torch.randn(n, generator=g)


def _mse(model: nn.Module, idx: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(idx) - y) ** 2).mean()


# ------------------------------------------------------------------------ HF MoE models
def _tokens(step: int, n: int) -> tuple[torch.Tensor]:
    g = torch.Generator().manual_seed(3000 + step)
    return (torch.randint(0, VOCAB, (n, SEQ), generator=g),)


def _causal_lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def _qwen3_moe() -> nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24,
                            moe_intermediate_size=8, num_hidden_layers=2, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=8, num_experts=4, num_experts_per_tok=2,
                            decoder_sparse_step=1, max_position_embeddings=2 * SEQ)
    return Qwen3MoeForCausalLM(config)


def _mixtral() -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=8, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                           num_local_experts=3, num_experts_per_tok=2, max_position_embeddings=2 * SEQ)
    return MixtralForCausalLM(config)


def _deepseek_v3() -> nn.Module:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    # layer 0 dense, layer 1 MoE: a shared expert (an MLP of 2-D matrices) + 4 routed experts
    config = DeepseekV3Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=24,
                              moe_intermediate_size=8, num_hidden_layers=2, num_attention_heads=2,
                              num_key_value_heads=2, n_shared_experts=1, n_routed_experts=4,
                              num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                              q_lora_rank=None, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
                              v_head_dim=4, max_position_embeddings=2 * SEQ)
    return DeepseekV3ForCausalLM(config)


@dataclass(frozen=True)
class Case:
    """An MoE model as a user would train it.

    Attributes:
        build: builds the model (called after ``torch.manual_seed``).
        blocks: the modules ``fully_shard`` is called on before the root.
        batch: ``batch(step, n)`` -> the global batch of ``n`` samples.
        loss: ``loss(model, *batch)`` -> scalar mean loss.
        embeddings: 2-D trainable weights that stay on AdamW.
    """

    build: Callable[[], nn.Module]
    blocks: Callable[[nn.Module], list[nn.Module]]
    batch: Callable[[int, int], tuple[torch.Tensor, ...]]
    loss: Callable[..., torch.Tensor]
    embeddings: tuple[str, ...]


CASES: dict[str, Case] = {
    "hf-qwen3-moe": Case(build=_qwen3_moe, blocks=lambda m: list(m.model.layers), batch=_tokens,
                         loss=_causal_lm_loss, embeddings=("model.embed_tokens.weight",)),
    "hf-mixtral": Case(build=_mixtral, blocks=lambda m: list(m.model.layers), batch=_tokens,
                       loss=_causal_lm_loss, embeddings=("model.embed_tokens.weight",)),
    "hf-deepseek-v3": Case(build=_deepseek_v3, blocks=lambda m: list(m.model.layers), batch=_tokens,
                           loss=_causal_lm_loss, embeddings=("model.embed_tokens.weight",)),
    "list-moe": Case(build=list_moe_net, blocks=lambda m: list(m.blocks), batch=_list_batch, loss=_mse,
                     embeddings=("emb.weight",)),
    "ep-moe": Case(build=ep_moe_net, blocks=lambda m: list(m.blocks), batch=_ep_batch, loss=_mse,
                   embeddings=("emb.weight",)),
    # 2 experts: over ep=2 x efsdp=2 each rank's one local expert leaves an empty FSDP2 shard
    "ep-moe-2": Case(build=lambda: ep_moe_net(experts=2), blocks=lambda m: list(m.blocks), batch=_ep_batch,
                     loss=_mse, embeddings=("emb.weight",)),
}


def build(case: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = CASES[case].build()
    model.train()
    return model


def muon_names(case: str, model: nn.Module) -> list[str]:
    """The reference's Muon parameters: 2-D trainable weights not in ``embeddings``, and the
    3-D expert stacks (by name: ``experts.gate_up_proj`` / ``experts.down_proj``)."""
    skip = set(CASES[case].embeddings)
    return [n for n, p in model.named_parameters() if p.requires_grad and n not in skip
            and (p.ndim == 2 or (p.ndim == 3 and n.rsplit(".", 2)[-2] == "experts"))]


def local_batch(case: str, step: int, rank: int, world_size: int) -> tuple[torch.Tensor, ...]:
    whole = CASES[case].batch(step, LOCAL_BATCH * world_size)
    return tuple(t[rank * LOCAL_BATCH:(rank + 1) * LOCAL_BATCH] for t in whole)


# ------------------------------------------------------------------------------ ranks
def full_params(model: nn.Module, rank: int) -> dict[str, np.ndarray]:
    """Every parameter's full value on rank 0 (``{}`` elsewhere). Collective.

    A dedicated expert stack is assembled from its owners' expert ranges (``rec.experts``,
    over the global experts: under expert parallelism each expert group holds experts
    ``[c * E / ep, (c + 1) * E / ep)``), replica 0's under HSDP; the dense matrices come from
    their owners, FSDP2 parameters are gathered."""
    state = model._dmuon_state
    state.pending.wait_all()  # Muon(overlap=...): the masters are read directly, after their updates
    mine = [(rec.fqn, (rec.experts or (0, 0))[0], rec.master.detach().numpy().copy())
            for rec in state.records if rec.is_owner and state.replicate_rank == 0]
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    pieces: dict[str, dict[int, np.ndarray]] = {}
    for part in parts:
        for fqn, start, value in part:
            pieces.setdefault(fqn, {})[start] = value
    out = {fqn: np.concatenate([ps[k] for k in sorted(ps)]) for fqn, ps in pieces.items()}
    for name, p in model.named_parameters():
        if name not in out and not hasattr(p, "_dmuon_fqn"):
            t = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[name] = t.detach().numpy().copy()
    return out if rank == 0 else {}


def spread_plan(model: nn.Module, predicate, shard_size: int):
    """An owner plan whose expert stacks are spread over every rank of the shard group (each
    expert priced far above any other matrix), so every stack is split into expert ranges
    with different owners: the tiny models' default plan may keep a stack whole on one owner."""
    from dmuon.hooks.dedicate import select_matrices
    from dmuon.owners.plan import build_plan

    selected = select_matrices(model, predicate)
    costs = [1e6 * sel.layout.count if sel.layout.is_stack else 1.0 for sel in selected]
    return build_plan([(sel.fqn, sel.shape) for sel in selected], shard_size, costs=costs, method="greedy",
                      blocks={sel.fqn: sel.blocks for sel in selected})


def apply_checkpointing(case: str, model: nn.Module) -> None:
    """Activation checkpointing as a user turns it on: Hugging Face's own switch for the HF
    models, ``torch.utils.checkpoint`` (non-reentrant) around each block's forward otherwise."""
    if case.startswith("hf-"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    blocks = model.blocks
    for i, block in enumerate(list(blocks)):
        blocks[i] = checkpoint_wrapper(block)


def train(rank: int, world_size: int, *, case: str, steps: int = 3, mesh: str = "fsdp",
          fused_blocks: dict | None = None, spread: bool = True, micro_batches: int = 1,
          checkpointing: bool = False, compile_blocks: bool = False,
          ckpt_path: str | None = None, save_at: int | None = None, resume_at: int | None = None,
          bf16: bool = False) -> dict[str, Any]:
    """``fully_shard`` each block and the root (1-D ``"fsdp"`` or 2 x (world/2) ``"hsdp"``),
    dedicate with the default predicate (and, with ``spread``, :func:`spread_plan`; else the
    default plan), train ``steps`` in fp32 exact mode; return full
    params (rank 0), losses, the dedicated plan entries and how many owners each stack has.
    ``checkpointing``: :func:`apply_checkpointing` before sharding; ``compile_blocks``:
    ``block.compile(backend="aot_eager")`` per block after dedicating, as torchtitan does.
    ``save_at``: ``dcp.save`` :func:`dmuon.checkpoint.state_dict` to ``ckpt_path`` after that
    many steps; ``resume_at``: load ``ckpt_path`` first and train steps ``resume_at..steps``
    (the losses then start at step ``resume_at``). ``bf16``: FSDP2's
    ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` on every block."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon

    model = build(case)
    if checkpointing:
        apply_checkpointing(case, model)
    if mesh == "hsdp":
        device_mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    else:
        device_mesh = init_device_mesh("cpu", (world_size,))
    if mesh != "plain":  # "plain": the module replicated on every rank (DDP-style keep mode)
        from torch.distributed.fsdp import MixedPrecisionPolicy

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
        kwargs = dict(mesh=device_mesh, **({"mp_policy": mp} if mp else {}))
        for block in CASES[case].blocks(model):
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
    predicate = dmuon.default_predicate(model, fused_blocks=fused_blocks)
    plan = spread_plan(model, predicate, world_size // 2 if mesh == "hsdp" else world_size) if spread else None
    plan = dmuon.dedicate_params(model, device_mesh, predicate=predicate, plan=plan, group_cost=0.0)
    opt = dmuon.Muon(model, **OPT_KWARGS)
    if compile_blocks:
        torch._dynamo.reset()
        for block in CASES[case].blocks(model):
            block.compile(backend="aot_eager")
    losses, calls = [], []  # calls: (step, expert module name) that ran on this rank
    first = 0
    if resume_at is not None:
        import torch.distributed.checkpoint as dcp

        sd = dmuon.checkpoint.state_dict(model, opt)
        dcp.load(sd, checkpoint_id=ckpt_path)
        dmuon.checkpoint.load_state_dict(model, opt, sd)
        first = resume_at
    for name, module in model.named_modules():
        if isinstance(module, Expert):
            module.register_forward_hook(lambda m, a, o, name=name: calls.append((len(losses), name)))
    for step in range(first, steps):
        if step == save_at:
            import torch.distributed.checkpoint as dcp

            dcp.save(dmuon.checkpoint.state_dict(model, opt), checkpoint_id=ckpt_path)
        batch = local_batch(case, step, rank, world_size)
        if micro_batches > 1:  # gradient accumulation: dmuon.no_sync on all but the last
            chunks = list(zip(*(t.chunk(micro_batches) for t in batch)))
            total = 0.0
            for k, chunk in enumerate(chunks):
                part = CASES[case].loss(model, *chunk) / micro_batches
                if k < len(chunks) - 1:
                    with dmuon.no_sync(model):
                        part.backward()
                else:
                    part.backward()
                total += part.item()
            loss = torch.tensor(total)
        else:
            loss = CASES[case].loss(model, *batch)
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    owners: dict[str, set] = {}
    for spec in plan.matrices:
        owners.setdefault(spec.fqn, set()).add(spec.owner)
    return dict(params=full_params(model, rank), losses=losses, calls=sorted(set(calls)),
                entries=[spec.key for spec in plan.matrices],
                max_owners_per_param=max((len(v) for v in owners.values()), default=0))


def _bf16_grads(case: str, model: nn.Module, step: int, world_size: int) -> torch.Tensor:
    """FSDP2's mixed precision emulated: each rank's local batch through a bf16 copy of the
    fp32 weights; the bf16 gradients cast to fp32 and averaged over the ranks (a rank where a
    parameter got none adds zero) into ``model``'s ``.grad``. Returns the mean loss."""
    total: dict[str, torch.Tensor] = {}
    losses = []
    for rank in range(world_size):
        low = build(case)
        low.load_state_dict(model.state_dict())
        for p in low.parameters():  # parameters only, as FSDP2 casts (buffers, such as the
            p.data = p.data.to(torch.bfloat16)  # rotary inv_freq, stay fp32)
        loss = CASES[case].loss(low, *local_batch(case, step, rank, world_size))
        loss.backward()
        losses.append(loss.float().item())
        for n, p in low.named_parameters():
            if p.grad is not None:
                g = p.grad.to(torch.float32)
                total[n] = g if n not in total else total[n] + g
    for n, p in model.named_parameters():
        p.grad = total[n] / world_size if n in total else None
    return torch.tensor(sum(losses) / world_size)


def reference(case: str, world_size: int, steps: int = 3, fused_blocks: dict | None = None,
              bf16: bool = False) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Single-process ``torch.optim.Muon`` (fp32 iteration) on every expert's 2-D slice (or
    its row blocks) as a parameter of its own + ``AdamW`` on the rest, on the global batch
    (``bf16``: gradients from :func:`_bf16_grads`, one thread as the pool's ranks use)."""
    threads = torch.get_num_threads()
    if bf16:
        torch.set_num_threads(1)
    try:
        return _reference(case, world_size, steps, fused_blocks, bf16)
    finally:
        torch.set_num_threads(threads)


def _reference(case: str, world_size: int, steps: int, fused_blocks: dict | None,
               bf16: bool) -> tuple[dict[str, torch.Tensor], list[float]]:
    model = build(case)
    names = set(muon_names(case, model))
    fused = fused_blocks or {}
    stacks, mats, views = [], [], []  # views: (stack, index, rows slice, slice parameter)
    for n, p in model.named_parameters():
        if n not in names:
            continue
        k = fused.get(n.rsplit(".", 1)[-1], 1)
        if p.ndim == 2 and k == 1:
            mats.append(p)
            continue
        stacks.append(p)
        stored = p.data.reshape(-1, p.shape[-2], p.shape[-1])
        rows = p.shape[-2] // k
        for e in range(stored.shape[0]):
            for b in range(k):
                piece = nn.Parameter(stored[e, b * rows:(b + 1) * rows].clone())
                views.append((p, e, slice(b * rows, (b + 1) * rows), piece))
                mats.append(piece)
    rest = [p for n, p in model.named_parameters() if n not in names and p.requires_grad]
    muon = torch.optim.Muon(mats, lr=OPT_KWARGS["lr"], weight_decay=OPT_KWARGS["weight_decay"],
                            ns_coefficients=models.MUON_COEFFICIENTS)
    adamw = torch.optim.AdamW(rest, lr=OPT_KWARGS["adamw_lr"], weight_decay=OPT_KWARGS["weight_decay"])
    losses = []
    with models.reference_ns(torch.float32):
        for step in range(steps):
            if bf16:
                loss = _bf16_grads(case, model, step, world_size)
            else:
                loss = CASES[case].loss(model, *CASES[case].batch(step, LOCAL_BATCH * world_size))
                loss.backward()
            for stack, e, rows, piece in views:
                grad = stack.grad
                piece.grad = None if grad is None else grad.reshape(-1, *stack.shape[-2:])[e, rows].clone()
            muon.step()
            adamw.step()
            with torch.no_grad():
                for stack, e, rows, piece in views:
                    stack.data.reshape(-1, *stack.shape[-2:])[e, rows].copy_(piece)
            for opt in (muon, adamw):
                opt.zero_grad()
            for stack in stacks:
                stack.grad = None
            losses.append(loss.item())
    return {n: p.detach().clone() for n, p in model.named_parameters()}, losses


# ------------------------------------------------------------------------------ bad input
class Plain3d(nn.Module):
    """A 3-D parameter whose module declares no expert count (leading dim: not experts)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(4, 6, 8))
        self.fc = nn.Linear(8, 8)


class WithConv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc = nn.Linear(8, 8)


BAD_INPUT = {
    # case: (model, predicate)
    "1d": (lambda: nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)), lambda n, p: True),
    "conv": (WithConv, lambda n, p: p.ndim >= 2),
    "not-experts": (Plain3d, lambda n, p: p.ndim >= 2),
    "bad-blocks": (_qwen3_moe, lambda n, p: 3 if n.endswith("gate_up_proj") else p.ndim == 2),
}


def bad_input(rank: int, world_size: int, *, case: str) -> str:
    """``dedicate_params`` with a bad selection: the error each rank raises (no hang)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon

    torch.manual_seed(0)
    make, predicate = BAD_INPUT[case]
    model = make()
    mesh = init_device_mesh("cpu", (world_size,))
    fully_shard(model, mesh=mesh)
    try:
        dmuon.dedicate_params(model, mesh, predicate=predicate)
    except Exception as e:  # noqa: BLE001 - the test reads the type and message
        return f"{type(e).__name__}: {e}"
    return "no error"


def checkpoint_roundtrip(rank: int, world_size: int, *, case: str = "hf-qwen3-moe") -> bool:
    """Train 2 steps with every expert stack split over the ranks, take ``dmuon.state_dict``
    (copied), train a third step, load the copy, train the third step again: the same
    parameters, bitwise (expert ranges saved under ``fqn[start:stop]`` on their owners)."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon

    model = build(case)
    mesh = init_device_mesh("cpu", (world_size,))
    for block in CASES[case].blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    predicate = dmuon.default_predicate(model)
    dmuon.dedicate_params(model, mesh, predicate=predicate, plan=spread_plan(model, predicate, world_size))
    opt = dmuon.Muon(model, **OPT_KWARGS)

    def step(i: int) -> None:
        CASES[case].loss(model, *local_batch(case, i, rank, world_size)).backward()
        opt.step()
        opt.zero_grad()

    for i in range(2):
        step(i)
    saved = copy.deepcopy(dmuon.state_dict(model, opt))
    assert any("[" in key for key in saved["model"]) or world_size == 1, "no expert range saved"
    step(2)
    first = full_params(model, rank)
    dmuon.load_state_dict(model, opt, saved)
    step(2)
    again = full_params(model, rank)
    return all(np.array_equal(first[k], again[k]) for k in first) and set(first) == set(again)


def meta_init(rank: int, world_size: int, *, case: str) -> dict[str, Any]:
    """The large-model flow on an MoE model: build on meta, ``fully_shard`` each block and the
    root, (``dedicate_params`` with the stacks split over every rank), ``to_empty``, the
    model's own init under a fixed seed; once with FSDP2 alone and once with dmuon. Returns
    both initial full values (rank 0)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon
    from tests.thirdparty_cases import own_init

    mesh = init_device_mesh("cpu", (world_size,))
    initial = {}
    for with_dmuon in (False, True):
        with torch.device("meta"):
            model = CASES[case].build()
        for block in CASES[case].blocks(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if with_dmuon:
            predicate = dmuon.default_predicate(model)
            dmuon.dedicate_params(model, mesh, predicate=predicate, group_cost=0.0,
                                  plan=spread_plan(model, predicate, world_size))
        model.to_empty(device="cpu")
        torch.manual_seed(1)
        own_init(model)
        if with_dmuon:
            dmuon.Muon(model, **OPT_KWARGS)
            initial["dmuon"] = full_params(model, rank)
        else:
            initial["fsdp"] = {n: p.full_tensor().detach().numpy().copy() for n, p in model.named_parameters()}
    return initial if rank == 0 else {}
