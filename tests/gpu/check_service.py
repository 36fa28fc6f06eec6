"""The service stage of tests/gpu/check.py: the whole service on the one GPU.

The local cluster (specdec.cluster.local, as `specdec serve --local` starts it) with the GPU on
its target node, deployments/config/one-gpu.yaml deployed with the random-weight pair (draft
and target replicas sharing the GPU by num_gpus 0.5 each), then requests through the gRPC
proxy one at a time, as `specdec bench --no-engine` sends them, at k = 0 and k = 4: tokens per
second and where a decode round's time goes, orchestration (transport, scheduling, the router's
own work) apart. Serve is shut down and exactly the cluster's processes are stopped afterwards
(LocalCluster; the parent stops them by pid too when this stage is killed).
"""

from __future__ import annotations

import time
from pathlib import Path

import yaml
from check_stages import Recorder, prompt_ids, say

ROOT = Path(__file__).resolve().parents[2]
ONE_GPU = ROOT / "deployments" / "config" / "one-gpu.yaml"
REQUESTS = 3  # per k, after one warm-up request


def serve_config(s: dict, pair: tuple[Path, Path], grpc_port: int, http_port: int) -> Path:
    """one-gpu.yaml with the pair, the settings' dtype and device, free ports, and (on a CPU)
    no GPU requests, written to the workdir."""
    raw = yaml.safe_load(ONE_GPU.read_text())
    raw["grpc_options"]["port"] = grpc_port
    raw["http_options"]["port"] = http_port
    app = next(a for a in raw["applications"] if a["name"] == "specdec")
    app["args"] |= {
        "draft_model": str(pair[0]),
        "target_model": str(pair[1]),
        "dtype": s["dtype"],
        "device": s["device"],
    }
    if not s["device"].startswith("cuda"):
        for deployment in app["deployments"]:
            deployment["ray_actor_options"].pop("num_gpus", None)
    path = Path(s["workdir"]) / "one-gpu-check.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def run(s: dict, rec: Recorder, pair: tuple[Path, Path]) -> None:
    import ray
    from ray import serve
    from transformers import AutoTokenizer

    from specdec.client import SpecdecClient, build_request
    from specdec.cluster.local import LocalCluster
    from specdec.cluster.processes import free_ports
    from specdec.decoding.stats import SpeculationStats
    from specdec.deployments.deploy import deploy

    grpc_port, http_port = free_ports(2)
    config = serve_config(s, pair, grpc_port, http_port)
    gpus = 1 if s["device"].startswith("cuda") else 0
    start = time.perf_counter()
    with LocalCluster(Path(s["workdir"]) / "cluster", target_gpus=gpus) as info:
        rec.put("service", cluster_up_s=round(time.perf_counter() - start, 1), config=str(config))
        say(f"service: cluster up at {info.address}; deploying {config.name}")
        try:
            start = time.perf_counter()
            deploy(config, address=info.address, timeout_s=max(s.get("limit_s", 150) - 40, 30))
            rec.put("service", deploy_s=round(time.perf_counter() - start, 1))
            say(f"service: running after {time.perf_counter() - start:.0f} s")
            tokenizer = AutoTokenizer.from_pretrained(pair[1])
            ids = prompt_ids(len(tokenizer), 16 if s["quick"] else 128, seed=2)
            text = tokenizer.decode(ids)
            runs: dict[str, dict] = {}
            with SpecdecClient(f"127.0.0.1:{grpc_port}", timeout_s=60) as client:
                for k in (0, 4):
                    request = build_request(
                        text, max_new_tokens=s["new_tokens"], num_speculative_tokens=k
                    )
                    client.generate(request)  # warm-up: the session, graphs, connections
                    stats = [
                        SpeculationStats.from_proto(client.generate(request).stats)
                        for _ in range(REQUESTS)
                    ]
                    runs[f"k{k}"] = round_figures(SpeculationStats.total(stats), len(stats))
                    rec.put("service", runs=runs)
                    say(f"service k={k}: {runs[f'k{k}']}")
        finally:
            if ray.is_initialized():
                serve.shutdown()
                ray.shutdown()


def round_figures(total, requests: int) -> dict:
    """A k's figures over its requests (SpeculationStats summed): decode tokens/s and the
    milliseconds of a decode round spent drafting, verifying and orchestrating."""
    return {
        "requests": requests,
        "decode_rounds": total.decode_rounds,
        "tokens_per_second": round(total.tokens_per_second, 2),
        "decode_tokens_per_second": round(total.decode_tokens_per_second, 2),
        "acceptance_rate": round(total.acceptance_rate, 3),
        "draft_ms_per_round": round(1e3 * total.draft_s_per_round, 3),
        "verify_ms_per_round": round(1e3 * total.verify_s_per_round, 3),
        "orchestration_ms_per_round": round(1e3 * total.orchestration_s_per_round, 3),
        "orchestration_share": round(total.orchestration_share, 3),
    }
