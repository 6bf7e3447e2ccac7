"""The timing every kernel benchmark uses: the median of many timed launches (Triton's ``do_bench``, CUDA
events) for a callable, and CUDA events around back-to-back replays for a captured graph, whose launches
then cost no host time."""

from __future__ import annotations

from collections.abc import Callable

import torch


def kernel_ms(fn: Callable[[], object], rep_ms: int = 100) -> float:
    """Median milliseconds of one call of ``fn`` (warmed up; ``rep_ms`` of repetitions)."""
    import triton

    return triton.testing.do_bench(fn, rep=rep_ms, return_mode="median")


def captured(fn: Callable[[int], object], count: int) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``fn(0) .. fn(count - 1)`` back to back (warmed up once outside the capture)."""
    for i in range(count):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(count):
            fn(i)
    return graph


def graph_ms(replay: Callable[[], object], reps: int = 50) -> float:
    """Device time of one replay (``graph.replay``): CUDA events around ``reps`` back-to-back replays,
    after five warm ones."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(5):
        replay()
    start.record()
    for _ in range(reps):
        replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def per_call_us(fn: Callable[[int], object], count: int) -> float:
    """Microseconds a call of ``fn`` takes inside a graph of ``count`` calls (launch gaps gone)."""
    return graph_ms(captured(fn, count).replay) * 1e3 / count
