"""The resume property on a fixed handful of its random cases (`benchmarks/resume_property.py` plays hundreds):
the `run` command SIGKILLed or stopped, faulted and resumed after dataset edits and settings changes, then one
clean run that answers every prompt of the final dataset once, under the final settings, in its own shard, with
`verify` clean, or that is refused in one line and completes once the line's fix is followed; and no attempt asks
an answer the run already holds.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from prefect.settings import PREFECT_API_URL

from cli.demo import DEMO_MODEL_NAME
from cli.main import main
from eagle3_datagen.testing.resume_cases import draw_case, run_case, verify_at_both_depths
from eagle3_datagen.think_tokens import load_tokenizer

pytestmark = pytest.mark.usefixtures("prefect_api")

# Seeds whose cases, together, kill runs, add and drop rows, re-cut the shards, change the settings (a
# refusal; 6 cuts 20 prompts in shards of 4, then of 25: no old shard may stay beside the new one), and
# meet each server fault: a 401 burst, 500s, a server that dies. 175 cuts a shard back to the prompts it held two
# attempts before: its cached sequences result must not vouch for the file the attempt between wrote over it. 240
# re-cuts the shards coarser under other settings: the refusal must come before the re-cut retires any file. 6,
# 7 and 19 also re-cut or edit the dataset after answers were logged: those answers are kept, never asked again.
# 160 and 125 stop attempts with SIGTERM, meet a server restarted on another checkpoint and a second start beside
# a run (160 also malformed 200s).
SEEDS = (6, 7, 19, 26, 175, 240, 160, 125)


verify = verify_at_both_depths(main)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_resumed_run_answers_every_prompt_once_under_its_final_settings_or_refuses_in_one_line(
        seed: int, tiny_model: Path, tmp_path: Path) -> None:
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value() or ""}
    case = draw_case(seed)
    outcome = run_case(case, tmp_path, tiny_model, DEMO_MODEL_NAME, load_tokenizer(str(tiny_model)), env, verify)
    assert outcome.violations == [], f"{case}\nkills at {outcome.kill_points}"
