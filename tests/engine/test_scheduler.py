"""The scheduler as the one owner of request state, in process and without a model: local requests, the decode
side's remote requests (reserve, admit, fail, lease expiry, quarantine) and the prefill side's exports."""

from __future__ import annotations

import time

import pytest

from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.messages import ExportParams, ImportParams, KVDestination, KVRankDest
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler import Scheduler
from pdserve.sampling_params import SamplingParams

BS = 4


def make(num_blocks: int = 16, lease_s: float = 30.0, max_num_seqs: int = 8) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, BS), max_num_seqs, 64, 256, lease_s)


def req(rid: str, n: int = 10, max_tokens: int = 4, kv=None, first: int = 100) -> Request:
    r = Request(rid, list(range(first, first + n)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    r.kv = kv
    return r


def run_step(s: Scheduler, token: int = 7) -> list:
    """One step with a fake model: every request that reached the end of its tokens samples `token`."""
    batch = s.schedule()
    sampled = [r for r, n in zip(batch.requests, batch.num_new_tokens) if r.num_computed_tokens + n == r.num_tokens]
    outs, exports = s.update(batch, sampled, [token] * len(sampled), [None] * len(sampled), time.time())
    return outs + exports


def whole(s: Scheduler) -> None:
    assert not s.requests and not s.kv.quarantine
    s.kv.pool.check_whole()


IMPORT = ImportParams(("http://p",), "rt-1")


def test_local_request_runs_and_frees_everything():
    s = make()
    s.add(req("a", n=10, max_tokens=3))
    outs = [o for _ in range(5) for o in run_step(s)]
    assert [o.new_token_ids for o in outs] == [[7], [7], [7]] and outs[-1].finished
    assert outs[-1].finish_reason == "length"
    whole(s)


def test_remote_request_reserve_admit_decode():
    s = make()
    r = req("d", n=10, max_tokens=3, kv=IMPORT)
    s.add_remote(r)
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KV and not s.has_work()
    reserved, failed = s.reserve_remote(time.time())
    assert reserved == [r] and not failed and len(r.block_ids) == 3 and r.kv_deadline is not None
    assert s.admit_remote("unknown", 1, time.time()) is None
    assert s.admit_remote("d", 42, time.time()) is r
    assert r.status == RequestStatus.ADMITTED and r.num_computed_tokens == 10 and r.output_token_ids == [42]
    batch = s.schedule()
    assert batch.requests == [r] and batch.num_new_tokens == [1]  # decodes from the first token on
    outs, _ = s.update(batch, [r], [9], [None], time.time())
    assert outs[0].new_token_ids == [9] and not outs[0].finished
    run_step(s)
    assert r.is_finished and r.output_token_ids == [42, 9, 7]
    whole(s)


def test_remote_reservation_uses_the_decode_sides_prefix_cache():
    s = make()
    s.add(req("warm", n=12, max_tokens=1))
    run_step(s)
    whole(s)  # its two full blocks stay cached (free, with hashes)
    r = req("d", n=12, max_tokens=2, kv=IMPORT)
    s.add_remote(r)
    (got,), _ = s.reserve_remote(time.time())
    assert got.num_cached_tokens == 8  # two full blocks; the last block always travels (its logits matter)
    s.abort("d")
    s.kv.release_quarantine("d")  # the peer never wrote: released by hand here, by its answer in real life
    whole(s)


def test_reservations_wait_for_blocks_in_arrival_order():
    s = make(num_blocks=4)
    big = req("big", n=12, kv=IMPORT)
    small = req("small", n=4, kv=IMPORT, first=300)
    s.add(req("local", n=8, max_tokens=8, first=500))
    run_step(s)  # holds 2 of the 4 blocks
    s.add_remote(big)
    s.add_remote(small)
    reserved, _ = s.reserve_remote(time.time())
    assert reserved == []  # big needs 3 blocks, 1 free; small waits behind it (FIFO)
    s.abort("local")
    reserved, _ = s.reserve_remote(time.time())
    assert reserved == [big, small]  # 3 + 1 blocks
    for rid in ("big", "small"):
        s.abort(rid)
        assert s.kv.release_quarantine(rid)
    whole(s)


def test_a_prompt_that_can_never_fit_fails_at_reservation():
    s = make(num_blocks=2)
    s.add_remote(req("huge", n=20, kv=IMPORT))
    reserved, failed = s.reserve_remote(time.time())
    assert not reserved and failed[0].finish_reason == "error" and "more KV blocks" in failed[0].stop_reason
    whole(s)


@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("peer_done", [True, False])
def test_failed_handover_recomputes_or_fails_and_quarantines_what_a_peer_may_write(recompute, peer_done):
    s = make(lease_s=30.0)
    r = req("d", n=10, max_tokens=2, kv=IMPORT)
    s.add_remote(r)
    s.reserve_remote(time.time())
    held = list(r.block_ids)
    assert s.fail_remote("d", recompute, peer_done, "boom") is r
    assert bool(s.kv.quarantine) is (not peer_done)
    if not peer_done:
        assert s.kv.quarantine["d"].block_ids == held
    if recompute:
        assert r.status == RequestStatus.WAITING and r.kv is None
        outs = [o for _ in range(4) for o in run_step(s)]
        assert outs[-1].finished and r.output_token_ids == [7, 7]
    else:
        assert r.is_finished and r.finish_reason == "error" and r.stop_reason == "boom"
    assert s.fail_remote("d", recompute, peer_done, "again") is None  # no longer remote
    s.kv.expire_quarantine(time.time() + 31)
    whole(s)


def test_reservation_lease_expires_and_quarantine_ends_at_its_deadline():
    s = make(lease_s=0.05)
    r = req("d", kv=IMPORT)
    s.add_remote(r)
    t0 = time.time()
    s.reserve_remote(t0)
    assert s.expired_reservations(t0) == []
    assert s.expired_reservations(t0 + 0.1) == ["d"]
    s.fail_remote("d", True, False, "lease")
    assert s.kv.num_quarantined_blocks == 3
    assert s.kv.expire_quarantine(time.time()) == 0
    assert s.kv.expire_quarantine(time.time() + 1) == 1
    s.abort("d")
    whole(s)


def test_abort_of_each_remote_state():
    s = make()
    pending = req("p", n=52, kv=IMPORT)  # 13 blocks: more than the 12 left
    reserved = req("r", n=8, kv=IMPORT, first=200)
    admitted = req("a", n=8, kv=IMPORT, first=300)
    s.add_remote(admitted)
    s.reserve_remote(time.time())
    s.admit_remote("a", 5, time.time())
    s.add_remote(reserved)
    s.add_remote(pending)
    got, _ = s.reserve_remote(time.time())
    assert got == [reserved] and pending.t_reserved is None
    for rid in ("p", "r", "a"):
        assert s.abort(rid) is not None
    assert list(s.kv.quarantine) == ["r"]  # only the reserved one may still be written by a peer
    s.kv.release_quarantine("r")
    whole(s)


def test_export_holds_blocks_until_the_push_ends_and_an_abort_waits_for_it():
    s = make()
    dest = KVDestination("d-1", (0, 1, 2), (KVRankDest("host:1", 0, 2),))
    r = req("x", n=10, max_tokens=1, kv=ExportParams(dest))
    s.add(r)
    started = run_step(s)
    assert len(started) == 1 and started[0].req is r and started[0].first_token == 7
    assert r.status == RequestStatus.EXPORTING and not s.running and len(r.block_ids) == 3
    assert s.abort("x") is r and r.export_aborted and r.block_ids  # blocks stay while the copy may read them
    assert s.expired_exports(time.time() + 31) == ["x"]
    assert s.end_export("x") is r and r.finish_reason == "abort"
    assert s.end_export("x") is None
    whole(s)


def test_preempted_admitted_request_is_recomputed_locally():
    s = make(num_blocks=5, max_num_seqs=4)
    r = req("d", n=8, max_tokens=10, kv=IMPORT)
    s.add_remote(r)
    s.reserve_remote(time.time())
    s.admit_remote("d", 11, time.time())
    s.add(req("l", n=8, max_tokens=10, first=500))
    for _ in range(30):
        run_step(s)
    assert r.is_finished and r.output_token_ids[0] == 11 and len(r.output_token_ids) == 10
    assert s.num_preemptions > 0
    whole(s)


def test_identical_prompts_share_one_prefill():
    s = make(num_blocks=32)
    sibs = [req(f"n{i}", n=22, max_tokens=3) for i in range(4)]  # n > 1: four choices of one prompt
    for r in sibs:
        s.add(r)
    batch = s.schedule()
    assert batch.requests == [sibs[0]]  # the others wait for its prompt's blocks
    s.update(batch, [sibs[0]], [7], [None], time.time())
    batch = s.schedule()
    assert sibs[0] in batch.requests and all(r in batch.requests for r in sibs[1:])
    assert [r.num_cached_tokens for r in sibs] == [0, 20, 20, 20]  # 5 full blocks each from the cache
    assert all(r.block_ids[:5] == sibs[0].block_ids[:5] for r in sibs)  # shared, not copied
    assert len({r.block_ids[5] for r in sibs}) == 4  # each its own last block (copy on write by recompute)
    for _ in range(6):
        run_step(s)
    assert all(r.is_finished and len(r.output_token_ids) == 3 for r in sibs)
    whole(s)


def test_sharing_waits_only_for_identical_prompts_and_survives_preemption_of_the_leader():
    s = make(num_blocks=12, max_num_seqs=8)
    lead, other, sib = req("a", n=22, max_tokens=30), req("b", n=6, first=900), req("c", n=22, max_tokens=30)
    for r in (lead, sib, other):
        s.add(r)
    batch = s.schedule()
    assert batch.requests == [lead, other]  # the sibling waits; a different prompt behind it does not
    for _ in range(60):
        run_step(s)
    assert lead.is_finished and sib.is_finished and other.is_finished
    whole(s)


def test_an_export_with_blocks_pushed_ahead_is_abandoned_not_preempted_or_freed():
    """Prefill side: once a request's blocks were pushed ahead of its last chunk, neither an abort nor a preemption
    frees them (a write may still read them): its export ends as an aborted one, blocks held until `end_export`."""
    dest = KVDestination("r", tuple(range(6)), (KVRankDest("peer", 0, 2),))
    # an abort
    s = make(num_blocks=16)
    r = req("x", n=22, max_tokens=1, kv=ExportParams(dest))
    s.add(r)
    s.max_num_batched_tokens = 8
    s.launched(s.schedule(), [])  # the first chunk: 8 tokens, two full blocks
    s.pushed_ahead(r, 2)
    blocks = list(r.block_ids)
    assert s.abort("x") is r and r.status == RequestStatus.EXPORTING and r.export_aborted and r.block_ids == blocks
    assert s.take_abandoned() == ["x"] and s.take_abandoned() == []
    assert s.end_export("x") is r and r.finish_reason == "abort"
    whole(s)
    # a preemption: the newer request, mid-prefill with blocks pushed ahead, is the victim
    s = make(num_blocks=6)
    s.max_num_batched_tokens = 8
    old = req("old", n=8, max_tokens=20, first=500)
    s.add(old)
    run_step(s)  # old: prefilled (2 blocks), decoding
    r = req("x", n=22, max_tokens=1, kv=ExportParams(dest))
    s.add(r)
    batch = s.schedule()
    assert r in batch.requests
    s.launched(batch, [old])
    s.collected([old], [7], [None], time.time())
    s.pushed_ahead(r, 1)
    for _ in range(12):  # old needs a block the pool no longer has: r would be preempted
        run_step(s)
        if s.exporting:
            break
    assert r.status == RequestStatus.EXPORTING and r.export_aborted and r.block_ids
    assert s.take_abandoned() == ["x"] and s.num_preemptions == 0
    s.end_export("x")
    while s.requests:
        run_step(s)
    whole(s)


def steps_of(s: Scheduler, k: int) -> list[dict[str, int]]:
    """k steps with the fake model: each step's new tokens by request id."""
    out = []
    for _ in range(k):
        batch = s.schedule()
        out.append({r.request_id: n for r, n in zip(batch.requests, batch.num_new_tokens)})
        sampled = [r for r, n in zip(batch.requests, batch.num_new_tokens) if r.num_computed_tokens + n == r.num_tokens]
        s.update(batch, sampled, [7] * len(sampled), [None] * len(sampled), time.time())
    return out


def capped(cap: int) -> Scheduler:
    return Scheduler(KVCacheManager(64, BS), 8, 64, 256, 30.0, max_long_prefill_tokens=cap)


def test_a_long_prompt_beside_decoding_requests_comes_in_chunks_of_the_cap():
    s = capped(8)
    s.add(req("dec", n=4, max_tokens=50))
    assert steps_of(s, 1) == [{"dec": 4}]  # its prompt, then it decodes
    s.add(req("long", n=40, max_tokens=2, first=300))
    steps = steps_of(s, 6)
    assert steps[:5] == [{"dec": 1, "long": 8}] * 5  # 40 prompt tokens, 8 a step: the decode steps stay short
    assert steps[5] == {"dec": 1, "long": 1}  # then it decodes too


def test_a_long_prompt_alone_takes_the_whole_budget_and_no_cap_is_the_old_rule():
    s = capped(8)
    s.add(req("long", n=100, max_tokens=2))
    assert [st["long"] for st in steps_of(s, 2)] == [64, 36]  # nothing decodes: chunks of the budget
    s = capped(0)
    s.add(req("dec", n=4, max_tokens=50))
    steps_of(s, 1)
    s.add(req("long", n=100, max_tokens=2, first=300))
    assert steps_of(s, 2) == [{"dec": 1, "long": 63}, {"dec": 1, "long": 37}]


def test_short_prompts_are_not_held_back_and_long_ones_share_the_cap():
    s = capped(8)
    s.add(req("dec", n=4, max_tokens=50))
    steps_of(s, 1)
    for rid, n, first in (("short1", 8, 300), ("long1", 20, 400), ("long2", 20, 500), ("short2", 6, 600)):
        s.add(req(rid, n=n, max_tokens=2, first=first))
    first, second = steps_of(s, 2)
    # short1 (8 left: not long) whole; long1 takes the step's 8 tokens of long prompts; long2 waits at the head of
    # the queue (FCFS), so short2 behind it waits too
    assert first == {"dec": 1, "short1": 8, "long1": 8}
    assert second == {"dec": 1, "short1": 1, "long1": 8}
    assert s.waiting and s.waiting[0].request_id == "long2"
    (third,) = steps_of(s, 1)
    # short1 ended (2 tokens); long1's last 4 are not long, so long2 starts with the share and short2 behind it
    assert third == {"dec": 1, "long1": 4, "long2": 8, "short2": 6}


def test_the_cap_must_not_be_negative():
    from pdserve.config import EngineConfig

    with pytest.raises(ValueError, match="max_long_prefill_tokens"):
        EngineConfig(max_long_prefill_tokens=-1)
