"""The no-policy baseline: keep every saved activation, as PyTorch does by default.

Not a paper: the yardstick every other searcher is measured against. Its status is ``INFEASIBLE`` when the
no-policy peak exceeds the budget (the base class reads it from the simulated peak).
"""

from __future__ import annotations

from agents.base import Problem, Proposal, SearchContext, Searcher, register


@register
class KeepAll(Searcher):
    """Keep everything: no swap, no recompute, no compression."""

    name = "none"
    summary = "Keep every saved activation (PyTorch's default; the no-policy baseline)"

    def _search(self, problem: Problem, ctx: SearchContext) -> Proposal:
        return Proposal(problem.keep_all(), note="keep all")
