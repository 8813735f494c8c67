"""The old name of :mod:`streams.budget_board`, kept only while producers/dispatcher.py
and producers/admission.py import it from here (issue 31): remove it once they import
``streams.budget_board``."""

from __future__ import annotations

from streams.budget_board import BudgetBoard

__all__ = ["BudgetBoard"]
