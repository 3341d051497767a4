#!/usr/bin/env bash
# The bill, with the provider's prompt cache, of conversations replayed turn by turn: input
# tokens, the cached share, the bill at each cached-price ratio and in USD ([prices]), for the
# original requests and through the pipeline; the definitions are those of
# ../shared/tools/cache_cost.py (`ctxproxy analyze --cost`, no proxy needed), plus the re-asks
# of answers that called a stub without a definition (from the meta file's recorded answers),
# billed as requests; the row without them is what cache_cost.py gives. Judge any change
# to what is sent upstream with it, beside bench/fidelity.sh.
#
#   bench/cost.sh                       tau2_bench_dev_every_turn.jsonl of ../shared/data
#   bench/cost.sh CONFIG.toml           the same with another config
#   bench/cost.sh CONFIG.toml FILE ...  other files (FILE.meta.jsonl gives `conversation`)
#
# Environment: DATA [../shared/data], CACHED_RATIOS [1,0.5,0.25,0.1], SKIP_BUILD=1,
# CTXPROXY_BIN [target/release/ctxproxy]; CTXPROXY_* overrides apply. COMPARE=1 also runs
# cache_cost.py through a proxy started here (needs python3 with bpe-openai) to check that the
# two agree. Targets (issue 16) printed below the table.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:-../shared/data}
BIN=${CTXPROXY_BIN:-target/release/ctxproxy}
# The binary path is not a config override: ctxproxy must not inherit it.
unset CTXPROXY_BIN
CONFIG=${1:-config.toml}
shift || true
if [ $# -gt 0 ]; then files=("$@"); else files=("$DATA/tau2_bench_dev_every_turn.jsonl"); fi
for f in "${files[@]}"; do
  if [ ! -f "$f" ]; then echo "no such file: $f" >&2; exit 2; fi
done
if [ "${SKIP_BUILD:-0}" != 1 ]; then cargo build --release --quiet; fi
echo "config: $CONFIG"
"$BIN" analyze --cost --config "$CONFIG" --cached-ratio "${CACHED_RATIOS:-1,0.5,0.25,0.1}" "${files[@]}"
if [ "${COMPARE:-0}" = 1 ]; then
  port=${PROXY_PORT:-19190}
  CTXPROXY_STORE_BACKEND=memory CTXPROXY_LOG_LEVEL=warn \
    CTXPROXY_UPSTREAM_BASE_URL=http://127.0.0.1:9/v1 \
    "$BIN" serve --config "$CONFIG" --listen "127.0.0.1:$port" &
  proxy=$!
  trap 'kill -9 $proxy 2>/dev/null || true' EXIT
  for _ in $(seq 1 100); do
    curl -fsS -o /dev/null "http://127.0.0.1:$port/healthz" 2>/dev/null && break
    sleep 0.1
  done
  for f in "${files[@]}"; do
    echo "cache_cost.py (reference), $f:"
    python3 ../shared/tools/cache_cost.py "http://127.0.0.1:$port" "$f" \
      --cached-ratios "${CACHED_RATIOS:-1,0.5,0.25,0.1}"
  done
fi
cat <<'TARGETS'
targets: the bill falls by >= 25% at every cached-price ratio; cached share through ctxproxy >= 88%
TARGETS
