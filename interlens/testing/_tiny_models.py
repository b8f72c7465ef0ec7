"""Tiny random-weight models of real families (qwen2, llama, gemma2, gemma3), built locally for tests.

Why build instead of download: tests and CI run offline, and a real checkpoint is far too slow for a unit
test. A tiny model is the next best thing to a real one because it goes through the same doors a user's
model does. It is saved with ``save_pretrained`` (safetensors) and loaded with
``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained``. Its tokenizer is a real
byte-level BPE, trained here in a fraction of a second on Python's own standard-library sources, carrying
the family's REAL special tokens. Its chat template is the family's real jinja template, so template quirks
(Gemma refusing a system role, Qwen's default system prompt, Llama's BOS before the first header) show up
in tests exactly as they do with real weights.

Builds are cached on disk (``$INTERLENS_TEST_MODELS`` or ``~/.cache/interlens/tiny-models``), keyed by
family, size, recipe version and the versions of the libraries that shape the files. A build happens in a
temporary directory that is renamed into place with one ``os.replace``, so concurrent builders (several
pytest processes, spawned workers) never see a half-written model: the loser of the race drops its copy.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._core import ConfigurationError

__all__ = ["TINY_FAMILIES", "TINY_SIZES", "tiny_model"]

TINY_FAMILIES: tuple[str, ...] = ("qwen2", "llama", "gemma2", "gemma3")
"""Model families :func:`tiny_model` can build."""

TINY_SIZES: tuple[str, ...] = ("tiny", "bench")
"""``"tiny"``: ~0.1 M parameters, for unit tests. ``"bench"``: ~25-30 M parameters, for benchmarks."""

# Bump when anything below changes what a build produces: old cache entries are then simply not found.
_RECIPE_VERSION = 2
_WEIGHT_SEED = 20240601


@dataclass(frozen=True)
class _Size:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    corpus_files: int  # how many of _CORPUS_FILES the tokenizer is trained on
    sliding_window: int  # for the families with sliding-window layers (gemma2, gemma3)
    max_positions: int


_SIZES: dict[str, _Size] = {
    # Sliding window 64 on purpose: test conversations cross it, so sliding-window cache paths get exercised.
    "tiny": _Size(
        hidden=64,
        layers=2,
        heads=4,
        kv_heads=2,
        intermediate=128,
        vocab=512,
        corpus_files=4,
        sliding_window=64,
        max_positions=4096,
    ),
    "bench": _Size(
        hidden=512,
        layers=8,
        heads=8,
        kv_heads=4,
        intermediate=1536,
        vocab=4096,
        corpus_files=12,
        sliding_window=512,
        max_positions=4096,
    ),
}


@dataclass(frozen=True)
class _Family:
    model_type: str
    specials: tuple[str, ...]  # special tokens, given ids 0..n-1 in this order
    bos: str | None
    eos: str  # the tokenizer's eos_token (what the released tokenizer declares)
    stops: tuple[str, ...]  # tokens that end generation: config / generation_config eos_token_id
    pad: str
    unk: str | None
    add_bos: bool  # whether plain encoding prepends BOS (Llama-3 and Gemma tokenizers do)
    chat_template: str


def _families() -> dict[str, _Family]:
    return {
        "qwen2": _Family(
            model_type="qwen2",
            specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
            bos=None,
            eos="<|im_end|>",
            stops=("<|im_end|>", "<|endoftext|>"),
            pad="<|endoftext|>",
            unk=None,
            add_bos=False,
            chat_template=QWEN2_TEMPLATE,
        ),
        "llama": _Family(
            model_type="llama",
            specials=(
                "<|begin_of_text|>",
                "<|end_of_text|>",
                "<|start_header_id|>",
                "<|end_header_id|>",
                "<|eot_id|>",
                "<|eom_id|>",
                "<|finetune_right_pad_id|>",
            ),
            bos="<|begin_of_text|>",
            eos="<|eot_id|>",
            stops=("<|end_of_text|>", "<|eot_id|>"),
            pad="<|finetune_right_pad_id|>",
            unk=None,
            add_bos=True,
            chat_template=LLAMA3_TEMPLATE,
        ),
        "gemma2": _Family(
            model_type="gemma2",
            specials=("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"),
            bos="<bos>",
            eos="<eos>",
            stops=("<eos>", "<end_of_turn>"),
            pad="<pad>",
            unk="<unk>",
            add_bos=True,
            chat_template=GEMMA2_TEMPLATE,
        ),
        "gemma3": _Family(
            model_type="gemma3_text",
            specials=("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"),
            bos="<bos>",
            eos="<eos>",
            stops=("<eos>", "<end_of_turn>"),
            pad="<pad>",
            unk="<unk>",
            add_bos=True,
            chat_template=GEMMA3_TEMPLATE,
        ),
    }


# Standard-library sources: always present, no network, plenty of English (docstrings) and code.
_CORPUS_FILES = (
    "textwrap.py",
    "string.py",
    "difflib.py",
    "argparse.py",
    "dataclasses.py",
    "functools.py",
    "typing.py",
    "inspect.py",
    "pathlib.py",
    "shutil.py",
    "json/decoder.py",
    "collections/__init__.py",
)

# A little chat-shaped English so role names and common words become single tokens.

# Qwen/Qwen2.5-*-Instruct (tool-calling branches included, default system prompt when none is given).
QWEN2_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    '    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'
    'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}\n'
    "    {%- for tool in tools %}\n"
    '        {{- "\\n" }}\n'
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": '
    '<args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n'
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or '
    '(message.role == "assistant" and not message.tool_calls) %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    '    {%- elif message.role == "assistant" %}\n'
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    '            {{- \'\\n<tool_call>\\n{"name": "\' }}\n'
    "            {{- tool_call.name }}\n"
    '            {{- \'", "arguments": \' }}\n'
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    '    {%- elif message.role == "tool" %}\n'
    '        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}\n'
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

# meta-llama/Meta-Llama-3-8B-Instruct.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

# google/gemma-2-*-it: no system role, strict user/assistant alternation, assistant rendered as "model".
GEMMA2_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"
)

# google/gemma-3-*-it (text part): a system message is folded into the first user turn.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    '    {%- set first_user_prefix = "" -%}\n'
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    '        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}\n'
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    '        {%- set role = "model" -%}\n'
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    '        {{ raise_exception("Invalid content type") }}\n'
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\\n'}}\n"
    "{%- endif -%}\n"
)


_CHAT_TEXT = """\
user: Hello! Can you help me with a question about Python?
assistant: Of course. What would you like to know?
system: You are a helpful assistant. Answer briefly and be kind.
user: Is a hot dog a sandwich? Give one argument for and one against.
model: For: it is a filling between bread. Against: the bread is one piece, hinged, not two slices.
user: Debate: tabs vs spaces. Argue for spaces.
assistant: Spaces look the same in every editor, so the code reads the same everywhere.
user: Solve this problem. A farmer has 12 sheep and buys 7 more. How many sheep? Final answer: 19
"""


def tiny_model(
    family: str = "qwen2",
    *,
    size: str = "tiny",
    cache_dir: str | os.PathLike[str] | None = None,
    ends_turns: bool = False,
) -> str:
    """Return a local directory holding a tiny ``family`` model, building it on first use.

    The directory loads with ``AutoModelForCausalLM.from_pretrained(path)`` and
    ``AutoTokenizer.from_pretrained(path)``; nothing is ever downloaded. Weights are random but seeded, so a
    given environment always builds the same model.

    A random model almost never picks its end-of-turn token (one in the vocabulary), so its turns run to
    ``max_new_tokens``. ``ends_turns=True`` builds a variant whose LM head row for that token is scaled up
    (:data:`_END_ROW_SCALE`): the token wins after some steps and not others, so turns end by themselves at
    different lengths, and rows of one batch finish at different steps, as with a real chat model.
    """
    if family not in TINY_FAMILIES:
        raise ConfigurationError(
            f"tiny_model(family={family!r}): unknown family; choose one of {', '.join(TINY_FAMILIES)}."
        )
    if size not in _SIZES:
        raise ConfigurationError(
            f"tiny_model(size={size!r}): unknown size; choose one of {', '.join(TINY_SIZES)}."
        )
    root = Path(cache_dir) if cache_dir is not None else _default_root()
    final = root / (_cache_key(family, size) + ("-ends" if ends_turns else ""))
    if (final / "config.json").is_file():
        return str(final)
    with _build_lock(str(final)):
        if not (final / "config.json").is_file():
            root.mkdir(parents=True, exist_ok=True)
            _build_into(final, family, size, ends_turns)
    return str(final)


def _default_root() -> Path:
    env = os.environ.get("INTERLENS_TEST_MODELS")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "interlens" / "tiny-models"


def _cache_key(family: str, size: str) -> str:
    """Name a build after everything that shapes its files: a library upgrade never reuses a stale build."""
    versions = [f"py{sys.version_info[0]}.{sys.version_info[1]}"]
    for dist in ("torch", "transformers", "tokenizers"):
        try:
            versions.append(f"{dist}={importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{dist}=missing")
    digest = hashlib.sha256("|".join(versions).encode()).hexdigest()[:10]
    return f"{family}-{size}-r{_RECIPE_VERSION}-{digest}"


_locks_guard = threading.Lock()
_locks: dict[str, threading.Lock] = {}


def _build_lock(key: str) -> threading.Lock:
    """One lock per build target, so threads of one process build once (other processes race harmlessly)."""
    with _locks_guard:
        return _locks.setdefault(key, threading.Lock())


def _build_into(final: Path, family: str, size: str, ends_turns: bool) -> None:
    spec = _families()[family]
    dims = _SIZES[size]
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        tokenizer = _train_tokenizer(spec, dims)
        model = _random_model(spec, dims, tokenizer)
        if ends_turns:
            _reachable_end(model, int(tokenizer.convert_tokens_to_ids(spec.stops[0])))
        _save_quietly(model, tokenizer, tmp)
        recipe = {"family": family, "size": size, "recipe_version": _RECIPE_VERSION, "seed": _WEIGHT_SEED}
        if ends_turns:
            recipe["ends_turns"] = True
        (tmp / "interlens_tiny_model.json").write_text(json.dumps(recipe, indent=2) + "\n")
        tmp.chmod(0o755)  # mkdtemp makes it owner-only; a shared cache should be readable by all
        try:
            os.replace(tmp, final)
        except OSError:
            # Another process renamed its build into place first; theirs is complete, ours is redundant.
            if not (final / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


#: How much the end-of-turn token's LM head row is scaled in an ``ends_turns`` model: its logit's spread is
#: then that many times the others', so it is the largest at some positions (measured on the tiny qwen2:
#: greedy turns of a few to a few dozen tokens) and not at others.
_END_ROW_SCALE = 2.0


def _reachable_end(model: Any, end_id: int) -> None:
    import torch

    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head[end_id] *= _END_ROW_SCALE


@contextlib.contextmanager
def quiet_progress() -> Iterator[None]:
    """transformers' progress bars off for the block: a test model's build is a detail, not something to
    report on stderr."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _save_quietly(model: Any, tokenizer: Any, path: Path) -> None:
    with quiet_progress():
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)


def _corpus(dims: _Size) -> str:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts = [_CHAT_TEXT * 20]
    for name in _CORPUS_FILES[: dims.corpus_files]:
        path = stdlib / name
        if path.is_file():
            parts.append(path.read_text(encoding="utf-8", errors="replace"))
    return "\n".join(parts)


def _train_tokenizer(spec: _Family, dims: _Size) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=dims.vocab,
        special_tokens=list(spec.specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_corpus(dims)], trainer=trainer)
    if spec.add_bos and spec.bos is not None:
        bos_id = tok.token_to_id(spec.bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{spec.bos} $A", pair=f"{spec.bos} $A $B", special_tokens=[(spec.bos, bos_id)]
        )
    named: dict[str, str] = {"eos_token": spec.eos, "pad_token": spec.pad}
    if spec.bos is not None:
        named["bos_token"] = spec.bos
    if spec.unk is not None:
        named["unk_token"] = spec.unk
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        chat_template=spec.chat_template,
        model_max_length=dims.max_positions,
        **named,
    )
    return hf


def _random_model(spec: _Family, dims: _Size, tokenizer: Any) -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    def token_id(token: str | None) -> int | None:
        return None if token is None else int(tokenizer.convert_tokens_to_ids(token))

    stop_ids = [int(tokenizer.convert_tokens_to_ids(t)) for t in spec.stops]
    ids = {"bos_token_id": token_id(spec.bos), "eos_token_id": stop_ids, "pad_token_id": token_id(spec.pad)}
    kwargs: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "hidden_size": dims.hidden,
        "intermediate_size": dims.intermediate,
        "num_hidden_layers": dims.layers,
        "num_attention_heads": dims.heads,
        "num_key_value_heads": dims.kv_heads,
        "max_position_embeddings": dims.max_positions,
        # Untied: with tied random embeddings the current token's own embedding dominates the output and
        # greedy decoding repeats one token forever (badly so for Gemma, which scales embeddings up).
        "tie_word_embeddings": False,
        # Wider than the usual 0.02 so the random logits are peaked: greedy decoding then has clear winners
        # instead of near-ties that float noise between batched and single runs could flip.
        "initializer_range": 0.2,
        **ids,
    }
    head_dim = dims.hidden // dims.heads
    if spec.model_type in ("gemma2", "gemma3_text"):
        kwargs.update(head_dim=head_dim, query_pre_attn_scalar=head_dim, sliding_window=dims.sliding_window)
    if spec.model_type == "gemma3_text":
        # The real 5:1 sliding/full pattern, always ending on a full-attention layer.
        kwargs["layer_types"] = [
            "full_attention" if (i + 1) % 6 == 0 or i == dims.layers - 1 else "sliding_attention"
            for i in range(dims.layers)
        ]
    config = AutoConfig.for_model(spec.model_type, **kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_WEIGHT_SEED)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(**ids)
    return model
