"""Rendered frames of the demonstrations: only the rows a run draws, rendered on demand.

The image policy (``obs="image"``) sees the simulator's rendering of each sample's state. A
demonstration set of 200 episodes holds ~21,000 samples, 590 MiB of 96 px frames, while a
3-step run of batch 64 draws 192 of them. So the demonstrations file
(:func:`dmuon.train.data.ensure_cached`) holds no frames, and this module keeps, per
demonstration set and image size, one file of the frames rendered so far:

    <cache dir>/pusht_<digest>_<S>px_frames.npy

a structured array (``row`` int64: the sample's row in the demonstrations, sorted;
``image`` uint8 [3, S, S]) that every rank memory-maps. :func:`ensure_frames` renders the rows
a run will draw that the file lacks and rewrites it (temporary name, then rename, so a reader
never sees half a file); later runs add theirs.

A frame is rendered by replaying its episode (same reset seed, same scripted expert) and
rendering the simulator where the demonstration was observed, exactly as gym-pusht renders
its ``pixels`` observation there. Setting the bodies' poses and rendering instead is not the
same picture: gym-pusht's debug drawing includes the last physics step's contact points.
The replayed agent position is checked against the stored one, row by row.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib

import numpy as np

from dmuon.train.expert import ScriptedPushExpert, make_env

logger = logging.getLogger(__name__)


def frames_dtype(image_size: int) -> np.dtype:
    """The frames file's record: ``row`` int64 and ``image`` uint8 [3, S, S]."""
    return np.dtype([("row", "<i8"), ("image", "u1", (3, image_size, image_size))])


def frames_path(demos_path: pathlib.Path, image_size: int) -> pathlib.Path:
    """The frames file beside the demonstrations file ``demos_path`` (``pusht_<digest>.npz``)."""
    return demos_path.with_name(f"{demos_path.stem}_{image_size}px_frames.npy")


@dataclasses.dataclass(frozen=True, slots=True)
class FramesInfo:
    """What :func:`ensure_frames` left on disk.

    Args:
        path: The frames file.
        frames: Frames it holds.
        rendered: Frames rendered by this call (0: every requested row was cached).
        nbytes: Its size in bytes.
    """

    path: pathlib.Path
    frames: int
    rendered: int
    nbytes: int


def load_frames(path: pathlib.Path) -> np.ndarray:
    """Memory-maps the frames file (read-only structured array; empty if there is none)."""
    if not path.exists():
        return np.zeros(0, dtype=np.dtype([("row", "<i8")]))
    return np.load(path, mmap_mode="r")


def render_rows(demos: dict[str, np.ndarray], rows: np.ndarray, *, seed: int, max_steps: int,
                image_size: int, progress: bool = False) -> np.ndarray:
    """Renders the frames of ``rows`` by replaying their episodes.

    Args:
        demos: The demonstrations' ``episode``, ``step`` and ``agent_pos`` arrays ([N] int32,
            [N] int32, [N, 2] float32 pixels).
        rows: int64 [M], sorted unique rows in [0, N).
        seed: The demonstrations' ``DataConfig.seed`` (episode e resets with ``seed + e``).
        max_steps: Their ``DataConfig.max_steps``.
        image_size: Frame side S in pixels.
        progress: Show a tqdm bar over the episodes replayed.

    Returns:
        uint8 [M, 3, S, S], the frame of each row, in the order of ``rows``.

    Raises:
        RuntimeError: If a replayed agent position differs from the stored one (the simulator
            or the expert changed since the demonstrations were cached: delete the cache).
    """
    from tqdm import tqdm

    out = np.empty((len(rows), 3, image_size, image_size), dtype=np.uint8)
    episodes = demos["episode"][rows]
    steps = demos["step"][rows]
    env = make_env(image_size, max_steps, obs_type="environment_state_agent_pos")
    sim = env.unwrapped
    expert = ScriptedPushExpert()
    for ep in tqdm(np.unique(episodes), desc="dmuon: rendering frames", disable=not progress):
        mine = np.flatnonzero(episodes == ep)  # positions in rows, by step (rows are sorted)
        want = dict(zip(steps[mine].tolist(), mine.tolist()))
        env.reset(seed=seed + int(ep))
        expert.reset()
        for step in range(int(steps[mine].max()) + 1):
            if step in want:  # the observation the demonstration recorded before acting
                k = want[step]
                if not np.array_equal(np.asarray(sim.agent.position, dtype=np.float32),
                                      demos["agent_pos"][rows[k]]):
                    raise RuntimeError(
                        f"dmuon.train: replaying episode {int(ep)} gives agent position "
                        f"{tuple(sim.agent.position)} at step {step}, the cached demonstrations "
                        f"{tuple(demos['agent_pos'][rows[k]])}; the simulator or the expert changed "
                        f"since they were cached. Delete the cache files (pusht_*) and rerun.")
                out[k] = sim._render().transpose(2, 0, 1)
            env.step(expert(sim))
    env.close()
    return out


def ensure_frames(demos_path: pathlib.Path, rows: np.ndarray, *, seed: int, max_steps: int,
                  image_size: int, progress: bool = True) -> FramesInfo:
    """Makes the frames file hold ``rows`` (and what it held before); renders only the rest.

    One process per cache directory calls it (local rank 0 of a run); the others wait on a
    barrier, then :func:`load_frames`.

    Args:
        demos_path: The demonstrations file (:func:`dmuon.train.data.ensure_cached`).
        rows: Rows the run will draw (any order, repeats allowed).
        seed, max_steps: The demonstrations' ``DataConfig`` fields.
        image_size: Frame side S in pixels.
        progress: Show a tqdm bar while rendering.

    Returns:
        :class:`FramesInfo` of the file.
    """
    path = frames_path(demos_path, image_size)
    old = load_frames(path)
    rows = np.unique(np.asarray(rows, dtype=np.int64))
    missing = np.setdiff1d(rows, np.asarray(old["row"]), assume_unique=True)
    if len(missing):
        with np.load(demos_path) as f:
            demos = {k: f[k] for k in ("episode", "step", "agent_pos")}
        images = render_rows(demos, missing, seed=seed, max_steps=max_steps, image_size=image_size,
                             progress=progress)
        merged = np.empty(len(old) + len(missing), dtype=frames_dtype(image_size))
        merged["row"] = np.concatenate([np.asarray(old["row"]), missing])
        merged["image"] = np.concatenate([np.asarray(old["image"]), images]) if len(old) else images
        merged = merged[np.argsort(merged["row"], kind="stable")]
        del old  # the memory map, before its file is replaced
        tmp = path.with_name(f"{path.stem}.tmp{os.getpid()}.npy")
        np.save(tmp, merged)
        os.replace(tmp, path)
        total = len(merged)
        logger.info("dmuon.train: rendered %d frames into %s (%d in all)", len(missing), path, total)
    else:
        total = len(old)
    return FramesInfo(path=path, frames=total, rendered=len(missing), nbytes=path.stat().st_size)
