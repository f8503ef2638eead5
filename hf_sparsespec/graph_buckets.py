"""Which padded decode shapes get a CUDA graph, and which captured graph an uncaptured shape borrows.

A padded decode iteration is fully described by its bucket `(verify rows, draft rows, shifted)`
(`batch.BatchBuilder.build`): the same bucket gives the same `StepShape`, so the same graph. A bucket
without a graph runs eagerly, and an eager iteration costs several replays (on the H200 at 256
requests ~58 ms against ~10 ms, host-bound: ~1,400 launches from Python, docs/measurements.md 9).
A batch that grows (admission) or shrinks (requests finishing at different iterations) passes through
many buckets, most of them only once or twice: at 256 x 2048 a SparseSpec run captured 89 graphs and
ran 211 iterations eagerly, 37 % of its time.

So a bucket borrows a larger captured graph while it is new: its first `BORROW_SIGHTINGS` iterations
replay the captured bucket with the fewest tokens that holds it (more verify rows, more draft rows,
shifted if it is; the extra rows are padding, which writes nothing and samples nothing), as long as
that graph has at most `max(2 x tokens, tokens + 64)` tokens: a few replays of at most twice the
work cost less than one eager iteration. A bucket seen again after that, or one that no captured graph
holds, runs eagerly and is captured once it has been seen twice (its eager run just compiled every
kernel it needs). Borrowing never changes a result: padding rows are inert and sampling noise is
keyed per request and position, not per row. In a simulated 256-request batch that drains over
~1,600 iterations (tests/test_graph_buckets.py) eager iterations fall from 245 to 100 and graphs from
116 to 93; not yet measured on a GPU.

Invariant (owned here): `captured` lists exactly the buckets the runner holds a graph for.
"""

from __future__ import annotations

from collections import Counter

Bucket = tuple[int, int, bool]  # (verify rows, draft rows, shifted) of a padded decode iteration

BORROW_SIGHTINGS = 4  # iterations a new bucket replays a larger graph before it gets its own
CAPTURE_SIGHTINGS = 2  # sightings (borrowed or eager) after which an eager bucket is captured


class GraphBuckets:
    """The bookkeeping of the runner's graphs by bucket (host only, no device state)."""

    def __init__(self, spec_len: int) -> None:
        self.spec_len = spec_len  # tokens per verify row (k + 1)
        self.captured: list[Bucket] = []
        self.borrowed: Counter[Bucket] = Counter()  # iterations each bucket ran in a larger graph
        self.eager: Counter[Bucket] = Counter()  # eager iterations of each bucket

    def tokens(self, bucket: Bucket) -> int:
        return bucket[0] * self.spec_len + bucket[1]

    def choose(self, bucket: Bucket) -> Bucket:
        """The bucket an iteration that needs `bucket` should be built for: its own when captured,
        else (while new) the smallest captured bucket that holds it within the padding limit, else its own."""
        if bucket in self.captured or self.borrowed[bucket] >= BORROW_SIGHTINGS:
            return bucket
        larger = self.smallest_holding(bucket)
        if larger is None:
            return bucket
        self.borrowed[bucket] += 1
        return larger

    def smallest_holding(self, bucket: Bucket) -> Bucket | None:
        verify, draft, shifted = bucket
        limit = max(2 * self.tokens(bucket), self.tokens(bucket) + 64)
        holding = [
            b for b in self.captured if b[0] >= verify and b[1] >= draft and b[2] >= shifted and self.tokens(b) <= limit
        ]
        return min(holding, key=lambda b: (self.tokens(b), b), default=None)

    def ran_eagerly(self, bucket: Bucket) -> bool:
        """Record an eager iteration of `bucket`; True when it should be captured now."""
        self.eager[bucket] += 1
        return self.eager[bucket] + self.borrowed[bucket] >= CAPTURE_SIGHTINGS

    def add(self, bucket: Bucket) -> None:
        self.captured.append(bucket)
