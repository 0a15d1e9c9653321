//! tine-api's checks over a table of bodies (the server's tests cover the same at the HTTP level).

use tine_api::{decode_any, Endpoint};

#[test]
fn bodies_are_accepted_or_refused_with_a_message_naming_the_field() {
    let cases: &[(Endpoint, &str, Result<&str, &str>)] = &[
        (Endpoint::Completion, r#"{"prompt": "hi", "n_predict": 3}"#, Ok("completion prompt 2 n_predict 3")),
        (Endpoint::Completion, r#"{"prompt": ["hi"], "max_tokens": 4}"#, Ok("n_predict 4")),
        (Endpoint::Completion, r#"{"prompt": [1, 2, 3]}"#, Ok("prompt 3 n_predict -1")),
        (Endpoint::Completion, r#"{"prompt": "hi", "unknown": {"x": 1}}"#, Ok("completion")),
        (Endpoint::Completion, r#"{"prompt": ["a", "bc"]}"#, Ok("completion prompt 1+2 n_predict -1 n 1")),
        (Endpoint::Completion, r#"{"prompt": [[1, 2], [3]], "n": 2}"#, Ok("completion prompt 2+1 n_predict -1 n 2")),
        (Endpoint::Completion, r#"{"prompt": ["a", [1]]}"#, Ok("completion prompt 1+1")),
        (Endpoint::Completion, r#"{"prompt": []}"#, Ok("completion prompt 0")), // the server refuses an empty prompt
        (Endpoint::Completion, r#"{"prompt": [[1], [400]]}"#, Err("token id 400 is outside")),
        (Endpoint::Completion, r#"{"prompt": [["a"]]}"#, Ok("completion prompt 1")),
        (Endpoint::Completion, r#"{"prompt": [[{"a": 1}]]}"#, Err("`prompt` as a string, a list of token ids, a `{\"prompt_string\": ...}` object, or a list of prompts")),
        (Endpoint::Completion, r#"{"n_predict": 3}"#, Err("`prompt` is required")),
        (Endpoint::Completion, r#"{"prompt": [1, 400]}"#, Err("token id 400 is outside the vocabulary (0..300)")),
        (Endpoint::Completion, r#"{"prompt": "hi", "n": 17}"#, Err("n must lie in 1..=16, got n = 17")),
        (Endpoint::Completion, r#"{"prompt": "hi", "n": 0}"#, Err("n = 0")),
        (Endpoint::Completion, r#"{"prompt": "hi", "echo": true}"#, Err("echo:")),
        (Endpoint::Completion, r#"{"prompt": "hi", "echo": false, "best_of": 1, "suffix": ""}"#, Ok("completion")),
        (Endpoint::Completion, r#"{"prompt": "hi", "best_of": 3}"#, Err("best_of: only 1")),
        (Endpoint::Completion, r#"{"prompt": "hi", "suffix": "x"}"#, Err("suffix:")),
        (Endpoint::Completion, r#"{"prompt": "hi", "n_predict": -2}"#, Err("n_predict must be -1")),
        (Endpoint::Completion, r#"{"prompt": "hi", "n_probs": 101}"#, Err("n_probs must be at most 100")),
        (Endpoint::Completion, r#"{"prompt": "hi", "top_p": 2}"#, Err("top_p")),
        (Endpoint::Completion, r#"{"prompt": "hi", "stop": 5}"#, Err("`stop` as a string or a list of strings")),
        (Endpoint::Completion, "  ", Err("the request body is empty")),
        (Endpoint::Completion, "[]", Err("expected a JSON object")),
        // Issue 32: text parts are joined by a newline, as llama-server joins them ("ab\nc").
        (Endpoint::Chat, r#"{"messages": [{"role": "user", "content": [{"type": "text", "text": "ab"}, {"type": "text", "text": "c"}]}]}"#, Ok("chat 1 messages 4 bytes")),
        (Endpoint::Chat, r#"{"messages": [{"role": "user", "content": [{"type": "text", "text": "ab"}, {"type": "image_url"}]}]}"#, Err("`image_url` are not supported")),
        (Endpoint::Chat, r#"{"messages": "x"}"#, Err("invalid type")),
        (Endpoint::Chat, r#"{"messages": [], "top_logprobs": 2}"#, Err("top_logprobs needs `logprobs: true`")),
        (Endpoint::Chat, r#"{"messages": [], "logprobs": true, "top_logprobs": 101}"#, Err("top_logprobs must lie in 0..=100")),
        (Endpoint::Completion, r#"{"prompt": "x", "logprobs": -1}"#, Err("logprobs must lie in 0..=100")),
        (Endpoint::Completion, r#"{"prompt": "x", "logprobs": "yes"}"#, Err("`logprobs` as a boolean or a count")),
        (Endpoint::Chat, r#"{}"#, Err("missing field `messages`")),
        // Issue 52: llama-server's prompt object, alone or in a list; a list of strings stays a list.
        (Endpoint::Completion, r#"{"prompt": {"prompt_string": "abc"}}"#, Ok("completion prompt 3")),
        (Endpoint::Completion, r#"{"prompt": [{"prompt_string": "a"}, "bc"]}"#, Ok("completion prompt 1+2")),
        (Endpoint::Completion, r#"{"prompt": {"prompt_string": "a", "multimodal_data": ["aGk="]}}"#, Err("`multimodal_data` is not supported")),
        (Endpoint::Completion, r#"{"prompt": {"text": "a"}}"#, Err("needs `prompt_string`")),
        // A list mixing ids and strings is one prompt (llama.cpp's `tokenize_mixed`), also inside a list.
        (Endpoint::Completion, r#"{"prompt": [1, 2, "abc", 3]}"#, Ok("completion prompt 4")),
        (Endpoint::Completion, r#"{"prompt": [[1, "abc"], "de"]}"#, Ok("completion prompt 2+2")),
        (Endpoint::Completion, r#"{"prompt": [["a", "b"]]}"#, Ok("completion prompt 2")),
        (Endpoint::Completion, r#"{"prompt": [1, {"x": 1}]}"#, Err("or a list of prompts")),
        (Endpoint::Tokenize, r#"{"content": "abc"}"#, Ok("tokenize 3 bytes")),
        (Endpoint::Detokenize, r#"{"tokens": [-1]}"#, Err("token id -1 is outside")),
    ];
    for (ep, body, want) in cases {
        let got = decode_any(*ep, body.as_bytes(), 300);
        match (want, &got) {
            (Ok(needle), Ok(summary)) => assert!(summary.contains(needle), "{ep:?} {body}: {summary}"),
            (Err(needle), Err(e)) => assert!(e.message.contains(needle), "{ep:?} {body}: {e}"),
            _ => panic!("{ep:?} {body}: want {want:?}, got {got:?}"),
        }
    }
}

#[test]
fn openai_logprobs_ask_the_engine_for_at_least_the_sampled_token() {
    let l = |body: &str| tine_api::decode::<tine_api::CompletionBody>(body.as_bytes()).expect("decodes").gen.limits().expect("valid");
    let none = l(r#"{"prompt": "x"}"#);
    assert_eq!((none.logprobs, none.n_probs), (None, 0));
    let zero = l(r#"{"prompt": "x", "logprobs": 0}"#);
    assert_eq!((zero.logprobs, zero.n_probs), (Some(0), 1));
    let chat = l(r#"{"prompt": "x", "logprobs": true, "top_logprobs": 4}"#);
    assert_eq!((chat.logprobs, chat.n_probs), (Some(4), 4));
    let both = l(r#"{"prompt": "x", "logprobs": 2, "n_probs": 7}"#);
    assert_eq!((both.logprobs, both.n_probs), (Some(2), 7));
}

/// Issue 32: on a template without a tool syntax, tools take the generic format: the tools are
/// described in the system turn, earlier calls and results become turns such a template can
/// render (turns still alternate), and the output is held to the format's JSON.
#[test]
fn tools_on_a_template_without_a_tool_syntax_take_the_generic_format() {
    use serde_json::json;
    use tine_api::{check_chat, check_chat_prompt, Defaults, ToolMode};
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    let history = json!([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {"role": "assistant", "content": null, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "c2", "content": "3 C"},
        {"role": "user", "content": "Thanks; and tomorrow?"}
    ]);
    let body = |extra: serde_json::Value| {
        let mut b = json!({"messages": history, "tools": tools});
        b.as_object_mut().expect("object").extend(extra.as_object().expect("object").clone());
        b.to_string().into_bytes()
    };
    let p = check_chat_prompt(&body(json!({})), false).expect("accepted");
    assert!(p.tools.is_none(), "the template itself gets no tools");
    let roles: Vec<&str> = p.messages.iter().map(|m| m["role"].as_str().expect("role")).collect();
    assert_eq!(roles, ["system", "user", "assistant", "user"], "{:?}", p.messages);
    let system = p.messages[0]["content"].as_str().expect("text");
    assert!(system.starts_with("Be brief.\n\nYou have access to the following tools:\n{\"name\":\"get_weather\",\"description\":\"Weather of a city\",\"parameters\":{"), "{system}");
    assert!(system.contains("{\"response\":\"your answer\"}"), "auto allows a plain answer: {system}");
    assert_eq!(p.messages[2]["content"], "{\"tool_calls\":[{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\"}},{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Oslo\"}}]}");
    let results = p.messages[3]["content"].as_str().expect("text");
    assert_eq!(
        results,
        "{\"tool_response\":{\"tool\":\"get_weather\",\"tool_call_id\":\"c1\",\"content\":\"18 C\"}}\n{\"tool_response\":{\"tool\":\"get_weather\",\"tool_call_id\":\"c2\",\"content\":\"3 C\"}}\nThanks; and tomorrow?"
    );
    // The output is held to a call or a response; `required` drops the response, and
    // `parallel_tool_calls` asks for a list.
    let d = Defaults::default();
    let r = check_chat(&body(json!({})), &d, false).expect("accepted");
    assert_eq!(r.tools, ToolMode::Generic);
    let schema = |r: &tine_api::ChatRequest| match &r.limits.constraint {
        Some((_, tine_api::Constraint::JsonSchema(s))) => s.clone(),
        other => panic!("a schema, got {other:?}"),
    };
    let s = schema(&r);
    assert_eq!(s["anyOf"].as_array().map(Vec::len), Some(2), "{s}");
    assert_eq!(s["anyOf"][0]["required"], json!(["tool_call"]), "{s}");
    assert_eq!(s["anyOf"][0]["properties"]["tool_call"]["anyOf"][0]["properties"]["name"], json!({"const": "get_weather"}), "{s}");
    assert_eq!(s["anyOf"][1]["required"], json!(["response"]), "{s}");
    let s = schema(&check_chat(&body(json!({"tool_choice": "required", "parallel_tool_calls": true})), &d, false).expect("accepted"));
    assert_eq!((s["anyOf"].as_array().map(Vec::len), &s["anyOf"][0]["required"]), (Some(1), &json!(["tool_calls"])), "{s}");
    // No tools offered: no schema, but the history is still rewritten.
    let r = check_chat(&body(json!({"tool_choice": "none"})), &d, false).expect("accepted");
    assert_eq!((r.tools, r.limits.constraint.is_none(), r.prompt.messages.len()), (ToolMode::None, true, 4));
    assert!(!r.prompt.messages[0]["content"].as_str().expect("text").contains("following tools"));
    // The format is a schema of its own: another constraint is refused, naming `tools`.
    let e = check_chat(&body(json!({"response_format": {"type": "json_object"}})), &d, false).expect_err("refused");
    assert_eq!(e.param.as_deref(), Some("tools"), "{e}");
    // A template with a tool syntax gets the tools and the messages as they came.
    let r = check_chat(&body(json!({})), &d, true).expect("accepted");
    assert_eq!((r.tools, r.prompt.tools.is_some(), r.prompt.messages.len(), r.limits.constraint.is_none()), (ToolMode::Native, true, 6, true));
    let r = check_chat(&body(json!({"tool_choice": "required"})), &d, true).expect("accepted");
    assert_eq!(r.tools, ToolMode::NativeForced);
}

/// Issue 32: a forced or generic call holds the keys its tool names: objects in a tool's
/// parameters that leave `additionalProperties` unset get none (llama.cpp's reading), and one
/// that sets it keeps its own.
#[test]
fn a_tool_calls_arguments_hold_only_the_keys_its_schema_names() {
    use serde_json::json;
    use tine_api::{check_chat, Defaults};
    let params = json!({"type": "object", "properties": {"city": {"type": "string"}, "opts": {"type": "object", "properties": {"unit": {"type": "string"}}}, "extra": {"type": "object", "properties": {}, "additionalProperties": true}}});
    let body = json!({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f", "parameters": params}}], "tool_choice": "required"});
    for native in [true, false] {
        let r = check_chat(body.to_string().as_bytes(), &Defaults::default(), native).expect("accepted");
        let Some((_, tine_api::Constraint::JsonSchema(s))) = &r.limits.constraint else { panic!("a schema") };
        let call = if native { &s["anyOf"][0] } else { &s["anyOf"][0]["properties"]["tool_call"]["anyOf"][0] };
        let args = &call["properties"]["arguments"];
        assert_eq!(
            (&args["additionalProperties"], &args["properties"]["opts"]["additionalProperties"], &args["properties"]["extra"]["additionalProperties"]),
            (&json!(false), &json!(false), &json!(true)),
            "{s}"
        );
        assert_eq!(s["x-guidance"], json!({"whitespace_flexible": false}), "compact JSON: {s}");
    }
}

/// Issue 32: Anthropic's Messages and OpenAI's Responses bodies become the chat body llama-server
/// maps them to; what cannot be honoured is refused naming the field.
#[test]
fn anthropic_and_responses_bodies_become_chat_bodies() {
    use serde_json::json;
    use tine_api::dialects::{anthropic_to_chat, responses_to_chat};
    let a = json!({
        "model": "m", "max_tokens": 9, "system": [{"type": "text", "text": "Be brief."}], "stop_sequences": ["END"], "temperature": 0.5,
        "tools": [{"name": "w", "description": "d", "input_schema": {"type": "object"}}], "tool_choice": {"type": "tool", "name": "w", "disable_parallel_tool_use": true},
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm"}, {"type": "text", "text": "Checking."}, {"type": "tool_use", "id": "t1", "name": "w", "input": {"c": 1}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "18 C"}]}, {"type": "text", "text": "so?"}]}
        ]
    });
    let c = anthropic_to_chat(a.to_string().as_bytes()).expect("converts");
    assert_eq!(
        c["messages"],
        json!([
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Checking.", "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "w", "arguments": "{\"c\":1}"}}]},
            {"role": "tool", "tool_call_id": "t1", "content": "18 C"},
            {"role": "user", "content": "so?"}
        ])
    );
    assert_eq!((&c["max_tokens"], &c["stop"], &c["temperature"], &c["parallel_tool_calls"]), (&json!(9), &json!(["END"]), &json!(0.5), &json!(false)));
    assert_eq!(c["tools"], json!([{"type": "function", "function": {"name": "w", "description": "d", "parameters": {"type": "object"}}}]));
    assert_eq!(c["tool_choice"], json!({"type": "function", "function": {"name": "w"}}));
    assert_eq!(anthropic_to_chat(br#"{"messages": []}"#).expect("converts")["max_tokens"], 4096, "llama-server's default");
    let t = anthropic_to_chat(br#"{"messages": [], "thinking": {"type": "disabled"}}"#).expect("converts");
    assert_eq!(t["chat_template_kwargs"], json!({"enable_thinking": false}));
    let t = responses_to_chat(br#"{"input": "x", "reasoning": {"effort": "low"}, "chat_template_kwargs": {"reasoning_effort": "high"}}"#).expect("converts");
    assert_eq!(t["chat_template_kwargs"], json!({"reasoning_effort": "high"}), "the client's own kwargs win");
    for (body, param) in [
        (json!({"max_tokens": 1}), "messages"),
        (json!({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}), "messages"),
        (json!({"messages": [{"role": "system", "content": "x"}]}), "messages"),
        (json!({"messages": [], "tool_choice": {"type": "maybe"}}), "tool_choice"),
        (json!({"messages": [], "output_config": {"format": {"type": "xml"}}}), "output_config.format"),
        (json!({"messages": [], "tools": [{"type": "web_search_20250305", "name": "web_search"}]}), "tools"),
    ] {
        assert_eq!(anthropic_to_chat(body.to_string().as_bytes()).expect_err("refused").param.as_deref(), Some(param), "{body}");
    }
    let r = json!({
        "model": "m", "instructions": "Be brief.", "max_output_tokens": 7, "temperature": 0, "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
        "tools": [{"type": "function", "name": "w", "parameters": {"type": "object"}}], "tool_choice": {"type": "function", "name": "w"},
        "input": [
            {"role": "user", "content": "hi"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
            {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "18 C"},
            {"type": "reasoning", "summary": []},
            {"role": "developer", "content": [{"type": "input_text", "text": "note"}]}
        ]
    });
    let c = responses_to_chat(r.to_string().as_bytes()).expect("converts");
    assert_eq!(
        c["messages"],
        json!([
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Checking.", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
            {"role": "system", "content": "note"}
        ])
    );
    assert_eq!((&c["max_tokens"], &c["temperature"]), (&json!(7), &json!(0)));
    assert_eq!(c["response_format"], json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}));
    assert_eq!(c["tools"], json!([{"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}]));
    assert_eq!(c["tool_choice"], json!({"type": "function", "function": {"name": "w"}}));
    assert_eq!(responses_to_chat(br#"{"input": "hello"}"#).expect("converts")["messages"], json!([{"role": "user", "content": "hello"}]));
    for (body, param) in [
        (json!({"model": "m"}), "input"),
        (json!({"input": "x", "previous_response_id": "resp_1"}), "previous_response_id"),
        (json!({"input": "x", "tools": [{"type": "web_search"}]}), "tools"),
        (json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}), "input"),
        (json!({"input": "x", "text": {"format": {"type": "yaml"}}}), "text.format"),
        (json!({"input": "x", "conversation": "conv_1"}), "conversation"),
        (json!({"input": "x", "background": true}), "background"),
    ] {
        assert_eq!(responses_to_chat(body.to_string().as_bytes()).expect_err("refused").param.as_deref(), Some(param), "{body}");
    }
}
