#!/usr/bin/env python3
"""Issue 31's targets on recorded traffic: through ctxproxy (`tool_definitions = "in_place"`, or
the placement `TOOL_DEFINITIONS` names: `in_result`, `in_block`)
and `ctxproxy mock-upstream` imitating each kind of chat template (`X-Mock-System-Messages`:
`in_place` reads a system message in mid-conversation, `reject` answers vLLM's 400, `drop`
loses it), how many answers reach the client as a 400 caused by a definition, how many tool
calls reach it with arguments that miss a property the client's schema requires (or give one
of the wrong type), and how many re-asks it took.

    cargo build --release && python3 bench/template_modes.py [FILE.jsonl] [--limit N]

Default file: ../shared/data/tau2_bench_dev.jsonl (its .meta.jsonl beside it). The requests
measured are those that need a definition: explain shows the rewrite defining a tool in its
messages, or the recorded answer's tool (`response_tool_names`) goes as a stub. Each is sent
with `X-Mock-Tool-Call: <that tool>` (the mock calls it, filling the required properties of the
schema it was given: none for a stub) and `Cache-Control: no-cache`, in order, JSON then
streamed, each mode and form on a fresh proxy (so what a proxy learns of the template shows:
its first requests pay the refusal or the re-ask, the later ones define tools in the block).
`CTXPROXY_BIN` picks the proxy's binary (`target/release/ctxproxy` by default; another build
measures "before"), `MOCK_BIN` the mock's (the same by default). Prints one row per mode and form; exit 1 when an answer is not a 200 with the call,
2 on a usage error or when a process does not start.
"""
import http.client
import json
import os
import subprocess
import sys
import time

from procs import free_port, wait_ready

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.environ.get("CTXPROXY_BIN", os.path.join(ROOT, "target", "release", "ctxproxy"))
MOCK_BIN = os.environ.get("MOCK_BIN", BIN)
HEADER = "Full definitions of tools that the tools list gives by name only"
MODES = ["in_place", "reject", "drop"]
PLACEMENT = os.environ.get("TOOL_DEFINITIONS", "in_place")
TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool,
         "array": list, "object": dict}


def start_proxy(mock_port):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CTXPROXY_")}
    env.update(CTXPROXY_UPSTREAM_BASE_URL=f"http://127.0.0.1:{mock_port}/v1",
               CTXPROXY_UPSTREAM_TOOL_DEFINITIONS=PLACEMENT,
               CTXPROXY_STORE_BACKEND="memory", CTXPROXY_LOG_LEVEL="error")
    proc = subprocess.Popen([BIN, "serve", "--config", os.path.join(ROOT, "config.toml"),
                             "--listen", f"127.0.0.1:{port}"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_ready(port, "/healthz", proc)
    return proc, port


def post(port, path, body, headers):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", path, json.dumps(body),
                 {"Content-Type": "application/json", **headers})
    response = conn.getresponse()
    return response.status, response.read().decode()


def schema_of(request, name):
    for tool in request.get("tools") or []:
        function = tool.get("function") or {}
        if function.get("name") == name:
            return function.get("parameters") or {}
    return {}


def fails(schema, arguments):
    """Arguments that are not a JSON object, miss a required property or give one of the wrong
    type (the top level of the schema: what the mock fills)."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return True
    if not isinstance(value, dict):
        return True
    if any(r not in value for r in schema.get("required") or []):
        return True
    for key, spec in (schema.get("properties") or {}).items():
        kind = TYPES.get(spec.get("type")) if isinstance(spec, dict) else None
        if key in value and kind and not isinstance(value[key], kind):
            return True
    return False


def calls_in(text, stream):
    if not stream:
        message = json.loads(text)["choices"][0]["message"]
        return [(c["function"]["name"], c["function"]["arguments"])
                for c in message.get("tool_calls") or []]
    calls = {}
    for line in text.splitlines():
        if not line.startswith("data: {"):
            continue
        chunk = json.loads(line[6:])
        for choice in chunk.get("choices") or []:
            for delta in (choice.get("delta") or {}).get("tool_calls") or []:
                call = calls.setdefault(delta["index"], ["", ""])
                function = delta.get("function") or {}
                call[0] += function.get("name") or ""
                call[1] += function.get("arguments") or ""
    return [tuple(calls[i]) for i in sorted(calls)]


def metrics(port):
    conn = http.client.HTTPConnection("127.0.0.1", port)
    conn.request("GET", "/metrics")
    out = {}
    for line in conn.getresponse().read().decode().splitlines():
        if line.startswith("#") or " " not in line:
            continue
        series, value = line.rsplit(" ", 1)
        out[series] = out.get(series, 0.0) + float(value)
    return out


def mock_chat_requests(port):
    conn = http.client.HTTPConnection("127.0.0.1", port)
    conn.request("GET", "/mock/stats")
    return json.loads(conn.getresponse().read())["chat_requests"]


def total(samples, name, label=""):
    return sum(v for k, v in samples.items()
               if (k == name or k.startswith(name + "{")) and label in k)


def needing_a_definition(port, rows):
    """The rows whose rewrite defines a tool in its messages or sends the next tool as a stub."""
    chosen = []
    for request, meta in rows:
        called = (meta.get("response_tool_names") or [None])[0]
        if not called or not request.get("tools"):
            continue
        status, text = post(port, "/v1/ctxproxy/explain", request, {})
        if status != 200:
            continue
        rewrite = json.loads(text)["request"]
        defined = any(m.get("role") in ("system", "tool")
                      and str(m.get("content") or "").startswith(HEADER)
                      for m in rewrite.get("messages") or [])
        sent = next((t for t in rewrite.get("tools") or []
                     if (t.get("function") or {}).get("name") == called), None)
        stub = sent is not None and sent != next(
            (t for t in request["tools"] if (t.get("function") or {}).get("name") == called), None)
        if defined or stub:
            chosen.append((request, called))
    return chosen


def main():
    args = sys.argv[1:]
    limit = None
    if "--limit" in args:
        i = args.index("--limit")
        limit = int(args[i + 1])
        del args[i:i + 2]
    path = args[0] if args else os.path.join(ROOT, "..", "shared", "data", "tau2_bench_dev.jsonl")
    meta_path = path[:-len(".jsonl")] + ".meta.jsonl"
    if not os.path.exists(BIN) or not os.path.exists(meta_path):
        sys.exit(2)
    with open(path) as f, open(meta_path) as m:
        rows = [(json.loads(a), json.loads(b)) for a, b in zip(f, m)]
    mock_port = free_port()
    mock = subprocess.Popen([MOCK_BIN, "mock-upstream", "--listen", f"127.0.0.1:{mock_port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    procs = [mock]
    bad = 0
    try:
        wait_ready(mock_port, "/v1/models", mock)
        proc, port = start_proxy(mock_port)
        procs.append(proc)
        chosen = needing_a_definition(port, rows)[:limit]
        print(f"{path}: {len(chosen)} of {len(rows)} requests need a definition ({BIN}, "
              f"tool_definitions = {PLACEMENT})")
        print(f"{'mode':9} {'form':6} {'requests':>8} {'400s':>5} {'schema fails':>12} "
              f"{'upstream calls':>14} {'expanded':>8} {'all_full':>8} {'invalid_args':>12} "
              f"{'refused':>7} {'errors':>6}")
        for mode in MODES:
            for stream in (False, True):
                proc, port = start_proxy(mock_port)
                procs.append(proc)
                errors = failing = other = 0
                asked_before = mock_chat_requests(mock_port)
                for request, called in chosen:
                    body = dict(request, stream=stream)
                    if stream:
                        body["stream_options"] = {"include_usage": True}
                    headers = {"X-Mock-System-Messages": mode, "X-Mock-Tool-Call": called,
                               "Cache-Control": "no-cache"}
                    status, text = post(port, "/v1/chat/completions", body, headers)
                    if status == 400:
                        errors += 1
                        continue
                    calls = calls_in(text, stream) if status == 200 else []
                    if not any(name == called for name, _ in calls):
                        other += 1
                        continue
                    failing += sum(fails(schema_of(request, n), a) for n, a in calls)
                samples = metrics(port)
                upstream = mock_chat_requests(mock_port) - asked_before
                outcomes = [total(samples, "ctxproxy_tool_expansions_total", f'outcome="{o}"')
                            for o in ("expanded", "all_full", "invalid_arguments")]
                refused = total(samples, "ctxproxy_tool_definitions_refused_total")
                form = "stream" if stream else "json"
                print(f"{mode:9} {form:6} {len(chosen):8} {errors:5} {failing:12} "
                      f"{int(upstream):14} {int(outcomes[0]):8} {int(outcomes[1]):8} "
                      f"{int(outcomes[2]):12} {int(refused):7} {other:6}")
                bad += errors + other
                proc.terminate()
                proc.wait()
                procs.remove(proc)
    finally:
        for p in procs:
            p.terminate()
            p.wait()
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
