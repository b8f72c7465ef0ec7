"""What a run produced: RunReport/RunResult (lazy over the ledger), usage and cost, export tables and the HTML
report.
"""

from ._branching import PARENT_KEY, describe_parent, parent_of
from ._export import TOKEN_COLUMNS, ledger_rows, ledger_token_rows, token_columns, write_export
from ._html_report import write_report
from ._report import RunReport, RunResult
from ._usage import SAMPLES_KEY, check_prices, recorded_metadata, summarize, turn_cost

__all__ = [
    "PARENT_KEY",
    "SAMPLES_KEY",
    "TOKEN_COLUMNS",
    "RunReport",
    "RunResult",
    "check_prices",
    "describe_parent",
    "ledger_rows",
    "ledger_token_rows",
    "parent_of",
    "recorded_metadata",
    "summarize",
    "token_columns",
    "turn_cost",
    "write_export",
    "write_report",
]
