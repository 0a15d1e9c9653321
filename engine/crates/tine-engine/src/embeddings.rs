//! Embeddings from a model's final hidden states (after the output norm): pooled over a
//! sequence's positions and normalized as llama.cpp pools and normalizes them
//! (`llama_context`'s pooling, `common_embd_normalize`).

/// How a sequence's rows become one embedding (llama.cpp's `--pooling`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooling {
    /// Every position's row, unpooled (llama.cpp's default for a generative model).
    None,
    /// The mean of the rows.
    Mean,
    /// The first position's row.
    Cls,
    /// The last position's row.
    Last,
}

impl Pooling {
    /// `--pooling NAME`.
    pub fn from_name(name: &str) -> Option<Pooling> {
        Some(match name {
            "none" => Pooling::None,
            "mean" => Pooling::Mean,
            "cls" => Pooling::Cls,
            "last" => Pooling::Last,
            _ => return None,
        })
    }

    /// A GGUF's `<arch>.pooling_type`, in llama.cpp's numbering (4, rank, is a reranker's
    /// score, not an embedding: `None` here).
    pub fn from_gguf(kind: u32) -> Option<Pooling> {
        Some(match kind {
            0 => Pooling::None,
            1 => Pooling::Mean,
            2 => Pooling::Cls,
            3 => Pooling::Last,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Pooling::None => "none",
            Pooling::Mean => "mean",
            Pooling::Cls => "cls",
            Pooling::Last => "last",
        }
    }
}

/// `rows` (one per position, all of one length) pooled: one row per position for
/// [`Pooling::None`], else one. An empty input gives nothing.
pub fn pool(rows: &[Vec<f32>], pooling: Pooling) -> Vec<Vec<f32>> {
    let (Some(first), Some(last)) = (rows.first(), rows.last()) else { return Vec::new() };
    match pooling {
        Pooling::None => rows.to_vec(),
        Pooling::Cls => vec![first.clone()],
        Pooling::Last => vec![last.clone()],
        Pooling::Mean => {
            // Summed in f64, as the mean of many rows loses little that way.
            let mut sum = vec![0f64; first.len()];
            for r in rows {
                for (s, v) in sum.iter_mut().zip(r) {
                    *s += f64::from(*v);
                }
            }
            vec![sum.iter().map(|s| (s / rows.len() as f64) as f32).collect()]
        }
    }
}

/// `v` normalized as llama.cpp's `common_embd_normalize(v, norm)`: `-1` none, `0` max-abs
/// scaled to int16's range (divided by max|x| / 32760), `2` Euclidean (the default), any other
/// `p` the p-norm (1 is the taxicab norm). A zero vector stays zero.
pub fn normalize(v: &[f32], norm: i32) -> Vec<f32> {
    let sum: f64 = match norm {
        -1 => 1.0,
        0 => v.iter().map(|x| f64::from(x.abs())).fold(0.0, f64::max) / 32760.0,
        2 => v.iter().map(|x| f64::from(*x) * f64::from(*x)).sum::<f64>().sqrt(),
        p => v.iter().map(|x| f64::from(x.abs()).powi(p)).sum::<f64>().powf(1.0 / f64::from(p)),
    };
    let scale = if sum > 0.0 { 1.0 / sum } else { 0.0 };
    v.iter().map(|x| (f64::from(*x) * scale) as f32).collect()
}
