//! tine-runtime over Gemma 4 (`gemma4`: the 31B-like dense model, the E-series, the MoE): the
//! same `Model`/`Sequence` API as Gemma 3, against the float64 reference, with verify rows equal
//! to decode steps, O(1) rollback to any position, atomic steps and slot images.

use tine_runtime::{Model, SlotImage, StepError};
use tine_test_support::gemma4_fixture::{Gemma4Reference, TinyGemma4, TOKENIZER_VOCAB};

struct Fixture {
    _dir: tempfile::TempDir,
    model: Model,
    weights: tine_test_support::gemma4_fixture::Gemma4Weights,
}

fn fixture(cfg: TinyGemma4) -> Fixture {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("gemma4.gguf");
    let weights = TinyGemma4 { vocab: TOKENIZER_VOCAB, tokenizer: true, ..cfg }.write(&path);
    let model = Model::load(&path).expect("the gemma4 fixture loads");
    Fixture { _dir: dir, model, weights }
}

fn shapes() -> [TinyGemma4; 3] {
    [TinyGemma4::dense(), TinyGemma4::e2b(), TinyGemma4::a4b()]
}

fn prompt(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 41 + 7) % 256).collect()
}

fn bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// Largest |got - want| over the largest |want|.
fn rel(got: &[f32], want: &[f64]) -> f64 {
    let scale = want.iter().fold(1e-12f64, |m, v| m.max(v.abs()));
    got.iter().zip(want).fold(0f64, |m, (g, w)| m.max((*g as f64 - w).abs())) / scale
}

#[test]
fn gemma4_loads_and_matches_float64_through_prefill_decode_and_verify() {
    for cfg in shapes() {
        let fx = fixture(cfg);
        let m = &fx.model;
        assert!(!m.is_recurrent() && !m.has_nextn());
        assert_eq!(m.info.architecture, "gemma4");
        assert_eq!(m.tokenizer.vocab_size(), TOKENIZER_VOCAB);
        let mut reference = Gemma4Reference::new(&fx.weights);
        let p = prompt(11);
        let mut seq = m.new_sequence(64);
        let last = seq.prefill(m, &p).expect("prefill");
        let mut want = Vec::new();
        for &t in &p {
            want = reference.step(t);
        }
        let mut worst = rel(&last, &want);
        for t in [5u32, 250, 31] {
            let l = seq.decode(m, t).expect("decode");
            worst = worst.max(rel(&l, &reference.step(t)));
        }
        let batch = seq.forward_all(m, &[9, 10, 11]).expect("verify");
        for (i, t) in [9u32, 10, 11].into_iter().enumerate() {
            worst = worst.max(rel(batch.row(i), &reference.step(t)));
        }
        assert!(worst < 1e-5, "{:?}: {worst:.2e} of the largest logit from float64", fx.weights.cfg.pattern);
        assert_eq!(seq.len(), p.len() + 6);
    }
}

#[test]
fn gemma4_verify_rows_are_decode_bits_and_any_rollback_continues_as_straight_decoding() {
    for cfg in shapes() {
        let fx = fixture(cfg);
        let m = &fx.model;
        let p = prompt(9);
        let drafts = [40u32, 41, 42, 43, 44];
        for keep in 0..=drafts.len() {
            let mut straight = m.new_sequence(64);
            straight.prefill(m, &p).expect("prefill");
            let mut rows = Vec::new();
            for &t in &drafts[..keep] {
                rows.push(straight.decode(m, t).expect("decode"));
            }
            let want = straight.decode(m, 7).expect("decode");
            let mut seq = m.new_sequence(64);
            seq.prefill(m, &p).expect("prefill");
            let batch = seq.forward_all(m, &drafts).expect("verify");
            for (i, row) in rows.iter().enumerate() {
                assert!(bits(batch.row(i), row), "row {i} of a verify batch is not a decode step's bits");
            }
            let at = p.len() + keep;
            assert_eq!(seq.restorable(at), at);
            seq.rollback(at).expect("a KV cache rolls back anywhere");
            assert!(bits(&seq.decode(m, 7).expect("decode"), &want), "{keep} of 5 kept: the step after the rollback differs");
            assert_eq!(seq.tokens(), straight.tokens());
        }
        // Back into the prompt, too.
        let mut seq = m.new_sequence(64);
        seq.prefill(m, &p).expect("prefill");
        seq.rollback(4).expect("rollback");
        let mut fresh = m.new_sequence(64);
        fresh.prefill(m, &p[..4]).expect("prefill");
        assert!(bits(&seq.decode(m, 3).expect("decode"), &fresh.decode(m, 3).expect("decode")));
    }
}

#[test]
fn gemma4_steps_are_atomic_and_slot_images_restore_bit_for_bit() {
    let fx = fixture(TinyGemma4::e2b());
    let m = &fx.model;
    let p = prompt(10);
    let mut seq = m.new_sequence(64);
    seq.prefill(m, &p).expect("prefill");
    let mut straight = m.new_sequence(64);
    straight.prefill(m, &p).expect("prefill");
    let want = straight.decode(m, 12).expect("decode");
    seq.inject_failure(Some(0));
    assert!(matches!(seq.decode(m, 99), Err(StepError::Injected)));
    seq.inject_failure(Some(0));
    assert!(matches!(seq.forward_all(m, &[99, 98, 97]), Err(StepError::Injected)));
    assert_eq!(seq.tokens(), p.as_slice());
    let img = seq.image(m).expect("image");
    assert!(bits(&seq.decode(m, 12).expect("decode"), &want), "a failed step left its state behind");
    // The image, before the last decode, restored into a fresh sequence.
    let mut back = m.new_sequence(64);
    back.restore_image(m, &img).expect("restores");
    assert_eq!(back.tokens(), p.as_slice());
    assert!(bits(&back.decode(m, 12).expect("decode"), &want), "a restored image continues differently");
    // Another model's image is refused and changes nothing.
    let other = fixture(TinyGemma4::dense());
    let mut seq2 = other.model.new_sequence(64);
    assert!(seq2.restore_image(&other.model, &img).is_err());
    assert!(seq2.is_empty());
}

#[test]
fn gemma4_sequences_share_a_prefix_and_keep_typed_caches_through_slot_files() {
    let mut f = fixture(TinyGemma4::e2b());
    // f16 fits the fixture's heads of 16 and 32 values; q8_0's blocks of 32 do not, and say so.
    let e = f.model.set_cache_types(tine_runtime::KvType::Q8_0, tine_runtime::KvType::F32).expect_err("heads of 16");
    assert!(tine_runtime::error_chain(&e).contains("q8_0"), "{}", tine_runtime::error_chain(&e));
    f.model.set_cache_types(tine_runtime::KvType::F16, tine_runtime::KvType::F16).expect("f16");
    let m = &f.model;
    // Three local layers of 2 KV heads x 16 and one global of 2 x 32 own K/V (the last two read
    // theirs), keys and values, 2 bytes a value.
    assert_eq!(m.kv_bytes_per_position(), Some(3 * (2 * 16 * 2 * 2) + 2 * 32 * 2 * 2));
    let toks = prompt(40);
    // The reference evaluates the same pieces (a long batch may take other matmul kernels).
    let mut whole = m.new_sequence(64);
    whole.prefill(m, &toks[..25]).expect("prefill");
    let want = whole.prefill(m, &toks[25..]).expect("prefill");
    let mut donor = m.new_sequence(64);
    donor.prefill(m, &toks[..30]).expect("prefill");
    assert!(donor.can_share());
    let prefix = donor.share_prefix(25).expect("share");
    assert_eq!((prefix.len(), donor.shared_len()), (25, 25));
    let mut seq = m.new_sequence(64);
    seq.attach_prefix(&prefix).expect("attach");
    let got = seq.prefill(m, &toks[25..]).expect("the rest");
    assert!(bits(&got, &want), "logits on the shared prefix differ");
    // A slot file of the f16 cache restores into a sequence of its own and goes on alike.
    let img = SlotImage::from_bytes(&seq.image(m).expect("image").to_bytes()).expect("parses");
    let mut back = m.new_sequence(64);
    back.restore_image(m, &img).expect("restore");
    assert_eq!((back.len(), back.shared_len()), (40, 0));
    assert!(bits(&back.decode(m, 9).expect("decode"), &seq.decode(m, 9).expect("decode")), "restored f16 cache differs");
}

// Issue 51: several sequences' rows in one forward (Model::forward_many), each sequence's logits
// the bits of its own forward_all, for every layout.
#[test]
fn gemma4_forward_many_gives_each_sequence_its_own_logits_bit_for_bit() {
    for cfg in shapes() {
        let fx = fixture(cfg);
        let m = &fx.model;
        assert!(m.batches());
        let mut batched: Vec<_> = (0..3).map(|_| m.new_sequence(256)).collect();
        let mut alone: Vec<_> = (0..3).map(|_| m.new_sequence(256)).collect();
        let streams: Vec<Vec<u32>> = (0..3).map(|s| prompt(60).into_iter().map(|t| (t + 17 * s) % 256).collect()).collect();
        let mut at = [0usize; 3];
        for (round, rows) in [[7usize, 1, 3], [1, 1, 1], [4, 2, 1], [1, 9, 1]].iter().enumerate() {
            if round == 2 {
                batched[1].rollback(at[1] - 2).expect("rollback");
                alone[1].rollback(at[1] - 2).expect("rollback");
                at[1] -= 2;
            }
            let chunks: Vec<Vec<u32>> = (0..3).map(|s| streams[s][at[s]..at[s] + rows[s]].to_vec()).collect();
            let mut steps: Vec<(&mut tine_runtime::Sequence, &[u32])> = batched.iter_mut().zip(&chunks).map(|(s, c)| (s, &c[..])).collect();
            let got = m.forward_many(&mut steps).expect("forward_many");
            for s in 0..3 {
                let want = alone[s].forward_all(m, &chunks[s]).expect("alone");
                assert!(bits(&got[s].data, &want.data), "round {round}, sequence {s}");
                at[s] += rows[s];
            }
        }
    }
}

// Issue 51: decode rows and verify batches (hidden states or not) of several sequences in one
// `Model::step_many`, each the bits of its own call, rollbacks inside the verify batches included.
#[test]
fn gemma4_step_many_mixes_decode_and_verify_rows_bit_for_bit() {
    for cfg in shapes() {
        let fx = fixture(cfg);
        let streams: [Vec<u32>; 3] = std::array::from_fn(|s| prompt(60).into_iter().map(|t| (t + 17 * s as u32) % 256).collect());
        crate::common::step_many_matches_each_alone(&fx.model, &streams);
    }
}
