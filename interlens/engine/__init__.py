"""The local generation engine: sampling, the model runner and its decode loop, the kept-KV store, one
object per generation path (plain batch, reused-prefix batch, slot layout for deterministic turns, hooked
row), the batch-invariance self-test, the process-wide model cache, chat templates and the chat engine the
scheduler runs.
"""

from ._chat_engine import ChatEngine, ChatRequest, ChatScoreRequest
from ._model_cache import load_engine, release_kept
from ._sampling import SamplingSettings

__all__ = [
    "ChatEngine",
    "ChatRequest",
    "ChatScoreRequest",
    "SamplingSettings",
    "load_engine",
    "release_kept",
]
