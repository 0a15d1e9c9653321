//! Integration tests of tine-engine.

use tine_engine::{GenerateRequest, Generation, StopType};
use tine_runtime::Model;
use tine_sampling::SamplingParams;
use tine_spec::{SpecConfig, SpecFactory, SpecType};
use tine_test_support::TinyGemma3;

fn run(model: &Model, req: GenerateRequest, factory: Option<&SpecFactory>) -> (Vec<u32>, String, Option<StopType>, Vec<Vec<f32>>, tine_engine::Timings) {
    run_in(model, 256, req, factory)
}

fn run_in(model: &Model, context: usize, req: GenerateRequest, factory: Option<&SpecFactory>) -> (Vec<u32>, String, Option<StopType>, Vec<Vec<f32>>, tine_engine::Timings) {
    let mut seq = model.new_sequence(context);
    let mut spec = factory.map(|f| f.speculator(model, context).expect("speculator"));
    let mut g = Generation::start_with(model, &mut seq, req, spec.as_mut()).expect("start");
    g.record_logits(true);
    let mut streamed = String::new();
    while !g.is_finished() {
        let ev = g.step_with(model, &mut seq, spec.as_mut()).expect("step");
        streamed.push_str(&ev.text);
    }
    assert_eq!(streamed, g.text(), "streamed text equals the final text");
    (g.tokens().to_vec(), g.text().to_owned(), g.stop_type(), g.recorded_logits().to_vec(), g.timings())
}

#[test]
fn speculative_generation_hands_out_exactly_what_plain_generation_does() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tiny.gguf");
    TinyGemma3 { nextn: true, seed: 4, ..TinyGemma3::default() }.write(&path);
    let model = Model::load(&path).expect("fixture loads");
    let prompt = model.tokenizer.encode("hello world hello world hello", true, true);
    let requests = [
        GenerateRequest { n_predict: 33, sampling: SamplingParams::greedy(), ignore_eos: true, ..GenerateRequest::new(prompt.clone()) },
        GenerateRequest { n_predict: 5, sampling: SamplingParams::greedy(), ignore_eos: true, n_probs: 3, ..GenerateRequest::new(prompt.clone()) },
        GenerateRequest { n_predict: 40, sampling: SamplingParams::greedy(), stop: vec!["l".into(), "wor".into()], ..GenerateRequest::new(prompt.clone()) },
    ];
    for kind in [SpecType::DraftMtp, SpecType::Ngram] {
        let factory = SpecFactory::load(SpecConfig { ngram_min: 1, ..SpecConfig::new(kind) }, &model).expect("setup");
        for (i, req) in requests.iter().enumerate() {
            let want = run(&model, req.clone(), None);
            let got = run(&model, req.clone(), Some(&factory));
            assert_eq!((&got.0, &got.1, got.2), (&want.0, &want.1, want.2), "{kind}, request {i}");
            assert!(got.3.iter().zip(&want.3).all(|(a, b)| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())), "{kind}, request {i}: logits differ");
            assert_eq!(got.4.predicted_n, want.4.predicted_n);
            assert_eq!(want.4.draft, Default::default(), "plain decoding drafts nothing");
            if i == 0 {
                assert!(got.4.draft.draft_verify_steps > 0, "{kind}: the drafter ran: {:?}", got.4.draft);
            }
        }
    }
}

#[test]
fn speculation_stops_at_the_context_limit_exactly_where_plain_decoding_does() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tiny.gguf");
    TinyGemma3 { nextn: true, seed: 6, ..TinyGemma3::default() }.write(&path);
    let model = Model::load(&path).expect("fixture loads");
    let prompt = model.tokenizer.encode("hello hello hello", true, true);
    for context in [prompt.len() + 1, prompt.len() + 2, prompt.len() + 3, prompt.len() + 7] {
        let req = GenerateRequest { n_predict: -1, sampling: SamplingParams::greedy(), ignore_eos: true, ..GenerateRequest::new(prompt.clone()) };
        let want = run_in(&model, context, req.clone(), None);
        assert_eq!(want.2, Some(StopType::Limit));
        for kind in [SpecType::DraftMtp, SpecType::Ngram] {
            let factory = SpecFactory::load(SpecConfig { ngram_min: 1, ..SpecConfig::new(kind) }, &model).expect("setup");
            let got = run_in(&model, context, req.clone(), Some(&factory));
            assert_eq!((&got.0, got.2), (&want.0, want.2), "{kind}, context {context}");
        }
    }
}

/// Logit agreement between a shifted sequence and a fresh request on the same tokens (f32
/// sums in a different order: batch prefill against one decode step).
const SHIFT_TOLERANCE: f32 = 1e-4;

#[test]
fn a_context_shift_continues_exactly_as_a_fresh_request_on_the_shifted_tokens() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tiny.gguf");
    // The fixture's sliding window (4) is far shorter than the context: the shifted
    // evaluation must respect it too.
    TinyGemma3 { nextn: true, seed: 6, ..TinyGemma3::default() }.write(&path);
    let model = Model::load(&path).expect("fixture loads");
    let prompt = model.tokenizer.encode("hello world hello", true, true);
    let context = 40;
    for n_keep in [0, 3, -1] {
        let base = GenerateRequest { n_predict: 90, sampling: SamplingParams::greedy(), ignore_eos: true, n_keep, ..GenerateRequest::new(prompt.clone()) };
        let off = run_in(&model, context, base.clone(), None);
        assert_eq!(off.2, Some(StopType::Limit));
        let on = run_in(&model, context, GenerateRequest { context_shift: true, ..base.clone() }, None);
        assert_eq!(on.0.len(), 90, "n_keep {n_keep}: shifting generates past the context");
        assert!(on.4.shifts >= 2, "{:?}", on.4);
        // Up to the first shift, the same tokens as without shifting.
        let before = off.0.len();
        assert_eq!(on.0[..before], off.0[..], "n_keep {n_keep}");
        // The first shift: the sequence held prompt + before-1 generated tokens; the last one
        // was pending. A fresh request on the shifted tokens plus that one continues the same.
        let held: Vec<u32> = prompt.iter().chain(&off.0[..before - 1]).copied().collect();
        let keep = if n_keep < 0 { prompt.len() } else { (n_keep as usize).max(1) };
        let discard = (held.len() - keep) / 2;
        let mut shifted: Vec<u32> = held[..keep].iter().chain(&held[keep + discard..]).copied().collect();
        shifted.push(off.0[before - 1]);
        let until_next = context - 1 - shifted.len();
        let fresh = run_in(&model, context, GenerateRequest { n_predict: until_next as i32, sampling: SamplingParams::greedy(), ignore_eos: true, ..GenerateRequest::new(shifted) }, None);
        assert_eq!(fresh.0[..], on.0[before..before + until_next], "n_keep {n_keep}: the continuation after the shift");
        // The logits too, not only their argmax (the fresh request evaluates the pending token
        // in its prompt batch, the shift in a decode step: equal up to summation order).
        let worst = fresh.3.iter().zip(&on.3[before..]).flat_map(|(a, b)| a.iter().zip(b).map(|(x, y)| (x - y).abs())).fold(0f32, f32::max);
        assert!(worst < SHIFT_TOLERANCE, "n_keep {n_keep}: logits after the shift differ by {worst}");
        for kind in [SpecType::DraftMtp, SpecType::Ngram] {
            let factory = SpecFactory::load(SpecConfig { ngram_min: 1, ..SpecConfig::new(kind) }, &model).expect("setup");
            let got = run_in(&model, context, GenerateRequest { context_shift: true, ..base.clone() }, Some(&factory));
            assert_eq!(got.0, on.0, "{kind}, n_keep {n_keep}: speculation across shifts gives the plain output");
        }
    }
}

#[test]
fn a_prompt_begun_in_ubatches_is_evaluated_one_chunk_per_step_and_generates_the_same() {
    // The scheduler's path (begin_with + step_with) against start_with, plain and with each
    // drafter that keeps per-position state (the NextN head reads every prompt position).
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tiny.gguf");
    TinyGemma3 { nextn: true, seed: 5, ..TinyGemma3::default() }.write(&path);
    let model = Model::load(&path).expect("fixture loads");
    let prompt = model.tokenizer.encode("hello world the world an hello in the hell world world", true, true);
    let req = GenerateRequest { n_predict: 12, sampling: SamplingParams::greedy(), ignore_eos: true, ..GenerateRequest::new(prompt.clone()) };
    for kind in [None, Some(SpecType::DraftMtp), Some(SpecType::Ngram)] {
        let factory = kind.map(|k| SpecFactory::load(SpecConfig { ngram_min: 1, ..SpecConfig::new(k) }, &model).expect("setup"));
        let want = run(&model, req.clone(), factory.as_ref());
        for ubatch in [1, 3, 7, prompt.len()] {
            let mut seq = model.new_sequence(256);
            let mut spec = factory.as_ref().map(|f| f.speculator(&model, 256).expect("speculator"));
            let valid = req.clone().validate(seq.context()).expect("valid");
            let mut g = Generation::begin_with(&mut seq, valid, spec.as_mut(), ubatch).expect("begin");
            assert!(seq.is_empty(), "begin_with evaluates nothing");
            let mut prefill_steps = 0;
            while g.is_prefilling() {
                let before = seq.len();
                let ev = g.step_with(&model, &mut seq, spec.as_mut()).expect("prefill step");
                assert!(ev.token.is_none() && ev.stop.is_none() && ev.text.is_empty(), "a prefill step emits nothing");
                assert!(seq.len() - before <= ubatch, "at most one ubatch per step");
                prefill_steps += 1;
            }
            assert_eq!(prefill_steps, prompt.len().div_ceil(ubatch), "{kind:?} ubatch {ubatch}");
            let mut tokens = Vec::new();
            while !g.is_finished() {
                tokens.extend(g.step_with(&model, &mut seq, spec.as_mut()).expect("step").token);
            }
            assert_eq!(tokens, want.0, "{kind:?} ubatch {ubatch}: greedy output differs from start_with's");
            assert_eq!(g.timings().prompt_n, prompt.len());
        }
    }
}

mod grammar;

mod templates {
    use serde_json::json;
    use tine_engine::template::{parse_tool_calls, ChatTemplate, RenderInput, TemplateError, ToolCall, ToolSyntax};

    /// Issue 52: templates read llama-server's extra context: `functions` (the tools as JSON text,
    /// llama.cpp's `dump(2)` of its order-keeping JSON: two-space indents, keys as sent; "" without tools), `datetime` and
    /// `date_string` (today, in llama.cpp's two formats).
    #[test]
    fn templates_read_functions_and_the_date_as_llama_server_gives_them() {
        let t = ChatTemplate::from_gguf(Some("{% if tools %}{% endif %}[{{ functions }}] {{ datetime }} / {{ date_string }}"));
        let messages = [json!({"role": "user", "content": "Hi"})];
        let tools = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
        let render =
            |tools: Option<&serde_json::Value>| t.render(&RenderInput { messages: &messages, tools, add_generation_prompt: true, bos_token: "", eos_token: "", extra: None }).expect("renders");
        let with = render(Some(&tools));
        let want = "[[\n  {\n    \"type\": \"function\",\n    \"function\": {\n      \"name\": \"get_weather\",\n      \"parameters\": {\n        \"type\": \"object\",\n        \"properties\": {\n          \"city\": {\n            \"type\": \"string\"\n          }\n        }\n      }\n    }\n  }\n]] ";
        assert!(with.starts_with(want), "{with}");
        let without = render(None);
        assert!(without.starts_with("[] "), "{without}");
        // `%b %d %Y / %d %b %Y`: "Dec 07 2026 / 07 Dec 2026".
        let dates: Vec<&str> = without["[] ".len()..].split(" / ").collect();
        let (a, b): (Vec<&str>, Vec<&str>) = (dates[0].split(' ').collect(), dates[1].split(' ').collect());
        assert_eq!((a[0], a[1], a[2]), (b[1], b[0], b[2]), "{without}");
        assert!(a[0].len() == 3 && a[1].len() == 2 && a[2].len() == 4, "{without}");
    }

    /// Issue 32: `--chat-template` takes llama.cpp's built-in names, each rendering what
    /// llama.cpp's C++ renders (src/llama-chat.cpp, written out here per format), and an inline
    /// template; an unknown name is an error listing the names, not a bare file-not-found.
    #[test]
    fn llama_cpps_named_templates_render_as_llama_cpp_and_inline_templates_are_taken() {
        let messages = [
            json!({"role": "system", "content": "Be brief."}),
            json!({"role": "user", "content": " Hi "}),
            json!({"role": "assistant", "content": "Hello."}),
            json!({"role": "user", "content": "Bye"}),
        ];
        let render = |name: &str, agp: bool| {
            ChatTemplate::named(name).expect(name).render(&RenderInput { messages: &messages, tools: None, add_generation_prompt: agp, bos_token: "", eos_token: "", extra: None }).expect(name)
        };
        let cases = [
            ("chatml", "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n Hi <|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n", "<|im_start|>assistant\n"),
            (
                "llama3",
                "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>",
                "<|start_header_id|>assistant<|end_header_id|>\n\n",
            ),
            ("phi3", "<|system|>\nBe brief.<|end|>\n<|user|>\n Hi <|end|>\n<|assistant|>\nHello.<|end|>\n<|user|>\nBye<|end|>\n", "<|assistant|>\n"),
            ("zephyr", "<|system|>\nBe brief.<|endoftext|>\n<|user|>\n Hi <|endoftext|>\n<|assistant|>\nHello.<|endoftext|>\n<|user|>\nBye<|endoftext|>\n", "<|assistant|>\n"),
            ("mistral-v7", "[SYSTEM_PROMPT] Be brief.[/SYSTEM_PROMPT][INST]  Hi [/INST] Hello.</s>[INST] Bye[/INST]", ""),
            ("mistral-v7-tekken", "[SYSTEM_PROMPT]Be brief.[/SYSTEM_PROMPT][INST] Hi [/INST]Hello.</s>[INST]Bye[/INST]", ""),
        ];
        for (name, body, open) in cases {
            assert_eq!(render(name, false), body, "{name}");
            assert_eq!(render(name, true), format!("{body}{open}"), "{name} with the generation prompt");
        }
        // More of llama.cpp's names, each with the generation prompt, as llama-server's
        // `/apply-template` rendered them (`--no-jinja --chat-template NAME`, the build under
        // ~/.cache/tine-peers): byte for byte.
        let more = [
            ("llama2", "[INST] Be brief.\n Hi  [/INST]Hello.</s>[INST] Bye [/INST]"),
            ("llama2-sys", "[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\n Hi  [/INST]Hello.</s>[INST] Bye [/INST]"),
            ("llama2-sys-bos", "[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\n Hi  [/INST]Hello.</s><s>[INST] Bye [/INST]"),
            ("llama2-sys-strip", "[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST]Hello.</s>[INST] Bye [/INST]"),
            ("mistral-v1", " [INST] Be brief.\n\n Hi  [/INST] Hello.</s> [INST] Bye [/INST]"),
            ("mistral-v3", "[INST] Be brief.\n\n Hi [/INST] Hello.</s>[INST] Bye[/INST]"),
            ("mistral-v3-tekken", "[INST]Be brief.\n\n Hi [/INST]Hello.</s>[INST]Bye[/INST]"),
            ("phi4", "<|im_start|>system<|im_sep|>Be brief.<|im_end|><|im_start|>user<|im_sep|> Hi <|im_end|><|im_start|>assistant<|im_sep|>Hello.<|im_end|><|im_start|>user<|im_sep|>Bye<|im_end|><|im_start|>assistant<|im_sep|>"),
            ("falcon3", "<|system|>\nBe brief.\n<|user|>\n Hi \n<|assistant|>\nHello.\n<|user|>\nBye\n<|assistant|>\n"),
            ("openchat", "Be brief.<|end_of_turn|>GPT4 Correct User:  Hi <|end_of_turn|>GPT4 Correct Assistant: Hello.<|end_of_turn|>GPT4 Correct User: Bye<|end_of_turn|>GPT4 Correct Assistant:"),
            ("vicuna", "Be brief.\n\nUSER:  Hi \nASSISTANT: Hello.</s>\nUSER: Bye\nASSISTANT:"),
            ("vicuna-orca", "SYSTEM: Be brief.\nUSER:  Hi \nASSISTANT: Hello.</s>\nUSER: Bye\nASSISTANT:"),
            ("deepseek", "Be brief.### Instruction:\n Hi \n### Response:\nHello.\n<|EOT|>\n### Instruction:\nBye\n### Response:\n"),
            ("deepseek2", "Be brief.\n\nUser:  Hi \n\nAssistant: Hello.<｜end▁of▁sentence｜>User: Bye\n\nAssistant:"),
            ("deepseek3", "Be brief.\n\n<｜User｜> Hi <｜Assistant｜>Hello.<｜end▁of▁sentence｜><｜User｜>Bye<｜Assistant｜>"),
            ("command-r", "<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>Be brief.<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hi<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>Hello.<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|USER_TOKEN|>Bye<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"),
        ];
        for (name, want) in more {
            assert_eq!(render(name, true), want, "{name}");
        }
        let inline = ChatTemplate::named("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}").expect("an inline template");
        assert_eq!(
            inline.render(&RenderInput { messages: &messages[..2], tools: None, add_generation_prompt: false, bos_token: "", eos_token: "", extra: None }).expect("renders"),
            "[system]Be brief.[user] Hi "
        );
        // Issue 52: text without Jinja syntax that is neither a file nor name-like is a template.
        let constant = ChatTemplate::named("You are a bot.\n<turn>").expect("an inline template without Jinja syntax");
        assert_eq!(
            constant.render(&RenderInput { messages: &messages[..2], tools: None, add_generation_prompt: false, bos_token: "", eos_token: "", extra: None }).expect("renders"),
            "You are a bot.\n<turn>"
        );
        let err = ChatTemplate::named("command-r-nonexistent").expect_err("neither a name nor a file");
        assert!(err.to_string().contains("llama3") && err.to_string().contains("mistral-v7"), "{err}");
    }

    /// A Hermes-style template with tools, in the shape Qwen's and Hermes' GGUFs carry.
    const HERMES: &str = r#"{%- if tools %}<|im_start|>system
{{ messages[0]['content'] if messages[0]['role'] == 'system' else 'You are helpful.' }}

# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call a tool as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% elif messages[0]['role'] == 'system' %}<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}{% continue %}{% endif %}
{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{%- for tc in message.tool_calls %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content | trim }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content.strip() }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"#;

    fn input<'a>(messages: &'a [serde_json::Value], tools: Option<&'a serde_json::Value>) -> RenderInput<'a> {
        RenderInput { messages, tools, add_generation_prompt: true, bos_token: "<bos>", eos_token: "<eos>", extra: None }
    }

    #[test]
    fn a_gguf_template_is_rendered_with_python_methods_system_handling_and_tools() {
        let t = ChatTemplate::from_gguf(Some(HERMES));
        t.check().expect("parses");
        assert_eq!(t.tool_syntax(), Some(ToolSyntax::Hermes));
        let msgs = [json!({"role": "system", "content": "Be brief."}), json!({"role": "user", "content": "  Hi!  "})];
        assert_eq!(t.render(&input(&msgs, None)).expect("renders"), "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n");
        let tools = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
        let history = [
            json!({"role": "user", "content": "Weather in Paris?"}),
            json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]}),
            json!({"role": "tool", "tool_call_id": "c1", "content": " 18 C "}),
        ];
        let got = t.render(&input(&history, Some(&tools))).expect("renders with tools");
        // Python's json.dumps separators, keys in the client's order, and trim_blocks as Hugging Face renders.
        assert!(got.starts_with("<|im_start|>system\nYou are helpful.\n\n# Tools\n<tools>{\"type\": \"function\", \"function\": {\"name\": \"get_weather\""), "{got}");
        assert!(got.contains("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call><|im_end|>"), "{got}");
        assert!(got.contains("<tool_response>\n18 C\n</tool_response>"), "{got}");
        assert!(got.ends_with("<|im_start|>assistant\n"));
    }

    #[test]
    fn the_gemma_fallback_renders_what_gemma_3_expects_and_refuses_tools() {
        let t = ChatTemplate::from_gguf(None);
        assert_eq!(t, ChatTemplate::Gemma);
        let msgs = [json!({"role": "system", "content": "Be brief."}), json!({"role": "user", "content": "Hi"})];
        assert_eq!(t.render(&input(&msgs, None)).expect("renders"), "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n");
        assert_eq!(t.render(&input(&msgs, Some(&json!([])))), Err(TemplateError::NoTools));
        assert_eq!(ChatTemplate::named("chatml").expect("builtin").render(&input(&msgs[1..], None)).expect("chatml"), "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
    }

    #[test]
    fn broken_or_hostile_templates_are_errors_not_panics_or_hangs() {
        for (src, want) in [
            ("{% for m in messages %}", "does not parse"),
            ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
            ("{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}", "fuel"),
            ("{{ messages[0].content.no_such_method() }}", "failed"),
        ] {
            let t = ChatTemplate::Jinja { name: "t".into(), source: src.into() };
            let err = t.render(&input(&[json!({"role": "user", "content": "x"})], None)).expect_err(src);
            assert!(err.to_string().contains(want), "{src}: {err}");
        }
    }

    #[test]
    fn tool_calls_are_parsed_back_for_each_template_family() {
        let call = |name: &str, args: &str| ToolCall { name: name.into(), arguments: args.into() };
        assert_eq!(
            parse_tool_calls(ToolSyntax::Hermes, "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"),
            Some(("Let me check.".into(), vec![call("get_weather", "{\"city\":\"Paris\"}")]))
        );
        assert_eq!(
            parse_tool_calls(ToolSyntax::Mistral, "[TOOL_CALLS][{\"name\": \"a\", \"arguments\": {}}, {\"name\": \"b\", \"arguments\": {\"x\": 1}}]"),
            Some((String::new(), vec![call("a", "{}"), call("b", "{\"x\":1}")]))
        );
        assert_eq!(parse_tool_calls(ToolSyntax::JsonObject, "<|python_tag|>{\"name\": \"f\", \"parameters\": {\"q\": \"x\"}}"), Some((String::new(), vec![call("f", "{\"q\":\"x\"}")])));
        for plain in ["just text", "<tool_call>not json</tool_call>", "{\"no_name\": 1}"] {
            for syntax in [ToolSyntax::Hermes, ToolSyntax::Mistral, ToolSyntax::JsonObject] {
                assert_eq!(parse_tool_calls(syntax, plain), None, "{syntax:?}: {plain}");
            }
        }
    }

    /// Issue 32: a streamed reply is read for calls as it comes. Over a table of replies in
    /// every syntax, cut into pieces at every byte (and one character at a time), the pieces
    /// given out add up to the whole reading ([`split_tool_output`]), content is given out
    /// before the reply ends wherever it cannot begin a call, and the reading is the expected one.
    #[test]
    fn a_streamed_reply_is_read_for_calls_as_the_whole_reply_is() {
        use tine_engine::template::{split_tool_output, ToolDelta, ToolStream};
        let call = |name: &str, args: &str| ToolCall { name: name.into(), arguments: args.into() };
        let table: Vec<(ToolSyntax, &str, &str, Vec<ToolCall>)> = vec![
            (ToolSyntax::Hermes, "Let me check.\n<tool_call>\n{\"name\": \"w\", \"arguments\": {\"c\": \"P\"}}\n</tool_call>", "Let me check.", vec![call("w", "{\"c\":\"P\"}")]),
            (ToolSyntax::Hermes, "<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call><tool_call>{\"name\": \"b\", \"arguments\": {}}</tool_call>", "", vec![call("a", "{}"), call("b", "{}")]),
            (ToolSyntax::Hermes, "a < b and <tool_ is not a call", "a < b and <tool_ is not a call", vec![]),
            // Leading whitespace is dropped whole and streamed alike (the stream cannot know a
            // call follows, so it is never given out).
            (ToolSyntax::Hermes, "\nLet me check.<tool_call>{\"name\": \"w\", \"arguments\": {}}</tool_call>", "Let me check.", vec![call("w", "{}")]),
            (ToolSyntax::Hermes, "\n  plain words", "plain words", vec![]),
            (ToolSyntax::Hermes, "x <tool_call>not json</tool_call> y", "x <tool_call>not json</tool_call> y", vec![]),
            (ToolSyntax::Hermes, "cut off <tool_call>{\"name\": \"a\"", "cut off <tool_call>{\"name\": \"a\"", vec![]),
            (ToolSyntax::Mistral, "ok [TOOL_CALLS][{\"name\": \"a\", \"arguments\": {\"x\": 1}}]", "ok", vec![call("a", "{\"x\":1}")]),
            (ToolSyntax::Mistral, "[TOOL_CALLS] oops", "[TOOL_CALLS] oops", vec![]),
            (ToolSyntax::JsonObject, " {\"name\": \"f\", \"parameters\": {\"q\": \"x\"}}", "", vec![call("f", "{\"q\":\"x\"}")]),
            (ToolSyntax::JsonObject, "<|python_tag|>{\"name\": \"f\", \"arguments\": {}}", "", vec![call("f", "{}")]),
            (ToolSyntax::JsonObject, "Plain words {\"name\": 1}", "Plain words {\"name\": 1}", vec![]),
            (ToolSyntax::JsonObject, "<|python", "<|python", vec![]),
            (ToolSyntax::Generic, "{\"tool_call\": {\"name\": \"f\", \"arguments\": {\"x\": [1, 2]}}}", "", vec![call("f", "{\"x\":[1,2]}")]),
            (ToolSyntax::Generic, "{ \"tool_calls\" : [{\"name\": \"a\", \"arguments\": {}}, {\"name\": \"b\", \"arguments\": {}}]}", "", vec![call("a", "{}"), call("b", "{}")]),
            (ToolSyntax::Generic, "{\"response\": \"Hi \\\"there\\\"\\n\\u00e9\\ud83d\\ude00 \\\\ end\"}", "Hi \"there\"\n\u{e9}\u{1f600} \\ end", vec![]),
            (ToolSyntax::Generic, "{\n  \"response\" :\"cut off mid", "cut off mid", vec![]),
            (ToolSyntax::Generic, "not json at all", "not json at all", vec![]),
            (ToolSyntax::Generic, "{\"other\": 1}", "{\"other\": 1}", vec![]),
        ];
        let content_of = |deltas: &[ToolDelta]| deltas.iter().filter_map(|d| if let ToolDelta::Content(c) = d { Some(c.as_str()) } else { None }).collect::<String>();
        let calls_of = |deltas: &[ToolDelta]| deltas.iter().filter_map(|d| if let ToolDelta::Call(c) = d { Some(c.clone()) } else { None }).collect::<Vec<_>>();
        for (syntax, reply, content, calls) in &table {
            let whole = split_tool_output(*syntax, reply);
            assert_eq!(whole, (content.to_string(), calls.clone()), "{syntax:?}: {reply}");
            let mut cuts: Vec<Vec<usize>> = (0..=reply.len()).filter(|&i| reply.is_char_boundary(i)).map(|i| vec![i]).collect();
            cuts.push(reply.char_indices().map(|(i, _)| i).skip(1).collect());
            for cut in cuts {
                let mut s = ToolStream::new(*syntax);
                let mut deltas = Vec::new();
                let mut from = 0;
                for &at in &cut {
                    deltas.extend(s.feed(&reply[from..at]));
                    from = at;
                }
                deltas.extend(s.feed(&reply[from..]));
                deltas.extend(s.finish());
                let streamed = content_of(&deltas);
                let got = if calls_of(&deltas).is_empty() { streamed.clone() } else { streamed.trim().to_owned() };
                assert_eq!((got, calls_of(&deltas)), whole.clone(), "{syntax:?} cut at {cut:?}: {reply}");
            }
        }
        // Content comes out before the end where it cannot begin a call: one character at a
        // time, a plain Hermes reply gives out all but a possible marker's start, and a generic
        // response gives out its text as it is decoded.
        let mut s = ToolStream::new(ToolSyntax::Hermes);
        let early: String = "Some plain words then <tool".chars().flat_map(|c| s.feed(&c.to_string())).map(|d| if let ToolDelta::Content(c) = d { c } else { panic!("no call here") }).collect();
        assert_eq!(early, "Some plain words then");
        let mut s = ToolStream::new(ToolSyntax::Generic);
        let early = content_of(&"{\"response\": \"Hello wor".chars().flat_map(|c| s.feed(&c.to_string())).collect::<Vec<_>>());
        assert_eq!(early, "Hello wor");
    }
}

#[test]
fn greedy_decoding_by_argmax_alone_generates_what_the_sampler_picks_from_the_rows() {
    // A plain greedy request with nothing reading the logits decodes by `decode_argmax` (on a
    // GPU the row stays there); asking for logprobs keeps the rows and the sampler's pick.
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tiny.gguf");
    TinyGemma3 { seed: 9, ..TinyGemma3::default() }.write(&path);
    let model = Model::load(&path).expect("fixture loads");
    let prompt = model.tokenizer.encode("hello world the", true, true);
    let generate = |req: GenerateRequest| {
        let mut seq = model.new_sequence(256);
        let mut g = Generation::start(&model, &mut seq, req).expect("start");
        while !g.is_finished() {
            g.step(&model, &mut seq).expect("step");
        }
        (g.tokens().to_vec(), g.text().to_owned(), g.stop_type(), seq.tokens().to_vec())
    };
    for n_predict in [1, 2, 40] {
        let base = GenerateRequest { n_predict, sampling: SamplingParams::greedy(), ..GenerateRequest::new(prompt.clone()) };
        let by_argmax = generate(base.clone());
        let by_rows = generate(GenerateRequest { n_probs: 1, ..base.clone() });
        assert_eq!(by_argmax, by_rows, "n_predict {n_predict}");
        // A penalty makes the rows matter again: the path must not be taken then.
        let penalised = generate(GenerateRequest { sampling: SamplingParams { repeat_penalty: 1.5, ..SamplingParams::greedy() }, ..base.clone() });
        let penalised_rows = generate(GenerateRequest { n_probs: 1, sampling: SamplingParams { repeat_penalty: 1.5, ..SamplingParams::greedy() }, ..base });
        assert_eq!(penalised, penalised_rows, "n_predict {n_predict}, penalised");
    }
}

#[test]
fn greedy_ignore_eos_and_greedy_speculation_by_ids_alone_generate_what_the_rows_give() {
    // Greedy requests nothing reads the rows of decode by ids alone: plain decoding with the
    // end-of-generation ids banned (`ignore_eos`), and speculation's verify rows
    // (`Sequence::forward_all_argmax`). Asking for logprobs keeps the rows and the sampler.
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tiny.gguf");
    TinyGemma3 { nextn: true, seed: 11, ..TinyGemma3::default() }.write(&path);
    let model = Model::load(&path).expect("fixture loads");
    let prompt = model.tokenizer.encode("hello world hello world hello", true, true);
    let generate = |req: GenerateRequest, factory: Option<&SpecFactory>| {
        let mut seq = model.new_sequence(256);
        let mut spec = factory.map(|f| f.speculator(&model, 256).expect("speculator"));
        let mut g = Generation::start_with(&model, &mut seq, req, spec.as_mut()).expect("start");
        while !g.is_finished() {
            g.step_with(&model, &mut seq, spec.as_mut()).expect("step");
        }
        (g.tokens().to_vec(), g.text().to_owned(), g.stop_type(), g.timings().draft.draft_verify_steps > 0)
    };
    for ignore_eos in [true, false] {
        let base = GenerateRequest { n_predict: 48, sampling: SamplingParams::greedy(), ignore_eos, ..GenerateRequest::new(prompt.clone()) };
        let by_rows = generate(GenerateRequest { n_probs: 1, ..base.clone() }, None);
        assert_eq!(generate(base.clone(), None).0, by_rows.0, "plain, ignore_eos {ignore_eos}");
        for kind in [SpecType::Ngram, SpecType::DraftMtp] {
            let factory = SpecFactory::load(SpecConfig { ngram_min: 1, ..SpecConfig::new(kind) }, &model).expect("setup");
            let by_ids = generate(base.clone(), Some(&factory));
            assert_eq!((&by_ids.0, &by_ids.1, by_ids.2), (&by_rows.0, &by_rows.1, by_rows.2), "{kind}, ignore_eos {ignore_eos}");
            assert!(by_ids.3, "{kind}: the drafter ran");
            let spec_rows = generate(GenerateRequest { n_probs: 1, ..base.clone() }, Some(&factory));
            assert_eq!(spec_rows.0, by_rows.0, "{kind} with rows, ignore_eos {ignore_eos}");
        }
    }
}

/// Issue 29: every KV cache type keeps speculative decoding lossless: within a type, each spec
/// type hands out the tokens and logits plain decoding does (greedy and seeded sampling), the
/// draft model with its own cache types too; and a type other than f32 is really in effect.
/// Issue 53: the rotated types too (heads of 128 values).
#[test]
fn speculation_is_lossless_within_each_kv_cache_type() {
    use tine_runtime::KvType;
    let scalar = [(KvType::Q8_0, KvType::Q8_0), (KvType::Q4_0, KvType::Q4_0), (KvType::F16, KvType::Q8_0), (KvType::BF16, KvType::BF16)];
    let rotated = [(KvType::Turbo3, KvType::Turbo3), (KvType::Turbo4, KvType::Turbo2), (KvType::Q8_0, KvType::Turbo3)];
    // Heads of 32 values: whole q8_0/q4_0 blocks; of 128: the rotated types' shortest rows.
    for (head_dim, types) in [(32, &scalar[..]), (128, &rotated[..])] {
        lossless_within(head_dim, types);
    }
}

fn lossless_within(head_dim: usize, types: &[(tine_runtime::KvType, tine_runtime::KvType)]) {
    use tine_runtime::KvType;
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, head, draft) = (dir.path().join("tiny.gguf"), dir.path().join("assistant.gguf"), dir.path().join("draft.gguf"));
    let cfg = TinyGemma3 { nextn: true, head_dim, n_kv_head: 2, seed: 12, ..TinyGemma3::default() };
    cfg.write(&path);
    tine_test_support::TinyAssistant::default().write(&cfg, &head);
    TinyGemma3 { seed: 99, n_layer: 2, head_dim: 32, ..TinyGemma3::default() }.write(&draft);
    let prompt_text = "hello world hello world hello";
    let f32_logits = {
        let model = Model::load(&path).expect("fixture loads");
        let prompt = model.tokenizer.encode(prompt_text, true, true);
        run(&model, GenerateRequest { n_predict: 8, sampling: SamplingParams::greedy(), ignore_eos: true, ..GenerateRequest::new(prompt) }, None).3
    };
    for &(k, v) in types {
        let mut model = Model::load(&path).expect("fixture loads");
        model.set_cache_types(k, v).expect("Gemma 3 on the CPU keeps every type");
        let prompt = model.tokenizer.encode(prompt_text, true, true);
        let seeded = SamplingParams { temperature: 0.8, seed: Some(3), ..SamplingParams::default() };
        let requests = [
            GenerateRequest { n_predict: 24, sampling: SamplingParams::greedy(), ignore_eos: true, ..GenerateRequest::new(prompt.clone()) },
            GenerateRequest { n_predict: 24, sampling: seeded, ignore_eos: true, ..GenerateRequest::new(prompt.clone()) },
        ];
        let plain = run(&model, requests[0].clone(), None);
        let differs = plain.3.iter().zip(&f32_logits).any(|(a, b)| a.iter().zip(b).any(|(x, y)| x != y));
        assert!(differs, "K {k} V {v}: logits equal the f32 cache's, so the type is not in effect");
        for kind in [SpecType::DraftMtp, SpecType::Ngram, SpecType::DraftAssistant, SpecType::Draft] {
            let config = SpecConfig { ngram_min: 1, mtp_head: Some(head.clone()), draft_model: Some(draft.clone()), draft_cache_types: (KvType::Q4_0, KvType::F16), ..SpecConfig::new(kind) };
            let factory = SpecFactory::load(config, &model).expect("setup");
            for (i, req) in requests.iter().enumerate() {
                let want = run(&model, req.clone(), None);
                let got = run(&model, req.clone(), Some(&factory));
                assert_eq!((&got.0, &got.1), (&want.0, &want.1), "K {k} V {v}, {kind}, request {i}");
                assert!(got.3.iter().zip(&want.3).all(|(a, b)| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())), "K {k} V {v}, {kind}, request {i}: logits differ");
                if i == 0 && kind != SpecType::Ngram {
                    assert!(got.4.draft.draft_verify_steps > 0, "K {k} V {v}, {kind}: the drafter ran: {:?}", got.4.draft);
                }
            }
        }
    }
}

#[test]
fn kv_cache_types_a_model_cannot_keep_are_refused() {
    use tine_runtime::KvType;
    let dir = tempfile::tempdir().expect("tempdir");
    let draft = dir.path().join("draft.gguf");
    TinyGemma3 { seed: 99, n_layer: 2, head_dim: 32, ..TinyGemma3::default() }.write(&draft);
    // Types a model cannot keep are refused with the reason, not ignored.
    let mut small = Model::load(&draft).expect("fixture loads");
    small.set_cache_types(KvType::Q8_0, KvType::F32).expect("heads of 32 values take q8_0");
    let dir16 = dir.path().join("hd16.gguf");
    TinyGemma3::default().write(&dir16);
    let mut hd16 = Model::load(&dir16).expect("fixture loads");
    let err = hd16.set_cache_types(KvType::Q4_0, KvType::Q4_0).expect_err("16-value heads are no whole q4_0 block");
    assert!(tine_runtime::error_chain(&err).contains("multiple of 32"), "{}", tine_runtime::error_chain(&err));
    assert_eq!(hd16.cache_types(), (KvType::F32, KvType::F32), "a refused type leaves the model's types as they were");
    // The rotated types need rows of at least 128 values.
    let err = small.set_cache_types(KvType::F16, KvType::Turbo3).expect_err("32-value heads are too short to rotate");
    assert!(tine_runtime::error_chain(&err).contains("at least 128"), "{}", tine_runtime::error_chain(&err));
}

#[test]
fn gemma4_speculation_is_lossless_within_each_kv_cache_type() {
    use tine_runtime::KvType;
    // Heads of 32 and 64 values (whole q8_0/q4_0 blocks); of 128 and 256 for the rotated types.
    // KV-shared layers read their source's rows.
    gemma4_lossless_within(32, 64, &[(KvType::F16, KvType::F16), (KvType::Q8_0, KvType::Q4_0)]);
    gemma4_lossless_within(128, 256, &[(KvType::Turbo3, KvType::Turbo3), (KvType::Turbo4, KvType::Turbo2)]);
}

fn gemma4_lossless_within(head_dim_swa: usize, head_dim_global: usize, types: &[(tine_runtime::KvType, tine_runtime::KvType)]) {
    use tine_runtime::KvType;
    use tine_test_support::gemma4_fixture::{TinyGemma4, TinyGemma4Assistant, TOKENIZER_VOCAB};
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, head, draft) = (dir.path().join("gemma4.gguf"), dir.path().join("assistant.gguf"), dir.path().join("draft.gguf"));
    let cfg = TinyGemma4 { vocab: TOKENIZER_VOCAB, tokenizer: true, head_dim_swa, head_dim_global, ..TinyGemma4::e2b() };
    cfg.write(&path);
    TinyGemma4Assistant::default().write(&cfg, &head);
    TinyGemma4 { vocab: TOKENIZER_VOCAB, tokenizer: true, pattern: vec![true, false], head_dim_swa: 32, head_dim_global: 64, seed: 70, ..TinyGemma4::dense() }.write(&draft);
    let prompt: Vec<u32> = (0..12u32).map(|i| 5 + (i * 7) % 40).collect();
    let greedy = GenerateRequest { n_predict: 20, sampling: SamplingParams::greedy(), ignore_eos: true, ..GenerateRequest::new(prompt.clone()) };
    let f32_logits = run(&Model::load(&path).expect("fixture loads"), greedy.clone(), None).3;
    for &(k, v) in types {
        let mut model = Model::load(&path).expect("fixture loads");
        model.set_cache_types(k, v).expect("Gemma 4 on the CPU keeps every type");
        let seeded = SamplingParams { temperature: 0.8, seed: Some(4), ..SamplingParams::default() };
        let requests = [greedy.clone(), GenerateRequest { sampling: seeded, ..greedy.clone() }];
        let plain = run(&model, requests[0].clone(), None);
        assert!(plain.3.iter().zip(&f32_logits).any(|(a, b)| a != b), "K {k} V {v}: logits equal the f32 cache's, so the type is not in effect");
        for kind in [SpecType::DraftAssistant, SpecType::Ngram, SpecType::Draft] {
            let config = SpecConfig { ngram_min: 1, mtp_head: Some(head.clone()), draft_model: Some(draft.clone()), draft_cache_types: (KvType::Q8_0, KvType::F16), ..SpecConfig::new(kind) };
            let factory = SpecFactory::load(config, &model).expect("setup");
            for (i, req) in requests.iter().enumerate() {
                let want = run(&model, req.clone(), None);
                let got = run(&model, req.clone(), Some(&factory));
                assert_eq!(got.0, want.0, "K {k} V {v}, {kind}, request {i}");
                assert!(got.3.iter().zip(&want.3).all(|(a, b)| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())), "K {k} V {v}, {kind}, request {i}: logits differ");
                if i == 0 && kind != SpecType::Ngram {
                    assert!(got.4.draft.draft_verify_steps > 0, "K {k} V {v}, {kind}: the drafter ran: {:?}", got.4.draft);
                }
            }
        }
    }
}

/// Issue 32: embeddings' pooling and llama.cpp's normalizations (`common_embd_normalize`),
/// against values worked by hand.
#[test]
fn embeddings_pool_and_normalize_as_llama_cpp() {
    use tine_engine::embeddings::{normalize, pool, Pooling};
    let rows = vec![vec![1.0f32, -2.0, 2.0], vec![3.0, 0.0, -2.0]];
    assert_eq!(pool(&rows, Pooling::Mean), vec![vec![2.0, -1.0, 0.0]]);
    assert_eq!(pool(&rows, Pooling::Cls), vec![rows[0].clone()]);
    assert_eq!(pool(&rows, Pooling::Last), vec![rows[1].clone()]);
    assert_eq!(pool(&rows, Pooling::None), rows);
    assert!(pool(&[], Pooling::Mean).is_empty());
    let v = [3.0f32, -4.0];
    assert_eq!(normalize(&v, 2), vec![0.6, -0.8]);
    assert_eq!(normalize(&v, 1), vec![3.0 / 7.0, -4.0 / 7.0]);
    assert_eq!(normalize(&v, -1), v.to_vec());
    assert_eq!(normalize(&v, 0), vec![3.0 * 32760.0 / 4.0, -32760.0]);
    let p3 = (27.0f64 + 64.0).powf(1.0 / 3.0);
    assert_eq!(normalize(&v, 3), vec![(3.0 / p3) as f32, (-4.0 / p3) as f32]);
    assert_eq!(normalize(&[0.0, 0.0], 2), vec![0.0, 0.0], "a zero vector stays zero");
    assert_eq!((Pooling::from_gguf(1), Pooling::from_gguf(4), Pooling::from_name("last")), (Some(Pooling::Mean), None, Some(Pooling::Last)));
}

/// Issue 32: reasoning (`<think>…</think>`) told apart from the answer as llama-server's
/// `reasoning_format: deepseek` does, whole or streamed at any cut, with the tag opened by the
/// reply or by the template (thinking forced open).
#[test]
fn reasoning_is_split_from_the_answer_whole_and_streamed() {
    use tine_engine::reasoning::{forced_open, split_reasoning, ReasoningDelta, ReasoningStream};
    let table: &[(bool, &str, &str, &str)] = &[
        (false, "<think>\nLet me see.\n</think>\n\nParis.", "Let me see.", "Paris."),
        (false, "  <think>a < b </thin k</think>x", "a < b </thin k", "x"),
        (false, "Paris, no thoughts.", "", "Paris, no thoughts."),
        (false, "<thin", "", "<thin"),
        (false, "Answer <think>late</think>", "", "Answer <think>late</think>"),
        (true, "\nfirst thought\n\nsecond</think>\n\nThe answer.", "first thought\n\nsecond", "The answer."),
        (true, "cut off mid-thought", "cut off mid-thought", ""),
        (true, "</think>answer", "", "answer"),
    ];
    for &(forced, reply, reasoning, content) in table {
        assert_eq!(split_reasoning(reply, forced), (reasoning.to_owned(), content.to_owned()), "{reply:?}");
        for cut in 0..=reply.len() {
            let mut s = ReasoningStream::new(forced);
            let mut deltas = s.feed(&reply[..cut]);
            deltas.extend(s.feed(&reply[cut..]));
            deltas.extend(s.finish());
            let (mut r, mut c) = (String::new(), String::new());
            for d in deltas {
                match d {
                    ReasoningDelta::Reasoning(t) => r.push_str(&t),
                    ReasoningDelta::Content(t) => c.push_str(&t),
                }
            }
            assert_eq!((r.as_str(), c.as_str()), (reasoning, content), "{reply:?} cut at {cut}");
        }
    }
    // Reasoning comes out as it is written, not at the end.
    let mut s = ReasoningStream::new(true);
    let early: Vec<ReasoningDelta> = "thinking hard </thi".chars().flat_map(|c| s.feed(&c.to_string())).collect();
    assert_eq!(early.iter().map(|d| if let ReasoningDelta::Reasoning(t) = d { t.as_str() } else { "" }).collect::<String>(), "thinking hard");
    assert!(forced_open("<|im_start|>assistant\n<think>\n") && !forced_open("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
}

/// Issue 50: the rows left to the GPU engine's batched step (`step_deferring_decode`: a plain
/// decode, or a speculative round's verify batch whose rows nobody reads) give what the slot's
/// own steps give, whatever the step reads back for them: the greedy id (with and without
/// `ignore_eos`), a sampled draw's top-k, or the row (logprobs, a draw without top-k; a round
/// then runs in the slot's own step), with the rows' hidden states where the drafter reads them
/// (a NextN head's rounds). The batched step is played here on the host from each row
/// (`Sequence::forward_all`, `forward_all_hidden`), as the engine computes it on the device: the
/// argmax passing over the end ids where the row asks, the top-k in the sampler's order.
#[test]
fn rows_left_to_a_batched_step_draw_what_the_slot_s_own_steps_draw() {
    use tine_runtime::{banned_argmax, DecodeOut, DecodeWant, StepRows};
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tiny.gguf");
    TinyGemma3 { seed: 13, ..TinyGemma3::default() }.write(&path);
    let model = Model::load(&path).expect("fixture loads");
    // A NextN head's rounds read their verify rows' hidden states back from the step.
    let mtp_path = dir.path().join("tiny-nextn.gguf");
    TinyGemma3 { seed: 13, nextn: true, ..TinyGemma3::default() }.write(&mtp_path);
    let mtp_model = Model::load(&mtp_path).expect("fixture loads");
    let prompt = model.tokenizer.encode("hello world the hello world the hello", true, true);
    let ngram = SpecFactory::load(SpecConfig { ngram_min: 1, ..SpecConfig::new(SpecType::Ngram) }, &model).expect("n-gram");
    let mtp = SpecFactory::load(SpecConfig::new(SpecType::DraftMtp), &mtp_model).expect("NextN");
    let alone = |model: &Model, req: GenerateRequest, factory: Option<&SpecFactory>| {
        let mut seq = model.new_sequence(256);
        let mut spec = factory.map(|f| f.speculator(model, 256).expect("speculator"));
        let mut g = Generation::start_with(model, &mut seq, req, spec.as_mut()).expect("start");
        let mut text = String::new();
        while !g.is_finished() {
            text.push_str(&g.step_with(model, &mut seq, spec.as_mut()).expect("step").text);
        }
        (g.tokens().to_vec(), text, g.stop_type(), seq.tokens().to_vec())
    };
    // `top_k`: the step reads the k best back (what the engine does for a sampled draw; a build
    // without CUDA asks for the row, as its GPU engine would not read a top-k).
    let batched = |model: &Model, req: GenerateRequest, factory: Option<&SpecFactory>, top_k: Option<usize>| {
        let mut seq = model.new_sequence(256);
        let mut spec = factory.map(|f| f.speculator(model, 256).expect("speculator"));
        let mut g = Generation::start_with(model, &mut seq, req, spec.as_mut()).expect("start");
        let (mut text, mut wants, mut verifies, mut hiddens) = (String::new(), Vec::new(), 0, 0);
        while !g.is_finished() {
            text.push_str(&g.step_deferring_decode(model, &mut seq, spec.as_mut()).expect("step").text);
            let Some((tokens, read)) = g.pending_gpu(model) else { continue };
            let (ban, want) = (read.ban, read.want);
            let tokens = tokens.to_vec();
            verifies += (tokens.len() > 1) as usize;
            hiddens += read.hidden as usize;
            let (logits, hidden) = if read.hidden {
                let (l, h) = seq.forward_all_hidden(model, &tokens).expect("forward");
                (l, Some(h))
            } else {
                (seq.forward_all(model, &tokens).expect("forward"), None)
            };
            let banned: &[u32] = if ban { model.end_of_generation_tokens() } else { &[] };
            let outs = (0..tokens.len())
                .map(|i| {
                    let row = logits.row(i).to_vec();
                    match top_k.map(DecodeWant::TopK).unwrap_or(want) {
                        DecodeWant::Argmax => DecodeOut::Id(banned_argmax(&row, banned)),
                        DecodeWant::TopK(k) => {
                            let mut c: Vec<(u32, f32)> = row.iter().enumerate().filter(|(i, _)| !banned.contains(&(*i as u32))).map(|(i, &v)| (i as u32, v)).collect();
                            c.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
                            c.truncate(k);
                            DecodeOut::TopK(c)
                        }
                        DecodeWant::Row => DecodeOut::Row(row),
                    }
                })
                .collect();
            wants.push(want);
            g.feed_gpu(model, &mut seq, spec.as_mut(), StepRows { outs, hidden }, 0.0, 0.0).expect("fed");
        }
        ((g.tokens().to_vec(), text, g.stop_type(), seq.tokens().to_vec()), wants, (verifies, hiddens))
    };
    let seeded = SamplingParams { temperature: 0.8, seed: Some(5), ..SamplingParams::default() };
    let cases = [
        ("greedy", GenerateRequest { sampling: SamplingParams::greedy(), ..GenerateRequest::new(prompt.clone()) }, DecodeWant::Argmax),
        ("greedy, ignore_eos", GenerateRequest { sampling: SamplingParams::greedy(), ignore_eos: true, ..GenerateRequest::new(prompt.clone()) }, DecodeWant::Argmax),
        ("seeded top-k", GenerateRequest { sampling: seeded.clone(), ..GenerateRequest::new(prompt.clone()) }, model.gpu_decode_want(false, Some(40), false)),
        ("seeded top-k, ignore_eos", GenerateRequest { sampling: seeded.clone(), ignore_eos: true, ..GenerateRequest::new(prompt.clone()) }, model.gpu_decode_want(false, Some(40), true)),
        ("seeded without top-k", GenerateRequest { sampling: SamplingParams { top_k: 0, ..seeded.clone() }, ..GenerateRequest::new(prompt.clone()) }, DecodeWant::Row),
        ("greedy with logprobs", GenerateRequest { sampling: SamplingParams::greedy(), n_probs: 2, ..GenerateRequest::new(prompt.clone()) }, DecodeWant::Row),
    ];
    for (model, factory, tag) in [(&model, None, ""), (&model, Some(&ngram), ", n-gram"), (&mtp_model, Some(&mtp), ", NextN")] {
        for (name, req, want) in cases.iter().cloned() {
            let name = format!("{name}{tag}");
            let req = GenerateRequest { n_predict: 40, ..req };
            let want_alone = alone(model, req.clone(), factory);
            let (got, wants, (verifies, hiddens)) = batched(model, req.clone(), factory, None);
            assert_eq!(got, want_alone, "{name}");
            // Rows read as ids or top-k reach the step (verify batches too); the others run in
            // the slot's own steps, and only their decodes are left.
            assert!(wants.iter().all(|w| *w == want), "{name}: the step read {wants:?}, not {want:?}");
            // (With a speculator, rows read as a whole run as rounds in the slot's own steps.)
            assert!(!wants.is_empty() || (factory.is_some() && want == DecodeWant::Row), "{name}: nothing reached the step");
            if factory.is_some() && want != DecodeWant::Row {
                assert!(verifies > 0, "{name}: no verify batch reached the step");
            }
            // NextN's rounds (and only theirs) read their rows' hidden states back.
            assert_eq!(hiddens > 0, std::ptr::eq(model, &mtp_model) && want != DecodeWant::Row, "{name}: {hiddens} steps read hidden states");
            if name.starts_with("seeded top-k") {
                let (top, _, (v, _)) = batched(model, req, factory, Some(40));
                assert_eq!(top, want_alone, "{name}, the top 40 read back");
                if factory.is_some() {
                    assert!(v > 0, "{name}: no verify batch reached the step with top-k");
                }
            }
        }
    }
}
