"""Tokenization with the `tokenizers` library and the model's own tokenizer.json.

Nothing here knows a token by name: which special tokens frame a text, and which id pads a
row, come from the tokenizer itself (its post-processor and its padding settings), so a
WordPiece `[CLS] ... [SEP]` model, a SentencePiece `<s> ... </s>` one and a BPE tokenizer
that adds nothing are all served the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

# Pad tokens by the names tokenizers commonly give them, tried when tokenizer.json sets no
# padding and the caller names none.
COMMON_PAD_TOKENS = ("[PAD]", "<pad>", "<|pad|>", "<|padding|>")


@dataclass(frozen=True)
class SpecialLayout:
    """How many special tokens the tokenizer puts around one text."""

    leading: int  # before the text's own tokens (BERT's [CLS]: 1)
    trailing: int  # after them (BERT's [SEP]: 1; a plain BPE tokenizer: 0)


def special_layout(tokenizer: Tokenizer) -> SpecialLayout:
    """The special tokens a single text gets, read from the tokenizer's own output."""
    mask = tokenizer.encode("a").special_tokens_mask
    if 0 not in mask:
        raise ValueError("the tokenizer turns a one-letter text into special tokens only")
    first = mask.index(0)
    last = len(mask) - 1 - mask[::-1].index(0)
    return SpecialLayout(leading=first, trailing=len(mask) - 1 - last)


def pad_id_of(tokenizer: Tokenizer, pad_token: str | None = None) -> int:
    """The id that pads a row: `pad_token`'s when named, else the tokenizer's own padding id
    (tokenizer.json's `padding`), else a common pad token's; ValueError saying which were tried."""
    if pad_token is not None:
        pad_id = tokenizer.token_to_id(pad_token)
        if pad_id is None:
            raise ValueError(f"tokenizer has no pad token {pad_token!r}")
        return pad_id
    if tokenizer.padding is not None:
        return int(tokenizer.padding["pad_id"])
    for name in COMMON_PAD_TOKENS:
        if (pad_id := tokenizer.token_to_id(name)) is not None:
            return pad_id
    raise ValueError("the tokenizer sets no padding and has none of the pad tokens "
                     f"{', '.join(COMMON_PAD_TOKENS)}: name the pad token (the attention mask hides "
                     "padding, so any token id will do, e.g. the end-of-text token)")


class TextTokenizer:
    """Encodes text rows to token ids with special tokens, without truncation or padding.

    Truncation and padding are the router's decisions (`buckets.truncate_tokens`,
    `buckets.pad_rows`), so the tokenizer must not do either on its own; `layout` says how
    many special tokens a truncation must keep at each end, `pad_id` what pads a row.
    """

    def __init__(self, tokenizer: Tokenizer, pad_token: str | None = None):
        self.pad_id: int = pad_id_of(tokenizer, pad_token)
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self._tokenizer = tokenizer
        self._encode_batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)  # tokenizers < 0.21
        self.layout: SpecialLayout = special_layout(tokenizer)

    @classmethod
    def from_file(cls, path: str | Path, pad_token: str | None = None) -> TextTokenizer:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file {path} not found; run `python -m tools build-models`")
        return cls(Tokenizer.from_file(str(path)), pad_token)

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text with its special tokens (`[CLS] ... [SEP]` for BERT), full length.

        `encode_batch_fast` leaves out the character offsets, which the router never reads
        (measured on 2 vCPU: 29 -> 25 us for a short text)."""
        return [encoding.ids for encoding in self._encode_batch(list(texts))]

    def num_pair_specials(self) -> int:
        """Special tokens the tokenizer adds around a text pair (BERT's [CLS] a [SEP] b [SEP]: 3)."""
        return self._tokenizer.num_special_tokens_to_add(True)

    def encode_pairs(self, firsts: Sequence[str], seconds: Sequence[str],
                     max_tokens: int | None = None) -> list[tuple[list[int], list[int], int]]:
        """Each pair as one row: (token ids, token type ids, tokens cut). With `max_tokens` the
        longer member loses tokens first (`longest_first`) until the row fits; specials are kept."""
        firsts_enc = self._tokenizer.encode_batch(list(firsts), add_special_tokens=False)
        seconds_enc = self._tokenizer.encode_batch(list(seconds), add_special_tokens=False)
        rows = []
        for first, second in zip(firsts_enc, seconds_enc, strict=True):
            cut = 0
            if max_tokens is not None:
                keep_first, keep_second = longest_first(len(first.ids), len(second.ids),
                                                        max_tokens - self.num_pair_specials())
                cut = len(first.ids) - keep_first + len(second.ids) - keep_second
                if keep_first < len(first.ids):
                    first.truncate(keep_first)
                if keep_second < len(second.ids):
                    second.truncate(keep_second)
            pair = self._tokenizer.post_process(first, second, add_special_tokens=True)
            rows.append((list(pair.ids), list(pair.type_ids), cut))
        return rows


def longest_first(first: int, second: int, budget: int) -> tuple[int, int]:
    """How many tokens of each pair member to keep so both fit `budget`: one at a time from the
    longer member (the first on a tie), as Hugging Face's `longest_first` truncation does; each
    keeps at least one token when the budget allows it."""
    if budget < 2:
        raise ValueError(f"a pair needs room for at least one token of each text, got {budget}")
    over = first + second - budget
    if over <= 0:
        return first, second
    longer, shorter = max(first, second), min(first, second)
    # Cut the longer down to the shorter's length, then both alternately.
    cut_longer = min(over, longer - shorter)
    longer -= cut_longer
    over -= cut_longer
    both = over // 2
    longer -= both + over % 2
    shorter -= both
    return (longer, shorter) if first >= second else (shorter, longer)
