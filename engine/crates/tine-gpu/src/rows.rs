//! The host-side tables of a batched step (issue 50), built without a GPU so CI tests them:
//! the row → sequence table the kernels read ([`SeqRow`], one a row, `StepParams::seq_rows`),
//! the rows' token ids, a recurrent family's entry table (each entry's first row, rows and start
//! plane) and the index of an entry's cache pointers in a layer's `kv_slots` / `ent_planes`
//! table. `crate::batch` uploads what [`step_tables`] builds.
//!
//! Invariants (each has a test): an entry's rows are consecutive, in entry order, at its
//! positions `pos..pos + len`; a step of more than 8 rows is padded to a multiple of 8 (or to
//! `pad_to`) with copies of the last row marked inert, which no entry holds; an entry's row
//! opts out of the banned ids unless it asks for them; the entry table has a row per padded row,
//! the rows past the entries empty; every (layer, entry, K or V) has its own table slot.

/// Rows a step takes of the graph's row-count (the kernels' 8-row GEMV groups).
const GROUP: usize = 8;

/// Row `m` of a batched step (`StepParams::seq_rows`; decode.cu's `SeqRow`, 32 bytes): its
/// position, its sequence's entry (the index of its caches in each layer's `kv_slots` table, or
/// its slot of a pooled cache), the position of its sequence's first row in the step, the keys
/// its attention reads (`kv_end` as `StepParams::kv_end`, per row; 0: up to its position),
/// whether the step's banned ids skip it, and whether it is a padding row.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SeqRow {
    pub pos: i32,
    pub slot: i32,
    pub first: i32,
    pub kv_end: i32,
    /// 1: the step's banned ids do not apply to this row (its request does not ignore the end
    /// of generation while another in the step does).
    pub no_ban: i32,
    /// 1: a padding row (a copy of another row): `qk_norm_rope_kv` writes no K/V for it, no
    /// recurrent entry holds it, and nobody reads its results.
    pub inert: i32,
    pub pad: [i32; 2],
}

const _: () = assert!(std::mem::size_of::<SeqRow>() == 32);

/// The padded row count of a step of `rows` rows: itself up to 8, else the next multiple of 8.
pub fn padded_rows(rows: usize) -> usize {
    if rows <= GROUP {
        rows
    } else {
        rows.div_ceil(GROUP) * GROUP
    }
}

/// One entry of a step: its sequence's length (its rows go to `pos..pos + tokens.len()`),
/// whether its draws pass over the banned ids, and the plane its recurrent state starts from.
#[derive(Debug, Clone, Copy)]
pub struct EntryRows<'a> {
    pub pos: usize,
    pub tokens: &'a [u32],
    pub ban: bool,
    pub plane: usize,
}

/// What [`step_tables`] builds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepTables {
    /// The entries' rows.
    pub rows: usize,
    /// The rows the step runs (the graph's), `table.len()`.
    pub padded: usize,
    pub table: Vec<SeqRow>,
    pub ids: Vec<i32>,
    /// `[padded][3]`: entry `e`'s first row, rows and start plane; zeros past the entries.
    pub ent: Vec<i32>,
}

/// The tables of a step over `entries` (at least one row in all), padded to at least `pad_to`
/// rows.
pub fn step_tables(entries: &[EntryRows<'_>], pad_to: usize) -> StepTables {
    let rows: usize = entries.iter().map(|e| e.tokens.len()).sum();
    let padded = padded_rows(rows.max(pad_to));
    let mut table = Vec::with_capacity(padded);
    let mut ids = Vec::with_capacity(padded);
    let mut ent = vec![0i32; padded * 3];
    for (e, entry) in entries.iter().enumerate() {
        ent[e * 3..e * 3 + 3].copy_from_slice(&[table.len() as i32, entry.tokens.len() as i32, entry.plane as i32]);
        for (j, &t) in entry.tokens.iter().enumerate() {
            table.push(SeqRow { pos: (entry.pos + j) as i32, slot: e as i32, first: entry.pos as i32, no_ban: (!entry.ban) as i32, ..Default::default() });
            ids.push(t as i32);
        }
    }
    if let (Some(&last), Some(&id)) = (table.last(), ids.last()) {
        table.resize(padded, SeqRow { inert: 1, ..last });
        ids.resize(padded, id);
    }
    StepTables { rows, padded, table, ids, ent }
}

/// Where entry `entry`'s K (`which` 0) or V (1) cache pointer, or its conv windows (0) or
/// delta-rule states (1), sit in the `kv_slots` / `ent_planes` table of a step of `padded`
/// rows: `[layer][padded][2]`, each layer's table at `layer * padded * 2` (what the launch of
/// that layer is given).
pub fn slot_index(layer: usize, padded: usize, entry: usize, which: usize) -> usize {
    (layer * padded + entry) * 2 + which
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(pos: usize, tokens: &[u32], ban: bool, plane: usize) -> EntryRows<'_> {
        EntryRows { pos, tokens, ban, plane }
    }

    #[test]
    fn an_entry_s_rows_are_consecutive_at_its_positions_and_name_its_entry() {
        let (a, b, c) = ([7u32], [8u32, 9, 10], [11u32, 12]);
        let t = step_tables(&[entry(5, &a, false, 2), entry(37, &b, true, 0), entry(0, &c, false, 8)], 0);
        assert_eq!((t.rows, t.padded), (6, 6), "up to 8 rows: no padding");
        let got: Vec<(i32, i32, i32, i32, i32)> = t.table.iter().map(|r| (r.pos, r.slot, r.first, r.no_ban, r.inert)).collect();
        assert_eq!(got, vec![(5, 0, 5, 1, 0), (37, 1, 37, 0, 0), (38, 1, 37, 0, 0), (39, 1, 37, 0, 0), (0, 2, 0, 1, 0), (1, 2, 0, 1, 0)]);
        assert_eq!(t.ids, vec![7, 8, 9, 10, 11, 12]);
        assert_eq!(t.ent, vec![0, 1, 2, 1, 3, 0, 4, 2, 8, 0, 0, 0, 0, 0, 0, 0, 0, 0], "an entry's first row, rows and plane; then empty entries");
        assert!(t.table.iter().all(|r| r.kv_end == 0), "a batched row reads its keys up to its position");
    }

    #[test]
    fn a_step_past_8_rows_is_padded_to_a_multiple_of_8_with_inert_copies_no_entry_holds() {
        let toks: Vec<[u32; 1]> = (0..10).map(|i| [100 + i]).collect();
        let entries: Vec<EntryRows> = toks.iter().enumerate().map(|(i, t)| entry(3 * i, t, i % 2 == 0, i % 9)).collect();
        let t = step_tables(&entries, 0);
        assert_eq!((t.rows, t.padded, t.table.len(), t.ids.len()), (10, 16, 16, 16));
        let last = t.table[9];
        assert_eq!(last.inert, 0);
        for r in &t.table[10..] {
            assert_eq!(*r, SeqRow { inert: 1, ..last }, "padding: the last row, inert");
        }
        assert!(t.ids[10..].iter().all(|&i| i == 109));
        // The entry table holds the 10 entries' rows and nothing of the padding.
        let held: i32 = t.ent.chunks(3).map(|e| e[1]).sum();
        assert_eq!(held, 10);
        assert!(t.ent[30..].iter().all(|&v| v == 0));
        assert_eq!(padded_rows(8), 8);
        assert_eq!(padded_rows(9), 16);
        assert_eq!(padded_rows(256), 256);
    }

    #[test]
    fn a_warm_up_step_pads_one_row_to_the_graph_s_rows() {
        let one = [0u32];
        for (pad_to, padded) in [(1, 1), (5, 5), (8, 8), (16, 16), (24, 24), (20, 24)] {
            let t = step_tables(&[entry(0, &one, false, 0)], pad_to);
            assert_eq!((t.rows, t.padded), (1, padded), "pad_to {pad_to}");
            assert_eq!(t.table.iter().filter(|r| r.inert == 0).count(), 1);
            assert_eq!(&t.ent[..3], &[0, 1, 0]);
        }
        // pad_to never shrinks a step.
        let many = [1u32; 12];
        assert_eq!(step_tables(&[entry(0, &many, false, 0)], 4).padded, 16);
    }

    #[test]
    fn every_layer_entry_and_pointer_has_its_own_table_slot() {
        for padded in [1usize, 6, 16, 256] {
            let layers = 5;
            let mut seen = vec![false; layers * padded * 2];
            for l in 0..layers {
                for e in 0..padded {
                    for which in 0..2 {
                        let i = slot_index(l, padded, e, which);
                        assert!(!std::mem::replace(&mut seen[i], true), "slot {i} twice");
                        // A layer's launch reads its table from layer * padded * 2 on.
                        assert_eq!(i - l * padded * 2, 2 * e + which);
                    }
                }
            }
            assert!(seen.iter().all(|&s| s));
        }
    }
}
