#!/usr/bin/env bash
# Runs every test of ctxproxy: unit, integration, golden and property tests, and the official
# `openai` Python SDK against a running proxy.
#
# Prepares what the tests need on a fresh machine: a Redis on 127.0.0.1:6379 (started here when
# none answers, installed with apt when missing, stopped again at the end), a virtualenv with
# the `openai` package from PyPI (kept in target/sdk-venv between runs), and Prometheus with
# promtool (Debian package `prometheus`, installed when missing; the test starts its own).
set -euo pipefail
cd "$(dirname "$0")/.."

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo -n "$@"; fi; }
apt_install() { as_root apt-get install -y --no-install-recommends "$@" >/dev/null || { as_root apt-get update >/dev/null && as_root apt-get install -y --no-install-recommends "$@" >/dev/null; }; }

# --- Redis -----------------------------------------------------------------------------------
redis_pidfile="$PWD/target/test-redis.pid"
redis_started=""
redis_answers() { (exec 3<>/dev/tcp/127.0.0.1/6379) 2>/dev/null; }
stop_redis() {
  if [ -n "$redis_started" ] && [ -f "$redis_pidfile" ]; then
    kill "$(cat "$redis_pidfile")" 2>/dev/null || true
    rm -f "$redis_pidfile"
  fi
}
trap stop_redis EXIT
if ! redis_answers; then
  command -v redis-server >/dev/null || apt_install redis-server
  mkdir -p target
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no \
    --pidfile "$redis_pidfile" --logfile "$PWD/target/test-redis.log"
  redis_started=1
  for _ in $(seq 50); do redis_answers && break; sleep 0.1; done
  redis_answers || { echo "Redis did not start" >&2; exit 1; }
fi
export CTXPROXY_TEST_REDIS_URL="redis://127.0.0.1:6379"

# --- Python virtualenv with the official openai SDK ---------------------------------------------
venv="$PWD/target/sdk-venv"
if ! "$venv/bin/python" -c "import openai" 2>/dev/null; then
  mkdir -p target
  python3 -m venv "$venv" 2>/dev/null || { apt_install python3-venv && rm -rf "$venv" && python3 -m venv "$venv"; }
  "$venv/bin/pip" install --quiet --disable-pip-version-check "openai>=1.40"
fi
export CTXPROXY_TEST_PYTHON="$venv/bin/python"

# --- Prometheus and promtool (Debian package), for the dashboard and alert-rule tests --------------
if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then
  apt_install prometheus
fi
export CTXPROXY_TEST_PROMETHEUS="$(command -v prometheus)"
export CTXPROXY_TEST_PROMTOOL="$(command -v promtool)"

# --- The tests -------------------------------------------------------------------------------
cargo test --all-targets "$@"
