"""Environment turns as tokens, rendered through the tokenizer's chat template.

A conversation is one token sequence; the model's turns are its sampled ids, appended verbatim.
An environment turn is the text the template puts between the end of the model's content and
the start of the next model turn, tokenized and appended::

    render(history + new, add_generation_prompt=True)  minus  render(history) up to the
    model's content, less the EOS the model already sampled

For a Qwen-style template after a model turn that sampled ``<|im_end|>`` it is
``"\\n<|im_start|>tool\\n18<|im_end|>\\n<|im_start|>assistant\\n"``; after a turn that stopped at
a stop string it also starts with the ``<|im_end|>`` that closes the model's turn. The rule: at
every model turn's start the sequence equals ``encode(render(messages, True))`` of the whole
conversation so far, as long as the model's earlier turns are the ids that encoding their text
(and the template's EOS) gives; sampled ids that tokenize the same text differently stay as
sampled, and only those positions differ.

Where exactness cannot be promised: a template that rewrites earlier turns when a message is
added (some drop the reasoning of earlier assistant turns, or move a system message), or that
changes the assistant's text. Then no appended rendering can equal a fresh one, and
:class:`RenderDriftError` says so on the turn where it happens instead of letting the trainer
and the engine drift apart.

A tokenizer without a chat template (the built-in character tokenizer, or a ``tokenizer.json``
with none) renders a conversation as its messages' contents in order, with no turn markup; a
model EOS sampled in the middle of such a conversation stays in the sequence but has no text, so
the built-in environments end their model turns with stop strings instead.
"""

from __future__ import annotations

from collections.abc import Sequence

from dora_jax.model.tokenizer import Message, Tokenizer, eos_ids


class RenderDriftError(ValueError):
    """The chat template cannot be rendered turn by turn token-exactly (the message says why)."""


class TurnRenderer:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.templated = bool(getattr(tokenizer, "chat_template", None))
        self._eos = set(eos_ids(tokenizer))

    def render(self, messages: Sequence[Message], add_generation_prompt: bool) -> str:
        if not self.templated:
            return "".join(m["content"] for m in messages)
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt)

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        """The first observation, ready for the model's first turn."""
        return self.tokenizer.encode(self.render(messages, True))

    def model_text(self, ids: Sequence[int]) -> str:
        """What the environment reads of a model turn: its text without EOS tokens."""
        return self.tokenizer.decode([t for t in ids if t not in self._eos])

    def env_turn_text(
        self, history: Sequence[Message], model_ids: Sequence[int], new: Sequence[Message]
    ) -> str:
        """The text appended after the model turn ``model_ids`` (``history``'s last message, an
        assistant message of its text) so that the model's next turn starts where the template
        starts it for ``history + new``."""
        if not history or history[-1]["role"] != "assistant":
            raise ValueError("history must end with the model's (assistant) turn")
        content = history[-1]["content"]
        before = self.render(history[:-1], True)
        done = self.render(history, False)
        after = self.render([*history, *new], True)
        if not done.startswith(before) or not done[len(before) :].startswith(content):
            raise RenderDriftError(
                "the chat template does not render the model's turn as its text after the "
                "generation prompt (it changes earlier turns or the assistant's text): turns "
                "cannot be appended token-exactly with this template"
            )
        if not after.startswith(done):
            raise RenderDriftError(
                f"the chat template rewrites earlier turns when a {new[0]['role'] if new else ''}"
                " message is added (e.g. it drops earlier reasoning): the rendered conversation "
                "would differ from the tokens the model sampled, so it cannot be used token-"
                "exactly for multi-turn episodes"
            )
        close = done[len(before) + len(content) :]
        if self.templated and model_ids and model_ids[-1] in self._eos:
            eos_text = self.tokenizer.decode([model_ids[-1]], skip_special=False)
            if not close.startswith(eos_text):
                raise RenderDriftError(
                    f"the chat template closes an assistant turn with {close[:40]!r}, not with "
                    f"the EOS {eos_text!r} the model sampled: the turn markup would differ"
                )
            close = close[len(eos_text) :]
        return close + after[len(done) :]

    def env_turn_ids(
        self, history: Sequence[Message], model_ids: Sequence[int], new: Sequence[Message]
    ) -> list[int]:
        return self.tokenizer.encode(self.env_turn_text(history, model_ids, new))
