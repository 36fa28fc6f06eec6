"""Fixed-shape steps replayed as CUDA graphs: one capture per shape, then one launch a call.

A decode forward of a small model is a few hundred kernel launches whose arithmetic takes
microseconds; from Python each launch costs more than the kernel (the H200 measurement in
issue 41: a 3.5 ms compiled step took 21-77 ms eager). A CUDA graph records the launches once
per shape and replays them in one call (the technique of vLLM's and SGLang's model runners and
nano-vllm's, which capture one graph per padded batch size).

A step is a function of tensors whose shapes its key fixes. On a CUDA device, the first call of
a key warms the function up on a side stream, captures it into a graph over static copies of its
inputs, and every call copies its inputs into those and replays the graph; its outputs are the
graph's static tensors, valid until the next call of the same key (the caller copies what it
keeps). Elsewhere, and with capture off, the function simply runs: the same code either way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable

import torch

Step = Callable[..., tuple[torch.Tensor, ...]]


@dataclasses.dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...]


class StepGraphs:
    """Runs ``step(key, *inputs)`` per shape key, as a CUDA graph where ``capture`` is on.

    Args:
        step: a function of the key and tensors that never reads a tensor on the host (no
            .item(), no .tolist(), no data-dependent Python branch), returning a tuple of
            tensors.
        capture: record CUDA graphs (only on a CUDA device).
    """

    def __init__(self, step: Step, capture: bool) -> None:
        self._step = step
        self.capture = capture
        self._graphs: dict[Hashable, _Captured] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None

    def __call__(self, key: Hashable, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The step's outputs for ``inputs`` (on the step's device): with capture, the graph's
        static outputs, overwritten by the next call of the same key."""
        if not self.capture:
            return self._step(key, *inputs)
        captured = self._graphs.get(key)
        if captured is None:
            captured = self._graphs[key] = self._record(key, inputs)
        for static, given in zip(captured.inputs, inputs):
            static.copy_(given, non_blocking=True)
        captured.graph.replay()
        return captured.outputs

    @property
    def captured(self) -> list[Hashable]:
        """The keys recorded so far."""
        return list(self._graphs)

    def _record(self, key: Hashable, inputs: tuple[torch.Tensor, ...]) -> _Captured:
        static = tuple(given.clone() for given in inputs)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            # Warm-up outside the graph: lazy initialisation (cuBLAS workspaces, autotuning)
            # must not be recorded. It writes what the replay will write again.
            for _ in range(2):
                self._step(key, *static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            outputs = self._step(key, *static)
        return _Captured(graph, static, tuple(outputs))
