#!/usr/bin/env bash
# Tool filtering quality on recorded agent traffic: for every request whose recorded answer
# called a tool (meta file `response_tool_names`, or `scaffold_expected_next_tool`), was that
# tool offered (in full or as a stub), and in full (1 minus that is the expansion rate; the
# re-asks per 100 tool-calling requests follow)? And how many tool-definition tokens are
# removed on requests with 10+ tools, stubs and definitions in the messages counted?
#
#   bench/tool_recall.sh [CONFIG] [FILE.jsonl ...]
#
# Defaults: the repo's config.toml and the agent files of ../shared/data. Each FILE.jsonl needs
# its FILE.meta.jsonl beside it. Runs `ctxproxy analyze`; no upstream, no Redis.
set -euo pipefail
cd "$(dirname "$0")/.."
config="${1:-config.toml}"
shift || true
files=("$@")
if [ ${#files[@]} -eq 0 ]; then
  files=(../shared/data/tau2_bench_dev.jsonl ../shared/data/tau_bench_airline_gpt4o.jsonl ../shared/data/mcpmark_postgres_dev.jsonl ../shared/data/mcpmark_mcp_agent_trajectories.jsonl ../shared/data/github_api_tool_results.jsonl ../shared/data/toolbench_examples.jsonl)
fi
cargo build --release --quiet
for file in "${files[@]}"; do
  [ -f "$file" ] || { echo "skip $file (absent)"; continue; }
  echo "== $file"
  ./target/release/ctxproxy analyze "$file" --config "$config" | grep -E "^(requests|prompt tokens|over budget|tool recall|called tools|tool definitions)"
done
