"""Checkpoints of the main job (``--save DIR``) and loading a policy for rollout.

A checkpoint is one DCP directory per save, ``DIR/step_NNNNNN``, holding

* the DCP state ``{"model": {fqn: ...}, "optim": {...}}``: :func:`dmuon.state_dict` under
  ``--optimizer dmuon`` (dedicated masters written by their owners), otherwise the FSDP2
  ``model.state_dict()`` (DTensor shards) and ``get_optimizer_state_dict``;
* ``dmuon_train.json`` (written by rank 0): the step and the :class:`~dmuon.train.loop.TrainConfig`
  fields, so a rollout rebuilds the same :class:`~dmuon.train.model.PolicyConfig` and knows the
  demonstrations' seeds.

Keys are fully qualified parameter names, so :func:`load_policy` reads the ``"model"`` section
into a plain (unsharded) :class:`Pi0Policy` on any number of ranks or in one process; DCP
assembles each FSDP2 shard and owner's master into the full tensor.
"""

from __future__ import annotations

import json
import logging
import pathlib
import re
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from dmuon.train.data import DataConfig
from dmuon.train.model import Pi0Policy, PolicyConfig

logger = logging.getLogger(__name__)

CONFIG_FILE = "dmuon_train.json"
_STEP_DIR = re.compile(r"step_(\d+)")


def step_dir(root: str | pathlib.Path, step: int) -> pathlib.Path:
    """Returns ``root/step_NNNNNN``, the directory of the checkpoint after ``step`` steps."""
    return pathlib.Path(root) / f"step_{step:06d}"


def save_checkpoint(root: str | pathlib.Path, step: int, model: nn.Module, opt: torch.optim.Optimizer,
                    optimizer_name: str, config: dict) -> pathlib.Path:
    """Writes the model and optimizer state after ``step`` steps (collective: every rank calls it).

    Args:
        root: The ``--save`` directory; the checkpoint goes to ``root/step_NNNNNN``.
        step: Optimizer steps taken so far.
        model: The FSDP2-sharded policy.
        opt: Its optimizer (``dmuon.Muon``, ``VanillaMuon`` or ``torch.optim.AdamW``).
        optimizer_name: ``"dmuon"``, ``"vanilla"`` or ``"adamw"``.
        config: ``dataclasses.asdict(TrainConfig)``, written to ``dmuon_train.json`` by rank 0.

    Returns:
        The checkpoint directory.
    """
    path = step_dir(root, step)
    if optimizer_name == "dmuon":
        import dmuon

        sd = dmuon.state_dict(model, opt)
    else:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        sd = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}
    dcp.save(sd, checkpoint_id=str(path))
    if not dist.is_initialized() or dist.get_rank() == 0:
        (path / CONFIG_FILE).write_text(json.dumps({"step": step, "config": config}, indent=1))
    if dist.is_initialized():
        dist.barrier()  # the config file exists before any rank reads the checkpoint
    return path


def resolve(path: str | pathlib.Path) -> pathlib.Path:
    """The checkpoint directory ``path`` names: itself, or its latest ``step_NNNNNN`` child.

    Raises:
        ValueError: If ``path`` is neither a DCP checkpoint (no ``.metadata``) nor holds one.
    """
    path = pathlib.Path(path)
    if (path / ".metadata").exists():
        return path
    steps = sorted((int(m.group(1)), p) for p in path.glob("step_*")
                   if (m := _STEP_DIR.fullmatch(p.name)) and (p / ".metadata").exists())
    if not steps:
        raise ValueError(f"dmuon.train: {str(path)!r} is not a DCP checkpoint (no .metadata) and holds "
                         "no step_NNNNNN checkpoint; pass a directory written by --save")
    return steps[-1][1]


def read_config(path: pathlib.Path) -> dict | None:
    """The ``dmuon_train.json`` of a checkpoint directory, or ``None`` if it has none."""
    f = pathlib.Path(path) / CONFIG_FILE
    return json.loads(f.read_text()) if f.exists() else None


def configs_from(meta: dict | None) -> tuple[PolicyConfig, DataConfig]:
    """The policy and data configs recorded in a checkpoint's config (defaults if ``None``)."""
    if meta is None:
        return PolicyConfig(), DataConfig()
    cfg = meta["config"]
    return PolicyConfig(**cfg["model"]), DataConfig(**cfg["data"])


def check_model_keys(path: pathlib.Path, model: nn.Module) -> None:
    """Compares a checkpoint's ``"model"`` entries with ``model``'s state dict before loading.

    Raises:
        ValueError: Naming the keys the checkpoint lacks, the ones ``model`` lacks and the
            shapes that differ (a checkpoint of another model or config).
    """
    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    saved = {k[len("model."):]: tuple(v.size) for k, v in meta.items()
             if k.startswith("model.") and hasattr(v, "size")}
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = sorted(set(want) - set(saved))
    unexpected = sorted(set(saved) - set(want))
    shapes = sorted(f"{k}: checkpoint {saved[k]} vs model {want[k]}"
                    for k in set(want) & set(saved) if saved[k] != want[k])
    if missing or unexpected or shapes:
        def few(xs: list[str]) -> str:
            return f"{xs[:6]}{' ...' if len(xs) > 6 else ''} ({len(xs)})"

        raise ValueError(
            f"dmuon.train: the checkpoint {str(path)!r} does not match {type(model).__name__}"
            f"({getattr(model, 'cfg', '')}): missing in the checkpoint {few(missing)}, not in the "
            f"model {few(unexpected)}, shape mismatches {few(shapes)}. Load it with the model "
            f"config it was trained with (its {CONFIG_FILE}), or pick the right directory."
        )


def load_policy(path: str | pathlib.Path, model_cfg: PolicyConfig | None = None) -> tuple[Pi0Policy, dict | None]:
    """Loads a checkpoint's weights into a plain (unsharded) policy on this process.

    Works in one process (no process group) and on any number of ranks (every rank reads the
    full tensors; collective when a process group is initialized).

    Args:
        path: A checkpoint directory or a ``--save`` root (its latest step is used).
        model_cfg: The policy sizes; ``None`` reads them from the checkpoint's
            ``dmuon_train.json`` (the default :class:`PolicyConfig` if it has none).

    Returns:
        ``(policy in eval mode, float32, CPU; the checkpoint's config dict or None)``.

    Raises:
        ValueError: If ``path`` holds no checkpoint or its keys/shapes do not match the policy.
    """
    path = resolve(path)
    meta = read_config(path)
    if model_cfg is None:
        model_cfg = configs_from(meta)[0]
    model = Pi0Policy(model_cfg)
    check_model_keys(path, model)
    sd = {"model": model.state_dict()}
    with warnings.catch_warnings():  # DCP warns that it loads in one process: that is the intent
        if not dist.is_initialized():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(sd, checkpoint_id=str(path))
    model.load_state_dict(sd["model"])
    return model.eval(), meta

