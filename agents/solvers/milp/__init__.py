"""Keep / swap / recompute (/ compress) per unit of activations by mixed-integer linear programming, with
HiGHS: ``highs`` (the solver's wrapper), ``data`` (decision units and their costs), ``model`` (the MILP,
NOTE [ MILP model ]), ``searcher`` (the registered ``milp`` searcher, with its repairs)."""

from agents.solvers.milp.searcher import MilpSearcher

__all__ = ["MilpSearcher"]
