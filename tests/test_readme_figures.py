"""The README's headline figures are BENCHMARKS.md's current ones (issue 45, item 7): the
paragraph that quotes them names the date and the commands of the runs, and every ratio it
quotes stands in BENCHMARKS.md under that date, beside those commands. (The README had kept
2026-11-30's figures after BENCHMARKS.md moved on.)"""
from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
RATIO = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)x\b")
COMMAND = re.compile(r"`(python scripts/benchmarks/[^`]+)`")


def _read(name: str) -> str:
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
        return f.read()


def headline(readme: str) -> str:
    """The README paragraph that begins with the measured figures."""
    for paragraph in readme.split("\n\n"):
        if "Measured" in paragraph and RATIO.search(paragraph):
            return paragraph
    raise AssertionError("README.md has no paragraph of measured figures")


def unsupported(paragraph: str, benchmarks: str) -> list[str]:
    """What the paragraph quotes that BENCHMARKS.md's sections of the paragraph's date do not
    hold: its date, commands and ratios (empty: every figure is there)."""
    dates = DATE.findall(paragraph)
    if not dates:
        return ["no date"]
    sections = re.split(r"\n(?=#{2,3} )", benchmarks)
    dated = " ".join(" ".join(s.split()) for s in sections if any(d in s for d in dates))
    missing = [f"date {d}" for d in dates if d not in benchmarks]
    commands = [" ".join(c.split()) for c in COMMAND.findall(paragraph)]  # lines wrapped
    if not commands:
        missing.append("no command")
    missing += [f"command {c!r}" for c in commands if c not in dated]
    missing += [f"ratio {r}x" for r in RATIO.findall(paragraph)
                if not re.search(rf"(?<![\w.]){re.escape(r)}x\b", dated)]
    return missing


def test_the_readme_quotes_the_current_figures_with_their_date_and_command():
    paragraph = headline(_read("README.md"))
    assert unsupported(paragraph, _read("BENCHMARKS.md")) == []


def test_the_check_refuses_figures_without_a_date_a_command_or_a_source():
    benchmarks = ("## Run (2026-12-07)\n`python scripts/benchmarks/bench.py --rounds 3`: "
                  "ours / DataLoader **7.1x**\n")
    good = "Measured 2026-12-07 (`python scripts/benchmarks/bench.py --rounds 3`): 7.1x."
    assert unsupported(good, benchmarks) == []
    assert unsupported("Measured: 7.1x (`python scripts/benchmarks/bench.py --rounds 3`).",
                       benchmarks) == ["no date"]
    assert unsupported("Measured 2026-12-07: 7.1x.", benchmarks) == ["no command"]
    assert unsupported(good.replace("7.1x", "3.8x"), benchmarks) == ["ratio 3.8x"]
    old = benchmarks.replace("2026-12-07", "2026-11-30")
    assert "ratio 7.1x" in unsupported(good, old + "## Later (2026-12-07)\nnothing\n")
