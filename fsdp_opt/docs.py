"""`python -m fsdp_opt.docs`: the reference pages written from the code, never by hand, and the check that the
commands the README and docs/ show still run.

- docs/flags.md, from the training command's parser: every flag, its default and its help, section by section.
  `--check` says which page is stale (exit 1) instead of writing it; a test runs the same comparison.
- `--run`: every ```bash and ```python block of README.md and docs/*.md runs on this machine (CPU), from the
  checkout, and must exit 0, unless the line before it says why not: `<!-- not run here: needs a GPU -->` (or the
  network, a Kaggle notebook, ...), or `<!-- run by tests/<file> ... -->` naming the test that runs it.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from fsdp_opt.config.parse import build_parser

FLAGS_PAGE = Path("docs") / "flags.md"


def _default(action: argparse.Action) -> str:
    if isinstance(action, argparse._VersionAction):
        return ""
    value = action.default
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    return f"`{value}`"


def flags_markdown(parser: argparse.ArgumentParser | None = None) -> str:
    """docs/flags.md: every flag of `fsdp_finetune.py` / `python -m fsdp_opt`, by section, from the parser."""
    parser = parser or build_parser()
    out = ["# Flags", "", "Every flag of the training command (`fsdp_finetune.py`, `python -m fsdp_opt`), by section, as "
           "`--help` gives them. Written by `python -m fsdp_opt.docs` from the parser; a test fails when this page "
           "is stale.", ""]  # fmt: skip
    groups = [g for g in parser._action_groups if any(a.option_strings for a in g._group_actions)]
    groups.sort(key=lambda g: g.title in ("options", "optional arguments"))  # --help and --version last
    for group in groups:
        rows = [a for a in group._group_actions if a.option_strings and a.dest != "help"]
        if not rows:
            continue
        title = group.title if group.title not in ("options", "optional arguments") else "other"
        out += [f"## {title}", "", "| flag | default | what it does |", "| --- | --- | --- |"]
        for a in rows:
            names = ", ".join(f"`{o}`" for o in a.option_strings)
            choices = f" One of: {', '.join(map(str, a.choices))}." if a.choices else ""
            text = " ".join((a.help or "").split()).replace("|", "\\|")
            out.append(f"| {names} | {_default(a)} | {text}{choices} |")
        out.append("")
    return "\n".join(out)


def stale(root: Path) -> list[str]:
    """The generated pages under `root` that differ from what the code writes now."""
    page = root / FLAGS_PAGE
    return [] if page.is_file() and page.read_text() == flags_markdown() else [str(FLAGS_PAGE)]


MARKER = re.compile(r"<!-- (not run here: .+|run by (tests/\S+).*) -->")
FENCE = re.compile(r"^```(bash|python)\n(.*?)^```", re.S | re.M)


@dataclass
class Block:
    page: str
    line: int
    kind: str  # bash | python
    code: str
    marker: str | None  # why it is not run here, or the test that runs it
    test: str | None  # the test file a `run by` marker names


def command_blocks(root: Path) -> list[Block]:
    """The runnable fenced blocks of README.md and docs/*.md, each with the marker on the line before it."""
    blocks = []
    for page in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        text = page.read_text()
        for m in FENCE.finditer(text):
            before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
            marker = MARKER.fullmatch(before)
            blocks.append(Block(str(page.relative_to(root)), text.count("\n", 0, m.start()) + 1, m.group(1),
                                m.group(2), marker.group(1) if marker else None,
                                marker.group(2) if marker else None))  # fmt: skip
    return blocks


def run_blocks(root: Path, blocks: list[Block], timeout: float = 600, env: dict[str, str] | None = None) -> list[str]:
    """Run each unmarked block from `root`; the failures, one line each (a `run by` marker must name a test file)."""
    failures = []
    for b in blocks:
        where = f"{b.page}:{b.line}"
        if b.test is not None:
            if not (root / b.test).is_file():
                failures.append(f"{where}: the test it names, {b.test}, does not exist")
            continue
        if b.marker is not None:
            continue
        cmd = ["bash", "-e", "-c", b.code] if b.kind == "bash" else [sys.executable, "-c", b.code]
        started = time.monotonic()
        try:
            proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            failures.append(f"{where}: did not finish in {timeout:.0f} s")
            continue
        took = time.monotonic() - started
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [""]
            failures.append(f"{where}: exit {proc.returncode} ({tail[0][:200]})")
        else:
            print(f"ran {where} in {took:.0f} s")
    return failures


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m fsdp_opt.docs", description=__doc__.split("\n\n")[0])
    p.add_argument("--root", default=".", help="the checkout whose docs/ to write (default: this folder)")
    p.add_argument("--check", action="store_true", help="say which page is stale (exit 1) instead of writing")
    p.add_argument("--run", action="store_true", help="run every command block of README.md and docs/ (exit 1 if one fails)")
    a = p.parse_args(argv)
    root = Path(a.root)
    if a.run:
        failures = run_blocks(root, command_blocks(root))
        for line in failures:
            print(f"failed: {line}")
        sys.exit(1 if failures else 0)
    if a.check:
        pages = stale(root)
        for page in pages:
            print(f"stale: {page} (run python -m fsdp_opt.docs)")
        sys.exit(1 if pages else 0)
    (root / FLAGS_PAGE).parent.mkdir(parents=True, exist_ok=True)
    (root / FLAGS_PAGE).write_text(flags_markdown())
    print(f"wrote {root / FLAGS_PAGE}")


if __name__ == "__main__":
    main()
