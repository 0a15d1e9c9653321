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
        (Endpoint::Completion, r#"{"prompt": [["a"]]}"#, Err("`prompt` as a string, a list of token ids, or a list of prompts")),
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
