"""`python -m fsdp_opt.docs`: the reference pages written from the code, never by hand, and the check that the
commands the README and docs/ show still run.

- docs/flags.md, from the training command's parser: every flag, its default and its help, section by section.
  `--check` says which page is stale (exit 1) instead of writing it; a test runs the same comparison.
- `--run`: every ```bash and ```python block of README.md and docs/*.md runs on this machine (CPU), from the
  checkout, and must exit 0, unless the line before it says why not: `<!-- not run here: needs a GPU -->` (or the
  network, a Kaggle notebook, ...), or `<!-- run by tests/<file> ... -->` naming the test that runs it.
- `--run` also checks every figure the pages quote from a deterministic command against what it prints now:
  - `<!-- run as NAME -->` before a block runs it as usual and keeps its output as NAME;
  - `<!-- command NAME: python -m ... -->` anywhere names a command whose figures the prose quotes without showing
    it (a table's row, say); it is run once;
  - a ```text block after `<!-- printed by NAME -->`: each of its lines is a line NAME prints (or a part of one),
    in order, spaces aside;
  - a figure in prose followed by `<!-- from NAME -->` (`16.54 GiB<!-- from kaggle-plan -->`): NAME prints that
    number. A drifted figure fails the check, as a failing block does.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from fsdp_opt.config.method import union_flags
from fsdp_opt.config.parse import build_parser

FLAGS_PAGE = Path("docs") / "flags.md"


def _default(action: argparse.Action) -> str:
    if isinstance(action, argparse._VersionAction):
        return ""
    value = action.default
    if value is argparse.SUPPRESS:  # a method's flag: the run's method's default (its help gives each method's)
        defaults = {repr(f.default) for _, f in union_flags()[action.dest]}
        if len(defaults) > 1:
            return "per method"
        value = next(f.default for _, f in union_flags()[action.dest])
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    return f"`{value}`"


def flags_markdown(parser: argparse.ArgumentParser | None = None) -> str:
    """docs/flags.md: every flag of `fsdp_finetune.py` / `python -m fsdp_opt`, by section, from the parser."""
    parser = parser or build_parser()
    out = [
        "# Flags",
        "",
        "Every flag of the training command (`fsdp_finetune.py`, `python -m fsdp_opt`), by section, as "
        "`--help` gives them. Written by `python -m fsdp_opt.docs` from the parser; a test fails when this page "
        "is stale.",
        "",
    ]
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


MARKER = re.compile(r"<!-- (not run here: .+|run by (tests/\S+).*|run as ([\w.-]+)) -->")
FENCE = re.compile(r"^```(bash|python)\n(.*?)^```", re.S | re.M)
COMMAND = re.compile(r"<!-- command ([\w.-]+): (.+?) -->")
# a ```text block, or a table (the plan prints markdown tables), right after the marker
PRINTED = re.compile(r"^<!-- printed by ([\w.-]+) -->\n(?:```text\n(.*?)^```|((?:\|[^\n]*\n)+))", re.S | re.M)
NUMBER = r"\d[\d,]*(?:\.\d+)?"
FIGURE = re.compile(rf"({NUMBER})[^\d<>]{{0,12}}?<!-- from ([\w.-]+) -->")


@dataclass
class Block:
    page: str
    line: int
    kind: str  # bash | python
    code: str
    marker: str | None  # why it is not run here, or the test that runs it
    test: str | None  # the test file a `run by` marker names
    name: str | None = None  # `run as NAME`: its output is kept for the figures quoted from it


@dataclass
class Quote:
    """What a page quotes of a named command's output: lines (a `printed by` block) or one number (`from`)."""

    page: str
    line: int
    name: str
    lines: list[str]  # each must be (a part of) one line of the output, in order
    number: str | None = None  # or: this number must be printed


def _pages(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def command_blocks(root: Path) -> list[Block]:
    """The runnable fenced blocks of README.md and docs/*.md, each with the marker on the line before it."""
    blocks = []
    for page in _pages(root):
        text = page.read_text()
        for m in FENCE.finditer(text):
            before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
            marker = MARKER.fullmatch(before)
            name = marker.group(3) if marker else None
            blocks.append(
                Block(
                    str(page.relative_to(root)),
                    text.count("\n", 0, m.start()) + 1,
                    m.group(1),
                    m.group(2),
                    None if name or not marker else marker.group(1),
                    marker.group(2) if marker else None,
                    name,
                )
            )
    return blocks


def named_commands(root: Path) -> dict[str, tuple[str, int, str]]:
    """`<!-- command NAME: ... -->` of every page: NAME -> (page, line, the command)."""
    found = {}
    for page in _pages(root):
        text = page.read_text()
        for m in COMMAND.finditer(text):
            found[m.group(1)] = (str(page.relative_to(root)), text.count("\n", 0, m.start()) + 1, m.group(2))
    return found


def quotes(root: Path) -> list[Quote]:
    """Every `printed by` block and `from` figure of the pages."""
    found = []
    for page in _pages(root):
        text, where = page.read_text(), str(page.relative_to(root))
        line = lambda m: text.count("\n", 0, m.start()) + 1  # noqa: E731
        here = [
            Quote(where, line(m), m.group(1), [x for x in (m.group(2) or m.group(3)).splitlines() if x.strip()])
            for m in PRINTED.finditer(text)
        ]
        here += [Quote(where, line(m), m.group(2), [], m.group(1)) for m in FIGURE.finditer(text)]
        found += sorted(here, key=lambda q: q.line)
    return found


def _flat(line: str) -> str:
    return " ".join(line.split())


def quote_failures(quote: Quote, output: str) -> str | None:
    """Why the output does not hold what the page quotes of it (None: it does)."""
    if quote.number is not None:
        printed = {n.replace(",", "") for n in re.findall(NUMBER, output)}
        if quote.number.replace(",", "") not in printed:
            return f"{quote.number} is not a number {quote.name} prints"
        return None
    out, at = [_flat(x) for x in output.splitlines()], 0
    for want in quote.lines:
        w = _flat(want)
        while at < len(out) and w not in out[at]:
            at += 1
        if at == len(out):
            return f"{quote.name} no longer prints {w[:120]!r} (or not in this order)"
        at += 1
    return None


def _run(
    where: str, kind: str, code: str, root: Path, timeout: float, env: dict[str, str] | None, failures: list[str]
) -> str | None:
    """A block's or a named command's output; None (and a failure line) when it did not exit 0."""
    cmd = ["bash", "-e", "-c", code] if kind == "bash" else [sys.executable, "-c", code]
    started = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        failures.append(f"{where}: did not finish in {timeout:.0f} s")
        return None
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [""]
        failures.append(f"{where}: exit {proc.returncode} ({tail[0][:200]})")
        return None
    print(f"ran {where} in {time.monotonic() - started:.0f} s")
    return proc.stdout


PLAN = "python -m fsdp_opt.plan "
# What `python -m fsdp_opt.plan ARGS` prints, for each ARGS of a JSON list on stdin, in one process: the plans
# themselves take a fraction of a second each, the imports several seconds per process.
PLAN_RUNNER = """
import contextlib, io, json, sys
from fsdp_opt.commands.plan import main
out = []
for args in json.load(sys.stdin):
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        try:
            code = main(args)
        except SystemExit as exc:  # --help: its exit is this command's alone
            code = exc.code if isinstance(exc.code, int) else 1
    out.append([code, text.getvalue()])
print(json.dumps(out))
"""


def _plan_args(command: str) -> list[str] | None:
    """The arguments of a plain `python -m fsdp_opt.plan ...` command (no shell syntax, no simulation), else None."""
    if not command.startswith(PLAN) or "--simulate" in command or re.search(r"[|;&<>$`'\"\\]", command):
        return None
    return command[len(PLAN) :].split()


def _run_plans(
    commands: dict[str, str], root: Path, timeout: float, env: dict[str, str] | None, failures: list[str]
) -> dict[str, str | None]:
    """Plain plan commands (blocks and named commands), run by the plan's own main in one process: their outputs
    (None where one failed), by the key each is given under."""
    if not commands:
        return {}
    started = time.monotonic()
    args = [_plan_args(c) for c in commands.values()]
    proc = subprocess.run(
        [sys.executable, "-c", PLAN_RUNNER],
        input=json.dumps(args),
        cwd=root,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    if proc.returncode != 0:
        failures.append(f"the plan commands: exit {proc.returncode} ({proc.stderr.strip()[-200:]})")
        return dict.fromkeys(commands)
    outputs: dict[str, str | None] = {}
    for (name, command), (code, text) in zip(commands.items(), json.loads(proc.stdout.strip().splitlines()[-1])):
        if code:
            failures.append(f"{name} ({command}): exit {code}")
        outputs[name] = None if code else text
    print(f"ran {len(commands)} plan commands in {time.monotonic() - started:.0f} s")
    return outputs


def run_blocks(root: Path, blocks: list[Block], timeout: float = 600, env: dict[str, str] | None = None) -> list[str]:
    """Run each unmarked block from `root`, and each named command; hold every quoted figure against the output
    it quotes. The failures, one line each (a `run by` marker must name a test file)."""
    failures: list[str] = []
    outputs: dict[str, str | None] = {}
    plans: dict[str, str] = {}  # plain plan commands, blocks and named ones: run together (_run_plans)
    block_plans: dict[str, str | None] = {}  # a plan block's place -> its name
    for b in blocks:
        where = f"{b.page}:{b.line}"
        if b.test is not None:
            if not (root / b.test).is_file():
                failures.append(f"{where}: the test it names, {b.test}, does not exist")
            continue
        if b.marker is not None:
            continue
        if b.kind == "bash" and "\n" not in b.code.strip() and _plan_args(b.code.strip()) is not None:
            plans[where], block_plans[where] = b.code.strip(), b.name
            continue
        out = _run(where, b.kind, b.code, root, timeout, env, failures)
        if b.name is not None:
            outputs[b.name] = out
    named = named_commands(root)
    for name, (page, line, _) in named.items():
        if name in outputs or name in block_plans.values():
            failures.append(f"{page}:{line}: the name {name} is given twice")
    plans |= {n: c for n, (_, _, c) in named.items() if n not in outputs and _plan_args(c) is not None}
    for key, out in _run_plans(plans, root, timeout, env, failures).items():
        name = block_plans.get(key, key)  # a block's own name (None: unnamed), or the command's
        if name is not None:
            outputs[name] = out
    for name, (page, line, command) in named.items():
        if name not in outputs:
            outputs[name] = _run(f"{page}:{line} ({name})", "bash", command, root, timeout, env, failures)
    for q in quotes(root):
        where = f"{q.page}:{q.line}"
        if q.name not in outputs:
            failures.append(f"{where}: quotes {q.name}, which no block or command of the pages is named")
        elif outputs[q.name] is not None:  # a command that failed is reported already
            why = quote_failures(q, outputs[q.name])
            if why:
                failures.append(f"{where}: {why}")
    return failures


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m fsdp_opt.docs", description=__doc__.split("\n\n")[0])
    p.add_argument("--root", default=".", help="the checkout whose docs/ to write (default: this folder)")
    p.add_argument("--check", action="store_true", help="say which page is stale (exit 1) instead of writing")
    p.add_argument(
        "--run", action="store_true", help="run every command block of README.md and docs/ (exit 1 if one fails)"
    )
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
