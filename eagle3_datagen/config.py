"""The run configuration: one pydantic model validates the YAML file and is the Prefect flow's parameter."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from eagle3_datagen.errors import ConfigurationError
from eagle3_datagen.forms import form_title
from eagle3_datagen.modes import ModeWeight
from eagle3_datagen.profiles import BUILTIN_PROFILES, ModelProfile, resolve_profile

_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_ABSOLUTE = r"^(/|[A-Za-z][A-Za-z0-9+.-]*://)"  # an absolute path or a URL such as s3://bucket/prefix
Compression = Literal["none", "zstd", "fp8"]
ModelDtype = Literal["bfloat16", "float16", "float32"]
ABSOLUTE_OUTPUT_FIX = "an absolute path such as /data/eagle3-runs, or s3://bucket/prefix"
ENDPOINTS_FIX = "list at least one vLLM base URL under server.endpoints, e.g. [http://127.0.0.1:8000]"


def checked_run_name(name: str) -> str:
    """A run name that is one safe folder name, or ValueError saying what one is."""
    if not _RUN_NAME.match(name) or ".." in name:
        raise ValueError(f"run_name {name!r} must be letters, digits, '.', '_' or '-' (no '/' or '..')")
    return name


def _absolute_in_the_form(schema: dict[str, Any]) -> None:
    """The deployment form offers no relative default and refuses one at submit: a worker has no folder of its own.

    The refusal names what to write (a `const` the value is not) rather than quoting a bare `pattern`'s regex.
    """
    schema.pop("default", None)
    schema["if"] = {"pattern": _ABSOLUTE}
    schema["else"] = {"const": ABSOLUTE_OUTPUT_FIX}


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", field_title_generator=form_title)


class ImagesConfig(_Section):
    max_bytes: PositiveInt = Field(default=20_000_000, description="An image over this many bytes rejects its row.")
    max_pixels: PositiveInt = Field(
        default=40_000_000, description="An image whose header declares more pixels (width x height) rejects its "
        "row, before it is decoded."
    )
    fetch_timeout_s: PositiveFloat = Field(
        default=5.0, description="How long an http(s) image URL may take to answer before its row is rejected."
    )


class DataConfig(_Section):
    source: str = Field(description="Hugging Face dataset id, or a local .jsonl/.json/.parquet file or folder.")
    split: str = Field(default="train", description="Dataset split to read.")
    limit: PositiveInt | None = Field(default=None, description="Read at most this many rows.")
    shard_size: PositiveInt = Field(default=500, description="Prompts per shard (the unit of storage and re-runs).")
    turns: Literal["rollout", "each", "last"] = Field(
        default="rollout",
        description="`rollout`: the conversation regenerated turn by turn on the model's own earlier answers (one "
        "sample per turn, tool calls answered with the row's recorded results); `each`: one prompt per user turn "
        "of a multi-turn row, after the dataset's earlier answers (another model's words); `last`: only the "
        "conversation up to its last user turn, after the dataset's answers.",
    )
    format: Literal["auto", "sharegpt", "openai"] = Field(
        default="auto", description="`sharegpt` (conversations: from/value), `openai` (messages: role/content)."
    )
    holdout: float = Field(
        default=0.01, ge=0, lt=1, description="Share of prompts held out to judge drafts on (`evaluate`): generated "
        "and extracted like the rest, written as their own split, left out of exports and training by default. "
        "Chosen by a salted hash of the prompt id; a conversation is held out whole. 0 holds out nothing.",
    )
    holdout_min_per_mode: NonNegativeInt = Field(
        default=20, description="At least this many held-out prompts per thinking mode (never more than a quarter "
        "of a mode's prompts), so every mode can be judged; with data.holdout 0, none.",
    )
    images: ImagesConfig = Field(
        default_factory=ImagesConfig, description="Image prompts (OpenAI image parts, `<image>` with an "
        "image/images column): each image is checked and stored once in the run, named by its sha256."
    )


class ModelConfig(_Section):
    name: str = Field(description="Model name the vLLM server serves (checked against /v1/models).")
    profile: str = Field(
        description="Model profile: how thinking is switched on and read back. The form offers the built-in ones; "
        "a profile defined under `profiles:` is named here from a YAML config (command line).",
        json_schema_extra={"enum": sorted(BUILTIN_PROFILES)},
    )
    tokenizer: str = Field(description="Tokenizer path or hub id, loaded with transformers' AutoTokenizer.")
    trust_remote_code: bool = Field(
        default=False, description="Run the code the target model's folder ships (Kimi-K2.5's multimodal wrapper "
        "needs it) when hidden states load it; recorded in the manifest. Only for models you trust.",
    )


def _required_in_the_form(*keys: str) -> Callable[[dict[str, Any]], None]:
    """Keys the deployment form must be given, though a YAML config may leave them to their defaults: a form left
    without endpoints is refused at submit, rather than run against a local default nobody serves there."""

    def require(schema: dict[str, Any]) -> None:
        schema["required"] = sorted({*schema.get("required", []), *keys})

    return require


def base_url(url: str) -> str:
    """The one spelling of an endpoint: `http://Host:80/v1/` and `http://host` are the same server."""
    parts = urlsplit(url.strip())
    scheme = parts.scheme.lower()
    userinfo, _, host = parts.netloc.rpartition("@")
    host = host.lower().removesuffix({"http": ":80", "https": ":443"}.get(scheme, ""))
    path = parts.path.rstrip("/").removesuffix("/v1").rstrip("/")
    return f"{scheme}://{userinfo + '@' if userinfo else ''}{host}{path}"


class ServerConfig(_Section):
    model_config = ConfigDict(json_schema_extra=_required_in_the_form("endpoints"))

    endpoints: list[str] = Field(
        default_factory=lambda: ["http://127.0.0.1:8000"],
        description="vLLM base URLs, one per replica, e.g. http://vllm-0:8000 (at least one, each server once; "
        "a trailing /v1 is dropped).",
        json_schema_extra={"minItems": 1, "uniqueItems": True,
                           "items": {"type": "string", "pattern": r"^https?://[^/\s]+"}},
    )
    max_in_flight: PositiveInt | Literal["auto"] = Field(
        default=64,
        description="Requests in flight per endpoint, or `auto`: follow each vLLM server's load (/metrics), "
        "growing while nothing waits in its queue and its KV cache has room, shrinking when requests queue.",
        # the form offers a number or the word `auto` from a list (a `const` branch reads "cannot be changed")
        json_schema_extra={"anyOf": [{"type": "integer", "exclusiveMinimum": 0, "title": "a number"},
                                     {"type": "string", "enum": ["auto"], "title": "auto"}]},
    )
    share_budget_across_runs: bool = Field(
        default=False,
        description="Also hold a slot of the Prefect global concurrency limit `eagle3:<endpoint>` (max_in_flight "
        "slots) per request, so concurrent runs together stay within each endpoint's budget.",
    )
    api_key_env: str = Field(
        default="VLLM_API_KEY", description="Environment variable holding the API key (never the key itself)."
    )
    api_key_secret: str | None = Field(
        default=None,
        description="Name of a Prefect Secret block holding the API key, used when the variable is unset.",
    )
    startup_timeout_s: float = Field(
        default=600.0, gt=0,
        description="How long a starting server (no answer yet, or /health 503) is waited for, with a line every "
        "15 s; a port that refuses connections and never answered fails in 10 s.",
    )
    request_timeout_s: float = Field(default=3600.0, gt=0, description="Per request; reasoning can be long.")
    max_retries: int = Field(default=5, ge=0, description="Retries of a request on 408/429/5xx and dropped links.")
    retry_backoff_s: float = Field(default=1.0, gt=0, description="First retry delay; doubles each try, jittered.")
    give_up_after_s: float = Field(
        default=300.0, gt=0,
        description="End the run (Failed, finished records kept) when no request has succeeded on any endpoint "
        "for this long while every endpoint was away or busy (refused connections, timeouts, 429, 502-504).",
    )
    max_consecutive_errors: PositiveInt = Field(
        default=32,
        description="Stop sending to an endpoint that answered this many requests in a row with an error (HTTP "
        "500 or a malformed response); the run ends when no endpoint is left.",
    )

    @model_validator(mode="after")
    def _shared_budget_is_fixed(self) -> ServerConfig:
        if self.share_budget_across_runs and self.max_in_flight == "auto":
            raise ValueError("share_budget_across_runs needs a number for server.max_in_flight, not auto")
        return self

    @field_validator("endpoints")
    @classmethod
    def _http_urls(cls, endpoints: list[str]) -> list[str]:
        if not endpoints:
            raise ValueError(f"is empty: {ENDPOINTS_FIX}")
        seen: dict[str, str] = {}
        for url in endpoints:
            if not re.match(r"^https?://[^/\s]+", url):
                raise ValueError(f"endpoint {url!r} is not an http(s) URL such as http://127.0.0.1:8000")
            base = base_url(url)
            if base in seen:  # one server listed twice would get two budgets and be overloaded
                raise ValueError(f"endpoints {seen[base]!r} and {url!r} are the same server ({base}): list it once")
            seen[base] = url
        return list(seen)


# Request fields the project sets: overriding one from extra_body would silently change what the run asks for
# (e.g. turn off the token ids exact sequences are built from), so each names where it is set instead.
REQUEST_OWNED_FIELDS = {
    "model": "set model.name",
    "messages": "prompts come from data.source",
    "max_tokens": "set generation.max_tokens",
    "max_completion_tokens": "set generation.max_tokens",
    "temperature": "set generation.temperature",
    "top_p": "set generation.top_p",
    "seed": "set generation.seed",
    "n": "set generation.n",
    "stream": "remove it (answers are read whole)",
    "stream_options": "remove it (answers are read whole)",
    "return_token_ids": "remove it (sequences.source decides whether the server's ids are used)",
    "chat_template_kwargs": "thinking is switched by the modes of model.profile (generation.modes picks them); "
    "define a profile under `profiles:` to change a mode's chat_template_kwargs",
    "reasoning_effort": "set it in a mode of a profile under `profiles:` (its reasoning_effort), picked by "
    "generation.modes",
}


class GenerationConfig(_Section):
    max_tokens: PositiveInt = Field(
        default=32768, description="Completion budget: reasoning plus answer (reasoning traces are long)."
    )
    temperature: float = Field(default=1.0, ge=0, description="Sampling temperature (Kimi-K2.5 thinking: 1.0).")
    top_p: float = Field(default=0.95, gt=0, le=1, description="Nucleus sampling mass.")
    seed: int | None = Field(default=None, description="Per-request seed base (the record index is added).")
    n: PositiveInt = Field(default=1, description="Samples per prompt (ids get a `:k` suffix when n > 1).")
    extra_body: dict[str, Any] = Field(
        default_factory=dict, description="Extra top-level request fields (e.g. structured_outputs); not the "
        "fields this project sets itself (model, messages, sampling, token ids, thinking switches).",
    )
    modes: list[ModeWeight] | None = Field(
        default=None,
        description="The model's modes this run mixes, each with its share of the prompts, e.g. [{mode: thinking, "
        "weight: 0.7}, {mode: instant, weight: 0.3}]; a prompt's mode follows from its id. Default: the "
        "profile's default mode only.",
    )

    @field_validator("modes")
    @classmethod
    def _a_mix(cls, modes: list[ModeWeight] | None) -> list[ModeWeight] | None:
        if modes is None:
            return None
        if not modes:
            raise ValueError("is empty: list at least one mode with its weight, or remove the key for the profile's "
                             "default mode")
        names = [entry.mode for entry in modes]
        if repeated := sorted({name for name in names if names.count(name) > 1}):
            raise ValueError(f"lists mode {', '.join(map(repr, repeated))} twice: give each mode one entry")
        if negative := [entry for entry in modes if entry.weight < 0]:
            raise ValueError(f"mode {negative[0].mode!r} has weight {negative[0].weight}: weights must be >= 0")
        if not sum(entry.weight for entry in modes) > 0:
            raise ValueError("weights sum to 0: give at least one mode a positive weight")
        return modes

    @model_serializer(mode="wrap")
    def _without_unset_modes(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """A config without a mix dumps without `modes`, so its fingerprint does not depend on the field."""
        dumped: dict[str, Any] = handler(self)
        if self.modes is None:
            dumped.pop("modes", None)
        return dumped

    def mode_mix(self, profile: ModelProfile) -> list[ModeWeight]:
        """The modes prompts are asked in, with their weights: the configured mix, else the default mode."""
        return list(self.modes) if self.modes else [ModeWeight(mode=profile.default_mode, weight=1.0)]

    @field_validator("extra_body")
    @classmethod
    def _no_field_the_request_owns(cls, extra_body: dict[str, Any]) -> dict[str, Any]:
        for key in extra_body:
            if key in REQUEST_OWNED_FIELDS:
                raise ValueError(f"sets {key!r}, which this project sends itself: {REQUEST_OWNED_FIELDS[key]}")
        return extra_body


class ValidationConfig(_Section):
    max_empty_reasoning_rate: float = Field(
        default=0.05, ge=0, le=1, description="A shard with a larger share of empty reasoning among its records of "
        "modes that think is quarantined."
    )
    max_unexpected_reasoning_rate: float = Field(
        default=0.05, ge=0, le=1, description="A shard with a larger share of reasoning among its records of modes "
        "answered without it (instant: the mode's switch was ignored) is quarantined; the first answers of a run "
        "are held to it too.",
    )
    max_empty_content_rate: float = Field(
        default=0.10, ge=0, le=1, description="A shard with a larger share of empty answers is quarantined."
    )
    max_truncated_rate: float = Field(
        default=0.10, ge=0, le=1,
        description="A shard with a larger share of answers cut by max_tokens (finish_reason length) is quarantined.",
    )
    max_unclosed_reasoning_rate: float = Field(
        default=0.10, ge=0, le=1, description="A shard with a larger share of records that ended their turn inside "
        "their reasoning (no think-end id, not cut by max_tokens) among its records of modes that think is "
        "quarantined; below it they are kept, as what the model did.",
    )
    early_abort_after: PositiveInt | None = Field(
        default=None,
        description="The most requests a run may spend before its first answers are judged (one that failed every "
        "try proves nothing and gives its place to another): it goes on as soon "
        "as they show reasoning (and instant-mode ones none), and stops with the cause when they show none (or "
        "instant-mode ones show it) or the server refuses them; what is in flight then is cancelled. Default: "
        "one in-flight budget (every endpoint's, at least 32; under `auto`, what it grows to meanwhile), so no "
        "slot waits for the verdict; a smaller number spends less on a broken server and leaves the rest of the "
        "budget idle until the verdict.",
    )
    allow_inline_reasoning: bool = Field(
        default=False, description="Accept a server without a reasoning parser and split the tags out here."
    )
    probe_requests: PositiveInt = Field(
        default=2, description="Each endpoint's first answers checked for form (reasoning field, token ids, model) "
        "before a record from it is kept.")
    max_leaked_tags_rate: float = Field(
        default=0.01, ge=0, le=1, description="A shard with a larger share of think tags left inside reasoning or "
        "answer text is quarantined.",
    )
    max_token_text_mismatch_rate: float = Field(
        default=0.01, ge=0, le=1, description="A shard with a larger share of server ids that disagree with the "
        "text (they do not decode to reasoning and answer, or carry other than one think-end id: a parser that "
        "changed the text) is quarantined; such samples are never trained on.",
    )
    max_rebuild_mismatch_rate: float = Field(
        default=0.01, ge=0, le=1, description="Text-rebuilt samples whose token counts differ from the server's "
        "usage counts are never trained on; a shard with a larger share of them is quarantined.",
    )
    min_accepted_rate: float = Field(
        default=0.5, ge=0, le=1,
        description="A run that accepts a smaller share of its prompts into the training set ends Failed; the "
        "early-abort window stops a run whose first requests are refused more often than this allows, and so does "
        "a share of refusals that rises above it later (the refused prompts are asked again after the fix).",
    )


class SequencesConfig(_Section):
    max_seq_len: PositiveInt = Field(default=32768, description="Longest training sequence, in tokens.")
    over_length: Literal["drop", "truncate"] = Field(
        default="drop", description="A sample longer than max_seq_len: `drop` it (rejected with its reason) or "
        "`truncate` it."
    )
    supervise_template_start_tag: bool = Field(
        default=False, description="Put the template-written think start tag under the loss mask."
    )
    source: Literal["auto", "server", "text"] = Field(
        default="auto",
        description="Where token ids come from: `server` (vLLM's own ids, exact; servers without them are "
        "refused), `text` (rebuilt from reasoning and answer text, each sample checked against the server's usage "
        "counts), `auto` (the server's ids where it returns them, else text).",
    )
    cross_check_rate: float = Field(
        default=0.1, ge=0, le=1,
        description="Share of the samples with server ids that are also rebuilt from text to check the two agree "
        "(chosen by prompt id, so the same ones every run); samples without ids are always rebuilt and checked "
        "against the server's counts. Re-encoding every text is most of the stage's cost.",
    )


class HiddenStatesConfig(_Section):
    backend: Literal["transformers", "vllm", "none"] = Field(
        default="transformers",
        description="`transformers` loads the target in this process; `vllm` asks an extraction server (targets "
        "too large for one process, see infra/vllm-gpu/); `none` skips hidden-state extraction.",
    )
    model: str | None = Field(default=None, description="Target model path or id (defaults to model.tokenizer).")
    aux_layers: list[int] | None = Field(
        default=None, description="Input-to-layer ids (= HF hidden_states index); default [2, N//2, N-3]."
    )
    dtype: ModelDtype = Field(
        default="bfloat16", description="dtype of the stored hidden states (and of the target's forward pass)."
    )
    device_map: str = Field(default="cpu", description="transformers device_map, e.g. `cpu`, `cuda`, `auto`.")
    max_tokens_per_batch: PositiveInt = Field(default=8192, description="Token budget of one forward pass.")
    part_size_bytes: PositiveInt = Field(
        default=1 << 30, description="Bound on one safetensors part before compression (what a part holds in memory)."
    )
    compression: Compression = Field(
        default="none",
        description="How the stored states are encoded (ids and loss mask always exact; readers decode to the "
        "model dtype): `none`; `zstd` lossless; `fp8` float8 e4m3 with a scale per "
        "token and layer, about half of bf16, lossy: the shard index records each row's cosine to the original "
        "(min, p1, p50, rows under 0.999).",
    )
    endpoint: str | None = Field(
        default=None, description="vllm backend: base URL of the extraction server (not a generation server)."
    )
    shared_path: str | None = Field(
        default=None,
        description="vllm backend: this machine's path to the server's shared_storage_path, where it writes one "
        "file per request; default: the path the server names.",
    )
    max_in_flight: PositiveInt = Field(default=8, description="vllm backend: requests in flight to the server.")
    request_timeout_s: float = Field(default=600.0, gt=0, description="vllm backend: one request (one prefill).")

    @field_validator("endpoint")
    @classmethod
    def _http_url(cls, endpoint: str | None) -> str | None:
        return None if endpoint is None else ServerConfig._http_urls([endpoint])[0]

    @model_validator(mode="after")
    def _vllm_needs_endpoint(self) -> HiddenStatesConfig:
        if self.backend == "vllm" and self.endpoint is None:
            raise ValueError("backend vllm needs hidden_states.endpoint, the extraction server's URL")
        return self


class ExecutionConfig(_Section):
    """Where the shard tasks run. Nothing here changes an output, so nothing here is in a cache key."""

    task_runner: Literal["local", "ray"] = Field(
        default="local",
        description="`local`: shard tasks run in threads of this process; `ray`: on a Ray cluster through "
        "prefect-ray (execution.ray_address), one task per shard and stage, spread over its nodes.",
    )
    ray_address: str | None = Field(
        default=None,
        description="ray: the cluster's address (`head:6379`, or `ray://head:10001` from outside it); default: "
        "RAY_ADDRESS, else a temporary Ray instance on this machine.",
    )
    workers: PositiveInt | None = Field(
        default=None,
        description="local: shard tasks running at once (memory grows with it, not with the prompt count); "
        "default: this machine's cores.",
    )
    extraction_gpus: float = Field(
        default=0, ge=0,
        description="ray: GPUs each hidden-state extraction task asks for (its worker keeps the target loaded "
        "for the next shard); 0 on CPU-only clusters.",
    )


class PipelineConfig(_Section):
    """Everything a run needs; the settings that change outputs are fingerprinted into the manifest."""

    model_config = ConfigDict(json_schema_extra=_required_in_the_form("server"))

    run_name: str = Field(
        default="", title="Run name", description="Folder name of this run under output_uri (letters, digits, "
        ". _ -); flow and task runs, artifacts and the report are named after it. The same name resumes the run. "
        "Empty in a deployment run: the flow run's own name (the form's Run name, above) names it.",
    )
    output_uri: str = Field(
        default="./runs", title="Output",
        description="Absolute folder or s3://bucket/prefix. A relative path is resolved against the directory the "
        "command was started in and recorded absolute; a deployment run (a worker) refuses it.",
        json_schema_extra=lambda schema: _absolute_in_the_form(schema),
    )
    data: DataConfig = Field(title="Data", description="The prompt dataset and how it is cut into shards.")
    model: ModelConfig = Field(title="Model", description="The served reasoning model, its profile and tokenizer.")
    server: ServerConfig = Field(
        default_factory=ServerConfig, title="Server", description="The vLLM servers that generate and how to use them."
    )
    generation: GenerationConfig = Field(
        default_factory=GenerationConfig, title="Generation", description="Sampling settings of every request."
    )
    validation: ValidationConfig = Field(
        default_factory=ValidationConfig, title="Validation",
        description="When a shard is quarantined, and when the run stops early or ends Failed.",
    )
    sequences: SequencesConfig = Field(
        default_factory=SequencesConfig, title="Sequences", description="Training token sequences and loss masks."
    )
    hidden_states: HiddenStatesConfig = Field(
        default_factory=HiddenStatesConfig, title="Hidden states",
        description="Extraction of the target's hidden states (the EAGLE-3 features).",
    )
    execution: ExecutionConfig = Field(
        default_factory=ExecutionConfig, title="Execution",
        description="Where the shard tasks run: threads of this process or a Ray cluster.",
    )
    profiles: dict[str, ModelProfile] = Field(
        default_factory=dict, title="Custom profiles",
        description="Model profiles of your own, by name (the built-in ones need none), e.g. "
        '`{"my-r1-distill": {"reasoning_parser": "deepseek_r1", "end_of_turn": "<|im_end|>", '
        '"template_writes_start_tag": true}}`; model.profile then names it.',
    )

    @field_validator("run_name")
    @classmethod
    def _safe_run_name(cls, name: str) -> str:
        return name and checked_run_name(name)

    @model_validator(mode="after")
    def _known_profile(self) -> PipelineConfig:
        profile = resolve_profile(self.model.profile, self.profiles)
        for entry in self.generation.modes or []:
            if entry.mode not in profile.mode_specs:
                raise ValueError(
                    f"generation.modes: profile {self.model.profile!r} has no mode {entry.mode!r}: use one of "
                    f"{', '.join(profile.mode_specs)}, or define it under the profile's `modes:`"
                )
        return self

    @model_validator(mode="after")
    def _one_answer_per_turn(self) -> PipelineConfig:
        if self.data.turns == "rollout" and self.generation.n > 1:
            raise ValueError("generation.n must be 1 with data.turns: rollout (a conversation goes on from one "
                             "answer): set n: 1, or use data.turns: each")
        return self

    @property
    def profile(self) -> ModelProfile:
        return resolve_profile(self.model.profile, self.profiles)

    @property
    def target_model(self) -> str:
        return self.hidden_states.model or self.model.tokenizer


def absolute_uri(uri: str, started_in: Path | None, key: str) -> str:
    """`uri` made absolute against the directory a run was started in, once, so it is recorded as it was meant.

    `started_in` is None where a run has no directory of its own (a worker runs it in a temporary folder that is
    deleted afterwards): a relative `uri` is refused there, as writing under it would lose the outputs.
    """
    if re.match(_ABSOLUTE, uri):
        return uri
    if started_in is None:
        raise ConfigurationError(
            f"config key {key}: {uri!r} is relative, and a deployment run has no directory of its own (the worker "
            f"runs it in a temporary folder deleted afterwards): set {key} to an absolute path or s3://bucket/prefix"
        )
    return str((started_in / uri).resolve())


def _set_dotted(tree: dict[str, Any], dotted: str) -> None:
    key_path, sep, value = dotted.partition("=")
    if not sep or not key_path:
        raise ConfigurationError(f"--set {dotted!r}: write it as dotted.key=value")
    node = tree
    *parents, leaf = key_path.split(".")
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigurationError(f"--set {dotted!r}: {part!r} is not a section")
    node[leaf] = yaml.safe_load(value) if value else value


def _one_line(error: ValidationError) -> str:
    first = error.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "(top level)"
    more = f" (and {error.error_count() - 1} more)" if error.error_count() > 1 else ""
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        message = "unknown key; remove it or check its spelling"
    return f"config key {where}: {message}{more}"


def parse_config(tree: dict[str, Any], overrides: list[str] | None = None) -> PipelineConfig:
    """Validate a config tree (plus `dotted.key=value` overrides) into a PipelineConfig or a ConfigurationError."""
    for item in overrides or []:
        _set_dotted(tree, item)
    try:
        return PipelineConfig.model_validate(tree)
    except ValidationError as error:
        raise ConfigurationError(_one_line(error)) from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> PipelineConfig:
    """Read a YAML config file; every problem is a one-line ConfigurationError naming the fix."""
    path = Path(path)
    if not path.is_file():
        raise ConfigurationError(f"config file {path} not found: pass --config with the path to your YAML file")
    try:
        tree = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as error:
        raise ConfigurationError(f"config file {path} is not valid YAML: {str(error).splitlines()[0]}") from None
    if not isinstance(tree, dict):
        raise ConfigurationError(f"config file {path} must hold a mapping of keys (run_name, data, model, ...)")
    return parse_config(tree, overrides)
