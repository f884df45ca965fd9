"""Policy sources: heuristics, exact solvers, Optuna and reinforcement-learning searchers."""
