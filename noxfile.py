"""Developer sessions: ``nox -s tests``, ``nox -s lint``, ``nox -s typecheck``.

torch is constrained to the build in ``.ci/constraints.txt`` (a CPU wheel on these machines) so a session
never pulls a multi-GB CUDA build by accident.
"""

from __future__ import annotations

import nox

nox.options.sessions = ["lint", "typecheck", "tests"]
CONSTRAINTS = ("-c", ".ci/constraints.txt")


@nox.session
def tests(session: nox.Session) -> None:
    session.install(*CONSTRAINTS, "-e", ".[test]")
    session.run("python", "-m", "pytest", "-q", *session.posargs)


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
