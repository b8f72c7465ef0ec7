"""Interpretability records and hooks: activation capture, steering vectors, decoder-layer hooks, probes and
scored continuations. Below the engine, which runs them; above the core only.
"""

from ._capture import ActivationCache, ActivationRecord, Captured, CaptureSpec, CaptureTarget, layer_indices
from ._hooks import DecoderLayer, decoder_layers, hidden_size, hooked, site_problem, text_config
from ._probes import Probe
from ._scoring import Logprobs, ScoredText
from ._steering import SteeringSpec, steering_from

__all__ = [
    "ActivationCache",
    "ActivationRecord",
    "CaptureSpec",
    "CaptureTarget",
    "Captured",
    "DecoderLayer",
    "Logprobs",
    "Probe",
    "ScoredText",
    "SteeringSpec",
    "decoder_layers",
    "hidden_size",
    "hooked",
    "layer_indices",
    "site_problem",
    "steering_from",
    "text_config",
]
