//! Prompt prefixes shared across slots: a request whose prompt starts like another slot's tokens
//! (a system prompt, a few-shot block) starts on one copy of that prefix's KV and evaluates only
//! the rest.
//!
//! Invariant: a slot reads a prefix only through [`tine_runtime::Sequence::attach_prefix`] /
//! `share_prefix` (and a NextN head's `NextNState` equivalents, trusted entries only), which keep
//! every result bit for bit what the slot would compute holding the positions itself; slots see
//! each other's tokens only as far as their prompts agree.
//! Invariant: an entry is freed (dropped from the pool) only when nothing else holds it: no
//! slot reads from it and no longer entry extends it; among those, the least recently used go
//! first, while the pool is over its budget.

use std::sync::Arc;

use tine_runtime::{NextNPrefix, SharedPrefix};

/// A new entry must add at least this many positions over what a request could reuse already
/// (its slot's own cache or an entry): shorter agreements are chance, not a shared prompt.
pub const MIN_NEW_PREFIX: usize = 64;

/// What a pool holds: a sequence's first positions (the target's or a draft model's), or a
/// NextN head's first entries.
#[derive(Debug, Clone)]
pub enum Shared {
    Sequence(SharedPrefix),
    NextN(NextNPrefix),
}

impl Shared {
    /// The tokens a prompt must start with to use it.
    pub fn tokens(&self) -> &[u32] {
        match self {
            Shared::Sequence(p) => p.tokens(),
            Shared::NextN(p) => p.tokens(),
        }
    }

    /// Positions (or entries) it holds.
    pub fn len(&self) -> usize {
        match self {
            Shared::Sequence(p) => p.len(),
            Shared::NextN(p) => p.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Positions whose rows it holds of its own (the rest are its parent's).
    pub fn copied(&self) -> usize {
        match self {
            Shared::Sequence(p) => p.copied(),
            Shared::NextN(p) => p.copied(),
        }
    }
}

/// A shared prefix and the one it extends (its first positions are read from there, so it
/// keeps that one alive). Slots hold these while they read from them.
#[derive(Debug)]
pub struct Node {
    pub prefix: Shared,
    pub parent: Option<Arc<Node>>,
}

struct Entry {
    node: Arc<Node>,
    last_used: u64,
}

/// What `/metrics` shows of the pool.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolStats {
    pub entries: usize,
    /// KV bytes the entries hold, each row counted once.
    pub bytes: usize,
    /// Requests started on a shared prefix.
    pub hits: u64,
    /// Prompt positions those requests read from a shared prefix instead of evaluating.
    pub shared_tokens: u64,
    /// Entries freed to stay within the budget.
    pub evictions: u64,
}

pub struct PrefixPool {
    entries: Vec<Entry>,
    /// Bytes the entries may hold (`None`: no limit).
    budget: Option<usize>,
    bytes_per_position: usize,
    stats: PoolStats,
}

impl PrefixPool {
    pub fn new(budget: Option<usize>, bytes_per_position: usize) -> PrefixPool {
        PrefixPool { entries: Vec::new(), budget, bytes_per_position, stats: PoolStats::default() }
    }

    /// The longest entry `prompt` starts with, of at most `limit` positions.
    pub fn lookup(&self, prompt: &[u32], limit: usize) -> Option<Arc<Node>> {
        self.entries.iter().filter(|e| e.node.prefix.len() <= limit && prompt.starts_with(e.node.prefix.tokens())).max_by_key(|e| e.node.prefix.len()).map(|e| e.node.clone())
    }

    /// Marks `prefix` used now (a request started on it).
    pub fn touch(&mut self, node: &Arc<Node>, clock: u64, positions: usize) {
        if let Some(e) = self.entries.iter_mut().find(|e| Arc::ptr_eq(&e.node, node)) {
            e.last_used = clock;
        }
        self.stats.hits += 1;
        self.stats.shared_tokens += positions as u64;
    }

    /// Adds `node`, then frees unheld entries, least recently used first, while over the budget.
    pub fn insert(&mut self, node: Arc<Node>, clock: u64) {
        self.entries.push(Entry { node, last_used: clock });
        self.evict();
    }

    fn evict(&mut self) {
        let Some(budget) = self.budget else { return };
        while self.bytes() > budget {
            // Held only by the pool: no slot reads it, no entry extends it.
            let free = self.entries.iter().enumerate().filter(|(_, e)| Arc::strong_count(&e.node) == 1).min_by_key(|(_, e)| e.last_used).map(|(i, _)| i);
            let Some(i) = free else { return };
            self.entries.remove(i);
            self.stats.evictions += 1;
        }
    }

    /// KV bytes the entries hold: each entry's own rows, and those of the prefixes they extend
    /// (held through them), each counted once.
    pub fn bytes(&self) -> usize {
        let mut seen: Vec<*const Node> = Vec::new();
        let mut total = 0;
        for e in &self.entries {
            let mut at = Some(&e.node);
            while let Some(n) = at {
                if seen.contains(&Arc::as_ptr(n)) {
                    break;
                }
                seen.push(Arc::as_ptr(n));
                total += n.prefix.copied() * self.bytes_per_position;
                at = n.parent.as_ref();
            }
        }
        total
    }

    pub fn stats(&self) -> PoolStats {
        PoolStats { entries: self.entries.len(), bytes: self.bytes(), ..self.stats }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tine_runtime::Model;
    use tine_test_support::TinyGemma3;

    fn node(model: &Model, tokens: &[u32], len: usize, parent: Option<Arc<Node>>) -> Arc<Node> {
        let mut seq = model.new_sequence(512);
        if let Some(Shared::Sequence(p)) = parent.as_ref().map(|n| &n.prefix) {
            seq.attach_prefix(p).expect("attach");
        }
        seq.prefill(model, &tokens[seq.len()..]).expect("prefill");
        Arc::new(Node { prefix: Shared::Sequence(seq.share_prefix(len).expect("share")), parent })
    }

    #[test]
    fn unheld_prefixes_go_least_recently_used_first_and_held_ones_stay() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("tiny.gguf");
        TinyGemma3 { context: 512, ..TinyGemma3::default() }.write(&path);
        let model = Model::load(&path).expect("fixture loads");
        let bpp = model.kv_bytes_per_position().expect("a KV cache");
        let toks = |seed: u32| -> Vec<u32> { (0..120u32).map(|i| 6 + (i * 31 + seed * 7) % 250).collect() };
        // Room for two prefixes of 100 positions.
        let mut pool = PrefixPool::new(Some(2 * 100 * bpp + 1), bpp);
        let (a, b) = (node(&model, &toks(1), 100, None), node(&model, &toks(2), 100, None));
        let held_b = b.clone();
        pool.insert(a.clone(), 1);
        pool.insert(b, 2);
        assert_eq!(pool.stats().bytes, 200 * bpp);
        drop(a);
        // A third: over the budget, so the unheld `a` goes; `b` is held by a slot.
        pool.insert(node(&model, &toks(3), 100, None), 3);
        assert_eq!((pool.stats().entries, pool.stats().evictions), (2, 1));
        assert!(pool.lookup(&toks(1), 119).is_none(), "the unheld entry was freed");
        assert!(pool.lookup(&toks(2), 119).is_some(), "the held entry stays");
        // Every entry held: the pool goes over its budget rather than free what slots read.
        let held_c = pool.lookup(&toks(3), 119).expect("third entry");
        let held_d = node(&model, &toks(4), 100, None);
        pool.insert(held_d.clone(), 4);
        assert_eq!((pool.stats().entries, pool.stats().bytes), (3, 300 * bpp));
        drop((held_b, held_c, held_d));
        // A prefix extending another counts only its own rows beside its parent's, and keeps it.
        let mut pool = PrefixPool::new(None, bpp);
        let base = node(&model, &toks(5), 64, None);
        let longer = node(&model, &toks(5), 100, Some(base.clone()));
        assert_eq!(longer.prefix.copied(), 36);
        pool.insert(base.clone(), 1);
        pool.insert(longer.clone(), 2);
        assert_eq!(pool.stats().bytes, 100 * bpp);
        // The longest entry the prompt starts with, within the limit.
        assert_eq!(pool.lookup(&toks(5), 119).expect("entry").prefix.len(), 100);
        assert_eq!(pool.lookup(&toks(5), 99).expect("entry").prefix.len(), 64);
        assert!(pool.lookup(&toks(6), 119).is_none());
        pool.touch(&longer, 3, 100);
        assert_eq!((pool.stats().hits, pool.stats().shared_tokens), (1, 100));
    }
}
