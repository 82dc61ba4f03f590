"""Profile analysis for ``bench/rank_view.py``: CPU time and aten ops inside dmuon's and FSDP2's
hook labels, and the CPU allocation peak, from ``torch.profiler`` events."""

from __future__ import annotations

from collections import Counter
from typing import Any

#: dmuon labels that are the optimizer's math, not hooks (reported apart, in the step phase).
OPTIMIZER_LABELS = ("dmuon::optimizer_step", "dmuon::newton_schulz", "dmuon::adamw",
                    "dmuon::vanilla_all_gather", "dmuon::vanilla_newton_schulz", "dmuon::vanilla_adamw",
                    "dmuon::vanilla_apply")


def _ancestors(evt) -> list:
    out, p = [], evt.cpu_parent
    while p is not None:
        out.append(p)
        p = p.cpu_parent
    return out


def analyze(events, phase: str) -> dict:
    """Hook CPU time and dispatched ops in one phase's profiler events.

    ``dmuon_hooks_cpu_s``: inclusive CPU time of the outermost ``dmuon::*`` labels that are not
    the optimizer's math (:data:`OPTIMIZER_LABELS`); ``fsdp_hooks_cpu_s``: of the outermost
    ``FSDP::*`` labels. ``*_aten_ops``: aten ops inside them with no aten op above (what the
    hooks dispatch themselves; an op's own sub-ops are not counted again). ``*_kernel_launches``
    (CUDA): ``cudaLaunchKernel``-like runtime calls inside them.
    """
    out: dict[str, Any] = {}
    for family, prefix in (("dmuon", "dmuon::"), ("fsdp", "FSDP::")):
        def is_hook(e) -> bool:
            return e.name.startswith(prefix) and e.name not in OPTIMIZER_LABELS

        outer = [e for e in events if is_hook(e) and not any(a.name.startswith(prefix) for a in _ancestors(e))]
        by_label: Counter = Counter()
        calls: Counter = Counter()
        for e in outer:
            by_label[e.name] += e.cpu_time_total * 1e-6
            calls[e.name] += 1
        ops = 0
        launches = 0
        op_names: Counter = Counter()
        for e in events:
            anc = _ancestors(e)
            if not any(is_hook(a) for a in anc):
                continue
            if e.name.startswith("aten::") and not any(a.name.startswith("aten::") for a in anc):
                ops += 1
                op_names[e.name] += 1
            if "LaunchKernel" in e.name:
                launches += 1
        out[f"{family}_hooks_cpu_s"] = sum(by_label.values())
        out[f"{family}_hook_labels_cpu_s"] = dict(by_label)
        out[f"{family}_hook_calls"] = dict(calls)
        out[f"{family}_aten_ops"] = ops
        out[f"{family}_aten_op_names"] = dict(op_names.most_common(12))
        out[f"{family}_kernel_launches"] = launches
    if phase == "step":
        out["dmuon_optimizer_cpu_s"] = {name: sum(e.cpu_time_total for e in events if e.name == name) * 1e-6
                                        for name in OPTIMIZER_LABELS}
    return out


def cpu_peak_bytes(events) -> float | None:
    """Largest running sum of the profiler's memory records (bytes above the phase's start)."""
    mem = sorted((e.time_range.start, e.self_cpu_memory_usage) for e in events if e.self_cpu_memory_usage)
    if not mem:
        return None
    run, peak = 0, 0
    for _, b in mem:
        run += b
        peak = max(peak, run)
    return float(peak)
