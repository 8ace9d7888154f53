"""`python -m fsdp_opt.docs`: the reference pages written from the code, never by hand.

- docs/flags.md, from the training command's parser: every flag, its default and its help, section by section.

`--check` says which page is stale (exit 1) instead of writing it; a test runs the same comparison.
"""

from __future__ import annotations

import argparse
import sys
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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m fsdp_opt.docs", description=__doc__.split("\n\n")[0])
    p.add_argument("--root", default=".", help="the checkout whose docs/ to write (default: this folder)")
    p.add_argument("--check", action="store_true", help="say which page is stale (exit 1) instead of writing")
    a = p.parse_args(argv)
    root = Path(a.root)
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
