"""Real-client check: the official `openai` package talks to ctxproxy (in front of the mock).

Run by tests/openai_sdk.rs with OPENAI_BASE_URL pointing at the proxy. Exits non-zero on the
first failed check.
"""

import json
import os
import sys

import openai

client = openai.OpenAI(base_url=os.environ["OPENAI_BASE_URL"], api_key="sk-test-client", max_retries=0)
MODEL = "gpt-4o"

# 1. A chat completion.
completion = client.chat.completions.create(
    model=MODEL,
    messages=[
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say hello"},
    ],
)
assert completion.choices[0].message.content == 'Mock answer to "Say hello" after 2 messages.', completion
assert completion.choices[0].finish_reason == "stop"
assert completion.usage.total_tokens == completion.usage.prompt_tokens + completion.usage.completion_tokens

# 2. The same, streamed, with usage.
stream = client.chat.completions.create(
    model=MODEL,
    messages=[
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say hello"},
    ],
    stream=True,
    stream_options={"include_usage": True},
)
pieces, finish, usage = [], None, None
for chunk in stream:
    if chunk.usage is not None:
        usage = chunk.usage
    for choice in chunk.choices:
        if choice.delta.content:
            pieces.append(choice.delta.content)
        if choice.finish_reason:
            finish = choice.finish_reason
assert "".join(pieces) == completion.choices[0].message.content, pieces
assert finish == "stop"
assert usage is not None and usage.completion_tokens == completion.usage.completion_tokens

# 3. A tool-call round trip: the model calls a tool, we answer it, the model concludes.
tools = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
messages = [{"role": "user", "content": "Weather in Paris?"}]
first = client.chat.completions.create(
    model=MODEL, messages=messages, tools=tools, extra_headers={"X-Mock-Tool-Call": "get_weather"}
)
call = first.choices[0].message.tool_calls[0]
assert first.choices[0].finish_reason == "tool_calls"
assert call.function.name == "get_weather"
assert json.loads(call.function.arguments) == {"city": "mock"}
messages.append(first.choices[0].message.model_dump(exclude_none=True))
messages.append({"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 18, "sky": "clear"}'})
second = client.chat.completions.create(model=MODEL, messages=messages, tools=tools)
assert second.choices[0].message.content.startswith("Mock summary of the tool result:"), second
# The tool result reached the model (ctxproxy re-encodes JSON results without whitespace).
assert '"temp_c":18' in second.choices[0].message.content, second

# 4. A streamed tool call is reassembled by the SDK's stream helper.
with client.chat.completions.stream(
    model=MODEL, messages=messages[:1], tools=tools, extra_headers={"X-Mock-Tool-Call": "auto"}
) as events:
    final = events.get_final_completion()
streamed_call = final.choices[0].message.tool_calls[0]
assert streamed_call.function.name == "get_weather"
assert json.loads(streamed_call.function.arguments) == {"city": "mock"}

# 5. Embeddings (the SDK asks for base64 and decodes it) and model listing.
embedding = client.embeddings.create(model="text-embedding-3-small", input=["hello", "world"])
assert len(embedding.data) == 2 and len(embedding.data[0].embedding) == 16
assert abs(sum(x * x for x in embedding.data[0].embedding) - 1.0) < 1e-3
models = [m.id for m in client.models.list()]
assert MODEL in models, models

# 6. Errors surface as the SDK's typed exceptions.
try:
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                   extra_headers={"X-Mock-Status": "503"})
    raise AssertionError("expected an error")
except openai.InternalServerError as e:
    assert e.status_code == 503
try:
    client.chat.completions.create(model=MODEL, messages="not a list")
    raise AssertionError("expected an error")
except openai.BadRequestError as e:
    assert e.status_code == 400 and e.body["param"] == "messages", e.body

# 7. A cached answer replayed as a stream parses like the original stream (temperature 0 makes
#    the request cacheable; the entry is written after the first stream ends).
import time

cached_request = dict(model=MODEL, temperature=0, tools=tools,
                      messages=[{"role": "user", "content": "Weather in Quito, please"}],
                      extra_headers={"X-Mock-Tool-Call": "get_weather"})
with client.chat.completions.stream(**cached_request) as events:
    original = events.get_final_completion()
for _ in range(100):
    raw = client.chat.completions.with_raw_response.create(stream=True, **cached_request)
    if raw.headers.get("x-ctxproxy-cache") == "hit":
        break
    for _chunk in raw.parse():
        pass
    time.sleep(0.02)
else:
    raise AssertionError("the streamed answer was never cached")
with client.chat.completions.stream(**cached_request) as events:
    replayed = events.get_final_completion()
original_call = original.choices[0].message.tool_calls[0]
replayed_call = replayed.choices[0].message.tool_calls[0]
assert (replayed_call.id, replayed_call.function.name, replayed_call.function.arguments) == (
    original_call.id, original_call.function.name, original_call.function.arguments), replayed
assert replayed.choices[0].finish_reason == original.choices[0].finish_reason

# 8. An answer cut at max_tokens is continued by ctxproxy ([continuation] is on for this
#    proxy): the SDK parses one merged stream, and one merged JSON answer.
full = ("The lighthouse keeper climbed the stairs, lit the lamp and watched the ships "
        "pass until dawn.")
cut = dict(model=MODEL, max_tokens=6, messages=[{"role": "user", "content": "A short story"}],
           extra_headers={"X-Mock-Reply": full, "X-Mock-Overlap": "6"})
with client.chat.completions.stream(**cut) as events:
    merged = events.get_final_completion()
assert merged.choices[0].message.content == full, merged
assert merged.choices[0].finish_reason == "stop", merged
plain = client.chat.completions.create(**cut)
assert plain.choices[0].message.content == full, plain
assert plain.usage.prompt_tokens > 0 and plain.choices[0].finish_reason == "stop"

# 8. Deferred tools: nothing in the question names a tool, so both go as stubs; the mock calls
#    one with `{}` (the stub's schema), ctxproxy asks again with it in full, and the SDK gets
#    only that call, JSON (with the header) and streamed.
deferred = dict(
    model=MODEL,
    messages=[{"role": "user", "content": "Do I need an umbrella in Paris tomorrow?"}],
    tools=tools + [{"type": "function", "function": {"name": "send_email",
                    "description": "Send an email.", "parameters": {"type": "object",
                    "properties": {"to": {"type": "string"}}}}}],
    extra_headers={"X-Mock-Tool-Call": "get_weather"},
)
raw = client.chat.completions.with_raw_response.create(**deferred)
assert raw.headers.get("x-ctxproxy-tools-expanded") == "get_weather", dict(raw.headers)
expanded = raw.parse()
assert json.loads(expanded.choices[0].message.tool_calls[0].function.arguments) == {"city": "mock"}
deferred["extra_headers"]["X-Conversation-Id"] = "sdk-deferred-stream"
with client.chat.completions.stream(**deferred) as events:
    final = events.get_final_completion()
streamed_call = final.choices[0].message.tool_calls[0]
assert streamed_call.function.name == "get_weather"
assert json.loads(streamed_call.function.arguments) == {"city": "mock"}, streamed_call

# 9. The Responses API: a function call, its output sent back with the reasoning item that came
#    before it (the mock refuses a reasoning item parted from its call), streamed, and chained;
#    a stub called in a stream.
flat_tools = [{"type": "function", "name": "get_weather", "description": "Weather for a city",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                              "required": ["city"]}}]
first = client.responses.create(
    model="gpt-5", instructions="You are terse.", store=False,
    include=["reasoning.encrypted_content"], tools=flat_tools,
    input=[{"role": "user", "content": "Weather in Paris?"}],
    extra_headers={"X-Mock-Tool-Call": "get_weather"},
)
calls = [item for item in first.output if item.type == "function_call"]
assert calls and calls[0].name == "get_weather", first.output
assert json.loads(calls[0].arguments) == {"city": "mock"}, calls[0]
assert first.output[0].type == "reasoning" and first.output[0].encrypted_content, first.output
history = [{"role": "user", "content": "Weather in Paris?"}]
history += [item.model_dump(exclude_none=True) for item in first.output]
history.append({"type": "function_call_output", "call_id": calls[0].call_id, "output": "18C, sunny"})
raw = client.responses.with_raw_response.create(
    model="gpt-5", instructions="You are terse.", store=False, tools=flat_tools, input=history,
    include=["reasoning.encrypted_content"],
)
assert raw.headers.get("x-ctxproxy-tokens-before") is not None, dict(raw.headers)
second = raw.parse()
assert second.status == "completed" and "18C, sunny" in second.output_text, second
assert second.usage.input_tokens > 0 and second.usage.output_tokens > 0, second.usage
with client.responses.stream(model="gpt-5", store=False, tools=flat_tools, input=history,
                             include=["reasoning.encrypted_content"]) as events:
    kinds = [event.type for event in events]
    final = events.get_final_response()
assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
assert final.output_text == second.output_text, final
chained = client.responses.create(
    model="gpt-5", previous_response_id=first.id,
    input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "18C, sunny"}],
)
assert chained.status == "completed", chained
try:
    client.responses.create(model="gpt-5", input=[
        {"type": "function_call_output", "call_id": "call_nowhere", "output": "x"}])
    raise AssertionError("an orphan function_call_output is refused")
except openai.BadRequestError as error:
    assert "call_nowhere" in str(error), error

# The Responses stream of a request whose tools go as stubs (nothing in the question names
# them): the mock calls one, ctxproxy asks again with it defined in the same event stream, and
# the SDK parses one stream whose final Response holds only the full call.
deferred_tools = flat_tools + [{"type": "function", "name": "send_email",
                                "description": "Send an email.", "parameters": {
                                    "type": "object", "properties": {"to": {"type": "string"}}}}]
with client.responses.stream(model=MODEL, store=False, tools=deferred_tools,
                             input=[{"role": "user",
                                     "content": "Do I need an umbrella in Paris tomorrow?"}],
                             extra_headers={"X-Mock-Tool-Call": "get_weather"}) as events:
    kinds = [event.type for event in events]
    final = events.get_final_response()
assert kinds.count("response.created") == 1 and kinds[-1] == "response.completed", kinds
streamed_calls = [item for item in final.output if item.type == "function_call"]
assert len(streamed_calls) == 1 and streamed_calls[0].name == "get_weather", final.output
assert json.loads(streamed_calls[0].arguments) == {"city": "mock"}, streamed_calls[0]
assert final.usage.input_tokens > 0, final.usage

# A chain on a stored Response whose request sent stubs: the chained request sends the same
# block, and a call to a stub there is asked again in JSON; the SDK gets the full call.
question = [{"role": "user", "content": "Do I need an umbrella in Paris tomorrow?"}]
stored = client.responses.create(model=MODEL, tools=deferred_tools, input=question)
for _ in range(50):  # the chain's block is remembered once the answer has gone
    raw = client.responses.with_raw_response.create(
        model=MODEL, previous_response_id=stored.id, tools=deferred_tools,
        input=[{"role": "user", "content": "And in Rome?"}],
        extra_headers={"X-Mock-Tool-Call": "get_weather"})
    if raw.headers.get("x-ctxproxy-tools-expanded") == "get_weather":
        break
    time.sleep(0.04)
assert raw.headers.get("x-ctxproxy-tools-expanded") == "get_weather", raw.headers
chained = raw.parse()
calls = [item for item in chained.output if item.type == "function_call"]
assert len(calls) == 1 and json.loads(calls[0].arguments) == {"city": "mock"}, chained.output

# A Response cut at max_output_tokens is continued as a chat answer is, in JSON and in the
# event stream ([continuation] is on): one message, one Response, the whole text.
story = "The keeper climbed the stairs, lit the lamp and watched the ships until dawn."
cut_response = dict(model=MODEL, store=False, max_output_tokens=5, input="A short story",
                    extra_headers={"X-Mock-Reply": story, "X-Mock-Overlap": "6"})
whole = client.responses.create(**cut_response)
assert whole.status == "completed" and whole.output_text == story, whole
with client.responses.stream(**cut_response) as events:
    kinds = [event.type for event in events]
    final = events.get_final_response()
assert kinds.count("response.created") == 1 and kinds[-1] == "response.completed", kinds
assert final.output_text == story and final.status == "completed", final
assert [item.type for item in final.output] == ["message"], final.output

print("openai SDK checks passed")
sys.exit(0)
