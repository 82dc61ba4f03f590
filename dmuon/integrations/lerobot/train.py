"""LeRobot training with dmuon under FSDP2: ``torchrun ... -m dmuon.integrations.lerobot.train``
with ``lerobot-train``'s arguments plus ``--dmuon.*`` (docs/integrations.md).

LeRobot's own parser, factories, processors, scheduler, clipping and checkpoint layout, with
the policy sharded and dedicated, :class:`dmuon.Muon` (AdamW at LeRobot's ``optimizer.*`` for
the non-matrices), the optimizer state and every rank's RNG in ``training_state/dmuon``, and
global batch ``k`` a function of ``(seed, k)``, so a resumed run continues exactly.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

import dmuon
from dmuon.integrations import lerobot as dl

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class DmuonArgs:
    """The ``--dmuon.*`` command-line options.

    Attributes:
        lr, momentum: :class:`dmuon.Muon`'s, for the matrices.
        param_dtype: ``"float32"`` or ``"bfloat16"`` (FSDP2 ``MixedPrecisionPolicy`` on the
            units: bf16 compute, fp32 outputs and reduction; the root stays fp32).
        solver: ``"auto"``, ``"greedy"`` or ``"milp"``; plan: an owner-plan JSON.
        metrics: a JSON file rank 0 writes the per-step records to.
        ns_method, ns_coefficients, ns_dtype, overlap: :class:`dmuon.Muon`'s.
    """

    lr: float = 0.02
    momentum: float = 0.95
    param_dtype: str = "float32"
    solver: str = "auto"
    plan: str | None = None
    metrics: str | None = None
    ns_method: str = "gram"
    ns_coefficients: str = "polar_express"
    ns_dtype: str = "auto"
    overlap: str = "off"

    def __post_init__(self) -> None:
        for name, allowed in (("param_dtype", ("float32", "bfloat16")),
                              ("solver", ("auto", "greedy", "milp")),
                              ("overlap", ("off", "forward", "backward"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"dmuon: --dmuon.{name}={getattr(self, name)!r}; "
                                 f"use {', '.join(allowed[:-1])} or {allowed[-1]}")


def split_argv(argv: list[str]) -> tuple[list[str], DmuonArgs]:
    """LeRobot's arguments and the ``--dmuon.<field>=<value>`` ones, parsed.

    Raises:
        ValueError: an unknown ``--dmuon.`` field or a value without ``=``.
    """
    fields = {f.name: f for f in dataclasses.fields(DmuonArgs)}
    rest, values = [], {}
    for arg in argv:
        if not arg.startswith("--dmuon."):
            rest.append(arg)
            continue
        key, sep, value = arg[len("--dmuon."):].partition("=")
        if not sep or key not in fields:
            raise ValueError(f"dmuon: unknown or valueless option {arg!r}; known: "
                             f"{', '.join('--dmuon.' + k + '=...' for k in fields)}")
        kind = fields[key].type
        values[key] = float(value) if kind == "float" else (None if value == "none" else value)
    return rest, DmuonArgs(**values)


def _init_distributed(device: str) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    if device.startswith("cuda"):
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    return init_device_mesh("cuda" if device.startswith("cuda") else "cpu", (dist.get_world_size(),))


def batches(dataset: Any, batch_size: int, seed: int, start_step: int, rank: int,
            world_size: int, num_workers: int = 0) -> Iterator[dict[str, Any]]:
    """Rank ``rank``'s ``batch_size`` samples of global batch ``k = start_step, ...``: epoch ``e``
    shuffles the frames with ``Generator(seed + e)`` and deals ``batch_size * world_size`` per
    global batch (dropping an epoch's tail)."""
    from lerobot.utils.collate import lerobot_collate_fn

    n, per_step = len(dataset), batch_size * world_size
    steps_per_epoch = n // per_step
    if steps_per_epoch == 0:
        raise ValueError(f"dmuon: the dataset has {n} frames, fewer than one global batch "
                         f"({batch_size} x {world_size} ranks); lower --batch_size")

    def indices() -> Iterator[list[int]]:
        k = start_step
        while True:
            epoch, i = divmod(k, steps_per_epoch)
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
            lo = i * per_step + rank * batch_size
            yield perm[lo:lo + batch_size].tolist()
            k += 1

    # its own generator: a DataLoader iterator draws its base seed from the global RNG
    # otherwise, which a resumed run (iterator made after the RNG restore) would then replay
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=indices(), num_workers=num_workers,
                                         collate_fn=lerobot_collate_fn,
                                         generator=torch.Generator().manual_seed(seed))
    yield from loader


def _state_paths(checkpoint_dir: Path, rank: int) -> tuple[Path, Path]:
    ts = checkpoint_dir / "training_state"
    return ts / "dmuon", ts / f"dmuon_rng_rank{rank}.pt"


def save(checkpoint_dir: Path, step: int, cfg: Any, policy: Any, opt: Any, scheduler: Any,
         preprocessor: Any, postprocessor: Any) -> None:
    """LeRobot's checkpoint layout, collective: rank 0 writes ``pretrained_model/`` (full
    weights, configs, processors) and LeRobot's ``training_state``; every rank its part of the
    DCP optimizer state and its RNG."""
    import torch.distributed.checkpoint as dcp
    from lerobot.common.train_utils import save_training_state
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True,
                                                                 cpu_offload=True))
    rank = dist.get_rank()
    if rank == 0:
        pretrained = checkpoint_dir / "pretrained_model"
        # one storage per tensor: safetensors refuses views (a row of FSDP2's gathered
        # padding buffer for an Embedding of one row)
        full = {k: v.clone() for k, v in full.items()}
        policy.save_pretrained(pretrained, state_dict=full)
        cfg.save_pretrained(pretrained)
        preprocessor.save_pretrained(pretrained)
        postprocessor.save_pretrained(pretrained)
        save_training_state(checkpoint_dir, step, None, scheduler,
                            num_processes=dist.get_world_size(), batch_size=cfg.batch_size)
    dist.barrier()
    dcp_dir, rng_file = _state_paths(checkpoint_dir, rank)
    dcp.save(dmuon.state_dict(policy, opt), checkpoint_id=str(dcp_dir))
    torch.save(torch.get_rng_state(), rng_file)
    dist.barrier()


def resume(checkpoint_dir: Path, policy: Any, opt: Any, scheduler: Any) -> int:
    """Restore the step, scheduler, optimizer, model and this rank's RNG saved by :func:`save`."""
    from lerobot.common.train_utils import load_training_state

    step, _, _ = load_training_state(checkpoint_dir, None, scheduler, load_optimizer=False)
    dcp_dir, rng_file = _state_paths(checkpoint_dir, dist.get_rank())
    dmuon.load(policy, opt, str(dcp_dir))
    torch.set_rng_state(torch.load(rng_file))
    return step


def _build_optimizer(cfg: Any, policy: Any, mesh: Any, args: DmuonArgs) -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if getattr(cfg.policy, "dtype", "float32") != "float32":
        raise ValueError(
            f"dmuon: --policy.dtype={cfg.policy.dtype} keeps some of {cfg.policy.type}'s "
            f"parameters in fp32 (FSDP2 needs one dtype); pass --policy.dtype=float32 "
            f"--dmuon.param_dtype=bfloat16 (FSDP2 MixedPrecisionPolicy) instead")
    plan = args.plan
    if plan is None and args.solver != "auto":
        pick = dl.predicate(policy)
        plan = dmuon.build_plan([(n, tuple(p.shape)) for n, p in policy.named_parameters()
                                 if pick(n, p)], mesh.size(), method=args.solver)
    kwargs: dict[str, Any] = {}
    if args.param_dtype == "bfloat16":
        # bf16 units with fp32 outputs and a fp32 root: LeRobot mixes the units' outputs with
        # fp32 tensors it makes itself (the flow-matching noise, masks)
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.float32,
                                                   output_dtype=torch.float32)
    dl.fully_shard_policy(policy, mesh, root_kwargs={}, **kwargs)
    dmuon.dedicate_params(policy, mesh, predicate=dl.predicate(policy), plan=plan)
    o = cfg.optimizer
    ns_dtype = None if args.ns_dtype == "auto" else getattr(torch, args.ns_dtype)
    return dmuon.Muon(policy, lr=args.lr, momentum=args.momentum,
                      weight_decay=o.weight_decay, adamw_lr=o.lr,
                      adamw_betas=tuple(o.betas), adamw_eps=o.eps, ns_method=args.ns_method,
                      ns_coefficients=args.ns_coefficients, ns_dtype=ns_dtype, overlap=args.overlap)


def run(cfg: Any, args: DmuonArgs) -> list[dict[str, float]]:
    """Train ``cfg`` (a validated LeRobot ``TrainPipelineConfig``) with dmuon; collective.

    Returns:
        The per-step records ``{"step", "loss", "grad_norm", "lr"}`` (loss: mean over ranks).
    """
    from lerobot.common.train_utils import get_step_checkpoint_dir, update_last_checkpoint
    from lerobot.datasets.factory import make_train_eval_datasets
    from lerobot.policies import make_policy, make_pre_post_processors
    from lerobot.utils.random_utils import set_seed

    mesh = _init_distributed(cfg.policy.device or "cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cfg.seed is not None:
        set_seed(cfg.seed)  # the same initial weights on every rank
    dataset, _ = make_train_eval_datasets(cfg)
    policy = make_policy(cfg=cfg.policy, ds_meta=dataset.meta, rename_map=cfg.rename_map)
    processor_kwargs = {} if cfg.resume else {"dataset_stats": dataset.meta.stats}
    preprocessor, postprocessor = make_pre_post_processors(
        policy_cfg=cfg.policy, pretrained_path=cfg.policy.pretrained_path, **processor_kwargs)
    policy.train()
    opt = _build_optimizer(cfg, policy, mesh, args)
    scheduler = cfg.scheduler.build(opt, cfg.steps) if cfg.scheduler is not None else None
    step = 0
    if cfg.resume:
        step = resume(Path(cfg.checkpoint_path), policy, opt, scheduler)
    clip = cfg.optimizer.grad_clip_norm
    records: list[dict[str, float]] = []
    data = batches(dataset, cfg.batch_size, cfg.seed or 0, step, rank, world, cfg.num_workers)
    t0 = time.perf_counter()
    while step < cfg.steps:
        batch = preprocessor(next(data))
        loss, _ = policy(batch)  # __call__: FSDP2's and dmuon's hooks run
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), clip) if clip else torch.tensor(0.0)
        opt.step()
        opt.zero_grad()
        lr = opt.param_groups[0]["lr"]
        if scheduler is not None:
            scheduler.step()
        step += 1
        mean = loss.detach().double().cpu()
        dist.all_reduce(mean)
        records.append(dict(step=step, loss=float(mean) / world, grad_norm=float(norm), lr=lr,
                            **{f"speculation_{k}": v for k, v in opt.overlap_stats().items()}))
        if rank == 0 and (step % max(cfg.log_freq, 1) == 0 or step == cfg.steps):
            log.info("step %d loss %.5f grad_norm %.4f lr %.3g (%.1fs)", step,
                     records[-1]["loss"], records[-1]["grad_norm"], lr, time.perf_counter() - t0)
        if cfg.save_checkpoint and (step % cfg.save_freq == 0 or step == cfg.steps):
            ckpt = get_step_checkpoint_dir(Path(cfg.output_dir), cfg.steps, step)
            save(ckpt, step, cfg, policy, opt, scheduler, preprocessor, postprocessor)
            if rank == 0:
                update_last_checkpoint(ckpt)
    if rank == 0 and args.metrics:
        Path(args.metrics).write_text(json.dumps(records, indent=1))
    return records


def main(argv: list[str] | None = None, runner: Any = None) -> Any:
    """``lerobot-train``'s command line plus ``--dmuon.*``, parsed by LeRobot's parser, then
    ``runner(cfg, dmuon_args)`` (default :func:`run`) on the validated config."""
    from lerobot.configs import parser
    from lerobot.configs.train import TrainPipelineConfig
    from lerobot.scripts import lerobot_train  # noqa: F401 - registers the config choices it knows
    from lerobot.utils.import_utils import register_third_party_plugins

    rest, args = split_argv(list(sys.argv[1:] if argv is None else argv))
    out: list[list[dict[str, float]]] = []

    def _train(cfg: TrainPipelineConfig) -> None:
        cfg.validate()
        out.append((runner or run)(cfg, args))

    # LeRobot's parser reads the config class off the annotation (a string under
    # `from __future__ import annotations`)
    _train.__annotations__ = {"cfg": TrainPipelineConfig, "return": None}
    _train = parser.wrap()(_train)

    register_third_party_plugins()
    saved = sys.argv
    sys.argv = [saved[0], *rest]
    try:
        _train()
    finally:
        sys.argv = saved
    return out[0]


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    main()
