//! Checks shared by the families' test files.

use tine_runtime::{Hidden, Logits, Model, Rows, Sequence};

fn same(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

fn hidden_bits(h: &Hidden) -> Vec<f32> {
    h.to_vec().expect("f32 rows").concat()
}

/// What a round feeds a sequence in `step_many_matches_each_alone`.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Feed {
    Decode,
    Verify {
        hidden: bool,
    },
    /// A prompt of this many tokens, fed as its pieces (`Model::prompt_pieces`), one a step.
    Prompt {
        hidden: bool,
    },
}

/// Issue 51: `Model::step_many` over three sequences mixing prompt pieces, decode rows, verify
/// batches with and without hidden states and a sequence sitting a round out, rolled back inside
/// their verify batches (where a recurrent model keeps row states), gives each sequence the bits
/// of its own `decode` / `forward_all` / `forward_all_hidden` / `prefill` / `prefill_hidden`, and
/// leaves each where its own calls would (a recurrent model's prompt checkpoints included): the
/// step after every round and after the last are compared too.
pub fn step_many_matches_each_alone(m: &Model, streams: &[Vec<u32>; 3]) {
    use Feed::{Decode, Prompt, Verify};
    let h = Verify { hidden: true };
    let v = Verify { hidden: false };
    let p = Prompt { hidden: false };
    let ph = Prompt { hidden: true };
    // Per round, each sequence's (rows, kind) or none, and how many rows of a verify to drop:
    // prompts (with and without hidden states), decode rows, verify batches.
    let rounds: [[(usize, Option<Feed>, usize); 3]; 8] = [
        [(7, Some(p), 0), (1, Some(Decode), 0), (3, Some(ph), 0)],
        [(1, Some(Decode), 0), (1, Some(Decode), 0), (1, Some(Decode), 0)],
        [(4, Some(h), 2), (1, Some(Decode), 0), (2, Some(v), 1)],
        [(1, Some(Decode), 0), (0, None, 0), (5, Some(h), 3)],
        [(1, Some(Decode), 0), (3, Some(v), 0), (1, Some(Decode), 0)],
        [(9, Some(ph), 0), (2, Some(h), 1), (6, Some(p), 0)],
        [(1, Some(Decode), 0), (5, Some(p), 0), (1, Some(Decode), 0)],
        [(1, Some(p), 0), (1, Some(ph), 0), (2, Some(p), 0)],
    ];
    let mut batched: Vec<Sequence> = (0..3).map(|_| m.new_sequence(256)).collect();
    let mut alone: Vec<Sequence> = (0..3).map(|_| m.new_sequence(256)).collect();
    let mut at = [0usize; 3];
    for (r, round) in rounds.iter().enumerate() {
        let chunks: Vec<Vec<u32>> = (0..3).map(|s| streams[s][at[s]..at[s] + round[s].0].to_vec()).collect();
        // Each sequence's steps this round: one, or a prompt's pieces, one per `step_many`.
        let feeds: Vec<Vec<(std::ops::Range<usize>, Rows)>> = (0..3)
            .map(|s| match round[s].1 {
                None => Vec::new(),
                Some(Decode) => vec![(0..1, Rows::Decode)],
                Some(Verify { hidden }) => vec![(0..round[s].0, Rows::Verify { hidden })],
                Some(Prompt { hidden }) => m.prompt_pieces(round[s].0).into_iter().map(|q| (q.start..q.start + q.len, Rows::Prefill { hidden, checkpoint: q.checkpoint })).collect(),
            })
            .collect();
        let mut got: Vec<Option<(Logits, Option<Hidden>)>> = vec![None, None, None];
        for k in 0..feeds.iter().map(Vec::len).max().unwrap_or(0) {
            let mut steps: Vec<(&mut Sequence, &[u32], Rows)> = Vec::new();
            let mut which = Vec::new();
            for (s, seq) in batched.iter_mut().enumerate() {
                if let Some((range, kind)) = feeds[s].get(k) {
                    steps.push((seq, &chunks[s][range.clone()], *kind));
                    which.push(s);
                }
            }
            let out = m.step_many(&mut steps).expect("step_many");
            assert_eq!(out.len(), which.len());
            for ((logits, hidden), &s) in out.into_iter().zip(&which) {
                // A prompt's pieces: the last one's logits, every piece's hidden states.
                let hidden = match (got[s].take().and_then(|(_, h)| h), hidden) {
                    (Some(a), Some(b)) => Some(a.concat(&b).expect("hidden states join")),
                    (_, b) => b,
                };
                got[s] = Some((logits, hidden));
            }
        }
        for s in 0..3 {
            let Some((logits, hidden)) = got[s].take() else { continue };
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
                Prompt { hidden: false } => {
                    let row = alone[s].prefill(m, &chunks[s]).expect("prefill alone");
                    (Logits { vocab: row.len(), data: row }, None)
                }
                Prompt { hidden: true } => {
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
            // The positions a later request could return to (a recurrent model's checkpoints).
            for back in 1..=3.min(at[s]) {
                assert_eq!(batched[s].restorable(at[s] - back), alone[s].restorable(at[s] - back), "round {r}, sequence {s}: restorable at -{back}");
            }
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
