"""The Prefect task of stage 8: the evaluation, and an artifact of it in the UI.

The evaluation (torch, the draft's model code) is imported when a draft is judged, not with the flow.
"""

from __future__ import annotations

import base64
import posixpath
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from eagle3_datagen.artifacts import EVALUATIONS, ui_key
from eagle3_datagen.storage import RunStore


@task(name="evaluate-draft", task_run_name="evaluate-{draft}", cache_policy=NO_CACHE)
def evaluate_draft_task(run: str, draft: str, steps: int | None = None) -> dict[str, Any]:
    """Prefect stage 8: the evaluation, and an artifact of it in the UI."""
    import torch

    from tasks.evaluate.evaluation import evaluate_draft, evaluation_markdown

    summary = evaluate_draft(run, draft, steps, "cuda" if torch.cuda.is_available() else "cpu")
    store = RunStore.at(run)
    plot = store.read_bytes(posixpath.join(EVALUATIONS, summary["name"], "acceptance.png"))
    create_markdown_artifact(
        key=ui_key(posixpath.basename(store.uri.rstrip("/")), f"evaluation-{summary['name']}"),
        markdown=evaluation_markdown(summary, f"data:image/png;base64,{base64.b64encode(plot).decode()}"),
        description=f"draft {summary['name']} judged on the held-out split of {store.uri}")
    return {key: value for key, value in summary.items() if key != "rows"}
