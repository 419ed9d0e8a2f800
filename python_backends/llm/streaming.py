"""When the engine loop sends a stream's new tokens: at once while the engine has room to
spare, held for a few steps and sent together while requests wait for it. Pure.

Every response is a round trip to the Triton process: on 2 vCPU about 0.28 ms, plus
0.075 ms to build it, and the server and the client spend their own CPU on it too. A step
with 96 streams sends 96 of them, a tenth of the loop's time taken from the forward pass,
which needs both cores. That matters only while requests wait for a batch slot or KV
blocks: then each millisecond spent sending delays the next ones' first tokens. So while
requests wait, a stream's tokens are held and sent in one response, at most `hold_s` after
the oldest of them was made (gen-config sets it to the spec's TPOT target: a client waits no
longer for a held token than the time per token it was promised).

The first token and the last are never held (time to first token, the end of the answer),
so the mean time per output token a client measures is what it was; no token is held while
nothing waits, so a lightly loaded server streams every token as it is made.
"""

from __future__ import annotations


def send_now(*, finished: bool, num_output_tokens: int, held_since_s: float | None, now_s: float,
             next_step_s: float, hold_s: float, requests_waiting: bool) -> bool:
    """Whether a stream's tokens go out after this step instead of waiting for a later one.

    `num_output_tokens`: the stream's tokens so far; `held_since_s`: when its oldest held
    token was made, None when all it holds is this step's; `next_step_s`: how long the next
    step is expected to take (the last one's time)."""
    if finished or num_output_tokens <= 1 or not requests_waiting or hold_s <= 0:
        return True
    oldest_s = now_s if held_since_s is None else held_since_s
    return now_s - oldest_s + next_step_s > hold_s
