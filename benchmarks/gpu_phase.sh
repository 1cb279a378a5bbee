#!/usr/bin/env bash
# The hidden-state stage on a CUDA GPU, in one run: the shard extracted there reads back as the host's (pinned
# copies on their own stream, fp8 quantized on the device), then the stage against the bare forward pass over the
# same batches (goal >= 0.85). Needs the project's environment with a CUDA build of torch; PY picks its python.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PY:-.venv/bin/python}
"$py" -m pytest -q -p no:cacheprovider tests/unit/test_hidden_states.py -k on_a_gpu
"$py" benchmarks/hidden_states_throughput.py --phases throughput --device-map cuda --dtype bfloat16 \
  --tokens 65536 --random-models 1024x8,4096x16
