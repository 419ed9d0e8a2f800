"""Iteration-level scheduling for the LLM engine (continuous batching).

Every engine step asks `schedule()` which tokens to compute, runs one batched forward over
them, and hands the sampled tokens back through `update_from_output()`. The scheduler
never touches the model, so its tests run on hand-built outputs.

One step:
1. Running sequences first, oldest first: a decoding sequence computes its one new token;
   a sequence still prefilling computes its next prompt chunk. When the KV cache has no
   block for a sequence's next token, the youngest running sequence is preempted: its blocks
   are freed and it goes back to the head of the waiting queue to be recomputed later
   (prompt + the tokens it already produced), so memory never runs out mid-step.
2. Then waiting sequences, first come first served, while the step's token budget, the
   sequence limit and free blocks allow. A sequence starts from the cached KV blocks of
   the longest prefix of its tokens already computed (the shared system turn of a chat;
   its own blocks, after a preemption) and computes only the rest. A prompt longer than what the budget leaves is
   prefilled in chunks over several steps, so running sequences keep decoding meanwhile.
   No new sequence is admitted in a step that had to preempt: the cache is full.

The `static` policies are the baselines continuous batching is measured against: a batch
forms only when the previous one has fully finished, takes up to `max_num_seqs` waiting
requests with their whole prompts (no token budget) and blocks reserved for prompt +
max_tokens up front (so it never preempts), and runs until its last sequence finishes.
- `static` is static batching as `generate` does it on a padded batch: a member that has
  finished keeps its row in every step until the batch ends (a padding row: one token
  recomputed at its last position, the result thrown away) and keeps its blocks until then.
  Its answer still goes out as soon as it finishes.
- `static_retiring` lets a finished member leave the batch's compute and free its blocks at
  once; only its slot stays empty until the batch ends. Retiring finished sequences at once
  is half of what continuous batching does, so this baseline measures the other half alone:
  letting new requests join.

A sequence finishes on a stop token, at `max_tokens`, at the context limit, or when it is
aborted (the client cancelled or went away); its blocks return to the pool at once (under
`static`, when its batch ends).
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from python_backends.llm.kv_blocks import BlockManager, blocks_for_tokens


class FinishReason(enum.StrEnum):
    STOP = "stop"  # a stop token or stop string
    LENGTH = "length"  # max_tokens or the context limit reached
    CANCELLED = "cancelled"  # aborted: the client cancelled or disconnected


class BatchingPolicy(enum.StrEnum):
    CONTINUOUS = "continuous"  # sequences join and leave the running batch at every step
    STATIC = "static"  # a batch forms when the last one finished; every member computes until it ends
    STATIC_RETIRING = "static_retiring"  # as static, but a finished member leaves the batch's compute at once

    @property
    def is_static(self) -> bool:
        return self is not BatchingPolicy.CONTINUOUS

    @classmethod
    def parse(cls, name: str) -> BatchingPolicy:
        try:
            return cls(name)
        except ValueError:
            raise ValueError(f"unknown batching policy {name!r}; choose one of {[p.value for p in cls]}") from None


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class SamplingParams:
    """How one request generates; validated by `Scheduler.add`."""

    max_tokens: int  # output tokens at most
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # nucleus sampling mass, (0, 1]
    seed: int | None = None  # per-request sampling seed, for reproducible sampled output
    stop: tuple[str, ...] = ()  # stop strings, matched on the decoded text by the engine
    stop_token_ids: tuple[int, ...] = ()  # token ids that end the generation (e.g. end of turn)


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one engine; `num_blocks` comes from the KV-cache memory budget."""

    num_blocks: int  # KV-cache blocks in the pool
    block_size: int = 16  # token slots per block
    max_num_seqs: int = 8  # sequences in the running batch at most
    max_num_batched_tokens: int = 128  # tokens computed per step: prefill chunks plus one per decoding sequence
    max_model_len: int = 2048  # context limit: prompt plus output tokens
    policy: BatchingPolicy = BatchingPolicy.CONTINUOUS  # how sequences join the running batch
    prefix_caching: bool = True  # reuse computed KV blocks of identical prompt prefixes

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"SchedulerConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so every running sequence can decode in one step"
            )


@dataclass
class SequenceState:
    """One request inside the engine."""

    seq_id: str  # the request id
    prompt_token_ids: list[int]  # the tokenized prompt
    params: SamplingParams  # how it generates
    arrival_s: float  # when it was added (engine clock, seconds)
    output_token_ids: list[int] = field(default_factory=list)  # generated so far
    num_computed_tokens: int = 0  # tokens whose keys and values are in the cache
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0  # times it was evicted and recomputed
    first_token_s: float | None = None  # when its first output token was sampled

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self) -> list[int]:
        """Prompt and output: what a (re)computation feeds the model."""
        return self.prompt_token_ids + self.output_token_ids


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens of one sequence computed in a step."""

    seq_id: str  # the sequence
    start: int  # position of the first token computed (its num_computed_tokens before the step)
    num_tokens: int  # tokens computed this step: a prefill chunk, or 1 when decoding
    samples: bool  # the chunk reaches the last known token, so the step samples a new one
    padding: bool = False  # a finished member's row in a `static` batch: computed, its result discarded


@dataclass(frozen=True)
class SchedulerOutput:
    """What one step computes, in batch order."""

    chunks: tuple[ScheduledChunk, ...]  # one per scheduled sequence
    preempted: tuple[str, ...]  # seq ids evicted this step: blocks freed, back to waiting
    num_batched_tokens: int  # sum of the chunks' tokens; <= max_num_batched_tokens under the continuous policy

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(frozen=True)
class TokenEvent:
    """A token sampled for a sequence, and whether that finished it."""

    seq_id: str  # the sequence
    token_id: int  # the sampled token
    finish_reason: FinishReason | None  # set on the sequence's last event


class Scheduler:
    """Continuous-batching scheduler over a KV block pool; see the module docstring."""

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.blocks = BlockManager(config.num_blocks, config.block_size, config.prefix_caching)
        self.waiting: deque[SequenceState] = deque()
        self.running: list[SequenceState] = []  # admission order: oldest first, youngest last
        self.sequences: dict[str, SequenceState] = {}  # every unfinished sequence by id
        # `static` policy: members of the running batch that finished; they keep a padding
        # row in every step and their blocks until the batch ends
        self.padding: dict[str, SequenceState] = {}
        self.num_preemptions = 0  # since start

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def check(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise ValueError, saying what is wrong, for a request this engine can never serve."""
        limit = self.config.max_model_len
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        if params.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {params.max_tokens}")
        if len(prompt_token_ids) >= limit:
            raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens; the context holds {limit}, "
                             "with room for at least one output token")
        if len(prompt_token_ids) + params.max_tokens > limit:
            raise ValueError(f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) "
                             f"exceeds the context of {limit} tokens; lower max_tokens to at most "
                             f"{limit - len(prompt_token_ids)}")
        if not params.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {params.temperature}")
        if not 0 < params.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
        needed = blocks_for_tokens(len(prompt_token_ids) + params.max_tokens, self.config.block_size)
        if needed > self.config.num_blocks:
            raise ValueError(f"the request may need {needed} KV-cache blocks but the cache holds "
                             f"{self.config.num_blocks}; lower max_tokens or shorten the prompt")

    def add(self, seq_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, now: float) -> SequenceState:
        """Queue a request; raise ValueError if it can never be served, KeyError on a duplicate id."""
        if seq_id in self.sequences or seq_id in self.padding:
            raise KeyError(f"request id {seq_id!r} is already in the engine")
        self.check(prompt_token_ids, params)
        seq = SequenceState(seq_id=seq_id, prompt_token_ids=list(prompt_token_ids), params=params, arrival_s=now)
        self.sequences[seq_id] = seq
        self.waiting.append(seq)
        return seq

    def abort(self, seq_id: str) -> SequenceState | None:
        """Cancel a sequence wherever it is and free its blocks; None if it is not in the engine."""
        return self.finish(seq_id, FinishReason.CANCELLED)

    def sequence(self, seq_id: str) -> SequenceState:
        """A scheduled sequence: unfinished, or a padding row of the running static batch."""
        seq = self.sequences.get(seq_id) or self.padding.get(seq_id)
        if seq is None:
            raise KeyError(f"no sequence {seq_id!r} in the engine")
        return seq

    def finish(self, seq_id: str, reason: FinishReason) -> SequenceState | None:
        """End a sequence now (a stop string in its text, a cancel) and free its blocks;
        None if it is not in the engine."""
        seq = self.sequences.get(seq_id)
        if seq is None:
            return None
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._finish(seq, reason)
        return seq

    def schedule(self) -> SchedulerOutput:
        """Decide the next step; see the module docstring for the order."""
        if self.config.policy.is_static:
            return self._schedule_static()
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []

        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.blocks.can_hold(seq.seq_id, seq.num_computed_tokens + num_new):
                victim = self.running.pop()  # the youngest goes: it has the least work to redo
                self._preempt(victim)
                preempted.append(victim.seq_id)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # it preempted itself: nothing younger is left to run
            chunks.append(self._schedule_chunk(seq, num_new))
            budget -= num_new
            index += 1

        while (not preempted and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            seq = self.waiting[0]
            self._match_prefix(seq)
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.blocks.can_hold(seq.seq_id, seq.num_computed_tokens + num_new):
                self._release(seq)
                break  # first come, first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunks.append(self._schedule_chunk(seq, num_new))
            budget -= num_new

        return SchedulerOutput(chunks=tuple(chunks), preempted=tuple(preempted),
                               num_batched_tokens=self.config.max_num_batched_tokens - budget)

    def update_from_output(self, output: SchedulerOutput, sampled: Mapping[str, int], now: float) -> list[TokenEvent]:
        """Take a step's results back: advance the computed tokens, append sampled tokens,
        finish sequences that hit a stop token or a length limit."""
        events: list[TokenEvent] = []
        for chunk in output.chunks:
            seq = self.sequences.get(chunk.seq_id)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                continue  # aborted while the step ran
            seq.num_computed_tokens += chunk.num_tokens
            self.blocks.register(seq.seq_id, seq.token_ids(), seq.num_computed_tokens)
            if not chunk.samples:
                continue  # mid-prefill: nothing sampled yet
            if chunk.seq_id not in sampled:
                raise KeyError(f"step output has no sampled token for {chunk.seq_id!r}")
            token = int(sampled[chunk.seq_id])
            seq.output_token_ids.append(token)
            if seq.first_token_s is None:
                seq.first_token_s = now
            reason = None
            if token in seq.params.stop_token_ids:
                reason = FinishReason.STOP
            elif len(seq.output_token_ids) >= seq.params.max_tokens or seq.num_tokens >= self.config.max_model_len:
                reason = FinishReason.LENGTH
            if reason is not None:
                self.running.remove(seq)
                self._finish(seq, reason)
            events.append(TokenEvent(chunk.seq_id, token, reason))
        return events

    def _schedule_static(self) -> SchedulerOutput:
        chunks: list[ScheduledChunk] = []
        if self.running:  # the batch runs to completion: every member decodes, nobody joins
            chunks = [self._schedule_chunk(seq, seq.num_tokens - seq.num_computed_tokens) for seq in self.running]
            # Finished members recompute their last token in place: the cost of their row,
            # with no growth of the cache (their blocks were reserved up front).
            chunks += [ScheduledChunk(seq_id=seq.seq_id, start=seq.num_tokens - 1, num_tokens=1, samples=False,
                                      padding=True) for seq in self.padding.values()]
        else:
            while self.waiting and len(self.running) < self.config.max_num_seqs:
                seq = self.waiting[0]
                self._match_prefix(seq)
                if not self.blocks.can_hold(seq.seq_id, len(seq.prompt_token_ids) + seq.params.max_tokens):
                    self._release(seq)
                    break
                self.blocks.allocate(seq.seq_id, len(seq.prompt_token_ids) + seq.params.max_tokens)
                self.waiting.popleft()
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                chunks.append(self._schedule_chunk(seq, seq.num_tokens - seq.num_computed_tokens))
        return SchedulerOutput(chunks=tuple(chunks), preempted=(),
                               num_batched_tokens=sum(c.num_tokens for c in chunks))

    def _schedule_chunk(self, seq: SequenceState, num_new: int) -> ScheduledChunk:
        end = seq.num_computed_tokens + num_new
        added = self.blocks.allocate(seq.seq_id, end)
        assert added is not None, "checked with can_hold first"
        return ScheduledChunk(seq_id=seq.seq_id, start=seq.num_computed_tokens, num_tokens=num_new,
                              samples=end == seq.num_tokens)

    def _match_prefix(self, seq: SequenceState) -> None:
        """Start a sequence that has nothing computed from the cached blocks of its prefix;
        its last token is always computed, for the logits it samples from."""
        if seq.num_computed_tokens == 0:
            seq.num_computed_tokens = self.blocks.match_prefix(seq.seq_id, seq.token_ids(), seq.num_tokens - 1)

    def _release(self, seq: SequenceState) -> None:
        """Undo `_match_prefix` for a sequence that stays waiting: it holds no blocks meanwhile."""
        self.blocks.free(seq.seq_id)
        seq.num_computed_tokens = 0

    def _preempt(self, seq: SequenceState) -> None:
        # Recompute, not swap: the blocks go back now and the sequence re-prefills prompt +
        # output later, continuing where it stopped.
        self.blocks.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _finish(self, seq: SequenceState, reason: FinishReason) -> None:
        """Mark a sequence finished; the caller has taken it out of `running` or `waiting`."""
        in_batch = seq.status is SequenceStatus.RUNNING
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self.sequences[seq.seq_id]
        if in_batch and self.config.policy is BatchingPolicy.STATIC and self.running:
            self.padding[seq.seq_id] = seq  # its row and blocks stay with the batch until it ends
            return
        self.blocks.free(seq.seq_id)
        if not self.running:  # the batch has ended: its padding rows go with it
            for done in self.padding:
                self.blocks.free(done)
            self.padding.clear()
