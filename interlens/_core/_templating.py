"""Per-row templates: ``shared_context``, ``shared_system_prompt`` and each ``system_prompt``.

A template value is one of:

- a ``str``, used as is;
- ``dataset_field("col")``: the row's column, as text;
- a ``callable(row) -> str``;
- a ``tuple`` of the above, joined;
- a PEP 750 t-string (Python 3.14+): its interpolations are template values themselves, so
  ``t"Q: {dataset_field('q')}"`` works. It is recognised by shape (``strings`` + ``interpolations``), so this
  module imports nothing from ``string.templatelib`` and runs on 3.11.

Templates resolve once per row when a rollout expands its jobs (row i ⟷ job i), which keeps resume correct.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias

from ._exceptions import ConfigurationError, MissingColumnError, TemplateError
from ._validate import check_text

__all__ = [
    "DatasetField",
    "Template",
    "dataset_field",
    "is_templated",
    "resolve",
    "template_from_json",
    "template_to_json",
]

Template: TypeAlias = Any  # str | DatasetField | Callable[[Mapping], str] | tuple[Template, ...] | t-string


@dataclass(frozen=True)
class DatasetField:
    """A reference to one column of the data row; see :func:`dataset_field`."""

    column: str

    def __repr__(self) -> str:
        return f"dataset_field({self.column!r})"


def dataset_field(column: str) -> DatasetField:
    """Template value that takes ``column`` from each data row (one conversation per row)."""
    if not isinstance(column, str) or not column:
        raise ConfigurationError(f"dataset_field() needs a column name (a non-empty str), got {column!r}")
    return DatasetField(column)


def _is_tstring(value: Any) -> bool:
    return hasattr(value, "strings") and hasattr(value, "interpolations") and not isinstance(value, str)


def is_templated(value: Template) -> bool:
    """Whether resolving ``value`` needs a data row."""
    if value is None or isinstance(value, str):
        return False
    if isinstance(value, DatasetField) or callable(value):
        return True
    if isinstance(value, tuple):
        return any(is_templated(part) for part in value)
    if _is_tstring(value):
        return any(is_templated(i.value) for i in value.interpolations)
    return False


def check_template(value: Template, *, field: str, _part: bool = False) -> None:
    """Reject a value that is not a template, at construction time, naming the field: also ``None`` inside a
    tuple (it would silently join as nothing) and a callable that cannot take the row as its one argument."""
    if value is None and _part:
        raise ConfigurationError(
            f'{field}: a template tuple holds None, which would join as nothing; drop it, or use "" for an '
            "intended empty part"
        )
    if callable(value) and not isinstance(value, DatasetField):
        _check_signature(value, field=field)
        return
    if isinstance(value, str):
        check_text(value, what=field)
        return
    if value is None or isinstance(value, DatasetField) or _is_tstring(value):
        return
    if isinstance(value, tuple):
        for part in value:
            check_template(part, field=field, _part=True)
        return
    raise ConfigurationError(
        f"{field} must be a str, dataset_field('col'), a callable(row) -> str, a tuple of those, or a "
        "t-string; "
        f"got {type(value).__name__}: {value!r}"
    )


def _check_signature(value: Callable[..., Any], *, field: str) -> None:
    """A template callable gets the row as its one positional argument: refuse one that cannot take it."""
    import inspect

    try:
        signature = inspect.signature(value)
    except (TypeError, ValueError):  # a builtin without a signature: it will be tried on the row
        return
    try:
        signature.bind({})
    except TypeError as exc:
        raise ConfigurationError(
            f"{field}: the template callable {_name(value)}{signature} cannot be called with the data row as "
            f"its one argument ({exc}); write it as a function of the row, such as lambda row: ..."
        ) from None


def _name(value: Any) -> str:
    return str(getattr(value, "__qualname__", None) or getattr(value, "__name__", None) or repr(value))


def resolve(value: Template, row: Mapping[str, Any] | None, *, field: str = "template") -> str | None:
    """Resolve ``value`` against ``row``. ``None`` stays ``None``."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, tuple):
        return "".join(resolve(part, row, field=field) or "" for part in value)
    if _is_tstring(value):
        return _resolve_tstring(value, row, field=field)
    if row is None:
        raise TemplateError(
            f"{field} is templated ({value!r}) but this conversation has no data row: attach data with "
            ".data(rows) and call .rollout(), which resolves one conversation per row"
        )
    if isinstance(value, DatasetField):
        if value.column not in row:
            raise MissingColumnError(
                f"{field} uses dataset_field({value.column!r}) but the row has no column {value.column!r}; "
                f"available columns: {sorted(row)}"
            )
        return _cell_text(row[value.column], column=value.column, field=field)
    if callable(value):
        try:
            result = value(row)
        except Exception as exc:  # the user's code on one row: that row's job fails, the rest go on
            raise TemplateError(
                f"{field}: the template callable {_name(value)} raised {type(exc).__name__}: {exc} on this "
                f"row (its columns: {list(row)[:20]})"
            ) from exc
        if not isinstance(result, str):
            raise TemplateError(
                f"{field}: the template callable {value!r} returned {type(result).__name__}, not str"
            )
        return result
    raise TemplateError(f"{field}: cannot resolve template value {value!r}")


def is_missing(cell: Any) -> bool:
    """A missing value as data libraries write one: None, NaN (Python's, numpy's), pandas' NA and NaT."""
    if cell is None or type(cell).__name__ in ("NAType", "NaTType"):
        return True
    if isinstance(cell, float) or getattr(cell, "ndim", None) == 0:  # numpy scalars have ndim 0
        try:
            return bool(cell != cell)
        except (TypeError, ValueError):
            return False
    return False


def _cell_text(cell: Any, *, column: str, field: str) -> str:
    """A row's cell as prompt text: a missing value refused (its text would be 'None' or 'nan', never what
    the prompt meant), an empty one warned about once."""
    if is_missing(cell):
        raise TemplateError(
            f"{field} uses dataset_field({column!r}) but this row's {column!r} is {cell!r}, a missing value: "
            f"its prompt would read {str(cell)!r}. Fill or drop such rows before .data(...) (pandas: "
            f"df.dropna(subset=[{column!r}]) or df.fillna({{{column!r}: '...'}}))"
        )
    text = str(cell)
    if not text.strip():
        warnings.warn(
            f"{field} uses dataset_field({column!r}), which is empty in some rows, so their prompt is empty "
            "there (this warning is shown once). If that is meant, ignore it; else fill or drop those rows",
            UserWarning,
            stacklevel=2,
        )
    return text


def _resolve_tstring(value: Any, row: Mapping[str, Any] | None, *, field: str) -> str:
    out: list[str] = []
    strings = list(value.strings)
    for i, interp in enumerate(value.interpolations):
        out.append(strings[i])
        resolved: Any = interp.value
        if is_templated(resolved) or isinstance(resolved, tuple):
            resolved = resolve(resolved, row, field=field)
        conversion = getattr(interp, "conversion", None)
        if conversion == "r":
            resolved = repr(resolved)
        elif conversion == "s":
            resolved = str(resolved)
        elif conversion == "a":
            resolved = ascii(resolved)
        out.append(format(resolved, getattr(interp, "format_spec", "") or ""))
    out.append(strings[-1] if len(strings) > len(value.interpolations) else "")
    return "".join(out)


def callable_path(fn: Callable[..., Any], *, what: str) -> str:
    """``module:qualname`` of a module-level function, so JSON can name it; a clear error otherwise."""
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not module or not qualname or "<locals>" in qualname or "<lambda>" in qualname:
        raise ConfigurationError(
            f"{what} {fn!r} is a lambda or closure, which JSON cannot name; use a module-level function "
            "(or a dataset_field / plain string)"
        )
    return f"{module}:{qualname}"


def import_callable(path: str) -> Callable[..., Any]:
    module, _, qualname = path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def template_to_json(value: Template, *, field: str = "template") -> Any:
    """A JSON form of ``value`` (for ``save`` and recipe fingerprints)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, DatasetField):
        return {"$field": value.column}
    if isinstance(value, tuple):
        return {"$concat": [template_to_json(part, field=field) for part in value]}
    if _is_tstring(value):
        parts: list[Any] = []
        strings = list(value.strings)
        for i, interp in enumerate(value.interpolations):
            parts.append(strings[i])
            parts.append(
                template_to_json(interp.value, field=field)
                if is_templated(interp.value)
                else str(interp.value)
            )
        parts.append(strings[-1] if len(strings) > len(value.interpolations) else "")
        return {"$concat": parts}
    if callable(value):
        return {"$callable": callable_path(value, what=f"{field} template")}
    raise TemplateError(f"{field}: cannot serialize template value {value!r}")


def template_from_json(data: Any) -> Template:
    if data is None or isinstance(data, str):
        return data
    if "$field" in data:
        return DatasetField(data["$field"])
    if "$concat" in data:
        return tuple(template_from_json(part) for part in data["$concat"])
    if "$callable" in data:
        return import_callable(data["$callable"])
    raise TemplateError(f"unknown template JSON {data!r}")


def describe_callable(fn: Any) -> str:
    """Name + a hash of the code: stable across runs, changes when the function body changes.

    Never a repr: a callable object's default repr holds its memory address, which would make every rerun's
    recipe fingerprint differ. An instance with ``__call__`` is named by its class and that method's code;
    a ``functools.partial`` by its function and arguments.
    """
    import functools
    import hashlib

    if isinstance(fn, functools.partial):
        return f"partial({describe_callable(fn.func)}, args={fn.args!r}, keywords={fn.keywords!r})"
    owner: Any = fn
    code = getattr(fn, "__code__", None)
    if code is None and not hasattr(fn, "__qualname__"):  # a callable instance: its class says what it does
        owner = type(fn)
        code = getattr(owner.__call__, "__code__", None)
    digest = hashlib.sha256(_code_bytes(code)).hexdigest()[:16] if code else ""
    name = getattr(owner, "__qualname__", type(fn).__qualname__)
    return f"{getattr(owner, '__module__', '?')}:{name}#{digest}"


def _code_bytes(code: Any) -> bytes:
    """A code object's bytecode and constants, nested code (comprehensions, inner functions) included by
    content: the repr of a code object holds its memory address, which differs on every run."""
    parts = [code.co_code]
    for const in code.co_consts:
        parts.append(_code_bytes(const) if hasattr(const, "co_code") else repr(const).encode())
    return b"\x00".join(parts)


def describe_template(value: Template) -> Any:
    """Like template JSON, but lambdas are named by their code instead of refused."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, DatasetField):
        return {"$field": value.column}
    if isinstance(value, tuple):
        return {"$concat": [describe_template(v) for v in value]}
    if callable(value):
        return {"$callable": describe_callable(value)}
    return repr(value)
