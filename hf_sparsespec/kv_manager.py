"""KVManager: which requests hold device pages, and when whole requests move to the host and back.

Why: reasoning outputs are long and their lengths unknown. Reserving every request's worst case
(prompt + max_new_tokens) before admitting it keeps the batch, the lever of throughput, a fraction of
what the pages could hold. So requests are admitted optimistically and, when the pages run out, whole
requests wait in host memory instead of being dropped or recomputed.

The `"dynamic"` policy (`SparseSpecConfig.kv_policy`, the default):
- Admission: a waiting request is admitted when no admitted request is away on the host (first come,
  first served: admitted requests come back before new ones start) and its prompt plus one speculative
  block fits the free pages with `headroom` pages to spare (one block per running request).
- Growth: requests take pages as they decode (`PageAllocator.ensure` in the scheduler's rows);
  `prepare`, before the rows of an iteration are built, makes sure the pages they need are free.
- Offload (victims): the most recently admitted running request leaves first (the paper's FCFS
  fairness; the oldest request is never offloaded, so it always progresses, and alone any request fits:
  `Scheduler.add` checks that). A victim leaves when the iteration's rows need more pages than are free
  (a *forced* offload: its pages are freed at once and the iteration is ordered after the copy that
  reads them, so that iteration waits for the copy), or earlier, when fewer than `headroom` pages would
  be left (its pages are freed once the copy is done, polled each iteration: the copy overlaps compute).
- Restore: when the oldest offloaded request's pages fit with twice the headroom to spare (or nothing
  else runs), it gets fresh pages and its K/V is copied back; it rejoins the batch once the copy is
  done, from the iteration that puts its next verification in the least-loaded phase bucket
  (`Scheduler.resume`; its cycle is unchanged). One restore at a time, oldest first.

What an offloaded request keeps: its host-side state (phase, place in its cycle, committed tokens,
statistics) and its device slot. Its row of the token buffer (drafts included: their values exist only
there), its drafts' distributions and its PillarAttn selection stay in the per-slot device buffers,
untouched while it is away, so nothing but its pages moves and it continues exactly where it stopped.
Slots bound admitted requests (running or away); since nothing new is admitted while a request is away,
a held slot never keeps out a request that could run.

Invariants:
- an admitted request is in exactly one state: RUNNING (holds pages, gets rows), OFFLOADING (its pages in transit, being copied out), OFFLOADED (host chunks only) or
  RESTORING (fresh pages being copied into); only RUNNING requests get rows;
- pages change hands only once the copy that reads or writes them is ordered before the compute
  stream's next use of them (`Transfer.order_before_compute`);
- a restore starts only when the request has no unread results that could roll its pages back;
- no prefill is recomputed and no request is lost (`KVStats` counts both).

The `"reserve"` policy admits by worst-case reservation and never offloads (the baseline).

Under tensor parallelism (`synchronous`) every process runs its own engine, and all must build the
same iterations: a decision may not depend on how far a copy got, so every offload and restore is
complete, for the compute stream, in the iteration that starts it (the copies still run on the copy
stream, ordered before the next iteration, without overlapping it).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

from hf_sparsespec.cache.host_tier import HostKV, HostMemoryError, HostTier, Transfer
from hf_sparsespec.cache.page_allocator import PageAllocator
from hf_sparsespec.config import SparseSpecConfig
from hf_sparsespec.stats import KVStats


class Residency(enum.Enum):
    RUNNING = "running"
    OFFLOADING = "offloading"
    OFFLOADED = "offloaded"
    RESTORING = "restoring"


@dataclass(eq=False)
class _Away:
    """A request that is not RUNNING: its host copy, the pages in transit, the restore in flight."""

    request: object  # scheduler.Request
    host: HostKV | None  # None: it held no positions
    pages: list[int]  # OFFLOADING: pages the copy reads (released when it is done)
    since: float  # when it left the batch
    restore: Transfer | None = None


class KVManager:
    """The KV policy of one engine (see the module docstring). The scheduler calls `prepare` before
    building an iteration's rows, `runs` for each admitted request, `can_admit`/`admit` for waiting
    ones and `release` when one finishes."""

    def __init__(
        self, config: SparseSpecConfig, allocator: PageAllocator, host: HostTier | None, synchronous: bool = False
    ) -> None:
        self.config = config
        self.synchronous = synchronous
        self.allocator = allocator
        self.host = host
        self.dynamic = config.kv_policy == "dynamic"
        self.block_pages = allocator.pages_for(config.num_draft_tokens + 1)
        # the most pages a decoding row's next iteration adds (`_growth`; prefill chunks add more): a
        # speculative draft past the verification in flight, k + 2 positions (twice that, for margin)
        self.max_decode_growth = allocator.pages_for(2 * config.num_draft_tokens + 4)
        self.residency: dict[int, Residency] = {}
        self._order: dict[int, int] = {}  # request id -> admission number
        self._admitted = 0
        self._away: dict[int, _Away] = {}
        self._num_running = 0
        self._offloaded_ids: set[int] = set()
        self.copy_iterations: list[int] = []  # iterations launched while a copy was in flight
        self._stats = KVStats(policy=config.kv_policy, num_pages=allocator.num_pages)

    # --- queries ----------------------------------------------------------------------------------
    @property
    def stats(self) -> KVStats:
        self._stats.peak_pages_used = self.allocator.peak_used_pages
        self._stats.requests_offloaded = len(self._offloaded_ids)
        return self._stats

    @property
    def offloaded_request_ids(self) -> frozenset[int]:
        """The requests moved to the host at least once."""
        return frozenset(self._offloaded_ids)

    @property
    def num_away(self) -> int:
        return len(self._away)

    def runs(self, request) -> bool:
        """Whether the admitted `request` holds its pages (may get rows)."""
        return self.residency[request.request_id] is Residency.RUNNING

    def headroom(self, num_running: int) -> int:
        """Pages kept free for growth: one speculative block per running request, at most 1/8 of the pool."""
        return min(num_running * self.block_pages, max(1, self.allocator.num_pages // 8))

    # --- admission and finish -------------------------------------------------------------------
    def can_admit(self, request, reservation: int) -> bool:
        if not self.dynamic:
            return self.allocator.can_reserve(reservation)
        if self._away:
            return False  # FCFS: requests on the host come back before new ones start
        needed = self.allocator.pages_for(request.prompt_len + self.config.num_draft_tokens + 1)
        # headroom is for the growth of requests already running; the first one only needs its pages (a
        # pool sized to its final length may not hold one more block)
        spare = self.headroom(self._num_running + 1) if self._num_running else 0
        return needed + spare <= self.allocator.num_free_pages

    def admit(self, request, reservation: int) -> None:
        rid = request.request_id
        if self.dynamic:
            self.allocator.add(rid)
        else:
            self.allocator.reserve(rid, reservation)
        self.residency[rid] = Residency.RUNNING
        self._order[rid] = self._admitted
        self._admitted += 1
        self._num_running += 1
        self._stats.prompt_tokens += request.prompt_len

    def count_prefill(self, num_tokens: int) -> None:
        self._stats.prefill_tokens += num_tokens

    def release(self, request) -> None:
        """The request finished (wherever it is): free its pages and host chunks."""
        rid = request.request_id
        state = self.residency.pop(rid)
        del self._order[rid]
        away = self._away.pop(rid, None)
        if state is Residency.RUNNING:
            self._num_running -= 1
        else:
            self._stats.offloaded_seconds += time.perf_counter() - away.since
            for transfer in (away.host.offload if away.host else None, away.restore):
                if transfer is not None:
                    transfer.order_before_compute()  # its pages may be reused from the next iteration on
            self.allocator.release(away.pages)
            if away.host is not None:
                self.host.release(away.host)
        self.allocator.free(rid)

    # --- before each iteration ------------------------------------------------------------------
    def prepare(self, scheduler) -> None:
        """Make the pages of the next iteration's rows free (offloading if needed), finish copies that
        are done, and start a restore when there is room. Called at the start of `Scheduler.schedule`."""
        if not self.dynamic:
            return
        iteration = scheduler.iteration
        self._poll(scheduler)
        if not self._away and self._room_for_any_growth(scheduler):
            return  # whatever the rows add leaves the headroom free: nothing to offload, nothing away to restore
        running = [r for r in scheduler.active if self.residency[r.request_id] is Residency.RUNNING]
        for away in self._away.values():
            scheduler.park(away.request)  # out of the phase buckets while away
        need = sum(self._growth(scheduler, r) for r in running)
        forced = False
        while need > self.allocator.num_free_pages:
            if self._force_offloads():
                continue
            victim = self._victim(running)
            if victim is None and self._force_restores(scheduler, running):
                need = sum(self._growth(scheduler, r) for r in running)
                continue
            if victim is None:
                raise RuntimeError(
                    f"hf_sparsespec: {need} KV pages needed, {self.allocator.num_free_pages} free and nothing to "
                    "offload (a bug: one request alone always fits)"
                )
            running.remove(victim)
            need -= self._growth(scheduler, victim)
            self._offload(victim, scheduler, forced=True)
            forced = True
        spare = self.allocator.num_free_pages - need
        in_transit = sum(len(a.pages) for a in self._away.values())
        if not forced and len(running) > 1 and spare + in_transit < self.headroom(len(running)):
            victim = self._victim(running)
            if self.host is not None and self.host.can_hold(self.allocator.num_pages_of(victim.request_id)):
                self._offload(victim, scheduler, forced=False)
        elif not forced:
            self._restore_next(scheduler, spare, running)
        if any(a.pages or a.restore is not None for a in self._away.values()):
            self.copy_iterations.append(iteration)

    def _room_for_any_growth(self, scheduler) -> bool:
        """Whether the free pages hold the headroom and the most every active request's next row could
        add, so that the exact demand (a Python loop over the rows) need not be summed; never while
        a prompt is still being prefilled (a chunk adds more than a decoding row)."""
        active = len(scheduler.active)
        if self.allocator.num_free_pages - active * self.max_decode_growth < self.headroom(active):
            return False
        return not scheduler.prefilling()

    def _growth(self, scheduler, request) -> int:
        """Pages the request's next row adds."""
        have = self.allocator.num_pages_of(request.request_id)
        return max(0, self.allocator.pages_for(scheduler.upcoming_length(request)) - have)

    def _victim(self, running: list):
        """The most recently admitted running request; never the last one."""
        if len(running) <= 1:
            return None
        return max(running, key=lambda r: self._order[r.request_id])

    # --- offload --------------------------------------------------------------------------------
    def _offload(self, request, scheduler, forced: bool) -> None:
        rid = request.request_id
        pages_held = self.allocator.num_pages_of(rid)
        if pages_held and (self.host is None or not self.host.can_hold(pages_held)):
            capacity = 0 if self.host is None else self.host.capacity * self.host.chunk_bytes
            raise HostMemoryError(
                f"hf_sparsespec: request {rid} ({self.allocator.length(rid)} tokens of KV) must be offloaded for "
                f"the batch to continue, but the host pool ({capacity / 2**30:.2f} GiB) is full with "
                f"{len(self._away)} offloaded requests; raise SparseSpecConfig.host_pool_bytes, lower "
                "max_num_requests, or give the device pool more pages (num_pages / gpu_memory_fraction)"
            )
        length = self.allocator.length(rid)
        pages = self.allocator.park(rid)
        host = self.host.offload(pages, length) if pages else None
        self.residency[rid] = Residency.OFFLOADING
        self._num_running -= 1
        self._away[rid] = _Away(request, host, pages, time.perf_counter())
        self._offloaded_ids.add(rid)
        scheduler.park(request)
        self._stats.offloads += 1
        self._stats.offloaded_bytes += host.num_bytes if host else 0
        if forced:
            self._stats.forced_offloads += 1
        if forced or self.synchronous or host is None or host.offload.done():
            self._finish_offload(self._away[rid])

    def _finish_offload(self, away: _Away) -> None:
        if away.host is not None:
            away.host.offload.order_before_compute()
        self.allocator.release(away.pages)
        away.pages = []
        self.residency[away.request.request_id] = Residency.OFFLOADED

    def _force_restores(self, scheduler, running: list) -> bool:
        """Finish the restores in flight (the next iteration waits for those copies): their requests hold
        pages and become running, so victims, again."""
        restoring = [a for a in self._away.values() if a.restore is not None]
        for away in restoring:
            self._finish_restore(away, scheduler)
            running.append(away.request)
        return bool(restoring)

    def _force_offloads(self) -> bool:
        """Free the pages of offloads still copying (the next iteration waits for those copies)."""
        pending = [a for a in self._away.values() if a.pages]
        for away in pending:
            self._finish_offload(away)
        return bool(pending)

    # --- restore --------------------------------------------------------------------------------
    def _restore_next(self, scheduler, spare: int, running: list) -> None:
        if any(a.restore is not None for a in self._away.values()):
            return  # one at a time
        candidates = [a for a in self._away.values() if self.residency[a.request.request_id] is Residency.OFFLOADED]
        if not candidates:
            return
        away = min(candidates, key=lambda a: self._order[a.request.request_id])
        request = away.request
        if not scheduler.settled(request):
            return  # its unread results may still roll it back
        rid = request.request_id
        needed = self.allocator.pages_for(self.allocator.parked_length(rid))
        if running and spare - needed < 2 * self.headroom(len(running) + 1):
            return
        if needed > self.allocator.num_free_pages:
            return
        pages = self.allocator.unpark(rid)
        self.residency[rid] = Residency.RESTORING
        away.restore = self.host.restore(away.host, pages) if pages else Transfer(None, 0)
        self._stats.restored_bytes += away.restore.num_bytes
        if self.synchronous or away.restore.done():
            self._finish_restore(away, scheduler)

    def _finish_restore(self, away: _Away, scheduler) -> None:
        request = away.request
        rid = request.request_id
        away.restore.order_before_compute()
        if away.host is not None:
            self.host.release(away.host)
        del self._away[rid]
        self.residency[rid] = Residency.RUNNING
        self._num_running += 1
        self._stats.restores += 1
        self._stats.offloaded_seconds += time.perf_counter() - away.since
        scheduler.resume(request)

    # --- copies in flight -------------------------------------------------------------------------
    def _poll(self, scheduler) -> None:
        """Finish the copies that are done (no waiting)."""
        for away in list(self._away.values()):
            if away.pages and away.host.offload.done():
                self._finish_offload(away)
            elif away.restore is not None and away.restore.done():
                self._finish_restore(away, scheduler)

    @property
    def busy(self) -> bool:
        """Whether copies are in flight."""
        return any(a.pages or a.restore is not None for a in self._away.values())

    def wait(self) -> None:
        """Block until the copies in flight are done (only when nothing else can run)."""
        for away in self._away.values():
            if away.pages:
                away.host.offload.wait()
            if away.restore is not None:
                away.restore.wait()
