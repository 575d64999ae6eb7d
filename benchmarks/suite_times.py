"""Where the test suite spends its time: seconds per module and the slowest tests, from the JUnit XML
files pytest writes (`--junitxml`), as the markdown tables of docs/testing.md.

    .venv/bin/python -m pytest -q --junitxml=/tmp/suite.xml ...
    .venv/bin/python -m benchmarks.suite_times /tmp/suite.xml [/tmp/serial.xml] [--modules 30] [--slowest 40]

A test's seconds are its setup, call and teardown together, so a module's first test carries the
fixtures it builds for the others. Under pytest-xdist the seconds add up the workers' time, which
is more than the wall time when two ran at once.
"""
from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def test_seconds(reports: list[Path]) -> dict[str, float]:
    """node id -> seconds, over every report (a test in two reports: the later one's)."""
    seconds = {}
    for report in reports:
        for case in ET.parse(report).getroot().iter("testcase"):
            module = case.get("classname", "").split(".")
            path = "/".join(part for part in module if part[:1].islower() and not part.startswith("Test"))
            name = case.get("name", "").split("@")[0]  # pytest-xdist's loadgroup appends @group
            seconds[f"{path}.py::{name}"] = float(case.get("time") or 0)
    return seconds


def module_table(seconds: dict[str, float], count: int) -> list[str]:
    """The `count` modules that took longest, then one row for the others and one for all."""
    per_module: dict[str, list[float]] = defaultdict(list)
    for node, value in seconds.items():
        per_module[node.split("::")[0]].append(value)
    total = sum(seconds.values())
    ranked = sorted(per_module.items(), key=lambda item: -sum(item[1]))
    others = [value for _, values in ranked[count:] for value in values]
    rows = ["| module | tests | seconds | share |", "| --- | ---: | ---: | ---: |"]
    for module, values in ranked[:count]:
        rows.append(f"| {module} | {len(values)} | {sum(values):.0f} | {100 * sum(values) / total:.1f}% |")
    if others:
        rows.append(f"| the other {len(ranked) - count} modules | {len(others)} | {sum(others):.0f} |"
                    f" {100 * sum(others) / total:.1f}% |")
    rows.append(f"| all | {len(seconds)} | {total:.0f} | 100% |")
    return rows


def slowest_table(seconds: dict[str, float], count: int) -> list[str]:
    rows = ["| test | seconds |", "| --- | ---: |"]
    for node, value in sorted(seconds.items(), key=lambda item: -item[1])[:count]:
        rows.append(f"| {node} | {value:.1f} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", type=Path, help="pytest --junitxml files")
    parser.add_argument("--slowest", type=int, default=40, help="how many of the slowest tests to list")
    parser.add_argument("--modules", type=int, default=30, help="how many of the slowest modules to list")
    args = parser.parse_args()
    seconds = test_seconds(args.reports)
    print("\n".join([*module_table(seconds, args.modules), "", *slowest_table(seconds, args.slowest)]))


if __name__ == "__main__":
    main()
