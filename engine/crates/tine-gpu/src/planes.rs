//! The bookkeeping of a recurrent layer's state planes (host code only, so CI tests it).
//!
//! A sequence's recurrent state (Qwen3.5's conv windows and delta states) lives in a ring of
//! [`PLANES`] planes on the device. A step of `rows` rows reads the plane the sequence is at and
//! writes the state after its row `m` into plane `(plane + 1 + m) % PLANES`, for its last
//! `PLANES - 1` rows only (the kernels' rule: `rows - 1 - m < PLANES - 1`). [`Ring`] knows which
//! position's state each plane holds, so going back to a position one of them holds is choosing
//! that plane for the next step: no copy and no re-run.

/// Planes per recurrent layer and sequence: the state at a step's start and after each row of
/// a verify step of up to the engine's 8 rows (`cuda::MAX_ROWS + 1`, asserted where both exist).
pub const PLANES: usize = 9;

/// Which position's state each plane holds, and which plane the sequence is at.
///
/// Invariant: `held[p] == Some(n)` only if plane `p` holds the state after the sequence's first
/// `n` positions (one of its current history: every entry is at most `pos`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ring {
    pos: usize,
    plane: usize,
    held: [Option<usize>; PLANES],
    /// Plane 0 must be zeroed before the next step (the sequence went back to position 0).
    zero_pending: bool,
    /// A step failed part way: the state is lost, and only a return to 0 is exact.
    broken: bool,
}

impl Default for Ring {
    fn default() -> Ring {
        Ring::new()
    }
}

impl Ring {
    /// An empty sequence: plane 0, zeroed (as allocated), holds position 0.
    pub fn new() -> Ring {
        let mut held = [None; PLANES];
        held[0] = Some(0);
        Ring { pos: 0, plane: 0, held, zero_pending: false, broken: false }
    }

    /// Positions the sequence holds.
    pub fn pos(&self) -> usize {
        self.pos
    }

    /// The plane the next step starts from.
    pub fn plane(&self) -> usize {
        self.plane
    }

    /// Whether plane 0 must be zeroed before the next step reads it.
    pub fn zero_pending(&self) -> bool {
        self.zero_pending
    }

    /// Plane 0 was zeroed.
    pub fn zeroed(&mut self) {
        self.zero_pending = false;
    }

    /// Whether a step failed part way (only [`Ring::truncate`] to 0 makes the ring usable).
    pub fn broken(&self) -> bool {
        self.broken
    }

    /// Whether a step's row `m` of `rows` keeps its state in a plane (the kernels' rule).
    pub fn keeps(rows: usize, m: usize) -> bool {
        rows - 1 - m < PLANES - 1
    }

    /// A step of `rows` rows ran: its kept rows' planes hold their positions, the sequence is at
    /// the last row's plane.
    pub fn stepped(&mut self, rows: usize) {
        let p0 = self.plane;
        for m in 0..rows {
            if Ring::keeps(rows, m) {
                self.held[(p0 + 1 + m) % PLANES] = Some(self.pos + m + 1);
            }
        }
        self.plane = (p0 + rows) % PLANES;
        self.pos += rows;
    }

    /// A step failed part way: it may have written planes.
    pub fn failed(&mut self) {
        self.held = [None; PLANES];
        self.broken = true;
    }

    /// The longest prefix of at most `len` positions [`Ring::truncate`] keeps: all of them at the
    /// end, `len` where a plane holds its state, else 0.
    pub fn restorable(&self, len: usize) -> usize {
        if self.broken {
            return 0;
        }
        if len >= self.pos {
            return self.pos;
        }
        if self.held.contains(&Some(len)) {
            len
        } else {
            0
        }
    }

    /// Keeps the first `len` positions where [`Ring::restorable`] allows it and returns whether
    /// it did; otherwise nothing changes.
    pub fn truncate(&mut self, len: usize) -> bool {
        if len >= self.pos && !self.broken {
            return true;
        }
        if len == 0 {
            *self = Ring { zero_pending: true, ..Ring::new() };
            return true;
        }
        if self.broken {
            return false;
        }
        let Some(p) = self.held.iter().position(|&q| q == Some(len)) else { return false };
        self.plane = p;
        for q in &mut self.held {
            if q.is_some_and(|q| q > len) {
                *q = None;
            }
        }
        self.pos = len;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A model of the device: each plane's content as the position whose state was written
    /// there (what the kernels do), to check the ring's map against.
    struct Device {
        content: [Option<usize>; PLANES],
    }

    impl Device {
        fn step(&mut self, ring: &Ring, rows: usize) {
            if ring.zero_pending() {
                self.content[0] = Some(0);
            }
            // The step reads its start plane: it must hold the sequence's position.
            let p0 = ring.plane();
            assert_eq!(self.content[p0], Some(ring.pos()), "the step starts from a plane holding its position");
            for m in 0..rows {
                if Ring::keeps(rows, m) {
                    self.content[(p0 + 1 + m) % PLANES] = Some(ring.pos() + m + 1);
                }
            }
        }
    }

    fn check(ring: &Ring, dev: &Device) {
        for (p, held) in ring.held.iter().enumerate() {
            if let Some(n) = held {
                assert_eq!(dev.content[p], Some(*n), "plane {p} is said to hold {n}");
                assert!(*n <= ring.pos(), "plane {p} holds {n} past the sequence's {}", ring.pos());
            }
        }
    }

    #[test]
    fn every_plane_the_ring_names_holds_that_position_through_steps_and_rollbacks() {
        // Steps of every size, rollbacks into each, to 0, and refused ones, against a model of
        // what the kernels write.
        let mut ring = Ring::new();
        let mut dev = Device { content: [None; PLANES] };
        dev.content[0] = Some(0);
        let mut seed = 7u64;
        let mut next = |n: usize| {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 33) as usize % n
        };
        for _ in 0..2000 {
            match next(4) {
                0 | 1 => {
                    let rows = if next(5) == 0 { 9 + next(40) } else { 1 + next(PLANES - 1) };
                    dev.step(&ring, rows);
                    ring.zeroed();
                    ring.stepped(rows);
                }
                2 => {
                    let len = next(ring.pos() + 1);
                    let can = ring.restorable(len);
                    assert!(can == len || can == 0, "restorable({len}) = {can}");
                    let before = ring.clone();
                    assert_eq!(ring.truncate(len), can == len || len == 0);
                    if can != len && len != 0 {
                        assert_eq!(ring, before, "a refused truncate changes nothing");
                    }
                }
                _ => {
                    // A verify step of up to 8 rows, then a rollback to each of its rows.
                    let rows = 1 + next(PLANES - 1);
                    let start = ring.pos();
                    dev.step(&ring, rows);
                    ring.zeroed();
                    ring.stepped(rows);
                    let keep = next(rows + 1);
                    assert_eq!(ring.restorable(start + keep), start + keep, "any row of the last verify step");
                    assert!(ring.truncate(start + keep));
                }
            }
            check(&ring, &dev);
        }
    }

    #[test]
    fn a_failed_step_leaves_only_position_zero() {
        let mut ring = Ring::new();
        ring.stepped(3);
        ring.failed();
        assert_eq!(ring.restorable(2), 0);
        assert!(!ring.truncate(2) && !ring.truncate(3));
        assert!(ring.truncate(0));
        assert!(!ring.broken() && ring.zero_pending() && ring.pos() == 0);
    }

    #[test]
    fn a_long_step_keeps_its_last_eight_rows() {
        let mut ring = Ring::new();
        ring.stepped(20);
        // Rows 12..=19 keep their states: positions 13..=20.
        for len in 13..=20 {
            assert_eq!(ring.restorable(len), len, "position {len}");
        }
        assert_eq!(ring.restorable(12), 0);
    }
}
