"""Closed-loop evaluation of the policy in PushT (``python -m dmuon.train.eval --checkpoint DIR``).

The policy runs the way Pi0 runs: from the current observation (image, or the T's keypoints with
the last ``history`` observations; agent position; the instruction) it samples an action chunk of H actions by integrating the flow-matching ODE from
noise with ``flow_steps`` Euler steps (:meth:`Pi0Policy.sample_actions`), executes the first
``exec_horizon`` actions, observes again and replans, until the block covers the goal (PushT's
own ``success_threshold``, coverage > 0.95, ends the episode) or ``max_steps`` control steps
pass. The scripted expert that made the demonstrations runs on the same initial states.

Initial states are ``gym-pusht`` reset seeds ``seed, seed + 1, ...``, disjoint from the
demonstrations' (``DataConfig.seed ... + episodes - 1``). Episodes are split over the ranks
(episode i on rank ``i % world``) and every rank rolls out with its own plain copy of the
policy. Each episode's flow noise comes from a generator seeded with its reset seed and the
policy computes on one thread, so an episode's actions, and hence the results, do not depend on
the number of ranks.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import pathlib
import statistics
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from dmuon.train.data import DELTA_PX, INSTRUCTION, DataConfig, normalize_xy, state_features, tokenize
from dmuon.train.expert import ScriptedPushExpert, make_env
from dmuon.train.model import Pi0Policy

logger = logging.getLogger(__name__)

_Z95 = statistics.NormalDist().inv_cdf(0.975)  # two-sided 95%
_VIDEO_SIZE = 192  # pixels; frames of gym-pusht's render, small enough for a few-MB GIF
_VIDEO_STRIDE = 2  # keep every 2nd control step (10 Hz control -> 5 frames per second)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class EvalConfig:
    """Closed-loop evaluation settings.

    Args:
        episodes: Evaluation episodes (initial states).
        flow_steps: Euler steps of the flow-matching ODE per action chunk (Pi0 uses 10).
        exec_horizon: Actions of each sampled chunk executed before replanning (<= horizon H).
        max_steps: Episode time limit in control steps (10 Hz); 300 as gym-pusht registers
            and LeRobot evaluates.
        seed: Reset seed of the first episode; episode i uses ``seed + i``.
        video: Path of a GIF of the first ``video_episodes`` episodes, or ``None``.
        video_episodes: Episodes in the GIF.
    """

    episodes: int = 16
    flow_steps: int = 10
    exec_horizon: int = 4
    max_steps: int = 300
    seed: int = 100_000
    video: str | None = None
    video_episodes: int = 3

    def __post_init__(self) -> None:
        for name in ("episodes", "flow_steps", "exec_horizon", "max_steps", "video_episodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"dmuon.train: EvalConfig.{name}={getattr(self, name)}; must be >= 1.")
        if self.video is not None and not self.video.lower().endswith(".gif"):
            raise ValueError(f"dmuon.train: --video {self.video!r}; only GIF is written, name it *.gif.")

    def seeds(self, data: DataConfig) -> list[int]:
        """The episodes' reset seeds.

        Raises:
            ValueError: If they overlap the demonstrations' seeds ``data.seed ... + episodes - 1``.
        """
        seeds = list(range(self.seed, self.seed + self.episodes))
        demo = range(data.seed, data.seed + data.episodes)
        overlap = [s for s in seeds if s in demo]
        if overlap:
            raise ValueError(
                f"dmuon.train: evaluation seeds {overlap[:5]} ({len(overlap)} in all) are demonstration "
                f"seeds ({data.seed}..{data.seed + data.episodes - 1}); pass --eval-seed >= "
                f"{data.seed + data.episodes} so the initial states are held out."
            )
        return seeds


@contextlib.contextmanager
def _one_thread():
    """Runs torch on one thread: GEMM results can depend on the thread count."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def obs_type(data: DataConfig) -> str:
    """gym-pusht's ``obs_type`` that feeds a policy trained on ``data``."""
    return "pixels_agent_pos" if data.obs == "image" else "environment_state_agent_pos"


class PolicyActor:
    """Turns the policy into a PushT controller: sample a chunk, execute a prefix, replan.

    Args:
        policy: A plain (unsharded) policy in eval mode.
        data: The demonstrations' config (image size, instruction tokens, normalization).
        cfg: Flow steps and execution horizon.

    Raises:
        ValueError: If ``cfg.exec_horizon`` exceeds the policy's chunk length H.
    """

    def __init__(self, policy: Pi0Policy, data: DataConfig, cfg: EvalConfig) -> None:
        if cfg.exec_horizon > policy.cfg.horizon:
            raise ValueError(f"dmuon.train: --exec-horizon {cfg.exec_horizon} exceeds the policy's "
                             f"action chunk H={policy.cfg.horizon}; pass a value in 1..{policy.cfg.horizon}.")
        self.policy, self.cfg, self.data = policy, cfg, data
        self.history: list[np.ndarray] = []
        self.tokens = torch.tensor([tokenize(INSTRUCTION, vocab_size=data.vocab_size, max_len=data.max_tokens)])
        self.queue: list[np.ndarray] = []
        self.gen = torch.Generator()

    def reset(self, seed: int) -> None:
        """Starts an episode: empties the plan, seeds the flow noise with the reset seed."""
        self.queue = []
        self.history = []
        self.gen.manual_seed(seed)

    def __call__(self, obs: dict, env) -> np.ndarray:
        """Next action (float64 [2], simulator pixels) for observation ``obs``.

        ``obs`` is gym-pusht's ``pixels_agent_pos`` (image policies) or
        ``environment_state_agent_pos`` (state policies) observation; a state policy keeps the
        last ``history`` observations' features (the first one repeated at the start, as in
        training).
        """
        if self.policy.cfg.obs == "state":
            feats = state_features(obs["environment_state"], obs["agent_pos"])
            self.history = (self.history or [feats] * self.policy.cfg.history)[1:] + [feats]
        if not self.queue:
            h = self.policy.cfg.horizon
            if self.policy.cfg.obs == "image":
                seen = torch.from_numpy(obs["pixels"].transpose(2, 0, 1).copy())[None].float().div_(255.0)
            else:
                seen = torch.from_numpy(np.stack(self.history))[None]
            state = torch.from_numpy(normalize_xy(obs["agent_pos"]))[None]
            noise = torch.randn(1, h, self.policy.cfg.action_dim, generator=self.gen)
            with _one_thread():
                chunk = self.policy.sample_actions(seen, state, self.tokens, noise, self.cfg.flow_steps)[0]
            chunk = chunk.double().numpy()
            if self.data.action_mode == "delta":
                pixels = np.asarray(obs["agent_pos"], dtype=np.float64) + chunk * DELTA_PX
            else:
                pixels = (chunk + 1.0) * 256.0  # inverse of normalize_xy
            self.queue = list(pixels.clip(0.0, 512.0)[: self.cfg.exec_horizon])
        return self.queue.pop(0)


class ExpertActor:
    """The scripted expert as a controller (reads the simulator state, not the observation)."""

    def __init__(self) -> None:
        self.expert = ScriptedPushExpert()

    def reset(self, seed: int) -> None:
        self.expert.reset()

    def __call__(self, obs: dict, env) -> np.ndarray:
        return self.expert(env.unwrapped)


def run_episode(env, seed: int, actor, max_steps: int, frames: list | None = None) -> dict:
    """Rolls ``actor`` out from reset seed ``seed``.

    Args:
        env: A PushT env from :func:`make_env`.
        seed: Reset seed (the initial block and agent pose).
        actor: ``reset(seed)`` and ``actor(obs, env) -> action`` (pixels).
        max_steps: Control steps at most.
        frames: If a list, ``env.render()`` frames (uint8 [R, R, 3]) are appended.

    Returns:
        ``{"seed", "steps", "final_coverage", "max_coverage", "success"}``; coverage is the
        simulator's goal-area fraction covered by the T in [0, 1]; success is PushT's
        ``is_success`` (coverage > ``env.unwrapped.success_threshold`` = 0.95).
    """
    obs, _ = env.reset(seed=seed)
    actor.reset(seed)
    coverage, best, success, steps = 0.0, 0.0, False, 0
    if frames is not None:
        frames.append(env.render())
    for steps in range(1, max_steps + 1):
        obs, _, terminated, truncated, info = env.step(actor(obs, env))
        coverage = float(info["coverage"])
        best, success = max(best, coverage), bool(info["is_success"])
        if frames is not None and (steps % _VIDEO_STRIDE == 0 or terminated):
            frames.append(env.render())
        if terminated or truncated:
            break
    return {"seed": seed, "steps": steps, "final_coverage": coverage, "max_coverage": best,
            "success": success}


def mean_ci(xs: list[float], bounds: tuple[float, float] | None = None) -> dict:
    """Mean and normal-approximation 95% interval ``mean +- 1.96 s / sqrt(n)`` (``s``: sample sd).

    ``bounds`` clips the interval to the quantity's range (coverage: ``(0, 1)``).
    """
    n = len(xs)
    mean = float(np.mean(xs))
    half = _Z95 * float(np.std(xs, ddof=1)) / math.sqrt(n) if n > 1 else float("nan")
    lo, hi = mean - half, mean + half
    if bounds is not None:
        lo, hi = max(bounds[0], lo), min(bounds[1], hi)
    return {"mean": mean, "ci95": [lo, hi]}


def wilson_ci(successes: int, n: int) -> dict:
    """Success rate and its Wilson score 95% interval (Wilson 1927), valid at 0 and n."""
    p = successes / n
    denom = 1.0 + _Z95**2 / n
    centre = (p + _Z95**2 / (2 * n)) / denom
    half = _Z95 * math.sqrt(p * (1 - p) / n + _Z95**2 / (4 * n * n)) / denom
    return {"mean": p, "ci95": [max(0.0, centre - half), min(1.0, centre + half)]}


def summarize(episodes: list[dict]) -> dict:
    """Success rate (Wilson 95% CI) and mean final / max coverage (normal 95% CI in [0, 1])."""
    return {
        "episodes": len(episodes),
        "success_rate": wilson_ci(sum(e["success"] for e in episodes), len(episodes)),
        "final_coverage": mean_ci([e["final_coverage"] for e in episodes], (0.0, 1.0)),
        "max_coverage": mean_ci([e["max_coverage"] for e in episodes], (0.0, 1.0)),
    }


def _rollouts(make_actor: Callable[[], object], seeds: list[int], cfg: EvalConfig, data: DataConfig,
              desc: str, progress: bool) -> list[dict]:
    """This rank's episodes (i % world == rank) of ``seeds``, gathered on every rank in order."""
    from tqdm import tqdm

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    env = make_env(data.image_size, cfg.max_steps, obs_type=obs_type(data))
    actor = make_actor()
    mine = list(range(rank, len(seeds), world))
    local = [(i, run_episode(env, seeds[i], actor, cfg.max_steps))
             for i in tqdm(mine, desc=f"{desc} (rank {rank}/{world})", disable=not (progress and rank == 0))]
    env.close()
    if world > 1:
        gathered: list = [None] * world
        dist.all_gather_object(gathered, local)
        local = [x for part in gathered for x in part]
    return [e for _, e in sorted(local, key=lambda x: x[0])]


def evaluate(policy: Pi0Policy | None, cfg: EvalConfig, data: DataConfig, *, progress: bool = True,
             expert: bool = True) -> dict:
    """Rolls the policy (and the expert) out on the held-out initial states.

    Collective when a process group is initialized (episodes split over ranks; every rank
    gets the whole result). Writes ``cfg.video`` on rank 0.

    Args:
        policy: A plain policy (e.g. from :func:`dmuon.train.ckpt.load_policy`), eval mode;
            ``None`` rolls out only the expert.
        cfg: Evaluation settings.
        data: The demonstrations' config (held-out seeds, image size, instruction).
        progress: tqdm bars on rank 0.
        expert: Also roll the scripted expert out on the same initial states.

    Returns:
        ``{"config": cfg fields, "seeds": [...], "policy": {"episodes": [...], "summary": ...},
        "expert": {...}}``; summaries from :func:`summarize`.

    Raises:
        ValueError: On seeds that overlap the demonstrations' or an ``exec_horizon > H``.
    """
    seeds = cfg.seeds(data)
    out = {"config": dataclasses.asdict(cfg), "seeds": seeds}
    runs = []
    if policy is not None:
        PolicyActor(policy, data, cfg)  # validates exec_horizon before any rollout
        runs.append(("policy", lambda: PolicyActor(policy, data, cfg)))
    if expert:
        runs.append(("expert", ExpertActor))
    for name, make_actor in runs:
        episodes = _rollouts(make_actor, seeds, cfg, data, f"dmuon: {name} rollouts", progress)
        out[name] = {"episodes": episodes, "summary": summarize(episodes)}
    rank = dist.get_rank() if dist.is_initialized() else 0
    if cfg.video and rank == 0 and policy is not None:
        write_video(policy, cfg, data, seeds[: cfg.video_episodes])
    return out


def write_video(policy: Pi0Policy, cfg: EvalConfig, data: DataConfig, seeds: list[int]) -> pathlib.Path:
    """Re-runs the policy on ``seeds`` with rendering and writes an animated GIF (Pillow).

    The rollouts are the evaluation's own (same seeds, same noise), rendered by gym-pusht at
    ``_VIDEO_SIZE`` pixels with the commanded target marked by a red cross.

    Raises:
        RuntimeError: If Pillow is not installed.
    """
    try:
        from PIL import Image
    except ImportError as exc:
        raise RuntimeError("dmuon.train: --video needs Pillow; pip install 'dmuon[demo]'.") from exc
    env = make_env(data.image_size, cfg.max_steps, render_size=_VIDEO_SIZE, obs_type=obs_type(data))
    actor = PolicyActor(policy, data, cfg)
    frames: list[np.ndarray] = []
    for seed in seeds:
        run_episode(env, seed, actor, cfg.max_steps, frames)
        frames.append(np.zeros_like(frames[-1]))  # a black frame between episodes
    env.close()
    path = pathlib.Path(cfg.video)
    path.parent.mkdir(parents=True, exist_ok=True)
    images = [Image.fromarray(f) for f in frames]
    images[0].save(path, save_all=True, append_images=images[1:], duration=1000 * _VIDEO_STRIDE // 10, loop=0)
    logger.info("dmuon.train: wrote %d frames of %d episodes to %s", len(frames), len(seeds), path)
    return path


def format_summary(result: dict) -> str:
    """Human-readable per-episode lines and the summary table of :func:`evaluate`'s result."""
    lines = []
    has_expert = "expert" in result
    for i, e in enumerate(result["policy"]["episodes"]):
        line = (f"episode {i:3d} seed {e['seed']}: policy final {e['final_coverage']:.3f} max "
                f"{e['max_coverage']:.3f} success {int(e['success'])}")
        if has_expert:
            x = result["expert"]["episodes"][i]
            line += f" | expert final {x['final_coverage']:.3f} success {int(x['success'])}"
        lines.append(line)

    def fmt(s: dict) -> str:
        return f"{s['mean']:.3f} [{s['ci95'][0]:.3f}, {s['ci95'][1]:.3f}]"

    lines.append(f"{'':8s} {'success rate':>24s} {'final coverage':>24s} {'max coverage':>24s}")
    for name in ("policy", "expert") if has_expert else ("policy",):
        s = result[name]["summary"]
        lines.append(f"{name:8s} {fmt(s['success_rate']):>24s} {fmt(s['final_coverage']):>24s} "
                     f"{fmt(s['max_coverage']):>24s}")
    lines.append(f"({result['policy']['summary']['episodes']} episodes, 95% intervals: Wilson for "
                 "success, normal for coverage)")
    return "\n".join(lines)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: must be >= 1")
    return value


def add_eval_args(p: argparse.ArgumentParser, *, episodes_default: int | None) -> None:
    """Adds the evaluation options shared by ``dmuon.train`` and ``dmuon.train.eval``."""
    d = EvalConfig()
    p.add_argument("--eval-episodes", type=_positive, default=episodes_default,
                   help="closed-loop PushT episodes on held-out initial states"
                        + (" (default: none)" if episodes_default is None else ""))
    p.add_argument("--flow-steps", type=_positive, default=d.flow_steps, help="Euler steps per action chunk")
    p.add_argument("--exec-horizon", type=_positive, default=d.exec_horizon,
                   help="actions executed from each chunk before replanning")
    p.add_argument("--eval-max-steps", type=_positive, default=d.max_steps, help="episode time limit")
    p.add_argument("--eval-seed", type=int, default=d.seed, help="reset seed of the first evaluation episode")
    p.add_argument("--video", default=None, help="write a GIF of the first evaluation episodes here")
    p.add_argument("--video-episodes", type=_positive, default=d.video_episodes)


def eval_config_from(a: argparse.Namespace, p: argparse.ArgumentParser) -> EvalConfig | None:
    """The :class:`EvalConfig` of parsed options (``None`` without ``--eval-episodes``)."""
    if a.eval_episodes is None:
        if a.video:
            p.error("--video needs --eval-episodes")
        return None
    try:
        return EvalConfig(episodes=a.eval_episodes, flow_steps=a.flow_steps, exec_horizon=a.exec_horizon,
                          max_steps=a.eval_max_steps, seed=a.eval_seed, video=a.video,
                          video_episodes=a.video_episodes)
    except ValueError as exc:
        p.error(str(exc))


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, EvalConfig]:
    """Parses ``python -m dmuon.train.eval``'s command line."""
    p = argparse.ArgumentParser(prog="python -m dmuon.train.eval",
                                description="Roll a dmuon.train checkpoint out in PushT.")
    p.add_argument("--checkpoint", required=True, help="a --save directory or one of its step_NNNNNN")
    p.add_argument("--nproc", type=_positive, default=1, help="local ranks (episodes split over them)")
    p.add_argument("--no-expert", action="store_true", help="skip the scripted expert's rollouts")
    p.add_argument("--out", default=None, help="write the result JSON here")
    add_eval_args(p, episodes_default=EvalConfig().episodes)
    a = p.parse_args(argv)
    return a, eval_config_from(a, p)


def eval_rank(args: tuple[argparse.Namespace, EvalConfig]) -> dict:
    """One rank of ``python -m dmuon.train.eval`` (process group optional)."""
    from dmuon.train.ckpt import configs_from, load_policy

    a, cfg = args
    policy, meta = load_policy(a.checkpoint)
    data = configs_from(meta)[1]
    result = evaluate(policy, cfg, data, expert=not a.no_expert)
    result["checkpoint"] = {"path": str(a.checkpoint), "step": meta and meta["step"]}
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(format_summary(result), flush=True)
        if a.out:
            pathlib.Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            pathlib.Path(a.out).write_text(json.dumps(result, indent=1))
    return result


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``python -m dmuon.train.eval``."""
    from dmuon.train.ranks import exit_on_rank_failure, launch

    a, cfg = parse_args(argv)
    with exit_on_rank_failure("python -m dmuon.train.eval"):
        launch(eval_rank, (a, cfg), a.nproc, spawn_one=False)


if __name__ == "__main__":
    main()
