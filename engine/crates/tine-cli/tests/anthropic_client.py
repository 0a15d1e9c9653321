"""The official `anthropic` Python client against `tine serve`'s Messages API (run by tine-cli's
`the_official_openai_and_anthropic_clients_get_what_they_ask_for`, which starts the server on a
synthetic model with a Hermes tool template and passes its URL).

Every call asserts the shape the client parsed; refused requests must raise the client's
BadRequestError (a 400); a stream is read with the client's own accumulator.

usage: anthropic_client.py BASE_URL   (e.g. http://127.0.0.1:8080)
"""
import json
import sys

import anthropic

base = sys.argv[1].rstrip("/")
client = anthropic.Anthropic(base_url=base, api_key="sk-test", max_retries=0, timeout=60)
checks = []
# This client no longer sends sampling fields; llama-server's (and tine's) are passed as extra fields.
GREEDY = {"temperature": 0}
WEATHER = {"name": "get_weather", "description": "Weather of a city", "input_schema": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}}


def check(name):
    def wrap(f):
        checks.append((name, f))
        return f
    return wrap


@check("messages: text, stop_reason, usage")
def _():
    r = client.messages.create(model="tiny", max_tokens=8, system="Be brief.", messages=[{"role": "user", "content": "hello"}], extra_body=GREEDY)
    assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_"), r
    assert r.stop_reason in ("max_tokens", "end_turn"), r
    assert all(b.type == "text" for b in r.content), r
    assert r.usage.output_tokens <= 8 and r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0) > 0, r.usage


@check("messages: greedy is deterministic, content blocks join as the OpenAI chat's text")
def _():
    ask = dict(model="tiny", max_tokens=12, messages=[{"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "the best book"}]}], extra_body=GREEDY)
    a, b = client.messages.create(**ask), client.messages.create(**ask)
    assert a.content == b.content, (a, b)


@check("messages: stop_sequences end with stop_sequence")
def _():
    r = client.messages.create(model="tiny", max_tokens=40, messages=[{"role": "user", "content": "hello"}], extra_body=GREEDY)
    text = "".join(b.text for b in r.content if b.type == "text")
    if len(text) > 4:
        word = text[2:4]
        r = client.messages.create(model="tiny", max_tokens=40, messages=[{"role": "user", "content": "hello"}], extra_body=GREEDY, stop_sequences=[word])
        assert r.stop_reason == "stop_sequence" and r.stop_sequence == word, r


@check("messages: output_config.format holds the answer to a JSON schema")
def _():
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"], "additionalProperties": False}
    r = client.messages.create(model="tiny", max_tokens=200, messages=[{"role": "user", "content": "yes or no?"}], output_config={"format": {"type": "json_schema", "schema": schema}}, extra_body=GREEDY)
    assert json.loads(r.content[0].text)["answer"] in ("yes", "no"), r


@check("messages: stream accumulates to the whole answer")
def _():
    ask = dict(model="tiny", max_tokens=16, messages=[{"role": "user", "content": "hello"}], extra_body=GREEDY)
    whole = client.messages.create(**ask)
    with client.messages.stream(**ask) as s:
        names = [e.type for e in s]
        final = s.get_final_message()
    assert names[0] == "message_start" and names[-1] == "message_stop", names
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content], (final, whole)
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens, (final, whole)


@check("messages: a forced tool comes back as a tool_use block, streamed too")
def _():
    ask = dict(model="tiny", max_tokens=400, messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    r = client.messages.create(**ask)
    uses = [b for b in r.content if b.type == "tool_use"]
    assert r.stop_reason == "tool_use" and len(uses) == 1, r
    assert uses[0].name == "get_weather" and uses[0].input["city"] in ("Paris", "Oslo") and uses[0].id, uses
    with client.messages.stream(**ask) as s:
        final = s.get_final_message()
    su = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and [(u.name, u.input) for u in su] == [(u.name, u.input) for u in uses], final


@check("messages: a tool result continues the conversation")
def _():
    r = client.messages.create(
        model="tiny", max_tokens=6, tools=[WEATHER], extra_body=GREEDY,
        messages=[
            {"role": "user", "content": "weather in Paris?"},
            {"role": "assistant", "content": [{"type": "text", "text": "Checking."}, {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"}, {"type": "text", "text": "and so?"}]},
        ],
    )
    assert r.type == "message", r


@check("messages.count_tokens agrees with the usage of a request")
def _():
    msgs = [{"role": "user", "content": "count me"}]
    n = client.messages.count_tokens(model="tiny", messages=msgs, system="sys").input_tokens
    r = client.messages.create(model="tiny", max_tokens=1, messages=msgs, system="sys", extra_body=GREEDY)
    assert n == r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0), (n, r.usage)


@check("refused requests raise BadRequestError with Anthropic's error shape")
def _():
    for kwargs in (
        dict(messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]),
        dict(messages=[{"role": "robot", "content": "x"}]),
        dict(messages=[{"role": "user", "content": "x"}], extra_body={"top_p": 3}),
        dict(messages=[{"role": "user", "content": "x"}], output_config={"format": {"type": "yaml"}}),
    ):
        try:
            client.messages.create(model="tiny", max_tokens=4, **kwargs)
        except anthropic.BadRequestError as e:
            assert e.body["type"] == "error" and e.body["error"]["type"] == "invalid_request_error", e.body
        else:
            raise AssertionError(f"accepted: {kwargs}")


@check("a wrong key is AuthenticationError")
def _():
    try:
        anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0).messages.create(model="tiny", max_tokens=1, messages=[{"role": "user", "content": "x"}])
    except anthropic.AuthenticationError:
        pass
    else:
        raise AssertionError("accepted a wrong key")


failed = 0
for name, f in checks:
    try:
        f()
        print(f"ok   {name}")
    except Exception as e:  # report every failure, then fail
        failed += 1
        print(f"FAIL {name}: {type(e).__name__}: {e}")
print(f"{len(checks) - failed}/{len(checks)} passed (anthropic {anthropic.__version__})")
sys.exit(1 if failed else 0)
