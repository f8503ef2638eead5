"""Acceptance statistics of speculative cycles.

Vocabulary (defined once): a *cycle* drafts m tokens sparsely and verifies them in one full pass;
the *accepted drafts* are the leading drafts the verification keeps (0..m); the cycle then commits one
more token, sampled from the target (the *recovered* token after a rejection, the *bonus* token when
all m drafts were accepted). So every request obeys

    generated_tokens = 1 (sampled at the end of prefill) + accepted_drafts + cycles

where a cycle cut short by a stop (eos, stop criteria) counts only the drafts kept before the stop.

`print(stats)` gives a short human summary, notebooks show an HTML table (`_repr_html_`), `as_dict()`
is JSON-ready and `plot_histogram()` draws the accepted-drafts histogram with matplotlib.
"""

from __future__ import annotations

import dataclasses
import html
from dataclasses import dataclass, field


@dataclass(repr=False)
class RequestStats:
    cycles: int = 0
    drafted_tokens: int = 0
    accepted_drafts: int = 0
    generated_tokens: int = 0
    accepted_histogram: list[int] = field(default_factory=list)  # index a: cycles that accepted a drafts
    cycle_accepted: list[int] = field(default_factory=list)  # accepted drafts of each cycle, in order (per request)
    cycle_drafted: list[int] = field(default_factory=list)  # drafts of each cycle, m, in order (per request)
    plain_steps: int = 0  # cycles of 0 drafts (plain one-token steps: autoregressive mode, the tail, the last token)

    def reset(self) -> None:
        self.cycles = self.drafted_tokens = self.accepted_drafts = self.generated_tokens = self.plain_steps = 0
        self.accepted_histogram = []
        self.cycle_accepted = []
        self.cycle_drafted = []

    def record_cycle(self, drafted: int, accepted: int) -> None:
        self.cycles += 1
        self.plain_steps += int(drafted == 0)
        self.drafted_tokens += drafted
        self.accepted_drafts += accepted
        if len(self.accepted_histogram) <= accepted:
            self.accepted_histogram.extend([0] * (accepted + 1 - len(self.accepted_histogram)))
        self.accepted_histogram[accepted] += 1
        self.cycle_accepted.append(accepted)
        self.cycle_drafted.append(drafted)

    @property
    def mean_accepted_per_cycle(self) -> float:
        """Mean accepted drafts per cycle (0..k; the recovered/bonus token is not counted)."""
        return self.accepted_drafts / self.cycles if self.cycles else 0.0

    @property
    def mean_accepted_per_drafting_cycle(self) -> float:
        """Mean accepted drafts per cycle that drafted (plain steps left out)."""
        drafting = self.cycles - self.plain_steps
        return self.accepted_drafts / drafting if drafting else 0.0

    @property
    def mean_drafted_per_cycle(self) -> float:
        """Mean drafts per cycle, m (k, less near the length limit or with adaptive draft lengths)."""
        return self.drafted_tokens / self.cycles if self.cycles else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts over drafted tokens."""
        return self.accepted_drafts / self.drafted_tokens if self.drafted_tokens else 0.0

    def merge(self, other: RequestStats) -> None:
        """Add `other`'s counts (its cycle order, `cycle_accepted` and `cycle_drafted`, is not
        merged)."""
        self.cycles += other.cycles
        self.plain_steps += other.plain_steps
        self.drafted_tokens += other.drafted_tokens
        self.accepted_drafts += other.accepted_drafts
        self.generated_tokens += other.generated_tokens
        for accepted, count in enumerate(other.accepted_histogram):
            if len(self.accepted_histogram) <= accepted:
                self.accepted_histogram.extend([0] * (accepted + 1 - len(self.accepted_histogram)))
            self.accepted_histogram[accepted] += count

    def __repr__(self) -> str:
        return (
            f"RequestStats({self.generated_tokens} tokens, {self.cycles} cycles, "
            f"{self.mean_accepted_per_cycle:.2f} accepted drafts/cycle, acceptance {self.acceptance_rate:.1%})"
        )

    def as_dict(self) -> dict:
        return {
            "cycles": self.cycles,
            "drafted_tokens": self.drafted_tokens,
            "accepted_drafts": self.accepted_drafts,
            "generated_tokens": self.generated_tokens,
            "mean_accepted_per_cycle": self.mean_accepted_per_cycle,
            "plain_steps": self.plain_steps,
            "mean_accepted_per_drafting_cycle": self.mean_accepted_per_drafting_cycle,
            "mean_drafted_per_cycle": self.mean_drafted_per_cycle,
            "acceptance_rate": self.acceptance_rate,
            "accepted_histogram": list(self.accepted_histogram),
            "cycle_accepted": list(self.cycle_accepted),
            "cycle_drafted": list(self.cycle_drafted),
        }


@dataclass
class KVStats:
    """What the KV manager did in one call (totals; see `kv_manager`).

    `offloads`/`restores` count moves of a request to the host and back (`requests_offloaded` counts
    distinct requests); `forced_offloads` are the offloads an iteration had to wait for (the others
    overlapped compute); `offloaded_seconds` sums, over requests, the wall time spent away from the
    batch. `prefill_tokens` are the prompt tokens computed: equal to `prompt_tokens` (nothing is
    recomputed).
    """

    policy: str = "dynamic"
    num_pages: int = 0
    peak_pages_used: int = 0
    offloads: int = 0
    restores: int = 0
    requests_offloaded: int = 0
    forced_offloads: int = 0
    offloaded_bytes: int = 0
    restored_bytes: int = 0
    offloaded_seconds: float = 0.0
    prefill_tokens: int = 0
    prompt_tokens: int = 0

    @property
    def recomputed_prefill_tokens(self) -> int:
        return self.prefill_tokens - self.prompt_tokens

    def summary(self) -> str:
        text = f"{self.policy}, peak {self.peak_pages_used} of {self.num_pages} pages"
        if self.offloads:
            text += (
                f"; {self.offloads} offloads ({self.requests_offloaded} requests, {self.forced_offloads} forced, "
                f"{self.offloaded_bytes / 2**20:.1f} MiB), {self.restores} restores ({self.restored_bytes / 2**20:.1f} MiB), "
                f"{self.offloaded_seconds:.2f} request-s away"
            )
        return text

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "recomputed_prefill_tokens": self.recomputed_prefill_tokens}


@dataclass
class EngineStats:
    """What the engine ran: its iterations, replayed from CUDA graphs or run eagerly, and the graphs
    it captured (with the seconds capture took). On a GPU, many eager iterations mean host-bound
    decoding: graphs off (`cuda_graphs=False`, or not CUDA / the Triton backend), a logits processor
    that synchronises with the host, prefill iterations, or more padded shapes than the runner keeps."""

    iterations: int = 0
    graph_replays: int = 0
    eager_iterations: int = 0
    graphs_captured: int = 0
    capture_seconds: float = 0.0

    @classmethod
    def from_counters(cls, counters) -> EngineStats:
        """From a `runner.RunnerCounters`."""
        replays, eager = counters.graph_replays, counters.eager_iterations
        return cls(replays + eager, replays, eager, counters.graphs_captured, counters.capture_seconds)

    def merge(self, other: EngineStats) -> None:
        for field_ in dataclasses.fields(self):
            setattr(self, field_.name, getattr(self, field_.name) + getattr(other, field_.name))

    def summary(self) -> str:
        return (
            f"{self.iterations} ({self.graph_replays} graph replays, {self.eager_iterations} eager; "
            f"{self.graphs_captured} graphs captured in {self.capture_seconds:.2f} s)"
        )

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(repr=False)
class SparseSpecStats:
    """Statistics of one `generate`/`generate_batch` call: per request (input order) and in total.

    `elapsed_s` is the wall time of the decoding (prefill included), when the caller measured it;
    `kv` what the KV manager did (pages, offloads, restores) and `engine` its iterations and CUDA
    graphs, when the engine ran.
    """

    num_draft_tokens: int
    per_request: list[RequestStats]
    total: RequestStats
    elapsed_s: float | None = None
    kv: KVStats | None = None
    engine: EngineStats | None = None

    @classmethod
    def from_requests(
        cls, num_draft_tokens: int, per_request: list[RequestStats], elapsed_s: float | None = None,
        kv: KVStats | None = None, engine: EngineStats | None = None,
    ) -> SparseSpecStats:
        total = RequestStats(accepted_histogram=[0] * (num_draft_tokens + 1))
        for stats in per_request:
            total.merge(stats)
        for stats in per_request:
            stats.accepted_histogram.extend([0] * (num_draft_tokens + 1 - len(stats.accepted_histogram)))
        return cls(num_draft_tokens=num_draft_tokens, per_request=per_request, total=total, elapsed_s=elapsed_s, kv=kv,
                   engine=engine)  # fmt: skip

    @property
    def num_requests(self) -> int:
        return len(self.per_request)

    @property
    def mean_accepted_per_cycle(self) -> float:
        return self.total.mean_accepted_per_cycle

    @property
    def mean_drafted_per_cycle(self) -> float:
        return self.total.mean_drafted_per_cycle

    @property
    def acceptance_rate(self) -> float:
        return self.total.acceptance_rate

    @property
    def tokens_per_second(self) -> float | None:
        """Generated tokens over the decoding's wall time (all requests together)."""
        if not self.elapsed_s:
            return None
        return self.total.generated_tokens / self.elapsed_s

    def summary_rows(self) -> list[tuple[str, str]]:
        """(label, value) pairs of the human summary."""
        total, k = self.total, self.num_draft_tokens
        rows = [
            ("requests", f"{self.num_requests}"),
            ("generated tokens", f"{total.generated_tokens}"),
            ("cycles", f"{total.cycles} (k = {k}; {total.mean_drafted_per_cycle:.2f} drafts per cycle)"),
            ("mean accepted drafts per cycle", f"{self.mean_accepted_per_cycle:.2f} of {k}"),
            ("acceptance rate", f"{self.acceptance_rate:.1%} ({total.accepted_drafts} of {total.drafted_tokens} drafts)"),
        ]
        if self.tokens_per_second is not None:
            rows.append(("throughput", f"{self.tokens_per_second:.1f} tokens/s over {self.elapsed_s:.2f} s"))
        if self.engine is not None:
            rows.append(("iterations", self.engine.summary()))
        if self.kv is not None:
            rows.append(("KV cache", self.kv.summary()))
        return rows

    def __str__(self) -> str:
        width = max(len(label) for label, _ in self.summary_rows())
        lines = ["SparseSpecStats"] + [f"  {label:<{width}}  {value}" for label, value in self.summary_rows()]
        lines.append(f"  {'accepted drafts histogram':<{width}}  {_histogram_line(self.total.accepted_histogram)}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        speed = "" if self.tokens_per_second is None else f", {self.tokens_per_second:.1f} tokens/s"
        return (
            f"SparseSpecStats({self.num_requests} requests, {self.total.generated_tokens} tokens, "
            f"{self.total.cycles} cycles, k={self.num_draft_tokens}: {self.mean_accepted_per_cycle:.2f} accepted "
            f"drafts/cycle, acceptance {self.acceptance_rate:.1%}{speed})"
        )

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><th style='text-align:left'>{html.escape(label)}</th><td style='text-align:left'>{html.escape(value)}</td></tr>"
            for label, value in self.summary_rows()
        )
        histogram = self.total.accepted_histogram
        peak = max(histogram, default=0) or 1
        bars = "".join(
            f"<tr><td>{accepted}</td><td><div style='background:#4c72b0;height:0.8em;width:{120 * count / peak:.0f}px'>"
            f"</div></td><td>{count}</td></tr>"
            for accepted, count in enumerate(histogram)
        )
        return (
            "<div><b>SparseSpecStats</b><table>" + rows + "</table>"
            "<table><tr><th>accepted drafts</th><th></th><th>cycles</th></tr>" + bars + "</table></div>"
        )

    def as_dict(self) -> dict:
        return {
            "num_draft_tokens": self.num_draft_tokens,
            "num_requests": self.num_requests,
            "elapsed_s": self.elapsed_s,
            "tokens_per_second": self.tokens_per_second,
            "total": self.total.as_dict(),
            "kv": self.kv.as_dict() if self.kv is not None else None,
            "engine": self.engine.as_dict() if self.engine is not None else None,
            "per_request": [stats.as_dict() for stats in self.per_request],
        }

    def plot_histogram(self, ax=None, label: str | None = None):
        """Bar chart of cycles per number of accepted drafts (0..k) on a matplotlib Axes; returns it."""
        from hf_sparsespec.plots import plot_acceptance_histogram

        return plot_acceptance_histogram({label or "SparseSpec": self.total.accepted_histogram}, ax=ax)


def _histogram_line(histogram: list[int]) -> str:
    """`0:12 1:3 ...`: cycles per number of accepted drafts."""
    return " ".join(f"{accepted}:{count}" for accepted, count in enumerate(histogram))
