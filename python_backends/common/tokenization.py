"""Tokenization with the `tokenizers` library and the model's own tokenizer.json."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer


class TextTokenizer:
    """Encodes text rows to token ids with special tokens, without truncation or padding.

    Truncation and padding are the router's decisions (`buckets.truncate_tokens`,
    `buckets.pad_rows`), so the tokenizer must not do either on its own.
    """

    def __init__(self, tokenizer: Tokenizer, pad_token: str = "[PAD]"):
        tokenizer.no_truncation()
        tokenizer.no_padding()
        pad_id = tokenizer.token_to_id(pad_token)
        if pad_id is None:
            raise ValueError(f"tokenizer has no pad token {pad_token!r}")
        self._tokenizer = tokenizer
        self.pad_id: int = pad_id

    @classmethod
    def from_file(cls, path: str | Path) -> TextTokenizer:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file {path} not found; run `python -m tools build-models`")
        return cls(Tokenizer.from_file(str(path)))

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, `[CLS] ... [SEP]`, full length."""
        return [encoding.ids for encoding in self._tokenizer.encode_batch(list(texts))]
