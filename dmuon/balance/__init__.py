"""Owner assignment: cost model, profiler, MILP and greedy solvers, XOR owner layout.

Never imports ``torch.distributed``; torch itself is only imported by the profiler.
"""

from dmuon.balance.assignment import evaluate, greedy, makespan_lower_bound, trivial_lower_bound
from dmuon.balance.solver import AUTO_MAX_INTEGER_VARS, Assignment, solve

__all__ = [
    "AUTO_MAX_INTEGER_VARS",
    "Assignment",
    "evaluate",
    "greedy",
    "makespan_lower_bound",
    "solve",
    "trivial_lower_bound",
]
