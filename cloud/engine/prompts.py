"""A prompt's checks, one place for each: its token ids, and whether it and its completion fit the context."""

from __future__ import annotations

from cloud.engine.tokenizer import ChatTokenizer
from shared.errors import ValidationError


def encode_prompt(tokenizer: ChatTokenizer, vocab_size: int, prompt: str | list[int]) -> list[int]:
    """A prompt's token ids: a string encoded, a list of ids checked against the vocabulary."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if not prompt or not all(isinstance(t, int) and 0 <= t < vocab_size for t in prompt):
        raise ValidationError(f"prompt: token ids must be integers in [0, {vocab_size})", param="prompt")
    return list(prompt)


def check_context_length(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> int:
    """The most tokens a completion of this prompt may have: ``max_tokens``, or all the room left when it is None.

    Raises:
        ValidationError: the prompt is empty, leaves no room for a completion, or with ``max_tokens`` exceeds
            ``max_model_len`` (code ``context_length_exceeded``, the OpenAI API's).
    """
    if num_prompt_tokens == 0:
        raise ValidationError("prompt: must not be empty", param="prompt")
    if num_prompt_tokens >= max_model_len:
        raise ValidationError(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt is "
            f"{num_prompt_tokens} tokens, leaving no room for a completion.",
            param="prompt",
            code="context_length_exceeded",
        )
    if max_tokens is None:
        return max_model_len - num_prompt_tokens
    if num_prompt_tokens + max_tokens > max_model_len:
        raise ValidationError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} in the "
            "completion). Please reduce the prompt or max_tokens.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return max_tokens
