"""The reference pages written from the code: docs/flags.md is the parser's, and the check catches a drift."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT

from fsdp_opt.config.parse import build_parser
from fsdp_opt.docs import FLAGS_PAGE, flags_markdown, stale


def test_the_flags_page_is_the_parsers():
    assert stale(ROOT) == [], "docs/flags.md is stale: run python -m fsdp_opt.docs"
    page = (ROOT / FLAGS_PAGE).read_text()
    for action in build_parser()._actions:
        if action.option_strings and action.dest != "help":
            assert all(f"`{o}`" in page for o in action.option_strings), action.dest


def test_a_flag_the_page_lacks_fails_the_check(tmp_path):
    # the page as it would be with one flag more in the parser: the committed page no longer matches
    parser = build_parser()
    parser.add_argument("--a_new_flag", default=3, help="a flag added without its page")
    assert "| `--a_new_flag` | `3` | a flag added without its page |" in flags_markdown(parser)
    assert flags_markdown(parser) != (ROOT / FLAGS_PAGE).read_text()
    # a page one row short: the command's check says so and exits 1
    page = (ROOT / FLAGS_PAGE).read_text().splitlines()
    (tmp_path / "docs").mkdir()
    (tmp_path / FLAGS_PAGE).write_text("\n".join(l for l in page if not l.startswith("| `--lr` ")))
    proc = subprocess.run([sys.executable, "-m", "fsdp_opt.docs", "--check", "--root", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 1 and "stale: docs/flags.md" in proc.stdout
    assert stale(tmp_path) == [str(FLAGS_PAGE)]
