//! Layouts: tensors, placements, blocks, and each rank's local buffer.

use std::collections::BTreeMap;
use std::fmt;

use ferroccl_kernels::DType;

use super::ReshardError;

/// The alignment of each tensor's block in a rank's buffer unless asked otherwise
/// ([`ModelLayout::with_align`]): 64 bytes, a cache line.
pub const DEFAULT_ALIGN: usize = 64;

/// A rectangle of a 2-D tensor, in elements: rows `row0..row0 + rows`, columns
/// `col0..col0 + cols`. A rank stores its block row-major (`cols` elements per row) in its
/// local buffer. A block with no rows or no columns is empty: the rank holds nothing of the
/// tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Block {
    /// First row.
    pub row0: usize,
    /// Number of rows.
    pub rows: usize,
    /// First column.
    pub col0: usize,
    /// Number of columns.
    pub cols: usize,
}

impl Block {
    /// The empty block (a rank that holds nothing).
    pub const EMPTY: Block = Block { row0: 0, rows: 0, col0: 0, cols: 0 };

    /// Rows `row0..row0 + rows`, columns `col0..col0 + cols`.
    pub const fn new(row0: usize, rows: usize, col0: usize, cols: usize) -> Block {
        Block { row0, rows, col0, cols }
    }

    /// Whether the block holds no element.
    pub const fn is_empty(&self) -> bool {
        self.rows == 0 || self.cols == 0
    }

    /// Elements in the block (saturating).
    pub const fn elems(&self) -> usize {
        self.rows.saturating_mul(self.cols)
    }

    /// One past the last row (saturating).
    pub const fn row_end(&self) -> usize {
        self.row0.saturating_add(self.rows)
    }

    /// One past the last column (saturating).
    pub const fn col_end(&self) -> usize {
        self.col0.saturating_add(self.cols)
    }

    /// Whether every element of `other` is in `self` (an empty `other` is in every block).
    pub const fn contains(&self, other: &Block) -> bool {
        other.is_empty()
            || (self.row0 <= other.row0
                && other.row_end() <= self.row_end()
                && self.col0 <= other.col0
                && other.col_end() <= self.col_end())
    }

    /// The elements in both blocks ([`Block::EMPTY`] if none).
    pub fn intersect(&self, other: &Block) -> Block {
        let (r0, r1) = (self.row0.max(other.row0), self.row_end().min(other.row_end()));
        let (c0, c1) = (self.col0.max(other.col0), self.col_end().min(other.col_end()));
        if r0 >= r1 || c0 >= c1 {
            Block::EMPTY
        } else {
            Block::new(r0, r1 - r0, c0, c1 - c0)
        }
    }
}

impl fmt::Display for Block {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_empty() {
            f.write_str("empty")
        } else {
            write!(f, "rows {}..{} cols {}..{}", self.row0, self.row_end(), self.col0, self.col_end())
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Kind {
    Replicated(usize),
    Rows(Vec<usize>),
    Cols(Vec<usize>),
    RowsReplicated(Vec<usize>, usize),
    Blocks(Vec<Block>),
}

/// Which block of a tensor each rank of a group holds (group-local ranks `0..ranks()`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement(Kind);

impl Placement {
    /// Every one of `ranks` ranks holds the whole tensor.
    pub fn replicated(ranks: usize) -> Placement {
        Placement(Kind::Replicated(ranks))
    }

    /// Row shards, one per rank, in rank order: rank `r` holds `sizes[r]` full rows starting
    /// after the rows of ranks `0..r` (uneven sizes and zeros allowed; they must add up to
    /// the tensor's rows).
    pub fn rows(sizes: &[usize]) -> Placement {
        Placement(Kind::Rows(sizes.to_vec()))
    }

    /// Column shards, one per rank, in rank order, as [`Placement::rows`] for columns.
    pub fn cols(sizes: &[usize]) -> Placement {
        Placement(Kind::Cols(sizes.to_vec()))
    }

    /// A 2-D mesh of `sizes.len()` row shards times `replicas` replicas, over
    /// `sizes.len() * replicas` ranks, the shard axis fastest: rank `r` holds row shard
    /// `r % sizes.len()` (of replica `r / sizes.len()`). So ranks `0..shards` are one full
    /// copy, ranks `shards..2 * shards` the next.
    pub fn rows_replicated(sizes: &[usize], replicas: usize) -> Placement {
        Placement(Kind::RowsReplicated(sizes.to_vec(), replicas))
    }

    /// The most general form: rank `r` holds `blocks[r]` (possibly empty; blocks of
    /// different ranks may overlap).
    pub fn blocks(blocks: Vec<Block>) -> Placement {
        Placement(Kind::Blocks(blocks))
    }

    /// The number of ranks the placement is over.
    pub fn ranks(&self) -> usize {
        match &self.0 {
            Kind::Replicated(n) => *n,
            Kind::Rows(s) | Kind::Cols(s) => s.len(),
            Kind::RowsReplicated(s, r) => s.len().saturating_mul(*r),
            Kind::Blocks(b) => b.len(),
        }
    }

    /// Each rank's block for a tensor of `shape`, checked (empty blocks become
    /// [`Block::EMPTY`]).
    fn resolve(&self, tensor: &str, shape: [usize; 2]) -> Result<Vec<Block>, ReshardError> {
        let [rows, cols] = shape;
        let shards = |sizes: &[usize], extent: usize, dim: &'static str| -> Result<Vec<(usize, usize)>, ReshardError> {
            let mut at = 0usize;
            let mut out = Vec::with_capacity(sizes.len());
            for &s in sizes {
                out.push((at, s));
                at = at.saturating_add(s);
            }
            if at != extent {
                return Err(ReshardError::ShardSizes { tensor: tensor.to_string(), dim, sum: at, extent });
            }
            Ok(out)
        };
        let blocks = match &self.0 {
            Kind::Replicated(n) => vec![Block::new(0, rows, 0, cols); *n],
            Kind::Rows(sizes) => shards(sizes, rows, "rows")?.into_iter().map(|(r0, n)| Block::new(r0, n, 0, cols)).collect(),
            Kind::Cols(sizes) => shards(sizes, cols, "cols")?.into_iter().map(|(c0, n)| Block::new(0, rows, c0, n)).collect(),
            Kind::RowsReplicated(sizes, replicas) => {
                let one: Vec<Block> = shards(sizes, rows, "rows")?.into_iter().map(|(r0, n)| Block::new(r0, n, 0, cols)).collect();
                let mut all = Vec::with_capacity(one.len().saturating_mul(*replicas));
                for _ in 0..*replicas {
                    all.extend_from_slice(&one);
                }
                all
            }
            Kind::Blocks(b) => b.clone(),
        };
        let whole = Block::new(0, rows, 0, cols);
        blocks
            .into_iter()
            .enumerate()
            .map(|(rank, b)| {
                if b.is_empty() {
                    Ok(Block::EMPTY)
                } else if b.row0.checked_add(b.rows).is_none_or(|e| e > rows) || b.col0.checked_add(b.cols).is_none_or(|e| e > cols) {
                    Err(ReshardError::BlockOutside { tensor: tensor.to_string(), rank, block: b, shape })
                } else {
                    debug_assert!(whole.contains(&b));
                    Ok(b)
                }
            })
            .collect()
    }
}

/// One tensor of a model and its placement: a 2-D row-major tensor `[rows, cols]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorLayout {
    name: String,
    dtype: DType,
    shape: [usize; 2],
    placement: Placement,
}

impl TensorLayout {
    /// A 2-D tensor of `shape = [rows, cols]`, row-major.
    pub fn new(name: impl Into<String>, dtype: DType, shape: [usize; 2], placement: Placement) -> TensorLayout {
        TensorLayout { name: name.into(), dtype, shape, placement }
    }

    /// A 1-D tensor of `len` elements, as the column `[len, 1]`: its one dimension is the row
    /// dimension, so [`Placement::rows`] shards it (and [`Placement::cols`] can only be
    /// `cols(&[1])` on one rank). For the row `[1, len]` use [`TensorLayout::new`].
    pub fn vector(name: impl Into<String>, dtype: DType, len: usize, placement: Placement) -> TensorLayout {
        TensorLayout::new(name, dtype, [len, 1], placement)
    }

    /// The tensor's name (unique within a layout).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Its shape, `[rows, cols]`.
    pub fn shape(&self) -> [usize; 2] {
        self.shape
    }

    /// Its placement.
    pub fn placement(&self) -> &Placement {
        &self.placement
    }
}

/// A model's layout over a group of ranks: the tensors, each rank's block of each, and each
/// rank's local buffer (the tensors' blocks one after another in list order, each row-major
/// and starting at a multiple of the alignment, so a replay can register one window per rank).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelLayout {
    ranks: usize,
    align: usize,
    tensors: Vec<TensorLayout>,
    /// `[tensor][rank]`.
    blocks: Vec<Vec<Block>>,
    /// `[rank][tensor]`: byte offsets in the rank's buffer.
    offsets: Vec<Vec<usize>>,
    /// `[rank]`: buffer lengths in bytes.
    lens: Vec<usize>,
    /// Name -> position in `tensors`.
    index: BTreeMap<String, usize>,
}

impl ModelLayout {
    /// A layout over `ranks` ranks, blocks aligned to [`DEFAULT_ALIGN`] bytes. Errors: no
    /// ranks, a name listed twice, a placement over another number of ranks, shard sizes
    /// that do not add up, a block outside its tensor, a buffer past `usize`.
    pub fn new(ranks: usize, tensors: Vec<TensorLayout>) -> Result<ModelLayout, ReshardError> {
        ModelLayout::with_align(ranks, tensors, DEFAULT_ALIGN)
    }

    /// As [`ModelLayout::new`], each block starting at a multiple of `align` bytes (a power of
    /// two; 1 packs the blocks with no gaps).
    pub fn with_align(ranks: usize, tensors: Vec<TensorLayout>, align: usize) -> Result<ModelLayout, ReshardError> {
        if ranks == 0 {
            return Err(ReshardError::NoRanks { tensors: tensors.len() });
        }
        if !align.is_power_of_two() {
            return Err(ReshardError::BadAlign { align });
        }
        let mut index = BTreeMap::new();
        let mut blocks = Vec::with_capacity(tensors.len());
        for (i, t) in tensors.iter().enumerate() {
            if let Some(&first) = index.get(&t.name) {
                return Err(ReshardError::DuplicateTensor { tensor: t.name.clone(), first, second: i });
            }
            index.insert(t.name.clone(), i);
            let placed = t.placement.ranks();
            if placed != ranks {
                return Err(ReshardError::RankCount { tensor: t.name.clone(), placed, ranks });
            }
            blocks.push(t.placement.resolve(&t.name, t.shape)?);
        }
        let mut offsets = vec![Vec::with_capacity(tensors.len()); ranks];
        let mut lens = vec![0usize; ranks];
        for (rank, (offs, len)) in offsets.iter_mut().zip(lens.iter_mut()).enumerate() {
            let mut at = 0usize;
            for (t, b) in tensors.iter().zip(&blocks) {
                let too_large = || ReshardError::TooLarge { tensor: t.name.clone(), rank };
                let start = at.checked_next_multiple_of(align).ok_or_else(too_large)?;
                let bytes = b[rank].rows.checked_mul(b[rank].cols).and_then(|e| e.checked_mul(t.dtype.size())).ok_or_else(too_large)?;
                offs.push(start);
                at = start.checked_add(bytes).ok_or_else(too_large)?;
            }
            *len = at;
        }
        Ok(ModelLayout { ranks, align, tensors, blocks, offsets, lens, index })
    }

    /// The number of ranks.
    pub fn ranks(&self) -> usize {
        self.ranks
    }

    /// The alignment of each block in a rank's buffer, in bytes.
    pub fn align(&self) -> usize {
        self.align
    }

    /// The tensors, in buffer order.
    pub fn tensors(&self) -> &[TensorLayout] {
        &self.tensors
    }

    /// The position of the tensor called `name`, if any.
    pub fn position(&self, name: &str) -> Option<usize> {
        self.index.get(name).copied()
    }

    /// The block rank `rank` holds of tensor `tensor` (a position), `None` if either is out
    /// of range.
    pub fn block(&self, rank: usize, tensor: usize) -> Option<Block> {
        self.blocks.get(tensor)?.get(rank).copied()
    }

    /// Where tensor `tensor`'s block starts in rank `rank`'s buffer, in bytes.
    pub fn offset(&self, rank: usize, tensor: usize) -> Option<usize> {
        self.offsets.get(rank)?.get(tensor).copied()
    }

    /// The length of rank `rank`'s buffer in bytes (the end of its last block).
    pub fn buffer_len(&self, rank: usize) -> Option<usize> {
        self.lens.get(rank).copied()
    }

    /// Rank `rank`'s block of tensor `tensor`, without bounds checks (callers in this module
    /// check ranks and positions first).
    pub(super) fn block_at(&self, rank: usize, tensor: usize) -> Block {
        self.blocks[tensor][rank]
    }

    /// As [`ModelLayout::offset`], unchecked (see [`ModelLayout::block_at`]).
    pub(super) fn offset_at(&self, rank: usize, tensor: usize) -> usize {
        self.offsets[rank][tensor]
    }

    /// Every rank's block of tensor `tensor`.
    pub(super) fn blocks_of(&self, tensor: usize) -> &[Block] {
        &self.blocks[tensor]
    }
}
