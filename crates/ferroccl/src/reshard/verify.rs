//! Replaying a routing table in memory: coverage, sources, bounds and balance, byte by byte.

use std::collections::BTreeMap;

use super::layout::{Block, ModelLayout};
use super::route::{cuts, match_tensors, RoutingTable};

/// The cell grid of one (destination rank, tensor): the key, the row cuts, the column cuts.
type Grid = ((usize, usize), Vec<usize>, Vec<usize>);

/// What a byte of a rank's buffer holds: (global row, global column, byte of the element) of
/// tensor `tensor` (a position in `layout`), or `None` if the byte is not in that tensor's
/// block on that rank (padding, another tensor, past the end).
fn locate(layout: &ModelLayout, rank: usize, tensor: usize, at: usize) -> Option<(usize, usize, usize)> {
    let b = layout.block_at(rank, tensor);
    let elem = layout.tensors()[tensor].dtype().size();
    let local = at.checked_sub(layout.offset_at(rank, tensor))?;
    let (e, byte) = (local / elem, local % elem);
    if b.is_empty() || e >= b.elems() {
        return None;
    }
    Some((b.row0 + e / b.cols, b.col0 + e % b.cols, byte))
}

/// The last byte a piece touches on one side, plus one: `offset + (rows - 1) * stride +
/// row_bytes`, `None` on overflow.
fn end(offset: usize, rows: usize, stride: usize, row_bytes: usize) -> Option<usize> {
    rows.checked_sub(1)?.checked_mul(stride)?.checked_add(offset)?.checked_add(row_bytes)
}

impl RoutingTable {
    /// Checks this table against the layouts it is meant for, by replaying it in memory: each
    /// piece's every byte is read from a position of the sender's buffer that holds (tensor,
    /// global row, global column, byte) and written where the receiver's buffer holds the same
    /// one; every byte of every destination block is written exactly once; every piece is
    /// non-empty and within both buffers (offsets and strides); its `region` is what it moves;
    /// and each replica group is shared within the balance rule of [`RoutingTable::compute`].
    /// Costs a pass over every byte moved and a counter per destination byte of one tensor at a
    /// time. The error says which tensor, rank and piece is wrong.
    pub fn verify(&self, src: &ModelLayout, dst: &ModelLayout) -> Result<(), String> {
        let src_of = match_tensors(src, dst).map_err(|e| e.to_string())?;
        if self.src_ranks() != src.ranks() || self.dst_ranks() != dst.ranks() {
            return Err(format!(
                "the table is from {} to {} ranks, the layouts from {} to {}",
                self.src_ranks(),
                self.dst_ranks(),
                src.ranks(),
                dst.ranks()
            ));
        }
        let mut total = vec![0usize; src.ranks()];
        for p in self.pieces() {
            let name = dst.tensors().get(p.tensor).map_or("?", |t| t.name());
            let say = |what: &str| format!("tensor `{name}`: piece rank {} -> rank {} ({}): {what}", p.src_rank, p.dst_rank, p.region);
            if p.tensor >= src_of.len() || p.src_rank >= src.ranks() || p.dst_rank >= dst.ranks() {
                return Err(say("names a tensor or rank out of range"));
            }
            if p.rows == 0 || p.row_bytes == 0 {
                return Err(say("is empty"));
            }
            if p.rows > 1 && (p.src_stride < p.row_bytes || p.dst_stride < p.row_bytes) {
                return Err(say("has rows that overlap (stride below the row)"));
            }
            let sl = src.buffer_len(p.src_rank).unwrap_or(0);
            let dl = dst.buffer_len(p.dst_rank).unwrap_or(0);
            if end(p.src_offset, p.rows, p.src_stride, p.row_bytes).is_none_or(|e| e > sl) {
                return Err(say(&format!("reads past the sender's buffer ({sl} bytes)")));
            }
            if end(p.dst_offset, p.rows, p.dst_stride, p.row_bytes).is_none_or(|e| e > dl) {
                return Err(say(&format!("writes past the receiver's buffer ({dl} bytes)")));
            }
            let elem = dst.tensors()[p.tensor].dtype().size();
            if p.region.is_empty() || p.region.elems().checked_mul(elem) != Some(p.bytes()) {
                return Err(say(&format!("moves {} bytes, not its region's", p.bytes())));
            }
            total[p.src_rank] = total[p.src_rank].saturating_add(p.bytes());
        }
        for (s, &t) in total.iter().enumerate() {
            if t != self.bytes_from(s) {
                return Err(format!("rank {s} sends {t} bytes in its pieces, the table says {}", self.bytes_from(s)));
            }
        }
        // Byte-exact replay, one (tensor, destination rank) at a time.
        let mut count: Vec<u8> = Vec::new();
        for (di, &si) in src_of.iter().enumerate() {
            let name = dst.tensors()[di].name();
            for d in 0..dst.ranks() {
                let db = dst.block_at(d, di);
                let elem = dst.tensors()[di].dtype().size();
                count.clear();
                count.resize(db.elems() * elem, 0);
                let base = dst.offset_at(d, di);
                let mine = self.pieces_to(d);
                let (a, b) = (mine.partition_point(|p| p.tensor < di), mine.partition_point(|p| p.tensor <= di));
                for p in &mine[a..b] {
                    for r in 0..p.rows {
                        for b in 0..p.row_bytes {
                            let (sp, dp) = (p.src_offset + r * p.src_stride + b, p.dst_offset + r * p.dst_stride + b);
                            let from = locate(src, p.src_rank, si, sp);
                            let to = locate(dst, d, di, dp);
                            let Some(to @ (row, col, _)) = to else {
                                return Err(format!(
                                    "tensor `{name}`: piece rank {} -> rank {d} writes byte {dp} of rank {d}'s buffer, outside its block",
                                    p.src_rank
                                ));
                            };
                            if from != Some(to) {
                                return Err(format!(
                                    "tensor `{name}`: piece rank {} -> rank {d} writes element (row {row}, col {col}) byte {} from rank {}'s byte {sp}, which holds {}",
                                    p.src_rank,
                                    to.2,
                                    p.src_rank,
                                    from.map_or("no byte of this tensor".to_string(), |(r, c, x)| format!("(row {r}, col {c}) byte {x}"))
                                ));
                            }
                            if !p.region.contains(&Block::new(row, 1, col, 1)) {
                                return Err(format!(
                                    "tensor `{name}`: piece rank {} -> rank {d} moves element (row {row}, col {col}), outside its region {}",
                                    p.src_rank, p.region
                                ));
                            }
                            let c = &mut count[dp - base];
                            *c = c.saturating_add(1);
                        }
                    }
                }
                if let Some(i) = count.iter().position(|&c| c != 1) {
                    let e = i / elem;
                    let (row, col) = (db.row0 + e / db.cols, db.col0 + e % db.cols);
                    return Err(format!(
                        "tensor `{name}`: rank {d}'s element (row {row}, col {col}) is written {} times, not once",
                        count[i]
                    ));
                }
            }
        }
        self.check_balance(src, &src_of, dst)
    }

    /// The balance rule of [`RoutingTable::compute`], per replica group (pieces whose region
    /// is held by the same set of two or more source ranks), the unit found from the cells the
    /// group's pieces touch (the grid `compute` cuts each destination block into).
    pub(super) fn check_balance(&self, src: &ModelLayout, src_of: &[usize], dst: &ModelLayout) -> Result<(), String> {
        // holders -> (bytes, unit, bytes per holder)
        let mut groups: BTreeMap<Vec<usize>, (u128, u128, BTreeMap<usize, u128>)> = BTreeMap::new();
        // The cell grid of the last (destination rank, tensor) seen (pieces come sorted by it).
        let mut grid: Option<Grid> = None;
        for p in self.pieces() {
            let si = src_of[p.tensor];
            let holders: Vec<usize> = (0..src.ranks()).filter(|&s| src.block_at(s, si).contains(&p.region)).collect();
            if holders.len() < 2 {
                continue;
            }
            let key = (p.dst_rank, p.tensor);
            if grid.as_ref().is_none_or(|g| g.0 != key) {
                let db = dst.block_at(p.dst_rank, p.tensor);
                let meet: Vec<Block> = (0..src.ranks()).map(|s| src.block_at(s, si).intersect(&db)).filter(|b| !b.is_empty()).collect();
                let rc = cuts((db.row0, db.row_end()), meet.iter().map(|b| (b.row0, b.row_end())));
                let cc = cuts((db.col0, db.col_end()), meet.iter().map(|b| (b.col0, b.col_end())));
                grid = Some((key, rc, cc));
            }
            let (_, rc, cc) = grid.as_ref().expect("set above");
            let elem = dst.tensors()[p.tensor].dtype().size() as u128;
            // The unit of the cells the piece touches: a row of a cell, one element in a one-row cell.
            let g = &p.region;
            let multi_row = rc.windows(2).any(|w| w[0] < g.row_end() && g.row0 < w[1] && w[1] - w[0] > 1);
            let widest = cc.windows(2).filter(|w| w[0] < g.col_end() && g.col0 < w[1]).map(|w| w[1] - w[0]).max().unwrap_or(1);
            let unit = if multi_row { widest as u128 * elem } else { elem };
            let g = groups.entry(holders).or_default();
            g.0 += p.bytes() as u128;
            g.1 = g.1.max(unit);
            *g.2.entry(p.src_rank).or_default() += p.bytes() as u128;
        }
        for (holders, (bytes, unit, by)) in &groups {
            let k = holders.len() as u128;
            for &h in holders {
                let sent = by.get(&h).copied().unwrap_or(0);
                // |sent - bytes / k| < unit, in integers.
                if (sent * k).abs_diff(*bytes) >= unit * k {
                    return Err(format!(
                        "replica group {holders:?} ({bytes} bytes, unit {unit}): rank {h} sends {sent}, its fair share is {bytes}/{k}"
                    ));
                }
            }
        }
        Ok(())
    }
}

/// Cheap invariants for big tables (no byte replay): every piece lies in both ranks' blocks,
/// and the pieces of each (tensor, destination rank) add up to its block.
#[cfg(test)]
pub(super) fn coverage_counts(table: &RoutingTable, src: &ModelLayout, dst: &ModelLayout) -> Result<(), String> {
    let src_of = match_tensors(src, dst).map_err(|e| e.to_string())?;
    let mut got: BTreeMap<(usize, usize), usize> = BTreeMap::new();
    for p in table.pieces() {
        let (sb, db) = (src.block_at(p.src_rank, src_of[p.tensor]), dst.block_at(p.dst_rank, p.tensor));
        if !sb.contains(&p.region) || !db.contains(&p.region) {
            return Err(format!("piece {p:?} is outside a block"));
        }
        *got.entry((p.tensor, p.dst_rank)).or_default() += p.region.elems();
    }
    for di in 0..dst.tensors().len() {
        for d in 0..dst.ranks() {
            let want = dst.block_at(d, di).elems();
            if got.get(&(di, d)).copied().unwrap_or(0) != want {
                return Err(format!("tensor {di} rank {d}: pieces cover {:?} elements, the block {want}", got.get(&(di, d))));
            }
        }
    }
    Ok(())
}
