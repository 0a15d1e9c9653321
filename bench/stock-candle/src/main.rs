//! Stock candle's quantized Gemma 3 loop, timed: prefill a prompt in one forward, then greedy
//! decode. Prompt token ids come from a JSON array file (stock candle has no SentencePiece
//! tokenizer). Prints one JSON line with the timings.
//! Usage: stock-candle-bench MODEL.gguf PROMPT_IDS.json N_DECODE

use std::time::Instant;

use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use candle_transformers::models::quantized_gemma3::ModelWeights;

fn main() -> candle_core::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let (model_path, ids_path, n) = (&args[1], &args[2], args[3].parse::<usize>().expect("N_DECODE"));
    let ids: Vec<u32> = serde_json::from_str(&std::fs::read_to_string(ids_path)?).expect("ids JSON");
    let dev = Device::Cpu;
    let t_load = Instant::now();
    let mut f = std::fs::File::open(model_path)?;
    let ct = gguf_file::Content::read(&mut f)?;
    let mut model = ModelWeights::from_gguf(ct, &mut f, &dev)?;
    let load_ms = t_load.elapsed().as_secs_f64() * 1e3;
    let t0 = Instant::now();
    let logits = model.forward(&Tensor::new(ids.as_slice(), &dev)?.unsqueeze(0)?, 0)?;
    let mut next = logits.squeeze(0)?.argmax(0)?.to_scalar::<u32>()?;
    let prompt_ms = t0.elapsed().as_secs_f64() * 1e3;
    let t1 = Instant::now();
    for i in 0..n {
        let logits = model.forward(&Tensor::new(&[next], &dev)?.unsqueeze(0)?, ids.len() + i)?;
        next = logits.squeeze(0)?.argmax(0)?.to_scalar::<u32>()?;
    }
    let predicted_ms = t1.elapsed().as_secs_f64() * 1e3;
    println!("{{\"load_ms\": {load_ms:.1}, \"prompt_n\": {}, \"prompt_ms\": {prompt_ms:.1}, \"predicted_n\": {n}, \"predicted_ms\": {predicted_ms:.1}}}", ids.len());
    Ok(())
}
