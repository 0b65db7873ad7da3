import numpy as np
import pytest

from openinfer.errors import InvalidRequestError, QueueFullError
from openinfer.kv import BlockPool, KVCacheManager
from openinfer.sampling import SamplingState
from openinfer.sched import Request, Scheduler
from openinfer.v1 import engine_pb2 as pb


def make(request_id: str, num_prompt: int, max_tokens: int = 4) -> Request:
    prompt = list(range(1, num_prompt + 1))
    return Request(request_id=request_id, token_ids=list(prompt), num_prompt_tokens=num_prompt,
                   stop=pb.StopConditions(max_tokens=max_tokens), max_tokens=max_tokens,
                   sampling=SamplingState(pb.SamplingParams(), np.random.default_rng(0), np.asarray(prompt)))


def scheduler(num_blocks=9, block_size=4, budget=8, max_num_seqs=8, max_queue=16, max_model_len=64):
    pool = BlockPool(num_blocks, block_size)
    return Scheduler(KVCacheManager(pool), max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                     max_model_len=max_model_len, max_queue=max_queue)


def advance(sched: Scheduler, plan) -> None:
    """What the engine does after a step: mark tokens computed, append a sampled token."""
    for chunk in plan.chunks:
        chunk.request.num_computed_tokens += chunk.num_tokens
    for chunk in plan.chunks:
        if chunk.request.num_computed_tokens == chunk.request.num_tokens:
            chunk.request.token_ids.append(0)


def test_long_prompt_is_chunked_under_the_token_budget_and_decodes_keep_running():
    sched = scheduler(budget=8)
    short, long = make("short", 3), make("long", 20)
    sched.add(short)
    plan = sched.schedule()
    assert [(c.request.request_id, c.num_tokens) for c in plan.chunks] == [("short", 3)]
    advance(sched, plan)
    sched.add(long)
    plan = sched.schedule()
    # the decoding request comes first (1 token), the long prompt gets the rest of the budget
    assert [(c.request.request_id, c.num_tokens) for c in plan.chunks] == [("short", 1), ("long", 7)]
    assert not plan.chunks[1].samples
    advance(sched, plan)
    plan = sched.schedule()
    assert [(c.request.request_id, c.num_tokens) for c in plan.chunks] == [("short", 1), ("long", 7)]


def test_newest_running_request_is_preempted_when_kv_runs_out():
    sched = scheduler(num_blocks=5, block_size=4, budget=64)  # 4 usable blocks = 16 slots
    first, second = make("first", 8), make("second", 7)
    sched.add(first)
    sched.add(second)
    plan = sched.schedule()
    assert [c.request.request_id for c in plan.chunks] == ["first", "second"]
    advance(sched, plan)  # first holds 9 tokens (3 blocks needed next), second 8 (2 blocks)
    plan = sched.schedule()
    assert [r.request_id for r in plan.preempted] == ["second"]
    assert [c.request.request_id for c in plan.chunks] == ["first"]
    assert second.num_computed_tokens == 0 and sched.waiting[0] is second
    assert second.request_id not in sched.kv.requests


def test_requests_that_can_never_fit_are_rejected_at_once():
    sched = scheduler(num_blocks=5, block_size=4, max_model_len=64)
    with pytest.raises(InvalidRequestError, match="exceeds the model's context"):
        sched.check_fits(60, 10)
    with pytest.raises(InvalidRequestError, match="KV blocks"):
        sched.check_fits(10, 20)  # 30 tokens > 16 slots in the pool


def test_bounded_queue():
    sched = scheduler(max_queue=2)
    sched.add(make("a", 2))
    sched.add(make("b", 2))
    with pytest.raises(QueueFullError):
        sched.add(make("c", 2))


def test_max_num_seqs_limits_admission():
    sched = scheduler(max_num_seqs=2, budget=64, num_blocks=20)
    for name in "abc":
        sched.add(make(name, 2))
    plan = sched.schedule()
    assert [c.request.request_id for c in plan.chunks] == ["a", "b"]
    assert [r.request_id for r in sched.waiting] == ["c"]


def test_a_request_waiting_for_blocks_hashes_its_prompt_once(monkeypatch):
    from openinfer.kv import block_pool

    hashed: list[int] = []
    chain = block_pool.chain_block_hashes
    monkeypatch.setattr(block_pool, "chain_block_hashes",
                        lambda parent, data, bs, key="": hashed.append(len(data) // (block_pool.TOKEN_WIDTH * bs)) or chain(parent, data, bs, key))
    monkeypatch.setattr(block_pool, "_CHAINS", block_pool._ChainMemo(256))  # no chain from an earlier test
    sched = scheduler(num_blocks=9, block_size=4, budget=64)
    first, second = make("first", 17), make("second", 17)
    sched.add(first)
    sched.add(second)
    assert [c.request.request_id for c in sched.schedule().chunks] == ["first"]  # 5 of 8 blocks
    for _ in range(3):  # no room for "second": looked up and refused every step
        assert [c.request.request_id for c in sched.schedule().chunks] == ["first"]
    assert second.prefix_hashes is not None and len(second.prefix_hashes.hashes) == 4
    # the first prompt's 4 full blocks, once; the second (the same tokens) takes the first's chain
    assert hashed == [4]


def split_scheduler(**kwargs) -> Scheduler:
    sched = scheduler(**kwargs)
    return Scheduler(sched.kv, max_num_seqs=sched.max_num_seqs, max_num_batched_tokens=sched.max_num_batched_tokens,
                     max_model_len=sched.max_model_len, max_queue=sched.max_queue, policy="split")


def test_split_policy_alternates_decode_only_and_prompt_only_steps():
    sched = split_scheduler(num_blocks=20, budget=8)
    short, long = make("short", 3, max_tokens=8), make("long", 20)
    sched.add(short)
    plan = sched.schedule()  # one kind of work only: as the mixed policy
    assert [(c.request.request_id, c.num_tokens) for c in plan.chunks] == [("short", 3)]
    advance(sched, plan)
    sched.add(long)
    kinds = []
    for _ in range(4):
        plan = sched.schedule()
        kinds.append([(c.request.request_id, c.num_tokens) for c in plan.chunks])
        advance(sched, plan)
    # decodes alone, then the prompt alone under the whole budget, and so on
    assert kinds == [[("short", 1)], [("long", 8)], [("short", 1)], [("long", 8)]]
    plan = sched.schedule()
    assert [(c.request.request_id, c.num_tokens) for c in plan.chunks] == [("short", 1)]
    advance(sched, plan)
    plan = sched.schedule()  # the prompt's last chunk; its sampled token makes it a decode too
    assert [(c.request.request_id, c.num_tokens) for c in plan.chunks] == [("long", 4)]
    advance(sched, plan)
    plan = sched.schedule()  # only decodes left: both in one step
    assert [(c.request.request_id, c.num_tokens) for c in plan.chunks] == [("short", 1), ("long", 1)]


def test_split_policy_falls_back_to_the_other_kind_when_its_turn_has_nothing_to_run():
    sched = split_scheduler(num_blocks=20, budget=8)
    done, long = make("done", 2, max_tokens=1), make("long", 12)
    sched.add(done)
    advance(sched, sched.schedule())  # "done" sampled its only token: it waits to be read back
    sched.add(long)
    assert done.reached_limit
    plan = sched.schedule()  # decode turn, but the only decode is finishing: the prompt runs
    assert [(c.request.request_id, c.num_tokens) for c in plan.chunks] == [("long", 8)]


def test_unknown_scheduler_policy_is_refused(monkeypatch):
    sched = scheduler()
    with pytest.raises(InvalidRequestError, match="scheduler policy"):
        Scheduler(sched.kv, max_num_seqs=8, max_num_batched_tokens=8, max_model_len=64, max_queue=16,
                  policy="fastest")
    # the policy comes from the engine's options alone: the environment variable of old is ignored
    monkeypatch.setenv("OPENINFER_SCHEDULER_POLICY", "split")
    assert scheduler().policy == "mixed"


def prefill_first_scheduler(**kwargs) -> Scheduler:
    sched = scheduler(**kwargs)
    return Scheduler(sched.kv, max_num_seqs=sched.max_num_seqs, max_num_batched_tokens=sched.max_num_batched_tokens,
                     max_model_len=sched.max_model_len, max_queue=sched.max_queue, policy="prefill_first")


def test_prefill_first_gives_prompts_the_budget_and_decodes_what_they_leave():
    sched = prefill_first_scheduler(num_blocks=20, budget=8)
    a, b = make("a", 3, max_tokens=8), make("b", 2, max_tokens=8)
    sched.add(a)
    sched.add(b)
    advance(sched, sched.schedule())  # both prompts in one step; both decode now
    sched.add(make("long", 20))
    plan = sched.schedule()  # the prompt fills the step: the decodes wait
    assert [(c.request.request_id, c.num_tokens) for c in plan.chunks] == [("long", 8)]
    advance(sched, plan)
    advance(sched, sched.schedule())
    sched.add(make("short", 3))
    plan = sched.schedule()  # 4 + 3 prompt tokens leave 1: the oldest decode takes it, ahead of the chunks
    assert [(c.request.request_id, c.num_tokens) for c in plan.chunks] == [("a", 1), ("long", 4), ("short", 3)]
    assert plan.chunks[0].samples and plan.chunks[1].samples and plan.chunks[2].samples
    advance(sched, plan)
    plan = sched.schedule()  # no prompt left: every decode
    assert [(c.request.request_id, c.num_tokens) for c in plan.chunks] == [("a", 1), ("b", 1), ("long", 1),
                                                                          ("short", 1)]


def test_prefill_first_decodes_filling_a_prompt_step_never_preempt():
    # 6 usable blocks of 4 slots; "a" holds 8 computed tokens (2 blocks) and needs a third for its next
    sched = prefill_first_scheduler(num_blocks=7, block_size=4, budget=16)
    a = make("a", 8, max_tokens=8)
    sched.add(a)
    advance(sched, sched.schedule())
    assert a.num_tokens == 9 and a.num_uncomputed_tokens == 1
    sched.add(make("p", 14))  # 4 blocks: the pool is full, "a" cannot grow
    plan = sched.schedule()
    assert [(c.request.request_id, c.num_tokens) for c in plan.chunks] == [("p", 14)]
    assert not plan.preempted and a in sched.running
    advance(sched, plan)
    plan = sched.schedule()  # no prompt left: the decodes alone, preempting the newest ("p") for "a"
    assert [r.request_id for r in plan.preempted] == ["p"]
    assert [(c.request.request_id, c.num_tokens) for c in plan.chunks] == [("a", 1)]
