"""The house plan, read from the code: interlens' subpackages import one way, and only through each other's
``__init__``.

ARCHITECTURE.md draws the layers; this test reads every import of every module under ``interlens/``
(function-level imports count, ``if TYPE_CHECKING:`` blocks do not) and fails on an arrow that points up, on a
reach into another subpackage's private module, and on a subpackage ``__init__`` without ``__all__``. The one
documented exception is the ``Conversation.rollout`` facade.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "interlens"

# Lowest first: a subpackage may import those before it, never those after it.
LAYERS = [
    "_core",
    "testing",
    "interp",
    "engine",
    "providers",
    "participants",
    "conversation",
    "report",
    "rollouts",
    "cli",
]
# (importing module, imported module): the facade Conversation.rollout/arollout, lazily.
FACADES = {("interlens.conversation._conversation", "interlens.rollouts._rollout")}


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = ["interlens", *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _imports(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, absolute target) of each interlens import in ``path``: modules, or a package's names."""
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_lines(tree)
    module = _module_name(path, root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names if alias.name.startswith("interlens")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("interlens"):
                continue
            # `from . import _export` imports a module: name it, so the rules see the module
            modules = [f"{target}.{a.name}" for a in node.names if a.name.startswith("_")]
            out += [(node.lineno, m) for m in modules] or [(node.lineno, target)]
    return out


def _subpackage(module: str) -> str | None:
    """The interlens subpackage of a module name (None: the top package, its __main__, or a sibling
    installed inside interlens: scheduler and store, which are below all of these)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def _violations(root: Path = ROOT) -> list[str]:
    problems = []
    for path in sorted(root.rglob("*.py")):
        module = _module_name(path, root)
        here = _subpackage(module)
        for line, target in _imports(path, root):
            there = _subpackage(target)
            where = f"{path.relative_to(root.parent)}:{line} imports {target}"
            if target.split(".")[:2] in (["interlens", "scheduler"], ["interlens", "store"]):
                continue  # the lower packages, through their own rules (structure.py)
            if here is None:  # interlens/__init__.py, __main__.py
                if there is not None and target != f"interlens.{there}":
                    problems.append(f"{where}: the top package imports subpackages' contracts only")
                continue
            if there is None:
                problems.append(f"{where}: a subpackage never imports the top package")
            elif there != here and (module, target) not in FACADES:
                if LAYERS.index(there) > LAYERS.index(here):
                    problems.append(f"{where}: {here} sits below {there} (arrows point down only)")
                if target != f"interlens.{there}":
                    problems.append(f"{where}: import what interlens.{there} exports, not its private module")
    return problems


def test_subpackages_import_one_way_through_their_contracts():
    problems = _violations()
    assert not problems, "\n".join(problems)


def test_the_facade_is_the_only_import_up_and_it_is_lazy():
    tree = ast.parse((ROOT / "conversation" / "_conversation.py").read_text())
    top_level = {id(n) for n in tree.body}
    ups = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.level == 2 and node.module == "rollouts._rollout"
    ]
    assert ups, "the Conversation.rollout facade no longer imports rollouts._rollout: update FACADES"
    assert all(id(node) not in top_level for node in ups), "the facade's import must stay inside the method"
    below = {_subpackage(t) for _, t in _imports(ROOT / "rollouts" / "_rollout.py")}
    assert "conversation" not in below, (
        "rollouts._rollout imports conversation: the facade would close a cycle"
    )


@pytest.mark.parametrize("name", LAYERS)
def test_each_subpackage_states_its_contract(name):
    init = ROOT / name / "__init__.py"
    tree = ast.parse(init.read_text())
    assert ast.get_docstring(tree), f"interlens/{name}/__init__.py has no docstring saying what it holds"
    targets = [
        t
        for node in tree.body
        for t in (node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)])
    ]
    names = [t for t in targets if getattr(t, "id", None) == "__all__"]
    assert names, f"interlens/{name}/__init__.py has no __all__"
    for line, target in _imports(init):
        assert _subpackage(target) in (name, None), f"interlens/{name}/__init__.py:{line} re-exports {target}"


def test_the_rule_catches_an_arrow_up(tmp_path):
    """The checker itself: an upward import and a private reach are both reported."""
    fake = tmp_path / "interlens"
    for name in ("_core", "engine"):
        (fake / name).mkdir(parents=True)
        (fake / name / "__init__.py").write_text('"""x"""\n__all__ = []\n')
    (fake / "_core" / "_bad.py").write_text("def f():\n    from ..engine._generation import LocalEngine\n")
    problems = _violations(fake)
    assert any("_core sits below engine" in p for p in problems), problems
    assert any("not its private module" in p for p in problems), problems
