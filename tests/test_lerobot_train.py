"""``python -m dmuon.integrations.lerobot.train`` (issue 41) on a local LeRobotDataset built from
dmuon's PushT demonstrations (``bench/lerobot_pusht.py``), a tiny SmolVLA, 2 gloo ranks:

- 4 steps through LeRobot's parser, factories, processors and scheduler, checkpoints at steps
  2 and 4 in LeRobot's layout; the step-4 export loads with LeRobot's ``from_pretrained`` to
  the weights of a single-process ``torch.optim.Muon`` + ``AdamW`` run of the same config
  (``lerobot_cases.entry_reference``) within 1e-5, the losses too;
- ``--resume=true --config_path=<step 2>/train_config.json`` continues exactly: the same losses
  and the same step-4 weights, bitwise.
"""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np
import pytest

pytest.importorskip("lerobot")
pytest.importorskip("datasets")  # LeRobotDataset: lerobot[dataset]
from tests import lerobot_cases as cases  # noqa: E402 - after the skips

pytestmark = [pytest.mark.lerobot, pytest.mark.slow]
POLICY = "smolvla"


@pytest.fixture(scope="module")
def local_data(tmp_path_factory):
    bench = str(pathlib.Path(__file__).resolve().parents[1] / "bench")
    sys.path.insert(0, bench)
    try:
        import lerobot_pusht
    finally:
        sys.path.remove(bench)
    root = tmp_path_factory.mktemp("lerobot")
    data = lerobot_pusht.build_dataset(root / "dataset", episodes=2, max_frames=12, image_size=32)
    tokenizer = lerobot_pusht.write_tokenizer(root / "tokenizer")
    return lerobot_pusht, root, data, tokenizer


def _argv(lp, data, out, tokenizer, steps=4):
    return lp.lerobot_args(POLICY, data, out, steps=steps, batch_size=2, image_size=32,
                           save_freq=2, tokenizer=tokenizer) + [
        "--policy.scheduler_warmup_steps=1", "--policy.scheduler_decay_steps=8",
        "--dmuon.ns_method=standard", "--dmuon.ns_coefficients=muon",
        "--dmuon.ns_dtype=float32"]


def test_entry_point_matches_reference_resumes_and_exports(dist_pool, local_data):
    lp, root, data, tokenizer = local_data
    out = root / "run"
    argv = _argv(lp, data, out, tokenizer)
    kw = dict(policy=POLICY, tokenizer=str(tokenizer))
    run = dist_pool.run(2, "tests.lerobot_cases:train_entry", dict(argv=argv, **kw), timeout_s=300)
    losses = [r["loss"] for r in run[0]]
    ckpt = out / "checkpoints"
    assert sorted(p.name for p in ckpt.iterdir()) == ["000002", "000004", "last"]
    assert json.loads((ckpt / "000004" / "training_state" / "training_step.json").read_text())["step"] == 4

    ref = cases.entry_reference_main(_argv(lp, data, root / "ref", tokenizer), **kw)
    np.testing.assert_allclose(losses, ref["losses"], rtol=1e-5)
    exported = cases.load_exported(POLICY, str(ckpt / "000004" / "pretrained_model"), str(tokenizer))
    assert set(exported) == set(ref["params"])
    worst = max(float(np.abs(exported[n] - v).max()) for n, v in ref["params"].items())
    print(f"entry point: losses {losses} vs {ref['losses']}, exported max |diff| {worst:.3g}")
    assert worst <= 1e-5
    moved = max(float(np.abs(v - ref["initial"][n]).max()) for n, v in ref["params"].items())
    assert moved > 1e-3  # the run trained

    resume = ["--resume=true", f"--config_path={ckpt / '000002' / 'pretrained_model' / 'train_config.json'}",
              "--dmuon.ns_method=standard", "--dmuon.ns_coefficients=muon",
              "--dmuon.ns_dtype=float32"]
    resumed = dist_pool.run(2, "tests.lerobot_cases:train_entry", dict(argv=resume, **kw), timeout_s=300)
    assert [r["step"] for r in resumed[0]] == [3, 4]
    assert [r["loss"] for r in resumed[0]] == losses[2:]
    again = cases.load_exported(POLICY, str(ckpt / "000004" / "pretrained_model"), str(tokenizer))
    for n, v in exported.items():
        np.testing.assert_array_equal(again[n], v, err_msg=n)
