"""A scripted pushing expert for the PushT simulator (``gym-pusht`` 0.1.8), built on its pushing model.

**The pushing model** (constants read from ``gym_pusht/envs/pusht.py``):

- The T (``PushTEnv.add_tee``, scale 30) is a bar ``[-60, 60] x [0, 30]`` and a stem
  ``[-15, 15] x [30, 120]`` in its body frame (pixels), with mass 1 and moment of inertia
  ``I = 3000`` (``moment_for_poly`` of the bar, counted twice: 2 x 1500 px^2), and its centre of
  gravity at ``(0, 45)`` (the mean of the two rectangles' centroids).
- ``space.damping = 0`` (``_setup``): pymunk multiplies velocities by ``damping ** dt`` each
  substep, so the block keeps no velocity; it moves only while it is pushed (quasi-static).
- ``friction = 1`` is set on the *bodies*, not on the shapes, so the contact friction is 0: a push
  acts along the contact's normal only.
- The agent is a kinematic circle of radius 15 whose target (the action) is tracked by a PD
  controller (``k_p = 100``, ``k_v = 20``, ten 10 ms substeps per 10 Hz control step).
- Walls are segments of radius 2 at x, y = 5 and 506, so the agent's centre stays in
  ``[22, 489]``.
- Success (``step``): coverage (goal area covered by the T) ``> success_threshold = 0.95``.

Hence a push at contact point ``p`` with inward normal ``n`` moves the block along the twist
``(n, (r x n) / I)`` (translation of the centre of gravity, rotation), with ``r`` from the centre
of gravity to ``p`` and unit mass: an impulse ``J n`` at ``p`` gives ``dv = J n`` and
``dw = J (r x n) / I``.

**The controller** is memoryless (each action is a function of the current simulator state):

1. Pose error ``E = (goal CoG - CoG, L * wrap(goal angle - angle))`` with ``L = 45`` px per
   radian, so a 1-degree error weighs like 0.8 px.
2. Among ~100 candidate contacts on the T's outline (outward normals, away from the concave
   corners the agent cannot reach), each contact's twist in the same units
   ``w = (n, L (r x n) / I)`` is scored by its cosine with ``E``; contacts whose approach point
   lies outside the walls are dropped; a small penalty on the distance from the agent breaks
   near-ties toward the contact the agent is already at.
3. If the agent is in the contact's approach corridor it pushes: its target is the contact
   point's agent position moved ``lead`` pixels into the block, with ``lead`` proportional to
   ``|E|`` (slow near the goal). Otherwise it goes to a staging point behind the contact, straight
   if the path is clear of the T, else along the T's convex hull inflated by the agent's radius
   and a margin, in the direction whose path stays inside the walls (the free side), the shorter
   if both are free.

Measured with ``python -m dmuon.train.expert`` (300 steps, reset seeds 200000..200049, which
the gains were not tuned on; tuning used 100000..100079): 50 / 50 successes, median 106 steps,
about 0.13 s per episode on one CPU core.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import numpy as np

AGENT_RADIUS = 15.0  # pixels; gym_pusht's agent circle (PushTEnv.add_circle)
COG_LOCAL = (0.0, 45.0)  # the T's centre of gravity in its body frame (PushTEnv.add_tee, scale 30)
INERTIA = 3000.0  # px^2 (unit mass): PushTEnv.add_tee's moment, 2 x moment_for_poly(1, bar)
ARENA = (22.0, 489.0)  # reachable agent centres: walls at 5 / 506 with radius 2, agent radius 15
# The T's outline in its body frame (pixels), counter-clockwise in pymunk's y-down frame drawn
# on screen; index 3 and 6 are the concave corners where bar and stem meet.
OUTLINE = np.array([(-60.0, 0.0), (60.0, 0.0), (60.0, 30.0), (15.0, 30.0), (15.0, 120.0),
                    (-15.0, 120.0), (-15.0, 30.0), (-60.0, 30.0)])
_CONCAVE = (3, 6)
_HULL = OUTLINE[[0, 1, 2, 4, 5, 7]]  # convex hull of the T


def _wrap(angle: float) -> float:
    """Wraps an angle in radians into [-pi, pi)."""
    return (angle + math.pi) % (2.0 * math.pi) - math.pi


def _candidates(spacing: float) -> tuple[np.ndarray, np.ndarray]:
    """Contact points on the outline and their outward normals, in the body frame.

    Points closer than ``AGENT_RADIUS + 2`` to a concave corner (the agent circle would hit the
    other face) or than 3 px to a convex corner (ambiguous normal) are left out.

    Returns:
        ``(points [K, 2], normals [K, 2])`` float64, pixels and unit vectors.
    """
    pts, nrm = [], []
    k = len(OUTLINE)
    for i in range(k):
        a, b = OUTLINE[i], OUTLINE[(i + 1) % k]
        edge = b - a
        length = float(np.linalg.norm(edge))
        t = edge / length
        n = np.array([t[1], -t[0]])
        mid = (a + b) / 2
        if _inside(mid + 0.5 * n):  # orient outward
            n = -n
        lo = AGENT_RADIUS + 2.0 if i in _CONCAVE else 3.0
        hi = length - (AGENT_RADIUS + 2.0 if (i + 1) % k in _CONCAVE else 3.0)
        m = max(1, int(round((hi - lo) / spacing)) + 1)
        for s in np.linspace(lo, hi, m):
            pts.append(a + t * s)
            nrm.append(n)
    return np.array(pts), np.array(nrm)


def _inside(p: np.ndarray) -> bool:
    """Whether body-frame point ``p`` lies inside the T."""
    x, y = p
    return (-60 < x < 60 and 0 < y < 30) or (-15 < x < 15 and 30 <= y < 120)


_POINTS, _NORMALS = _candidates(spacing=5.0)


def _rot(angle: float) -> np.ndarray:
    c, s = math.cos(angle), math.sin(angle)
    return np.array([[c, -s], [s, c]])


@dataclasses.dataclass(slots=True)
class ScriptedPushExpert:
    """Model-based pushing policy for ``gym_pusht/PushT-v0`` (see the module docstring).

    Args:
        arm: ``L``, pixels per radian that weigh the angle error against the position error.
        gain: Push lead per pixel of ``|E|``.
        lead_min: Smallest push lead in pixels.
        lead_max: Largest push lead in pixels.
        travel_cost: Score penalty per pixel between the agent and a contact's approach point.
        corridor: Lateral tolerance in pixels of the approach corridor.
        stage: Distance in pixels behind the contact's agent position of the staging point.
        margin: Clearance in pixels added to the agent radius around the T when going around it.
        max_move: Largest target displacement in pixels per control step when travelling.
    """

    arm: float = 45.0
    gain: float = 1.0
    lead_min: float = 1.5
    lead_max: float = 30.0
    travel_cost: float = 0.003
    corridor: float = 6.0
    stage: float = 12.0
    margin: float = 10.0
    max_move: float = 40.0

    def reset(self) -> None:
        """Nothing to clear: the expert is memoryless (kept for the controller interface)."""

    def pose_error(self, env) -> np.ndarray:
        """``E``: float64 [3], (goal CoG - CoG in pixels, ``arm`` x angle error in radians)."""
        block = env.block
        cog = np.array(block.local_to_world(COG_LOCAL))
        goal = env.get_goal_pose_body(env.goal_pose)
        goal_cog = np.array(goal.local_to_world(COG_LOCAL))
        return np.array([*(goal_cog - cog), self.arm * _wrap(float(env.goal_pose[2]) - block.angle)])

    def __call__(self, env) -> np.ndarray:
        """Returns the next action for the unwrapped ``PushTEnv``.

        Args:
            env: The unwrapped ``gym_pusht.envs.PushTEnv`` (``gym_env.unwrapped``); read only.

        Returns:
            float64 array of shape [2]: target agent position in pixels, clipped to [0, 512].
        """
        block = env.block
        rot = _rot(block.angle)
        origin = np.array(block.position)
        agent = np.array(env.agent.position)
        err = self.pose_error(env)
        size = float(np.linalg.norm(err))

        pts = _POINTS @ rot.T + origin  # world frame [K, 2]
        n_out = _NORMALS @ rot.T
        cog = np.array(block.local_to_world(COG_LOCAL))
        r = pts - cog
        n_in = -n_out
        twist = np.concatenate([n_in, (self.arm / INERTIA * (r[:, 0] * n_in[:, 1] - r[:, 1] * n_in[:, 0]))[:, None]], 1)
        score = twist @ err / (np.linalg.norm(twist, axis=1) * max(size, 1e-9))
        contact = pts + n_out * AGENT_RADIUS  # agent centre touching the T at each point
        approach = contact + n_out * self.stage
        ok = np.all((approach > ARENA[0]) & (approach < ARENA[1]), axis=1)
        score = np.where(ok, score, -np.inf) - self.travel_cost * np.linalg.norm(approach - agent, axis=1)
        k = int(np.argmax(score))
        p, n, c = pts[k], n_out[k], contact[k]

        rel = agent - p
        along = float(rel @ n)
        lateral = rel - along * n
        if float(np.linalg.norm(lateral)) < self.corridor and AGENT_RADIUS - 6.0 < along < AGENT_RADIUS + 3 * self.stage:
            lead = float(np.clip(self.gain * size, self.lead_min, self.lead_max))
            return self._step_to(agent, c - n * lead, cap=along - AGENT_RADIUS + lead + self.max_move)
        staging = c + n * self.stage
        if not self._crosses(agent, staging, block):
            return self._step_to(agent, staging)
        return self._step_to(agent, self._around(agent, staging, rot, origin))

    def _step_to(self, agent: np.ndarray, target: np.ndarray, cap: float | None = None) -> np.ndarray:
        move = target - agent
        norm = float(np.linalg.norm(move))
        limit = self.max_move if cap is None else max(cap, self.max_move)
        if norm > limit:
            move *= limit / norm
        return np.clip(agent + move, 0.0, 512.0)

    def _crosses(self, a: np.ndarray, b: np.ndarray, block) -> bool:
        """Whether the agent moving from ``a`` to ``b`` (world pixels) would touch the T."""
        inv = _rot(-block.angle)
        origin = np.array(block.position)
        la, lb = inv @ (a - origin), inv @ (b - origin)
        clear = AGENT_RADIUS + 0.5
        for lo, hi in (((-60.0, 0.0), (60.0, 30.0)), ((-15.0, 30.0), (15.0, 120.0))):
            if _segment_box_distance(la, lb, np.array(lo), np.array(hi)) < clear:
                return True
        return False

    def _around(self, agent: np.ndarray, target: np.ndarray, rot: np.ndarray, origin: np.ndarray) -> np.ndarray:
        """Next waypoint along the inflated convex hull toward ``target``, on the free side."""
        import shapely.geometry as sg

        hull = sg.Polygon(_HULL @ rot.T + origin).buffer(AGENT_RADIUS + self.margin, quad_segs=4)
        ring = hull.exterior
        total = ring.length
        s_a, s_t = ring.project(sg.Point(agent)), ring.project(sg.Point(target))
        best = None
        for sign in (1.0, -1.0):
            dist = (sign * (s_t - s_a)) % total
            samples = np.array([ring.interpolate((s_a + sign * d) % total).coords[0]
                                for d in np.linspace(0.0, dist, max(2, int(dist / 10.0)))])
            blocked = int(np.sum(np.any((samples < ARENA[0]) | (samples > ARENA[1]), axis=1)))
            key = (blocked, dist)
            if best is None or key < best[0]:
                best = (key, sign, dist)
        _, sign, dist = best
        step = 30.0
        if dist <= step:  # the target is beside this stretch of the ring (e.g. in the T's concave side)
            return target
        waypoint = np.array(ring.interpolate((s_a + sign * step) % total).coords[0])
        return np.clip(waypoint, ARENA[0], ARENA[1])


def _segment_box_distance(a: np.ndarray, b: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> float:
    """Smallest distance between segment ``a``-``b`` and the axis-aligned box ``[lo, hi]`` (sampled)."""
    ts = np.linspace(0.0, 1.0, 16)[:, None]
    pts = a + ts * (b - a)
    d = np.maximum(np.maximum(lo - pts, pts - hi), 0.0)
    return float(np.min(np.linalg.norm(d, axis=1)))


def make_env(image_size: int, max_steps: int, render_size: int = 680, *, obs_type: str = "pixels_agent_pos"):
    """Creates a headless PushT environment.

    Args:
        image_size: Side in pixels of the rendered observation image (pixel observations).
        max_steps: Episode time limit in control steps (gym-pusht registers 300).
        render_size: Side in pixels of ``env.render()`` frames (gym-pusht's visualization,
            with the last action marked by a red cross); does not change observations.
        obs_type: gym-pusht's ``obs_type``: ``"pixels_agent_pos"`` (image + agent position) or
            ``"environment_state_agent_pos"`` (the T's 8 keypoints + agent position, no
            rendering: about 0.5 ms per step instead of a render per step).

    Returns:
        A ``gymnasium`` environment (``gym_pusht/PushT-v0``).

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
        obs_type=obs_type,
        render_mode="rgb_array",
        observation_width=image_size,
        observation_height=image_size,
        visualization_width=render_size,
        visualization_height=render_size,
        max_episode_steps=max_steps,
    )


def evaluate_expert(policy: str, episodes: int, max_steps: int, seed: int, *,
                    progress: bool = False) -> dict[str, float]:
    """Rolls out the expert or uniform random actions and measures coverage and success.

    Args:
        policy: ``"expert"`` or ``"random"``.
        episodes: Number of episodes.
        max_steps: Control steps per episode (an episode ends early on success).
        seed: Reset seed of the first episode (episode ``i`` uses ``seed + i``).
        progress: Show a tqdm bar over episodes.

    Returns:
        ``{"final_coverage": mean coverage at the end, "max_reward": mean best reward,
        "success_rate": fraction of episodes where gym-pusht reported ``is_success``
        (coverage > 0.95), "median_steps": median control steps per episode}``; coverage is the
        simulator's intersection-over-goal-area in [0, 1].

    Raises:
        ValueError: If ``policy`` is unknown.
    """
    from tqdm import tqdm

    if policy not in ("expert", "random"):
        raise ValueError(f"dmuon.train: policy={policy!r}; use 'expert' or 'random'.")
    env = make_env(image_size=16, max_steps=max_steps, obs_type="environment_state_agent_pos")
    expert = ScriptedPushExpert()
    rng = np.random.default_rng(seed)
    finals, bests, wins, lengths = [], [], [], []
    for ep in tqdm(range(episodes), desc=f"dmuon: {policy} rollouts", disable=not progress):
        env.reset(seed=seed + ep)
        expert.reset()
        best, coverage, success, steps = 0.0, 0.0, False, 0
        for steps in range(1, max_steps + 1):
            action = expert(env.unwrapped) if policy == "expert" else rng.uniform(0, 512, 2)
            _, reward, terminated, truncated, info = env.step(action)
            best, coverage = max(best, float(reward)), float(info["coverage"])
            success = bool(info["is_success"])
            if terminated or truncated:
                break
        finals.append(coverage)
        bests.append(best)
        wins.append(success)
        lengths.append(steps)
    env.close()
    return {
        "final_coverage": float(np.mean(finals)),
        "max_reward": float(np.mean(bests)),
        "success_rate": float(np.mean(wins)),
        "median_steps": float(np.median(lengths)),
    }


def main(argv: list[str] | None = None) -> None:
    """``python -m dmuon.train.expert``: the expert's success on held-out reset seeds."""
    p = argparse.ArgumentParser(prog="python -m dmuon.train.expert",
                                description="Measure the scripted PushT expert (or random actions).")
    p.add_argument("--policy", choices=("expert", "random"), default="expert")
    p.add_argument("--episodes", type=int, default=50)
    p.add_argument("--max-steps", type=int, default=300, help="episode limit (gym-pusht registers 300)")
    p.add_argument("--seed", type=int, default=200_000, help="reset seed of the first episode")
    a = p.parse_args(argv)
    r = evaluate_expert(a.policy, a.episodes, a.max_steps, a.seed, progress=True)
    print(f"{a.policy}: success {r['success_rate']:.3f} over {a.episodes} episodes (seeds {a.seed}.."
          f"{a.seed + a.episodes - 1}, {a.max_steps} steps), mean final coverage {r['final_coverage']:.3f}, "
          f"median steps {r['median_steps']:.0f}")


if __name__ == "__main__":
    main()
