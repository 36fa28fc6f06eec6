"""`specdec cluster up|down|status`: the local multi-node Ray cluster from the command line, over
the public functions of ``specdec.cluster.local``."""

from __future__ import annotations

import argparse

from specdec.cluster.state import STATE_DIR_ENV


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `specdec cluster`."""
    parser.add_argument(
        "action",
        choices=["up", "down", "status"],
        help="up starts the head, draft and target nodes, down stops them, status describes them",
    )
    parser.add_argument(
        "--state-dir",
        help="where the cluster records its processes and logs "
        f"(default: ${STATE_DIR_ENV}, else ~/.specdec/cluster)",
    )
    parser.add_argument(
        "--gcs-redis",
        metavar="HOST:PORT",
        help="up: keep the GCS's tables in this running Redis (GCS fault tolerance), so the "
        "head can die and come back while serving goes on; adds a fourth node for the routers "
        "(default: none, the tables live in the head's memory)",
    )


def main(args: argparse.Namespace) -> int:
    """Starts, stops or describes the cluster recorded in --state-dir; prints one summary.

    Raises:
        RuntimeError: a node failed to start (up), or this process is connected to another
        Ray cluster (status).
    """
    from specdec.cluster import local

    if args.action == "up":
        info = local.up(args.state_dir, gcs_redis=args.gcs_redis)
        print(f"local cluster up at {info.address} ({len(info.nodes)} nodes)")
    elif args.action == "down":
        pids = local.down(args.state_dir)
        print(f"stopped {len(pids)} processes" if pids else "no local cluster was running")
    else:
        print(local.format_status(local.status(args.state_dir)))
    return 0
