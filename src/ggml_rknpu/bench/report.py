"""Benchmark reports: raw JSON, Markdown tables and PNG plots in one directory, plus rich tables.

WHY one module: the seed log's figures were hard to trust after the fact because the
conditions (DRAM clock, burst vs sustained, modeled vs measured) were not recorded with
them (seed log, retraction). Here every report carries the rig check it ran under, and
every figure names its basis in its key: a key ending in ``_modeled`` (the cost model,
never a board) or ``_measured`` (a clock on a real machine). Table headers and plot
series are labelled from those keys, and a figure without a basis is refused, so modeled
and measured numbers cannot be mixed without labels.

Plots are drawn with matplotlib's object API on the Agg canvas (no pyplot, no display).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table as RichTable

BASES = ("modeled", "measured")


def basis_of(key: str) -> str | None:
    """'modeled' / 'measured' from a figure key's suffix, None for a non-figure (shape, dtype...)."""
    for basis in BASES:
        if key.endswith(f"_{basis}"):
            return basis
    return None


@dataclass(frozen=True)
class Column:
    key: str
    title: str
    fmt: str = "{}"
    figure: bool = False   # a number measured or modeled: its key must name the basis

    def __post_init__(self) -> None:
        if self.figure and basis_of(self.key) is None:
            raise ValueError(f"figure column {self.key!r} must end in _modeled or _measured")

    @property
    def header(self) -> str:
        basis = basis_of(self.key)
        return f"{self.title} ({basis})" if self.figure and basis else self.title

    def cell(self, row: dict) -> str:
        value = row.get(self.key)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "-"
        try:
            return self.fmt.format(value)
        except (ValueError, TypeError):
            return str(value)


@dataclass
class Table:
    title: str
    columns: list[Column]
    rows: list[dict]
    note: str = ""

    def markdown(self) -> str:
        lines = [f"### {self.title}", ""]
        if self.note:
            lines += [self.note, ""]
        lines.append("| " + " | ".join(c.header.replace("|", "\\|") for c in self.columns) + " |")
        lines.append("|" + "|".join("---:" if c.figure else "---" for c in self.columns) + "|")
        for row in self.rows:
            lines.append("| " + " | ".join(c.cell(row).replace("|", "\\|") for c in self.columns) + " |")
        return "\n".join(lines) + "\n"

    def rich(self) -> RichTable:
        table = RichTable(title=self.title, caption=self.note or None)
        for c in self.columns:
            table.add_column(c.header, justify="right" if c.figure else "left", overflow="fold")
        for row in self.rows:
            table.add_row(*(c.cell(row) for c in self.columns))
        return table


@dataclass
class Series:
    label: str
    x: list
    y: list[float | None]     # None: no value there (a gap in the line)

    def __post_init__(self) -> None:
        if not any(b in self.label for b in BASES):
            raise ValueError(f"plot series {self.label!r} must say 'modeled' or 'measured'")


@dataclass
class Plot:
    """A plot as data (kept in the JSON so tests and readers can check what was drawn)."""

    file: str
    title: str
    xlabel: str
    ylabel: str
    series: list[Series]
    kind: str = "line"            # "line" | "bar"
    log_x: bool = False
    log_y: bool = False

    def figure(self) -> Figure:
        fig = Figure(figsize=(7.5, 4.5), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        if self.kind == "bar":
            categories = list(dict.fromkeys(x for s in self.series for x in s.x))
            width = 0.8 / max(1, len(self.series))
            for i, s in enumerate(self.series):
                xs = [categories.index(x) + (i - (len(self.series) - 1) / 2) * width for x in s.x]
                # matplotlib draws a None as a gap; its stubs' ArrayLike leaves None out
                ax.bar(xs, s.y, width=width, label=s.label)  # type: ignore[arg-type]
            ax.set_xticks(range(len(categories)), [str(c) for c in categories], rotation=25, ha="right", fontsize=7)
        else:
            for s in self.series:
                ax.plot(s.x, s.y, marker="o", label=s.label)  # type: ignore[arg-type]  # a None: a gap (as above)
            if self.log_x:
                ax.set_xscale("log", base=2)
        if self.log_y:
            ax.set_yscale("log")
        ax.set_title(self.title, fontsize=10)
        ax.set_xlabel(self.xlabel)
        ax.set_ylabel(self.ylabel)
        ax.grid(True, alpha=0.3)
        if self.series:
            ax.legend(fontsize=8)
        fig.tight_layout()
        return fig


@dataclass
class Report:
    """Everything one bench run produced; ``write`` puts it on disk as JSON + Markdown + PNGs."""

    name: str                       # "matmul", "sustained", "model", "selftest" (file stem)
    title: str
    rig: dict                       # RigReport.to_dict() of the check that ran first
    meta: dict = field(default_factory=dict)
    tables: list[Table] = field(default_factory=list)
    plots: list[Plot] = field(default_factory=list)
    raw: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"name": self.name, "title": self.title, "created_utc": self.meta.get("created_utc"),
                "rig": self.rig, "meta": self.meta, "notes": self.notes,
                "tables": [{"title": t.title, "note": t.note,
                            "columns": [{"key": c.key, "header": c.header} for c in t.columns],
                            "rows": t.rows} for t in self.tables],
                "plots": [asdict(p) for p in self.plots], "raw": self.raw}

    def markdown(self) -> str:
        rig = self.rig
        lines = [f"# {self.title}", "",
                 f"- rig: **{rig.get('verdict')}** ({rig.get('board')}) - {rig.get('summary')}"]
        lines += [f"- {k}: {v}" for k, v in self.meta.items()]
        lines += [f"- note: {n}" for n in self.notes]
        bad = [c for c in rig.get("checks", []) if c["status"] in ("WARN", "FAIL")]
        if bad:
            lines += ["", "Rig findings:", ""]
            lines += [f"- {c['status']} {c['name']}: {c['reason']}" + (f" -> `{c['fix']}`" if c["fix"] else "")
                      for c in bad]
        lines.append("")
        lines += [t.markdown() for t in self.tables]
        lines += [f"![{p.title}]({p.file})\n" for p in self.plots]
        return "\n".join(lines)

    def write(self, out_dir: str | Path) -> dict[str, Path]:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.meta.setdefault("created_utc", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        paths = {"json": out / f"{self.name}.json", "markdown": out / f"{self.name}.md"}
        paths["json"].write_text(json.dumps(self.to_dict(), indent=2, default=_jsonable))
        paths["markdown"].write_text(self.markdown())
        for plot in self.plots:
            fig = plot.figure()
            paths[plot.file] = out / plot.file
            fig.savefig(paths[plot.file])
        return paths

    def print(self, console: Console | None = None) -> None:
        console = console or Console()
        for table in self.tables:
            console.print(table.rich())
        for note in self.notes:
            console.print(f"[dim]{note}[/]")


def _jsonable(value):
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


@contextmanager
def progress(console: Console | None, description: str, total: int) -> Iterator:
    """A rich progress bar for long runs; yields ``advance()``. Transient so reports stay clean."""
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console or Console(stderr=True), transient=True) as bar:
        line = bar.add_task(description, total=total)   # rich calls a bar's line a task
        yield lambda n=1: bar.advance(line, n)


def series_by(rows: Iterable[dict], group: str, x: str, y: str, label: str) -> list[Series]:
    """Rows grouped by ``group`` into one series each: x -> y, labelled ``label.format(group, basis)``."""
    grouped: dict = {}
    for row in rows:
        if row.get(y) is not None:
            grouped.setdefault(row[group], []).append((row[x], row[y]))
    basis = basis_of(y) or ""
    return [Series(label.format(g, basis), [p[0] for p in sorted(pts)], [p[1] for p in sorted(pts)])
            for g, pts in grouped.items()]
