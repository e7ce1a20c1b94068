#!/usr/bin/env bash
# The load test of docs/SERVING.md ("Load test"): plain decoding, the default server (method
# combined), the draft model at the server's K, a fixed K-by-load table and `--k-by-load auto`, one
# server at a time on the default pair, each measured by the same load test. Writes bench-results/loadtest/<name>.json and prints a summary.
# Each level runs on a fresh server (a server's drafters learn from its earlier answers, and the
# levels send the same prompts). Keep the machine quiet while it runs (about 5 minutes a server on 2 cores).
#
#   scripts/loadtest_k_by_load.sh [SERVER ...]   # none, default, draft_model, table, auto (default: all, in that order)
#   PORT=8011 (default) picks the port; LEVELS="1 2" (default "1 2 4 8") the client counts;
#   WORKLOAD=code (default code,chat) the prompts.
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${PORT:-8011}
BIN=.venv/bin
OUT=bench-results/loadtest
mkdir -p "$OUT"

read -ra LEVELS <<< "${LEVELS:-1 2 4 8}"

level() {  # name, clients, then the serve flags: one level on a fresh server, whose history of
    local name=$1 clients=$2  # answers holds none of the prompts (see specdecode/server/loadtest.py)
    shift 2
    "$BIN/specdecode" serve --port "$PORT" --max-concurrency 8 --log-level warning "$@" &
    local pid=$!
    trap 'kill $pid 2>/dev/null || true' EXIT
    for _ in $(seq 600); do
        curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
        kill -0 $pid 2>/dev/null || { echo "server $name exited" >&2; exit 1; }
        sleep 1
    done
    "$BIN/python" -m specdecode.server.loadtest --url "http://127.0.0.1:$PORT" --concurrency "$clients" \
        --requests 16 --max-tokens 64 --ignore-eos --workload "${WORKLOAD:-code,chat}" --json > "$OUT/$name.$clients.json"
    kill $pid
    wait $pid 2>/dev/null || true
    trap - EXIT
}

run() {  # name, then the serve flags; writes $OUT/name.json with every level
    local name=$1
    shift
    for clients in "${LEVELS[@]}"; do level "$name" "$clients" "$@"; done
    "$BIN/python" - "$OUT" "$name" "${LEVELS[@]}" <<'EOF'
import json, pathlib, sys
out, name, levels = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
parts = [json.loads((out / f"{name}.{c}.json").read_text()) for c in levels]
merged = {**parts[0], "levels": [lvl for part in parts for lvl in part["levels"]]}
(out / f"{name}.json").write_text(json.dumps(merged))
for c in levels:
    (out / f"{name}.{c}.json").unlink()
EOF
    echo "$name done"
}

SERVERS=("$@")
[ ${#SERVERS[@]} -gt 0 ] || SERVERS=(none default draft_model table auto)
for name in "${SERVERS[@]}"; do
    case $name in
        none) run none --method none ;;
        default) run default ;;
        draft_model) run draft_model --method draft_model ;;
        table) run table --method draft_model --k-by-load 1-2:12,3-4:6,5-:0 ;;
        auto) run auto --method draft_model --k-by-load auto ;;
        *) echo "unknown server $name (none, default, draft_model, table, auto)" >&2; exit 2 ;;
    esac
done
"$BIN/python" - "$OUT" "${SERVERS[@]}" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
plain = {lvl["concurrency"]: lvl for lvl in json.loads((out / "none.json").read_text())["levels"]}
for name in dict.fromkeys(sys.argv[2:]):
    for lvl in json.loads((out / f"{name}.json").read_text())["levels"]:
        base = plain[lvl["concurrency"]]["output_tokens_per_s"]
        print(f"{name:12s} {lvl['concurrency']:2d} clients  {lvl['output_tokens_per_s']:6.1f} tok/s  "
              f"{lvl['output_tokens_per_s'] / base:5.2f}x  p50 {lvl['latency_p50_s']:6.2f} s  "
              f"p99 {lvl['latency_p99_s']:6.2f} s  TTFT p50 {lvl['ttft_p50_s']:5.2f} s  "
              f"acceptance length {lvl['mean_acceptance_length']:.2f}")
EOF
