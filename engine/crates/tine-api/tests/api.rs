//! tine-api's checks over a table of bodies (the server's tests cover the same at the HTTP level).

use tine_api::{decode_any, Endpoint};

#[test]
fn bodies_are_accepted_or_refused_with_a_message_naming_the_field() {
    let cases: &[(Endpoint, &str, Result<&str, &str>)] = &[
        (Endpoint::Completion, r#"{"prompt": "hi", "n_predict": 3}"#, Ok("completion prompt 2 n_predict 3")),
        (Endpoint::Completion, r#"{"prompt": ["hi"], "max_tokens": 4}"#, Ok("n_predict 4")),
        (Endpoint::Completion, r#"{"prompt": [1, 2, 3]}"#, Ok("prompt 3 n_predict -1")),
        (Endpoint::Completion, r#"{"prompt": "hi", "unknown": {"x": 1}}"#, Ok("completion")),
        (Endpoint::Completion, r#"{"prompt": ["a", "b"]}"#, Err("one prompt per request")),
        (Endpoint::Completion, r#"{"n_predict": 3}"#, Err("`prompt` is required")),
        (Endpoint::Completion, r#"{"prompt": [1, 400]}"#, Err("token id 400 is outside the vocabulary (0..300)")),
        (Endpoint::Completion, r#"{"prompt": "hi", "n": 3}"#, Err("n = 3")),
        (Endpoint::Completion, r#"{"prompt": "hi", "n_predict": -2}"#, Err("n_predict must be -1")),
        (Endpoint::Completion, r#"{"prompt": "hi", "n_probs": 101}"#, Err("n_probs must be at most 100")),
        (Endpoint::Completion, r#"{"prompt": "hi", "top_p": 2}"#, Err("top_p")),
        (Endpoint::Completion, r#"{"prompt": "hi", "stop": 5}"#, Err("`stop` as a string or a list of strings")),
        (Endpoint::Completion, "  ", Err("the request body is empty")),
        (Endpoint::Completion, "[]", Err("expected a JSON object")),
        (Endpoint::Chat, r#"{"messages": [{"role": "user", "content": [{"type": "text", "text": "ab"}, {"type": "image_url"}]}]}"#, Ok("chat 1 messages 2 bytes")),
        (Endpoint::Chat, r#"{"messages": "x"}"#, Err("invalid type")),
        (Endpoint::Chat, r#"{}"#, Err("missing field `messages`")),
        (Endpoint::Tokenize, r#"{"content": "abc"}"#, Ok("tokenize 3 bytes")),
        (Endpoint::Detokenize, r#"{"tokens": [-1]}"#, Err("token id -1 is outside")),
    ];
    for (ep, body, want) in cases {
        let got = decode_any(*ep, body.as_bytes(), 300);
        match (want, &got) {
            (Ok(needle), Ok(summary)) => assert!(summary.contains(needle), "{ep:?} {body}: {summary}"),
            (Err(needle), Err(e)) => assert!(e.0.contains(needle), "{ep:?} {body}: {e}"),
            _ => panic!("{ep:?} {body}: want {want:?}, got {got:?}"),
        }
    }
}
