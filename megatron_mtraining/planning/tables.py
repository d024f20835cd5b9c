"""The calibration tables shipped with the package (``planning/calibration/*.json``).

Every measured figure the planner uses is in one of them with the device, date, commit and
the ``docs/benchmarks.md`` section it came from; published and assumed figures say so and
name their source. :func:`table` reads one, once.
"""

from __future__ import annotations

import functools
import json
from importlib import resources

TABLES = ("hardware", "kernels", "training_steps", "context_parallel", "workloads")


@functools.cache
def table(name: str) -> dict:
    """The parsed ``calibration/<name>.json``."""
    if name not in TABLES:
        raise ValueError(f"calibration table {name!r} is not one of {', '.join(TABLES)}")
    return json.loads(resources.files(__package__).joinpath("calibration", f"{name}.json").read_text())


def source(table_name: str, key: str) -> dict:
    """A measurement's source record (device, date, commit, section, command)."""
    return table(table_name)["sources"][key]
