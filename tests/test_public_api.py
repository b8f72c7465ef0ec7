"""The public face: every name in __all__ exists and is documented; importing interlens stays cheap."""

from __future__ import annotations

import subprocess
import sys

import pytest

import interlens
import interlens.scheduler
import interlens.store
import interlens.testing

PACKAGES = [interlens, interlens.scheduler, interlens.store, interlens.testing]


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.__name__)
def test_all_is_complete_and_importable(package):
    assert len(set(package.__all__)) == len(package.__all__), "duplicates in __all__"
    for name in package.__all__:
        assert hasattr(package, name), f"{package.__name__}.__all__ names {name!r} which does not exist"
    public = {n for n in vars(package) if not n.startswith("_")}
    modules = {n for n, v in vars(package).items() if type(v).__name__ == "module"}
    extra = public - set(package.__all__) - modules - {"annotations"}
    assert not extra, f"{package.__name__} exposes names missing from __all__: {sorted(extra)}"


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.__name__)
def test_public_names_are_documented(package):
    for name in package.__all__:
        obj = getattr(package, name)
        if callable(obj) and not isinstance(obj, type(interlens)):
            assert (obj.__doc__ or "").strip(), f"{package.__name__}.{name} has no docstring"


@pytest.mark.floors
def test_import_interlens_is_cheap():
    code = (
        "import sys, interlens; "
        "heavy = [m for m in ('torch', 'transformers', 'datasets', 'openai', 'anthropic', 'httpx2', "
        "'jinja2', 'ray') if m in sys.modules]; print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"import interlens imported {out.stdout.strip()}"


def test_scheduler_and_store_are_not_top_level_packages():
    code = "import importlib.util as u; print(u.find_spec('scheduler'), u.find_spec('store'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.strip() == "None None"


def test_exceptions_share_one_root():
    for name in interlens.__all__:
        obj = getattr(interlens, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, interlens.InterlensError), name


def test_the_run_options_are_one_record_named_once():
    """``rollout``/``run`` options: the TypedDict type checkers read names exactly the options accepted, and
    each option the scheduler runs with takes its default from the scheduler's ``RunConfig``."""
    import dataclasses

    from interlens.rollouts._options import OPTION_DEFAULTS, RunOptions
    from interlens.scheduler import RunConfig

    assert set(RunOptions.__optional_keys__) == set(OPTION_DEFAULTS)
    config = RunConfig()
    shared = {f.name for f in dataclasses.fields(RunConfig)} & set(OPTION_DEFAULTS)
    assert shared == {
        "devices",
        "out_dir",
        "resume",
        "mode",
        "max_batch_size",
        "max_concurrency",
        "max_attempts",
        "progress",
        "max_batch_wait",
        "worker_start_timeout",
        "cluster",
    }
    for name in shared - {"mode"}:  # mode: None (decided with batched=), the scheduler's default BATCHED
        assert OPTION_DEFAULTS[name] == getattr(config, name), name


def test_a_new_run_config_field_is_an_option_unless_interlens_sets_it():
    """The options are derived from ``RunConfig``'s fields: each field is an option of the same name, or
    one interlens fills in itself; the options beyond the fields are interlens' own six. A field added to
    ``RunConfig`` becomes an option, and the test above then asks ``RunOptions`` to name it too."""
    import dataclasses

    from interlens.rollouts._options import OPTION_DEFAULTS, SET_BY_INTERLENS
    from interlens.scheduler import RunConfig

    fields = [f.name for f in dataclasses.fields(RunConfig)]
    assert set(SET_BY_INTERLENS) <= set(fields)
    assert [name for name in OPTION_DEFAULTS if name in fields] == [
        name for name in fields if name not in SET_BY_INTERLENS
    ]
    assert set(OPTION_DEFAULTS) - set(fields) == {
        "seed",
        "batched",
        "api_budget",
        "record_tokens",
        "turn_timeout",
        "analyzer_timeout",
    }
