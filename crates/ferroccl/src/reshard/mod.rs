//! M->N resharding of a model's weights: the routing table, pure data (issue 13).
//!
//! In asynchronous RL, M trainer ranks hold a model sharded one way and N inference ranks
//! need it sharded another way. A [`RoutingTable`] is computed once from the two
//! [`ModelLayout`]s and says, for each destination rank, which source rank sends which byte
//! ranges of its local buffer to which byte ranges of the destination's; a later step replays
//! it every sync over one-sided transfer plans ([`Communicator::weight_sync`](crate::Communicator::weight_sync),
//! in [`crate::weights`]; see `docs/reshard.md`).
//!
//! This module does no I/O and knows nothing of the communicator: it stands on the lowest
//! floor of the layer table and imports only the kernels' [`DType`].
//!
//! * Layouts: a [`TensorLayout`] is a 2-D row-major tensor (`name`, [`DType`], `[rows, cols]`)
//!   with a [`Placement`] saying which [`Block`] each rank holds; a [`ModelLayout`] is a group of
//!   ranks and a list of tensors, and gives each rank's local buffer: the tensors one after
//!   another in list order, each its block row-major, each starting at a multiple of the
//!   layout's alignment ([`ModelLayout::offset`], [`ModelLayout::buffer_len`]).
//! * The table: [`RoutingTable::compute`] is a pure, deterministic function of the two
//!   layouts, so every rank computes the same table itself, with no communication.
//!   [`Piece`]s are rectangles of bytes (`rows` rows of `row_bytes`, with a stride on each
//!   side); a piece that is contiguous on both sides is one run (`rows == 1`).
//! * Replicas share the load: bytes held by several source ranks are split among them so that
//!   each sends its fair share within one row (the rule: [`RoutingTable::compute`]).
//! * [`RoutingTable::verify`] replays a table in memory, byte by byte, and checks coverage,
//!   sources, bounds and balance.
//! * [`ModelLayout::fingerprint`] is a deterministic 64-bit hash of a layout, which ranks
//!   compare to check that they were given the same one.
//!
//! ```
//! use ferroccl::reshard::{ModelLayout, Placement, RoutingTable, TensorLayout};
//! use ferroccl::DType;
//!
//! // 2 trainer ranks hold a 4096 x 4096 bf16 weight as row shards; 4 inference ranks want
//! // column shards.
//! let w = |p| TensorLayout::new("layer0.weight", DType::Bf16, [4096, 4096], p);
//! let src = ModelLayout::new(2, vec![w(Placement::rows(&[2048, 2048]))])?;
//! let dst = ModelLayout::new(4, vec![w(Placement::cols(&[1024; 4]))])?;
//! let table = RoutingTable::compute(&src, &dst)?;
//! assert_eq!(table.pieces_to(3).len(), 2); // one strided piece from each trainer
//! assert_eq!(table.bytes_from(0), 4096 * 4096); // half the weight's 32 MiB
//! table.verify(&src, &dst).unwrap();
//! println!("{}", table.explain(&src, &dst));
//! # Ok::<(), ferroccl::reshard::ReshardError>(())
//! ```

mod fingerprint;
mod layout;
mod route;
#[cfg(test)]
mod tests;
mod verify;

use std::fmt;

use ferroccl_kernels::DType;

pub(crate) use fingerprint::Fingerprint;
pub use layout::{Block, ModelLayout, Placement, TensorLayout, DEFAULT_ALIGN};
pub use route::{Piece, RoutingTable};

/// Which of the two layouts of a resharding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Side {
    /// The layout the bytes come from (the trainers').
    Source,
    /// The layout the bytes go to (the inference ranks').
    Destination,
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Side::Source => "source",
            Side::Destination => "destination",
        })
    }
}

/// Why a layout or a routing table could not be built. Every variant names the tensor (and
/// the rank, where one is at fault); nothing here panics on user input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ReshardError {
    /// A layout over zero ranks.
    #[error("a model layout needs at least one rank ({tensors} tensors given)")]
    NoRanks {
        /// How many tensors the layout listed.
        tensors: usize,
    },
    /// The buffer alignment is not a power of two.
    #[error("buffer alignment {align} is not a power of two")]
    BadAlign {
        /// The alignment asked for.
        align: usize,
    },
    /// Two tensors of one layout have the same name.
    #[error("tensor `{tensor}` is listed twice in one layout (positions {first} and {second})")]
    DuplicateTensor {
        /// The name.
        tensor: String,
        /// Its first position in the list.
        first: usize,
        /// Its second position.
        second: usize,
    },
    /// A placement is over a different number of ranks than its layout.
    #[error("tensor `{tensor}`: its placement is over {placed} ranks, the layout has {ranks}")]
    RankCount {
        /// The tensor.
        tensor: String,
        /// Ranks the placement names.
        placed: usize,
        /// Ranks of the layout.
        ranks: usize,
    },
    /// Row or column shard sizes do not add up to the tensor's extent.
    #[error("tensor `{tensor}`: its {dim} shards add up to {sum} {dim}, the tensor has {extent}")]
    ShardSizes {
        /// The tensor.
        tensor: String,
        /// `"rows"` or `"cols"`.
        dim: &'static str,
        /// The sum of the sizes given (saturating).
        sum: usize,
        /// The tensor's extent in that dimension.
        extent: usize,
    },
    /// A rank's block reaches outside the tensor's shape.
    #[error("tensor `{tensor}`: rank {rank}'s block ({block}) lies outside its shape [{} x {}]", shape[0], shape[1])]
    BlockOutside {
        /// The tensor.
        tensor: String,
        /// The rank holding the block.
        rank: usize,
        /// The block.
        block: Block,
        /// The tensor's shape, `[rows, cols]`.
        shape: [usize; 2],
    },
    /// A size or offset does not fit in `usize`.
    #[error("tensor `{tensor}`: rank {rank}'s buffer would be larger than the address space")]
    TooLarge {
        /// The tensor.
        tensor: String,
        /// The rank whose buffer overflows.
        rank: usize,
    },
    /// An element of a tensor is held by no source rank.
    #[error("tensor `{tensor}`: element (row {row}, col {col}) is held by no source rank")]
    Uncovered {
        /// The tensor.
        tensor: String,
        /// The element's row.
        row: usize,
        /// The element's column.
        col: usize,
    },
    /// A tensor is in one layout only.
    #[error("tensor `{tensor}` is in the {side} layout only")]
    Missing {
        /// The tensor.
        tensor: String,
        /// The layout that lists it.
        side: Side,
    },
    /// A tensor's shape differs between the layouts.
    #[error("tensor `{tensor}`: shape [{} x {}] in the source layout, [{} x {}] in the destination", src[0], src[1], dst[0], dst[1])]
    ShapeMismatch {
        /// The tensor.
        tensor: String,
        /// Its shape in the source layout.
        src: [usize; 2],
        /// Its shape in the destination layout.
        dst: [usize; 2],
    },
    /// A tensor's element type differs between the layouts.
    #[error("tensor `{tensor}`: dtype {src} in the source layout, {dst} in the destination")]
    DTypeMismatch {
        /// The tensor.
        tensor: String,
        /// Its dtype in the source layout.
        src: DType,
        /// Its dtype in the destination layout.
        dst: DType,
    },
}
