"""Replica counts of every Serve deployment, polled from ``serve.status()`` in a subprocess
(specdec.bench.replicas reads them).

``serve.status()`` needs a Ray driver connection; a driver in the load generator's own process
would share its event loop's CPU and GIL with Ray's threads and pull Ray into a command that
otherwise only speaks gRPC. So a child process (``python -m specdec.bench.replica_monitor``)
connects once, polls every ``interval_s`` seconds and prints one JSON line per sample; the parent
reads those lines with asyncio, so its event loop never blocks on Ray.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import Mapping

from specdec.bench.replicas import replica_states
from specdec.config import APPLICATION


class ReplicaMonitor:
    """The latest replica states of one Serve application, from a polling child process.

    Args:
        ray_address: GCS address ("ip:port") of the Ray cluster.
        application: the Serve application whose deployments are counted.
        interval_s: seconds between two ``serve.status()`` calls.

    ``running`` is {deployment: RUNNING replica count}; ``states`` is {deployment: {state: n}};
    both are empty until the first sample. ``error`` holds the child's last error, if any.
    """

    def __init__(
        self, ray_address: str, application: str = APPLICATION, interval_s: float = 1.0
    ) -> None:
        self.ray_address = ray_address
        self.application = application
        self.interval_s = interval_s
        self.states: dict[str, dict[str, int]] = {}
        self.error: str | None = None
        self.samples = 0
        self._proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task | None = None
        self._first = asyncio.Event()

    @property
    def running(self) -> dict[str, int]:
        return {name: states.get("RUNNING", 0) for name, states in self.states.items()}

    async def start(self, timeout_s: float = 60.0) -> None:
        """Starts the child and waits for its first sample.

        Raises:
            RuntimeError: no sample within ``timeout_s`` seconds (e.g. Ray not reachable), with
                the child's error when it reported one. The child is stopped again.
        """
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "specdec.bench.replica_monitor",
            "--ray-address",
            self.ray_address,
            "--application",
            self.application,
            "--interval",
            str(self.interval_s),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )
        self._reader = asyncio.create_task(self._read())
        try:
            await asyncio.wait_for(self._first.wait(), timeout_s)
        except TimeoutError:
            await self.close()
            raise RuntimeError(
                f"no replica counts from Ray at {self.ray_address} within "
                f"{timeout_s:.0f} s: {self.error or 'no answer'}"
            ) from None
        if not self.states and self.error:
            await self.close()
            raise RuntimeError(f"replica counts unavailable: {self.error}")

    async def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        async for line in self._proc.stdout:
            try:
                sample = json.loads(line)
            except json.JSONDecodeError:
                continue  # a stray print of Ray's; samples are whole JSON lines
            if "error" in sample:
                self.error = sample["error"]
            else:
                self.states = sample["states"]
                self.samples += 1
            self._first.set()
        self._first.set()

    async def close(self) -> None:
        """Stops the child (our own process, by its pid) and the reader."""
        if self._proc is not None and self._proc.returncode is None:
            self._proc.terminate()
            try:
                await asyncio.wait_for(self._proc.wait(), 10.0)
            except TimeoutError:
                self._proc.kill()
                await self._proc.wait()
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)


def _poll(ray_address: str, application: str, interval_s: float) -> None:
    """The child: connect once, then print one JSON line per sample until the parent goes."""
    parent = os.getppid()

    def emit(record: Mapping) -> None:
        print(json.dumps(record), flush=True)

    try:
        import ray

        from specdec.cluster.processes import prepare_driver

        prepare_driver()  # a local cluster's auth mode and loopback address
        ray.init(
            address=ray_address, logging_level="ERROR", log_to_driver=False, configure_logging=False
        )
    except Exception as err:  # noqa: BLE001 - reported to the parent, which decides
        emit({"error": f"ray.init({ray_address!r}) failed: {type(err).__name__}: {err}"})
        return
    while os.getppid() == parent:  # re-parented: the load generator is gone, so are we
        try:
            emit({"t": time.time(), "states": replica_states(application)})
        except Exception as err:  # noqa: BLE001 - a transient controller hiccup
            emit({"error": f"serve.status() failed: {type(err).__name__}: {err}"})
        time.sleep(interval_s)


if __name__ == "__main__":
    cli = argparse.ArgumentParser(description=__doc__)
    cli.add_argument("--ray-address", required=True)
    cli.add_argument("--application", default=APPLICATION)
    cli.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    opts = cli.parse_args()
    with contextlib.suppress(KeyboardInterrupt, BrokenPipeError):
        _poll(opts.ray_address, opts.application, opts.interval)
