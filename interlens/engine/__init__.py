"""The local generation engine: sampling, the model runner and its decode loop, the kept-KV store, one
object per generation path (plain batch, reused-prefix batch, slot layout for deterministic turns, hooked
row), the batch-invariance self-test, the process-wide model cache, chat templates and the chat engine the
scheduler runs, and what a load recipe adds to transformers' ``from_pretrained`` (checked ``load_kwargs``,
GGUF files).
"""

from ._chat_engine import ChatEngine, ChatRequest, ChatScoreRequest
from ._load_options import check_load_kwargs, gguf_path, load_kwargs_key, no_chat_template, read_gguf_header
from ._model_cache import load_engine, release_kept
from ._sampling import SamplingSettings

__all__ = [
    "ChatEngine",
    "ChatRequest",
    "ChatScoreRequest",
    "SamplingSettings",
    "check_load_kwargs",
    "gguf_path",
    "load_engine",
    "load_kwargs_key",
    "no_chat_template",
    "read_gguf_header",
    "release_kept",
]
