"""The reference pages written from the code: docs/flags.md is the parser's, and the check catches a drift."""

from __future__ import annotations

import shutil
import subprocess
import sys

from conftest import ROOT, sandbox_env

from fsdp_opt.commands.docs import FLAGS_PAGE, command_blocks, flags_markdown, run_blocks, stale
from fsdp_opt.config.parse import build_parser


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
    proc = subprocess.run(
        [sys.executable, "-m", "fsdp_opt.docs", "--check", "--root", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1 and "stale: docs/flags.md" in proc.stdout
    assert stale(tmp_path) == [str(FLAGS_PAGE)]


def test_every_command_block_of_the_readme_and_docs_runs_or_says_why_not(tmp_path):
    """The docs check: each ```bash / ```python block runs here from the checkout and exits 0, or the line before it
    says why it cannot (a GPU, the network, a Kaggle cell) or names the test that runs it."""
    blocks = command_blocks(ROOT)
    run = [b for b in blocks if b.marker is None]
    pages = {"docs/planner.md", "docs/launching.md", "docs/lora.md", "docs/kaggle.md", "docs/distill.md", "docs/kto.md"}
    assert {b.page for b in run} >= pages
    assert all(
        b.marker.startswith(("not run here: needs", "not run here: a Kaggle", "run by tests/"))
        for b in blocks
        if b.marker
    )
    env = sandbox_env(tmp_path, WANDB_MODE="disabled")
    assert run_blocks(ROOT, blocks, timeout=600, env=env) == []
    shutil.rmtree(ROOT / "outputs" / "cpu", ignore_errors=True)  # what the CPU launch example wrote
    shutil.rmtree(ROOT / "outputs" / "distill-example", ignore_errors=True)  # docs/distill.md's CPU example
    shutil.rmtree(ROOT / "outputs" / "kto-example", ignore_errors=True)  # docs/kto.md's


def test_the_docs_check_fails_on_a_block_that_fails_or_names_no_test(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("# x\n\n```bash\ntrue\n```\n\n```bash\nfalse\n```\n")
    (tmp_path / "docs" / "page.md").write_text(
        "<!-- run by tests/nowhere.py -->\n```python\nprint(1)\n```\n\n"
        "<!-- not run here: needs a GPU -->\n```bash\nnvidia-smi\n```\n"
    )
    # Plan blocks run together in one process: the one that is refused is named; --help (which exits) and the one
    # after it still run.
    (tmp_path / "docs" / "plans.md").write_text(
        "```bash\npython -m fsdp_opt.plan --no_such_flag 1\n```\n\n"
        "```bash\npython -m fsdp_opt.plan --help\n```\n\n"
        "```bash\npython -m fsdp_opt.plan --batch_size 2\n```\n"
    )
    failures = run_blocks(tmp_path, command_blocks(tmp_path), env=sandbox_env(tmp_path))
    assert failures == [
        "README.md:7: exit 1 ()",
        "docs/page.md:2: the test it names, tests/nowhere.py, does not exist",
        "docs/plans.md:1 (python -m fsdp_opt.plan --no_such_flag 1): exit 2",
    ]


def test_the_version_is_one_number_everywhere():
    from importlib.metadata import version

    from fsdp_opt.base import VERSION
    from fsdp_opt.hub.card import render_card, run_info

    proc = subprocess.run([sys.executable, "-m", "fsdp_opt", "--version"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == f"fsdp-opt {VERSION}"
    assert version("fsdp-opt") == VERSION  # pyproject.toml reads it
    run = run_info({"model": "tiny-opt", "dataset": "python-docs"}, world_size=2, global_batch=8, n_params=1)
    assert f"with fsdp-opt {VERSION}, one session per row range" in render_card(
        "me/run", {"run": run, "checkpoints": {}}
    )
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert f"## {VERSION} (" in changelog


def test_the_test_requirements_are_the_test_extra():
    """requirements-test.txt (for pip -r) and pyproject's `test` extra (what scripts/test.sh installs) name the same
    requirements: a package added to one alone is missing on CI or for a user installing by hand."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    listed = set()
    for line in (ROOT / "requirements-test.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line and not line.startswith("-r"):
            listed.add(line)
    assert listed == set(extras["test"])
    assert set(extras["grpo"]) <= listed and set(extras["qlora"]) <= listed | {"torchao>=0.16"}


def test_a_figure_the_pages_quote_is_held_against_the_command_that_prints_it(tmp_path):
    """`run as` / `command` name an output; `printed by` blocks and tables, and `from` figures, must be in it. A drifted
    figure, a line no longer printed, and a quote of a name nothing defines each fail the check, one line each."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(
        "# x\n\n<!-- run as plan -->\n```bash\nprintf 'peak 16.54 GiB\\n| a | 1.00 |\\n| b | 2.00 |\\nstep 25.84 s\\n'\n```\n\n"
        "<!-- printed by plan -->\n```text\npeak 16.54 GiB\nstep 25.84 s\n```\n\n"
        "<!-- printed by plan -->\n| a | 1.00 |\n| b | 2.00 |\n\n"
        "It needs 16.54 GiB<!-- from plan --> per GPU, a step of 25.84 s<!-- from plan -->.\n"
    )
    (tmp_path / "docs" / "page.md").write_text(
        "<!-- command other: echo 'host RAM 18,330 MB' -->\n"
        "Host RAM 18,330 MB<!-- from other -->; a step of 25.8 s<!-- from plan -->, 9.9 GiB<!-- from nothing -->.\n\n"
        "<!-- printed by plan -->\n| b | 2.00 |\n| a | 1.00 |\n"
    )
    failures = run_blocks(tmp_path, command_blocks(tmp_path))
    assert failures == [
        "docs/page.md:2: 25.8 is not a number plan prints",
        "docs/page.md:2: quotes nothing, which no block or command of the pages is named",
        "docs/page.md:4: plan no longer prints '| a | 1.00 |' (or not in this order)",
    ], failures
