"""Reading an iteration's results on the host, and deciding when a request stops.

`ResultReader` is the engine's one planned synchronisation point: the int64 results of an iteration
are copied into pinned host memory behind an event, and only read (waited for) when the engine needs
them. `StopChecker` appends committed tokens one at a time and stops at the first one that ends the
request, exactly where plain `generate` would stop (eos, length, stopping criteria).
"""

from __future__ import annotations

import torch

from hf_sparsespec.scheduler import Request


class ResultReader:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def start(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Begin copying `values` to the host without waiting for the device."""
        if self.device.type != "cuda":
            return values, None
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        host.copy_(values, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event

    @staticmethod
    def finish(host: torch.Tensor, event: torch.cuda.Event | None) -> list[int]:
        if event is not None:
            event.synchronize()
        return host.tolist()


class StopChecker:
    """Stop rules of one `generate` call.

    Args:
        eos_token_ids: tokens that end a request (the eos token itself is kept, as `generate` does).
        criteria: further `StoppingCriteria` (stop strings, max time, custom), called with the
            request's full history `[1, len]` (its left padding included) after every committed token.
    """

    def __init__(self, eos_token_ids: set[int], criteria: list, device: torch.device) -> None:
        self.eos_token_ids = eos_token_ids
        self.criteria = criteria
        self.device = device

    def commit(self, request: Request, tokens: list[int]) -> tuple[int, str | None]:
        """Append `tokens` to `request.generated` up to the first stop; returns (kept, reason)."""
        for index, token in enumerate(tokens):
            request.generated.append(token)
            if token in self.eos_token_ids:
                return index + 1, "eos"
            if len(request.generated) >= request.max_new_tokens:
                return index + 1, "length"
            if self.criteria and self._criteria_stop(request):
                return index + 1, "stop_criteria"
        return len(tokens), None

    def _criteria_stop(self, request: Request) -> bool:
        history = torch.tensor([request.padding + request.prompt + request.generated], device=self.device)
        return any(bool(criterion(history, None).any()) for criterion in self.criteria)
