"""The soak's faults: the newest TargetModel replica killed (``ray.kill``), the draft pool's
node SIGKILLed and started again (specdec.cluster.faults), each in the background."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from specdec.bench.replicas import DRAFT, TARGET, serve_replicas


class Faults:
    """The soak's faults, each run in the background (``start``) so the load's clock never
    waits on one; ``events`` gets one record per fault: {"name", "t", "t_done", "ok", "what",
    ...} (``error`` when it failed)."""

    def __init__(self, state_dir: Path, clock: Callable[[], float]) -> None:
        self.state_dir, self.clock = state_dir, clock
        self.events: list[dict] = []
        self._threads: dict[str, threading.Thread] = {}

    def start(self, name: str, action: Callable[[], dict]) -> None:
        thread = threading.Thread(target=self._record, args=(name, action), daemon=True)
        self._threads[name] = thread
        thread.start()

    def done(self, name: str) -> bool:
        return name in self._threads and not self._threads[name].is_alive()

    def skip(self, name: str, why: str) -> None:
        t = round(self.clock(), 2)
        self.events.append({"name": name, "t": t, "t_done": t, "ok": False, "error": why})

    def join(self, timeout_s: float) -> None:
        for thread in self._threads.values():
            thread.join(timeout_s)

    def _record(self, name: str, action: Callable[[], dict]) -> None:
        event = {"name": name, "t": round(self.clock(), 2)}
        try:
            event.update(action(), ok=True)
        except Exception as err:  # noqa: BLE001 - a fault that did not happen fails a check
            event.update(ok=False, error=f"{type(err).__name__}: {err}")
        event["t_done"] = round(self.clock(), 2)
        self.events.append(event)

    @staticmethod
    def kill_target() -> dict:
        """ray.kill of the newest RUNNING TargetModel replica (the one scaling up added)."""
        import ray

        running = [
            r for r in serve_replicas() if r["deployment"] == TARGET and r["state"] == "RUNNING"
        ]
        if len(running) < 2:
            raise RuntimeError(f"TargetModel has {len(running)} RUNNING replicas, not 2")
        victim = max(running, key=lambda r: r["start_time_s"] or 0.0)
        ray.kill(ray.get_actor(victim["actor_name"], namespace="serve"), no_restart=True)
        return {"what": f"replica {victim['replica_id']} (pid {victim['pid']})", **victim}

    def kill_draft(self) -> dict:
        from specdec.cluster.faults import kill_node

        before = [r["replica_id"] for r in serve_replicas() if r["deployment"] == DRAFT]
        pids = kill_node(self.state_dir, "draft")
        return {"what": f"{len(pids)} processes", "pids": pids, "draft_replicas": before}

    def restart_draft(self) -> dict:
        from specdec.cluster.faults import restart_node

        node = restart_node(self.state_dir, "draft")
        return {"what": f"node pid {node.pid} alive", "pid": node.pid}
