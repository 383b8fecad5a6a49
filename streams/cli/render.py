"""What the commands print, through rich: tables that fit the terminal (plain text, no colour
and no width limit when piped, so scripts and logs get every cell whole) and the replay's
progress bar (shown on a terminal only). Values are always text, never rich markup: a
cell holding ``[bold]`` prints as written."""

from __future__ import annotations

import io
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import IO, Any

from rich.console import Console, RenderableType
from rich.padding import Padding
from rich.progress import (
    BarColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

PIPED_WIDTH = 100_000  # piped output: lines are never cut or wrapped


Block = str | RenderableType


def utc(ns: Any, fmt: str = "%m-%d %H:%M:%S") -> str:
    """A time the API gives in ns since the epoch, in UTC; '-' for none."""
    if not isinstance(ns, int) or isinstance(ns, bool) or ns <= 0:
        return "-"
    return datetime.fromtimestamp(ns / 1e9, tz=UTC).strftime(fmt)


def covered(doc: Any, asked: str, where: Mapping[str, str] | None = None) -> str:
    """The window an answer really covers, and why when it is less than was asked; then
    the label filters it was asked with."""
    text = asked
    covers, kept = doc.get("covers"), doc.get("kept")
    if isinstance(covers, str) and covers != asked and isinstance(kept, str):
        text = f"{covers} (asked for {asked}; the counters keep {kept})"
    if where:
        text += " where " + ", ".join(f"{k}={v}" for k, v in where.items())
    return text


def console(stream: IO[str]) -> Console:
    terminal = stream.isatty()
    return Console(
        file=stream,
        width=None if terminal else PIPED_WIDTH,
        color_system="auto" if terminal else None,
        soft_wrap=not terminal,
        markup=False,
        emoji=False,
        highlight=False,
    )


def table(
    headers: Sequence[str], rows: Iterable[Sequence[str]], right: set[int], indent: int = 0
) -> RenderableType:
    """A header, a rule of dashes under each column, the rows; columns two spaces apart, no
    borders. Columns in `right` are right-aligned (numbers)."""
    rows = [list(row) for row in rows]
    t = Table(box=None, pad_edge=False, padding=(0, 2, 0, 0))
    for i, header in enumerate(headers):
        t.add_column(Text(header), justify="right" if i in right else "left", overflow="fold")
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    t.add_row(*(Text("-" * w, no_wrap=True, overflow="crop") for w in widths))
    for row in rows:
        t.add_row(*(Text(cell) for cell in row))
    return Padding(t, (0, 0, 0, indent), expand=False) if indent else t


def write(blocks: Iterable[Block], stream: IO[str]) -> None:
    if not stream.isatty():
        stream.write(to_text(blocks) + "\n")
        return
    out = console(stream)
    for block in blocks:
        out.print(Text(block) if isinstance(block, str) else block)


def to_text(blocks: Iterable[Block]) -> str:
    """The blocks as plain text (as piped)."""
    out = Console(
        width=PIPED_WIDTH,
        color_system=None,
        soft_wrap=True,
        markup=False,
        record=True,
        file=io.StringIO(),
    )
    for block in blocks:
        out.print(Text(block) if isinstance(block, str) else block)
    return "\n".join(line.rstrip() for line in out.export_text().splitlines())


class ReplayProgress:
    """Bytes of the input read, spans and events so far; on a terminal and for inputs over
    1 MB only."""

    def __init__(self, total_bytes: int, stream: IO[str]) -> None:
        self.enabled = stream.isatty() and total_bytes > 1_000_000
        self.bar: Progress | None = None
        if self.enabled:
            self.bar = Progress(
                BarColumn(),
                TaskProgressColumn(),
                TextColumn("{task.fields[spans]:,} spans  {task.fields[events]:,} events"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=console(stream),
                transient=False,
            )
            self.task = self.bar.add_task("replay", total=total_bytes, spans=0, events=0)
            self.bar.start()

    def update(self, done_bytes: int, spans: int, events: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=done_bytes, spans=spans, events=events)

    def done(self, spans: int, events: int) -> None:
        if self.bar is not None:
            self.bar.update(
                self.task, completed=self.bar.tasks[0].total, spans=spans, events=events
            )
            self.bar.stop()
