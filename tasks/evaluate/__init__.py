"""Stage 8, on demand: a draft judged on the run's held-out split (see task.py)."""

from tasks.evaluate.task import evaluate_draft, evaluate_draft_task

__all__ = ["evaluate_draft", "evaluate_draft_task"]
