//! tine-runtime over a Qwen3.5 hybrid (`qwen35`, `qwen35moe`): the same `Model`/`Sequence` API as
//! Gemma 3, against the float64 reference, with a recurrent state that rolls back exactly inside
//! a verify batch and to the checkpoint at a prompt's end, and refuses anything else.

use tine_runtime::{Model, Sequence, StepError};
use tine_test_support::qwen35_fixture::{Qwen35Reference, TinyQwen35, TOKENIZER_VOCAB};

struct Fixture {
    _dir: tempfile::TempDir,
    model: Model,
    weights: tine_test_support::qwen35_fixture::Qwen35Weights,
}

fn fixture(cfg: TinyQwen35) -> Fixture {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("qwen35.gguf");
    let weights = TinyQwen35 { vocab: TOKENIZER_VOCAB, tokenizer: true, ..cfg }.write(&path);
    let model = Model::load(&path).expect("the qwen35 fixture loads");
    Fixture { _dir: dir, model, weights }
}

fn shapes() -> [TinyQwen35; 2] {
    [TinyQwen35 { nextn: true, ..TinyQwen35::default() }, TinyQwen35 { n_k_heads: 1, n_v_heads: 3, full_attention_interval: 2, seed: 4, ..TinyQwen35::moe() }]
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
fn qwen35_loads_and_matches_float64_through_prefill_decode_and_verify() {
    for cfg in shapes() {
        let fx = fixture(cfg);
        let m = &fx.model;
        assert!(m.is_recurrent());
        assert_eq!(m.info.architecture, if fx.weights.cfg.n_expert > 0 { "qwen35moe" } else { "qwen35" });
        assert_eq!(m.has_nextn(), fx.weights.cfg.nextn);
        let mut reference = Qwen35Reference::new(&fx.weights);
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
        // F32 weights: rounding alone (the fixture's own tests measure about 1e-6).
        assert!(worst < 1e-5, "{}: {worst:.2e} of the largest logit from float64", m.info.architecture);
        assert_eq!(seq.len(), p.len() + 6);
    }
}

#[test]
fn qwen35_verify_rows_are_decode_bits_and_a_rollback_inside_the_batch_is_exact() {
    for cfg in shapes() {
        let fx = fixture(cfg);
        let m = &fx.model;
        let p = prompt(9);
        let drafts = [40u32, 41, 42, 43, 44];
        let mut base = m.new_sequence(64);
        base.prefill(m, &p).expect("prefill");
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
            seq.rollback(at).expect("inside the verify batch");
            let got = seq.decode(m, 7).expect("decode after the rollback");
            assert!(bits(&got, &want), "{} of 5 kept: the step after the rollback differs from straight decoding", keep);
            assert_eq!(seq.tokens(), straight.tokens());
        }
    }
}

#[test]
fn qwen35_rolls_back_to_its_prompt_checkpoint_and_refuses_positions_it_has_no_record_of() {
    let fx = fixture(shapes()[0].clone());
    let m = &fx.model;
    let p = prompt(12);
    let mut seq = m.new_sequence(64);
    seq.prefill(m, &p).expect("prefill");
    for t in [3u32, 4, 5] {
        seq.decode(m, t).expect("decode");
    }
    let n = p.len();
    // The prompt's last two positions are checkpoints; between them and the end, and before
    // them, there is no record.
    assert_eq!(seq.restorable(n + 2), n);
    assert_eq!(seq.restorable(n - 1), n - 1);
    assert_eq!(seq.restorable(n - 2), 0);
    let before = seq.tokens().to_vec();
    match seq.rollback(n + 1) {
        Err(StepError::RollbackRecurrent { to, len, nearest }) => assert_eq!((to, len, nearest), (n + 1, n + 3, n)),
        other => panic!("a rollback with no record: {:?}", other.map(|_| ())),
    }
    assert_eq!(seq.tokens(), before.as_slice(), "a refused rollback changes nothing");
    // Back to the checkpoint, then on: what a fresh sequence computes.
    seq.rollback(n).expect("to the prompt's checkpoint");
    let got = seq.decode(m, 77).expect("decode");
    let mut fresh = m.new_sequence(64);
    fresh.prefill(m, &p).expect("prefill");
    assert!(bits(&got, &fresh.decode(m, 77).expect("decode")), "after the checkpoint the state is not the prompt's");
    // The checkpoint before the prompt's last token, then that token: the prompt's logits.
    seq.rollback(n - 1).expect("to the checkpoint before the prompt's last token");
    assert!(bits(&seq.decode(m, p[n - 1]).expect("decode"), &{
        let mut s = m.new_sequence(64);
        s.prefill(m, &p).expect("prefill")
    }));
    seq.rollback(0).expect("0 is always reachable");
    assert!(seq.is_empty());
    assert!(bits(&seq.prefill(m, &p).expect("prefill"), &{
        let mut s = m.new_sequence(64);
        s.prefill(m, &p).expect("prefill")
    }));
}

#[test]
fn qwen35_steps_are_atomic_under_injected_failures() {
    let fx = fixture(shapes()[1].clone());
    let m = &fx.model;
    let p = prompt(10);
    let mut seq: Sequence = m.new_sequence(64);
    seq.prefill(m, &p).expect("prefill");
    let mut straight = m.new_sequence(64);
    straight.prefill(m, &p).expect("prefill");
    let want = straight.decode(m, 12).expect("decode");
    // A failure after a decode's state was written, and after a verify's.
    seq.inject_failure(Some(0));
    assert!(matches!(seq.decode(m, 99), Err(StepError::Injected)));
    seq.inject_failure(Some(0));
    assert!(matches!(seq.forward_all(m, &[99, 98, 97]), Err(StepError::Injected)));
    assert_eq!(seq.tokens(), p.as_slice());
    assert!(bits(&seq.decode(m, 12).expect("decode"), &want), "a failed step left its state behind");
}

#[test]
fn qwen35_nextn_state_matches_the_heads_float64_reference() {
    let fx = fixture(shapes()[0].clone());
    let m = &fx.model;
    let p = prompt(8);
    let mut seq = m.new_sequence(64);
    let (_, hidden) = seq.prefill_hidden(m, &p).expect("prefill");
    let mut state = m.new_nextn_state(64).expect("the fixture has a NextN head");
    assert!(!state.on_gpu_engine());
    // Entries j = 0..n-2 read hidden j and token j + 1.
    let n = p.len();
    let (logits, out) = state.forward(m, p[0], &hidden.rows(0, n - 1).expect("rows"), &p[1..]).expect("entries");
    assert_eq!(state.len(), n - 1);
    assert_eq!(out.positions(), n - 1);
    let mut reference = tine_test_support::qwen35_fixture::NextNReference::new(&fx.weights);
    let h = hidden.to_vec().expect("hidden");
    let mut want = Vec::new();
    for j in 0..n - 1 {
        want = reference.step(&h[j].iter().map(|&x| x as f64).collect::<Vec<_>>(), p[j + 1]).0;
    }
    // From the trunk's f32 hidden states: rounding alone.
    let worst = rel(&logits, &want);
    assert!(worst < 1e-5, "NextN entries against float64: {worst:.2e}");
    assert_eq!(state.reusable(&p), n - 1);
    state.truncate(3).expect("truncate");
    assert_eq!(state.len(), 3);
}

#[test]
fn qwen35_refuses_an_assistant_head_with_a_clear_error() {
    let fx = fixture(shapes()[0].clone());
    let m = &fx.model;
    // An assistant head is Gemma 3's.
    let dir = tempfile::tempdir().expect("tempdir");
    let head = dir.path().join("head.gguf");
    let cfg = tine_test_support::TinyGemma3::default();
    tine_test_support::TinyAssistant::default().write(&cfg, &head);
    let err = tine_runtime::Assistant::load(&head, m).err().expect("refused");
    assert!(err.to_string().contains("an assistant head is for a gemma3 or gemma4 target"), "{err}");
}

#[test]
fn qwen35_slot_files_carry_the_recurrent_state_and_continue_bit_for_bit() {
    for cfg in shapes() {
        let fx = fixture(cfg);
        let m = &fx.model;
        let p = prompt(13);
        let mut seq = m.new_sequence(64);
        seq.prefill(m, &p).expect("prefill");
        seq.forward_all(m, &[20, 21, 22]).expect("a verify batch");
        seq.rollback(p.len() + 2).expect("inside the batch");
        let img = seq.image(m).expect("image");
        assert!(!img.states.is_empty(), "the delta-net layers' windows and states are saved");
        let bytes = img.to_bytes();
        assert_eq!(&bytes[8..12], &2u32.to_le_bytes(), "a file with recurrent states is version 2");
        let back = tine_runtime::SlotImage::from_bytes(&bytes).expect("reads back");
        assert_eq!(back, img);
        let mut other = m.new_sequence(64);
        other.prefill(m, &prompt(4)).expect("something to replace");
        other.restore_image(m, &back).expect("restores");
        assert_eq!(other.tokens(), seq.tokens());
        assert!(bits(&other.decode(m, 9).expect("decode"), &seq.decode(m, 9).expect("decode")), "a restored slot continues differently");
        // A flipped byte is caught by the checksum; an image of another shape is refused and
        // leaves the sequence as it was.
        let mut bad = bytes.clone();
        bad[40] ^= 1;
        assert!(tine_runtime::SlotImage::from_bytes(&bad).is_err());
        let mut wrong = img.clone();
        wrong.states.pop();
        let before = other.tokens().to_vec();
        assert!(other.restore_image(m, &wrong).is_err());
        assert_eq!(other.tokens(), before.as_slice());
        // An empty sequence saves and restores too.
        let empty = m.new_sequence(64).image(m).expect("image");
        other.restore_image(m, &empty).expect("restores an empty slot");
        assert!(other.is_empty());
    }
}

/// Issue 29: with `-ctk/-ctv` the attention layers' rows are saved as stored (version 3 names the
/// types) beside the recurrent states; they restore bit for bit, and a model keeping other
/// types refuses the file by name.
#[test]
fn qwen35_typed_slot_files_keep_the_stored_rows_and_the_recurrent_state() {
    use tine_runtime::KvType;
    let mut fx = fixture(TinyQwen35 { head_dim: 32, nextn: true, full_attention_interval: 2, ..TinyQwen35::default() });
    fx.model.set_cache_types(KvType::Q8_0, KvType::Q4_0).expect("Qwen3.5 on the CPU keeps every type");
    let m = &fx.model;
    let p = prompt(13);
    let mut seq = m.new_sequence(64);
    seq.prefill(m, &p).expect("prefill");
    seq.forward_all(m, &[20, 21, 22]).expect("a verify batch");
    seq.rollback(p.len() + 1).expect("inside the batch");
    let img = seq.image(m).expect("image");
    assert_eq!(img.cache_types, (KvType::Q8_0, KvType::Q4_0));
    assert!(img.layers.is_empty() && img.typed_layers.len() == 2 && !img.states.is_empty(), "stored rows and recurrent states, no f32 copies");
    let bytes = img.to_bytes();
    assert_eq!(&bytes[8..12], &3u32.to_le_bytes(), "version 3 names the types");
    let back = tine_runtime::SlotImage::from_bytes(&bytes).expect("reads back");
    assert_eq!(back, img);
    let mut other = m.new_sequence(64);
    other.restore_image(m, &back).expect("restores");
    for t in [9u32, 10, 11] {
        assert!(bits(&other.decode(m, t).expect("decode"), &seq.decode(m, t).expect("decode")), "a restored slot continues differently at {t}");
    }
    let mut f32_model = fixture(TinyQwen35 { head_dim: 32, nextn: true, full_attention_interval: 2, ..TinyQwen35::default() });
    let err = f32_model.model.new_sequence(64).restore_image(&f32_model.model, &back).expect_err("an f32 cache refuses q8_0/q4_0 rows");
    assert!(err.to_string().contains("q8_0"), "{err}");
    f32_model.model.set_cache_types(KvType::F16, KvType::F16).expect("f16");
    assert!(f32_model.model.new_sequence(64).restore_image(&f32_model.model, &back).is_err(), "other types are refused too");
}

#[test]
fn recurrent_sequences_do_not_share_a_prefix_and_say_so() {
    let f = fixture(shapes()[0].clone());
    let mut seq = f.model.new_sequence(64);
    seq.prefill(&f.model, &[1, 2, 3, 4, 5]).expect("prefill");
    assert!(!seq.can_share());
    assert!(seq.share_prefix(4).is_err());
    assert_eq!((seq.len(), seq.shared_len()), (5, 0));
}

// Issue 51: several sequences' rows in one forward (Model::forward_many), each sequence's logits
// and recurrent state those of its own forward_all, a rollback inside a batched verify included.
#[test]
fn qwen35_forward_many_gives_each_sequence_its_own_logits_and_state() {
    for cfg in shapes() {
        let fx = fixture(cfg);
        let m = &fx.model;
        assert!(m.batches());
        let mut batched: Vec<Sequence> = (0..3).map(|_| m.new_sequence(256)).collect();
        let mut alone: Vec<Sequence> = (0..3).map(|_| m.new_sequence(256)).collect();
        let streams: Vec<Vec<u32>> = (0..3).map(|s| prompt(60).into_iter().map(|t| (t + 17 * s) % 256).collect()).collect();
        let mut at = [0usize; 3];
        for (round, rows) in [[7usize, 1, 3], [1, 1, 1], [4, 2, 1], [1, 5, 1]].iter().enumerate() {
            let chunks: Vec<Vec<u32>> = (0..3).map(|s| streams[s][at[s]..at[s] + rows[s]].to_vec()).collect();
            let mut steps: Vec<(&mut Sequence, &[u32])> = batched.iter_mut().zip(&chunks).map(|(s, c)| (s, &c[..])).collect();
            let got = m.forward_many(&mut steps).expect("forward_many");
            for s in 0..3 {
                let want = alone[s].forward_all(m, &chunks[s]).expect("alone");
                assert!(bits(&got[s].data, &want.data), "round {round}, sequence {s}");
                at[s] += rows[s];
            }
            if round == 2 {
                // Keep 2 of sequence 0's 4 verify rows: both go back to the same row state.
                batched[0].rollback(at[0] - 2).expect("rollback inside the batch");
                alone[0].rollback(at[0] - 2).expect("rollback inside the batch");
                at[0] -= 2;
            }
        }
        for s in 0..3 {
            let a = batched[s].forward_all(m, &streams[s][at[s]..at[s] + 1]).expect("after");
            let b = alone[s].forward_all(m, &streams[s][at[s]..at[s] + 1]).expect("after");
            assert!(bits(&a.data, &b.data), "sequence {s}: the step after (the recurrent state)");
        }
    }
}

// The server's batched decode (Model::decode_many): each sequence's row is its own decode's, and
// the sequences go on as they would alone.
#[test]
fn qwen35_decode_many_is_each_sequences_decode() {
    let fx = fixture(shapes()[0].clone());
    let m = &fx.model;
    let mut batched: Vec<Sequence> = (0..3).map(|_| m.new_sequence(128)).collect();
    let mut alone: Vec<Sequence> = (0..3).map(|_| m.new_sequence(128)).collect();
    for s in 0..3 {
        let p: Vec<u32> = prompt(5 + 3 * s).into_iter().map(|t| (t + 7 * s as u32) % 256).collect();
        batched[s].prefill(m, &p).expect("prefill");
        alone[s].prefill(m, &p).expect("prefill");
    }
    for step in 0..6u32 {
        let mut steps: Vec<(&mut Sequence, u32)> = batched.iter_mut().enumerate().map(|(s, q)| (q, (step * 31 + s as u32 * 5) % 256)).collect();
        let rows = m.decode_many(&mut steps).expect("decode_many");
        for s in 0..3 {
            let want = alone[s].decode(m, (step * 31 + s as u32 * 5) % 256).expect("decode");
            assert!(bits(&rows[s], &want), "step {step}, sequence {s}");
        }
    }
}

// Issue 51: decode rows and verify batches (hidden states or not) of several sequences in one
// `Model::step_many`, each the bits of its own call, rollbacks inside the verify batches included.
#[test]
fn qwen35_step_many_mixes_decode_and_verify_rows_bit_for_bit() {
    for cfg in shapes() {
        let fx = fixture(cfg);
        let streams: [Vec<u32>; 3] = std::array::from_fn(|s| prompt(60).into_iter().map(|t| (t + 17 * s as u32) % 256).collect());
        crate::common::step_many_matches_each_alone(&fx.model, &streams);
    }
}
