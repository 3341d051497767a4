#!/usr/bin/env python3
"""The bill of agents that chain on stored Responses (`previous_response_id`), through ctxproxy
and the mock: what the tool block along a chain costs.

    python3 ../shared/tools/convert_responses.py ../shared/data/tau2_bench_dev_every_turn.jsonl /tmp/every_turn.jsonl
    python3 bench/chains.py http://127.0.0.1:8080 /tmp/every_turn.jsonl [--limit N]

URL is a proxy in front of `ctxproxy mock-upstream` (the mock gives each Response an id and
counts cached tokens per conversation: the longest byte prefix its previous request shares with
this one, over tools, instructions and input, at 4 bytes a token, from 1,024 tokens, by 128).
FILE holds every request of each conversation in order, as Responses bodies, with its
`.meta.jsonl` beside it (`simulation_id` names the conversation). Each conversation is replayed
as an agent chaining on its stored Responses sends it: the first request whole, each later one
with `previous_response_id` (the id the proxy returned for the one before) and only the items
after the last answer (tool outputs, a user message), the same tools. Each chain is sent twice:
as the client wrote it (`X-Ctxproxy-Mode: off`) and optimized. Prints the input tokens the
upstream counted, the cached share, and the change of the bill at cached-token prices of x1,
x0.5, x0.25 and x0.1 of the uncached price. The mock holds no history, so tokens are those each
request sends, not the context the upstream adds: the chains differ only in what ctxproxy
changes of what is sent.
"""
import argparse
import http.client
import json
import os
import sys
import time
from collections import OrderedDict

RATIOS = (1.0, 0.5, 0.25, 0.1)
MODEL_ITEMS = ("reasoning", "function_call")
RUN = f"{os.getpid()}-{time.time_ns()}"


def chains(path, limit):
    meta_path = path[: -len(".jsonl")] + ".meta.jsonl"
    bodies = [json.loads(line) for line in open(path) if line.strip()]
    metas = [json.loads(line) for line in open(meta_path) if line.strip()]
    grouped = OrderedDict()
    for body, meta in zip(bodies, metas):
        grouped.setdefault(meta.get("simulation_id") or meta.get("line"), []).append(body)
    return list(grouped.items())[:limit] if limit else list(grouped.items())


def is_answer(item):
    """An item the model wrote: upstream after its Response, not sent again on a chain."""
    if item.get("type") in MODEL_ITEMS:
        return True
    return item.get("role") == "assistant"


def chained_input(previous, current):
    """The items of `current` after those of `previous` and the answer that followed them."""
    items = current["input"] if isinstance(current["input"], list) else []
    before = len(previous["input"]) if isinstance(previous["input"], list) else 1
    new = items[before:]
    while new and is_answer(new[0]):
        new = new[1:]
    return new


def post(conn, body, headers):
    conn.request("POST", "/v1/responses", body=json.dumps(body).encode(), headers=headers)
    response = conn.getresponse()
    data = response.read()
    if response.status != 200:
        raise SystemExit(f"HTTP {response.status}: {data[:300]!r}")
    return json.loads(data)


def replay(url, conversations, mode):
    host, port = url.split("//", 1)[1].rstrip("/").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    sent = cached = requests = 0
    for name, bodies in conversations:
        # The mock's cache is keyed by the conversation: one of this run's own.
        headers = {"Content-Type": "application/json", "X-Ctxproxy-Mode": mode,
                   "X-Conversation-Id": f"chain-{RUN}-{mode}-{name}"}
        previous_id = None
        for k, body in enumerate(bodies):
            body = dict(body)
            body.pop("store", None)
            body["stream"] = False
            if k > 0:
                body["input"] = chained_input(bodies[k - 1], bodies[k])
                body["previous_response_id"] = previous_id
            answer = post(conn, body, headers)
            previous_id = answer["id"]
            usage = answer.get("usage", {})
            sent += usage.get("input_tokens", 0)
            cached += usage.get("input_tokens_details", {}).get("cached_tokens", 0)
            requests += 1
    return requests, sent, cached


def bill(sent, cached, ratio):
    return (sent - cached) + ratio * cached


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("file")
    parser.add_argument("--limit", type=int, default=0, help="conversations at most")
    args = parser.parse_args()
    conversations = chains(args.file, args.limit)
    off = replay(args.url, conversations, "off")
    optimized = replay(args.url, conversations, "optimize")
    print(f"{os.path.basename(args.file)}: {len(conversations)} chains, {off[0]} requests")
    for label, (_, sent, cached) in (("as written", off), ("through ctxproxy", optimized)):
        share = cached / sent if sent else 0.0
        print(f"  {label:17} input tokens {sent:>10,}  cached {cached:>10,} ({100 * share:.1f}%)")
    changes = []
    for ratio in RATIOS:
        before, after = bill(off[1], off[2], ratio), bill(optimized[1], optimized[2], ratio)
        changes.append(f"x{ratio:g} {100 * (after / before - 1):+.1f}%")
    print("  bill change: " + " / ".join(changes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
