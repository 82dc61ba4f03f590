"""PushT demonstrations for the Pi0-style policy: generation, on-disk cache, batching.

A sample is what a vision-language-action policy sees at one control step of a demonstration:

- ``images`` (``obs="image"``): uint8 [3, S, S], the simulator's rendering (goal in green, T in
  grey, agent blue), S = 96 by default as in Diffusion Policy and LeRobot;
- ``env_state`` (``obs="state"``): float32 [history, F], :func:`state_features` of the last
  ``history`` observations (oldest first; the first observation repeats at an episode's start),
  from gym-pusht's ``environment_state_agent_pos`` observation (the T's 8 keypoints and the
  agent position);
- ``state``: float32 [2], the agent position, normalized to [-1, 1] (``pixels / 256 - 1``);
- ``tokens``: int64 [L], the fixed instruction tokenized by :func:`tokenize`;
- ``actions``: float32 [H, 2], the next H expert actions (agent targets); chunks that run past
  the episode's end repeat its last action. ``action_mode="absolute"`` normalizes them like
  ``state``; ``"delta"`` gives ``(target - agent position now) / DELTA_PX`` (pixels / pixels).

Demonstrations run gym-pusht's 300-step episodes (its registered ``max_episode_steps``, and
LeRobot's evaluation length); only successful ones are kept (``keep_failed=False``), and the
cache records every episode's success. The demonstrations are generated once by
:class:`~dmuon.train.expert.ScriptedPushExpert` and cached as ``.npz`` in :func:`cache_dir`
(``DataConfig.cache_dir``, ``--cache-dir``, else ``$DMUON_CACHE_DIR``, else
``~/.cache/dmuon``), keyed by a hash of the generation fields of :class:`DataConfig` and
``_FORMAT_VERSION``, so a second load reads the file and an old cache is never read by new
code. The file holds no images: the frames a run draws are rendered on demand and cached per
image size beside it (:mod:`dmuon.train.frames`; :func:`ensure_run_data` does both).
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
from dmuon.train.frames import ensure_frames, frames_path, load_frames

logger = logging.getLogger(__name__)

INSTRUCTION = "push the grey t block onto the green target"
PAD_ID = 0
UNK_ID = 1
# bump when the cached arrays change meaning (2: 300 steps, keypoints, success; 3: no images,
# one file for both observation kinds, frames rendered per run in dmuon.train.frames)
_FORMAT_VERSION = 3
DELTA_PX = 32.0  # pixels per unit of a delta action: the expert's pushes lead by <= 30 px
STATE_FEATURES = 28  # :func:`state_features`' output width
# gym-pusht's fixed goal pose (PushTEnv._setup): x, y in pixels, angle in radians
GOAL_POSE = (256.0, 256.0, np.pi / 4)
OBS_KINDS = ("image", "state")
ACTION_MODES = ("absolute", "delta")


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
    """Generation and sample parameters; the generation fields' hash names the cache file.

    Args:
        episodes: Demonstrations run (the failed ones are dropped unless ``keep_failed``).
        max_steps: Control steps per demonstration at most (it ends when the block is on goal).
        obs: ``"image"`` (rendered frames, Pi0-style) or ``"state"`` (keypoints and agent).
        image_size: Rendered image side in pixels (``obs="image"``; ignored for ``"state"``).
        horizon: Action chunk length H.
        seed: Seed of the first episode's initial state (episode i uses seed + i).
        vocab_size: Tokenizer vocabulary size.
        max_tokens: Instruction length L in tokens.
        history: Observations per sample for ``obs="state"`` (1: the current one only).
        action_mode: ``"absolute"`` or ``"delta"`` targets (module docstring).
        keep_failed: Keep demonstrations that did not reach the goal.
        cache_dir: Directory of the cache files; ``None``: :func:`cache_dir`'s default. Not a
            generation field (the files' names do not depend on it).
    """

    episodes: int = 200
    max_steps: int = 300
    obs: str = "image"
    image_size: int = 96
    horizon: int = 8
    seed: int = 0
    vocab_size: int = 256
    max_tokens: int = 10
    history: int = 1
    action_mode: str = "absolute"
    keep_failed: bool = False
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        for name in ("episodes", "max_steps", "image_size", "horizon", "max_tokens", "history"):
            if getattr(self, name) < 1:
                raise ValueError(f"dmuon.train: DataConfig.{name}={getattr(self, name)}; must be >= 1.")
        if self.obs not in OBS_KINDS:
            raise ValueError(f"dmuon.train: DataConfig.obs={self.obs!r}; choose one of {OBS_KINDS}.")
        if self.action_mode not in ACTION_MODES:
            raise ValueError(f"dmuon.train: DataConfig.action_mode={self.action_mode!r}; choose one of {ACTION_MODES}.")
        if self.history > 1 and self.obs != "state":
            raise ValueError(f"dmuon.train: DataConfig.history={self.history} needs obs='state' (images carry one frame).")

    def digest(self) -> str:
        """Returns a 12-hex-digit hash of the generation fields and the cache format version.

        The observation kind and image size are not among them: both kinds train on the same
        demonstrations, and frames are cached per size (:mod:`dmuon.train.frames`)."""
        fields = {k: getattr(self, k) for k in ("episodes", "max_steps", "horizon", "seed", "keep_failed")}
        blob = json.dumps({**fields, "v": _FORMAT_VERSION}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def cache_dir(cfg: DataConfig | None = None) -> pathlib.Path:
    """Returns the cache directory (not created): ``cfg.cache_dir`` if set, else
    ``$DMUON_CACHE_DIR``, else ``$DMUON_CACHE`` (its older name), else ``~/.cache/dmuon``.

    The one place dmuon reads these variables."""
    if cfg is not None and cfg.cache_dir:
        return pathlib.Path(cfg.cache_dir).expanduser()
    env = os.environ.get("DMUON_CACHE_DIR") or os.environ.get("DMUON_CACHE")
    return pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "dmuon"


def cache_path(cfg: DataConfig) -> pathlib.Path:
    """Returns the ``.npz`` path that holds the demonstrations generated with ``cfg``."""
    return cache_dir(cfg) / f"pusht_{cfg.digest()}.npz"


def drawn_rows(n: int, steps: int, global_batch: int, seed: int) -> np.ndarray:
    """The sample rows that :meth:`PushTDemos.batch` draws over ``steps`` steps, on all ranks.

    Args:
        n: Samples in the demonstrations (``len(PushTDemos)``).
        steps: Steps of the run (batches 0 .. steps - 1).
        global_batch: Samples per step over all ranks.
        seed: Run seed.

    Returns:
        int64 [M], sorted unique rows in [0, n).
    """
    return np.unique(np.concatenate([_draw(n, step, global_batch, seed)[0].numpy() for step in range(steps)]))


def _draw(n: int, step: int, global_batch: int, seed: int) -> tuple[torch.Tensor, torch.Generator]:
    """The global batch's rows of ``step`` (int64 [global_batch]) and the generator after them."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(n, (global_batch,), generator=gen), gen


def normalize_xy(xy: np.ndarray) -> np.ndarray:
    """Maps simulator pixels [0, 512] to [-1, 1] (float32, same shape)."""
    return (np.asarray(xy, dtype=np.float32) / 256.0 - 1.0).astype(np.float32)


def _rotation(cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    return np.stack([np.stack([cos, -sin], -1), np.stack([sin, cos], -1)], -2)  # [..., 2, 2]


def state_features(keypoints: np.ndarray, agent: np.ndarray) -> np.ndarray:
    """Observation features of the state policy, from gym-pusht's ``environment_state_agent_pos``.

    The block pose is read off the keypoints (``PushTEnv.get_keypoints``: keypoints 0 and 1 are
    the bar's corners at body-frame (-60, 0) and (60, 0)); the centre of gravity is at body-frame
    (0, 45) and the goal pose is gym-pusht's fixed ``(256, 256, pi/4)``.

    Args:
        keypoints: float [..., 16], the T's 8 keypoints ``[x0, y0, x1, y1, ...]`` in pixels.
        agent: float [..., 2], the agent position in pixels.

    Returns:
        float32 [..., 28]: keypoints (16) and agent (2) as ``pixels / 256 - 1``; the block's
        centre of gravity (2, same units), ``cos, sin`` of its angle (2); the agent relative to
        the centre of gravity in the block frame (2, units of 100 px); the goal's centre of
        gravity relative to the block's in the block frame (2, units of 100 px); ``sin, cos``
        of the goal angle minus the block angle (2).
    """
    kp = np.asarray(keypoints, dtype=np.float64)
    ag = np.asarray(agent, dtype=np.float64)
    p0, p1 = kp[..., 0:2], kp[..., 2:4]
    axis = (p1 - p0) / 120.0
    cos, sin = axis[..., 0], axis[..., 1]
    rot = _rotation(cos, sin)
    cog = (p0 + p1) / 2 + rot @ np.array([0.0, 45.0])
    gc, gs = np.cos(GOAL_POSE[2]), np.sin(GOAL_POSE[2])
    goal_cog = np.array(GOAL_POSE[:2]) + np.array([-gs * 45.0, gc * 45.0])
    inv = np.swapaxes(rot, -1, -2)
    agent_b = (inv @ (ag - cog)[..., None])[..., 0] / 100.0
    goal_b = (inv @ (goal_cog - cog)[..., None])[..., 0] / 100.0
    dth = GOAL_POSE[2] - np.arctan2(sin, cos)
    out = np.concatenate([kp / 256.0 - 1.0, ag / 256.0 - 1.0, cog / 256.0 - 1.0, cos[..., None], sin[..., None],
                          agent_b, goal_b, np.sin(dth)[..., None], np.cos(dth)[..., None]], axis=-1)
    return out.astype(np.float32)


def generate(cfg: DataConfig, *, progress: bool = True) -> dict[str, np.ndarray]:
    """Runs the scripted expert in the simulator and builds the samples.

    Args:
        cfg: Generation parameters.
        progress: Show a tqdm bar over episodes.

    Returns:
        Arrays ``keypoints`` float32 [N, 16] and ``agent_pos`` float32 [N, 2] (pixels), ``state`` float32 [N, 2]
        (normalized), ``actions`` float32 [N, H, 2] (absolute, normalized), ``episode`` int32
        [N], ``step`` int32 [N] (control step in its episode), and per run episode
        ``final_coverage`` float32, ``success`` bool, ``kept`` bool. No images: a run renders
        the frames it draws (:mod:`dmuon.train.frames`).
    """
    from tqdm import tqdm

    env = make_env(16, cfg.max_steps, obs_type="environment_state_agent_pos")
    expert = ScriptedPushExpert()
    kps, agents, chunks, episode_ids, steps = [], [], [], [], []
    coverages, successes, kept = [], [], []
    bar = tqdm(range(cfg.episodes), desc="dmuon: PushT demos", disable=not progress)
    for ep in bar:
        obs, _ = env.reset(seed=cfg.seed + ep)
        expert.reset()
        ep_kps, ep_agents, ep_actions, coverage, success = [], [], [], 0.0, False
        for _ in range(cfg.max_steps):
            action = expert(env.unwrapped)
            ep_kps.append(np.asarray(env.unwrapped.get_keypoints(env.unwrapped._block_shapes)).reshape(16))
            ep_agents.append(obs["agent_pos"])
            ep_actions.append(action)
            obs, _, terminated, truncated, info = env.step(action)
            coverage, success = float(info["coverage"]), bool(info["is_success"])
            if terminated or truncated:
                break
        coverages.append(coverage)
        successes.append(success)
        kept.append(success or cfg.keep_failed)
        bar.set_postfix(success=f"{np.mean(successes):.2f}")
        if not kept[-1]:
            continue
        acts = normalize_xy(np.stack(ep_actions))
        n = len(acts)
        idx = np.minimum(np.arange(n)[:, None] + np.arange(cfg.horizon)[None, :], n - 1)
        kps.append(np.stack(ep_kps).astype(np.float32))
        agents.append(np.stack(ep_agents).astype(np.float32))
        chunks.append(acts[idx])
        episode_ids.append(np.full(n, ep, dtype=np.int32))
        steps.append(np.arange(n, dtype=np.int32))
    env.close()
    if not chunks:
        raise RuntimeError(f"dmuon.train: none of the {cfg.episodes} demonstrations reached the goal in "
                           f"{cfg.max_steps} steps; pass keep_failed=True or more steps.")
    out = {
        "keypoints": np.concatenate(kps),
        "agent_pos": np.concatenate(agents),
        "state": normalize_xy(np.concatenate(agents)),
        "actions": np.concatenate(chunks),
        "episode": np.concatenate(episode_ids),
        "step": np.concatenate(steps),
        "final_coverage": np.asarray(coverages, dtype=np.float32),
        "success": np.asarray(successes, dtype=bool),
        "kept": np.asarray(kept, dtype=bool),
    }
    return out


def ensure_cached(cfg: DataConfig, *, progress: bool = True) -> pathlib.Path:
    """Generates the dataset unless its cache file exists; returns the file's path.

    The file is written to a temporary name and renamed, so a concurrent reader never sees a
    partial file. In a multi-rank run one rank per node calls this; the others wait on a
    barrier. Frames are :func:`ensure_run_data`'s.
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
        "dmuon.train: cached %d samples (%d of %d episodes kept, expert success %.3f) at %s",
        len(arrays["state"]), int(arrays["kept"].sum()), cfg.episodes, float(arrays["success"].mean()), path,
    )
    return path


class PushTDemos:
    """The cached demonstrations as tensors, with deterministic global batches.

    Args:
        cfg: Generation parameters of the cache file to load, and the sample parameters
            (``history``, ``action_mode``) of the batches.

    Raises:
        RuntimeError: If the cache file does not exist (call :func:`ensure_cached` first).
    """

    images: np.ndarray | None
    image_rows: np.ndarray | None

    def __init__(self, cfg: DataConfig) -> None:
        path = cache_path(cfg)
        if not path.exists():
            raise RuntimeError(
                f"dmuon.train: no cached PushT dataset at {path}; call ensure_cached(cfg) "
                "(rank 0) before loading."
            )
        with np.load(path) as f:
            self.state = torch.from_numpy(f["state"])
            self.actions = torch.from_numpy(f["actions"])
            self.final_coverage = torch.from_numpy(f["final_coverage"])
            self.success = torch.from_numpy(f["success"])
            self.features = torch.from_numpy(state_features(f["keypoints"], f["agent_pos"]))
            step = f["step"]
        # Row of the previous observation in the same episode (itself at the episode's start).
        self.prev = torch.from_numpy(np.where(step > 0, np.arange(len(step)) - 1, np.arange(len(step))))
        # Memory-mapped: the ranks of a node share one copy in the page cache. The frames
        # rendered so far (dmuon.train.frames): uint8 [M, 3, S, S] (read-only) with their rows
        # int64 [M] (sorted), or None for obs="state".
        self.images = self.image_rows = None
        if cfg.obs == "image":
            frames = load_frames(frames_path(path, cfg.image_size))
            self.images, self.image_rows = frames["image"] if len(frames) else None, np.asarray(frames["row"])
        self.cfg = cfg
        self.tokens = torch.tensor(
            tokenize(INSTRUCTION, vocab_size=cfg.vocab_size, max_len=cfg.max_tokens), dtype=torch.long
        )

    def frames_of(self, rows: np.ndarray) -> np.ndarray:
        """uint8 [len(rows), 3, S, S]: the rendered frames of ``rows`` (int64 [b]).

        Raises:
            RuntimeError: If one of them was not rendered (see :func:`ensure_run_data`).
        """
        pos = np.searchsorted(self.image_rows, rows)
        found = pos < len(self.image_rows)
        found[found] = self.image_rows[pos[found]] == rows[found]
        if not found.all():
            raise RuntimeError(
                f"dmuon.train: rows {rows[~found][:8].tolist()} of the PushT demonstrations have no "
                f"rendered {self.cfg.image_size} px frame; call ensure_run_data(cfg, steps=..., "
                f"global_batch=..., seed=...) with this run's values (rank 0) before loading.")
        return self.images[pos]

    def __len__(self) -> int:
        return int(self.state.shape[0])

    def history_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """int64 [b, history]: the rows of the last ``history`` observations, oldest first."""
        cols = [rows]
        for _ in range(self.cfg.history - 1):
            cols.append(self.prev[cols[-1]])
        return torch.stack(cols[::-1], dim=1)

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
            ``images`` float32 [b, 3, S, S] in [0, 1] (``obs="image"``) or ``env_state`` float32
            [b, history, 28] (``obs="state"``), ``state`` float32 [b, 2], ``tokens`` int64
            [b, L], ``actions`` float32 [b, H, 2] (``action_mode`` units), ``noise`` float32
            [b, H, 2], ``time`` float32 [b] in (0, 1], with ``b = global_batch / world_size``.

        Raises:
            ValueError: If ``global_batch`` is not divisible by ``world_size``.
            RuntimeError: If a drawn row's frame was not rendered (``obs="image"``; call
                :func:`ensure_run_data` with this run's steps, batch and seed first).
        """
        if global_batch % world_size:
            raise ValueError(
                f"dmuon.train: global batch {global_batch} is not divisible by world size "
                f"{world_size}; pick --batch-size as a multiple of {world_size}."
            )
        idx, gen = _draw(len(self), step, global_batch, seed)
        noise = torch.randn(global_batch, self.cfg.horizon, 2, generator=gen)
        # Pi0's time distribution: Beta(1.5, 1) stretched to [0.001, 1], favouring noisy t.
        u = torch.rand(global_batch, generator=gen)
        time = u.pow(1.0 / 1.5) * 0.999 + 0.001  # inverse CDF of Beta(1.5, 1) is u^(1/1.5)
        b = global_batch // world_size
        rows = slice(rank * b, (rank + 1) * b)
        sel = idx[rows]
        actions = self.actions[sel]
        if self.cfg.action_mode == "delta":  # normalized units are 256 px
            actions = (actions - self.state[sel][:, None, :]) * (256.0 / DELTA_PX)
        out = {
            "state": self.state[sel],
            "tokens": self.tokens.expand(b, -1).clone(),
            "actions": actions,
            "noise": noise[rows],
            "time": time[rows],
        }
        if self.cfg.obs == "image":
            out["images"] = torch.from_numpy(self.frames_of(sel.numpy())).float().div_(255.0)
        else:
            out["env_state"] = self.features[self.history_rows(sel)]
        return out


def ensure_run_data(cfg: DataConfig, *, steps: int, global_batch: int, seed: int,
                    progress: bool = True) -> str:
    """Caches what a run of ``steps`` steps reads: the demonstrations and, for ``obs="image"``,
    the frames of the rows it draws (:func:`drawn_rows`; rendered only where missing).

    One process per cache directory calls it (local rank 0); the others wait on a barrier.

    Args:
        cfg: The demonstrations and observation kind.
        steps, global_batch, seed: The run's, as later passed to :meth:`PushTDemos.batch`.
        progress: Show tqdm bars while generating and rendering.

    Returns:
        One line for the user: the cache's location, its files' sizes and how to move it.
    """
    path = ensure_cached(cfg, progress=progress)
    what = f"demonstrations {path.name} ({path.stat().st_size / 2 ** 20:.1f} MiB)"
    if cfg.obs == "image":
        with np.load(path) as f:
            n = len(f["step"])
        info = ensure_frames(path, drawn_rows(n, steps, global_batch, seed), seed=cfg.seed,
                             max_steps=cfg.max_steps, image_size=cfg.image_size, progress=progress)
        what += (f", {info.frames} frames at {cfg.image_size} px in {info.path.name} "
                 f"({info.nbytes / 2 ** 20:.1f} MiB, {info.rendered} rendered now)")
    return f"dmuon.train: data cache {path.parent}: {what}; --cache-dir or DMUON_CACHE_DIR moves it"
