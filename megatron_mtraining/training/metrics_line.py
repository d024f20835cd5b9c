"""Reads back the per-interval line of the training entry point (``step_metrics.StepMetrics.report``):

    [mtraining] iteration       12 | lm_loss: 5.61 | tokens/s: 1424.3 | attended_fraction: 0.33 |

for the quickstart's progress display and summary, and for the tests. Values stay text, as
printed (the loss at full precision), so a caller converts only what it uses.
"""

from __future__ import annotations

import re

LINE = re.compile(r"\[mtraining\] iteration +(\d+) \| (.*)")


def parse_metrics_line(line: str) -> tuple[int, dict[str, str]] | None:
    """(iteration, name -> value text) of one metrics line; None for any other line."""
    match = LINE.search(line)
    if match is None:
        return None
    fields = (part.split(":", 1) for part in match.group(2).split("|") if ":" in part)
    return int(match.group(1)), {name.strip(): value.strip() for name, value in fields}


def parse_metrics(output: str) -> dict[int, dict[str, str]]:
    """Every metrics line of ``output``, by iteration."""
    return dict(parsed for line in output.splitlines() if (parsed := parse_metrics_line(line)))
