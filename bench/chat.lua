-- wrk script for bench/load.sh: POSTs one small, realistic, non-streaming chat completion
-- (a system message plus a user question, model gpt-4o) and, when the run is over, prints one
-- machine-readable line:
--
--   BENCH requests=… duration_us=… rps=… p50_us=… p75_us=… p90_us=… p99_us=… p999_us=…
--         max_us=… mean_us=… non2xx=… err_connect=… err_read=… err_write=… err_timeout=…
--         err_status=…
--
-- Latencies are wrk's per-request latencies (request written → response read) in microseconds.
-- non2xx counts every response whose status is not 2xx (counted per thread in response());
-- err_status is wrk's own "Non-2xx or 3xx responses" count (status >= 400).
--
-- Usage: wrk -t1 -c1 -d10s --latency -s bench/chat.lua http://127.0.0.1:19180/v1/chat/completions

wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Accept"] = "application/json"
-- Forwarded upstream by the proxy (no [auth] keys configured); the mock ignores it.
wrk.headers["Authorization"] = "Bearer sk-bench-not-a-real-key"
-- Keep the body on this one line: load.sh reads it from here for its smoke request.
wrk.body = [[{"model":"gpt-4o","messages":[{"role":"system","content":"You are a concise assistant for a software company. Answer in at most three sentences and say so when you are unsure."},{"role":"user","content":"Our nightly build started failing with 'linker cc not found' after we switched the CI image to Alpine. What is the most likely cause and how do we fix it?"}],"temperature":0.2,"max_tokens":256,"stream":false}]]

-- Per-thread non-2xx counters, collected in done().
local threads = {}

function setup(thread)
   table.insert(threads, thread)
end

function init(args)
   non2xx = 0
end

function response(status, headers, body)
   if status < 200 or status > 299 then
      non2xx = non2xx + 1
   end
end

function done(summary, latency, requests)
   local non = 0
   for _, t in ipairs(threads) do
      non = non + (tonumber(t:get("non2xx")) or 0)
   end
   local secs = summary.duration / 1e6
   local e = summary.errors
   io.write(string.format(
      "BENCH requests=%d duration_us=%d rps=%.1f p50_us=%d p75_us=%d p90_us=%d p99_us=%d p999_us=%d max_us=%d mean_us=%.1f non2xx=%d err_connect=%d err_read=%d err_write=%d err_timeout=%d err_status=%d\n",
      summary.requests, summary.duration, summary.requests / secs,
      latency:percentile(50), latency:percentile(75), latency:percentile(90),
      latency:percentile(99), latency:percentile(99.9), latency.max, latency.mean,
      non, e.connect, e.read, e.write, e.timeout, e.status))
end
