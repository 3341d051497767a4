#!/usr/bin/env python3
"""What ctxproxy adds to recorded agent requests, cold and warm (issue 34, item 1).

    cargo build --release
    python3 bench/real_latency.py                       # every default run, 3 passes (~2 minutes)
    python3 bench/real_latency.py --limit 20 --repeat 1 # quick look: the first 20 requests of each file
    python3 bench/real_latency.py --files tau2_bench_dev_every_turn.jsonl,mcpmark_postgres_dev.jsonl:memo

Starts `ctxproxy mock-upstream` and `ctxproxy serve` (config.toml, memory store, log level warn)
on free 127.0.0.1 ports. Each request body of a file (one `POST /v1/chat/completions` body per
line, or one `POST /v1/responses` body as ../shared/tools/convert_responses.py writes them; read by
path from ../shared/data, $DATA) is sent to the mock directly and then through the
proxy, each on its own keep-alive connection, one at a time; the time of each (from the request's
first byte to the answer's last) is taken and the difference, proxy minus direct, is what the
proxy added to that request. Per run it prints requests, the median body, the added p50 / p90 /
p99 / max and the direct p50 (the mock's whole round trip on the original body).

Modes (how much the proxy knows of a conversation when its request arrives):
  warm  one proxy process, the file in order: every turn of a conversation after the previous one
        (what a sticky replica sees).
  cold  no request meets a conversation the proxy has seen: the requests are dealt into rounds,
        at most one per conversation in a round (a conversation as the proxy names it: the first
        system and the first user message), and every round gets a fresh proxy process (memory
        store, so no state survives it). Every request is the first the process sees of its
        conversation.
  memo  a fresh proxy gets every request once (not timed), then every request again, timed: the
        same request again, memoized.
Every fresh proxy process first gets 20 small warm-up requests on both paths, then, untimed, one
primer per application in the round (its model, system message and tools, and a user message no
recorded conversation starts with): the proxy knows what a replica that served other
conversations of the application knows (tool catalog, system prompt), nothing of the
conversations measured. A replica's very first request, which also builds those, is not measured.

Both paths get the same headers, among them `Cache-Control: no-store` (the proxy's caches are
neither looked up nor written; an answer whose `X-Ctxproxy-Cache` is not `bypass` counts as an
error), and the mock answers at once (no --latency-ms, no jitter, no X-Mock-* header). The mock
parses, hashes and compares what it receives, so a proxy that sends less saves the mock some of
that work: the direct p50 column bounds that saving.

Options:
  --files F[:MODE],...  files (names in $DATA or paths) with an optional mode; without one, a
                        file's default runs (below), else `cold`
  --limit N             only the first N requests of each file
  --repeat N            passes over each file (3), each with fresh processes as its mode says;
                        a request's added time is the median of its passes (the machine's noise
                        out, a request's own cost kept); every pass is in the JSON
  --out PATH            the JSON results (default bench/results/real-latency-<UTC time>.json;
                        every request's times are in it)
  --strict              exit 3 when a target is missed

Default runs: tau2_bench_dev_every_turn warm; tau2_bench_dev cold; mcpmark_postgres_dev and
mcpmark_mcp_agent_trajectories cold, then memo; github_api_tool_results cold.

Targets (issue 34): added p50 <= 1 ms and p99 <= 5 ms on every run, p99 <= 10 ms on the MCPMark
files. Exit 2 when a process does not start, a file is missing or any answer is not a 2xx chat
completion (the numbers are then not meaningful), 3 with --strict when a target is missed.

Environment: CTXPROXY_BIN (target/release/ctxproxy, or $CARGO_TARGET_DIR/release/ctxproxy),
DATA (../shared/data), BENCH_CONFIG (config.toml); other CTXPROXY_* variables reach the proxy
as usual, except the store backend, which is always memory.
"""
import argparse
import datetime
import gc
import http.client
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

from procs import free_port, wait_ready

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TARGET = os.environ.get("CARGO_TARGET_DIR") or os.path.join(ROOT, "target")
BIN = os.environ.get("CTXPROXY_BIN") or os.path.join(_TARGET, "release", "ctxproxy")
DATA = os.environ.get("DATA", os.path.join(ROOT, "..", "shared", "data"))
CONFIG = os.environ.get("BENCH_CONFIG", os.path.join(ROOT, "config.toml"))
CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
HEADERS = {"Content-Type": "application/json", "Cache-Control": "no-store"}

DEFAULT_RUNS = [
    ("tau2_bench_dev_every_turn.jsonl", "warm"),
    ("tau2_bench_dev.jsonl", "cold"),
    ("mcpmark_postgres_dev.jsonl", "cold"),
    ("mcpmark_mcp_agent_trajectories.jsonl", "cold"),
    ("mcpmark_postgres_dev.jsonl", "memo"),
    ("mcpmark_mcp_agent_trajectories.jsonl", "memo"),
    ("github_api_tool_results.jsonl", "cold"),
]
MODES = ("warm", "cold", "memo")
# Added latency targets in ms: (p50, p99); the MCPMark files (bodies around 100 KB) get 10 ms at p99.
TARGET_P50, TARGET_P99, TARGET_P99_MCP = 1.0, 5.0, 10.0
# Untimed small requests on both paths after a proxy starts: connections opened, code paged in.
WARMUP = 20
WARMUP_BODY = json.dumps({
    "model": "gpt-4o",
    "messages": [{"role": "system", "content": "You are a benchmark warm-up."},
                 {"role": "user", "content": "Say hello to the warm-up."}],
}).encode()


def log(msg):
    print(f"[real_latency] {msg}", file=sys.stderr, flush=True)


def die(msg, code=2):
    log(f"error: {msg}")
    sys.exit(code)


def stop(proc):
    if proc and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Servers:
    """The mock (one for the whole run) and the proxy (restarted as the modes need)."""

    def __init__(self, logdir):
        self.logdir = logdir
        self.mock_port = free_port()
        self.mock_log = open(os.path.join(logdir, "mock.log"), "w")
        self.mock = subprocess.Popen(
            [BIN, "mock-upstream", "--listen", f"127.0.0.1:{self.mock_port}"],
            stdout=self.mock_log, stderr=subprocess.STDOUT)
        wait_ready(self.mock_port, "/v1/models", self.mock, "mock-upstream")
        self.proxy = None
        self.proxy_port = None
        self.starts = 0
        self.direct = None
        self.through = None

    def restart_proxy(self):
        """A fresh proxy process (nothing memoized, empty memory store), warmed up."""
        self.close_connections()
        stop(self.proxy)
        self.proxy_port = free_port()
        env = {k: v for k, v in os.environ.items() if k != "CTXPROXY_BIN" and k != "RUST_LOG"}
        env.update(CTXPROXY_UPSTREAM_BASE_URL=f"http://127.0.0.1:{self.mock_port}/v1",
                   CTXPROXY_STORE_BACKEND="memory", CTXPROXY_LOG_LEVEL="warn")
        self.starts += 1
        log_file = open(os.path.join(self.logdir, "proxy.log"), "a")
        self.proxy = subprocess.Popen(
            [BIN, "serve", "--config", CONFIG, "--listen", f"127.0.0.1:{self.proxy_port}"],
            env=env, stdout=log_file, stderr=subprocess.STDOUT)
        log_file.close()
        wait_ready(self.proxy_port, "/healthz", self.proxy, "ctxproxy serve")
        self.direct = http.client.HTTPConnection("127.0.0.1", self.mock_port, timeout=120)
        self.through = http.client.HTTPConnection("127.0.0.1", self.proxy_port, timeout=120)
        for _ in range(WARMUP):
            for conn, name in ((self.direct, "mock"), (self.through, "proxy")):
                status, _, _, data = send(conn, WARMUP_BODY)
                if not 200 <= status < 300:
                    die(f"warm-up request to the {name} answered {status}: {data[:300]!r}")

    def close_connections(self):
        for conn in (self.direct, self.through):
            if conn is not None:
                conn.close()
        self.direct = self.through = None

    def check_alive(self):
        for proc, name in ((self.mock, "mock-upstream"), (self.proxy, "ctxproxy serve")):
            if proc.poll() is not None:
                die(f"{name} died during the run (exit {proc.returncode}); logs in {self.logdir}")

    def close(self):
        self.close_connections()
        stop(self.proxy)
        stop(self.mock)
        self.mock_log.close()


def send(conn, body):
    """One request on a keep-alive connection: (status, seconds, X-Ctxproxy-Cache, body)."""
    t0 = time.perf_counter()
    conn.request("POST", RESPONSES if is_responses(body) else CHAT, body=body, headers=HEADERS)
    resp = conn.getresponse()
    data = resp.read()
    elapsed = time.perf_counter() - t0
    if resp.will_close:
        conn.close()  # http.client reopens it on the next request
    return resp.status, elapsed, resp.getheader("X-Ctxproxy-Cache"), data


def is_responses(body):
    """A Responses API body (`input`, no `messages`, as convert_responses.py writes them): sent to
    /v1/responses."""
    return b'"messages"' not in body and b'"input"' in body


def messages_of(request):
    """The chat messages of a body, or a Responses body's `instructions` and message items."""
    if "messages" in request or "input" not in request:
        return request.get("messages", [])
    out = [{"role": "system", "content": request["instructions"]}] if request.get("instructions") else []
    items = request["input"]
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    return out + [i for i in items if i.get("type", "message") == "message" and "role" in i]


def conversation_key(body):
    """The proxy's conversation without X-Conversation-Id or `user`: first system + first user text."""
    request = json.loads(body)
    system = user = None
    for m in messages_of(request):
        if system is None and m.get("role") == "system":
            system = json.dumps(m.get("content"), sort_keys=True)
        if user is None and m.get("role") == "user":
            user = json.dumps(m.get("content"), sort_keys=True)
    return system, user, request.get("user")


def rounds(bodies):
    """The indices of `bodies` dealt into rounds, at most one per conversation in a round, each
    conversation's requests in file order."""
    seen = {}
    out = []
    for i, body in enumerate(bodies):
        k = conversation_key(body)
        r = seen.get(k, 0)
        seen[k] = r + 1
        if r == len(out):
            out.append([])
        out[r].append(i)
    return out


def primers(bodies, indices):
    """One small request per distinct (model, system prompt, tools) among `indices`: the system
    message and the tools of the application, and a user message no recorded conversation starts
    with. Sent untimed to a fresh proxy before its timed requests, so that what it knows is what a
    replica that has served this application before knows (the tool catalog, the system prompt's
    facts), and nothing of the measured conversations."""
    seen = {}
    for i in indices:
        request = json.loads(bodies[i])
        warm_up = {"role": "user", "content": "Benchmark warm-up: a conversation of its own."}
        if is_responses(bodies[i]):
            primer = {"model": request.get("model"), "input": [warm_up]}
            if request.get("instructions"):
                primer["instructions"] = request["instructions"]
        else:
            system = [m for m in request.get("messages", [])[:1] if m.get("role") == "system"]
            primer = {"model": request.get("model"), "messages": system + [warm_up]}
        if request.get("tools"):
            primer["tools"] = request["tools"]
        body = json.dumps(primer).encode()
        seen.setdefault(body, None)
    return list(seen)


def percentile(sorted_values, p):
    """Linear interpolation between closest ranks (numpy's default)."""
    if not sorted_values:
        return math.nan
    x = (len(sorted_values) - 1) * p
    lo = math.floor(x)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (x - lo)


def measure(servers, bodies, indices, rows, errors, label):
    """Times each body of `indices` directly, then through the proxy; appends a row per request."""
    for i in indices:
        body = bodies[i]
        row = {"index": i, "bytes": len(body)}
        for name, conn in (("direct", servers.direct), ("proxy", servers.through)):
            try:
                status, seconds, cache, data = send(conn, body)
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                servers.check_alive()
                errors.append(f"{label} #{i} {name}: {type(e).__name__}: {e}")
                row[name + "_error"] = str(e)
                continue
            row[name + "_ms"] = seconds * 1000
            row[name + "_status"] = status
            if name == "proxy":
                row["cache"] = cache
            answered = b'"chat.completion"' in data or b'"object":"response"' in data
            if not 200 <= status < 300 or not answered:
                errors.append(f"{label} #{i} {name}: {status} {data[:200]!r}")
            elif name == "proxy" and cache != "bypass":
                errors.append(f"{label} #{i} proxy: X-Ctxproxy-Cache {cache!r}, expected 'bypass'")
        if "direct_ms" in row and "proxy_ms" in row:
            row["added_ms"] = row["proxy_ms"] - row["direct_ms"]
        rows.append(row)


def run_one(servers, path, mode, limit, repeat):
    with open(path, "rb") as f:
        bodies = [line.rstrip(b"\r\n") for line in f if line.strip()]
    if limit:
        bodies = bodies[:limit]
    name = os.path.basename(path)
    label = f"{name} ({mode})"
    samples, errors = [], []
    t0 = time.monotonic()
    plan = rounds(bodies) if mode == "cold" else [list(range(len(bodies)))]
    starts_before = servers.starts
    for rep in range(repeat):
        for n, indices in enumerate(plan):
            servers.restart_proxy()
            for body in primers(bodies, indices):
                status, _, _, data = send(servers.through, body)
                if not 200 <= status < 300:
                    errors.append(f"{label} primer: {status} {data[:200]!r}")
            if mode == "memo":
                for i in indices:  # untimed first pass: every request seen once
                    status, _, _, data = send(servers.through, bodies[i])
                    if not 200 <= status < 300:
                        errors.append(f"{label} #{i} first pass: {status} {data[:200]!r}")
            gc.collect()
            gc.disable()
            try:
                measure(servers, bodies, indices, samples, errors, label)
            finally:
                gc.enable()
            servers.check_alive()
        log(f"{label}: pass {rep + 1}/{repeat} done ({len(plan)} proxy process(es))")
    # Per request: the median of its passes (each in fresh processes as the mode says).
    by_index = {}
    for sample in samples:
        by_index.setdefault(sample["index"], []).append(sample)
    rows = []
    for i in sorted(by_index):
        ok = [x for x in by_index[i] if "added_ms" in x]
        row = {"index": i, "bytes": len(bodies[i]), "passes": by_index[i]}
        if ok:
            row["added_ms"] = statistics.median(x["added_ms"] for x in ok)
            row["direct_ms"] = statistics.median(x["direct_ms"] for x in ok)
            row["proxy_ms"] = statistics.median(x["proxy_ms"] for x in ok)
        rows.append(row)
    added = sorted(r["added_ms"] for r in rows if "added_ms" in r)
    direct = sorted(r["direct_ms"] for r in rows if "direct_ms" in r)
    all_added = sorted(x["added_ms"] for x in samples if "added_ms" in x)
    mcp = name.startswith("mcpmark")
    summary = {
        "file": name, "mode": mode, "requests": len(bodies), "measured": len(added),
        "proxy_processes": servers.starts - starts_before, "rounds": len(plan), "passes": repeat,
        "median_body_kb": statistics.median(len(b) for b in bodies) / 1024 if bodies else 0,
        "added_ms": {"p50": percentile(added, 0.5), "p90": percentile(added, 0.9),
                     "p99": percentile(added, 0.99), "max": added[-1] if added else math.nan,
                     "mean": statistics.fmean(added) if added else math.nan},
        "direct_ms": {"p50": percentile(direct, 0.5), "p99": percentile(direct, 0.99)},
        "added_ms_every_pass": {"p50": percentile(all_added, 0.5), "p90": percentile(all_added, 0.9),
                                "p99": percentile(all_added, 0.99),
                                "max": all_added[-1] if all_added else math.nan},
        "errors": len(errors), "seconds": round(time.monotonic() - t0, 1),
    }
    p99_target = TARGET_P99_MCP if mcp else TARGET_P99
    summary["targets"] = {"p50_max_ms": TARGET_P50, "p99_max_ms": p99_target,
                          "met": summary["added_ms"]["p50"] <= TARGET_P50
                          and summary["added_ms"]["p99"] <= p99_target}
    log(f"{label}: {len(added)} requests in {summary['seconds']} s, added p50 "
        f"{summary['added_ms']['p50']:.2f} ms, p99 {summary['added_ms']['p99']:.2f} ms, "
        f"{len(errors)} errors")
    for e in errors[:10]:
        log(f"  {e}")
    return summary, rows, errors


def describe(s):
    what = {"warm": "every turn in order (warm)", "cold": "cold",
            "memo": "the same again (memoized)"}[s["mode"]]
    return f"`{s['file']}`, {what}"


def fmt(v):
    if math.isnan(v):
        return "–"
    return f"{v:.2f}" if abs(v) < 10 else f"{v:.1f}"


def table(summaries):
    lines = ["| traffic | requests | median body | added p50 | p90 | p99 | max | direct p50 | target |",
             "|---|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        a = s["added_ms"]
        t = s["targets"]
        verdict = "met" if t["met"] else "**missed**"
        lines.append(
            f"| {describe(s)} | {s['measured']} | {s['median_body_kb']:.0f} KB | {fmt(a['p50'])} ms "
            f"| {fmt(a['p90'])} | {fmt(a['p99'])} | {fmt(a['max'])} | {fmt(s['direct_ms']['p50'])} ms "
            f"| {verdict} (p50 ≤ {t['p50_max_ms']:g}, p99 ≤ {t['p99_max_ms']:g}) |")
    return "\n".join(lines)


def parse_runs(spec):
    if not spec:
        return DEFAULT_RUNS
    runs = []
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        name, _, mode = item.partition(":")
        if mode:
            if mode not in MODES:
                die(f"unknown mode {mode!r} in {item!r} (one of {', '.join(MODES)})")
            runs.append((name, mode))
        else:
            base = os.path.basename(name)
            defaults = [m for f, m in DEFAULT_RUNS if f == base] or ["cold"]
            runs.extend((name, m) for m in defaults)
    return runs


def git(*args):
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", help="F[:MODE],... (names in $DATA or paths; modes warm, cold, memo)")
    ap.add_argument("--limit", type=int, default=0, help="only the first N requests of each file")
    ap.add_argument("--out", help="JSON results (default bench/results/real-latency-<UTC time>.json)")
    ap.add_argument("--repeat", type=int, default=3,
                    help="passes over each file, fresh processes each; a request's time is its median (3)")
    ap.add_argument("--strict", action="store_true", help="exit 3 when a target is missed")
    args = ap.parse_args()
    if args.limit < 0:
        die("--limit must be positive")
    if args.repeat < 1:
        die("--repeat must be at least 1")
    runs = []
    for name, mode in parse_runs(args.files):
        path = name if os.path.sep in name or os.path.exists(name) else os.path.join(DATA, name)
        if not os.path.isfile(path):
            die(f"no file {path} (DATA={DATA})")
        runs.append((path, mode))
    if not os.access(BIN, os.X_OK):
        die(f"no binary at {BIN} (cargo build --release, or set CTXPROXY_BIN)")

    started = datetime.datetime.now(datetime.timezone.utc)
    stamp = started.strftime("%Y%m%dT%H%M%SZ")
    out = args.out or os.path.join(ROOT, "bench", "results", f"real-latency-{stamp}.json")
    logdir = tempfile.mkdtemp(prefix="ctxproxy-real-latency.")
    servers = Servers(logdir)
    summaries, all_rows, all_errors = [], [], []
    t0 = time.monotonic()
    try:
        for path, mode in runs:
            summary, rows, errors = run_one(servers, path, mode, args.limit, args.repeat)
            summaries.append(summary)
            all_rows.append({"file": summary["file"], "mode": mode, "requests": rows})
            all_errors.extend(errors)
    except KeyboardInterrupt:
        die("interrupted", 130)
    finally:
        servers.close()
    elapsed = time.monotonic() - t0

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    header = (f"ctxproxy real-traffic latency  {started.strftime('%Y-%m-%dT%H:%M:%SZ')}  commit {commit}"
              f"{' (dirty)' if dirty else ''}  {os.cpu_count()} CPUs  {elapsed:.0f} s"
              f"{f'  (--limit {args.limit})' if args.limit else ''}  {args.repeat} pass(es)")
    print()
    print(header)
    print("added = proxy minus direct per request, in ms; mock answers at once; "
          "client, mock and proxy share the machine")
    print()
    print(table(summaries))
    print()
    results = {
        "started": started.strftime("%Y-%m-%dT%H:%M:%SZ"), "git_commit": commit, "git_dirty": dirty,
        "host": {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version()},
        "settings": {"limit": args.limit, "config": CONFIG, "data": DATA, "bin": BIN,
                     "repeat": args.repeat, "warmup_requests": WARMUP, "headers": HEADERS},
        "seconds": round(elapsed, 1), "runs": summaries, "errors": all_errors,
        "table": table(summaries), "requests": all_rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"results: {os.path.relpath(out, ROOT) if out.startswith(ROOT) else out}; server logs in {logdir}")
    if all_errors:
        print(f"ERROR: {len(all_errors)} failed or unexpected answers (first: {all_errors[0]}) - "
              "the numbers are not meaningful")
        sys.exit(2)
    if args.strict and not all(s["targets"]["met"] for s in summaries):
        sys.exit(3)


if __name__ == "__main__":
    main()
