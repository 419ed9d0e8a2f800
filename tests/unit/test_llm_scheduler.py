"""The continuous-batching scheduler and the KV block manager, driven by a fake model.

The fake model's next token is a pure function of every token before it, like a greedy
LLM, so a sequence's output must not depend on what it was batched with, on prefill
chunking, or on being preempted and recomputed.
"""

from __future__ import annotations

import pytest

from python_backends.llm.kv_blocks import BlockManager, KVCacheSpec, blocks_for_tokens, num_blocks_for_budget
from python_backends.llm.scheduler import (
    BatchingPolicy,
    FinishReason,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    SequenceStatus,
)

EOS = 7


def next_token(prefix: list[int]) -> int:
    """A deterministic stand-in for greedy decoding: depends on the whole prefix."""
    value = 0
    for token in prefix:
        value = (value * 31 + token) % 9973
    return 100 + value % 800  # never EOS


class FakeRunner:
    """Checks that each step computes exactly the tokens not yet in the cache, then samples.

    A sequence may start past zero only from a prefix whose blocks some sequence computed
    before (prefix caching): the fake remembers every computed block-aligned prefix."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.computed: dict[str, int] = {}  # seq_id -> tokens the fake cache holds
        self.prefixes: set[tuple[int, ...]] = set()  # block-aligned token prefixes computed so far
        self.steps: list[SchedulerOutput] = []

    def step(self, now: float = 0.0):
        output = self.scheduler.schedule()
        self.steps.append(output)
        for seq_id in output.preempted:
            self.computed[seq_id] = 0  # its blocks were freed
        sampled = {}
        for chunk in output.chunks:
            seq = self.scheduler.sequence(chunk.seq_id)
            table = self.scheduler.blocks.block_table(chunk.seq_id)
            if chunk.padding:  # a finished member of a static batch: its last token again, in its own blocks
                assert seq.status is SequenceStatus.FINISHED and not chunk.samples and chunk.num_tokens == 1
                assert chunk.start == seq.num_tokens - 1
                assert len(table) * self.scheduler.config.block_size >= seq.num_tokens
                continue
            held = self.computed.get(chunk.seq_id, 0)
            if held == 0 and chunk.start > 0:
                assert tuple(seq.token_ids()[:chunk.start]) in self.prefixes, "skipped tokens nobody computed"
            else:
                assert chunk.start == held, "a step must continue where the cache ends"
            self.computed[chunk.seq_id] = chunk.start + chunk.num_tokens
            size = self.scheduler.config.block_size
            tokens = seq.token_ids()
            for end in range(size, chunk.start + chunk.num_tokens + 1, size):
                self.prefixes.add(tuple(tokens[:end]))
            assert len(table) * self.scheduler.config.block_size >= chunk.start + chunk.num_tokens
            if chunk.samples:
                sampled[chunk.seq_id] = next_token(seq.token_ids())
        if self.scheduler.config.policy is BatchingPolicy.CONTINUOUS:
            assert output.num_batched_tokens <= self.scheduler.config.max_num_batched_tokens
        return output, self.scheduler.update_from_output(output, sampled, now)

    def run(self, max_steps: int = 10_000) -> dict[str, list[int]]:
        outputs: dict[str, list[int]] = {}
        for step in range(max_steps):
            if not self.scheduler.has_work:
                return outputs
            _, events = self.step(now=float(step))
            for event in events:
                outputs.setdefault(event.seq_id, []).append(event.token_id)
        raise AssertionError("the scheduler did not drain")


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    tokens, out = list(prompt), []
    for _ in range(max_tokens):
        out.append(next_token(tokens))
        tokens.append(out[-1])
    return out


def prompt(length: int, seed: int = 1) -> list[int]:
    return [(seed * 17 + i * 13) % 500 + 1 for i in range(length)]


def scheduler(**overrides) -> Scheduler:
    config = {"num_blocks": 64, "block_size": 4, "max_num_seqs": 4, "max_num_batched_tokens": 32,
              "max_model_len": 256, **overrides}
    return Scheduler(SchedulerConfig(**config))


# --- the block manager -------------------------------------------------------------------


def test_blocks_grow_with_the_sequence_and_all_return_on_free():
    blocks = BlockManager(num_blocks=4, block_size=4)
    assert blocks.allocate("a", 5) == [0, 1]
    assert blocks.allocate("a", 8) == []  # still fits in two blocks
    assert blocks.allocate("a", 9) == [2]
    assert blocks.block_table("a") == [0, 1, 2] and blocks.num_used == 3
    assert blocks.free("a") == 3 and blocks.num_free == 4 and blocks.block_table("a") == []


def test_allocation_is_all_or_nothing_and_says_none_when_short():
    blocks = BlockManager(num_blocks=3, block_size=4)
    assert blocks.allocate("a", 8) == [0, 1]
    assert not blocks.can_hold("b", 8)
    assert blocks.allocate("b", 8) is None
    assert blocks.num_free == 1 and blocks.block_table("b") == []
    assert blocks.allocate("b", 4) == [2]


def test_cache_budget_in_blocks():
    spec = KVCacheSpec(num_layers=30, num_kv_heads=3, head_dim=64, dtype_bytes=4, block_size=16)
    assert spec.bytes_per_token == 2 * 30 * 3 * 64 * 4
    assert num_blocks_for_budget(spec, 10 * spec.bytes_per_block + 1) == 10
    with pytest.raises(ValueError, match="holds no block"):
        num_blocks_for_budget(spec, spec.bytes_per_block - 1)
    with pytest.raises(ValueError, match="num_kv_heads must be >= 1"):
        KVCacheSpec(num_layers=1, num_kv_heads=0, head_dim=64)
    assert blocks_for_tokens(0, 16) == 0 and blocks_for_tokens(17, 16) == 2
    with pytest.raises(ValueError, match="num_blocks >= 1"):
        BlockManager(0, 16)


# --- scheduling ----------------------------------------------------------------------------


def test_each_output_matches_the_sequence_run_alone():
    sched = scheduler()
    prompts = {f"r{i}": prompt(3 + 5 * i, seed=i) for i in range(6)}
    for seq_id, tokens in prompts.items():
        sched.add(seq_id, tokens, SamplingParams(max_tokens=9), now=0.0)
    outputs = FakeRunner(sched).run()
    assert outputs == {seq_id: reference(tokens, 9) for seq_id, tokens in prompts.items()}
    assert sched.blocks.num_used == 0 and not sched.sequences


def test_running_sequences_decode_together_one_token_each():
    sched = scheduler()
    for i in range(3):
        sched.add(f"r{i}", prompt(4, seed=i), SamplingParams(max_tokens=5), now=0.0)
    runner = FakeRunner(sched)
    first, _ = runner.step()
    assert [(c.num_tokens, c.samples) for c in first.chunks] == [(4, True)] * 3  # three prefills in one step
    second, events = runner.step()
    assert [(c.num_tokens, c.samples) for c in second.chunks] == [(1, True)] * 3  # one batched decode
    assert len(events) == 3


def test_a_new_request_joins_the_running_batch_at_the_next_step():
    sched = scheduler()
    sched.add("old", prompt(4), SamplingParams(max_tokens=20), now=0.0)
    runner = FakeRunner(sched)
    runner.step()
    runner.step()
    sched.add("new", prompt(6, seed=2), SamplingParams(max_tokens=3), now=2.0)
    output, events = runner.step()
    assert [c.seq_id for c in output.chunks] == ["old", "new"]
    assert {e.seq_id for e in events} == {"old", "new"}  # the newcomer's first token comes at once


def test_a_finished_sequence_leaves_at_once_and_frees_its_blocks():
    sched = scheduler()
    sched.add("short", prompt(4), SamplingParams(max_tokens=2), now=0.0)
    sched.add("long", prompt(4, seed=3), SamplingParams(max_tokens=10), now=0.0)
    runner = FakeRunner(sched)
    runner.step()
    _, events = runner.step()
    finished = [e for e in events if e.finish_reason is not None]
    assert [(e.seq_id, e.finish_reason) for e in finished] == [("short", FinishReason.LENGTH)]
    assert sched.blocks.block_table("short") == [] and "short" not in sched.sequences
    output, _ = runner.step()
    assert [c.seq_id for c in output.chunks] == ["long"]


def test_long_prompt_is_prefilled_in_chunks_while_others_keep_decoding():
    sched = scheduler(max_num_batched_tokens=8)
    sched.add("chat", prompt(3), SamplingParams(max_tokens=30), now=0.0)
    runner = FakeRunner(sched)
    runner.step()
    sched.add("document", prompt(30, seed=5), SamplingParams(max_tokens=2), now=1.0)
    decoded_every_step = []
    while "document" in sched.sequences and not sched.sequences["document"].output_token_ids:
        output, _ = runner.step()
        sizes = {c.seq_id: c.num_tokens for c in output.chunks}
        decoded_every_step.append(sizes.get("chat") == 1)
        assert sizes.get("document", 0) <= 7  # the budget left after the decode
    assert all(decoded_every_step) and len(decoded_every_step) >= 4  # 30 tokens in chunks of at most 7
    outputs = runner.run()
    assert outputs["document"][-1] == reference(prompt(30, seed=5), 2)[-1]


def test_out_of_blocks_preempts_the_youngest_and_recomputes_it_to_the_same_output():
    # 8 blocks of 4 slots: two 10-token prompts growing to 26 tokens cannot both fit.
    sched = scheduler(num_blocks=8, max_num_seqs=2)
    sched.add("older", prompt(10, seed=1), SamplingParams(max_tokens=16), now=0.0)
    sched.add("younger", prompt(10, seed=2), SamplingParams(max_tokens=16), now=0.0)
    runner = FakeRunner(sched)
    outputs = runner.run()
    preempting = [s for s in runner.steps if s.preempted]
    assert preempting and all(s.preempted == ("younger",) for s in preempting)
    assert sched.num_preemptions == len(preempting)
    assert outputs["older"] == reference(prompt(10, seed=1), 16)
    assert outputs["younger"] == reference(prompt(10, seed=2), 16)
    assert sched.blocks.num_used == 0


def test_no_admission_in_a_step_that_preempted():
    # With a small token budget the evicted sequence's first recompute chunk would fit in the
    # blocks it just gave back; taking it straight back in would only thrash.
    sched = scheduler(num_blocks=6, max_num_seqs=2, max_num_batched_tokens=8)
    sched.add("a", prompt(8, seed=1), SamplingParams(max_tokens=15), now=0.0)
    sched.add("b", prompt(8, seed=2), SamplingParams(max_tokens=15), now=0.0)
    runner = FakeRunner(sched)
    preempting = []
    for _ in range(40):
        output, _ = runner.step()
        if output.preempted:
            preempting.append(output)
            assert not set(output.preempted) & {c.seq_id for c in output.chunks}
    assert preempting
    runner.run()  # and it still drains: no endless evict-and-readmit


def test_waiting_requests_are_admitted_first_come_first_served():
    sched = scheduler(num_blocks=6, max_num_seqs=4)
    sched.add("big", prompt(16, seed=1), SamplingParams(max_tokens=8), now=0.0)  # 4 blocks now, 6 later
    sched.add("huge", prompt(16, seed=2), SamplingParams(max_tokens=8), now=0.0)  # would need 4 more
    sched.add("tiny", prompt(2, seed=3), SamplingParams(max_tokens=1), now=0.0)  # fits, but queued behind
    output, _ = FakeRunner(sched).step()
    assert [c.seq_id for c in output.chunks] == ["big"]
    assert [s.seq_id for s in sched.waiting] == ["huge", "tiny"]


def test_max_num_seqs_caps_the_running_batch():
    sched = scheduler(max_num_seqs=2)
    for i in range(4):
        sched.add(f"r{i}", prompt(3, seed=i), SamplingParams(max_tokens=4), now=0.0)
    output, _ = FakeRunner(sched).step()
    assert len(output.chunks) == 2 and sched.num_running == 2 and sched.num_waiting == 2


def test_stop_token_finishes_with_stop():
    sched = scheduler()
    sched.add("r", prompt(3), SamplingParams(max_tokens=10, stop_token_ids=(EOS,)), now=0.0)
    output = sched.schedule()
    (event,) = sched.update_from_output(output, {"r": EOS}, now=1.0)
    assert event.finish_reason is FinishReason.STOP and not sched.has_work


def test_abort_frees_blocks_wherever_the_sequence_is_and_ignores_its_step_result():
    sched = scheduler(max_num_seqs=1)
    sched.add("running", prompt(5), SamplingParams(max_tokens=10), now=0.0)
    sched.add("queued", prompt(5, seed=2), SamplingParams(max_tokens=10), now=0.0)
    output = sched.schedule()
    assert sched.blocks.num_used == 2
    cancelled = sched.abort("running")
    assert cancelled.finish_reason is FinishReason.CANCELLED and cancelled.status is SequenceStatus.FINISHED
    assert sched.blocks.num_used == 0
    assert sched.update_from_output(output, {"running": 123}, now=1.0) == []  # the step ran before the cancel
    assert sched.abort("queued").finish_reason is FinishReason.CANCELLED
    assert sched.abort("unknown") is None and not sched.has_work


def test_finish_by_stop_string_frees_the_sequence():
    sched = scheduler()
    sched.add("r", prompt(3), SamplingParams(max_tokens=10, stop=("\n",)), now=0.0)
    FakeRunner(sched).step()
    sched.finish("r", FinishReason.STOP)
    assert not sched.has_work and sched.blocks.num_used == 0


def test_first_token_time_is_recorded_once():
    sched = scheduler()
    seq = sched.add("r", prompt(3), SamplingParams(max_tokens=3), now=0.0)
    runner = FakeRunner(sched)
    runner.step(now=0.25)
    runner.step(now=0.5)
    assert seq.first_token_s == 0.25


@pytest.mark.parametrize(
    ("tokens", "params", "message"),
    [
        ([], SamplingParams(max_tokens=4), "the prompt is empty"),
        ([1, 2], SamplingParams(max_tokens=0), "max_tokens must be >= 1, got 0"),
        ([1] * 64, SamplingParams(max_tokens=1), "the prompt has 64 tokens; the context holds 64"),
        ([1] * 60, SamplingParams(max_tokens=10), r"exceeds the context of 64 tokens; lower max_tokens to at most 4"),
        ([1, 2], SamplingParams(max_tokens=4, temperature=-1.0), "temperature must be >= 0"),
        ([1, 2], SamplingParams(max_tokens=4, top_p=0.0), r"top_p must be in \(0, 1\]"),
    ],
)
def test_requests_that_can_never_be_served_are_refused_with_the_reason(tokens, params, message):
    sched = scheduler(max_model_len=64)
    with pytest.raises(ValueError, match=message):
        sched.add("r", tokens, params, now=0.0)
    assert not sched.has_work


def test_a_request_larger_than_the_whole_cache_is_refused():
    sched = scheduler(num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="may need 5 KV-cache blocks but the cache holds 4"):
        sched.add("r", prompt(10), SamplingParams(max_tokens=10), now=0.0)


def test_duplicate_request_id_is_refused():
    sched = scheduler()
    sched.add("r", prompt(3), SamplingParams(max_tokens=2), now=0.0)
    with pytest.raises(KeyError, match="already in the engine"):
        sched.add("r", prompt(3), SamplingParams(max_tokens=2), now=0.0)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [({"num_blocks": 0}, "num_blocks must be >= 1"),
     ({"max_num_seqs": 8, "max_num_batched_tokens": 4}, "must be >= max_num_seqs")],
)
def test_scheduler_config_is_validated(overrides, message):
    with pytest.raises(ValueError, match=message):
        scheduler(**overrides)


# --- the static baseline ---------------------------------------------------------------


def rows(output: SchedulerOutput) -> list[str]:
    """A step's rows: seq ids, a padding row marked with '~'."""
    return [("~" if c.padding else "") + c.seq_id for c in output.chunks]


def long_short_and_late(policy: BatchingPolicy) -> tuple[Scheduler, FakeRunner]:
    """A batch of two ("long" and "short", which finishes first) and "late" waiting behind it."""
    sched = scheduler(policy=policy, max_num_seqs=2)
    sched.add("long", prompt(4), SamplingParams(max_tokens=6), now=0.0)
    sched.add("short", prompt(4, seed=2), SamplingParams(max_tokens=2), now=0.0)
    sched.add("late", prompt(4, seed=3), SamplingParams(max_tokens=2), now=0.0)
    runner = FakeRunner(sched)
    return sched, runner


def test_static_batch_computes_every_member_until_the_last_one_finishes():
    sched, runner = long_short_and_late(BatchingPolicy.STATIC)
    first, _ = runner.step()
    assert rows(first) == ["long", "short"]
    # Blocks for prompt + max_tokens are reserved at admission: 10 tokens -> 3 blocks of 4.
    assert len(sched.blocks.block_table("long")) == 3
    second, events = runner.step()
    assert rows(second) == ["long", "short"]
    assert [(e.seq_id, e.finish_reason) for e in events] == [("long", None), ("short", FinishReason.LENGTH)]
    # "short" is answered, but its row and its blocks stay with the batch; "late" waits.
    scheduled = [rows(runner.step()[0]) for _ in range(4)]
    assert scheduled == [["long", "~short"]] * 4
    assert sched.num_running == 0 and not sched.padding and sched.blocks.num_used == 0
    assert rows(runner.step()[0]) == ["late"]


def test_static_retiring_batch_drops_finished_members_but_admits_nobody_until_it_ends():
    sched, runner = long_short_and_late(BatchingPolicy.STATIC_RETIRING)
    assert rows(runner.step()[0]) == ["long", "short"]
    assert len(sched.blocks.block_table("long")) == 3  # prompt + max_tokens reserved, as in static
    scheduled = [rows(runner.step()[0]) for _ in range(5)]
    assert scheduled == [["long", "short"], ["long"], ["long"], ["long"], ["long"]]  # "late" waits
    assert sched.blocks.block_table("short") == []  # freed when it finished
    assert rows(runner.step()[0]) == ["late"]


def test_a_cancelled_member_of_a_static_batch_keeps_its_row_until_the_batch_ends():
    sched = scheduler(policy=BatchingPolicy.STATIC, max_num_seqs=2)
    sched.add("a", prompt(4), SamplingParams(max_tokens=8), now=0.0)
    sched.add("b", prompt(4, seed=2), SamplingParams(max_tokens=8), now=0.0)
    runner = FakeRunner(sched)
    runner.step()
    held = sched.blocks.num_used
    assert sched.abort("a") is not None
    assert sched.blocks.num_used == held and rows(runner.step()[0]) == ["b", "~a"]
    with pytest.raises(KeyError, match="already in the engine"):  # its id is still the batch's
        sched.add("a", prompt(4), SamplingParams(max_tokens=2), now=1.0)
    assert sched.abort("b") is not None  # the last member: the batch ends, every block returns
    assert not sched.has_work and not sched.padding and sched.blocks.num_used == 0


@pytest.mark.parametrize("policy", [BatchingPolicy.STATIC, BatchingPolicy.STATIC_RETIRING])
def test_static_batch_prefills_whole_prompts_and_outputs_match_the_reference(policy):
    sched = scheduler(policy=policy, max_num_batched_tokens=8)
    prompts = {f"r{i}": prompt(10 + i, seed=i) for i in range(3)}
    for seq_id, tokens in prompts.items():
        sched.add(seq_id, tokens, SamplingParams(max_tokens=4), now=0.0)
    runner = FakeRunner(sched)
    first, events = runner.step()
    assert [c.num_tokens for c in first.chunks] == [10, 11, 12]  # the token budget does not split them
    outputs = runner.run()
    for event in events:
        outputs[event.seq_id].insert(0, event.token_id)
    assert outputs == {seq_id: reference(tokens, 4) for seq_id, tokens in prompts.items()}
    assert sched.blocks.num_used == 0


def test_unknown_batching_policy_is_named():
    assert BatchingPolicy.parse("static") is BatchingPolicy.STATIC
    assert BatchingPolicy.parse("static_retiring") is BatchingPolicy.STATIC_RETIRING
    with pytest.raises(ValueError, match="unknown batching policy 'greedy'"):
        BatchingPolicy.parse("greedy")


# --- prefix caching ----------------------------------------------------------------------


def test_a_computed_prefix_is_found_again_after_its_sequence_finished():
    blocks = BlockManager(num_blocks=6, block_size=4)
    tokens = list(range(1, 11))  # 10 tokens: 2 full blocks and a partial one
    blocks.allocate("a", 10)
    blocks.register("a", tokens, num_computed=10)
    assert blocks.num_cached == 2  # the partial third block is not registered
    blocks.free("a")
    assert blocks.num_free == 6 and blocks.num_used == 0  # cached blocks are reclaimable
    assert blocks.match_prefix("b", tokens, max_tokens=9) == 8
    assert blocks.block_table("b") == [0, 1] and blocks.num_used == 2 and blocks.num_hit_tokens == 8
    assert blocks.allocate("b", 10) == [2]


def test_the_match_stops_at_the_first_different_block_and_leaves_the_last_token():
    blocks = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(1, 13))
    blocks.allocate("a", 12)
    blocks.register("a", tokens, num_computed=12)
    blocks.free("a")
    # The same second block after a different first one is a different chain: no match past block 0.
    assert blocks.match_prefix("b", [1, 2, 3, 4, 99, 6, 7, 8, 9], max_tokens=8) == 4
    # A prompt of exactly 12 known tokens keeps its last one to compute: 2 blocks, not 3.
    assert blocks.match_prefix("c", tokens, max_tokens=11) == 8


def test_shared_blocks_are_held_once_and_freed_when_the_last_holder_goes():
    blocks = BlockManager(num_blocks=4, block_size=4)
    tokens = list(range(1, 9))
    blocks.allocate("a", 8)
    blocks.register("a", tokens, num_computed=8)
    assert blocks.match_prefix("b", [*tokens, 9], max_tokens=8) == 8
    assert blocks.num_used == 2  # a and b share both blocks
    blocks.free("a")
    assert blocks.num_used == 2
    blocks.free("b")
    assert blocks.num_used == 0 and blocks.num_cached == 2


def test_blocks_computed_after_a_partly_matched_prefix_are_found_again():
    # Every chat shares its first block (the system turn); two that share two blocks must find
    # both, the second computed by the first of them after it matched only the shared one.
    blocks = BlockManager(num_blocks=16, block_size=4)
    system, question = [1, 2, 3, 4], [5, 6, 7, 8]
    for seq_id, prompt in (("a", [*system, 9, 9, 9, 9, 0]), ("b", [*system, *question, 0]),
                           ("c", [*system, *question, 1])):
        matched = blocks.match_prefix(seq_id, prompt, max_tokens=len(prompt) - 1)
        assert matched == {"a": 0, "b": 4, "c": 8}[seq_id], seq_id
        blocks.allocate(seq_id, len(prompt))
        blocks.register(seq_id, prompt, len(prompt))
        blocks.free(seq_id)


def test_cached_blocks_are_evicted_last_and_least_recently_released_first():
    blocks = BlockManager(num_blocks=4, block_size=2)
    blocks.allocate("a", 4)
    blocks.register("a", [1, 2, 3, 4], num_computed=4)
    blocks.free("a")  # blocks 0, 1 cached; 2, 3 never used
    assert blocks.allocate("b", 4) == [2, 3]  # never-registered blocks go first
    assert blocks.allocate("c", 2) == [1]  # then the tail of a's prefix, before its head
    assert blocks.num_cached == 1
    assert blocks.match_prefix("d", [1, 2, 3, 4, 5], max_tokens=4) == 2  # only the head is left


def test_the_same_contents_computed_twice_register_once():
    blocks = BlockManager(num_blocks=4, block_size=2)
    for seq in ("a", "b"):
        blocks.allocate(seq, 2)
        blocks.register(seq, [5, 6], num_computed=2)
    assert blocks.num_cached == 1
    blocks.free("a")
    blocks.free("b")
    assert blocks.num_free == 4


def test_prefix_caching_can_be_turned_off():
    blocks = BlockManager(num_blocks=4, block_size=2, prefix_caching=False)
    blocks.allocate("a", 4)
    blocks.register("a", [1, 2, 3, 4], num_computed=4)
    blocks.free("a")
    assert blocks.num_cached == 0 and blocks.match_prefix("b", [1, 2, 3, 4, 5], max_tokens=4) == 0


def test_a_second_request_with_the_same_prompt_computes_only_what_is_not_cached():
    sched = scheduler()
    shared = prompt(14, seed=3)
    sched.add("first", shared, SamplingParams(max_tokens=3), now=0.0)
    runner = FakeRunner(sched)
    first = runner.run()
    sched.add("second", shared, SamplingParams(max_tokens=3), now=1.0)
    output, events = runner.step()
    (chunk,) = output.chunks
    assert (chunk.start, chunk.num_tokens) == (12, 2)  # 3 cached blocks of 4; the last 2 prompt tokens computed
    second = [e.token_id for e in events] + runner.run()["second"]
    assert second == first["first"] == reference(shared, 3)


def test_a_preempted_sequence_recomputes_from_its_own_cached_blocks():
    sched = scheduler(num_blocks=8, max_num_seqs=2)
    sched.add("older", prompt(10, seed=1), SamplingParams(max_tokens=16), now=0.0)
    sched.add("younger", prompt(10, seed=2), SamplingParams(max_tokens=16), now=0.0)
    outputs = FakeRunner(sched).run()
    assert sched.num_preemptions > 0 and sched.blocks.num_hit_tokens > 0
    assert outputs["younger"] == reference(prompt(10, seed=2), 16)


@pytest.mark.parametrize("policy", [BatchingPolicy.STATIC, BatchingPolicy.STATIC_RETIRING])
def test_static_batches_use_the_cache_too(policy):
    sched = scheduler(policy=policy)
    shared = prompt(9, seed=4)
    sched.add("a", shared, SamplingParams(max_tokens=2), now=0.0)
    runner = FakeRunner(sched)
    runner.run()
    sched.add("b", shared, SamplingParams(max_tokens=2), now=1.0)
    output, events = runner.step()
    assert output.chunks[0].start == 8
    assert [e.token_id for e in events] + runner.run()["b"] == reference(shared, 2)
