"""Reads back the per-interval line of the training entry point (``step_metrics.StepMetrics.report``):

    [mtraining] iteration       12 | lm_loss: 5.61 | tokens/s: 1424.3 | attended_fraction: 0.33 |

and the line of each evaluation (``validation_metrics.ValidationMetrics.end``):

    [mtraining] validation iteration       12 | lm_loss: 5.72 | attended_fraction: 0.34 |

for the quickstart's progress display and summary, and for the tests. Values stay text, as
printed (the loss at full precision), so a caller converts only what it uses.
"""

from __future__ import annotations

import re

LINE = re.compile(r"\[mtraining\] iteration +(\d+) \| (.*)")
VALIDATION_LINE = re.compile(r"\[mtraining\] validation iteration +(\d+) \| (.*)")


def parse_metrics_line(line: str, pattern: re.Pattern = LINE) -> tuple[int, dict[str, str]] | None:
    """(iteration, name -> value text) of one metrics line (``pattern``: an evaluation's,
    :data:`VALIDATION_LINE`); None for any other line."""
    match = pattern.search(line)
    if match is None:
        return None
    fields = (part.split(":", 1) for part in match.group(2).split("|") if ":" in part)
    return int(match.group(1)), {name.strip(): value.strip() for name, value in fields}


def parse_metrics(output: str) -> dict[int, dict[str, str]]:
    """Every metrics line of ``output``, by iteration."""
    return dict(parsed for line in output.splitlines() if (parsed := parse_metrics_line(line)))


def parse_validation(output: str) -> list[tuple[int, dict[str, str]]]:
    """Every evaluation line of ``output`` in order, as (iteration, name -> value text):
    an iteration can have several (at the end of training Megatron evaluates the
    validation and the test split after the last periodic evaluation)."""
    return [parsed for line in output.splitlines() if (parsed := parse_metrics_line(line, VALIDATION_LINE))]
