"""The built-in reward functions against TRL 1.16's (accuracy, format) and their documented rules (length, choice);
reward functions named by file and module, their pins; math-verify missing is one line naming its install."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest
from conftest import ROOT

from fsdp_opt.base import ConfigError
from fsdp_opt.config.choices import BUILTIN_REWARDS
from fsdp_opt.config.parse import build_parser
from fsdp_opt.engine.rewards import BUILTINS, load, load_all, score

MATH = [  # (completion, solution)
    (r"The sum is \boxed{5}.", "5"),
    (r"So $x = \frac{1}{2}$", r"$\frac{1}{2}$"),
    (r"\boxed{0.5}", r"$\frac{1}{2}$"),
    (r"I think it is \boxed{6}", "$5$"),
    ("five", "$5$"),
    (r"\boxed{\sqrt{2}}", r"$\sqrt{2}$"),
    (r"$x^2 + 1$", r"$1 + x^2$"),
    (r"\boxed{3}", "no solution here"),  # the solution cannot be parsed: None
    (r"The answer: $\{1, 2\}$", r"$\{2, 1\}$"),
]


def test_accuracy_and_format_are_trls_on_the_same_completions():
    from trl.rewards import accuracy_reward, think_format_reward

    accuracy, fmt = load("accuracy"), load("format")
    messages = [[{"role": "assistant", "content": c}] for c, _ in MATH]
    solutions = [s for _, s in MATH]
    ours = accuracy.fn(completions=messages, solution=solutions)
    assert ours == accuracy_reward(messages, solutions)
    assert ours.count(1.0) >= 4 and ours.count(0.0) >= 2 and None in ours  # the cases are not all one verdict
    strings = accuracy.fn(completions=[c for c, _ in MATH], solution=solutions)  # string prompts: string completions
    assert strings == ours
    thinking = [
        "<think>add them</think>5",
        "<think>a</think><think>b</think>5",
        "5 <think>late</think>",
        "<think>\nmulti\nline\n</think>\nThe answer is 5",
        "no reasoning",
        "<think>never closed",
    ]
    as_messages = [[{"role": "assistant", "content": t}] for t in thinking]
    assert fmt.fn(completions=as_messages) == think_format_reward(as_messages)
    assert fmt.fn(completions=as_messages).count(1.0) == 2


def test_length_and_choice_follow_their_rules():
    completions = ["list", "a list", "list", "dict", " tuple ", ""]
    ended = [True, True, False, True, True, True]
    max_words = [1, 1, 1, 3, 1, 1]
    choices = [["list", "dict"]] * 6
    rows = list(range(6))
    got = score(
        [load("length"), load("choice")],
        ["q"] * 6,
        completions,
        [[1]] * 6,
        {"max_words": max_words, "choices": choices},
        rows,
        ended,
    )
    # length: ended and at most max_words words; choice: ended and (stripped) one of the row's choices
    assert [r[0] for r in got] == [1.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    assert [r[1] for r in got] == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    default = score([load("length")], ["q"], [" ".join(["w"] * 50)], [[1]], {}, [0], [True])
    assert default == [[1.0]] and score([load("length")], ["q"], [" ".join(["w"] * 51)], [[1]], {}, [0], [True]) == [
        [0.0]
    ]


def test_functions_by_file_and_module_are_pinned_by_their_whole_source(tmp_path, monkeypatch):
    rules = tmp_path / "rules.py"
    rules.write_text(
        "def bonus():\n    return 1.0\n\n\ndef mine(completions, **kw):\n    return [bonus()] * len(completions)\n"
    )
    first = load(f"{rules}:mine")
    assert first.fn(completions=["a", "b"]) == [1.0, 1.0]
    rules.write_text(
        "def bonus():\n    return 2.0\n\n\ndef mine(completions, **kw):\n    return [bonus()] * len(completions)\n"
    )
    second = load(f"{rules}:mine")
    assert second.fn(completions=["a"]) == [2.0] and second.source != first.source  # the helper changed the rule
    monkeypatch.syspath_prepend(str(tmp_path))
    by_module = load("rules:mine")
    assert by_module.source == second.source and by_module.pin() == {"name": "rules:mine", "source": second.source}
    with pytest.raises(ConfigError, match="--reward rules:nope: rules has no function nope"):
        load("rules:nope")
    with pytest.raises(ConfigError, match="--reward_weights 1,x: numbers"):
        load_all(["length", "format"], "1,x")


def test_accuracy_without_math_verify_is_refused_when_named():
    code = (
        "import sys; sys.modules['math_verify'] = None\n"
        "from fsdp_opt.engine.rewards import load\n"
        "from fsdp_opt.base import ConfigError\n"
        "try:\n    load('accuracy')\n"
        "except ConfigError as e:\n    print(e)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == '--reward accuracy: math-verify is not installed (pip install "math-verify>=0.8")'


def test_a_rule_is_pinned_by_its_syntax_not_its_layout(tmp_path):
    """A reward file reformatted (comments, blank lines, a call spread over lines with a trailing comma: what a
    formatter does) pins the same rule; a changed constant does not; a checkpoint's pin from before the syntax
    fingerprint (the source text's sha256) still names the rule it pinned. Built-ins pin the same way."""
    rules = tmp_path / "layout.py"
    rules.write_text("def mine(completions, **kw):\n    return [min(1.0, len(c) / 10) for c in completions]\n")
    first = load(f"{rules}:mine")
    legacy = hashlib.sha256(rules.read_text().encode()).hexdigest()[:16]
    rules.write_text(
        "# a note\n\n\ndef mine(completions, **kw):  # the length, in tens\n    return [\n"
        "        min(\n            1.0,\n            len(c) / 10,\n        )\n        for c in completions\n    ]\n"
    )
    second = load(f"{rules}:mine")
    assert second.source == first.source and second.source.startswith("ast:")
    assert second.same_rule(first.source) and not first.same_rule("ast:0000000000000000")
    rules.write_text("def mine(completions, **kw):\n    return [min(1.0, len(c) / 20) for c in completions]\n")
    third = load(f"{rules}:mine")
    assert third.source != first.source and not third.same_rule(first.source)
    rules.write_text("def mine(completions, **kw):\n    return [min(1.0, len(c) / 10) for c in completions]\n")
    assert load(f"{rules}:mine").same_rule(legacy)  # the pin a checkpoint of an earlier version holds
    assert load("length").source.startswith("ast:")


def test_the_built_ins_are_listed_alike_in_the_help_flags_md_and_grpo_md():
    """The --reward help (and so docs/flags.md, written from it) and grpo.md's table name every built-in."""
    assert tuple(BUILTINS) == BUILTIN_REWARDS
    (reward,) = [a for a in build_parser()._actions if a.dest == "reward"]
    assert f"a built-in ({', '.join(BUILTIN_REWARDS)})" in reward.help
    assert f"a built-in ({', '.join(BUILTIN_REWARDS)})" in (ROOT / "docs" / "flags.md").read_text()
    table = [line for line in (ROOT / "docs" / "grpo.md").read_text().splitlines() if line.startswith("| `")]
    assert [line.split("`")[1] for line in table if line.split("`")[1] in BUILTINS] == list(BUILTIN_REWARDS)
