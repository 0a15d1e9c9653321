//! Integration tests of tine-runtime (one test binary for the crate).

use candle_core::{Device, Tensor};

// The patches' own tests live in the crate they change (so the patch reads like an upstream PR);
// cargo cannot test a [patch]ed crate that is not a workspace member, so they are compiled here.
// candle's own crates call candle-core `candle`; at the crate root this alias reaches every module.
extern crate candle_core as candle;
#[path = "../../../upstream/candle-nn/tests/kv_cache_truncate.rs"]
mod patch_0001_kv_cache_truncate;
use tine_runtime::kv::{KvError, SequenceKv};

fn kv(values: &[f32]) -> Tensor {
    // (batch 1, heads 1, seq, head_dim 1): the layout quantized models use, seq on dim 2.
    Tensor::new(values, &Device::Cpu).expect("tensor").reshape((1, 1, values.len(), 1)).expect("reshape")
}

fn keys(t: &Tensor) -> Vec<f32> {
    t.flatten_all().expect("flatten").to_vec1().expect("f32")
}

#[test]
fn rollback_after_partial_accept_matches_a_sequence_that_never_saw_the_draft() {
    let mut spec = SequenceKv::new(2, 2, 16);
    let mut plain = SequenceKv::new(2, 2, 16);
    for layer in 0..2 {
        spec.append(layer, &kv(&[1., 2.]), &kv(&[1., 2.])).expect("prefill");
        plain.append(layer, &kv(&[1., 2.]), &kv(&[1., 2.])).expect("prefill");
    }
    let mark = spec.checkpoint().expect("layers agree");
    // Verify a 3-token draft, accept 1 of it.
    for layer in 0..2 {
        spec.append(layer, &kv(&[3., 9., 9.]), &kv(&[3., 9., 9.])).expect("draft");
    }
    spec.rollback(mark + 1).expect("rollback within the sequence");
    for layer in 0..2 {
        plain.append(layer, &kv(&[3.]), &kv(&[3.])).expect("accepted token");
    }
    for layer in 0..2 {
        let (ks, _) = spec.append(layer, &kv(&[4.]), &kv(&[4.])).expect("next token");
        let (kp, _) = plain.append(layer, &kv(&[4.]), &kv(&[4.])).expect("next token");
        assert_eq!(keys(&ks), keys(&kp));
        assert_eq!(keys(&ks), [1., 2., 3., 4.]);
    }
}

#[test]
fn rollback_past_the_end_is_refused_and_changes_nothing() {
    let mut s = SequenceKv::new(1, 2, 4);
    s.append(0, &kv(&[1.]), &kv(&[1.])).expect("append");
    assert!(matches!(s.rollback(2), Err(KvError::RollbackPastEnd { to: 2, len: 1 })));
    assert_eq!(s.len().expect("in step"), 1);
}

#[test]
fn layers_out_of_step_are_reported() {
    let mut s = SequenceKv::new(2, 2, 4);
    s.append(0, &kv(&[1.]), &kv(&[1.])).expect("append");
    assert!(matches!(s.len(), Err(KvError::LayersOutOfStep { layer: 1, found: 0, expected: 1 })));
    assert!(matches!(s.append(5, &kv(&[1.]), &kv(&[1.])), Err(KvError::NoSuchLayer { layer: 5, layers: 2 })));
}
