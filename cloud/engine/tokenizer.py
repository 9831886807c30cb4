"""The engine's tokenizer and detokenizer: the shared implementation (the edge agent uses the same one)."""

from shared.chat_tokenizer import ChatTokenizer, IncrementalDetokenizer

__all__ = ["ChatTokenizer", "IncrementalDetokenizer"]
