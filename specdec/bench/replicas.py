"""Serve's replica state, read in one place: the deployment names, the replica counts by state
(``serve.status()``) and each replica's details (Serve's instance details: actor, pid, start).

Both readers need this process connected to Ray (``ray.init``), and import Ray inside the call;
specdec.bench.replica_monitor polls the counts from a child process for a command that must
not connect itself.
"""

from __future__ import annotations

from specdec.config import APPLICATION

DRAFT, TARGET, ROUTER = "DraftModel", "TargetModel", "SpeculativeRouter"
DEPLOYMENTS = (DRAFT, TARGET, ROUTER)


def replica_states(application: str = APPLICATION) -> dict[str, dict[str, int]]:
    """{deployment: {replica state: count}} of one application, from ``serve.status()``; an
    application that does not exist (yet) gives {}."""
    from ray import serve

    app = serve.status().applications.get(application)
    if app is None:
        return {}
    return {
        name: {
            str(getattr(state, "value", state)): count for state, count in d.replica_states.items()
        }
        for name, d in app.deployments.items()
    }


def serve_replicas(application: str = APPLICATION) -> list[dict]:
    """Every replica of the application from Serve's details: deployment, replica_id,
    actor_name, pid, state, start_time_s (epoch s); [] when the application does not exist."""
    from ray import serve
    from ray.serve.schema import ServeInstanceDetails

    details = ServeInstanceDetails(**serve.context._get_global_client().get_serve_details())
    app = details.applications.get(application)
    if app is None:
        return []
    return [
        {
            "deployment": name,
            "replica_id": r.replica_id,
            "actor_name": r.actor_name,
            "pid": r.pid,
            "state": str(getattr(r.state, "value", r.state)),
            "start_time_s": r.start_time_s,
        }
        for name, d in app.deployments.items()
        for r in d.replicas
    ]
