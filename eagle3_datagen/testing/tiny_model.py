"""Build a tiny Qwen3-style reasoning model offline, so the demo and tests can serve a real model with vLLM.

Nothing is downloaded: the tokenizer is trained here with `tokenizers`, and a ~0.6 M-parameter
`Qwen3ForCausalLM` is trained for a minute or two (one CPU thread) on synthetic conversations until it
answers in Qwen3's format, `<think>\\n{reasoning}\\n</think>\\n\\n{answer}<|im_end|>`, which vLLM's `qwen3`
reasoning parser splits into `reasoning` and `content`. Deterministic: the same seed gives the same bytes.

With `--kimi-tokenizer DIR` (the real Kimi-K2.5 vocabulary, 163,840 ids) it builds the same model on Kimi's
tokenizer and template instead, trained to answer `{reasoning}</think>{answer}<|im_end|>` after the template's
`<think>`, which vLLM's `kimi_k2` parser splits.

Usage: `python -m eagle3_datagen.testing.tiny_model --out build/tiny-model [--kimi-tokenizer DIR]`.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    ProcessorMixin,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.utils import logging as transformers_logging

from eagle3_datagen.testing.tiny_tool_calls import TOOL_MARKUP_IDS, tool_call_rows

DEMO_QUESTIONS = Path(__file__).parents[1] / "data" / "demo_questions.jsonl"

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
THINK_START, THINK_END = "<think>", "</think>"
VOCAB_SIZE = 2000
# Qwen2/3's pre-tokenizer split: digits one by one, newline runs kept together ("\n\n" is one token).
_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
AUX_LAYERS = (2, 4, 5)  # input-to-layer convention [2, N//2, N-3] for N = 8 layers
MARGIN_ROWS = 320  # the training rows the format margin is checked on: the demo prompts' four times, then others
TOOL_CONVERSATIONS = 160  # the Kimi model's tool-call conversations (each one to four training rows)
TOOL_MARGIN_ROWS = 64  # and its tool-call rows the margin is checked on
EXTRA_ROUNDS = 3  # gentler training rounds at most, while the format has no margin

# A training row: (prompt ids, reply ids), and whatever else a model needs to read it (the tiny VLM: its pixels).
Row = Sequence[Any]
# How a model reads a chunk of rows: the logits where a reply token is predicted, and those tokens. The text models
# read ids only (`text_reply_logits`); the tiny VLM (tiny_vlm.py) also feeds each row's image tiles.
ReplyLogits = Callable[[PreTrainedModel, Sequence[Row], int], tuple[torch.Tensor, torch.Tensor]]

# Qwen3's template without tools: reasoning is kept only on assistant turns after the last user message
# (from `reasoning_content`, or split out of inline `<think>` content); every earlier assistant turn renders
# only its content. `enable_thinking=false` pre-fills an empty think block, as Qwen3 does.
CHAT_TEMPLATE = r"""{%- set ns = namespace(last_query_index=messages|length - 1) -%}
{%- for message in messages -%}
{%- if message.role == 'user' -%}{%- set ns.last_query_index = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- for message in messages -%}
{%- set content = message.content if message.content is string else '' -%}
{%- if message.role == 'assistant' -%}
{%- set reasoning = '' -%}
{%- if message.reasoning_content is string -%}
{%- set reasoning = message.reasoning_content -%}
{%- elif '</think>' in content -%}
{%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') -%}
{%- set content = content.split('</think>')[-1].lstrip('\n') -%}
{%- endif -%}
{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning) -%}
{{- '<|im_start|>assistant\n<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') -}}
{%- else -%}
{{- '<|im_start|>assistant\n' + content -}}
{%- endif -%}
{{- '<|im_end|>\n' -}}
{%- else -%}
{{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\n' -}}
{%- if enable_thinking is defined and enable_thinking is false -%}
{{- '<think>\n\n</think>\n\n' -}}
{%- endif -%}
{%- endif -%}"""

MODEL_README = """# Tiny demo reasoning model (eagle3-datagen)

Built offline by `python -m eagle3_datagen.testing.tiny_model`: a {params:,}-parameter `Qwen3ForCausalLM`
(hidden 64, 8 layers, 4 heads, 2 KV heads, head_dim 32, tied embeddings, float32) with a byte-level BPE
tokenizer of {vocab} tokens trained on synthetic text, and a Qwen3-style chat template.

It was trained for 250 small steps on synthetic conversations, only to produce Qwen3's output *format*:
`<think>\\n{{reasoning}}\\n</think>\\n\\n{{answer}}<|im_end|>`. Its words are canned and often wrong: it is not a
useful language model. It exists so the pipeline can be tested end to end against a real vLLM server
(`--reasoning-parser qwen3`) on a CPU, with no download. EAGLE-3 aux layers: {aux} (input-to-layer ids).

- `<|im_start|>`, `<|im_end|>` (end of turn, eos) and `<|endoftext|>` (pad) are special tokens.
- `<think>` and `</think>` are added tokens with `special: false` (they survive `skip_special_tokens`).
- Template switch: `chat_template_kwargs={{"enable_thinking": false}}` pre-fills `<think>\\n\\n</think>\\n\\n`.
- Like Qwen3's, the template drops the reasoning of assistant turns before the last user message, and keeps
  a final turn's reasoning only when it is passed as `reasoning_content` (vLLM's responses call it `reasoning`).
- Format margin on the demo prompts' taught replies (temperature 0.7): {margin}.
"""

# Synthetic prompts and canned replies. The model only has to learn the shape of a reply, so the replies
# are a few fixed sentences per kind of question: low entropy keeps sampling at temperature 0.7 on format.
_COUNTRIES = {
    "France": "Paris", "Japan": "Tokyo", "Spain": "Madrid", "Egypt": "Cairo", "Canada": "Ottawa",
    "Peru": "Lima", "Kenya": "Nairobi", "Norway": "Oslo", "India": "New Delhi", "Chile": "Santiago",
    "Greece": "Athens", "Poland": "Warsaw", "Mexico": "Mexico City", "Vietnam": "Hanoi",
}
_WORDS = [
    "gravity", "a verb", "an atom", "democracy", "a prime number", "a variable", "erosion", "a habit",
    "friction", "a metaphor", "an ecosystem", "a recipe", "a budget", "a database", "an island", "a fraction",
]
_CODE_TASKS = [
    "sort a list", "read a file", "join two strings", "count words in a text", "find the largest number",
    "remove duplicates from a list", "reverse a string", "parse JSON", "loop over a dictionary",
]
_LANGUAGES = ["Python", "JavaScript", "Go", "Rust", "SQL", "Bash"]
_CHORES = [
    "clean a window", "make tea", "fold a shirt", "plan a trip", "cook rice", "wake up early",
    "keep plants alive", "learn a new word every day", "stay focused", "save energy at home",
]
# Everyday words for the tokenizer's corpus only, so its vocabulary is not just the canned replies.
_COMMON_TEXT = """
about above across after again against air all almost along also always among animal answer any apple area
around ask away baby back ball bank base basket bath beach bean bear beautiful because bed before begin behind
believe below best better between big bird black blue boat body book both bottle bottom box boy bread break
bridge bright bring brother brown build busy buy call camera can car card care carry case cat catch cause
center chair change cheap check child choose city class clean clear climb clock close cloud coat coffee cold
color come common company compare computer cook cool copy corner correct count country course cover cross
cup cut dance dark data date daughter day dear decide deep desk different dinner direction discover doctor
dog door down draw dream dress drink drive dry during early earth easy eat edge egg energy engine enough
enter even evening every example explain face fact fall family far farm fast father feel field file fill
final find fine finger finish fire first fish floor flower fly follow food foot forest forget form forward
free fresh friend front fruit full game garden gather girl give glass good grass great green ground group
grow guess hair hand happy hard head hear heart heavy help here high hill history hold home hope horse hot
hour house idea important inside island job join journey jump keep key kind kitchen know lake language large
last late laugh learn leave left letter level library light line listen little live long look machine make
many map market matter measure meet memory middle minute mirror money month moon morning mother mountain move
music name near need never new next night noise north note number object ocean offer office often open order
other outside page paint paper park part party pass past pencil people picture piece place plan plant play
please point power present problem program question quick quiet rain read ready reason red remember rest
return river road rock room round rule safe same school science sea season second seed sell send sentence
shape share short show side sign simple sing sister sleep slow small smile snow soft song sound south space
speak special spring square stand star start station stay step stone story street strong student study
summer sun table take talk teacher team test thing think time today together tomorrow tool town train travel
tree try turn under understand use value village visit voice wait walk wall warm watch water weather week
well west wheel white wind window winter word work world write year yellow young
"""
_COMMON_WORDS = _COMMON_TEXT.split()
_SYSTEMS = [
    "You are a helpful assistant.", "You are a concise tutor.", "Answer briefly.",
    "You are a friendly guide.", "Keep your answers short.",
]

_REASONING_OPENERS = {
    "math": ["This is a small arithmetic question.", "The user wants a quick calculation."],
    "define": ["The user asks what a word or idea means.", "This asks for a short definition."],
    "geo": ["This is a geography question.", "The user asks about a place in the world."],
    "code": ["This is a programming question.", "The user wants help with some code."],
    "life": ["This is an everyday question.", "The user wants practical advice."],
}
_REASONING_CLOSERS = [
    "I will answer in one short sentence.", "A brief, clear answer is best.", "I should keep it simple.",
    "Let me give the key fact.",
]
_ANSWERS = {
    "math": ["The answer is a small number.", "Here is the result of the calculation."],
    "define": ["It is a simple idea with a short meaning.", "Here is a short definition."],
    "geo": ["It is a well known place.", "Here is the place you asked about."],
    "code": ["Use a short function for that.", "Here is a simple way to write it."],
    "life": ["Take it one small step at a time.", "Here is a simple tip."],
}
_KIND_WORDS = {
    "math": ("plus", "minus", "times", "half", "prime", "square", "how many", "divided", "sum"),
    "geo": ("capital", "river", "ocean", "continent", "mountain", "country", "where is", "language is spoken"),
    "code": ("python", "sql", "function", "code", "http", "list", "string", "javascript", "bash"),
    "define": ("what is a", "what is an", "define", "mean", "what does", "opposite"),
}


def _kind(question: str) -> str:
    """A coarse topic, so replies depend a little on the question (the model learns the cue words)."""
    lower = question.lower()
    for kind, words in _KIND_WORDS.items():
        if any(word in lower for word in words):
            return kind
    return "life"


def _synthetic_question(rng: random.Random) -> str:
    """One generated question in the same families as the demo questions."""
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    country = rng.choice(sorted(_COUNTRIES))
    return rng.choice([
        f"What is {a} plus {b}?", f"What is {a} minus {b}?", f"What is {a} times {b}?",
        f"What is {a * b} divided by {b}?", f"Is {a} a prime number?", f"How many days are in {a} weeks?",
        f"What is the capital of {country}?", f"Where is {_COUNTRIES[country]}?",
        f"On which continent is {country}?", f"What language is spoken in {country}?",
        f"What is {rng.choice(_WORDS)}?", f"Define {rng.choice(_WORDS)}.",
        f"What does {rng.choice(_WORDS)} mean?",
        f"How do I {rng.choice(_CODE_TASKS)} in {rng.choice(_LANGUAGES)}?",
        f"Write a {rng.choice(_LANGUAGES)} function to {rng.choice(_CODE_TASKS)}.",
        f"How do I {rng.choice(_CHORES)}?", f"Give me a tip to {rng.choice(_CHORES)}.",
        f"Why should I {rng.choice(_CHORES)}?",
    ])


def _reply(question: str, rng: random.Random) -> tuple[str, str]:
    """Canned (reasoning, answer) for a question."""
    kind = _kind(question)
    reasoning = f"{rng.choice(_REASONING_OPENERS[kind])} {rng.choice(_REASONING_CLOSERS)}"
    return reasoning, rng.choice(_ANSWERS[kind])


def _demo_conversations() -> list[list[dict[str, str]]]:
    """The demo questions as chat messages (ShareGPT `from`/`value` mapped to `role`/`content`)."""
    roles = {"system": "system", "human": "user", "gpt": "assistant"}
    rows = [json.loads(line) for line in DEMO_QUESTIONS.read_text(encoding="utf-8").splitlines() if line]
    return [[{"role": roles[t["from"]], "content": t["value"]} for t in row["conversations"]] for row in rows]


def _training_conversations(rng: random.Random, count: int) -> list[tuple[list[dict[str, str]], str, str]]:
    """(prompt messages, reasoning, answer) triples: every demo prompt a few times plus generated ones."""
    prompts = _demo_conversations() * 4
    while len(prompts) < count:
        messages = [{"role": "user", "content": _synthetic_question(rng)}]
        if rng.random() < 0.2:
            messages.insert(0, {"role": "system", "content": rng.choice(_SYSTEMS)})
        if rng.random() < 0.2:
            earlier = _synthetic_question(rng)
            history = [{"role": "user", "content": earlier}, {"role": "assistant", "content": _reply(earlier, rng)[1]}]
            messages[-1:-1] = history
        prompts.append(messages)
    triples = []
    for messages in prompts:
        reasoning, answer = _reply(messages[-1]["content"], rng)
        triples.append((messages, reasoning, answer))
    return triples


def _train_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    """Byte-level BPE with Qwen3's special and think tokens, wrapped for transformers."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - 2,
        min_frequency=1,
        special_tokens=[PAD, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    # Not special, as in Qwen3 and Kimi: they must survive skip_special_tokens for the reasoning parser.
    tokenizer.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in (THINK_START, THINK_END)])
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=IM_END, pad_token=PAD, model_max_length=2048
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def _batches(
    rows: list[tuple[list[int], list[int]]], batch_size: int, rng: random.Random, pad_id: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless shuffled batches of (input_ids, labels); labels are -100 outside the assistant's reply."""
    for chunk in _chunks(rows, batch_size, rng):
        yield _pad(chunk, pad_id)


def _chunks(rows: Sequence[Row], batch_size: int, rng: random.Random) -> Iterator[list[Row]]:
    """Endless shuffled batches of rows, unpadded.

    Rows of similar length go together (sorted within windows of 8 batches): a third less padding to compute.
    """
    window = 8 * batch_size
    while True:
        order = list(range(len(rows)))
        rng.shuffle(order)
        for start in range(0, len(order) - window + 1, window):
            chunk = sorted(order[start : start + window], key=lambda i: len(rows[i][0]) + len(rows[i][1]))
            groups = [chunk[k : k + batch_size] for k in range(0, window, batch_size)]
            rng.shuffle(groups)
            for group in groups:
                yield [rows[i] for i in group]


def _pad(chunk: Sequence[Row], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad (prompt, reply, ...) rows into input_ids and labels."""
    width = max(len(prompt) + len(reply) for prompt, reply, *_ in chunk)
    ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
    labels = torch.full((len(chunk), width), -100, dtype=torch.long)
    for row, (prompt, reply, *_) in enumerate(chunk):
        ids[row, : len(prompt) + len(reply)] = torch.tensor(prompt + reply)
        labels[row, len(prompt) : len(prompt) + len(reply)] = torch.tensor(reply)
    return ids, labels


def build_tiny_model(out_dir: Path, seed: int = 0, steps: int = 250, check_margin: bool = True) -> Path:
    """Build tokenizer + trained model into `out_dir` and return it; same seed, same bytes. Refuses a model that
    keeps its format without margin (`FormatMargin`), unless `check_margin` is off (a build of a few steps)."""
    out_dir = Path(out_dir)
    rng = random.Random(seed)
    triples = _training_conversations(rng, count=1600)
    # The conversations as plain text (tags left out: they are added tokens), plus more questions for variety.
    texts = [
        "".join(f"{m['role']}\n{m['content']}\n" for m in messages) + f"assistant\n\n{reasoning}\n\n\n{answer}\n"
        for messages, reasoning, answer in triples
    ]
    texts += [_synthetic_question(rng) for _ in range(4000)]
    texts += [" ".join(rng.choices(_COMMON_WORDS, k=12)).capitalize() + "." for _ in range(3000)]
    tokenizer = _train_tokenizer(texts)

    rows = []
    for index, (messages, reasoning, answer) in enumerate(triples):
        thinking = index % 10 != 0  # a tenth with thinking off, so the switch also works
        prompt = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, enable_thinking=thinking
        )
        reply = f"{THINK_START}\n{reasoning}\n{THINK_END}\n\n{answer}{IM_END}" if thinking else f"{answer}{IM_END}"
        rows.append((tokenizer.encode(prompt), tokenizer.encode(reply)))

    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # vLLM's CPU attention supports head sizes 32, 64, 80, ... (16 fails at the first request)
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    threads = torch.get_num_threads()
    # One thread: the float reduction order (hence the weights) depends on the thread count, and a lone
    # thread does not stall in OpenMP barriers when the cores are shared (2 threads ran 3x slower then).
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):  # seeds the weights without touching the caller's RNG
            torch.manual_seed(seed)
            structural = tokenizer.convert_tokens_to_ids([THINK_START, THINK_END, IM_END, PAD, IM_START])
            model = _train_with_margin(Qwen3ForCausalLM(config), rows, rng, tokenizer.pad_token_id, steps, structural,
                                       rows[:MARGIN_ROWS])
            margin = format_margin(model, rows[:MARGIN_ROWS], structural, tokenizer.pad_token_id)
    finally:
        torch.set_num_threads(threads)
    if check_margin:
        _checked(margin)
    params = sum(p.numel() for p in model.parameters())
    readme = MODEL_README.format(params=params, vocab=len(tokenizer), aux=list(AUX_LAYERS), margin=margin)
    return _save(out_dir, model, tokenizer, [tokenizer.eos_token_id, tokenizer.pad_token_id], readme)


def _save(out_dir: Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast | ProcessorMixin,
          eos_ids: list[int], readme: str) -> Path:
    """Weights, tokenizer (or a VLM's processor) and a README; sampling defaults as the demo's (temperature 0.7,
    top-p 0.9)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    text_config = model.config.get_text_config()  # a VLM's ids are its text model's
    model.generation_config = GenerationConfig(
        bos_token_id=text_config.bos_token_id, eos_token_id=eos_ids, pad_token_id=text_config.pad_token_id,
        do_sample=True, temperature=0.7, top_p=0.9,
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    (out_dir / "README.md").write_text(readme, encoding="utf-8")
    return out_dir


KIMI_IM_END_ID, KIMI_EOS_ID, KIMI_BOS_ID, KIMI_PAD_ID = 163586, 163585, 163584, 163839
KIMI_THINK_ID, KIMI_THINK_END_ID = 163606, 163607
# Misplaced markup weighs more in the Kimi model's loss than in Qwen3's: where a call's argument copies a word
# from the question, a tool token kept 1-4 % of the sampled mass on some CPUs at weight 1, whatever the extra rounds
# (at 10 the taught tokens keep at least 0.997 there, at 4 only 0.971)
KIMI_UNLIKELIHOOD_WEIGHT = 10.0
KIMI_README = """# Tiny model on the Kimi-K2.5 vocabulary (eagle3-datagen)

The tiny demo model's shape on the real Kimi-K2.5 tokenizer and template, trained to answer
`{{reasoning}}</think>{{answer}}<|im_end|>` after the template's `<think>`, and to call the function-calling set's
tools in Kimi-K2's tool-call sections (parallel calls included). Not a useful language model.
Format margin on the taught replies of the demo prompts and of tool calls (temperature 0.7): {margin}.
"""


def build_tiny_kimi_model(out_dir: Path, tokenizer_dir: Path, seed: int = 0, steps: int = 800,
                          check_margin: bool = True) -> Path:
    """The tiny model on the real Kimi-K2.5 vocabulary and template; same seed, same bytes; checked as the other.

    More than three times the other's steps: Kimi's reply has no separator between reasoning and answer, so ending
    the reasoning and ending the turn look alike after a sentence, and a second parallel call hangs on a word far
    back (500 steps left end-of-turn, and a call where none is taught, in the nucleus)."""
    out_dir, tokenizer_dir = Path(out_dir), Path(tokenizer_dir)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.chat_template = (tokenizer_dir / "chat_template.jinja").read_text(encoding="utf-8")
    rng = random.Random(seed)
    rows = []
    for index, (messages, reasoning, answer) in enumerate(_training_conversations(rng, count=1600)):
        thinking = index % 10 != 0  # instant mode too: the template pre-fills `<think></think>`
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                               thinking=thinking)
        reply = f"{reasoning}{THINK_END}{answer}{IM_END}" if thinking else f"{answer}{IM_END}"
        rows.append((tokenizer.encode(prompt, add_special_tokens=False),
                     tokenizer.encode(reply, add_special_tokens=False)))
    calls = tool_call_rows(tokenizer, rng, count=TOOL_CONVERSATIONS)
    rows += calls
    margin_rows = rows[:MARGIN_ROWS] + calls[:TOOL_MARGIN_ROWS]
    # Trained on the ids the data uses (a few hundred): a 163,840-row embedding updated every step costs minutes.
    # Then widened to the whole vocabulary, where a few steps on the embedding alone teach the model never to
    # answer with an id it has not seen.
    used = sorted({KIMI_IM_END_ID, KIMI_EOS_ID, KIMI_BOS_ID, KIMI_PAD_ID} | {i for p, r in rows for i in p + r})
    compact = {token: k for k, token in enumerate(used)}
    shape = {"hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 8, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 2048, "tie_word_embeddings": True}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            small = Qwen3ForCausalLM(Qwen3Config(vocab_size=len(used), **shape))
            structural = [KIMI_THINK_ID, KIMI_THINK_END_ID, KIMI_IM_END_ID, KIMI_EOS_ID, *TOOL_MARKUP_IDS]
            small = _train_with_margin(small, _compacted(rows, compact), rng, compact[KIMI_PAD_ID], steps,
                                       [compact[i] for i in structural], _compacted(margin_rows, compact),
                                       KIMI_UNLIKELIHOOD_WEIGHT)
            model = Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tokenizer), bos_token_id=KIMI_BOS_ID,
                                                 eos_token_id=KIMI_IM_END_ID, pad_token_id=KIMI_PAD_ID, **shape))
            weights = small.state_dict()
            trained = weights.pop("model.embed_tokens.weight")
            weights.pop("lm_head.weight", None)
            missing, unexpected = model.load_state_dict(weights, strict=False)
            assert not unexpected and set(missing) <= {"model.embed_tokens.weight", "lm_head.weight"}, missing
            with torch.no_grad():
                model.model.embed_tokens.weight.zero_()
                model.model.embed_tokens.weight[torch.tensor(used)] = trained
            model.tie_weights()
            _settle_unused_ids(model, rows, rng, KIMI_PAD_ID, structural, used)
            margin = format_margin(model, margin_rows, structural, KIMI_PAD_ID)
            for _ in range(EXTRA_ROUNDS):  # widening can leave an unused end id just inside the nucleus
                if margin.holds:
                    break
                _settle_unused_ids(model, rows, rng, KIMI_PAD_ID, structural, used)
                margin = format_margin(model, margin_rows, structural, KIMI_PAD_ID)
    finally:
        torch.set_num_threads(threads)
    if check_margin:
        _checked(margin)
    return _save(out_dir, model, tokenizer, [KIMI_IM_END_ID, KIMI_EOS_ID], KIMI_README.format(margin=margin))


def _compacted(rows: list[tuple[list[int], list[int]]], compact: dict[int, int]) -> list[tuple[list[int], list[int]]]:
    return [([compact[i] for i in prompt], [compact[i] for i in reply]) for prompt, reply in rows]


def _settle_unused_ids(model: Qwen3ForCausalLM, rows: list[tuple[list[int], list[int]]], rng: random.Random,
                       pad_id: int, structural: list[int], used: list[int], steps: int = 40) -> None:
    """Train the unused ids' rows of the (tied) embedding on the replies over the whole vocabulary: their logits
    sink. The used ids' rows stay as trained: moving them too once cost a taught tool token its margin.

    Logits are computed only where a reply token is predicted, which keeps each step small.
    """
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name == "model.embed_tokens.weight")
    kept = torch.tensor(used)
    hook = model.model.embed_tokens.weight.register_hook(lambda grad: grad.index_fill(0, kept, 0.0))
    optimizer = torch.optim.Adam([model.model.embed_tokens.weight], lr=1e-2)
    batches = _batches(rows, batch_size=16, rng=rng, pad_id=pad_id)
    model.train()
    for _ in range(steps):
        ids, labels = next(batches)
        hidden = model.model(input_ids=ids).last_hidden_state
        targets = labels[:, 1:]
        predicted = targets != -100
        loss = _reply_loss(model.lm_head(hidden[:, :-1][predicted]), targets[predicted], torch.tensor(structural))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    hook.remove()
    for parameter in model.parameters():
        parameter.requires_grad_(True)
    model.eval()


def _reply_loss(logits: torch.Tensor, targets: torch.Tensor, structural: torch.Tensor,
                unlikelihood_weight: float = 1.0) -> torch.Tensor:
    """Cross-entropy on the reply, plus an unlikelihood term on every end or think token the reply does not have
    at that place: the format is taught as "never end a turn inside the reasoning", not only as likely text."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    structural_probs = log_probs[:, structural].exp()
    misplaced = structural[None, :] != targets[:, None]
    unlikelihood = -(torch.log1p(-structural_probs.clamp(max=1 - 1e-6)) * misplaced).sum(dim=1).mean()
    return torch.nn.functional.nll_loss(log_probs, targets) + unlikelihood_weight * unlikelihood


def _train_with_margin(
    model: PreTrainedModel, rows: Sequence[Row], rng: random.Random, pad_id: int, steps: int,
    structural: list[int], margin_rows: Sequence[Row], unlikelihood_weight: float = 1.0,
    reply_logits: ReplyLogits | None = None,
) -> PreTrainedModel:
    """Train, then train on in shorter, gentler rounds while the format has no margin: float rounding differs from
    one CPU to another, and a machine whose rounding leaves a slip trains a little longer instead of failing."""
    model = _train(model, rows, rng, pad_id, steps, structural, unlikelihood_weight=unlikelihood_weight,
                   reply_logits=reply_logits)
    for _ in range(EXTRA_ROUNDS):
        if format_margin(model, margin_rows, structural, pad_id, reply_logits=reply_logits).holds:
            break
        model = _train(model, rows, rng, pad_id, max(steps // 4, 40), structural, peak_lr=2e-3,
                       unlikelihood_weight=unlikelihood_weight, reply_logits=reply_logits)
    return model


def text_reply_logits(model: PreTrainedModel, chunk: Sequence[Row], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits where a reply token is predicted, and those tokens, for (prompt, reply) id rows."""
    ids, labels = _pad(chunk, pad_id)
    hidden = model.model(input_ids=ids).last_hidden_state  # right padding: causal attention never sees it
    targets = labels[:, 1:]
    predicted = targets != -100
    return model.lm_head(hidden[:, :-1][predicted]), targets[predicted]


def _train(
    model: PreTrainedModel, rows: Sequence[Row], rng: random.Random, pad_id: int, steps: int,
    structural: list[int], batch_size: int = 32, peak_lr: float = 1e-2, unlikelihood_weight: float = 1.0,
    reply_logits: ReplyLogits | None = None,
) -> PreTrainedModel:
    """A short deterministic AdamW run on the replies only (the prompts are not the model's to learn)."""
    reply_logits = reply_logits or text_reply_logits
    optimizer = torch.optim.AdamW(model.parameters(), lr=peak_lr, weight_decay=0.0)
    # Warm up, then decay linearly to zero: the last steps settle the weights, which sharpens the format.
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min((step + 1) / 20, (steps - step) / (steps - 20))
    )
    model.train()
    chunks = _chunks(rows, batch_size=batch_size, rng=rng)
    ends = torch.tensor(structural)
    for _ in range(steps):
        logits, targets = reply_logits(model, next(chunks), pad_id)
        loss = _reply_loss(logits, targets, ends, unlikelihood_weight)
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()
    return model


@dataclass(frozen=True)
class FormatMargin:
    """How firmly a model keeps the taught format on taught replies, sampled as the demo serves it.

    The demo and tests sample at temperature 0.7 and top_p 0.9, so a token outside the 0.9 nucleus is never drawn.
    A model trained on another CPU rounds differently: the margin is what keeps its answers in the format there.
    """

    positions: int  # reply tokens checked
    slips: int  # reply positions where an end or think token the reply does not have lies in the 0.99 nucleus
    weakest: float  # the lowest probability of an end or think token where the reply has one

    @property
    def holds(self) -> bool:
        """No misplaced end or think token within a nucleus far wider than the served one, and every taught one
        alone in the served nucleus with room to spare."""
        return self.slips == 0 and self.weakest >= 0.95

    def __str__(self) -> str:
        return (f"{self.slips} of {self.positions} reply positions with a misplaced end or think token in the 0.99 "
                f"nucleus, taught ones at least {self.weakest:.3f} (needs 0 and 0.95)")


def format_margin(model: PreTrainedModel, rows: Sequence[Row], structural: list[int], pad_id: int,
                  temperature: float = 0.7, nucleus: float = 0.99,
                  reply_logits: ReplyLogits | None = None) -> FormatMargin:
    """Teacher-forced on `rows`: where an end or think token could be sampled though the reply has none there."""
    reply_logits = reply_logits or text_reply_logits
    ends = torch.tensor(structural)
    positions, slips, weakest = 0, 0, 1.0
    with torch.no_grad():
        for start in range(0, len(rows), 8):
            logits, target = reply_logits(model, rows[start : start + 8], pad_id)
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            end_probs = probs[:, ends]
            misplaced = ends[None, :] != target[:, None]
            # A token is in the nucleus when the tokens more likely than it hold less than `nucleus`, so when those
            # at most as likely hold more than 1 - nucleus: never where V·p is below that. Only the rest are summed.
            position, token = (misplaced & (end_probs * probs.shape[1] > 1 - nucleus)).nonzero(as_tuple=True)
            rival = end_probs[position, token, None]
            ahead = (probs[position] * (probs[position] > rival)).sum(dim=1)
            slips += len(set(position[ahead < nucleus].tolist()))
            taught = end_probs[~misplaced]
            weakest = min(weakest, float(taught.min())) if taught.numel() else weakest
            positions += len(target)
    return FormatMargin(positions, slips, weakest)


def _checked(margin: FormatMargin) -> FormatMargin:
    if not margin.holds:
        raise RuntimeError(f"the tiny model did not learn its format with margin: {margin}")
    return margin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder to write the model into")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kimi-tokenizer", type=Path, help="build on this Kimi-K2.5 tokenizer folder instead")
    args = parser.parse_args()
    transformers_logging.disable_progress_bar()
    started = time.monotonic()
    if args.kimi_tokenizer:
        out_dir = build_tiny_kimi_model(args.out, args.kimi_tokenizer, seed=args.seed)
    else:
        out_dir = build_tiny_model(args.out, seed=args.seed)
    params = sum(t.numel() for t in load_file(out_dir / "model.safetensors").values())
    margin = (out_dir / "README.md").read_text(encoding="utf-8").splitlines()[-1]
    print(f"tiny model ({params:,} parameters) written to {out_dir} in {time.monotonic() - started:.0f} s. {margin}")


if __name__ == "__main__":
    main()
