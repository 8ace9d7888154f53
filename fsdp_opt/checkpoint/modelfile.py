"""The Ollama `Modelfile` beside a GGUF: FROM the file, the chat template in Ollama's Go template language, and the
stop tokens that end an answer.

A Jinja chat template cannot be translated in general, so it is measured instead: rendered by the tokenizer's own
`apply_chat_template` around marker texts, its pieces (the start, a user turn's end up to the assistant's text, an
assistant turn's end up to the next user's text, a system turn) are cut out and laid into a Go template that rebuilds
the same prompt for any conversation of those turns. A template that does not render that way (no system role, a
template that refuses to alternate) falls back to the roles it does render; no template at all: Ollama's raw prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedTokenizerBase

MARK = {"system": "\u2060SYSTEM\u2060", "user": "\u2060USER{}\u2060", "assistant": "\u2060ASSISTANT{}\u2060"}


@dataclass(frozen=True)
class Turns:
    """The fixed text of a chat template around the messages' contents."""

    start: str  # before the first user message
    user_to_assistant: str  # after a user's text, before the assistant's (also the generation prompt)
    assistant_to_user: str  # after an assistant's text, before the next user's
    system_start: str | None  # before a system message's text (None: the template has no system role)
    system_to_user: str | None  # after it, before the first user's text

    def render(self, messages: list[dict[str, str]]) -> str:
        """The prompt these pieces give, with the generation prompt after a last user turn (what Ollama's template
        below renders, written in Python to check it against the tokenizer)."""
        out, previous = "", None
        for m in messages:
            if m["role"] == "system":
                out += (self.system_start or "") + m["content"]
            elif m["role"] == "user":
                out += {None: self.start, "system": self.system_to_user, "assistant": self.assistant_to_user}.get(
                    previous, ""
                ) + m["content"]
            else:
                out += self.user_to_assistant + m["content"]
            previous = m["role"]
        return out + (self.user_to_assistant if previous == "user" else "")

    def go_template(self) -> str:
        # NOTE: no `{{-` trim markers: they would eat the template's own newlines around the pieces
        def q(text: str | None) -> str:
            return (text or "").replace("{{", '{{ "{{" }}')

        return (
            '{{ $last := "" }}{{ range .Messages }}'
            '{{ if eq .Role "system" }}' + q(self.system_start) + "{{ .Content }}"
            '{{ else if eq .Role "user" }}{{ if eq $last "" }}'
            + q(self.start)
            + '{{ else if eq $last "system" }}'
            + q(self.system_to_user)
            + '{{ else if eq $last "assistant" }}'
            + q(self.assistant_to_user)
            + "{{ end }}{{ .Content }}"
            '{{ else if eq .Role "assistant" }}' + q(self.user_to_assistant) + "{{ .Content }}"
            "{{ end }}{{ $last = .Role }}{{ end }}"
            '{{ if eq $last "user" }}' + q(self.user_to_assistant) + "{{ end }}"
        )


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)


def measure(tokenizer: PreTrainedTokenizerBase, add_bos: bool) -> Turns | None:
    """The template's pieces; None without a template, or one that does not render user/assistant turns."""
    if not isinstance(getattr(tokenizer, "chat_template", None), str):
        return None
    u1, a1, u2 = MARK["user"].format(1), MARK["assistant"].format(1), MARK["user"].format(2)
    try:
        text = _render(
            tokenizer,
            [{"role": "user", "content": u1}, {"role": "assistant", "content": a1}, {"role": "user", "content": u2}],
            True,
        )
        start, rest = text.split(u1)
        user_to_assistant, rest = rest.split(a1)
        assistant_to_user, prompt = rest.split(u2)
    except Exception:  # noqa: BLE001 - a template that does not render these turns: no Go template
        return None
    system_start = system_to_user = None
    try:
        with_system = _render(
            tokenizer, [{"role": "system", "content": MARK["system"]}, {"role": "user", "content": u1}], False
        )
        system_start, after = with_system.split(MARK["system"])
        system_to_user = after.split(u1)[0]
    except Exception:  # noqa: BLE001 - no system role in this template
        pass
    bos = tokenizer.bos_token or ""
    if add_bos and bos:
        # llama.cpp adds the BOS itself when it tokenizes the prompt: the template must not write a second one
        start = start.removeprefix(bos)
        system_start = system_start.removeprefix(bos) if system_start is not None else None
    return Turns(start, prompt, assistant_to_user, system_start, system_to_user)


def stop_tokens(tokenizer: PreTrainedTokenizerBase, turns: Turns | None) -> list[str]:
    """The special tokens that close an assistant's turn (those opening the text after it), and the EOS."""
    stops = []
    if turns is not None:
        specials = sorted(tokenizer.get_added_vocab(), key=len, reverse=True)
        text = turns.assistant_to_user
        for token in specials:
            if token and token in text and token != tokenizer.bos_token:
                stops.append((text.index(token), token))
        stops = [t for _, t in sorted(stops)][:1]
    if tokenizer.eos_token and tokenizer.eos_token not in stops:
        stops.append(tokenizer.eos_token)
    return stops


def write_modelfile(
    gguf_file: Path, tokenizer: PreTrainedTokenizerBase, add_bos: bool, name: str = "Modelfile"
) -> Path:
    """The Modelfile beside the GGUF (`ollama create NAME -f Modelfile`)."""
    turns = measure(tokenizer, add_bos)
    lines = [f"FROM ./{gguf_file.name}"]
    if turns is not None:
        lines.append(f'TEMPLATE """{turns.go_template()}"""')
    for stop in stop_tokens(tokenizer, turns):
        lines.append(f"PARAMETER stop {stop!r}".replace("'", '"'))
    path = gguf_file.with_name(name)
    path.write_text("\n".join(lines) + "\n")
    return path
