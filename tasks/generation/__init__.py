"""Stage 3: chat completions for every prompt, reasoning and answer, with one in-flight budget per endpoint.

`scheduler` sends the requests, `pool` shares the budget and backs off failing endpoints, `budget` moves it with
the server's load (`server.max_in_flight: auto`), `probation` judges the first answers before the run may spend
more, and `records` keeps what was answered (partial logs, finished shards, the settings a run is pinned to).
"""

from __future__ import annotations

from tasks.generation.records import (
    GenerationError,
    GenerationSettings,
    refuse_other_settings,
    unfinished_shards,
    unmarked_shards,
)
from tasks.generation.scheduler import generate_shards
from tasks.generation.task import GenerationJob, GenerationOutcome, GenerationStopped, generate, generated_shards

__all__ = ["GenerationError", "GenerationJob", "GenerationOutcome", "GenerationSettings", "GenerationStopped",
           "generate", "generate_shards", "generated_shards", "refuse_other_settings", "unfinished_shards",
           "unmarked_shards"]
