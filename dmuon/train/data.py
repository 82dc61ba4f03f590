"""PushT demonstrations for the Pi0-style policy: generation, on-disk cache, batching.

A sample is what a vision-language-action policy sees at one control step of a demonstration:

- ``images``: uint8 [3, S, S], the simulator's rendering (goal in green, T in grey, agent blue);
- ``state``: float32 [2], the agent position, normalized to [-1, 1] (``pixels / 256 - 1``);
- ``tokens``: int64 [L], the fixed instruction tokenized by :func:`tokenize`;
- ``actions``: float32 [H, 2], the next H expert actions (absolute agent targets), normalized
  like ``state``; chunks that run past the episode's end repeat its last action.

The dataset is generated once by :class:`~dmuon.train.expert.ScriptedPushExpert` and cached as
``.npz`` under ``$DMUON_CACHE`` (default ``~/.cache/dmuon``), keyed by a hash of
:class:`DataConfig`, so a second load reads the file instead of running the simulator.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import zlib

import numpy as np
import torch

from dmuon.train.expert import ScriptedPushExpert, make_env

logger = logging.getLogger(__name__)

INSTRUCTION = "push the grey t block onto the green target"
PAD_ID = 0
UNK_ID = 1
_FORMAT_VERSION = 1  # bump when the cached arrays change meaning


def tokenize(text: str, *, vocab_size: int, max_len: int) -> list[int]:
    """Deterministic word-level hashing tokenizer.

    Each lower-cased whitespace-separated word maps to ``2 + crc32(word) % (vocab_size - 2)``
    (ids 0 and 1 are padding and unknown), truncated or right-padded with ``PAD_ID`` to
    ``max_len``. ``crc32`` makes the ids identical across processes and Python versions,
    unlike ``hash()``.

    Args:
        text: The instruction.
        vocab_size: Number of token ids (> 2).
        max_len: Output length.

    Returns:
        ``max_len`` token ids in [0, vocab_size).

    Raises:
        ValueError: If ``vocab_size <= 2`` or ``max_len < 1``.
    """
    if vocab_size <= 2 or max_len < 1:
        raise ValueError(
            f"dmuon.train: tokenize needs vocab_size > 2 and max_len >= 1, "
            f"got vocab_size={vocab_size}, max_len={max_len}."
        )
    ids = [2 + zlib.crc32(w.encode()) % (vocab_size - 2) for w in text.lower().split()]
    ids = ids[:max_len]
    return ids + [PAD_ID] * (max_len - len(ids))


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class DataConfig:
    """Generation parameters; their hash names the cache file.

    Args:
        episodes: Number of demonstrations.
        max_steps: Control steps per demonstration (fewer if the block reaches the goal).
        image_size: Rendered image side in pixels.
        horizon: Action chunk length H.
        seed: Seed of the first episode's initial state (episode i uses seed + i).
        vocab_size: Tokenizer vocabulary size.
        max_tokens: Instruction length L in tokens.
    """

    episodes: int = 48
    max_steps: int = 200
    image_size: int = 48
    horizon: int = 8
    seed: int = 0
    vocab_size: int = 256
    max_tokens: int = 10

    def __post_init__(self) -> None:
        for name in ("episodes", "max_steps", "image_size", "horizon", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"dmuon.train: DataConfig.{name}={getattr(self, name)}; must be >= 1.")

    def digest(self) -> str:
        """Returns a 12-hex-digit hash of the fields and the cache format version."""
        blob = json.dumps({**dataclasses.asdict(self), "v": _FORMAT_VERSION}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def cache_dir() -> pathlib.Path:
    """Returns the cache directory: ``$DMUON_CACHE`` or ``~/.cache/dmuon`` (not created)."""
    env = os.environ.get("DMUON_CACHE")
    return pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "dmuon"


def cache_path(cfg: DataConfig) -> pathlib.Path:
    """Returns the ``.npz`` path that holds the dataset generated with ``cfg``."""
    return cache_dir() / f"pusht_{cfg.digest()}.npz"


def normalize_xy(xy: np.ndarray) -> np.ndarray:
    """Maps simulator pixels [0, 512] to [-1, 1] (float32, same shape)."""
    return (np.asarray(xy, dtype=np.float32) / 256.0 - 1.0).astype(np.float32)


def generate(cfg: DataConfig, *, progress: bool = True) -> dict[str, np.ndarray]:
    """Runs the scripted expert in the simulator and builds the samples.

    Args:
        cfg: Generation parameters.
        progress: Show a tqdm bar over episodes.

    Returns:
        Arrays ``images`` uint8 [N, 3, S, S], ``state`` float32 [N, 2], ``actions`` float32
        [N, H, 2], ``episode`` int32 [N], ``final_coverage`` float32 [episodes].
    """
    from tqdm import tqdm

    env = make_env(cfg.image_size, cfg.max_steps)
    expert = ScriptedPushExpert()
    images, states, chunks, episode_ids, coverages = [], [], [], [], []
    for ep in tqdm(range(cfg.episodes), desc="dmuon: PushT demos", disable=not progress):
        obs, _ = env.reset(seed=cfg.seed + ep)
        expert.reset()
        ep_images, ep_states, ep_actions, coverage = [], [], [], 0.0
        for _ in range(cfg.max_steps):
            action = expert(env.unwrapped)
            ep_images.append(obs["pixels"].transpose(2, 0, 1))
            ep_states.append(obs["agent_pos"])
            ep_actions.append(action)
            obs, _, terminated, truncated, info = env.step(action)
            coverage = float(info["coverage"])
            if terminated or truncated:
                break
        acts = normalize_xy(np.stack(ep_actions))
        n = len(acts)
        idx = np.minimum(np.arange(n)[:, None] + np.arange(cfg.horizon)[None, :], n - 1)
        images.append(np.stack(ep_images).astype(np.uint8))
        states.append(normalize_xy(np.stack(ep_states)))
        chunks.append(acts[idx])
        episode_ids.append(np.full(n, ep, dtype=np.int32))
        coverages.append(coverage)
    env.close()
    return {
        "images": np.concatenate(images),
        "state": np.concatenate(states),
        "actions": np.concatenate(chunks),
        "episode": np.concatenate(episode_ids),
        "final_coverage": np.asarray(coverages, dtype=np.float32),
    }


def ensure_cached(cfg: DataConfig, *, progress: bool = True) -> pathlib.Path:
    """Generates the dataset unless its cache file exists; returns the file's path.

    The file is written to a temporary name and renamed, so a concurrent reader never sees a
    partial file. In a multi-rank run only rank 0 calls this; the others wait on a barrier.
    """
    path = cache_path(cfg)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = generate(cfg, progress=progress)
    tmp = path.with_suffix(f".tmp{os.getpid()}.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, path)
    logger.info(
        "dmuon.train: cached %d samples (%d episodes, expert mean final coverage %.3f) at %s",
        len(arrays["state"]), cfg.episodes, float(arrays["final_coverage"].mean()), path,
    )
    return path


class PushTDemos:
    """The cached demonstrations as tensors, with deterministic global batches.

    Args:
        cfg: Generation parameters of the cache file to load.

    Raises:
        RuntimeError: If the cache file does not exist (call :func:`ensure_cached` first).
    """

    def __init__(self, cfg: DataConfig) -> None:
        path = cache_path(cfg)
        if not path.exists():
            raise RuntimeError(
                f"dmuon.train: no cached PushT dataset at {path}; call ensure_cached(cfg) "
                "(rank 0) before loading."
            )
        with np.load(path) as f:
            self.images = torch.from_numpy(f["images"])
            self.state = torch.from_numpy(f["state"])
            self.actions = torch.from_numpy(f["actions"])
            self.final_coverage = torch.from_numpy(f["final_coverage"])
        self.cfg = cfg
        self.tokens = torch.tensor(
            tokenize(INSTRUCTION, vocab_size=cfg.vocab_size, max_len=cfg.max_tokens), dtype=torch.long
        )

    def __len__(self) -> int:
        return int(self.state.shape[0])

    def batch(self, step: int, global_batch: int, rank: int, world_size: int, seed: int) -> dict[str, torch.Tensor]:
        """Returns this rank's slice of the global batch of ``step``.

        The global batch (sample indices, flow-matching noise and times) depends only on
        ``(seed, step, global_batch)``, so every world size trains on the same data; rank r gets
        rows ``[r * B / W, (r + 1) * B / W)``.

        Args:
            step: Training step (>= 0).
            global_batch: Samples per step across all ranks, divisible by ``world_size``.
            rank: This rank in [0, world_size).
            world_size: Number of data-parallel ranks.
            seed: Run seed.

        Returns:
            ``images`` float32 [b, 3, S, S] in [0, 1], ``state`` float32 [b, 2], ``tokens`` int64
            [b, L], ``actions`` float32 [b, H, 2], ``noise`` float32 [b, H, 2], ``time`` float32
            [b] in (0, 1], with ``b = global_batch / world_size``.

        Raises:
            ValueError: If ``global_batch`` is not divisible by ``world_size``.
        """
        if global_batch % world_size:
            raise ValueError(
                f"dmuon.train: global batch {global_batch} is not divisible by world size "
                f"{world_size}; pick --batch-size as a multiple of {world_size}."
            )
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        idx = torch.randint(len(self), (global_batch,), generator=gen)
        noise = torch.randn(global_batch, self.cfg.horizon, 2, generator=gen)
        # Pi0's time distribution: Beta(1.5, 1) stretched to [0.001, 1], favouring noisy t.
        u = torch.rand(global_batch, generator=gen)
        time = u.pow(1.0 / 1.5) * 0.999 + 0.001  # inverse CDF of Beta(1.5, 1) is u^(1/1.5)
        b = global_batch // world_size
        rows = slice(rank * b, (rank + 1) * b)
        sel = idx[rows]
        return {
            "images": self.images[sel].float().div_(255.0),
            "state": self.state[sel],
            "tokens": self.tokens.expand(b, -1).clone(),
            "actions": self.actions[sel],
            "noise": noise[rows],
            "time": time[rows],
        }
