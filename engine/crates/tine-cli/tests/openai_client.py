"""The official `openai` Python client against `tine serve` (run by tine-cli's `openai_client`
test, which starts the server on a synthetic model and passes its URL).

Every call asserts the shape the client parsed, and the field it asked for; refused fields must
raise the client's BadRequestError (a 400). A plain SSE reader checks the stream on the wire.

usage: openai_client.py BASE_URL   (e.g. http://127.0.0.1:8080)
"""
import base64
import json
import struct
import sys
import urllib.request

import openai

base = sys.argv[1].rstrip("/")
client = openai.OpenAI(base_url=base + "/v1", api_key="sk-test", max_retries=0, timeout=60)
checks = []


def check(name):
    def wrap(f):
        checks.append((name, f))
        return f
    return wrap


@check("models.list")
def _():
    models = client.models.list()
    assert len(models.data) == 1 and models.data[0].id == "tiny", models


@check("completions: text, usage, finish_reason, system_fingerprint")
def _():
    r = client.completions.create(model="tiny", prompt="hello", max_tokens=6, temperature=0, seed=1)
    c = r.choices[0]
    assert isinstance(c.text, str) and c.finish_reason in ("length", "stop"), r
    assert r.usage.completion_tokens <= 6 and r.usage.prompt_tokens > 0, r.usage
    assert r.system_fingerprint, r


@check("completions: greedy is deterministic")
def _():
    a = client.completions.create(model="tiny", prompt="hello world", max_tokens=8, temperature=0)
    b = client.completions.create(model="tiny", prompt="hello world", max_tokens=8, temperature=0)
    assert a.choices[0].text == b.choices[0].text


@check("completions: stream joins to the whole text")
def _():
    whole = client.completions.create(model="tiny", prompt="hello world", max_tokens=8, temperature=0).choices[0].text
    parts = client.completions.create(model="tiny", prompt="hello world", max_tokens=8, temperature=0, stream=True)
    text, finish = "", None
    for chunk in parts:
        for c in chunk.choices:
            text += c.text
            finish = c.finish_reason or finish
    assert text == whole and finish == "length", (text, whole, finish)


@check("completions: logprobs")
def _():
    r = client.completions.create(model="tiny", prompt="hello", max_tokens=4, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4, lp
    assert all(len(t) == 3 for t in lp.top_logprobs), lp
    assert all(v <= 0 for v in lp.token_logprobs), lp
    # Greedy: the sampled token is the most likely one.
    assert all(max(t.values()) == pytest_approx(v) for t, v in zip(lp.top_logprobs, lp.token_logprobs)), lp


def pytest_approx(v):
    class A:
        def __eq__(self, o):
            return abs(o - v) < 1e-5
    return A()


@check("completions: n and batch prompts")
def _():
    r = client.completions.create(model="tiny", prompt=["hello", "world"], max_tokens=4, temperature=0)
    assert [c.index for c in r.choices] == [0, 1], r
    alone = client.completions.create(model="tiny", prompt="world", max_tokens=4, temperature=0).choices[0].text
    assert r.choices[1].text == alone
    r = client.completions.create(model="tiny", prompt="hello", max_tokens=4, temperature=1.0, seed=5, n=3)
    assert len(r.choices) == 3, r


@check("completions: stop")
def _():
    r = client.completions.create(model="tiny", prompt="hello world", max_tokens=30, temperature=0, stop=["l"])
    assert "l" not in r.choices[0].text, r


@check("chat: message, role, usage")
def _():
    r = client.chat.completions.create(model="tiny", messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}], max_completion_tokens=6, temperature=0)
    m = r.choices[0].message
    assert m.role == "assistant" and isinstance(m.content, str), r
    assert r.object == "chat.completion" and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens, r


@check("chat: stream (no empty deltas, role first)")
def _():
    whole = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0).choices[0].message.content
    text, roles = "", []
    for chunk in client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0, stream=True):
        for c in chunk.choices:
            if c.delta.role:
                roles.append(c.delta.role)
            if c.delta.content is not None:
                assert c.delta.content != "", chunk
                text += c.delta.content
    assert roles == ["assistant"] and text == whole, (roles, text, whole)


@check("chat: stream_options include_usage ends with a usage chunk of no choices")
def _():
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None and last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens, last
    assert all(c.usage is None for c in chunks[:-1]), chunks


@check("chat: logprobs and top_logprobs")
def _():
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in content), r
    assert all(isinstance(t.bytes, list) for t in content), r


@check("chat: n choices with distinct seeds")
def _():
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=1.5, top_p=1.0, seed=11, n=2)
    assert [c.index for c in r.choices] == [0, 1], r
    one = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=1.5, top_p=1.0, seed=12)
    assert r.choices[1].message.content == one.choices[0].message.content, (r, one)


@check("chat: response_format json_schema")
def _():
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "blue"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["color", "n"], "additionalProperties": False}
    for seed in range(3):
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a color"}], max_tokens=400, temperature=1.0, seed=seed,
                                           response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema, "strict": True}})
        v = json.loads(r.choices[0].message.content)
        assert v["color"] in ("red", "blue") and 0 <= v["n"] <= 9 and set(v) == {"color", "n"}, v


@check("chat: response_format json_object")
def _():
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "json"}], max_tokens=60, temperature=0, response_format={"type": "json_object"})
    assert r.choices[0].message.content.lstrip().startswith("{"), r


@check("chat: tools with tool_choice required come back as tool_calls")
def _():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"], "additionalProperties": False}}}]
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "weather?"}], tools=tools, tool_choice="required", max_tokens=400, temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", r
    call = c.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather", call
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo"), call
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "weather?"}], tools=tools, tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=400, temperature=0)
    assert r.choices[0].message.tool_calls[0].function.name == "get_weather", r


@check("chat: a streamed forced call comes as tool_calls deltas")
def _():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}}}]
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "weather?"}], tools=tools, tool_choice="required", max_tokens=400, temperature=0, stream=True)
    name, args, finish = "", "", None
    for chunk in stream:
        for c in chunk.choices:
            for call in c.delta.tool_calls or []:
                assert call.index == 0, call
                name += call.function.name or ""
                args += call.function.arguments or ""
            finish = c.finish_reason or finish
    assert (name, finish) == ("get_weather", "tool_calls"), (name, finish)
    assert json.loads(args)["city"] in ("Paris", "Oslo"), args


@check("chat: logit_bias bans a token")
def _():
    first = client.completions.create(model="tiny", prompt="hello", max_tokens=1, temperature=0, logprobs=1).choices[0].logprobs.tokens[0]
    ids = json.loads(urllib.request.urlopen(urllib.request.Request(base + "/tokenize", data=json.dumps({"content": first}).encode(), headers={"Content-Type": "application/json", "Authorization": "Bearer sk-test"})).read())["tokens"]
    r = client.completions.create(model="tiny", prompt="hello", max_tokens=1, temperature=0, logprobs=1, logit_bias={str(ids[0]): -100})
    assert r.choices[0].logprobs.tokens[0] != first, r


@check("responses: output_text, status, usage")
def _():
    r = client.responses.create(model="tiny", input="hello", instructions="Be brief.", max_output_tokens=8, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.status in ("completed", "incomplete"), r
    assert isinstance(r.output_text, str) and r.output[0].type == "message" and r.output[0].content[0].type == "output_text", r
    assert r.usage.output_tokens <= 8 and r.usage.input_tokens > 0 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens, r.usage
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens", r


@check("responses: the stream accumulates to the whole answer")
def _():
    ask = dict(model="tiny", input=[{"role": "user", "content": "hello"}], max_output_tokens=16, temperature=0)
    whole = client.responses.create(**ask)
    with client.responses.stream(**ask) as s:
        events = list(s)
    kinds = [e.type for e in events]
    # A truncated answer ends with `response.incomplete` (as OpenAI's), which the client's
    # get_final_response() does not accept: the last event carries the response instead.
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == f"response.{whole.status}", kinds
    assert [e.sequence_number for e in events] == list(range(len(events))), kinds
    final = events[-1].response
    assert final.output_text == whole.output_text == "".join(e.delta for e in events if e.type == "response.output_text.delta"), (final, whole)


@check("responses: a forced function tool comes back as a function_call item, streamed too")
def _():
    tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}}]
    ask = dict(model="tiny", input="weather?", tools=tools, tool_choice="required", max_output_tokens=400, temperature=0)
    r = client.responses.create(**ask)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and json.loads(calls[0].arguments)["city"] in ("Paris", "Oslo") and calls[0].call_id, r
    with client.responses.stream(**ask) as s:
        final = s.get_final_response()
    got = [(o.name, o.arguments) for o in final.output if o.type == "function_call"]
    assert got == [(c.name, c.arguments) for c in calls], final
    # The next turn sends the call and its output back.
    r2 = client.responses.create(model="tiny", input=[{"role": "user", "content": "weather?"}, {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments}, {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 C"}], tools=tools, max_output_tokens=4, temperature=0)
    assert r2.object == "response", r2


@check("responses: input_tokens counts the prompt a request would run")
def _():
    n = client.responses.input_tokens.count(model="tiny", input="count me", instructions="sys").input_tokens
    r = client.responses.create(model="tiny", input="count me", instructions="sys", max_output_tokens=1, temperature=0)
    assert n == r.usage.input_tokens, (n, r.usage)


@check("responses: previous_response_id and hosted tools raise BadRequestError")
def _():
    for kwargs in (dict(previous_response_id="resp_x"), dict(tools=[{"type": "web_search"}])):
        try:
            client.responses.create(model="tiny", input="x", max_output_tokens=2, **kwargs)
        except openai.BadRequestError as e:
            assert e.body["param"] in ("previous_response_id", "tools"), e.body
        else:
            raise AssertionError(f"accepted {kwargs}")


@check("embeddings: unit vectors, floats and base64 alike")
def _():
    r = client.embeddings.create(model="tiny", input=["hello world", "the world"])
    assert [d.index for d in r.data] == [0, 1] and r.usage.prompt_tokens > 0, r
    v = r.data[0].embedding
    assert abs(sum(x * x for x in v) - 1.0) < 1e-4, sum(x * x for x in v)
    # Without encoding_format the client asks for base64 and decodes it; asked for floats, the same.
    f = client.embeddings.create(model="tiny", input="hello world", encoding_format="float")
    assert max(abs(x - y) for x, y in zip(f.data[0].embedding, v)) < 1e-6, "floats and base64 hold the same values"
    b = client.embeddings.create(model="tiny", input="hello world", encoding_format="base64").data[0].embedding
    raw = base64.b64decode(b)
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == f.data[0].embedding, "base64 is little-endian f32"


@check("refused fields raise BadRequestError")
def _():
    for kwargs in [dict(n=99), dict(echo=True), dict(best_of=2), dict(temperature=float("inf")), dict(logprobs=101)]:
        try:
            client.completions.create(model="tiny", prompt="x", max_tokens=2, **kwargs)
        except openai.BadRequestError as e:
            assert e.status_code == 400 and e.body and "message" in e.body, e
        except ValueError:
            pass  # the client itself refused to send it (JSON has no infinity)
        else:
            raise AssertionError(f"{kwargs} was accepted")
    try:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}], max_tokens=2)
    except openai.BadRequestError:
        pass
    else:
        raise AssertionError("an image part was accepted")


@check("context overflow is exceed_context_size_error")
def _():
    try:
        client.completions.create(model="tiny", prompt="hello " * 2000, max_tokens=2)
    except openai.BadRequestError as e:
        assert e.body.get("type") == "exceed_context_size_error" or "context" in str(e), e
    else:
        raise AssertionError("an overlong prompt was accepted")


@check("plain SSE reader: data lines, JSON chunks, [DONE] last")
def _():
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0, "stream": True}).encode(), headers={"Content-Type": "application/json", "Authorization": "Bearer sk-test"})
    with urllib.request.urlopen(req) as resp:
        assert resp.headers.get("Content-Type", "").startswith("text/event-stream"), resp.headers
        data = [line[6:] for line in resp.read().decode().splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]", data
    chunks = [json.loads(d) for d in data[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks), chunks
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop"), chunks[-1]


failed = 0
for name, f in checks:
    try:
        f()
        print(f"ok   {name}")
    except Exception as e:  # report every failure, then fail
        failed += 1
        print(f"FAIL {name}: {type(e).__name__}: {e}")
print(f"{len(checks) - failed}/{len(checks)} passed (openai {openai.__version__})")
sys.exit(1 if failed else 0)
