//! Per-sequence KV state across all layers, with checkpoints and O(1) rollback.
//!
//! Invariant: every layer's cache holds exactly [`SequenceKv::len`] positions between calls;
//! a failed rollback changes nothing.

use candle_core::Tensor;
use candle_nn::kv_cache::KvCache;

/// Errors of [`SequenceKv`] operations.
#[derive(Debug, thiserror::Error)]
pub enum KvError {
    #[error("cannot roll back to position {to}: the sequence holds only {len}")]
    RollbackPastEnd { to: usize, len: usize },
    #[error("layer {layer} of {layers} does not exist")]
    NoSuchLayer { layer: usize, layers: usize },
    #[error("layer {layer} holds {found} positions, the sequence {expected}: append to every layer before reading the length")]
    LayersOutOfStep { layer: usize, found: usize, expected: usize },
    #[error("tensor operation failed in layer {layer}")]
    Candle {
        layer: usize,
        #[source]
        source: candle_core::Error,
    },
}

/// The KV caches of every layer of one sequence.
#[derive(Debug, Clone)]
pub struct SequenceKv {
    layers: Vec<KvCache>,
}

impl SequenceKv {
    /// `layers` caches concatenating along `seq_dim`, each preallocated for `capacity` positions.
    pub fn new(layers: usize, seq_dim: usize, capacity: usize) -> SequenceKv {
        SequenceKv { layers: (0..layers).map(|_| KvCache::new(seq_dim, capacity)).collect() }
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Positions held, checked to agree across layers.
    pub fn len(&self) -> Result<usize, KvError> {
        let expected = self.layers.first().map(|c| c.current_seq_len()).unwrap_or(0);
        for (layer, c) in self.layers.iter().enumerate() {
            if c.current_seq_len() != expected {
                return Err(KvError::LayersOutOfStep { layer, found: c.current_seq_len(), expected });
            }
        }
        Ok(expected)
    }

    pub fn is_empty(&self) -> Result<bool, KvError> {
        Ok(self.len()? == 0)
    }

    /// Appends `k`/`v` to one layer; returns that layer's full keys and values.
    pub fn append(&mut self, layer: usize, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor), KvError> {
        let layers = self.layers.len();
        let cache = self.layers.get_mut(layer).ok_or(KvError::NoSuchLayer { layer, layers })?;
        cache.append(k, v).map_err(|source| KvError::Candle { layer, source })
    }

    /// A position to roll back to later.
    pub fn checkpoint(&self) -> Result<usize, KvError> {
        self.len()
    }

    /// Drops every position from `to` on, in every layer, without copying (patch 0001).
    pub fn rollback(&mut self, to: usize) -> Result<(), KvError> {
        let len = self.len()?;
        if to > len {
            return Err(KvError::RollbackPastEnd { to, len });
        }
        for (layer, c) in self.layers.iter_mut().enumerate() {
            c.truncate(to).map_err(|source| KvError::Candle { layer, source })?;
        }
        Ok(())
    }

    pub fn reset(&mut self) {
        self.layers.iter_mut().for_each(KvCache::reset);
    }
}
