"""The engine's tokenizer and detokenizer: the shared implementation (the edge agent uses the same one)."""

from shared.chat_tokenizer import DEFAULT_CHAT_TEMPLATE, ChatTokenizer, IncrementalDetokenizer

__all__ = ["DEFAULT_CHAT_TEMPLATE", "ChatTokenizer", "IncrementalDetokenizer"]
