//! What one batched engine step runs (issue 50's scheduler, before the engine's batched step
//! exists): every decoding slot's next row and every speculating slot's verify rows first, then
//! prompt chunks while the step's prompt-token budget lasts, at most `max_prefills` prompts a
//! step, the prompts taken in turn from the slot after the last one served. Pure bookkeeping over
//! slot demands, so CI tests it without a GPU; the row-count bucket a step's graph is captured for
//! comes with the plan.
//!
//! Invariants a plan keeps (each has a test):
//! - every decode and verify demand is in every step, whatever the prompts: a long prompt stalls
//!   no decoding slot, and prompts never eat the rows decoding needs (the budget is on top);
//! - a prompt's chunks depend on its own length alone (the longest ladder length that fits in
//!   what is left of it, or the whole rest below the smallest), never on what else shares the
//!   step: a request is cut the same way alone and under load, which keeps its rows' arithmetic
//!   the same (the engine runs short steps and prompt steps through different kernels);
//! - the first prompt in turn always gets its chunk (the ladder's longest fits the budget), so no
//!   prompt starves; the bucket is the smallest that holds the step's rows.

/// What a slot asks of the next step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Demand {
    /// Its next token: one row.
    Decode,
    /// Verify `drafts` drafted tokens: `drafts + 1` rows.
    Verify { drafts: usize },
    /// `remaining` prompt tokens not yet run.
    Prompt { remaining: usize },
}

/// One slot's part of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    pub slot: usize,
    pub demand: Demand,
    /// Rows it adds to the step.
    pub rows: usize,
}

/// A step: its entries (decode and verify first, in slot order, then prompt chunks), its rows and
/// the row-count bucket its graph is captured for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub entries: Vec<Entry>,
    pub rows: usize,
    pub bucket: usize,
}

/// The row counts a step's graph is captured for: 1 to 8 one by one, then about 1.5x apart, up to
/// and including `max_rows` (a step of more rows than the largest bucket runs without a graph).
pub fn buckets(max_rows: usize) -> Vec<usize> {
    let mut b: Vec<usize> = (1..=8.min(max_rows)).collect();
    let mut n = 8usize;
    while n < max_rows {
        let next = if n.is_power_of_two() { n + n / 2 } else { n / 3 * 4 };
        n = next.min(max_rows);
        b.push(n);
    }
    b
}

/// The smallest bucket holding `rows` (`rows` itself past the largest).
pub fn bucket_for(buckets: &[usize], rows: usize) -> usize {
    buckets.iter().copied().find(|&b| b >= rows).unwrap_or(rows)
}

/// Why a planner cannot be made.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PlanError {
    #[error("the prompt chunk ladder is empty or holds 0")]
    Ladder,
    #[error("the ladder's longest chunk, {longest}, is over the step's prompt budget of {budget}")]
    Budget { budget: usize, longest: usize },
}

/// Builds plans step after step (it remembers whose prompt went last).
#[derive(Debug, Clone)]
pub struct Planner {
    /// Most prompt tokens a step takes (llama-server's `-ub` in spirit), on top of its decode and
    /// verify rows.
    budget: usize,
    max_prefills: usize,
    /// Prompt chunk lengths, longest first.
    ladder: Vec<usize>,
    buckets: Vec<usize>,
    /// The slot whose prompt was served last.
    last_prompt: Option<usize>,
}

impl Planner {
    /// A planner for steps of at most `max_fixed` decode and verify rows (the slots times their
    /// draft depth plus one) plus `budget` prompt tokens of at most `max_prefills` prompts, cut at
    /// the lengths of `ladder`. Graph buckets go up to `max_fixed + budget` rows.
    pub fn new(budget: usize, max_fixed: usize, max_prefills: usize, ladder: &[usize]) -> Result<Planner, PlanError> {
        if ladder.is_empty() || ladder.contains(&0) {
            return Err(PlanError::Ladder);
        }
        let mut ladder = ladder.to_vec();
        ladder.sort_unstable_by(|a, b| b.cmp(a));
        ladder.dedup();
        if ladder[0] > budget {
            return Err(PlanError::Budget { budget, longest: ladder[0] });
        }
        Ok(Planner { budget, max_prefills, ladder, buckets: buckets(max_fixed + budget), last_prompt: None })
    }

    /// The chunk a prompt with `remaining` tokens left runs next: the longest ladder length not
    /// over `remaining`, or all of it below the ladder's shortest.
    pub fn chunk(&self, remaining: usize) -> usize {
        self.ladder.iter().copied().find(|&l| l <= remaining).unwrap_or(remaining)
    }

    /// The next step over `demands` (`(slot, demand)`, any order, a slot at most once): decode and
    /// verify rows in slot order, then prompt chunks in turn from the slot after the last one
    /// served while the budget holds them (a chunk that does not fit what is left waits; the
    /// first in turn always fits).
    pub fn plan(&mut self, demands: &[(usize, Demand)]) -> Plan {
        let mut entries: Vec<Entry> = demands
            .iter()
            .filter_map(|&(slot, demand)| match demand {
                Demand::Decode => Some(Entry { slot, demand, rows: 1 }),
                Demand::Verify { drafts } => Some(Entry { slot, demand, rows: drafts + 1 }),
                Demand::Prompt { .. } => None,
            })
            .collect();
        entries.sort_by_key(|e| e.slot);
        let mut prompts: Vec<(usize, usize)> = demands
            .iter()
            .filter_map(|&(slot, d)| match d {
                Demand::Prompt { remaining } if remaining > 0 => Some((slot, remaining)),
                _ => None,
            })
            .collect();
        // In turn: the slots after the last one served first, then the rest, each by slot.
        let after = self.last_prompt.map_or(0, |s| s + 1);
        prompts.sort_by_key(|&(slot, _)| (slot < after, slot));
        let (mut left, mut prefills) = (self.budget, 0);
        for (slot, remaining) in prompts {
            if prefills == self.max_prefills {
                break;
            }
            let n = self.chunk(remaining);
            if n > left {
                continue;
            }
            entries.push(Entry { slot, demand: Demand::Prompt { remaining }, rows: n });
            left -= n;
            prefills += 1;
            self.last_prompt = Some(slot);
        }
        let rows = entries.iter().map(|e| e.rows).sum();
        Plan { bucket: bucket_for(&self.buckets, rows), entries, rows }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LADDER: [usize; 6] = [512, 256, 128, 64, 32, 16];

    fn planner(max_prefills: usize) -> Planner {
        Planner::new(512, 64, max_prefills, &LADDER).expect("a planner")
    }

    fn cuts(plan: &Plan) -> Vec<(usize, usize)> {
        plan.entries.iter().map(|e| (e.slot, e.rows)).collect()
    }

    #[test]
    fn every_decode_and_verify_row_is_in_every_step_whatever_the_prompts() {
        let mut p = planner(2);
        let demands = [(3, Demand::Prompt { remaining: 5000 }), (0, Demand::Decode), (2, Demand::Verify { drafts: 3 }), (1, Demand::Prompt { remaining: 9000 }), (5, Demand::Decode)];
        for _ in 0..10 {
            let plan = p.plan(&demands);
            let fixed: Vec<(usize, usize)> = plan.entries.iter().filter(|e| !matches!(e.demand, Demand::Prompt { .. })).map(|e| (e.slot, e.rows)).collect();
            assert_eq!(fixed, vec![(0, 1), (2, 4), (5, 1)], "decode and verify rows first, in slot order");
            let prompt_rows: usize = plan.entries.iter().filter(|e| matches!(e.demand, Demand::Prompt { .. })).map(|e| e.rows).sum();
            assert_eq!(prompt_rows, 512, "one prompt's 512-token chunk a step, on top of the 6 rows");
            assert_eq!(plan.rows, 518);
        }
    }

    #[test]
    fn a_prompt_is_cut_by_its_own_length_alone_under_load_or_not() {
        // 700 tokens: 512, then 128 of the 188 left, then 32 of 60, 16 of 28, then the last 12.
        let alone = |mut remaining: usize| {
            let mut p = planner(1);
            let mut chunks = Vec::new();
            while remaining > 0 {
                let plan = p.plan(&[(0, Demand::Prompt { remaining })]);
                chunks.push(plan.entries[0].rows);
                remaining -= plan.entries[0].rows;
            }
            chunks
        };
        assert_eq!(alone(700), vec![512, 128, 32, 16, 12]);
        // Beside another prompt and decoding slots: the same chunks, in more steps.
        let mut p = planner(2);
        let (mut a, mut b) = (700usize, 300usize);
        let mut got = Vec::new();
        while a > 0 {
            let mut demands = vec![(1, Demand::Decode), (2, Demand::Verify { drafts: 2 })];
            if a > 0 {
                demands.push((0, Demand::Prompt { remaining: a }));
            }
            if b > 0 {
                demands.push((3, Demand::Prompt { remaining: b }));
            }
            for e in p.plan(&demands).entries {
                match e.slot {
                    0 => {
                        got.push(e.rows);
                        a -= e.rows;
                    }
                    3 => b -= e.rows,
                    _ => {}
                }
            }
        }
        assert_eq!(got, alone(700));
    }

    #[test]
    fn prompts_take_turns_so_none_starves() {
        let mut p = Planner::new(256, 8, 1, &[256, 64]).expect("a planner");
        let mut left = [1000usize, 1000, 1000];
        let mut served = [0usize; 3];
        for _ in 0..9 {
            let demands: Vec<(usize, Demand)> = left.iter().enumerate().filter(|(_, &r)| r > 0).map(|(s, &r)| (s, Demand::Prompt { remaining: r })).collect();
            let plan = p.plan(&demands);
            assert_eq!(plan.entries.len(), 1, "one prompt a step");
            let e = plan.entries[0];
            left[e.slot] -= e.rows;
            served[e.slot] += 1;
        }
        assert_eq!(served, [3, 3, 3], "the slots took turns");
        // Two prompts a step: a chunk that does not fit what the first left waits its turn.
        let mut p = Planner::new(512, 8, 2, &LADDER).expect("a planner");
        let plan = p.plan(&[(0, Demand::Prompt { remaining: 400 }), (1, Demand::Prompt { remaining: 300 })]);
        assert_eq!(cuts(&plan), vec![(0, 256), (1, 256)]);
        let plan = p.plan(&[(0, Demand::Prompt { remaining: 144 }), (1, Demand::Prompt { remaining: 600 })]);
        assert_eq!(cuts(&plan), vec![(0, 128)], "slot 1's 512 does not fit the 384 left; slot 0's turn came round");
    }

    #[test]
    fn a_step_s_bucket_is_the_smallest_that_holds_its_rows() {
        let b = buckets(80);
        assert_eq!(b, vec![1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64, 80]);
        assert_eq!(bucket_for(&b, 9), 12);
        assert_eq!(bucket_for(&b, 33), 48);
        assert_eq!(bucket_for(&b, 200), 200, "past the largest: no graph, the rows themselves");
        let mut p = Planner::new(64, 16, 4, &[64, 32, 16, 8]).expect("a planner");
        let demands: Vec<(usize, Demand)> = (0..3).map(|s| (s, Demand::Verify { drafts: 4 })).chain([(20, Demand::Prompt { remaining: 40 })]).collect();
        let plan = p.plan(&demands);
        assert_eq!((plan.rows, plan.bucket), (15 + 32, 48));
        assert_eq!(*buckets(16 + 64).last().expect("buckets"), 80);
    }

    #[test]
    fn a_planner_refuses_an_empty_ladder_or_a_chunk_over_its_budget() {
        assert_eq!(Planner::new(512, 64, 1, &[]).expect_err("empty"), PlanError::Ladder);
        assert_eq!(Planner::new(512, 64, 1, &[64, 0]).expect_err("zero"), PlanError::Ladder);
        assert_eq!(Planner::new(256, 64, 1, &[512, 64]).expect_err("budget"), PlanError::Budget { budget: 256, longest: 512 });
    }
}
