"""Which padded decode shapes get a CUDA graph, and which captured graph an uncaptured shape borrows.

A padded decode iteration is fully described by its bucket `(verify rows, draft rows, shifted)`
(`batch.BatchBuilder.build`): the same bucket gives the same `StepShape`, so the same graph. A bucket
without a graph runs eagerly, and an eager iteration costs several replays (on the H200 at 256
requests ~58 ms against ~10 ms, host-bound: ~1,400 launches from Python, docs/measurements.md 9).
A batch that grows (admission) or shrinks (requests finishing at different iterations) passes through
many buckets, most of them only once or twice: at 256 x 2048 a SparseSpec run captured 89 graphs and
ran 211 iterations eagerly, 37 % of its time.

So a bucket borrows a larger captured graph while it is new: it replays the captured bucket with the
fewest tokens that holds it (more verify rows, more draft rows, shifted if it is; the extra rows are
padding, which writes nothing and samples nothing), however many more tokens that graph has: the
largest replay costs a fraction of an eager iteration (on the H100 at 256 requests ~6-10 ms against
~28-65 ms). When a bucket borrowed only graphs of at most `max(2 x tokens, tokens + 64)` tokens, a
draining batch's tail ran most new buckets eagerly twice and captured them: 7 % of a 256 x 2048 run's
GPU time and 1.7 % of a 256 x 8192 run's (docs/measurements.md 24).

How long a bucket borrows is a rent-or-buy choice: a borrowed replay costs the padding tokens it
computes for nothing, its own graph costs one eager iteration plus a capture (~100 ms on the H200
against ~0.0125 ms a padded token: a 256-row replay of ~480 tokens takes ~10 ms, a 1-row one ~3.8 ms;
docs/measurements.md 10). So a bucket borrows until its padding adds up to
`CAPTURE_AFTER_PADDING_TOKENS` (~8,000 tokens, the price of a capture), then gets its own graph: a
bucket that is seen a few times never pays for a capture, one that stays pays at most twice the
optimum. A bucket that no captured graph holds runs eagerly and is captured once it has been seen
twice (its eager run just compiled every kernel it needs). Borrowing never changes a result: padding
rows are inert and sampling noise is keyed per request and position, not per row. In a simulated
256-request batch that drains over ~1,600 iterations (tests/test_graph_buckets.py) eager iterations
fall from 245 to 14 and graphs from 116 to 7 (27 and 13 with the old limit). Measured on the H200
with a fixed 4 borrowings a bucket (docs/measurements.md 10): 211 -> 73 eager iterations, 10,847 ->
13,893 tok/s at 256 x 2048.

The decode start is a ramp: requests join their phase buckets over one cycle (`scheduler`), so the
first k + 1 decode iterations each need more verify and draft rows than the last, and no graph exists
yet: about 9 iterations of 33-104 ms each (eager, some capturing) at the start of every H100 run of
docs/measurements.md 24, against 4-9 ms for a replay. So the first iteration that nothing holds builds
and captures the batch's first graph at once, sized for every slot (`first_graph`: verify rows for 1.25
x the slots' share of verifications, a one-token row per slot, the shift fields). The ramp and the
steady state borrow it until they buy their own.

Invariant (owned here): `captured` lists exactly the buckets the runner holds a graph for.
"""

from __future__ import annotations

import math
from collections import Counter

from hf_sparsespec.batch import round_up_rows

Bucket = tuple[int, int, bool]  # (verify rows, draft rows, shifted) of a padded decode iteration

# padding tokens a bucket may compute in borrowed graphs before it gets its own: an eager iteration plus
# a capture (~100 ms) over the cost of a padded token in a replay (~0.0125 ms), both on the H200
CAPTURE_AFTER_PADDING_TOKENS = 8192
CAPTURE_SIGHTINGS = 2  # sightings (borrowed or eager) after which an eager bucket is captured
# the first graph's verify rows, over the slots' share of verifications (slots / (k + 1)): the share
# moves with the requests' acceptance
FIRST_GRAPH_VERIFY_MARGIN = 1.25


def holds(larger: Bucket, bucket: Bucket) -> bool:
    """Whether an iteration built for `larger` can run one that needs `bucket` (the extra rows padding)."""
    return larger[0] >= bucket[0] and larger[1] >= bucket[1] and larger[2] >= bucket[2]


class GraphBuckets:
    """The bookkeeping of the runner's graphs by bucket (host only, no device state)."""

    def __init__(self, spec_len: int, num_slots: int | None = None) -> None:
        self.spec_len = spec_len  # tokens per verify row (k + 1)
        self.num_slots = num_slots  # rows an iteration has at most (None: no first graph)
        self.first: Bucket | None = None  # the first graph's bucket, once chosen
        self.captured: list[Bucket] = []
        self.borrowed: Counter[Bucket] = Counter()  # iterations each bucket ran in a larger graph
        self.padding: Counter[Bucket] = Counter()  # padding tokens those iterations computed
        self.eager: Counter[Bucket] = Counter()  # eager iterations of each bucket

    def tokens(self, bucket: Bucket) -> int:
        return bucket[0] * self.spec_len + bucket[1]

    def choose(self, bucket: Bucket) -> Bucket:
        """The bucket an iteration that needs `bucket` should be built for: its own when captured,
        else (until its padding has cost a capture) the smallest captured bucket that holds it, else its
        own."""
        if bucket in self.captured or self.padding[bucket] >= CAPTURE_AFTER_PADDING_TOKENS:
            return bucket
        larger = self.smallest_holding(bucket)
        if larger is None:
            # the first bucket nothing holds (every capture follows this branch) may start the first graph
            if self.first is None and self.spec_len > 1 and self.num_slots:
                self.first = self.first_graph()
                if holds(self.first, bucket):
                    return self.first
            return bucket
        self.borrowed[bucket] += 1
        self.padding[bucket] += self.tokens(larger) - self.tokens(bucket)
        return larger

    def smallest_holding(self, bucket: Bucket) -> Bucket | None:
        holding = [b for b in self.captured if holds(b, bucket)]
        return min(holding, key=lambda b: (self.tokens(b), b), default=None)

    def first_graph(self) -> Bucket:
        """The bucket of the batch's first graph (see the module docstring)."""
        slots = self.num_slots
        verify = math.ceil(FIRST_GRAPH_VERIFY_MARGIN * slots / self.spec_len)
        return round_up_rows(verify, slots, self.spec_len), round_up_rows(slots, slots), True

    def ran_eagerly(self, bucket: Bucket) -> bool:
        """Record an eager iteration of `bucket`; True when it should be captured now (the first
        graph's at once: it was chosen to be borrowed)."""
        self.eager[bucket] += 1
        return bucket == self.first or self.eager[bucket] + self.borrowed[bucket] >= CAPTURE_SIGHTINGS

    def add(self, bucket: Bucket) -> None:
        self.captured.append(bucket)
