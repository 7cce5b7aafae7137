//! Mesh (direct) algorithms: every rank exchanges with every other rank at once, one
//! latency per phase; reductions are one `ReduceMany` per chunk over all ranks' data in rank
//! order, so f16/bf16 results are bit-equal to the reference `reduce_many`.
//!
//! Peers are visited in the order `rank + 1, rank + 2, ...` (mod n) so that the ranks do
//! not all send to rank 0 first. Received chunks land in `Shape::slots`
//! scratch slots per peer, reused once the reduction (or copy) that read them is done.

pub(super) mod allgather;
pub(super) mod allreduce;
pub(super) mod alltoall;
pub(super) mod alltoallv;
pub(super) mod broadcast;
pub(super) mod reduce;
pub(super) mod reduce_scatter;
pub(super) mod rooted;

/// Held-back local steps of the mesh builders.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Key {
    /// The `ReduceMany` of own chunk `c`.
    Reduce(usize),
    /// The copy out of the slot of peer `k` places on, chunk `c`.
    Copy(usize, usize),
}
