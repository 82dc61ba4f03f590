"""A scripted pushing expert for the PushT simulator (``gym-pusht``).

The expert is a small state machine over the simulator's true state (block pose, goal pose,
agent position). It never reads pixels. Each control step it:

1. picks a push direction ``u``: toward the goal when the block's centre of gravity is more than
   ``tol`` pixels from the goal's (translation mode), else along the T's bar (rotation mode, with
   hysteresis so it does not flip between modes every step);
2. picks a lateral lever arm ``s`` (pixels, perpendicular to ``u``) so that pushing along ``u``
   also turns the block toward the goal angle (torque = -s for a unit force along ``u``);
3. finds the contact point: where the line through ``cog + s * v`` along ``u`` first enters the
   block (shapely intersection), and the pre-push point just behind it;
4. if the agent is in the approach corridor behind that point, pushes through it; otherwise it
   moves to a staging point behind the pre-push point, orbiting around the block (fixed
   direction per orbit) when the straight path would hit it.

The action is the agent's absolute target position in simulator pixels ([0, 512]^2), which the
simulator tracks with a PD controller. The expert is deliberately simple; its measured quality
(mean coverage vs. uniformly random actions) is reported by :func:`evaluate_expert`.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

AGENT_RADIUS = 15.0  # pixels; gym_pusht's agent circle (PushTEnv.add_circle)
COG_LOCAL = (0.0, 45.0)  # the T's centre of gravity in its body frame (PushTEnv.add_tee, scale 30)


def _wrap(angle: float) -> float:
    """Wraps an angle in radians into [-pi, pi)."""
    return (angle + math.pi) % (2.0 * math.pi) - math.pi


@dataclasses.dataclass(slots=True)
class ScriptedPushExpert:
    """Scripted pushing policy for ``gym_pusht/PushT-v0``.

    Args:
        tol: Distance in pixels below which the expert switches to rotation mode.
        tol_exit: Distance in pixels above which it goes back to translation mode.
        k_rot: Lever-arm gain in pixels per radian of angle error.
        s_max: Largest lever arm in pixels.
        gap: Clearance in pixels between the agent circle and the block at the pre-push point.
        engage: Lateral tolerance in pixels of the approach corridor.
        stage: Distance in pixels of the staging point behind the pre-push point.
        push_step: Target lead in pixels per control step while pushing.
        r_orbit: Orbit radius in pixels around the block's centre of gravity.
        orbit_step: Orbit advance in radians per control step.
        max_move: Largest target displacement in pixels per control step.
    """

    tol: float = 10.0
    tol_exit: float = 30.0
    k_rot: float = 60.0
    s_max: float = 40.0
    gap: float = 4.0
    engage: float = 12.0
    stage: float = 40.0
    push_step: float = 15.0
    r_orbit: float = 105.0
    orbit_step: float = 0.4
    max_move: float = 35.0
    _rotating: bool = False
    _orbit_dir: float | None = None

    def reset(self) -> None:
        """Clears the per-episode memory (mode and orbit direction)."""
        self._rotating = False
        self._orbit_dir = None

    def __call__(self, env) -> np.ndarray:
        """Returns the next action for the unwrapped ``PushTEnv``.

        Args:
            env: The unwrapped ``gym_pusht.envs.PushTEnv`` (``gym_env.unwrapped``); read only.

        Returns:
            float64 array of shape [2]: target agent position in pixels, clipped to [0, 512].
        """
        import shapely.geometry as sg

        block = env.block
        cog = np.array(block.local_to_world(COG_LOCAL))
        goal_cog = np.array(env.get_goal_pose_body(env.goal_pose).local_to_world(COG_LOCAL))
        delta = goal_cog - cog
        dist = float(np.linalg.norm(delta))
        angle_err = _wrap(float(env.goal_pose[2]) - block.angle)
        agent = np.array(env.agent.position)

        if self._rotating and dist > self.tol_exit:
            self._rotating = False
        elif not self._rotating and dist < self.tol:
            self._rotating = True
        if self._rotating:
            u = np.array([math.cos(block.angle), math.sin(block.angle)])
            s = -self.s_max * float(np.sign(angle_err))
        else:
            u = delta / max(dist, 1e-9)
            s = float(np.clip(-self.k_rot * angle_err, -self.s_max, self.s_max))
        v = np.array([-u[1], u[0]])

        geom = sg.MultiPolygon(  # the T as two world-frame polygons
            [sg.Polygon([block.local_to_world(v) for v in shape.get_vertices()]) for shape in block.shapes]
        )
        base = cog + v * s
        hit = geom.intersection(sg.LineString([base - 200 * u, base + 200 * u]))
        if hit.is_empty:  # the offset line misses the T: push through the centre instead
            base = cog
            hit = geom.intersection(sg.LineString([base - 200 * u, base + 200 * u]))
        pts = np.array([p for g in getattr(hit, "geoms", [hit]) for p in g.coords])
        back = pts[np.argmin((pts - base) @ u)]
        pre = back - u * (AGENT_RADIUS + self.gap)

        lateral = float((agent - pre) @ v)
        along = float((agent - pre) @ u)
        if abs(lateral) < self.engage and -self.stage - 10.0 < along < 5.0:
            self._orbit_dir = None
            return np.clip(agent + u * self.push_step - v * lateral, 0.0, 512.0)

        staging = pre - u * self.stage
        path = sg.LineString([agent, staging])
        if path.intersects(geom.buffer(AGENT_RADIUS + 3.0)):
            rel = agent - cog
            ang_agent = math.atan2(rel[1], rel[0])
            rel_pre = pre - cog
            turn = _wrap(math.atan2(rel_pre[1], rel_pre[0]) - ang_agent)
            if self._orbit_dir is None:  # fixed per orbit: avoids dithering when turn ~ +-pi
                self._orbit_dir = 1.0 if turn >= 0 else -1.0
            ang = ang_agent + self._orbit_dir * self.orbit_step
            target = cog + self.r_orbit * np.array([math.cos(ang), math.sin(ang)])
        else:
            self._orbit_dir = None
            target = staging
        move = target - agent
        norm = float(np.linalg.norm(move))
        if norm > self.max_move:
            move *= self.max_move / norm
        return np.clip(agent + move, 0.0, 512.0)


def make_env(image_size: int, max_steps: int, render_size: int = 680):
    """Creates a headless PushT environment with pixel + agent-position observations.

    Args:
        image_size: Side in pixels of the rendered observation image.
        max_steps: Episode time limit in control steps.
        render_size: Side in pixels of ``env.render()`` frames (gym-pusht's visualization,
            with the last action marked by a red cross); does not change observations.

    Returns:
        A ``gymnasium`` environment (``gym_pusht/PushT-v0``, ``obs_type="pixels_agent_pos"``).

    Raises:
        RuntimeError: If ``gym-pusht`` is not installed.
    """
    import os

    os.environ.setdefault("SDL_VIDEODRIVER", "dummy")  # pygame: no display needed
    try:
        import gym_pusht  # noqa: F401  (registers the environment)
        import gymnasium as gym
    except ImportError as exc:
        raise RuntimeError(
            "dmuon.train: the PushT simulator is missing; install it with "
            "`pip install 'gym-pusht>=0.1.5'` (or `pip install dmuon[demo]`)."
        ) from exc
    return gym.make(
        "gym_pusht/PushT-v0",
        obs_type="pixels_agent_pos",
        render_mode="rgb_array",
        observation_width=image_size,
        observation_height=image_size,
        visualization_width=render_size,
        visualization_height=render_size,
        max_episode_steps=max_steps,
    )


def evaluate_expert(policy: str, episodes: int, max_steps: int, seed: int) -> dict[str, float]:
    """Rolls out the expert or uniform random actions and measures coverage.

    Args:
        policy: ``"expert"`` or ``"random"``.
        episodes: Number of episodes.
        max_steps: Control steps per episode.
        seed: Seed of the first episode (episode ``i`` uses ``seed + i``).

    Returns:
        ``{"final_coverage": mean coverage at the end, "max_reward": mean best reward,
        "success_rate": fraction with coverage > 0.95}``; coverage is the simulator's
        intersection-over-goal-area in [0, 1].

    Raises:
        ValueError: If ``policy`` is unknown.
    """
    if policy not in ("expert", "random"):
        raise ValueError(f"dmuon.train: policy={policy!r}; use 'expert' or 'random'.")
    env = make_env(image_size=16, max_steps=max_steps)
    expert = ScriptedPushExpert()
    rng = np.random.default_rng(seed)
    finals, bests = [], []
    for ep in range(episodes):
        env.reset(seed=seed + ep)
        expert.reset()
        best, coverage = 0.0, 0.0
        for _ in range(max_steps):
            action = expert(env.unwrapped) if policy == "expert" else rng.uniform(0, 512, 2)
            _, reward, terminated, truncated, info = env.step(action)
            best, coverage = max(best, float(reward)), float(info["coverage"])
            if terminated or truncated:
                break
        finals.append(coverage)
        bests.append(best)
    env.close()
    finals_arr = np.asarray(finals)
    return {
        "final_coverage": float(finals_arr.mean()),
        "max_reward": float(np.mean(bests)),
        "success_rate": float((finals_arr > 0.95).mean()),
    }
