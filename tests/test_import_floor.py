"""What each floor stands on, counted in a fresh process: the bottom floor (``interlens._core``) and the
floors that only speak to the scheduler's contract (``engine``, ``providers``) load nothing of the scheduler
or the store but their contract and error modules, so the process and Ray workers, the run loop, the
batcher and the gateway's machinery load only when a run starts.

The checks are allowlists: a new scheduler module is outside the floor until it is named here, so a worker
module added later and reached by accident fails here, not in a profile. Each floor is imported under a bare
``interlens`` package (its real path, its ``__init__`` not run): the top package imports every floor, so
``import interlens._core`` through it would measure the house, not the floor. Also here: ``import interlens``
loads no run machinery, the ``Conversation.rollout`` facade's import does not import ``conversation`` back,
and a name of a lazy face is its module's own object.
"""

from __future__ import annotations

import importlib.util
import json
import pickle
import subprocess
import sys

import pytest

import interlens.scheduler
import interlens.scheduler.gateway
import interlens.store

# The bare top package: the subpackages and the scheduler/store resolve as installed; nothing else runs.
_BARE = (
    "import importlib.util, sys\n"
    "spec = importlib.util.find_spec('interlens')\n"
    "sys.modules['interlens'] = importlib.util.module_from_spec(spec)\n"
)
_LOWER = ("interlens.scheduler", "interlens.store")
# The scheduler's and the store's contract: their lazy faces (``_lazy``: the scheduler's helper for them),
# the errors, the job/engine protocols and the gateway's contract (what an adapter speaks in, the policies).
CONTRACT = {
    "interlens.scheduler",
    "interlens.scheduler._lazy",
    "interlens.scheduler._errors",
    "interlens.scheduler._protocols",
    "interlens.scheduler.gateway",
    "interlens.scheduler.gateway._contract",
    "interlens.scheduler.gateway._policies",
    "interlens.store",
    "interlens.store._errors",
}
ERRORS = {
    "interlens.scheduler",
    "interlens.scheduler._lazy",
    "interlens.scheduler._errors",
    "interlens.store",
    "interlens.store._errors",
}
HEAVY = ("torch", "transformers", "datasets", "openai", "anthropic", "ray")


def _loaded(statement: str, *, bare: bool = True) -> set[str]:
    """The modules in ``sys.modules`` after ``statement`` runs in a fresh interpreter."""
    prelude = _BARE if bare else "import sys\n"
    code = f"{prelude}{statement}\nimport json\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return set(json.loads(out.stdout.splitlines()[-1]))


def _lower(modules: set[str]) -> set[str]:
    return {m for m in modules if m.startswith(_LOWER)}


def test_the_bare_package_runs_no_floor():
    """The measuring stick: the bare top package itself loads no floor (else every check below is void)."""
    loaded = _loaded("pass")
    assert not {m for m in loaded if m.startswith("interlens.")}, sorted(loaded)


def test_core_stands_on_the_errors_only():
    loaded = _loaded("import interlens._core")
    assert _lower(loaded) <= ERRORS, (
        f"import interlens._core loads {sorted(_lower(loaded) - ERRORS)}: the bottom floor subclasses the "
        "scheduler's and the store's errors, and must load nothing else of them"
    )
    assert not [m for m in HEAVY if m in loaded]


@pytest.mark.parametrize("floor", ["interlens.engine", "interlens.providers", "interlens.interp"])
def test_floors_below_the_run_load_only_the_contract(floor):
    loaded = _loaded(f"import {floor}")
    assert _lower(loaded) <= CONTRACT, (
        f"import {floor} loads {sorted(_lower(loaded) - CONTRACT)} of the scheduler/store: import the "
        "contract (errors, protocols, the gateway's contract) and leave the machinery to the run"
    )
    assert not [m for m in HEAVY if m in loaded]


# What only a run needs: the run loop, the ledger writer, the process and Ray workers.
RUN_ONLY = [
    *(
        f"interlens.scheduler.{name}"
        for name in ("_run_jobs", "_pool", "_worker", "_batcher", "_engine_loads", "_ledger_recorder")
    ),
    *(
        f"interlens.scheduler.workers.{name}"
        for name in ("_subprocess", "_worker_process", "_wire", "_ray_worker")
    ),
    "interlens.store._ledger",
]


@pytest.mark.parametrize("module", sorted(CONTRACT) + RUN_ONLY)
def test_the_lists_name_modules_that_exist(module):
    """A module renamed or moved must be renamed here too, or the checks above and below would pass on a
    name that no longer exists."""
    assert importlib.util.find_spec(module) is not None, f"{module} is gone: update this file"


def test_import_interlens_loads_no_run_machinery():
    """The whole package: the run loop, the ledger writer and the process and Ray workers load with a run."""
    loaded = _loaded("import interlens", bare=False)
    assert not [m for m in RUN_ONLY if m in loaded]


def test_the_rollout_facade_does_not_import_conversation_back():
    """``Conversation.rollout`` imports ``rollouts._rollout``; that import (with ``rollouts/__init__``, which
    runs first) must not import ``interlens.conversation``, or the facade closes a cycle."""
    loaded = _loaded("import interlens.rollouts._rollout")
    assert "interlens.conversation" not in loaded, (
        "importing interlens.rollouts._rollout loads interlens.conversation (through rollouts/__init__?)"
    )


@pytest.mark.parametrize("package", [interlens.scheduler, interlens.scheduler.gateway, interlens.store])
def test_a_lazy_name_is_the_defining_modules_object(package):
    """A name resolved through the lazy face is the object its module defines (``isinstance``, ``except`` and
    pickling by reference see one class), listed by ``dir()``, and an unknown name says so."""
    for name in package.__all__:
        value = getattr(package, name)
        home = sys.modules.get(getattr(value, "__module__", None) or "")
        if home is not None and hasattr(home, name):
            assert getattr(home, name) is value, f"{package.__name__}.{name}"
        assert vars(package)[name] is value, f"{package.__name__}.{name} is not kept once resolved"
        assert name in dir(package)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        package.nope  # noqa: B018


def test_a_lazy_name_pickles_to_itself():
    mode = interlens.scheduler.ExecutionMode.DETERMINISTIC
    assert pickle.loads(pickle.dumps(mode)) is mode
    error = pickle.loads(pickle.dumps(interlens.scheduler.gateway.ProviderCallError("boom", 2, True, 503)))
    assert type(error) is interlens.scheduler.gateway.ProviderCallError and error.status == 503
