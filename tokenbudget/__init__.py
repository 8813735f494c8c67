"""tokenbudget: exact per-dataset token budgets for synthetic data generation."""

__version__ = "0.1.0"
