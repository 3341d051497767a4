#!/usr/bin/env bash
# Load test: ctxproxy in front of the mock upstream vs. the mock upstream directly, on loopback.
#
#   (a) one connection, back to back (wrk -t1 -c1 --latency): p50 / p99 of each, and what the
#       proxy adds (proxy minus direct);
#   (b) 32 connections (wrk -t2 -c32 --latency): requests/s and p99 of each.
#
# Each measurement runs RUNS times (alternating which target goes first); the medians are
# reported in a table and written as JSON to bench/results/load-<timestamp>.json.
#
# Environment (defaults in brackets):
#   RUNS [3]  SINGLE_SECS [10]  MULTI_SECS [15]  WARMUP_SECS [2]
#   MULTI_THREADS [2]  MULTI_CONNS [32]
#   MOCK_PORT [19100]  PROXY_PORT [19180]  - a default port that is taken is replaced by the
#                                            next free one; a port you set must be free.
#   MOCK_LATENCY_MS [0]                    - mock-upstream --latency-ms
#   BENCH_CONFIG [config.toml]             - proxy config (CTXPROXY_* env overrides apply)
#   SKIP_BUILD [0]   CTXPROXY_BIN [target/release/ctxproxy]
#   RESULTS_DIR [bench/results]
#   TARGET_ADDED_P50_US [100]  TARGET_ADDED_P99_US [500]  TARGET_PROXY_RPS [10000]
#   STRICT [0]                             - 1: exit 3 when a target is missed
#
# Quick run:  RUNS=1 SINGLE_SECS=3 MULTI_SECS=3 WARMUP_SECS=1 bench/load.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

RUNS=${RUNS:-3}
SINGLE_SECS=${SINGLE_SECS:-10}
MULTI_SECS=${MULTI_SECS:-15}
WARMUP_SECS=${WARMUP_SECS:-2}
MULTI_THREADS=${MULTI_THREADS:-2}
MULTI_CONNS=${MULTI_CONNS:-32}
MOCK_LATENCY_MS=${MOCK_LATENCY_MS:-0}
BENCH_CONFIG=${BENCH_CONFIG:-config.toml}
SKIP_BUILD=${SKIP_BUILD:-0}
CTXPROXY_BIN=${CTXPROXY_BIN:-${CARGO_TARGET_DIR:-$ROOT/target}/release/ctxproxy}
# The binary path is not a config override: the proxy must not inherit it.
export -n CTXPROXY_BIN
RESULTS_DIR=${RESULTS_DIR:-$ROOT/bench/results}
TARGET_ADDED_P50_US=${TARGET_ADDED_P50_US:-100}
TARGET_ADDED_P99_US=${TARGET_ADDED_P99_US:-500}
TARGET_PROXY_RPS=${TARGET_PROXY_RPS:-10000}
STRICT=${STRICT:-0}
LUA=$ROOT/bench/chat.lua
PATH_CHAT=/v1/chat/completions

log() { printf '[load] %s\n' "$*" >&2; }
die() { printf '[load] error: %s\n' "$*" >&2; exit 1; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo -n "$@"; fi; }

for v in RUNS SINGLE_SECS MULTI_SECS WARMUP_SECS MULTI_THREADS MULTI_CONNS MOCK_LATENCY_MS; do
  [[ ${!v} =~ ^[0-9]+$ ]] || die "$v must be a whole number, got '${!v}'"
done
[ "$RUNS" -ge 1 ] || die "RUNS must be at least 1"

# --- tools -----------------------------------------------------------------------------------
if ! command -v wrk >/dev/null; then
  log "wrk not found, installing it with apt-get"
  as_root apt-get install -y wrk >/dev/null ||
    { as_root apt-get update >/dev/null && as_root apt-get install -y wrk >/dev/null; } ||
    die "cannot install wrk"
fi
command -v curl >/dev/null || die "curl is needed"

if [ "$SKIP_BUILD" != 1 ]; then
  log "cargo build --release"
  cargo build --release >&2
fi
[ -x "$CTXPROXY_BIN" ] || die "no binary at $CTXPROXY_BIN"

# --- ports -----------------------------------------------------------------------------------
port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
# pick_port NAME DEFAULT [AVOID]: the port in $NAME if set (must be free), else the first free
# one from DEFAULT on.
pick_port() {
  local name=$1 default=$2 avoid=${3:-} p
  if [ -n "${!name:-}" ]; then
    p=${!name}
    port_busy "$p" && die "$name=$p is already in use"
    echo "$p"
    return
  fi
  for ((p = default; p < default + 100; p++)); do
    [ "$p" = "$avoid" ] && continue
    port_busy "$p" || { echo "$p"; return; }
  done
  die "no free port in $default..$((default + 99))"
}
MOCK_PORT=$(pick_port MOCK_PORT 19100)
PROXY_PORT=$(pick_port PROXY_PORT 19180 "$MOCK_PORT")
[ "$MOCK_PORT" != "$PROXY_PORT" ] || die "MOCK_PORT and PROXY_PORT are the same"
DIRECT_URL=http://127.0.0.1:$MOCK_PORT$PATH_CHAT
PROXY_URL=http://127.0.0.1:$PROXY_PORT$PATH_CHAT

# --- processes -------------------------------------------------------------------------------
WORK=$(mktemp -d "${TMPDIR:-/tmp}/ctxproxy-load.XXXXXX")
MOCK_PID="" PROXY_PID=""
# keep_logs: keep $WORK (server logs, wrk output) for a look after a failure.
keep_logs() { touch "$WORK/.keep"; }
cleanup() {
  local pid
  for pid in $PROXY_PID $MOCK_PID; do
    kill "$pid" 2>/dev/null || true
  done
  for pid in $PROXY_PID $MOCK_PID; do
    wait "$pid" 2>/dev/null || true
  done
  if [ -e "$WORK/.keep" ]; then log "logs kept in $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# wait_ready NAME PID URL: until URL answers 2xx (10 s at most) or the process is gone.
wait_ready() {
  local name=$1 pid=$2 url=$3 i
  for ((i = 0; i < 100; i++)); do
    kill -0 "$pid" 2>/dev/null || { keep_logs; tail -n 20 "$WORK/$name.log" >&2; die "$name exited"; }
    curl -fsS -o /dev/null --max-time 1 "$url" 2>/dev/null && return 0
    sleep 0.1
  done
  keep_logs
  tail -n 20 "$WORK/$name.log" >&2
  die "$name does not answer on $url"
}

log "mock upstream on 127.0.0.1:$MOCK_PORT, proxy on 127.0.0.1:$PROXY_PORT"
"$CTXPROXY_BIN" mock-upstream --listen "127.0.0.1:$MOCK_PORT" --latency-ms "$MOCK_LATENCY_MS" \
  >"$WORK/mock.log" 2>&1 &
MOCK_PID=$!
wait_ready mock "$MOCK_PID" "http://127.0.0.1:$MOCK_PORT/v1/models"

env -u RUST_LOG CTXPROXY_LOG_LEVEL=warn \
  CTXPROXY_UPSTREAM_BASE_URL="http://127.0.0.1:$MOCK_PORT/v1" \
  "$CTXPROXY_BIN" serve --config "$BENCH_CONFIG" --listen "127.0.0.1:$PROXY_PORT" \
  >"$WORK/proxy.log" 2>&1 &
PROXY_PID=$!
wait_ready proxy "$PROXY_PID" "http://127.0.0.1:$PROXY_PORT/healthz"

# Smoke request with the exact wrk body: both targets must answer 200 with a chat completion.
BODY=$(sed -n 's/^wrk\.body = \[\[\(.*\)\]\]$/\1/p' "$LUA")
[ -n "$BODY" ] || die "cannot read wrk.body from $LUA"
for url in "$DIRECT_URL" "$PROXY_URL"; do
  answer=$(curl -sS --max-time 5 -w '\n%{http_code}' -H 'content-type: application/json' \
    --data-binary "$BODY" "$url") || die "smoke request to $url failed"
  [ "${answer##*$'\n'}" = 200 ] && [[ $answer == *'"chat.completion"'* ]] ||
    { keep_logs; die "smoke request to $url: unexpected answer: $answer"; }
done

# --- measuring -------------------------------------------------------------------------------
RAW=$WORK/wrk.txt
# bench THREADS CONNS SECS URL: runs wrk, prints its BENCH line.
bench() {
  local out line
  out=$(wrk -t"$1" -c"$2" -d"$3"s --latency -s "$LUA" "$4") || { keep_logs; die "wrk failed: $out"; }
  printf '### wrk -t%s -c%s -d%ss %s\n%s\n' "$1" "$2" "$3" "$4" "$out" >>"$RAW"
  line=$(grep -m1 '^BENCH ' <<<"$out") || { keep_logs; die "no BENCH line from wrk: $out"; }
  kill -0 "$MOCK_PID" 2>/dev/null || { keep_logs; die "mock upstream died during the run"; }
  kill -0 "$PROXY_PID" 2>/dev/null || { keep_logs; die "proxy died during the run"; }
  echo "${line#BENCH }"
}
# field LINE KEY: the value of KEY=value in a BENCH line.
field() { awk -v k="$2" '{ for (i = 1; i <= NF; i++) { split($i, kv, "="); if (kv[1] == k) { print kv[2]; exit } } }' <<<"$1"; }

declare -A LINES # "<scenario>_<target>" → newline-separated BENCH lines (one per run)
NON2XX=0 SOCKERR=0
# scenario NAME THREADS CONNS SECS
scenario() {
  local name=$1 t=$2 c=$3 secs=$4 run target line order url
  if [ "$WARMUP_SECS" -gt 0 ]; then
    log "$name: warm-up ${WARMUP_SECS}s each"
    bench "$t" "$c" "$WARMUP_SECS" "$DIRECT_URL" >/dev/null
    bench "$t" "$c" "$WARMUP_SECS" "$PROXY_URL" >/dev/null
  fi
  for ((run = 1; run <= RUNS; run++)); do
    if ((run % 2)); then order="direct proxy"; else order="proxy direct"; fi
    for target in $order; do
      if [ "$target" = direct ]; then url=$DIRECT_URL; else url=$PROXY_URL; fi
      line=$(bench "$t" "$c" "$secs" "$url")
      LINES[${name}_$target]+="$line"$'\n'
      NON2XX=$((NON2XX + $(field "$line" non2xx)))
      SOCKERR=$((SOCKERR + $(field "$line" err_connect) + $(field "$line" err_read) + \
        $(field "$line" err_write) + $(field "$line" err_timeout)))
      log "$name run $run/$RUNS $(printf '%-6s' "$target") rps=$(field "$line" rps) p50=$(field "$line" p50_us)us p99=$(field "$line" p99_us)us non2xx=$(field "$line" non2xx)"
    done
  done
}
# median KEY FIELD: median over the runs of one scenario/target.
median() {
  printf '%s' "${LINES[$1]}" | while IFS= read -r l; do [ -n "$l" ] && field "$l" "$2"; done |
    sort -g | awk '{ v[NR] = $1 } END { if (NR == 0) exit 1; m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2; printf "%.10g\n", m }'
}
# runs_json KEY: the runs of one scenario/target as a JSON array of objects.
runs_json() {
  printf '%s' "${LINES[$1]}" | awk 'NF { printf "%s{", (n++ ? "," : ""); for (i = 1; i <= NF; i++) { split($i, kv, "="); printf "%s\"%s\":%s", (i > 1 ? "," : ""), kv[1], kv[2] } printf "}" } END { print "" }' | sed 's/^/[/; s/$/]/'
}

START=$(date -u +%Y-%m-%dT%H:%M:%SZ)
STAMP=$(date -u +%Y%m%dT%H%M%SZ)
scenario single 1 1 "$SINGLE_SECS"
scenario multi "$MULTI_THREADS" "$MULTI_CONNS" "$MULTI_SECS"

# --- results ---------------------------------------------------------------------------------
s_d50=$(median single_direct p50_us) s_d99=$(median single_direct p99_us)
s_p50=$(median single_proxy p50_us) s_p99=$(median single_proxy p99_us)
s_drps=$(median single_direct rps) s_prps=$(median single_proxy rps)
m_drps=$(median multi_direct rps) m_d50=$(median multi_direct p50_us) m_d99=$(median multi_direct p99_us)
m_prps=$(median multi_proxy rps) m_p50=$(median multi_proxy p50_us) m_p99=$(median multi_proxy p99_us)
calc() { awk "BEGIN { printf \"%.10g\n\", $1 }"; }
add50=$(calc "$s_p50 - $s_d50") add99=$(calc "$s_p99 - $s_d99")
rps_ratio=$(calc "$m_prps / $m_drps")
ok() { awk "BEGIN { exit !($1) }" && echo true || echo false; }
t_add50=$(ok "$add50 <= $TARGET_ADDED_P50_US")
t_add99=$(ok "$add99 <= $TARGET_ADDED_P99_US")
t_rps=$(ok "$m_prps >= $TARGET_PROXY_RPS")
verdict() { [ "$1" = true ] && echo met || echo MISSED; }
ms() { awk "BEGIN { printf \"%.3f\", $1 / 1000 }"; }

commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
dirty=false
[ -n "$(GIT_OPTIONAL_LOCKS=0 git status --porcelain --untracked-files=no 2>/dev/null)" ] && dirty=true
cpus=$(nproc 2>/dev/null || echo 0)
wrk_version=$(wrk -v 2>&1 | awk 'NR == 1 { print $2 }' || true)

{
  echo
  echo "ctxproxy load test  $START  commit $commit$([ "$dirty" = true ] && echo ' (dirty)')  ${cpus} CPUs  wrk $wrk_version"
  echo "medians of $RUNS run(s); mock latency ${MOCK_LATENCY_MS} ms; latencies in ms"
  echo
  echo "(a) 1 connection, back to back, ${SINGLE_SECS}s (wrk -t1 -c1)"
  printf '    %-16s %10s %10s %12s\n' "" p50 p99 req/s
  printf '    %-16s %10s %10s %12.0f\n' "mock direct" "$(ms "$s_d50")" "$(ms "$s_d99")" "$s_drps"
  printf '    %-16s %10s %10s %12.0f\n' "through proxy" "$(ms "$s_p50")" "$(ms "$s_p99")" "$s_prps"
  printf '    %-16s %10s %10s\n' "added by proxy" "$(ms "$add50")" "$(ms "$add99")"
  echo
  echo "(b) $MULTI_CONNS connections, ${MULTI_SECS}s (wrk -t$MULTI_THREADS -c$MULTI_CONNS)"
  printf '    %-16s %12s %10s %10s\n' "" req/s p50 p99
  printf '    %-16s %12.0f %10s %10s\n' "mock direct" "$m_drps" "$(ms "$m_d50")" "$(ms "$m_d99")"
  printf '    %-16s %12.0f %10s %10s\n' "through proxy" "$m_prps" "$(ms "$m_p50")" "$(ms "$m_p99")"
  printf '    %-16s %12s\n' "proxy / direct" "$(awk "BEGIN { printf \"%.2f\", $rps_ratio }")"
  echo
  echo "targets"
  printf '    added p50 <= %s ms: %s (%s ms)\n' "$(ms "$TARGET_ADDED_P50_US")" "$(verdict "$t_add50")" "$(ms "$add50")"
  printf '    added p99 <= %s ms: %s (%s ms)\n' "$(ms "$TARGET_ADDED_P99_US")" "$(verdict "$t_add99")" "$(ms "$add99")"
  printf '    proxy >= %s req/s at %s connections: %s (%.0f)\n' "$TARGET_PROXY_RPS" "$MULTI_CONNS" "$(verdict "$t_rps")" "$m_prps"
  echo
  if [ "$NON2XX" -ne 0 ] || [ "$SOCKERR" -ne 0 ]; then
    echo "WARNING: $NON2XX non-2xx responses and $SOCKERR socket errors during the runs - the numbers are suspect"
  else
    echo "no non-2xx responses, no socket errors"
  fi
} >"$WORK/summary.txt"

mkdir -p "$RESULTS_DIR"
OUT=$RESULTS_DIR/load-$STAMP.json
cat >"$OUT" <<EOF
{
  "started": "$START",
  "git_commit": "$commit",
  "git_dirty": $dirty,
  "host": {"cpus": $cpus, "kernel": "$(uname -r)", "wrk": "$wrk_version"},
  "settings": {"runs": $RUNS, "single_secs": $SINGLE_SECS, "multi_secs": $MULTI_SECS, "warmup_secs": $WARMUP_SECS,
               "multi_threads": $MULTI_THREADS, "multi_connections": $MULTI_CONNS, "mock_latency_ms": $MOCK_LATENCY_MS,
               "mock_port": $MOCK_PORT, "proxy_port": $PROXY_PORT},
  "single_connection": {
    "direct": {"p50_us": $s_d50, "p99_us": $s_d99, "rps": $s_drps, "runs": $(runs_json single_direct)},
    "proxy": {"p50_us": $s_p50, "p99_us": $s_p99, "rps": $s_prps, "runs": $(runs_json single_proxy)},
    "added_p50_us": $add50,
    "added_p99_us": $add99
  },
  "multi_connection": {
    "connections": $MULTI_CONNS,
    "direct": {"rps": $m_drps, "p50_us": $m_d50, "p99_us": $m_d99, "runs": $(runs_json multi_direct)},
    "proxy": {"rps": $m_prps, "p50_us": $m_p50, "p99_us": $m_p99, "runs": $(runs_json multi_proxy)},
    "proxy_over_direct_rps": $rps_ratio
  },
  "non2xx_responses": $NON2XX,
  "socket_errors": $SOCKERR,
  "targets": {
    "added_p50_us_max": $TARGET_ADDED_P50_US, "added_p50_met": $t_add50,
    "added_p99_us_max": $TARGET_ADDED_P99_US, "added_p99_met": $t_add99,
    "proxy_rps_min": $TARGET_PROXY_RPS, "proxy_rps_met": $t_rps
  }
}
EOF
if command -v jq >/dev/null && ! jq -e . "$OUT" >/dev/null; then
  keep_logs
  die "wrote invalid JSON to $OUT"
fi
cp "$RAW" "${OUT%.json}.wrk.txt"

cat "$WORK/summary.txt"
rel=${OUT#"$ROOT"/}
echo "results: $rel  (raw wrk output: ${rel%.json}.wrk.txt)"
[ "$NON2XX" -eq 0 ] && [ "$SOCKERR" -eq 0 ] || exit 2
if [ "$STRICT" = 1 ] && ! { [ "$t_add50" = true ] && [ "$t_add99" = true ] && [ "$t_rps" = true ]; }; then
  exit 3
fi
