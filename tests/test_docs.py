"""The docs say only what exists: every link resolves, every imported name imports, every command's script and
flags exist. Cheap checks (no model runs; tests/test_examples.py runs the examples themselves)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
WRITTEN_ELSEWHERE = {ROOT / "docs" / "cli.md"}  # the CLI's page: a link to it may precede it

_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
_BLOCK = re.compile(r"```(\w*)\n(.*?)```", re.DOTALL)
_IMPORT = re.compile(r"^\s*from (interlens[\w.]*) import \(?([\w, ]+)\)?", re.MULTILINE)
_COMMAND = re.compile(r"python3? ((?:examples|benchmarks)/[\w/]+\.py)((?: +[^\s`#|]+)*)")


def _page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_links_resolve(page: Path) -> None:
    text = page.read_text()
    for target in _LINK.findall(text):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path = (page.parent / target).resolve()
        assert path.exists() or path in WRITTEN_ELSEWHERE, f"{_page_id(page)} links to missing {target}"


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_imported_names_exist(page: Path) -> None:
    blocks = [code for lang, code in _BLOCK.findall(page.read_text()) if lang in ("python", "")]
    for module, names in (m for code in blocks for m in _IMPORT.findall(code)):
        mod = importlib.import_module(module)
        for name in (n.strip() for n in names.split(",") if n.strip()):
            assert hasattr(mod, name), f"{_page_id(page)}: `from {module} import {name}` fails"


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_commands_name_real_scripts_and_flags(page: Path) -> None:
    for script, args in _COMMAND.findall(page.read_text()):
        source = (ROOT / script).read_text() if (ROOT / script).is_file() else None
        assert source is not None, f"{_page_id(page)} runs {script}, which does not exist"
        for flag in re.findall(r"(?<!\S)(--?[a-z][\w-]*)", args):
            assert f'"{flag}"' in source, f"{_page_id(page)}: {script} has no option {flag}"


def test_api_names_in_backticks_exist() -> None:
    """`interlens.x`, `RunReport.x`, `RunResult.x` and `ExecutionMode.X` named in the pages are real."""
    import interlens

    owners = {
        "interlens": interlens,
        "RunReport": interlens.RunReport,
        "RunResult": interlens.RunResult,
        "ExecutionMode": interlens.ExecutionMode,
    }
    pattern = re.compile(r"`(?:report\.|res\.)?(interlens|RunReport|RunResult|ExecutionMode)\.(\w+)")
    for page in PAGES:
        for owner, name in pattern.findall(page.read_text()):
            assert hasattr(owners[owner], name), f"{_page_id(page)} names {owner}.{name}: no such attribute"


#: A command line of another program (SLURM, pip, transformers serve): its flags are not ours to check.
_FOREIGN_COMMAND = re.compile(
    r"(?:^[ \t]*(?:ray|srun|sbatch|scontrol|#SBATCH|transformers serve)\b|[\w./]*\bpip install\b)[^\n`]*",
    re.MULTILINE,
)


def test_flags_in_backticks_belong_to_some_script() -> None:
    """`--streaming`, `--devices cpu cpu`...: prose names options too; each is a real one of a script."""
    scripts = [p for d in ("examples", "benchmarks") for p in (ROOT / d).glob("*.py")]
    sources = "".join(p.read_text() for p in scripts)
    for page in PAGES:
        text = _FOREIGN_COMMAND.sub("", page.read_text().replace("\\\n", " "))
        for flag in re.findall(r"`[^`]*?(--[a-z][\w-]*)[^`]*`", text):
            known = f'"{flag}"' in sources or flag in _cli_options()
            assert known, f"{_page_id(page)} names the option {flag}, which no script or command has"


def _cli_options() -> set[str]:
    """Every option of every `interlens` command, as the real command line declares it."""
    import typer

    from interlens.cli._commands import app

    group = typer.main.get_command(app)
    options = {"--help"}
    for command in getattr(group, "commands", {}).values():
        for param in command.params:
            options.update(getattr(param, "opts", ()), getattr(param, "secondary_opts", ()))
    return options


def test_readme_lists_every_example() -> None:
    readme = (ROOT / "README.md").read_text()
    examples = [*(ROOT / "examples").glob("*.py"), *(ROOT / "examples").glob("*.ipynb")]
    missing = [p.name for p in examples if f"`examples/{p.name}`" not in readme]
    assert missing == [], f"README's examples table lacks {missing}"
