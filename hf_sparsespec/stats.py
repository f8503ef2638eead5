"""Acceptance statistics of speculative cycles.

Vocabulary (defined once): a *cycle* drafts m tokens sparsely and verifies them in one full pass;
the *accepted drafts* are the leading drafts the verification keeps (0..m); the cycle then commits one
more token, sampled from the target (the *recovered* token after a rejection, the *bonus* token when
all m drafts were accepted). So every request obeys

    generated_tokens = 1 (sampled at the end of prefill) + accepted_drafts + cycles

where a cycle cut short by a stop (eos, stop criteria) counts only the drafts kept before the stop.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestStats:
    cycles: int = 0
    drafted_tokens: int = 0
    accepted_drafts: int = 0
    generated_tokens: int = 0
    accepted_histogram: list[int] = field(default_factory=list)  # index a: cycles that accepted a drafts

    def reset(self) -> None:
        self.cycles = self.drafted_tokens = self.accepted_drafts = self.generated_tokens = 0
        self.accepted_histogram = []

    def record_cycle(self, drafted: int, accepted: int) -> None:
        self.cycles += 1
        self.drafted_tokens += drafted
        self.accepted_drafts += accepted
        if len(self.accepted_histogram) <= accepted:
            self.accepted_histogram.extend([0] * (accepted + 1 - len(self.accepted_histogram)))
        self.accepted_histogram[accepted] += 1

    @property
    def mean_accepted_per_cycle(self) -> float:
        """Mean accepted drafts per cycle (0..k; the recovered/bonus token is not counted)."""
        return self.accepted_drafts / self.cycles if self.cycles else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts over drafted tokens."""
        return self.accepted_drafts / self.drafted_tokens if self.drafted_tokens else 0.0

    def merge(self, other: RequestStats) -> None:
        self.cycles += other.cycles
        self.drafted_tokens += other.drafted_tokens
        self.accepted_drafts += other.accepted_drafts
        self.generated_tokens += other.generated_tokens
        for accepted, count in enumerate(other.accepted_histogram):
            if len(self.accepted_histogram) <= accepted:
                self.accepted_histogram.extend([0] * (accepted + 1 - len(self.accepted_histogram)))
            self.accepted_histogram[accepted] += count

    def as_dict(self) -> dict:
        return {
            "cycles": self.cycles,
            "drafted_tokens": self.drafted_tokens,
            "accepted_drafts": self.accepted_drafts,
            "generated_tokens": self.generated_tokens,
            "mean_accepted_per_cycle": self.mean_accepted_per_cycle,
            "acceptance_rate": self.acceptance_rate,
            "accepted_histogram": list(self.accepted_histogram),
        }


@dataclass
class SparseSpecStats:
    """Statistics of one `generate`/`generate_batch` call: per request (input order) and in total."""

    num_draft_tokens: int
    per_request: list[RequestStats]
    total: RequestStats

    @classmethod
    def from_requests(cls, num_draft_tokens: int, per_request: list[RequestStats]) -> SparseSpecStats:
        total = RequestStats(accepted_histogram=[0] * (num_draft_tokens + 1))
        for stats in per_request:
            total.merge(stats)
        for stats in per_request:
            stats.accepted_histogram.extend([0] * (num_draft_tokens + 1 - len(stats.accepted_histogram)))
        return cls(num_draft_tokens=num_draft_tokens, per_request=per_request, total=total)

    @property
    def mean_accepted_per_cycle(self) -> float:
        return self.total.mean_accepted_per_cycle

    def as_dict(self) -> dict:
        return {
            "num_draft_tokens": self.num_draft_tokens,
            "total": self.total.as_dict(),
            "per_request": [stats.as_dict() for stats in self.per_request],
        }
