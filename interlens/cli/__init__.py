"""The ``interlens`` command (typer): demo, status, show, export, report. Only this package imports typer and
rich.
"""

from ._commands import main

__all__ = [
    "main",
]
