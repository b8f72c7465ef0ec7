"""A Conversation as JSON: the recipe's JSON, the schema version, ``save`` and ``load``.

Apart from ``_conversation`` because it is a format, not behaviour: what the ledger and ``save`` store, and
how a file written by another version (or not by interlens at all) is refused with an error naming it. It
never imports ``Conversation``: ``load`` is handed the class, so imports run one way (conversation → here).
JSON only, never pickle.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._core import (
    ConfigurationError,
    InterlensError,
    SchemaVersionError,
    TemplateError,
    Transcript,
    callable_path,
    condition_from_json,
    describe_callable,
    describe_template,
    import_callable,
    invalid_text,
    is_missing,
    template_from_json,
    template_to_json,
)
from ..participants import participant_from_json

if TYPE_CHECKING:
    from ._conversation import Conversation

__all__ = ["SAVE_FILE", "SCHEMA_VERSION", "check_schema", "json_safe", "load", "recipe_json", "save"]

SCHEMA_VERSION = 1
"""Version of the JSON written by ``save`` and stored in the ledger. A newer one is refused on load."""

SAVE_FILE = "conversation.json"


def recipe_json(conv: Conversation, *, strict: bool) -> dict[str, Any]:
    """The recipe of ``conv`` as JSON (see ``Conversation.recipe_json``)."""
    if strict:
        participants = [p.to_json() for p in conv.participants]
        context = template_to_json(conv.shared_context, field="shared_context")
        system = template_to_json(conv.shared_system_prompt, field="shared_system_prompt")
    else:
        participants = [p.describe() for p in conv.participants]
        context = describe_template(conv.shared_context)
        system = describe_template(conv.shared_system_prompt)
    return {
        "participants": participants,
        "shared_context": context,
        "shared_system_prompt": system,
        "turns": conv.turns(),
        "stop": [c.to_json() for c in conv.stop_conditions],
        "analyzer": _analyzer_json(conv.analyzer_fn, strict=strict),
        "name": conv.name(),
    }


def save(conv: Conversation, directory: str | os.PathLike[str]) -> Path:
    """Write ``conv.to_json(strict=True)`` to ``directory/conversation.json``, atomically."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    payload = conv.to_json(strict=True)
    target = path / SAVE_FILE
    tmp = target.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2, ensure_ascii=False))
    os.replace(tmp, target)
    return target


def load(cls: type[Conversation], directory: str | os.PathLike[str]) -> Conversation:
    """Read a conversation written by :func:`save` as a ``cls``; refuse anything else, naming the file."""
    target = Path(directory) / SAVE_FILE
    if not target.exists():
        raise ConfigurationError(f"no saved conversation at {target} (save(dir) writes {SAVE_FILE})")
    refused = f"{target} is not a conversation saved by Conversation.save() (the file was left untouched)"
    try:
        payload = json.loads(target.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigurationError(f"{refused}: it is not valid JSON ({exc})") from None
    if not isinstance(payload, dict) or not isinstance(payload.get("schema"), int):
        keys = sorted(payload)[:8] if isinstance(payload, dict) else type(payload).__name__
        raise ConfigurationError(f"{refused}: it has no interlens 'schema' version (found {keys})")
    try:
        check_schema(payload)
        return _from_payload(cls, payload)
    except InterlensError as exc:
        raise type(exc)(f"cannot load {target}: {exc}") from exc
    except ImportError as exc:
        raise ConfigurationError(
            f"cannot load {target}: a function it names cannot be imported ({exc}); make its module "
            "importable (on sys.path) before loading"
        ) from exc
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ConfigurationError(
            f"cannot load {target}: it does not have the shape Conversation.save() writes "
            f"({type(exc).__name__}: {exc}); the file was left untouched"
        ) from exc


def _from_payload(cls: type[Conversation], payload: Mapping[str, Any]) -> Conversation:
    recipe = payload["recipe"]
    stop = []
    for item in recipe.get("stop", []):
        condition = condition_from_json(item)
        if condition is None:
            raise ConfigurationError(
                f"cannot rebuild custom stop condition {item} from JSON; "
                "re-attach it with .run_until(...) after loading"
            )
        stop.append(condition)
    conv = cls(
        [participant_from_json(p) for p in recipe["participants"]],
        shared_context=template_from_json(recipe.get("shared_context")),
        shared_system_prompt=template_from_json(recipe.get("shared_system_prompt")),
        turns=recipe.get("turns"),
        analyzer=_analyzer_from_json(recipe.get("analyzer")),
        name=recipe.get("name"),
        stop=stop,
    )
    conv.transcript = Transcript.from_json(payload.get("transcript", []))
    conv.row = payload.get("row")
    conv.seed = payload.get("seed")
    return conv


def check_schema(payload: Mapping[str, Any]) -> None:
    version = payload.get("schema")
    if not isinstance(version, int):
        raise SchemaVersionError(f"not an interlens conversation (no schema version): keys {sorted(payload)}")
    if version > SCHEMA_VERSION:
        raise SchemaVersionError(
            f"this conversation was saved with schema {version}, newer than this interlens understands "
            f"({SCHEMA_VERSION}); upgrade interlens to load it"
        )


def _analyzer_json(analyzer: Any, *, strict: bool) -> Any:
    if analyzer is None or isinstance(analyzer, str):
        return analyzer
    if strict:
        try:
            return {"$callable": callable_path(analyzer, what="analyzer")}
        except ConfigurationError:
            return {"$unsaved": describe_callable(analyzer)}  # a closure: the dialogue still saves
    return {"$callable": describe_callable(analyzer)}


def _analyzer_from_json(data: Any) -> Any:
    if data is None or isinstance(data, str):
        return data
    if "$callable" in data:
        return import_callable(data["$callable"])
    return None  # a closure could not be saved; re-attach with .analyzer(...)


def storable_row(row: Any, index: int | None) -> dict[str, Any] | None:
    """``row`` as the dict a job holds and the ledger stores, or the error that fails its job before any
    turn runs (nothing is paid for on a row that could not be recorded): a row that is no mapping, or one
    holding text that is not text (a lone surrogate, left by a broken decode)."""
    if row is None:
        return None
    if not hasattr(row, "keys"):
        raise TemplateError(f"data row {index} is a {type(row).__name__}, not a mapping of column -> value")
    row_dict = dict(row)
    for column, cell in row_dict.items():
        why = _unstorable(cell)
        if why is not None:
            raise ConfigurationError(f"data row {index}, column {column!r}: {why}")
    return row_dict


def _unstorable(cell: Any) -> str | None:
    if isinstance(cell, str):
        return invalid_text(cell)
    if isinstance(cell, Mapping):
        cell = [*cell.keys(), *cell.values()]
    if isinstance(cell, list | tuple):
        return next((why for part in cell if (why := _unstorable(part)) is not None), None)
    return None


def json_safe(value: Any) -> Any:
    """Rows can hold anything (numpy scalars, images); keep what JSON can say, stringify the rest. A missing
    value (NaN, pandas' NA) is stored as null, as pandas and Arrow write it: JSON has no NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else str(value)  # ±inf: 'inf' / '-inf', no number JSON can hold
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if is_missing(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    item = getattr(value, "item", None)
    if callable(item):
        try:
            return json_safe(item())
        except (TypeError, ValueError):
            pass
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return json_safe(tolist())
    return str(value)
