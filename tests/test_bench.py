"""Smoke and model tests of bench/bench_step.py and bench/simulate.py (CI small mode, < 30 s).

The benchmark runs the tiny model on 2 gloo ranks for one measured step per variant; the
simulator's collective formulas are checked against hand-computed values, its plan against the
FLOP model's bounds, and its CLI end to end in tiny mode.
"""

from __future__ import annotations

import json
import math
import pathlib
import sys

import pytest
import torch

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import sim_model  # noqa: E402
import simulate  # noqa: E402


def _bench_rank(rank: int, world_size: int) -> dict | None:
    """Pool worker: bench_step's per-rank body on the pool's gloo world (no process spawn)."""
    import bench_step

    cfg = bench_step.BenchConfig(nproc=world_size, rounds=2, block_steps=1, batch_size=4, tiny=True)
    return bench_step._run_rank(rank, cfg)


@pytest.fixture(scope="module")
def tiny_step(dist_pool):
    return dist_pool.run(2, "tests.test_bench:_bench_rank", {}, timeout_s=120, isolated=True)[0]


def test_bench_step_same_model_and_data_for_every_variant(tiny_step):
    # Step 0 is a forward on batch 0 before any update: identical models see identical data,
    # so the three losses agree (they diverge afterwards, the optimizers differ).
    first = [tiny_step["variants"][v]["losses"][0] for v in ("adamw", "vanilla", "dmuon")]
    assert first[0] == pytest.approx(first[1], rel=1e-6) and first[0] == pytest.approx(first[2], rel=1e-6)
    assert all(math.isfinite(x) for v in tiny_step["variants"].values() for x in v["losses"])
    assert tiny_step["variants"]["dmuon"]["losses"][1] != pytest.approx(first[2], rel=1e-9)


def test_bench_step_phases_and_waits(tiny_step):
    v = tiny_step["variants"]
    for name in ("adamw", "vanilla", "dmuon", "adamw_b"):
        assert v[name]["measured_steps"] == 2  # 2 rounds x 1 measured step
        # Each phase is a max over the 2 ranks, and each rank's phases add up to its total, so
        # max(total) <= sum of the phases' maxes <= sum of the 2 totals <= 2 max(total).
        parts = sum(v[name][k]["median_s"] for k in ("forward", "backward", "step"))
        total = v[name]["total"]["median_s"]
        assert total * (1 - 1e-9) <= parts <= 2 * total * (1 + 1e-9), (name, parts, total)
    # the breakdown: dmuon's record_function labels, read by torch.profiler on the profiled step
    assert v["vanilla"]["profiled_steps"] == 2
    assert 0 < v["vanilla"]["label_vanilla_all_gather_step"]["median_s"]
    assert 0 < v["vanilla"]["ns"]["median_s"] and 0 < v["dmuon"]["ns"]["median_s"]
    for label in ("pre_forward_forward", "finish_backward_backward", "reduce_bucket_backward",
                  "newton_schulz_step", "publish_after_step_step"):
        assert v["dmuon"][f"label_{label}"]["median_s"] > 0, label
    owners = {m["owner"] for m in tiny_step["dedicated_matrices"]}
    assert owners <= {0, 1} and tiny_step["calibration"]["ns_s"]


def test_bench_step_aa_control_and_per_round_ratios(tiny_step):
    """The A/A control: adamw_b is the baseline built again (same weights, same batches: the
    same losses step for step), run interleaved; every ratio is a median of per-round ratios
    recomputed here from the per-round times, with quartiles, and a verdict against the floor."""
    import step_stats

    v, rr = tiny_step["variants"], tiny_step["round_ratios"]
    assert v["adamw_b"]["losses"] == v["adamw"]["losses"]  # bit-identical: the same baseline twice
    assert tiny_step["round_orders"] == [["adamw", "vanilla", "adamw_b", "dmuon"],
                                         ["vanilla", "dmuon", "adamw", "adamw_b"]]
    assert (rr["baseline"], rr["control"], rr["rounds"]) == ("adamw", "adamw_b", 2)
    assert set(rr["ratios"]) == {"vanilla_over_adamw", "dmuon_over_adamw", "adamw_b_over_adamw",
                                 "dmuon_over_vanilla"}
    assert step_stats.all_finite_positive(rr)
    for phase in step_stats.PHASES:
        aa = rr["ratios"]["adamw_b_over_adamw"][phase]
        assert len(aa["per_round"]) == 2 and aa["q1"] <= aa["median"] <= aa["q3"]
        assert aa["median"] == pytest.approx(sum(aa["per_round"]) / 2)  # median of two rounds
        assert rr["noise_floor"][phase] == pytest.approx(max(abs(aa[k] - 1) for k in ("q1", "median", "q3")))
        d = rr["ratios"]["dmuon_over_adamw"][phase]
        assert d["verdict"] == ("not distinguishable" if abs(d["median"] - 1) <= rr["noise_floor"][phase]
                                else "slower" if d["median"] > 1 else "faster")
    # the old fields (bench/simulate.py, sim_validate.py, gpu_suite read them) are still there
    assert tiny_step["ratios"]["dmuon_total_over_adamw_total"] > 0
    load = tiny_step["load_average"]
    assert len(load["before"]) == 3 and len(load["after"]) == 3


def test_step_stats_against_hand_computed_values():
    import step_stats

    # per-round ratio, not ratio of medians: round 0 runs 2x slower for both variants
    base = {0: 2.0, 1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0}
    num = {0: 2.2, 1: 1.1, 2: 1.0, 3: 1.3, 4: 0.9}
    s = step_stats.ratio_stats(num, base)
    assert s["per_round"] == pytest.approx([1.1, 1.1, 1.0, 1.3, 0.9])
    assert (s["q1"], s["median"], s["q3"]) == pytest.approx((1.0, 1.1, 1.1))  # inclusive quartiles
    aa = {"q1": 0.97, "median": 1.01, "q3": 1.08}
    assert step_stats.noise_floor(aa) == pytest.approx(0.08)
    assert step_stats.verdict({"median": 1.07}, 0.08) == "not distinguishable"
    assert step_stats.verdict({"median": 1.09}, 0.08) == "slower"
    assert step_stats.verdict({"median": 0.90}, 0.08) == "faster"
    with pytest.raises(ValueError, match="no common round"):
        step_stats.ratio_stats({0: 1.0}, {1: 1.0})
    with pytest.raises(ValueError, match="adamw_b"):
        step_stats.round_ratios({"adamw": [[]]})


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_round_order_balances_positions_and_predecessors(n):
    """A Williams design: over one cycle every variant holds every position equally often and
    follows every other variant equally often (counted by hand for n = 4: 12 ordered pairs,
    once each)."""
    import collections

    import step_stats

    variants = tuple("abcde"[:n])
    cycle = step_stats.design_rounds(n)
    orders = [step_stats.round_order(variants, r) for r in range(cycle)]
    if n == 4:
        assert orders == [("a", "b", "d", "c"), ("b", "c", "a", "d"), ("c", "d", "b", "a"), ("d", "a", "c", "b")]
    for v in variants:
        assert collections.Counter(o.index(v) for o in orders) == {p: cycle // n for p in range(n)}
    pairs = collections.Counter((o[i], o[i + 1]) for o in orders for i in range(n - 1))
    assert len(pairs) == n * (n - 1) and len(set(pairs.values())) <= 1
    assert step_stats.round_order(variants, cycle) == orders[0]


def _bench_replicate(rank: int, world_size: int) -> dict | None:
    import bench_step

    cfg = bench_step.BenchConfig(nproc=world_size, rounds=1, block_steps=1, batch_size=4, tiny=True,
                                 calibrate=False, mesh="replicate")
    return bench_step._run_rank(rank, cfg)


def test_bench_step_replicate_mode(dist_pool):
    """--mesh replicate: AdamW and vanilla under torch DDP, dmuon's DDP-style path; the same
    first batch with the same weights gives the same first loss, and dmuon issues one reduce
    and one broadcast per bucket (the JSON says how many)."""
    out = dist_pool.run(2, "tests.test_bench:_bench_replicate", {}, timeout_s=120, isolated=True)[0]
    v = out["variants"]
    # the A/A control on the replicated path is DDP + AdamW twice: the same losses
    assert v["adamw_b"]["losses"] == v["adamw"]["losses"]
    assert out["round_ratios"]["ratios"]["adamw_b_over_adamw"]["total"]["median"] > 0
    first = [v[name]["losses"][0] for name in ("adamw", "vanilla", "dmuon")]
    assert first[1] == pytest.approx(first[0], rel=1e-6) and first[2] == pytest.approx(first[0], rel=1e-6)
    assert out["mesh"] == "replicate" and "keep" in out["dmuon_collectives"]["publish"]
    assert out["dmuon_collectives"]["buckets"] == out["dmuon_collectives"]["publish_groups"] >= 2
    assert v["dmuon"]["label_reduce_bucket_backward"]["median_s"] > 0
    assert "label_pre_backward_backward" not in v["dmuon"]  # nothing is published in backward


def _bench_single(rank: int, world_size: int) -> dict | None:
    import bench_step

    cfg = bench_step.BenchConfig(nproc=1, rounds=1, block_steps=1, batch_size=4, tiny=True,
                                 calibrate=False, extra_variants=("torch_muon",))
    return bench_step._run_rank(rank, cfg)


def test_bench_step_single_rank_against_torch_muon(dist_pool):
    """World size 1 (the single-GPU mode, here on CPU): torch.optim.Muon + AdamW on the unsharded
    model sees the same first batch with the same weights, so its first loss equals the others'."""
    out = dist_pool.run(1, "tests.test_bench:_bench_single", {}, timeout_s=120, isolated=True)[0]
    first = {v: out["variants"][v]["losses"][0] for v in ("adamw", "vanilla", "dmuon", "torch_muon")}
    assert all(x == pytest.approx(first["adamw"], rel=1e-6) for x in first.values()), first
    assert out["variants"]["torch_muon"]["losses"][1] != pytest.approx(first["torch_muon"], rel=1e-9)
    assert out["ratios"]["dmuon_total_over_torch_muon_total"] > 0
    assert out["backend"] == "gloo" and out["calibration"] is None


def test_bench_step_command_line_defaults_and_refusals():
    import bench_step

    default = bench_step.parse_args([])
    assert (default.nproc, default.rounds, default.block_steps, default.batch_size) == (4, 4, 2, 64)
    assert default.control and default.warmup_steps == 1 and default.trace_dir is None
    assert not bench_step.parse_args(["--no-control"]).control
    tiny = bench_step.parse_args(["--tiny", "--nproc", "2", "--extra", "dmuon_allreduce", "dmuon_keep"])
    assert (tiny.nproc, tiny.batch_size, tiny.tiny) == (2, 8, True)
    assert tiny.extra_variants == ("dmuon_allreduce", "dmuon_keep")
    with pytest.raises(SystemExit):
        bench_step.parse_args(["--extra", "dmuon_fast"])
    with pytest.raises(ValueError, match="batch_size"):
        bench_step.parse_args(["--nproc", "3"])  # 64 samples do not split over 3 ranks
    assert default.device == "cpu"
    with pytest.raises(ValueError, match="nproc=1"):
        bench_step.parse_args(["--nproc", "2", "--extra", "torch_muon"])
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"needs 1 GPU\(s\)"):
            bench_step.parse_args(["--device", "cuda", "--nproc", "1"])


def test_alpha_beta_matches_hand_computation():
    h = sim_model.H100
    intra, inter = sim_model.AlphaBeta(h, 8), sim_model.AlphaBeta(h, 16)
    assert intra.bw == pytest.approx(450e9 * 0.8)
    assert inter.bw == pytest.approx(400e9 / 8 * 0.8)  # one 400 Gb/s NIC per GPU
    assert inter.all_gather(1e9) == pytest.approx(15 * 10e-6 + 1e9 * 15 / 16 / 40e9)
    assert inter.broadcast(1e9) == pytest.approx(15 * 10e-6 + 1e9 / 40e9)
    a800 = sim_model.AlphaBeta(sim_model.A800, 32)
    assert a800.bw == pytest.approx(4 * 25e9 / 8 * 0.8)  # 4 x 200 Gb/s per 8 GPUs
    assert sim_model.AlphaBeta(h, 1).all_gather(1e9) == 0.0


def test_fitted_comm_recovers_line_and_exposure_rule():
    pts = [[n, 1e-4 + 2e-9 * n] for n in (1e3, 1e5, 1e6)]
    fit = sim_model.FittedComm({"broadcast": pts, "reduce": pts, "all_gather": pts}, p=4)
    assert fit.fit["broadcast"] == pytest.approx((1e-4, 2e-9))
    assert fit.all_gather(4e6) == pytest.approx(1e-4 + 2e-9 * 1e6)  # per-rank input = n / p
    assert sim_model.exposed([1.0, 2.0, 3.0], compute=4.0, overlap=1.0) == pytest.approx(1.0 + 1.0)
    assert sim_model.exposed([1.0, 2.0, 3.0], compute=4.0, overlap=0.0, tail=True) == pytest.approx(6.0)


def test_predict_bounds_from_flop_model():
    work = simulate.workloads()["qwen2.5-7b"]
    row = simulate.predict_one(work, sim_model.H100, 8, method="greedy")
    rate = sim_model.H100.peak_flops * sim_model.H100.mfu_ns
    p, q = 3584, 18944  # the MLP matrices; Gram NS, 5 steps, one restart: 8 p^2 q + 28 p^3
    largest = (8 * p * p * q + 28 * p**3) / rate
    assert row["dmuon"]["optimizer"] >= largest
    total_ns = sum(simulate.ns_flops(r, c, steps=5, method="gram") for _, (r, c) in
                   simulate.inventory("qwen2.5-7b")) / rate
    assert row["dmuon"]["optimizer"] >= total_ns / 8
    assert row["vanilla"]["optimizer"] >= total_ns
    assert row["adamw"]["total"] <= row["dmuon"]["total"] <= row["vanilla"]["total"]


def test_simulate_cli_tiny(tmp_path, capsys):
    out = tmp_path / "sim.json"
    simulate.main(["--tiny", "--out", str(out)])
    data = json.loads(out.read_text())
    assert [r["gpus"] for r in data["rows"]] == [8, 16]
    assert out.with_suffix(".png").stat().st_size > 1000
    assert "SIMULATED" in capsys.readouterr().out


def test_fixed_global_batch_accumulates_and_amortizes_the_optimizer():
    """A 4M-token global batch at 8 GPUs is 32 micro-batches of 16,384 tokens: compute and
    FSDP2/dmuon communication repeat 32 times, the optimizer step (NS makespan) runs once."""
    weak = simulate.predict(("qwen2.5-7b",), ("h100",), (8,), method="greedy")[0]
    fixed = simulate.predict(("qwen2.5-7b",), ("h100",), (8,), method="greedy",
                             global_tokens=simulate.GLOBAL_TOKENS)[0]
    assert (weak["micro_batches"], fixed["micro_batches"]) == (1, 32)
    for variant in ("adamw", "dmuon"):
        assert fixed[variant]["forward_compute"] == pytest.approx(32 * weak[variant]["forward_compute"])
        assert fixed[variant]["optimizer"] == pytest.approx(weak[variant]["optimizer"])
    extra = lambda r: r["dmuon"]["total"] - r["adamw"]["total"]  # noqa: E731
    assert fixed["dmuon_over_adamw"] - 1 < (weak["dmuon_over_adamw"] - 1) / 4
    assert extra(fixed) >= extra(weak)  # the NS time is still paid, once, plus per-pass comm
    with pytest.raises(ValueError, match="qwen2.5-7b"):
        simulate.predict(("pi0",), ("h100",), (8,), global_tokens=simulate.GLOBAL_TOKENS)


def test_replicated_path_model_bytes_and_optimizer():
    """Replicated path (--replicated): DDP's backward is the ring all-reduce of every gradient;
    dmuon's is one reduce per matrix bucket (half its bytes) plus the others' all-reduce, and
    its broadcasts go to forward. NS: vanilla runs all of it on every rank, dmuon the most
    loaded owner's share, at least total / p."""
    work = simulate.workloads()["pi0"]
    cluster = sim_model.H100
    row = simulate.predict_replicated(work, cluster, 8)
    comm = sim_model.AlphaBeta(cluster, 8)
    matrix_bytes = 4 * sum(r * c for _, (r, c) in simulate.inventory("pi0"))
    assert row["buckets"] >= 8 and row["ns_share_max"] < 0.2
    # every byte of the matrices is broadcast once (forward list) and reduced once (backward)
    fwd = row["dmuon"]["exposed_comm_forward"]
    assert 0 < fwd <= matrix_bytes / comm.bw + row["buckets"] * 7 * comm.alpha
    rate = cluster.peak_flops * cluster.mfu_ns
    total_ns = sum(simulate.ns_flops(r, c, steps=5, method="gram") for _, (r, c) in
                   simulate.inventory("pi0")) / rate
    assert row["vanilla"]["optimizer"] >= total_ns
    assert total_ns / 8 <= row["dmuon"]["optimizer"] < row["vanilla"]["optimizer"] / 4
    assert row["adamw"]["exposed_comm_forward"] == 0


def test_simulate_measured_compute_with_modelled_nccl():
    """--measured (issue 25): a rank view's per-phase times are the compute side, the
    collectives the alpha-beta model; with no overlap, the exposed communication adds up."""
    import dataclasses

    import bench_step

    phases = {"forward": 0.05, "backward": 0.1, "step": 0.02}
    view = {"world": 8, "rank": 3, "device": "cpu (test)", "model": "tiny", "layers_note": None,
            "model_description": {"kind": "Pi0Policy", "config": dataclasses.asdict(bench_step.TINY_MODEL)},
            "variants": {v: {ph: {"median_s": t * (1.5 if v == "dmuon" else 1)} for ph, t in phases.items()}
                         for v in ("adamw", "dmuon")}}
    row = simulate.predict_measured(view, sim_model.CLUSTERS["h100"], overlap=0.0)
    assert row["gpus"] == 8 and row["rank"] == 3
    for v, k in (("adamw", 1.0), ("dmuon", 1.5)):
        r = row[v]
        assert r["forward_compute"] == pytest.approx(0.05 * k) and r["optimizer"] == pytest.approx(0.02 * k)
        assert r["exposed_comm_forward"] > 0 and r["exposed_comm_backward"] > 0
        assert r["total"] == pytest.approx(sum(phases.values()) * k + r["exposed_comm_forward"]
                                           + r["exposed_comm_backward"])
    assert row["dmuon_over_adamw"] == pytest.approx(row["dmuon"]["total"] / row["adamw"]["total"])


def test_overlap_delay_replays_a_hand_computed_schedule():
    """Two ranks, two units: rank 0 owns a 3 s matrix of unit 0 and a 2 s one of unit 1, rank 1
    a 1 s one of unit 0; forward 1 s then 5 s; NS at half speed beside a forward. Forward 0 waits 3 s (NS at full speed), during
    its 1 s rank 0 does 0.5 s of unit 1's 2 s, so forward 1 waits 1.5 s more: 4.5 s."""
    import sim_overlap

    got = sim_overlap.overlap_delay([0, 1, 0], [3.0, 1.0, 2.0], [(2, 2), (3, 3), (4, 4)], [0, 0, 1],
                                    [1.0, 5.0], 2, ns_call_s=0.0, rate=0.5)
    assert got == pytest.approx(4.5)
    # a batch overhead per (rank, unit, shape): rank 0's unit 0 pays 0.25 s once more
    got = sim_overlap.overlap_delay([0, 1, 0], [3.0, 1.0, 2.0], [(2, 2), (3, 3), (4, 4)], [0, 0, 1],
                                    [1.0, 5.0], 2, ns_call_s=0.25, rate=0.5)
    assert got == pytest.approx(3.25 + 1.75)


def test_overlap_row_hides_ns_behind_the_next_forward():
    """Qwen2.5-7B on 8 H100s: the overlapped step drops the NS makespan from the optimizer phase
    and stalls at least for the largest matrix of layer 0 (due at once, at full speed) and at most
    for the makespan plan's NS; its total is its phases plus that stall."""
    work = simulate.workloads()["qwen2.5-7b"]
    row = simulate.predict_one(work, sim_model.H100, 8, method="greedy")
    rate = sim_model.H100.peak_flops * sim_model.H100.mfu_ns
    p, q = 3584, 18944
    largest = (8 * p * p * q + 28 * p**3) / rate + sim_model.H100.ns_call_s
    ov, d = row["dmuon_overlap"], row["dmuon"]
    assert largest * (1 - 1e-9) <= ov["exposed_ns"] <= row["plan"]["makespan_s"]
    assert ov["optimizer"] < d["optimizer"] - row["plan"]["makespan_s"] + 1e-3
    parts = ov["forward_compute"] + ov["backward_compute"] + ov["exposed_comm_forward"] \
        + ov["exposed_comm_backward"] + ov["optimizer"] + ov["exposed_ns"]
    assert ov["total"] == pytest.approx(parts)
    assert row["adamw"]["total"] < ov["total"] < d["total"]
    assert row["dmuon_overlap_over_adamw"] == pytest.approx(ov["total"] / row["adamw"]["total"])
    assert set(row["overlap"]["sensitivity_over_adamw"]) == {"1.0", "0.3"}
