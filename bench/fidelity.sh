#!/usr/bin/env bash
# Fidelity and reduction of the pipeline on recorded agent traffic, in one table: for each file
# and overall, the token reduction, the identifiers of the recorded next answer still in the
# rewrite, the next-called tool still offered, invalid rewrites, changed last user messages and
# rewrites over the budget (by the part of the floor that is over), then the lost identifiers by
# file, role and kind (table, number, prose, code, id). Judge any pipeline change
# with it, before and after. The definitions are those of ../shared/tools/eval_fidelity.py.
#
#   bench/fidelity.sh                 the agent files of ../shared/data
#   bench/fidelity.sh FILE.jsonl ...  other recordings (request bodies or [record] lines;
#                                     FILE.meta.jsonl beside a file gives the answers)
#
# Environment: BENCH_CONFIG [config.toml] (CTXPROXY_* overrides apply), DATA [../shared/data],
# LOSSES=1 to list every lost identifier with the stage that removed it, SKIP_BUILD=1,
# CTXPROXY_BIN [target/release/ctxproxy]. Targets (issue 14) printed beside the table.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:-../shared/data}
BIN=${CTXPROXY_BIN:-target/release/ctxproxy}
# The binary path is not a config override: ctxproxy must not inherit it.
unset CTXPROXY_BIN
if [ "${SKIP_BUILD:-0}" != 1 ]; then cargo build --release --quiet; fi
if [ $# -gt 0 ]; then
  files=("$@")
else
  files=()
  for f in tau2_bench_dev tau_bench_airline_gpt4o mcpmark_postgres_dev mcpmark_mcp_agent_trajectories chatgpt_export_chats github_api_tool_results toolbench_examples; do
    if [ -f "$DATA/$f.jsonl" ]; then files+=("$DATA/$f.jsonl"); fi
  done
  if [ ${#files[@]} -eq 0 ]; then echo "no data under $DATA" >&2; exit 2; fi
fi
extra=()
if [ "${LOSSES:-0}" = 1 ]; then extra+=(--losses); fi
"$BIN" analyze --config "${BENCH_CONFIG:-config.toml}" "${files[@]}" "${extra[@]}" | sed -n '/^fidelity$/,$p'
cat <<'TARGETS'
targets (issue 30): ids >= 98% on every dev file (tau2, airline, both MCPMark files, chats), 0 invalid;
targets: tau2_bench_dev ids >= 98%, next tool >= 91.1%, 0 invalid, reduction >= 30%;
         tau_bench_airline_gpt4o ids >= 98%, reduction >= 30%;
         chatgpt_export_chats reduction >= 55%, ids >= 95%; github_api_tool_results reduction >= 80%
TARGETS
