//! Tine's model runtime, built on the patched candle in `engine/upstream/`.
//!
//! Today it holds the per-sequence KV state ([`kv::SequenceKv`]) that speculative decoding rolls
//! back after a partially accepted draft, on top of patch 0001 (`KvCache::truncate`, O(1)).

pub mod kv;
