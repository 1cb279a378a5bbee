"""Stage 8, on demand: a draft judged on the run's held-out split (`evaluation`: the judging; `task`: its Prefect
task)."""

from tasks.evaluate.task import evaluate_draft_task

__all__ = ["evaluate_draft_task"]
