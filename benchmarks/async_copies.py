"""Which host-side step of an offload waits for the GPU: each primitive the host tier uses, timed on
the host while a long kernel keeps the compute stream busy (the copy stream waits for it on the
device, so a primitive that returns in microseconds is asynchronous and one that takes the kernel's
~250 ms waited for it).

    python benchmarks/async_copies.py

Prints a table: primitive, host ms, whether the copy stream's event was already complete after it.
"""

from __future__ import annotations

import time

import torch


def main() -> None:
    device = torch.device("cuda")
    copy_stream = torch.cuda.Stream(device)
    pages = torch.randn(512, 16, 2, 64, device=device, dtype=torch.bfloat16)
    staging = torch.empty(16, 16, 2, 64, device=device, dtype=torch.bfloat16)
    chunk = torch.empty(16, 16, 2, 64, dtype=torch.bfloat16, pin_memory=True)
    preallocated_index = torch.arange(16, dtype=torch.long).pin_memory()

    def pinned_new_index():
        return torch.arange(16, dtype=torch.long).pin_memory()

    def upload(index):
        return index.to(device, non_blocking=True)

    steps = {
        "torch.tensor(list).pin_memory() (new pinned block)": lambda: pinned_new_index(),
        "pinned index .to(cuda, non_blocking) (preallocated)": lambda: upload(preallocated_index),
        "new pinned index .to(cuda, non_blocking)": lambda: upload(pinned_new_index()),
        "index_select into the device staging buffer": lambda: torch.index_select(
            pages, 0, upload(preallocated_index), out=staging
        ),
        "D2H staging -> pinned chunk, non_blocking": lambda: chunk.copy_(staging, non_blocking=True),
        "torch.empty(pin_memory=True) of a chunk": lambda: torch.empty(16, 16, 2, 64, pin_memory=True),
    }
    for _ in range(2):  # the first round allocates (caching allocators); the second is what a long run sees
        rows = []
        for name, step in steps.items():
            torch.cuda.synchronize()
            torch.cuda._sleep(500_000_000)  # ~0.25 s on the compute stream
            copy_stream.wait_stream(torch.cuda.current_stream(device))
            began = time.perf_counter()
            with torch.cuda.stream(copy_stream):
                step()
            host_ms = 1000 * (time.perf_counter() - began)
            event = torch.cuda.Event()
            event.record(copy_stream)
            rows.append((name, host_ms, event.query()))
        torch.cuda.synchronize()
    print("| primitive (second round) | host ms | copy already done |\n|---|---|---|")
    for name, host_ms, done in rows:
        print(f"| {name} | {host_ms:.3f} | {done} |")


if __name__ == "__main__":
    main()
