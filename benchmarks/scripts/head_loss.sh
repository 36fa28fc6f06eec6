#!/usr/bin/env bash
# The head killed under load (issue 44 item 4): a real redis-server keeps the GCS's tables, the
# tiny pair is served with a proxy on every node, `specdec loadtest` runs STAGES, and the head
# (every process of it) is SIGKILLed KILL_AT seconds in and started again DOWN_S seconds later.
# Prints the load test's summary; its JSON goes to OUT. Stops exactly what it started.
#   bash benchmarks/scripts/head_loss.sh [OUT.json]
set -euo pipefail
OUT=${1:-bench-results/head-loss.json}
STAGES=${STAGES:-8x120s} KILL_AT=${KILL_AT:-40} DOWN_S=${DOWN_S:-20} REDIS_PORT=${REDIS_PORT:-6391}
WORK=$(mktemp -d)
export SPECDEC_CLUSTER_DIR=$WORK/state
redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --dir "$WORK" >"$WORK/redis.log" 2>&1 &
REDIS_PID=$!
trap 'specdec cluster down >/dev/null || true; kill "$REDIS_PID" 2>/dev/null || true' EXIT
specdec cluster up --gcs-redis "127.0.0.1:$REDIS_PORT"
specdec tiny-models >/dev/null
TINY=~/.cache/specdec/tiny
specdec serve --local --draft-model "$TINY/draft" --target-model "$TINY/target" \
    --dtype float32 --draft-dtype float32 --set proxy_location=EveryNode
# No replica counts: the load generator must not be a Ray driver of a head that dies.
SPECDEC_CLUSTER_DIR=$WORK/none specdec loadtest --stages "$STAGES" --max-new-tokens 32 \
    --json "$OUT" &
LOAD_PID=$!
sleep "$KILL_AT"
python -c "from specdec.cluster.faults import kill_node as k; print('head killed:', len(k(None, 'head')), 'processes')"
sleep "$DOWN_S"
python -c "from specdec.cluster.faults import restart_node as r; print('head back: pid', r(None, 'head', wait_s=120).pid)"
wait "$LOAD_PID"
# The fault's timing and the machine go into the load test's JSON.
python - "$OUT" "$KILL_AT" "$DOWN_S" <<'PY'
import json, subprocess, sys
from specdec.device.hardware import describe_device
path, kill_at, down_s = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
report = json.load(open(path))
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
report["head_loss"] = {"killed_at_s": kill_at, "restarted_after_s": down_s,
                       "device": describe_device("cpu"), "commit": commit.stdout.strip()}
json.dump(report, open(path, "w"), indent=1)
print("head killed at", kill_at, "s, restarted", down_s, "s later;", describe_device("cpu"))
PY
