"""Dynamic KV management end to end: optimistic admission, offload under pressure, restore; nothing lost,
nothing recomputed, outputs unchanged.

The pool is capped far below the requests' final lengths (room for ~2.5 of 16), so requests are
offloaded and restored many times; greedy outputs must stay token for token those of the unpressured
run and of plain `generate`.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from models import assert_greedy_equal, ragged_batch, tiny_model
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

import hf_sparsespec
from hf_sparsespec import SparseSpecConfig
from hf_sparsespec.batch import BatchBuilder
from hf_sparsespec.cache import HostMemoryError, HostTier, PageAllocator
from hf_sparsespec.cache.host_tier import Transfer
from hf_sparsespec.kv_manager import KVManager
from hf_sparsespec.scheduler import Phase, Request, Scheduler

NEW_TOKENS, PAGE, K = 60, 4, 4
LENGTHS = [3, 11, 7, 5, 9, 4, 10, 6, 8, 3, 11, 5, 7, 9, 4, 6]  # 16 prompts


def final_pages(prompt_len: int) -> int:
    return -(-(prompt_len + NEW_TOKENS + K + 1) // PAGE)


POOL = int(2.5 * final_pages(max(LENGTHS)))  # room for ~2.5 of the 16 requests' final lengths


def config(**kwargs) -> SparseSpecConfig:
    return SparseSpecConfig(num_draft_tokens=K, min_budget=4, page_size=PAGE, **kwargs)


def run(model, ids, mask, cfg, **kwargs):
    return model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, generation_strategy="sparsespec",
        sparsespec_config=cfg, return_dict_in_generate=True, **kwargs,
    )  # fmt: skip


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2")


@pytest.fixture(scope="module")
def batch():
    return ragged_batch(LENGTHS, seed=4)


@pytest.fixture(scope="module")
def unpressured(model, batch):
    return run(model, *batch, config(), do_sample=False)


class Recorder:
    """Which requests the KV manager offloaded (and which were running then) and restored, in order."""

    def __init__(self, monkeypatch):
        self.offloads: list[tuple[int, list[int]]] = []  # (victim, running request ids)
        self.restores: list[int] = []
        offload, finish_restore = KVManager._offload, KVManager._finish_restore
        recorder = self

        def _offload(self, request, scheduler, forced):
            running = [r.request_id for r in scheduler.active if self.residency[r.request_id].value == "running"]
            recorder.offloads.append((request.request_id, running))
            return offload(self, request, scheduler, forced)

        def _finish_restore(self, away, scheduler):
            recorder.restores.append(away.request.request_id)
            return finish_restore(self, away, scheduler)

        monkeypatch.setattr(KVManager, "_offload", _offload)
        monkeypatch.setattr(KVManager, "_finish_restore", _finish_restore)


def test_greedy_under_pressure_equals_unpressured_and_plain_generate(model, batch, unpressured, monkeypatch):
    ids, mask = batch
    assert sum(final_pages(n) for n in LENGTHS) > 6 * POOL
    recorder = Recorder(monkeypatch)
    out = run(model, ids, mask, config(num_pages=POOL), do_sample=False)
    assert out.sequences.tolist() == unpressured.sequences.tolist()  # every request, in order
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert_greedy_equal(model, expected, out.sequences, mask)
    kv = out.sparsespec_stats.kv
    assert kv.offloads >= 10 and kv.restores == kv.offloads and kv.requests_offloaded >= 8, kv
    assert kv.offloaded_bytes >= kv.restored_bytes > 0 and kv.offloaded_seconds > 0  # rollbacks while away
    assert kv.prefill_tokens == kv.prompt_tokens == sum(LENGTHS) and kv.recomputed_prefill_tokens == 0
    assert kv.peak_pages_used <= POOL == kv.num_pages
    assert "offloads" in str(out.sparsespec_stats)
    # first come, first served: the oldest running request is never the victim; restores go oldest first
    for victim, running in recorder.offloads:
        assert victim == max(running) and victim != min(running)
    assert len(recorder.restores) == kv.restores


@pytest.mark.parametrize("num_draft_tokens,chunk", [(K, 512), (0, 512), (K, 3), (8, 2)])
def test_the_free_pool_shortcut_is_taken_only_when_the_exact_demand_fits(model, batch, monkeypatch, num_draft_tokens,
                                                                         chunk):  # fmt: skip
    """`KVManager.prepare` skips summing the rows' page demand when the free pages hold `max_decode_growth`
    pages an active request plus the headroom. Every time it does, under pressure (offloads, restores,
    rollbacks of speculative drafts, prompts in chunks), the exact demand must leave the headroom free:
    then the exact path would have offloaded and restored nothing either."""
    shortcut, taken = KVManager._room_for_any_growth, []

    def checked(self, scheduler):
        room = shortcut(self, scheduler)
        if room:
            running = [r for r in scheduler.active if self.runs(r)]
            need = sum(self._growth(scheduler, r) for r in running)
            assert self.allocator.num_free_pages - need >= self.headroom(len(running)), (need, self.max_decode_growth)
            taken.append(need)
        return room

    monkeypatch.setattr(KVManager, "_room_for_any_growth", checked)
    cfg = SparseSpecConfig(num_draft_tokens=num_draft_tokens, min_budget=4, page_size=PAGE, num_pages=POOL,
                           prefill_chunk_size=chunk)  # fmt: skip
    out = run(model, *batch, cfg, do_sample=False)
    assert out.sparsespec_stats.kv.offloads > 0 and len(taken) > 10 and max(taken) > 0


class SlowEvent:
    """A copy that completes only after a few polls (a busy copy stream), or once the compute stream was
    ordered after it."""

    def __init__(self, polls: int) -> None:
        self.polls, self.ordered = polls, False

    def query(self) -> bool:
        self.polls -= 1
        return self.polls < 0

    def synchronize(self) -> None:
        self.polls = -1

    @property
    def safe(self) -> bool:
        return self.polls < 0 or self.ordered


@pytest.mark.parametrize("synchronous", [False, True], ids=["overlapped", "tensor-parallel"])
def test_slow_copies_keep_pages_in_transit_until_ordered(model, batch, unpressured, monkeypatch, synchronous):
    """The CUDA protocol on CPU: copies finish late, so requests sit OFFLOADING/RESTORING across
    iterations. No page an offload reads goes back to the free list, and no restored request runs, before
    its copy is done or the compute stream is ordered after it; outputs stay exact. Under tensor
    parallelism (`synchronous`) no decision waits on a copy's progress: nothing is left in flight."""
    rng = random.Random(0)
    offload_of: dict[int, Transfer] = {}  # id(pages list) -> the offload that reads them
    restore_of: dict[int, Transfer] = {}  # page -> the last restore that wrote it
    seen = Counter()
    original_offload, original_restore = HostTier.offload, HostTier.restore
    original_release, original_build = PageAllocator.release, BatchBuilder.build

    def record(self, num_bytes):
        return Transfer(SlowEvent(rng.randint(0, 4)), num_bytes)

    def order_before_compute(self):
        if self.event is not None:
            self.event.ordered = True

    def offload(self, pages, length):
        host = original_offload(self, pages, length)
        offload_of[id(pages)] = host.offload
        return host

    def restore(self, host, pages):
        transfer = original_restore(self, host, pages)
        restore_of.update(dict.fromkeys(pages, transfer))
        return transfer

    def release(self, pages):
        if pages:
            seen["in transit" if offload_of[id(pages)].event.polls >= 0 else "done"] += 1
            assert offload_of[id(pages)].event.safe, "pages reused before the copy reading them was ordered"
        return original_release(self, pages)

    def build(self, rows, allocator, bucket=None):
        for row in rows:
            for page in allocator.page_table(row.request.request_id):
                assert page not in restore_of or restore_of[page].event.safe, "ran before its restore"
        return original_build(self, rows, allocator, bucket)

    original_prepare = KVManager.prepare

    def prepare(self, scheduler):
        self.synchronous = synchronous
        original_prepare(self, scheduler)
        assert not (synchronous and self.busy), "a copy left in flight: processes could decide differently"

    monkeypatch.setattr(KVManager, "prepare", prepare)
    monkeypatch.setattr(HostTier, "_record", record)
    monkeypatch.setattr(Transfer, "order_before_compute", order_before_compute)
    monkeypatch.setattr(HostTier, "offload", offload)
    monkeypatch.setattr(HostTier, "restore", restore)
    monkeypatch.setattr(PageAllocator, "release", release)
    monkeypatch.setattr(BatchBuilder, "build", build)
    ids, mask = batch
    out = run(model, ids, mask, config(num_pages=POOL), do_sample=False)
    assert out.sequences.tolist() == unpressured.sequences.tolist()
    kv = out.sparsespec_stats.kv
    assert kv.restores == kv.offloads > 0 and kv.recomputed_prefill_tokens == 0
    assert seen["in transit"] > 0, seen  # releases ordered after copies still running
    assert (seen["done"] == 0) if synchronous else (seen["done"] > 0), seen  # and after copies done, unless TP


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed-k", "adaptive-k"])
def test_sampled_under_pressure_equals_unpressured(model, batch, adaptive):
    """Same seed, same samples: each draw's noise is keyed by (request, position, purpose) and a request's
    cycles (adaptive lengths too) do not depend on when it runs (`sampling.sample_keys`, `Scheduler._join`)."""
    ids, mask = batch
    kwargs = dict(do_sample=True, temperature=0.8, top_k=30, top_p=0.95)
    outputs = []
    for extra in ({}, dict(num_pages=POOL), dict(num_pages=POOL, kv_policy="reserve")):
        cfg = config(adaptive_draft_tokens=adaptive, **extra)
        torch.manual_seed(11)
        outputs.append(run(model, ids, mask, cfg, **kwargs))
    free, pressured, reserved = outputs
    assert pressured.sparsespec_stats.kv.offloads > 0
    assert pressured.sequences.tolist() == free.sequences.tolist() == reserved.sequences.tolist()
    for a, b in zip(free.sparsespec_stats.per_request, pressured.sparsespec_stats.per_request):
        assert a.cycle_accepted == b.cycle_accepted  # the same drafts were accepted, cycle by cycle
        assert a.cycle_drafted == b.cycle_drafted


def test_unpressured_run_never_offloads(unpressured):
    kv = unpressured.sparsespec_stats.kv
    assert kv.offloads == 0 and kv.policy == "dynamic" and kv.recomputed_prefill_tokens == 0


@pytest.mark.parametrize("num_draft_tokens", [0, K])
def test_a_pool_sized_from_the_requests_never_offloads(model, batch, num_draft_tokens):
    # the pool sized itself to the requests' final lengths (no num_pages): the dynamic policy's headroom
    # is part of it, so requests that all grow to their forced lengths together never move to the host
    # (on the H200 an exactly-sized pool offloaded 2 requests of an autoregressive run near its end)
    cfg = SparseSpecConfig(num_draft_tokens=num_draft_tokens, min_budget=4, page_size=PAGE)
    out = run(model, *batch, cfg, do_sample=False, min_new_tokens=NEW_TOKENS)
    kv = out.sparsespec_stats.kv
    assert out.sequences.shape[1] == batch[0].shape[1] + NEW_TOKENS
    assert kv.policy == "dynamic" and kv.offloads == 0, kv


def test_reserve_policy_admits_by_worst_case_and_matches(model, batch, unpressured, monkeypatch):
    """The baseline policy: same outputs, never offloads, and no more requests at once than worst cases fit."""
    ids, mask = batch
    admitted_at_once = []
    original = Scheduler.schedule

    def schedule(self):
        rows = original(self)
        admitted_at_once.append(len(self.active))
        return rows

    monkeypatch.setattr(Scheduler, "schedule", schedule)
    out = run(model, ids, mask, config(num_pages=POOL, kv_policy="reserve"), do_sample=False)
    assert out.sequences.tolist() == unpressured.sequences.tolist()
    kv = out.sparsespec_stats.kv
    assert kv.policy == "reserve" and kv.offloads == 0 and kv.recomputed_prefill_tokens == 0
    worst_case = sorted(final_pages(n) for n in LENGTHS)
    assert max(admitted_at_once) <= max(i for i in range(17) if sum(worst_case[:i]) <= POOL)


class StopOnToken(StoppingCriteria):
    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_eos_and_stop_criteria_under_pressure(model, batch):
    """Requests end early (eos, a batch-wide stopping criterion) while others are on the host, and the
    criteria's frontier waits for offloaded requests."""
    ids, mask = batch
    free_run = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    eos, stop = free_run[5, ids.shape[1] + 20].item(), free_run[9, ids.shape[1] + 30].item()
    kwargs = dict(do_sample=False, eos_token_id=eos)
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, **kwargs,
                              stopping_criteria=StoppingCriteriaList([StopOnToken(stop)]))  # fmt: skip
    out = run(model, ids, mask, config(num_pages=POOL), **kwargs, stopping_criteria=StoppingCriteriaList([StopOnToken(stop)]))
    assert_greedy_equal(model, expected, out.sequences, mask)
    assert out.sequences.shape == expected.shape
    assert out.sparsespec_stats.kv.offloads > 0


def test_a_request_that_cannot_fit_alone_is_refused_before_work(model):
    with pytest.raises(ValueError, match=r"request 0 needs 18 KV pages \(4 prompt \+ 60 new tokens\), the pool has 17"):
        run(model, torch.tensor([[5, 6, 7, 8]]), None, config(num_pages=17), do_sample=False)


@pytest.mark.parametrize("new_tokens", [1, 8])
def test_a_long_prompt_with_few_new_tokens_is_admitted_into_a_pool_sized_for_it(model, new_tokens):
    # the default pool holds the request's final length + one block; admission used to ask one more block
    # of headroom on top, so a prompt that fills most of its pages was never admitted (nothing ran)
    ids = torch.randint(3, model.config.vocab_size, (1, 45), generator=torch.Generator().manual_seed(0))
    plain = model.generate(input_ids=ids, max_new_tokens=new_tokens, do_sample=False)
    for cfg in (SparseSpecConfig(), SparseSpecConfig(num_draft_tokens=0)):
        out = model.generate(input_ids=ids, max_new_tokens=new_tokens, do_sample=False,
                             generation_strategy="sparsespec", sparsespec_config=cfg)  # fmt: skip
        assert torch.equal(out, plain)


def test_a_full_host_pool_is_a_clear_error(model, batch):
    ids, mask = batch
    with pytest.raises(HostMemoryError, match=r"must be offloaded .* the host pool \(0.00 GiB\) is full"):
        run(model, ids, mask, config(num_pages=POOL, host_pool_bytes=0), do_sample=False)


def test_generate_batch_under_pressure_returns_every_request_in_order(model):
    prompts = [[7, i + 1, 3] for i in range(10)]
    gc = GenerationConfig(max_new_tokens=40, do_sample=False, eos_token_id=None)
    free = hf_sparsespec.generate_batch(model, prompts, gc, config())
    tight = hf_sparsespec.generate_batch(model, prompts, gc, config(num_pages=30))
    assert [r.prompt_ids for r in tight] == prompts
    assert [r.generated_ids for r in tight] == [r.generated_ids for r in free]
    assert all(r.finish_reason == "length" and len(r.generated_ids) == 40 for r in tight)


def scheduler_with_loads(policy: str) -> Scheduler:
    """k = 4: a cycle of 4 drafts + verify = 5 iterations; verifications per residue mod 5."""
    scheduler = Scheduler(SparseSpecConfig(num_draft_tokens=4, scheduler=policy), PageAllocator(8, 16), num_slots=4)
    assert scheduler.cycle_length == 5
    scheduler.iteration = 20
    scheduler.verify_residues.update({0: 5, 1: 1, 2: 4, 3: 2, 4: 3})
    return scheduler


@pytest.mark.parametrize("policy", ["unified", "naive"])
def test_requests_join_the_least_loaded_bucket_by_waiting(policy):
    """A restored request keeps its cycle (3 drafts to go) and a new one drafts a full first cycle: only
    when they start moves, so that their verification lands in the emptiest bucket (the fullest, naive)."""
    scheduler = scheduler_with_loads(policy)
    restored = Request(0, [1, 2], 50, phase=Phase.DRAFT, cycle_drafts=4, drafts_done=1)
    scheduler.resume(restored)
    # verification 3 iterations after the start: residue 1 (load 1) from iteration 23; naive: residue 0 from 22
    assert restored.start_iteration == (23 if policy == "unified" else 22)
    assert restored.verify_iteration == restored.start_iteration + 3
    assert (restored.cycle_drafts, restored.drafts_done) == (4, 1)
    scheduler = scheduler_with_loads(policy)
    fresh = Request(1, [1, 2], 50, phase=Phase.PREFILL, num_committed=3)
    scheduler.start_cycle(fresh, 23, first=True)
    assert (fresh.phase, fresh.cycle_drafts, fresh.drafts_done) == (Phase.DRAFT, 4, 0)
    # verification 4 iterations after the start: residue 1 from iteration 27; naive: residue 0 from 26
    assert fresh.start_iteration == (27 if policy == "unified" else 26)
    assert fresh.verify_iteration == fresh.start_iteration + 4
    assert scheduler.verify_residues[1 if policy == "unified" else 0] == (2 if policy == "unified" else 6)


def test_a_new_pool_counts_the_memory_the_caching_allocator_holds_unused(monkeypatch):
    # a previous generate's pool, freed, stays reserved by PyTorch's caching allocator: mem_get_info does
    # not count it as free, but the next pool may take it (a second generate in a notebook would
    # otherwise size a smaller pool and offload)
    from hf_sparsespec.engine import free_device_memory

    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (40 * gib, 140 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 96 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 3 * gib)
    assert free_device_memory(torch.device("cuda")) == (40 + 96 - 3) * gib
