#!/usr/bin/env python3
"""Prints what every panel of the ctxproxy Grafana dashboard shows now, from a Prometheus.

    python3 bench/dashboard_values.py http://127.0.0.1:9090 [RANGE]

Reads grafana/dashboards/ctxproxy.json, fills the variables as Grafana would (all tenants and
models, `$__range` = RANGE (default 15m), `$__rate_interval` = 1m) and prints each panel's
series with their current values, row by row: a screenshot-free reading of the dashboard.
"""
import json
import os
import sys
import urllib.parse
import urllib.request

base = sys.argv[1].rstrip("/")
window = sys.argv[2] if len(sys.argv) > 2 else "15m"
path = os.path.join(os.path.dirname(__file__), "..", "grafana", "dashboards", "ctxproxy.json")
dashboard = json.load(open(path))


def query(expr):
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.load(response)["data"]["result"]


def legend(template, labels):
    for key, value in labels.items():
        template = template.replace("{{" + key + "}}", value)
    return template


for panel in dashboard["panels"]:
    if panel["type"] == "row":
        print(f"\n== {panel['title']}")
        continue
    unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
    values = []
    for target in panel.get("targets", []):
        expr = (target["expr"].replace("$__rate_interval", "1m").replace("$__range", window)
                .replace("$tenant", ".*").replace("$model", ".*"))
        for series in query(expr):
            name = legend(target.get("legendFormat", ""), series["metric"]) or "value"
            value = float(series["value"][1])
            values.append(f"{name}={value:.4g}")
    print(f"{panel['title']} [{unit}]: {', '.join(values) if values else '(no data)'}")
