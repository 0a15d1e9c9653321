//! Checks shared by the families' test files.

use tine_runtime::{Hidden, Logits, Model, Rows, Sequence};

fn same(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

fn hidden_bits(h: &Hidden) -> Vec<f32> {
    h.to_vec().expect("f32 rows").concat()
}

/// Issue 51: `Model::step_many` over three sequences mixing prompt chunks, decode rows, verify
/// batches with and without hidden states and a sequence sitting a round out, rolled back inside their verify
/// batches (where a recurrent model keeps row states), gives each sequence the bits of its own
/// `decode` / `forward_all` / `forward_all_hidden`, and leaves each where its own calls would:
/// the step after every round and after the last are compared too.
pub fn step_many_matches_each_alone(m: &Model, streams: &[Vec<u32>; 3]) {
    use Rows::{Decode, Prefill, Verify};
    let h = Verify { hidden: true };
    let v = Verify { hidden: false };
    let p = Prefill { hidden: false };
    let ph = Prefill { hidden: true };
    // Per round, each sequence's (rows, kind) or none, and how many rows of a verify to drop:
    // prompt chunks (with and without hidden states), decode rows, verify batches.
    let rounds: [[(usize, Option<Rows>, usize); 3]; 7] = [
        [(7, Some(p), 0), (1, Some(Decode), 0), (3, Some(ph), 0)],
        [(1, Some(Decode), 0), (1, Some(Decode), 0), (1, Some(Decode), 0)],
        [(4, Some(h), 2), (1, Some(Decode), 0), (2, Some(v), 1)],
        [(1, Some(Decode), 0), (0, None, 0), (5, Some(h), 3)],
        [(1, Some(Decode), 0), (3, Some(v), 0), (1, Some(Decode), 0)],
        [(9, Some(ph), 0), (2, Some(h), 1), (6, Some(p), 0)],
        [(1, Some(Decode), 0), (5, Some(p), 0), (1, Some(Decode), 0)],
    ];
    let mut batched: Vec<Sequence> = (0..3).map(|_| m.new_sequence(256)).collect();
    let mut alone: Vec<Sequence> = (0..3).map(|_| m.new_sequence(256)).collect();
    let mut at = [0usize; 3];
    for (r, round) in rounds.iter().enumerate() {
        let chunks: Vec<Vec<u32>> = (0..3).map(|s| streams[s][at[s]..at[s] + round[s].0].to_vec()).collect();
        let mut steps: Vec<(&mut Sequence, &[u32], Rows)> = Vec::new();
        let mut which = Vec::new();
        for (s, seq) in batched.iter_mut().enumerate() {
            if let Some(kind) = round[s].1 {
                steps.push((seq, &chunks[s][..], kind));
                which.push(s);
            }
        }
        let got = m.step_many(&mut steps).expect("step_many");
        assert_eq!(got.len(), which.len());
        for ((logits, hidden), &s) in got.into_iter().zip(&which) {
            let (want, want_hidden): (Logits, Option<Hidden>) = match round[s].1.expect("in the round") {
                Decode => {
                    let row = alone[s].decode(m, chunks[s][0]).expect("decode alone");
                    (Logits { vocab: row.len(), data: row }, None)
                }
                Verify { hidden: false } => (alone[s].forward_all(m, &chunks[s]).expect("forward_all alone"), None),
                Verify { hidden: true } => {
                    let (l, h) = alone[s].forward_all_hidden(m, &chunks[s]).expect("forward_all_hidden alone");
                    (l, Some(h))
                }
                Prefill { hidden: false } => {
                    let row = alone[s].prefill(m, &chunks[s]).expect("prefill alone");
                    (Logits { vocab: row.len(), data: row }, None)
                }
                Prefill { hidden: true } => {
                    let (row, h) = alone[s].prefill_hidden(m, &chunks[s]).expect("prefill_hidden alone");
                    (Logits { vocab: row.len(), data: row }, Some(h))
                }
            };
            assert!(same(&logits.data, &want.data) && logits.vocab == want.vocab, "round {r}, sequence {s}: logits");
            assert_eq!(hidden.is_some(), want_hidden.is_some(), "round {r}, sequence {s}: hidden states given");
            if let (Some(a), Some(b)) = (&hidden, &want_hidden) {
                assert!(same(&hidden_bits(a), &hidden_bits(b)), "round {r}, sequence {s}: hidden states");
            }
            at[s] += round[s].0;
            let drop = round[s].2;
            if drop > 0 {
                batched[s].rollback(at[s] - drop).expect("rollback inside the verify batch");
                alone[s].rollback(at[s] - drop).expect("rollback inside the verify batch");
                at[s] -= drop;
            }
            assert_eq!(batched[s].tokens(), alone[s].tokens(), "round {r}, sequence {s}: tokens");
        }
    }
    for s in 0..3 {
        let a = batched[s].decode(m, streams[s][at[s]]).expect("after the batches");
        let b = alone[s].decode(m, streams[s][at[s]]).expect("after the solo steps");
        assert!(same(&a, &b), "sequence {s}: the step after (caches and recurrent states)");
    }
    // A batch that cannot run (a decode of two tokens) is refused and changes no sequence.
    let lens: Vec<usize> = batched.iter().map(Sequence::len).collect();
    let (x, y) = batched.split_at_mut(1);
    let two = [streams[0][0], streams[0][1]];
    assert!(m.step_many(&mut [(&mut x[0], &two[..1], Rows::Decode), (&mut y[0], &two[..], Rows::Decode)]).is_err());
    assert_eq!(batched.iter().map(Sequence::len).collect::<Vec<_>>(), lens);
}
