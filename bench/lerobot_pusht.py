"""LeRobot training with dmuon on local PushT demonstrations (issue 41), no hub.

Builds a ``LeRobotDataset`` (``LeRobotDataset.create`` / ``add_frame`` / ``save_episode``) from
dmuon's scripted PushT expert (:mod:`dmuon.train.expert`: gym-pusht episodes, images rendered
at ``--image-size``), then trains a tiny LeRobot policy on it through
``dmuon.integrations.lerobot.train`` (LeRobot's config parser, policy factory, processors,
scheduler and checkpoint layout) on ``--nproc`` gloo CPU ranks, and writes the per-step losses
to ``bench/results/lerobot_pusht_<policy>.json``::

    python bench/lerobot_pusht.py --policy pi0 --steps 40 --nproc 2
    python bench/lerobot_pusht.py --policy smolvla --steps 40 --nproc 2

"Tiny": LeRobot's own pi0 / SmolVLA classes with the pretrained backbones shrunk
(:func:`lerobot_tiny.tiny`: 2-layer Gemmas 32 wide, a 1-layer SigLIP; a
2-layer SmolVLM) and a word-level tokenizer written to a local directory, since LeRobot's
processors would otherwise download PaliGemma's / SmolVLM2's tokenizer. The ranks are started
by :func:`dmuon.train.ranks.launch`; rank 0 writes the per-step records (``--dmuon.metrics``).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TASK = "push the grey t block onto the green target"


def build_dataset(root: pathlib.Path, *, episodes: int, max_frames: int, image_size: int,
                  seed: int = 0) -> pathlib.Path:
    """A local LeRobotDataset of ``episodes`` scripted PushT demonstrations (each cut to its
    first ``max_frames`` control steps): ``observation.image`` [3, S, S], ``observation.state``
    (agent position, pixels) and ``action`` (the expert's target, pixels), 10 fps."""
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    from dmuon.train.expert import ScriptedPushExpert, make_env

    features = {
        "observation.image": {"dtype": "image", "shape": (image_size, image_size, 3),
                              "names": ["height", "width", "channel"]},
        "observation.state": {"dtype": "float32", "shape": (2,), "names": ["x", "y"]},
        "action": {"dtype": "float32", "shape": (2,), "names": ["x", "y"]},
    }
    ds = LeRobotDataset.create("local/pusht_dmuon", fps=10, features=features, root=root,
                               use_videos=False)
    env = make_env(image_size, 300)
    expert = ScriptedPushExpert()
    for ep in range(episodes):
        obs, _ = env.reset(seed=seed + ep)
        expert.reset()
        for _ in range(max_frames):
            action = np.asarray(expert(env.unwrapped), dtype=np.float32)
            ds.add_frame({"observation.image": obs["pixels"],
                          "observation.state": np.asarray(obs["agent_pos"], dtype=np.float32),
                          "action": action, "task": TASK})
            obs, _, terminated, truncated, _ = env.step(action)
            if terminated or truncated:
                break
        ds.save_episode()
    ds.finalize()
    env.close()
    return root


def write_tokenizer(path: pathlib.Path, vocab_size: int = 128) -> pathlib.Path:
    """A word-level tokenizer (the task's words, padding, unknown) saved where LeRobot's
    ``TokenizerProcessorStep`` loads it with ``AutoTokenizer.from_pretrained``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<unk>", "<bos>", "<eos>"] + sorted(set(TASK.split() + ["\n"]))
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
                                   bos_token="<bos>", eos_token="<eos>")
    fast.save_pretrained(path)
    return path


def lerobot_args(policy: str, dataset_root: pathlib.Path, output_dir: pathlib.Path, *,
                 steps: int, batch_size: int, image_size: int, save_freq: int,
                 tokenizer: pathlib.Path | None) -> list[str]:
    """``lerobot-train`` arguments for a tiny ``policy`` on the local dataset."""
    args = [f"--dataset.repo_id=local/pusht_dmuon", f"--dataset.root={dataset_root}",
            f"--policy.type={policy}", "--policy.device=cpu", "--policy.push_to_hub=false",
            f"--output_dir={output_dir}", f"--steps={steps}", f"--batch_size={batch_size}",
            "--num_workers=0", "--seed=1", "--log_freq=1", f"--save_freq={save_freq}",
            "--wandb.enable=false", "--dataset.image_transforms.enable=false"]
    if policy in ("pi0", "pi05"):
        args += ["--policy.chunk_size=4", "--policy.n_action_steps=4",
                 f"--policy.image_resolution=[{image_size},{image_size}]",
                 "--policy.tokenizer_max_length=12", "--policy.max_state_dim=8",
                 "--policy.max_action_dim=8", "--policy.dtype=float32"]
    if policy == "smolvla":
        args += ["--policy.chunk_size=4", "--policy.n_action_steps=4",
                 f"--policy.resize_imgs_with_padding=[{image_size},{image_size}]",
                 "--policy.tokenizer_max_length=12", "--policy.max_state_dim=8",
                 "--policy.max_action_dim=8", "--policy.num_vlm_layers=2",
                 f"--policy.vlm_model_name={tokenizer}"]
    if policy == "act":
        args += ["--policy.chunk_size=4", "--policy.n_action_steps=4", "--policy.dim_model=32",
                 "--policy.n_heads=2", "--policy.dim_feedforward=64",
                 "--policy.n_encoder_layers=2", "--policy.n_decoder_layers=1",
                 "--policy.n_vae_encoder_layers=1", "--policy.latent_dim=8",
                 "--policy.pretrained_backbone_weights=null"]
    return args


def train_rank(arg: tuple[list[str], str, str]) -> None:
    """One rank (process group initialized by :func:`dmuon.train.ranks.launch`):
    :func:`lerobot_tiny.train_tiny` on ``arg = (argv, policy, tokenizer)``."""
    from lerobot_tiny import train_tiny

    train_tiny(*arg)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policy", default="pi0", choices=["pi0", "pi05", "smolvla", "act"])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--episodes", type=int, default=4)
    p.add_argument("--max-frames", type=int, default=60)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--param-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--overlap", default="off", choices=["off", "forward", "backward"],
                   help="dmuon.Muon(overlap=...); the result counts rank 0's speculations kept")
    p.add_argument("--clip", type=float, default=None,
                   help="the policy preset's gradient clip norm (pi0, pi05, SmolVLA; default: LeRobot's)")
    p.add_argument("--workdir", default="/tmp/dmuon_lerobot_pusht")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    work = pathlib.Path(a.workdir)
    data = work / "dataset"
    if not (data / "meta" / "info.json").exists():
        t = time.perf_counter()
        build_dataset(data, episodes=a.episodes, max_frames=a.max_frames, image_size=a.image_size)
        print(f"dataset: {data} ({time.perf_counter() - t:.1f}s)")
    tokenizer = write_tokenizer(work / "tokenizer")
    out_dir = work / f"run_{a.policy}_{int(time.time())}"
    metrics = work / f"metrics_{a.policy}.json"
    argv = lerobot_args(a.policy, data, out_dir, steps=a.steps, batch_size=a.batch_size,
                        image_size=a.image_size, save_freq=a.steps, tokenizer=tokenizer)
    argv += [f"--dmuon.lr={a.lr}", f"--dmuon.metrics={metrics}",
             f"--dmuon.param_dtype={a.param_dtype}", f"--dmuon.overlap={a.overlap}"]
    if a.clip is not None:
        argv.append(f"--policy.optimizer_grad_clip_norm={a.clip}")
    from dmuon.train.ranks import exit_on_rank_failure, launch

    metrics.unlink(missing_ok=True)  # rank 0 writes it anew
    t = time.perf_counter()
    with exit_on_rank_failure("bench/lerobot_pusht.py"):
        launch(train_rank, (argv, a.policy, str(tokenizer)), a.nproc, backend="gloo",
               torchrun=False)
    wall = time.perf_counter() - t
    records = json.loads(metrics.read_text())
    losses = [r["loss"] for r in records]
    import lerobot
    import torch

    result = dict(policy=a.policy, ranks=a.nproc, backend="gloo", device="cpu",
                  steps=a.steps, global_batch=a.batch_size * a.nproc, dmuon_lr=a.lr,
                  param_dtype=a.param_dtype, overlap=a.overlap, clip=a.clip,
                  grad_norms=[round(r["grad_norm"], 4) for r in records],
                  speculation_rank0={k.removeprefix("speculation_"): v for k, v in records[-1].items()
                                     if k.startswith("speculation_")},
                  dataset=dict(episodes=a.episodes, max_frames=a.max_frames,
                               image_size=a.image_size),
                  versions=dict(torch=torch.__version__, lerobot=lerobot.__version__,
                                python=sys.version.split()[0]),
                  wall_s=round(wall, 1), losses=[round(x, 5) for x in losses],
                  first5_mean=float(np.mean(losses[:5])), last5_mean=float(np.mean(losses[-5:])),
                  command=" ".join(["python", "bench/lerobot_pusht.py", *sys.argv[1:]]))
    path = pathlib.Path(a.out or ROOT / "bench" / "results" / f"lerobot_pusht_{a.policy}.json")
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "losses"}, indent=1))


if __name__ == "__main__":
    main()
