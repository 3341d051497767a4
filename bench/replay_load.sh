#!/usr/bin/env bash
# Load-test recipe with recorded traffic: the mock upstream (fixed latency + jitter, token rate
# for streams), ctxproxy with Redis and both caches on, and `ctxproxy replay` of the requests
# of ../shared/data/ in open loop at increasing rates, each rate against the mock directly and
# through ctxproxy. It stops at the first rate that breaks: error rate over MAX_ERROR_RATE, p99
# added (proxy minus direct) over MAX_ADDED_P99_MS, or less than 95% of the asked rate achieved.
#
# Every request carries its own `user` (replay --vary-user) and dedup is scoped by user: the
# caches are consulted in Redis on every request but never answer, so each request runs the
# whole pipeline and the model call (cache hits excluded).
#
# Environment (defaults in brackets):
#   RATES ["250 500 750 1000 1250 1500 2000"]  STEP_SECS [10]  WARMUP_SECS [5]
#   LATENCY_MS [50]  JITTER_MS [20]  TOKENS_PER_SEC [400]   - mock-upstream options
#   STREAM [recorded]                                        - replay --stream recorded|on|off
#   MAX_ADDED_P99_MS [5]  MAX_ERROR_RATE [0.01]
#   DATA [../shared/data]  FILES [the four request files of DATA]
#   BENCH_CONFIG [config.toml]  RECORD [0] (1: [record] on, every request, to the work dir)
#   MOCK_PORT [19300]  PROXY_PORT [19380]  REDIS_URL [redis://127.0.0.1:6379]
#   SKIP_BUILD [0]  CTXPROXY_BIN [target/release/ctxproxy]  RESULTS_DIR [bench/results]
#
# Output: one table row per rate, the pipeline time percentiles from ctxproxy's metrics, and
# bench/results/replay-load-<timestamp>.json with every replay report.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

RATES=${RATES:-"250 500 750 1000 1250 1500 2000"}
STEP_SECS=${STEP_SECS:-10}
WARMUP_SECS=${WARMUP_SECS:-5}
LATENCY_MS=${LATENCY_MS:-50}
JITTER_MS=${JITTER_MS:-20}
TOKENS_PER_SEC=${TOKENS_PER_SEC:-400}
STREAM=${STREAM:-recorded}
MAX_ADDED_P99_MS=${MAX_ADDED_P99_MS:-5}
MAX_ERROR_RATE=${MAX_ERROR_RATE:-0.01}
DATA=${DATA:-$ROOT/../shared/data}
BENCH_CONFIG=${BENCH_CONFIG:-config.toml}
RECORD=${RECORD:-0}
REDIS_URL=${REDIS_URL:-redis://127.0.0.1:6379}
SKIP_BUILD=${SKIP_BUILD:-0}
CTXPROXY_BIN=${CTXPROXY_BIN:-${CARGO_TARGET_DIR:-$ROOT/target}/release/ctxproxy}
# The binary path is not a config override: the proxy must not inherit it.
export -n CTXPROXY_BIN
RESULTS_DIR=${RESULTS_DIR:-$ROOT/bench/results}

log() { printf '[replay-load] %s\n' "$*" >&2; }
die() { printf '[replay-load] error: %s\n' "$*" >&2; exit 1; }

if [ -z "${FILES:-}" ]; then
  FILES=""
  for f in tau_bench_airline_gpt4o github_api_tool_results chatgpt_export_chats toolbench_examples; do
    [ -f "$DATA/$f.jsonl" ] && FILES="$FILES $DATA/$f.jsonl"
  done
fi
[ -n "${FILES// /}" ] || die "no request files in $DATA (set DATA or FILES)"
command -v python3 >/dev/null || die "python3 is needed"
command -v curl >/dev/null || die "curl is needed"
if [ "$SKIP_BUILD" != 1 ]; then
  log "cargo build --release"
  cargo build --release >&2
fi
[ -x "$CTXPROXY_BIN" ] || die "no binary at $CTXPROXY_BIN"

port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
free_port() {
  local p
  for ((p = $1; p < $1 + 100; p++)); do
    [ "$p" = "${2:-}" ] && continue
    port_busy "$p" || { echo "$p"; return; }
  done
  die "no free port in $1..$(($1 + 99))"
}
MOCK_PORT=${MOCK_PORT:-$(free_port 19300)}
PROXY_PORT=${PROXY_PORT:-$(free_port 19380 "$MOCK_PORT")}

WORK=$(mktemp -d "${TMPDIR:-/tmp}/ctxproxy-replay-load.XXXXXX")
MOCK_PID="" PROXY_PID=""
cleanup() {
  local pid
  for pid in $PROXY_PID $MOCK_PID; do kill "$pid" 2>/dev/null || true; done
  for pid in $PROXY_PID $MOCK_PID; do wait "$pid" 2>/dev/null || true; done
  log "logs and reports in $WORK"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

wait_ready() {
  local name=$1 pid=$2 url=$3 i
  for ((i = 0; i < 100; i++)); do
    kill -0 "$pid" 2>/dev/null || { tail -n 20 "$WORK/$name.log" >&2; die "$name exited"; }
    curl -fsS -o /dev/null --max-time 1 "$url" 2>/dev/null && return 0
    sleep 0.1
  done
  tail -n 20 "$WORK/$name.log" >&2
  die "$name does not answer on $url"
}

log "mock on :$MOCK_PORT (latency ${LATENCY_MS} ms + up to ${JITTER_MS} ms, ${TOKENS_PER_SEC} tokens/s), proxy on :$PROXY_PORT"
"$CTXPROXY_BIN" mock-upstream --listen "127.0.0.1:$MOCK_PORT" --latency-ms "$LATENCY_MS" \
  --jitter-ms "$JITTER_MS" --tokens-per-sec "$TOKENS_PER_SEC" >"$WORK/mock.log" 2>&1 &
MOCK_PID=$!
wait_ready mock "$MOCK_PID" "http://127.0.0.1:$MOCK_PORT/v1/models"

record_path=""
[ "$RECORD" = 1 ] && record_path="$WORK/recording.jsonl"
env -u RUST_LOG CTXPROXY_LOG_LEVEL=warn \
  CTXPROXY_UPSTREAM_BASE_URL="http://127.0.0.1:$MOCK_PORT/v1" \
  CTXPROXY_STORE_REDIS_URL="$REDIS_URL" \
  CTXPROXY_STORE_KEY_PREFIX="replay-load:$$:$RANDOM:" \
  CTXPROXY_CACHE_DEDUP_ENABLED=true CTXPROXY_CACHE_DEDUP_SCOPE=user \
  CTXPROXY_PIPELINE_BUDGET_ON_EXCEED=forward \
  CTXPROXY_RECORD_PATH="$record_path" \
  "$CTXPROXY_BIN" serve --config "$BENCH_CONFIG" --listen "127.0.0.1:$PROXY_PORT" \
  >"$WORK/proxy.log" 2>&1 &
PROXY_PID=$!
wait_ready proxy "$PROXY_PID" "http://127.0.0.1:$PROXY_PORT/readyz"
curl -fsS "http://127.0.0.1:$PROXY_PORT/metrics" | grep -q '^ctxproxy_store_up 1' ||
  die "the proxy does not reach Redis at $REDIS_URL"

# replay NAME URL RATE SECS: one open-loop run; its JSON report goes to $WORK/NAME.json.
replay() {
  # shellcheck disable=SC2086
  "$CTXPROXY_BIN" replay $FILES --target "$2" --rate "$3" --duration "$4s" --vary-user \
    --stream "$STREAM" --timeout-secs 30 --output "$WORK/$1.json" >"$WORK/$1.txt" 2>&1 ||
    { cat "$WORK/$1.txt" >&2; die "replay $1 failed"; }
  kill -0 "$MOCK_PID" 2>/dev/null || die "the mock died during $1"
  kill -0 "$PROXY_PID" 2>/dev/null || die "the proxy died during $1"
}

log "warm-up: ${WARMUP_SECS}s at 200 req/s through the proxy"
replay warmup "http://127.0.0.1:$PROXY_PORT" 200 "$WARMUP_SECS"
curl -fsS "http://127.0.0.1:$PROXY_PORT/metrics" >"$WORK/metrics-before.txt"

printf '%-6s | %-24s | %-24s | %-9s | %-7s | %s\n' "rate" "direct p50/p99 ms" "ctxproxy p50/p99 ms" "p99 added" "errors" "achieved"
for rate in $RATES; do
  replay "direct-$rate" "http://127.0.0.1:$MOCK_PORT/v1" "$rate" "$STEP_SECS"
  replay "proxy-$rate" "http://127.0.0.1:$PROXY_PORT" "$rate" "$STEP_SECS"
  verdict=$(python3 - "$WORK/direct-$rate.json" "$WORK/proxy-$rate.json" "$rate" \
    "$MAX_ADDED_P99_MS" "$MAX_ERROR_RATE" <<'PY'
import json, sys
direct, proxy = (json.load(open(p)) for p in sys.argv[1:3])
rate, max_added, max_errors = (float(x) for x in sys.argv[3:6])
p = proxy["uncached_latency_ms"]
added = p["p99"] - direct["latency_ms"]["p99"]
errors = proxy["errors"] / max(proxy["requests"], 1)
achieved = proxy["throughput_rps"]
ok = added <= max_added and errors <= max_errors and achieved >= 0.95 * rate
print(f'{rate:<6.0f} | {direct["latency_ms"]["p50"]:>8.1f} / {direct["latency_ms"]["p99"]:<13.1f} | '
      f'{p["p50"]:>8.1f} / {p["p99"]:<13.1f} | {added:>6.1f} ms | {100 * errors:>5.2f}% | '
      f'{achieved:.0f} req/s {"" if ok else "<- breaks"}')
print("ok" if ok else "broken")
PY
  )
  head -n1 <<<"$verdict"
  [ "$(tail -n1 <<<"$verdict")" = ok ] || break
done

curl -fsS "http://127.0.0.1:$PROXY_PORT/metrics" >"$WORK/metrics-after.txt"
mkdir -p "$RESULTS_DIR"
OUT=$RESULTS_DIR/replay-load-$(date -u +%Y%m%dT%H%M%SZ).json
python3 - "$WORK" "$OUT" <<'PY'
import glob, json, os, re, sys
work, out = sys.argv[1:3]
def buckets(path):
    values = {}
    for line in open(path):
        m = re.match(r'ctxproxy_pipeline_duration_seconds_bucket\{le="([^"]+)"\} (\S+)', line)
        if m:
            values[m.group(1)] = float(m.group(2))
    return values
before, after = buckets(f"{work}/metrics-before.txt"), buckets(f"{work}/metrics-after.txt")
total = after.get("+Inf", 0) - before.get("+Inf", 0)
shares = {}
for le in ["0.00025", "0.0005", "0.001", "0.0025", "0.005", "0.01"]:
    if total > 0 and le in after:
        shares[le] = (after[le] - before.get(le, 0)) / total
print("pipeline time over the measured runs (%d requests): %s" % (total, ", ".join(
    f"{100 * v:.1f}% under {float(k) * 1e3:g} ms" for k, v in shares.items())))
reports = {os.path.basename(p)[:-5]: json.load(open(p)) for p in sorted(glob.glob(f"{work}/*.json"))}
json.dump({"reports": reports, "pipeline_share_under_seconds": shares}, open(out, "w"), indent=1)
print(f"reports written to {out}")
PY
