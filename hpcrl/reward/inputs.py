"""How a response becomes the reward model's input.

**A discriminative model** reads prompt + response as one sequence and is scored at its last token. When its
tokenizer is the policy's (the same vocabulary and special tokens), the tokens are the policy's own: the prompt as
the policy saw it (its chat template and generation prompt applied) followed by the response's tokens, EOS included.
When the tokenizers differ, verl's chat-template switch: the prompt's chat messages plus the decoded response as
the assistant's turn, rendered by the reward model's chat template (no generation prompt) and tokenized by its
tokenizer (a model without a chat template gets prompt and response on two lines).

**A generative judge** reads ``reward_model.prompt_template`` filled with the question (``{prompt}``: a string
prompt as it is, chat messages as their contents, one per line), ``{response}`` and ``{ground_truth}``, sent as one
user message through the judge's chat template with the generation prompt (without a template: the text).

An input over ``reward_model.max_length`` is cut by ``reward_model.truncation`` (``left`` keeps the response's end)
or refused (``error``: :class:`InputTooLong`, that response's reward is 0 and counted).
"""
from __future__ import annotations

from typing import Any, Optional

from hpcrl.reward.wire import ScoreItem


class InputTooLong(ValueError):
    """A reward-model input over ``reward_model.max_length`` with ``reward_model.truncation: error``."""


def prompt_messages(prompt: Any) -> list[dict]:
    """The prompt as chat messages (a string is one user message)."""
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)


def prompt_text(prompt: Any) -> str:
    """The prompt as text: a string as it is, chat messages as their contents, one per line."""
    return prompt if isinstance(prompt, str) else "\n".join(str(m.get("content", "")) for m in prompt)


def same_tokenizer(a, b) -> bool:
    """The two tokenizers write the same tokens: the same vocabulary and special tokens."""
    return a.get_vocab() == b.get_vocab() and list(a.all_special_tokens) == list(b.all_special_tokens)


class Truncation:
    """``reward_model.max_length`` and ``truncation`` applied to one input."""

    def __init__(self, max_length: Optional[int], truncation: str):
        self.max_length, self.truncation = max_length, truncation

    def __call__(self, ids: list[int]) -> list[int]:
        if self.max_length is None or len(ids) <= self.max_length:
            return ids
        if self.truncation == "error":
            raise InputTooLong(f"the reward model's input is {len(ids)} tokens, over reward_model.max_length="
                               f"{self.max_length} (reward_model.truncation=error)")
        return ids[-self.max_length:] if self.truncation == "left" else ids[:self.max_length]


def _chat_ids(tokenizer, messages: list[dict], generation_prompt: bool) -> list[int]:
    """``messages`` through the tokenizer's chat template (tokens exactly as the template writes them)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


class DiscriminativeInputs:
    """Input tokens of a discriminative reward model (module docstring)."""

    def __init__(self, tokenizer, policy_tokenizer, truncate: Truncation):
        self.tokenizer, self.truncate = tokenizer, truncate
        self.reuse_ids = same_tokenizer(tokenizer, policy_tokenizer)
        """The policy's tokens are used as they are (same tokenizer); else the chat-template switch."""
        self.template = bool(getattr(tokenizer, "chat_template", None))

    def ids(self, item: ScoreItem) -> list[int]:
        """The model's input for one response (InputTooLong with ``truncation: error``)."""
        if self.reuse_ids:
            return self.truncate(list(item.prompt_ids) + list(item.response_ids))
        if self.template:
            chat = prompt_messages(item.prompt) + [{"role": "assistant", "content": item.response}]
            return self.truncate(_chat_ids(self.tokenizer, chat, generation_prompt=False))
        text = f"{prompt_text(item.prompt)}\n{item.response}"
        return self.truncate(list(self.tokenizer(text)["input_ids"]))

    def describe(self) -> str:
        """One line for the job's log: how inputs are built."""
        if self.reuse_ids:
            return "the policy's tokenizer: prompt + response tokens as the policy wrote them"
        return ("another tokenizer than the policy's: prompt and decoded response through its "
                + ("chat template" if self.template else "tokenizer (no chat template: two lines)"))


class JudgeInputs:
    """Prompt tokens of a generative judge (module docstring)."""

    def __init__(self, tokenizer, template: str, truncate: Truncation):
        self.tokenizer, self.template_text, self.truncate = tokenizer, template, truncate
        self.chat = bool(getattr(tokenizer, "chat_template", None))

    def ids(self, item: ScoreItem) -> list[int]:
        """The judge's prompt for one response."""
        text = self.template_text.format(prompt=prompt_text(item.prompt), response=item.response,
                                         ground_truth=item.ground_truth)
        return self.prompt_ids(text)

    def prompt_ids(self, prompt: Any) -> list[int]:
        """A free prompt (a string or chat messages) as the judge reads it: a hybrid function's own call."""
        if self.chat:
            return self.truncate(_chat_ids(self.tokenizer, prompt_messages(prompt), generation_prompt=True))
        return self.truncate(list(self.tokenizer(prompt_text(prompt))["input_ids"]))
