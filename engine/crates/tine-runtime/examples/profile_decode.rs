//! Where does a decode step's time go? Times the quantized matmuls of one token in isolation.
use candle_core::quantized::{gguf_file, QMatMul};
use candle_core::{Device, Module, Tensor};
use std::time::Instant;
fn main() {
    let path = std::env::args().nth(1).expect("model path");
    let mut f = std::fs::File::open(&path).unwrap();
    let ct = gguf_file::Content::read(&mut f).unwrap();
    let mut total = 0.0;
    for name in
        ["token_embd.weight", "blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight", "blk.0.attn_output.weight", "blk.0.ffn_gate.weight", "blk.0.ffn_up.weight", "blk.0.ffn_down.weight"]
    {
        let q = ct.tensor(&mut f, name, &Device::Cpu).unwrap();
        let dt = q.dtype();
        let k = q.shape().dims()[1];
        let mm = QMatMul::from_qtensor(q).unwrap();
        let x = Tensor::randn(0f32, 1f32, (1, 1, k), &Device::Cpu).unwrap();
        for _ in 0..3 {
            mm.forward(&x).unwrap();
        }
        let n = 20;
        let t = Instant::now();
        for _ in 0..n {
            mm.forward(&x).unwrap();
        }
        let ms = t.elapsed().as_secs_f64() * 1e3 / n as f64;
        let per_token = if name.starts_with("blk") { ms * 18.0 } else { ms };
        total += per_token;
        println!("{name:28} {dt:?}: {ms:.3} ms per call, {per_token:.2} ms per token");
    }
    println!("matmuls per token: {total:.1} ms");
}
