"""Launch configs of the Triton symmetric-product kernel, tuned offline by
``bench/tune_kernels.py`` into ``configs/launch_configs.json``: per GPU name an ordered list of
buckets, the first whose ``max_m``/``max_k`` (``null``: unbounded) hold the output side ``m`` and
reduction length ``k`` wins; other GPUs use ``"default"``, CPU (``TRITON_INTERPRET=1``)
``"interpreter"``. No autotuning, so every rank launches the same config.

Schema (version 1)::

    {"schema": 1,
     "default":     {"min_rows_for_triton": 256, "buckets": [BUCKET, ...]},
     "interpreter": {...same...},
     "gpus": {"NVIDIA H100 80GB HBM3": {...same...}}}
    BUCKET = {"max_m": int|null, "max_k": int|null, "block": 64, "block_k": 64,
              "num_warps": 4, "num_stages": 3}
"""

from __future__ import annotations

import dataclasses
import functools
import json
from importlib import resources
from pathlib import Path
from typing import Any, NamedTuple, Optional

import torch

__all__ = ["LaunchConfig", "LaunchTable", "load_launch_table", "lookup_launch_config",
           "min_rows_for_triton"]

_TABLE_FILE = "launch_configs.json"
_SCHEMA = 1


def _is_pow2(v: int) -> bool:
    return v > 0 and (v & (v - 1)) == 0


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LaunchConfig:
    """One launch config of :func:`dmuon.kernels.triton_syrk.triton_sym_mm`.

    Attributes:
        block: output tile side (rows = cols, so tiles mirror onto tiles), power of 2 >= 16.
        block_k: reduction tile length, power of 2 >= 16.
        num_warps: warps per program (power of 2, 1..16).
        num_stages: software-pipelining stages (>= 1).
    """

    block: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block", "block_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 16 or not _is_pow2(value):
                raise ValueError(f"dmuon: LaunchConfig.{name} must be a power of 2 >= 16; "
                                 f"got {value!r}.")
        warps = self.num_warps
        if not isinstance(warps, int) or not _is_pow2(warps) or warps > 16:
            raise ValueError(f"dmuon: LaunchConfig.num_warps must be 1, 2, 4, 8 or 16; got {warps!r}.")
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"dmuon: LaunchConfig.num_stages must be an int >= 1; "
                             f"got {self.num_stages!r}.")


class _Bucket(NamedTuple):
    max_m: Optional[int]
    max_k: Optional[int]
    config: LaunchConfig

    def matches(self, m: int, k: int) -> bool:
        return (self.max_m is None or m <= self.max_m) and (self.max_k is None or k <= self.max_k)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _DeviceEntry:
    min_rows_for_triton: int
    buckets: tuple[_Bucket, ...]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LaunchTable:
    """The parsed launch-config table: ``default`` (unlisted GPUs), ``interpreter`` (CPU under
    ``TRITON_INTERPRET=1``), ``gpus`` (``(exact GPU name, entry)`` pairs)."""

    default: _DeviceEntry
    interpreter: _DeviceEntry
    gpus: tuple[tuple[str, _DeviceEntry], ...]

    def entry(self, device: torch.device) -> _DeviceEntry:
        if device.type != "cuda":
            return self.interpreter
        name = torch.cuda.get_device_name(device)
        return next((entry for gpu, entry in self.gpus if gpu == name), self.default)


def _parse_entry(raw: Any, where: str) -> _DeviceEntry:
    if not isinstance(raw, dict) or not isinstance(raw.get("buckets"), list) or not raw["buckets"]:
        raise ValueError(f"dmuon: launch table entry {where} needs a non-empty 'buckets' list; "
                         f"got {raw!r}.")
    buckets = []
    for i, b in enumerate(raw["buckets"]):
        try:
            config = LaunchConfig(block=b["block"], block_k=b["block_k"], num_warps=b["num_warps"],
                                  num_stages=b["num_stages"])
            buckets.append(_Bucket(b.get("max_m"), b.get("max_k"), config))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"dmuon: launch table {where} bucket {i} is malformed ({exc}): "
                             f"{b!r}.") from exc
    if buckets[-1].max_m is not None or buckets[-1].max_k is not None:
        raise ValueError(f"dmuon: the last bucket of launch table entry {where} must be unbounded "
                         f"(max_m = max_k = null).")
    return _DeviceEntry(min_rows_for_triton=int(raw.get("min_rows_for_triton", 256)),
                        buckets=tuple(buckets))


@functools.lru_cache(maxsize=4)
def load_launch_table(path: Optional[str] = None) -> LaunchTable:
    """Load, validate and parse the launch table from the JSON file ``path`` (``None``: the one
    shipped in ``dmuon/kernels/configs/``); cached. ``ValueError`` names a wrong schema or a
    malformed entry; ``FileNotFoundError`` if ``path`` does not exist."""
    if path is None:
        text = resources.files("dmuon.kernels").joinpath("configs", _TABLE_FILE).read_text()
    else:
        text = Path(path).read_text()
    raw = json.loads(text)
    if not isinstance(raw, dict) or raw.get("schema") != _SCHEMA:
        raise ValueError(f"dmuon: launch table must be a dict with schema {_SCHEMA}; got schema "
                         f"{raw.get('schema') if isinstance(raw, dict) else raw!r}.")
    gpus = tuple((str(name), _parse_entry(e, f"gpus[{name!r}]"))
                 for name, e in raw.get("gpus", {}).items())
    return LaunchTable(default=_parse_entry(raw["default"], "default"),
                       interpreter=_parse_entry(raw["interpreter"], "interpreter"), gpus=gpus)


def lookup_launch_config(device: torch.device, m: int, k: int,
                         table: Optional[LaunchTable] = None) -> LaunchConfig:
    """Launch config for an ``[m, k] @ [k, m]`` symmetric product on ``device`` (``cuda``, or
    ``cpu`` under the interpreter), from ``table`` (``None``: the shipped one)."""
    buckets = (table or load_launch_table()).entry(device).buckets
    return next(b.config for b in buckets if b.matches(m, k))  # the last one is unbounded


def min_rows_for_triton(device: torch.device) -> int:
    """Smallest ``m`` (rows after orienting ``m <= n``) for which ``backend="auto"`` picks Triton."""
    return load_launch_table().entry(device).min_rows_for_triton
