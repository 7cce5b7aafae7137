//! The routing table: which source rank sends which bytes to which destination rank.

use std::collections::BTreeMap;
use std::fmt::{self, Write as _};

use super::layout::{Block, ModelLayout};
use super::{ReshardError, Side};

/// One transfer of a routing table: a rectangle of `rows` rows of `row_bytes` bytes, read from
/// `src_rank`'s local buffer at `src_offset` (rows `src_stride` bytes apart) and written into
/// `dst_rank`'s at `dst_offset` (rows `dst_stride` bytes apart). A piece that is contiguous on
/// both sides (a single row of the tensor, or rows spanning the full width of both ranks'
/// blocks) is one run: `rows == 1`, `row_bytes` = all of it, both strides equal to
/// `row_bytes`. A column shard moving to a row shard is one strided piece, not a piece per row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Piece {
    /// The tensor's position in the destination layout's list.
    pub tensor: usize,
    /// The sending rank (of the source layout's group).
    pub src_rank: usize,
    /// The receiving rank (of the destination layout's group).
    pub dst_rank: usize,
    /// Byte offset of the first row in the sender's buffer.
    pub src_offset: usize,
    /// Byte offset of the first row in the receiver's buffer.
    pub dst_offset: usize,
    /// Rows (at least 1).
    pub rows: usize,
    /// Bytes per row (at least 1).
    pub row_bytes: usize,
    /// Bytes from one row's start to the next in the sender's buffer.
    pub src_stride: usize,
    /// Bytes from one row's start to the next in the receiver's buffer.
    pub dst_stride: usize,
    /// The elements it moves, in the tensor's global coordinates.
    pub region: Block,
}

impl Piece {
    /// Bytes moved.
    pub fn bytes(&self) -> usize {
        self.rows * self.row_bytes
    }

    /// Whether it is one contiguous run on both sides.
    pub fn is_contiguous(&self) -> bool {
        self.rows == 1
    }
}

/// For each destination rank, the pieces it receives and from whom: computed once from a
/// source and a destination [`ModelLayout`], replayed every sync.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutingTable {
    /// Sorted by (destination rank, tensor, first row, first column, source rank).
    pieces: Vec<Piece>,
    /// `[dst_rank]`: the range of `pieces` it receives.
    by_dst: Vec<(usize, usize)>,
    /// `[src_rank]`: bytes sent.
    sent: Vec<usize>,
    /// `[src_rank]`: pieces sent.
    sent_pieces: Vec<usize>,
}

/// A rectangle of one destination block that a set of source ranks all hold.
#[derive(Debug, Clone, Copy)]
struct Cell {
    /// Position in the destination layout.
    tensor: usize,
    dst: usize,
    region: Block,
}

/// A cell (or part of one) given to a sender; `set` numbers its holders' set ([`SINGLE`]
/// for a cell with one holder).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Assigned {
    dst: usize,
    tensor: usize,
    src: usize,
    set: usize,
    region: Block,
}

/// For each tensor of `dst` (by position), its position in `src`: the two layouts must list
/// the same tensors (by name, in any order) with the same dtype and shape.
pub(super) fn match_tensors(src: &ModelLayout, dst: &ModelLayout) -> Result<Vec<usize>, ReshardError> {
    let mut out = Vec::with_capacity(dst.tensors().len());
    for t in dst.tensors() {
        let Some(si) = src.position(t.name()) else {
            return Err(ReshardError::Missing { tensor: t.name().to_string(), side: Side::Destination });
        };
        let s = &src.tensors()[si];
        if s.shape() != t.shape() {
            return Err(ReshardError::ShapeMismatch { tensor: t.name().to_string(), src: s.shape(), dst: t.shape() });
        }
        if s.dtype() != t.dtype() {
            return Err(ReshardError::DTypeMismatch { tensor: t.name().to_string(), src: s.dtype(), dst: t.dtype() });
        }
        out.push(si);
    }
    if let Some(t) = src.tensors().iter().find(|t| dst.position(t.name()).is_none()) {
        return Err(ReshardError::Missing { tensor: t.name().to_string(), side: Side::Source });
    }
    Ok(out)
}

/// The sorted, deduplicated cut positions of `within` along one axis: its two ends and the
/// ends of every block in `blocks` (already clipped to it).
pub(super) fn cuts(within: (usize, usize), blocks: impl Iterator<Item = (usize, usize)>) -> Vec<usize> {
    let mut c = Vec::new();
    cuts_into(&mut c, within, blocks);
    c
}

/// [`cuts`] into `c` (cleared first), reusing its allocation.
fn cuts_into(c: &mut Vec<usize>, within: (usize, usize), blocks: impl Iterator<Item = (usize, usize)>) {
    c.clear();
    c.extend([within.0, within.1]);
    for (a, b) in blocks {
        c.push(a);
        c.push(b);
    }
    c.sort_unstable();
    c.dedup();
}

/// The cell index range `[i, j)` of `lo..hi` in `cuts` (both are cut positions).
fn span(cuts: &[usize], lo: usize, hi: usize) -> (usize, usize) {
    (cuts.partition_point(|&c| c < lo), cuts.partition_point(|&c| c < hi))
}

/// Checks that every element of source tensor `si` is held by some rank.
fn check_coverage(src: &ModelLayout, si: usize) -> Result<(), ReshardError> {
    let t = &src.tensors()[si];
    let [rows, cols] = t.shape();
    if rows == 0 || cols == 0 {
        return Ok(());
    }
    let blocks: Vec<Block> = src.blocks_of(si).iter().copied().filter(|b| !b.is_empty()).collect();
    let rc = cuts((0, rows), blocks.iter().map(|b| (b.row0, b.row_end())));
    let cc = cuts((0, cols), blocks.iter().map(|b| (b.col0, b.col_end())));
    let (nr, nc) = (rc.len() - 1, cc.len() - 1);
    let mut covered = vec![false; nr * nc];
    for b in &blocks {
        let (r0, r1) = span(&rc, b.row0, b.row_end());
        let (c0, c1) = span(&cc, b.col0, b.col_end());
        for r in r0..r1 {
            covered[r * nc + c0..r * nc + c1].fill(true);
        }
    }
    match covered.iter().position(|c| !c) {
        Some(i) => Err(ReshardError::Uncovered { tensor: t.name().to_string(), row: rc[i / nc], col: cc[i % nc] }),
        None => Ok(()),
    }
}

/// The finest cut of a cell when its holders share it, in bytes: a row, or one element for a
/// cell of one row (cut by columns). A cut keeps every part a rectangle.
fn unit(region: &Block, elem: usize) -> usize {
    if region.rows > 1 {
        region.cols * elem
    } else {
        elem
    }
}

/// Part `lo..hi` (bytes, multiples of the cell's unit) of a cell, as a rectangle.
fn part(region: &Block, elem: usize, lo: usize, hi: usize) -> Block {
    let u = unit(region, elem);
    if region.rows > 1 {
        Block::new(region.row0 + lo / u, (hi - lo) / u, region.col0, region.cols)
    } else {
        Block::new(region.row0, 1, region.col0 + lo / u, (hi - lo) / u)
    }
}

/// Shares one replica group's cells among its `members`: the cells laid end to end (in the
/// order given) are cut into `members.len()` stretches, stretch `i` starting at the first cut
/// point at or after `ceil(i * total / k)`; stretch `i` goes to member `(i + g) % k`.
fn share(cells: &[Cell], members: &[usize], set: usize, elem_of: &dyn Fn(usize) -> usize, out: &mut Vec<Assigned>) {
    let k = members.len();
    let bytes: Vec<usize> = cells.iter().map(|c| c.region.elems() * elem_of(c.tensor)).collect();
    let total: u128 = bytes.iter().map(|&b| b as u128).sum();
    let mut bounds: Vec<u128> = Vec::with_capacity(k + 1);
    bounds.push(0);
    let (mut ci, mut start) = (0usize, 0u128);
    for i in 1..k {
        let ideal = (i as u128 * total).div_ceil(k as u128);
        while ci < cells.len() && start + bytes[ci] as u128 <= ideal {
            start += bytes[ci] as u128;
            ci += 1;
        }
        let b = if ci == cells.len() {
            total
        } else {
            let u = unit(&cells[ci].region, elem_of(cells[ci].tensor)) as u128;
            start + ((ideal - start).div_ceil(u) * u).min(bytes[ci] as u128)
        };
        bounds.push(b);
    }
    bounds.push(total);
    let mut at = 0u128;
    let mut j = 0usize;
    for (c, &len) in cells.iter().zip(&bytes) {
        let end = at + len as u128;
        while j < k && bounds[j + 1] <= at {
            j += 1;
        }
        let mut s = j;
        while s < k && bounds[s] < end {
            let (lo, hi) = (bounds[s].max(at), bounds[s + 1].min(end));
            if lo < hi {
                let region = part(&c.region, elem_of(c.tensor), (lo - at) as usize, (hi - at) as usize);
                out.push(Assigned { dst: c.dst, tensor: c.tensor, src: members[(s + set) % k], set, region });
            }
            s += 1;
        }
        at = end;
    }
}

/// The set of a cell with one holder (every group's ordinal is below it).
const SINGLE: usize = usize::MAX;

/// The positions of `assigned` grouped by (destination, tensor) in that order (a counting
/// sort: one pass, no copy of the entries), each group sorted by (sender, holders' set):
/// what the merge needs, each key's rectangles together (their order does not matter:
/// [`merge`] sorts them).
fn by_destination(assigned: &[Assigned], dsts: usize, tensors: usize) -> Vec<usize> {
    let key = |a: &Assigned| a.dst * tensors + a.tensor;
    let mut start = vec![0usize; dsts * tensors + 1];
    for a in assigned {
        start[key(a) + 1] += 1;
    }
    for k in 1..start.len() {
        start[k] += start[k - 1];
    }
    let mut order = vec![0usize; assigned.len()];
    let mut at = start.clone();
    for (i, a) in assigned.iter().enumerate() {
        let k = key(a);
        order[at[k]] = i;
        at[k] += 1;
    }
    for k in 0..dsts * tensors {
        order[start[k]..start[k + 1]].sort_unstable_by_key(|&i| (assigned[i].src, assigned[i].set));
    }
    order
}

/// Merges rectangles of one (destination, tensor, sender, holders) key where their union is a
/// rectangle, until none can be merged.
fn merge(rects: &mut Vec<Block>) {
    loop {
        let before = rects.len();
        rects.sort_unstable_by_key(|b| (b.row0, b.rows, b.col0));
        rects.dedup_by(|next, prev| {
            let joins = prev.row0 == next.row0 && prev.rows == next.rows && prev.col_end() == next.col0;
            if joins {
                prev.cols += next.cols;
            }
            joins
        });
        rects.sort_unstable_by_key(|b| (b.col0, b.cols, b.row0));
        rects.dedup_by(|next, prev| {
            let joins = prev.col0 == next.col0 && prev.cols == next.cols && prev.row_end() == next.row0;
            if joins {
                prev.rows += next.rows;
            }
            joins
        });
        if rects.len() == before {
            return;
        }
    }
}

impl RoutingTable {
    /// The routing table from `src` to `dst` (the two layouts must list the same tensors, by
    /// name, with the same dtype and shape; every element must be held by a source rank).
    ///
    /// A pure function of its inputs: every rank computes the same table itself, with no
    /// communication, so no decision depends on a hash map's order or on floating point.
    ///
    /// How: each destination block is cut by the row and column boundaries of the source blocks
    /// it meets into a grid of cells; a cell's *holders* are the source ranks whose block
    /// contains it. A cell with one holder is sent by it. Cells with several holders (replicas)
    /// form *replica groups*, one per holder set, across the whole model; a group's cells, laid
    /// end to end in (tensor, destination rank, row, column) order, are cut into one stretch per
    /// holder (cuts at row boundaries, or column boundaries in a one-row cell), and stretch `i`
    /// goes to holder `(i + g) % k` of the group's `k` holders, `g` the group's ordinal. Then
    /// adjacent rectangles with the same sender and holder set are merged while their union
    /// stays a rectangle.
    ///
    /// Balance: in a replica group of `k` holders and `B` bytes, each holder's *fair share* is
    /// `B / k`, and each sends less than one *unit* more or less than it, the unit being the
    /// largest cut step among the group's cells: a row of the cell (in bytes), or one element
    /// for a cell of one row. So a sender's total is its
    /// single-holder bytes plus its fair share of each group it belongs to, within a unit per
    /// group. [`RoutingTable::verify`] checks this.
    pub fn compute(src: &ModelLayout, dst: &ModelLayout) -> Result<RoutingTable, ReshardError> {
        let src_of = match_tensors(src, dst)?;
        for si in 0..src.tensors().len() {
            check_coverage(src, si)?;
        }
        let elem_of = |di: usize| dst.tensors()[di].dtype().size();
        let mut groups: BTreeMap<Vec<usize>, Vec<Cell>> = BTreeMap::new();
        let mut meet: Vec<(usize, Block)> = Vec::new();
        let mut cand: Vec<Vec<usize>> = Vec::new();
        let (mut rc, mut cc) = (Vec::new(), Vec::new());
        // Cells with one holder go straight to `assigned` (most cells: no copy, no map
        // lookup), with the set `SINGLE`; their holder's key still enters `groups` (with no
        // cells), so that every group's ordinal, which its sharing depends on, is the same.
        let mut assigned = Vec::new();
        let mut single = vec![false; src.ranks()];
        for (di, &si) in src_of.iter().enumerate() {
            for d in 0..dst.ranks() {
                let db = dst.block_at(d, di);
                if db.is_empty() {
                    continue;
                }
                meet.clear();
                meet.extend((0..src.ranks()).map(|s| (s, src.block_at(s, si).intersect(&db))).filter(|(_, b)| !b.is_empty()));
                cuts_into(&mut rc, (db.row0, db.row_end()), meet.iter().map(|(_, b)| (b.row0, b.row_end())));
                cuts_into(&mut cc, (db.col0, db.col_end()), meet.iter().map(|(_, b)| (b.col0, b.col_end())));
                let (nr, nc) = (rc.len() - 1, cc.len() - 1);
                cand.iter_mut().for_each(Vec::clear);
                cand.resize_with(cand.len().max(nr * nc), Vec::new);
                for (s, b) in &meet {
                    let (r0, r1) = span(&rc, b.row0, b.row_end());
                    let (c0, c1) = span(&cc, b.col0, b.col_end());
                    for r in r0..r1 {
                        for c in c0..c1 {
                            cand[r * nc + c].push(*s);
                        }
                    }
                }
                for r in 0..nr {
                    for c in 0..nc {
                        let region = Block::new(rc[r], rc[r + 1] - rc[r], cc[c], cc[c + 1] - cc[c]);
                        match cand[r * nc + c].as_slice() {
                            [] => {
                                let tensor = dst.tensors()[di].name().to_string();
                                return Err(ReshardError::Uncovered { tensor, row: region.row0, col: region.col0 });
                            }
                            &[only] => {
                                if !single[only] {
                                    single[only] = true;
                                    groups.insert(vec![only], Vec::new());
                                }
                                assigned.push(Assigned { dst: d, tensor: di, src: only, set: SINGLE, region });
                                continue;
                            }
                            holders => {
                                let cell = Cell { tensor: di, dst: d, region };
                                match groups.get_mut(holders) {
                                    Some(cells) => cells.push(cell),
                                    None => {
                                        groups.insert(holders.to_vec(), vec![cell]);
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        for (set, (members, cells)) in groups.iter().enumerate() {
            if members.len() > 1 {
                share(cells, members, set, &elem_of, &mut assigned);
            }
        }
        drop(groups);
        let order = by_destination(&assigned, dst.ranks(), dst.tensors().len());
        let mut pieces = Vec::with_capacity(assigned.len());
        let mut rects = Vec::new();
        let key = |a: &Assigned| (a.dst, a.tensor, a.src, a.set);
        for same in order.chunk_by(|&x, &y| key(&assigned[x]) == key(&assigned[y])) {
            let a = assigned[same[0]];
            rects.clear();
            rects.extend(same.iter().map(|&x| assigned[x].region));
            merge(&mut rects);
            let si = src_of[a.tensor];
            let elem = elem_of(a.tensor);
            let (sb, db) = (src.block_at(a.src, si), dst.block_at(a.dst, a.tensor));
            for g in &rects {
                let src_offset = src.offset_at(a.src, si) + ((g.row0 - sb.row0) * sb.cols + (g.col0 - sb.col0)) * elem;
                let dst_offset = dst.offset_at(a.dst, a.tensor) + ((g.row0 - db.row0) * db.cols + (g.col0 - db.col0)) * elem;
                let contiguous = g.rows == 1 || (g.cols == sb.cols && g.cols == db.cols);
                let (rows, row_bytes, src_stride, dst_stride) = if contiguous {
                    let n = g.elems() * elem;
                    (1, n, n, n)
                } else {
                    (g.rows, g.cols * elem, sb.cols * elem, db.cols * elem)
                };
                pieces.push(Piece {
                    tensor: a.tensor,
                    src_rank: a.src,
                    dst_rank: a.dst,
                    src_offset,
                    dst_offset,
                    rows,
                    row_bytes,
                    src_stride,
                    dst_stride,
                    region: *g,
                });
            }
        }
        // Already grouped by (destination, tensor): each group sorted alone (the keys are
        // unique, as no two pieces write the same byte, so this is the one sorted order).
        for same in pieces.chunk_by_mut(|a, b| (a.dst_rank, a.tensor) == (b.dst_rank, b.tensor)) {
            same.sort_unstable_by_key(|p| (p.region.row0, p.region.col0, p.src_rank));
        }
        debug_assert!(pieces.is_sorted_by_key(|p| (p.dst_rank, p.tensor, p.region.row0, p.region.col0, p.src_rank)));
        let mut by_dst = vec![(0, 0); dst.ranks()];
        for (d, range) in by_dst.iter_mut().enumerate() {
            *range = (pieces.partition_point(|p| p.dst_rank < d), pieces.partition_point(|p| p.dst_rank <= d));
        }
        let mut sent = vec![0usize; src.ranks()];
        let mut sent_pieces = vec![0usize; src.ranks()];
        for p in &pieces {
            sent[p.src_rank] = sent[p.src_rank].saturating_add(p.bytes());
            sent_pieces[p.src_rank] += 1;
        }
        Ok(RoutingTable { pieces, by_dst, sent, sent_pieces })
    }

    /// The pieces, to break a table on purpose (tests of [`RoutingTable::verify`]).
    #[cfg(test)]
    pub(super) fn pieces_mut(&mut self) -> &mut Vec<Piece> {
        &mut self.pieces
    }

    /// Every piece, sorted by (destination rank, tensor, first row, first column, source rank).
    pub fn pieces(&self) -> &[Piece] {
        &self.pieces
    }

    /// The pieces destination rank `dst_rank` receives (none for a rank out of range).
    pub fn pieces_to(&self, dst_rank: usize) -> &[Piece] {
        self.by_dst.get(dst_rank).map_or(&[], |&(a, b)| &self.pieces[a..b])
    }

    /// The pieces source rank `src_rank` sends, in table order.
    pub fn pieces_from(&self, src_rank: usize) -> impl Iterator<Item = &Piece> + '_ {
        self.pieces.iter().filter(move |p| p.src_rank == src_rank)
    }

    /// Bytes source rank `src_rank` sends (saturating; 0 out of range).
    pub fn bytes_from(&self, src_rank: usize) -> usize {
        self.sent.get(src_rank).copied().unwrap_or(0)
    }

    /// Bytes destination rank `dst_rank` receives (0 out of range).
    pub fn bytes_to(&self, dst_rank: usize) -> usize {
        self.pieces_to(dst_rank).iter().fold(0usize, |a, p| a.saturating_add(p.bytes()))
    }

    /// The number of source ranks (the source layout's group).
    pub fn src_ranks(&self) -> usize {
        self.sent.len()
    }

    /// The number of destination ranks.
    pub fn dst_ranks(&self) -> usize {
        self.by_dst.len()
    }

    /// The table for people: per tensor, each piece (`rank 0 -> rank 2 rows 0..2048 (16 MiB,
    /// contiguous)`), then each sender's and each receiver's totals. `src` and `dst` must be
    /// the layouts the table was computed from (names and shapes come from `dst`).
    pub fn explain(&self, src: &ModelLayout, dst: &ModelLayout) -> String {
        self.explain_as(src, dst, &|r| format!("rank {r}"), &|r| format!("rank {r}"))
    }

    /// [`RoutingTable::explain`] with each rank named by its rank in its group and in the
    /// world (`rank 1 (world 5)`): `src_ranks[r]` and `dst_ranks[r]` are the world ranks of
    /// the groups' ranks, as given to
    /// [`Communicator::weight_sync`](crate::Communicator::weight_sync). A rank past the end of
    /// its list is named by its group rank alone.
    pub fn explain_world(&self, src: &ModelLayout, dst: &ModelLayout, src_ranks: &[usize], dst_ranks: &[usize]) -> String {
        let name = |ranks: &[usize], r: usize| match ranks.get(r) {
            Some(w) => format!("rank {r} (world {w})"),
            None => format!("rank {r}"),
        };
        self.explain_as(src, dst, &|r| name(src_ranks, r), &|r| name(dst_ranks, r))
    }

    fn explain_as(
        &self,
        src: &ModelLayout,
        dst: &ModelLayout,
        src_name: &dyn Fn(usize) -> String,
        dst_name: &dyn Fn(usize) -> String,
    ) -> String {
        let mut out = String::new();
        let mut order: Vec<&Piece> = self.pieces.iter().collect();
        order.sort_by_key(|p| (p.tensor, p.dst_rank, p.region.row0, p.region.col0, p.src_rank));
        for same in order.chunk_by(|a, b| a.tensor == b.tensor) {
            let Some(t) = dst.tensors().get(same[0].tensor) else { continue };
            let [rows, cols] = t.shape();
            let _ = writeln!(out, "{} [{rows} x {cols}] {}:", t.name(), t.dtype());
            for p in same {
                let g = &p.region;
                let _ = write!(out, "  {} -> {} rows {}..{}", src_name(p.src_rank), dst_name(p.dst_rank), g.row0, g.row_end());
                if g.cols != cols {
                    let _ = write!(out, " cols {}..{}", g.col0, g.col_end());
                }
                if p.is_contiguous() {
                    let _ = writeln!(out, " ({}, contiguous)", human(p.bytes()));
                } else {
                    let _ = writeln!(out, " ({}, {} rows of {}, strided)", human(p.bytes()), p.rows, human(p.row_bytes));
                }
            }
        }
        let _ = writeln!(out, "per sender ({} source ranks):", src.ranks());
        for s in 0..self.src_ranks() {
            let _ = writeln!(out, "  {} sends {} in {} pieces", src_name(s), human(self.sent[s]), self.sent_pieces[s]);
        }
        let _ = writeln!(out, "per receiver ({} destination ranks):", dst.ranks());
        for d in 0..self.dst_ranks() {
            let _ = writeln!(out, "  {} receives {} in {} pieces", dst_name(d), human(self.bytes_to(d)), self.pieces_to(d).len());
        }
        out
    }
}

/// A byte count for people: `512 B`, `4 KiB`, `16 MiB`, `1.5 GiB`.
fn human(bytes: usize) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut u = 0;
    while u + 1 < UNITS.len() && bytes >= 1usize << (10 * (u + 1)) {
        u += 1;
    }
    if u == 0 {
        return format!("{bytes} B");
    }
    let whole = bytes >> (10 * u);
    let tenths = ((bytes & ((1usize << (10 * u)) - 1)) * 10) >> (10 * u);
    if tenths == 0 {
        format!("{whole} {}", UNITS[u])
    } else {
        format!("{whole}.{tenths} {}", UNITS[u])
    }
}

/// A summary: pieces, and each sender's and receiver's totals (without the tensors' names,
/// which [`RoutingTable::explain`] takes from the layouts).
impl fmt::Display for RoutingTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "routing table: {} pieces from {} source ranks to {} destination ranks",
            self.pieces.len(),
            self.src_ranks(),
            self.dst_ranks()
        )?;
        for s in 0..self.src_ranks() {
            writeln!(f, "  rank {s} sends {} in {} pieces", human(self.sent[s]), self.sent_pieces[s])?;
        }
        for d in 0..self.dst_ranks() {
            writeln!(f, "  rank {d} receives {} in {} pieces", human(self.bytes_to(d)), self.pieces_to(d).len())?;
        }
        Ok(())
    }
}
