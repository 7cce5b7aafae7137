//! Tensor parallelism: the communication halves of tensor-parallel layers, with their
//! shapes checked (see docs/tp.md).
//!
//! A [`TensorParallel`] wraps the communicator of one tensor-parallel group (its ranks
//! hold the shards of the same layers; `tp` below is [`TensorParallel::degree`]). Every
//! matrix is row-major, and its shape is given as `[rows, cols]` (in a decode step, `rows`
//! is the number of tokens):
//!
//! | layer | this rank holds | call | every rank ends with |
//! | ----- | --------------- | ---- | -------------------- |
//! | row-parallel linear | the partial output `[rows, cols]` | [`row_parallel_reduce`](TensorParallel::row_parallel_reduce) | the sum `[rows, cols]` |
//! | column-parallel linear, gathered | its column block `[rows, cols / tp]` | [`column_parallel_gather`](TensorParallel::column_parallel_gather) | the full `[rows, cols]` |
//! | sequence parallelism, out of a row-parallel layer | the partial `[rows, cols]` | [`sequence_reduce_scatter`](TensorParallel::sequence_reduce_scatter) | its rows of the sum, `[rows / tp, cols]` |
//! | sequence parallelism, into a column-parallel layer | its rows `[rows / tp, cols]` | [`sequence_allgather`](TensorParallel::sequence_allgather) | the full `[rows, cols]` |
//!
//! Rank r's column block is columns `r * cols / tp .. (r + 1) * cols / tp`, its rows
//! `r * rows / tp .. (r + 1) * rows / tp`. Dimensions that do not divide by `tp` are
//! refused ([`Error::InvalidArgument`], nothing sent): pad the matrix, or shard unevenly
//! with the collectives themselves.
//!
//! A layer's several small reductions go as one unit with
//! [`row_parallel_reduce_many`](TensorParallel::row_parallel_reduce_many) (one [`Group`]:
//! those up to `FERROCCL_EAGER_MAX` bytes are packed into one message); the `_start` forms
//! run in a [`Scope`], next to computation that touches other buffers.
//!
//! ```
//! # use ferroccl::bootstrap::{env::StoreRole, new_token, StoreServer};
//! # use ferroccl::{Communicator, InitConfig, Params};
//! # let token = new_token();
//! # let store = StoreServer::start("127.0.0.1:0".parse().unwrap(), &token, 1 << 20)?;
//! # let cfg = InitConfig { rank: 0, world_size: 1, store: StoreRole::Connect(store.addr().to_string()), token };
//! # let comm = Communicator::init_with(cfg, Params::default())?;
//! use ferroccl::tp::TensorParallel;
//!
//! let tp = TensorParallel::new(&comm);
//! let (tokens, hidden) = (2, 8);
//! // y = x W2 on this rank's rows of W2: a partial sum of the layer's output.
//! let mut y = vec![1.0f32; tokens * hidden];
//! tp.row_parallel_reduce(&mut y, [tokens, hidden])?;
//! // A column block of x W1, gathered into the full matrix.
//! let block = vec![2.0f32; tokens * hidden / tp.degree()];
//! let mut full = vec![0.0f32; tokens * hidden];
//! tp.column_parallel_gather(&block, &mut full, [tokens, hidden])?;
//! // A shape that does not match the buffer is an error, not a panic.
//! assert!(tp.row_parallel_reduce(&mut y, [3, hidden]).is_err());
//! # Ok::<(), ferroccl::Error>(())
//! ```
//!
//! # Ranks that disagree
//!
//! The collectives compare every call on the wire, so ranks whose buffers differ in
//! length (a `rows` or `cols` that differs between ranks) fail with
//! [`Error::Mismatch`] on every rank. Two shapes of the same element count (`[2, 8]` on
//! one rank, `[4, 4]` on another) reach the wire as the same call and are not caught.

use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::nonblocking::{Group, Request, Scope};
use ferroccl_kernels::{Element, ReduceOp};

/// The communication of tensor-parallel layers over one communicator (the
/// tensor-parallel group); see the [module documentation](self).
#[derive(Debug, Clone, Copy)]
pub struct TensorParallel<'c> {
    comm: &'c Communicator,
}

impl<'c> TensorParallel<'c> {
    /// The tensor-parallel group of `comm`'s ranks (every rank of it; use
    /// [`Communicator::split`] for a group of some).
    pub fn new(comm: &'c Communicator) -> Self {
        TensorParallel { comm }
    }

    /// The communicator.
    pub fn comm(&self) -> &'c Communicator {
        self.comm
    }

    /// The tensor-parallel degree `tp`: the communicator's size.
    pub fn degree(&self) -> usize {
        self.comm.size()
    }

    /// This rank's index in the group: it holds column block (or row block) `rank()`.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// `extent / tp`, the part of a dimension one rank holds; an
    /// [`Error::InvalidArgument`] naming `what` (e.g. `"cols"`) if it does not divide.
    pub fn shard(&self, what: &str, extent: usize) -> Result<usize> {
        let tp = self.degree();
        if !extent.is_multiple_of(tp) {
            return Err(Error::invalid(format!(
                "rank {}: tensor parallel: {what} = {extent} does not divide by the tensor-parallel degree {tp} (pad it to a \
                 multiple of {tp})",
                self.rank()
            )));
        }
        Ok(extent / tp)
    }

    /// This rank's columns of a `cols`-wide matrix split into `tp` column blocks.
    pub fn column_range(&self, cols: usize) -> Result<std::ops::Range<usize>> {
        let c = self.shard("cols", cols)?;
        Ok(self.rank() * c..(self.rank() + 1) * c)
    }

    /// This rank's rows of a `rows`-high matrix split into `tp` row blocks.
    pub fn row_range(&self, rows: usize) -> Result<std::ops::Range<usize>> {
        let r = self.shard("rows", rows)?;
        Ok(self.rank() * r..(self.rank() + 1) * r)
    }

    /// Checks that a buffer of `got` elements holds a `[rows, cols]` matrix.
    fn check(&self, call: &str, what: &str, got: usize, [rows, cols]: [usize; 2]) -> Result<()> {
        let want = rows
            .checked_mul(cols)
            .ok_or_else(|| Error::invalid(format!("rank {}: {call}: {what} [{rows}, {cols}] overflows", self.rank())))?;
        if got != want {
            return Err(Error::invalid(format!(
                "rank {}: {call}: {what} has {got} elements, expected {want} ([{rows}, {cols}])",
                self.rank()
            )));
        }
        Ok(())
    }

    /// Row-parallel linear: sums the partial outputs `out` (`[rows, cols]`, row-major) of
    /// every rank, in place; every rank ends with the layer's output.
    ///
    /// An [`Error::InvalidArgument`] if `out` does not have `rows * cols` elements.
    pub fn row_parallel_reduce<T: Element>(&self, out: &mut [T], shape: [usize; 2]) -> Result<()> {
        self.check("row_parallel_reduce", "out", out.len(), shape)?;
        self.comm.allreduce(out, ReduceOp::Sum)
    }

    /// [`row_parallel_reduce`](Self::row_parallel_reduce) of several partial outputs (a
    /// layer's, or several requests'), each summed across ranks in place, as one
    /// [`Group`]: one submission, and those up to `FERROCCL_EAGER_MAX` bytes packed into one
    /// message. Every rank must pass the same number of buffers with the same lengths.
    pub fn row_parallel_reduce_many<T: Element>(&self, outs: &mut [&mut [T]]) -> Result<()> {
        self.comm.group(|g| self.add_row_parallel_reduces(g, outs))
    }

    /// Adds [`row_parallel_reduce`](Self::row_parallel_reduce)s of `outs` to a group the
    /// caller builds (next to other calls of the layer).
    pub fn add_row_parallel_reduces<'s, T: Element>(&self, g: &Group<'s, '_>, outs: &'s mut [&mut [T]]) -> Result<()> {
        for out in outs.iter_mut() {
            g.add(crate::op::allreduce(out, ReduceOp::Sum))?;
        }
        Ok(())
    }

    /// Non-blocking [`row_parallel_reduce`](Self::row_parallel_reduce) in a [`Scope`]:
    /// `out` stays borrowed until the scope ends; wait for the [`Request`] before using it.
    pub fn row_parallel_reduce_start<'s, T: Element>(&self, s: &Scope<'s, '_>, out: &'s mut [T], shape: [usize; 2]) -> Result<Request<'s>> {
        self.check("row_parallel_reduce", "out", out.len(), shape)?;
        s.start(crate::op::allreduce(out, ReduceOp::Sum))
    }

    /// Column-parallel linear with gathered output: every rank's column block `local`
    /// (`[rows, cols / tp]`, row-major) lands in `out` (the full `[rows, cols]`, row-major:
    /// rank r's block in columns `r * cols / tp ..`).
    ///
    /// The allgather lands rank blocks one after another; for `rows > 1` they are then
    /// moved into place through a temporary copy of `out` (for `rows == 1` they already
    /// are). An [`Error::InvalidArgument`] if `cols` does not divide by `tp` or a buffer's
    /// length does not match the shape.
    pub fn column_parallel_gather<T: Element>(&self, local: &[T], out: &mut [T], shape: [usize; 2]) -> Result<()> {
        let [rows, cols] = shape;
        const CALL: &str = "column_parallel_gather";
        let c = self.shard("cols", cols).map_err(|e| rename(e, CALL))?;
        self.check(CALL, "local", local.len(), [rows, c])?;
        self.check(CALL, "out", out.len(), shape)?;
        self.comm.allgather_into(local, out)?;
        blocks_to_columns(out, rows, c, self.degree());
        Ok(())
    }

    /// Sequence parallelism, leaving a row-parallel layer: sums the partial outputs
    /// `partial` (`[rows, cols]`) across ranks and leaves this rank its rows of the sum in
    /// `out` (`[rows / tp, cols]`: rows `rank() * rows / tp ..`).
    ///
    /// An [`Error::InvalidArgument`] if `rows` does not divide by `tp` (refused: pad the
    /// sequence to a multiple of `tp`) or a buffer's length does not match the shape.
    pub fn sequence_reduce_scatter<T: Element>(&self, partial: &[T], out: &mut [T], shape: [usize; 2]) -> Result<()> {
        self.sequence_shapes("sequence_reduce_scatter", partial.len(), out.len(), shape)?;
        self.comm.reduce_scatter_into(partial, out, ReduceOp::Sum)
    }

    /// Non-blocking [`sequence_reduce_scatter`](Self::sequence_reduce_scatter) in a
    /// [`Scope`].
    pub fn sequence_reduce_scatter_start<'s, T: Element>(
        &self,
        s: &Scope<'s, '_>,
        partial: &'s [T],
        out: &'s mut [T],
        shape: [usize; 2],
    ) -> Result<Request<'s>> {
        self.sequence_shapes("sequence_reduce_scatter", partial.len(), out.len(), shape)?;
        s.start(crate::op::reduce_scatter_into(partial, out, ReduceOp::Sum))
    }

    /// Sequence parallelism, entering a column-parallel layer: every rank's rows `local`
    /// (`[rows / tp, cols]`) land in `out` (the full `[rows, cols]`, rank r's rows at row
    /// `r * rows / tp`).
    ///
    /// An [`Error::InvalidArgument`] if `rows` does not divide by `tp` or a buffer's length
    /// does not match the shape.
    pub fn sequence_allgather<T: Element>(&self, local: &[T], out: &mut [T], shape: [usize; 2]) -> Result<()> {
        self.sequence_shapes("sequence_allgather", out.len(), local.len(), shape)?;
        self.comm.allgather_into(local, out)
    }

    /// Non-blocking [`sequence_allgather`](Self::sequence_allgather) in a [`Scope`].
    pub fn sequence_allgather_start<'s, T: Element>(
        &self,
        s: &Scope<'s, '_>,
        local: &'s [T],
        out: &'s mut [T],
        shape: [usize; 2],
    ) -> Result<Request<'s>> {
        self.sequence_shapes("sequence_allgather", out.len(), local.len(), shape)?;
        s.start(crate::op::allgather_into(local, out))
    }

    /// Checks a sequence-parallel pair: `full` elements of `[rows, cols]` and `part` of
    /// `[rows / tp, cols]`; returns `rows / tp`.
    fn sequence_shapes(&self, call: &str, full: usize, part: usize, shape: [usize; 2]) -> Result<usize> {
        let [rows, cols] = shape;
        let r = self.shard("rows", rows).map_err(|e| rename(e, call))?;
        let (full_name, part_name) = if call == "sequence_allgather" { ("out", "local") } else { ("partial", "out") };
        self.check(call, full_name, full, shape)?;
        self.check(call, part_name, part, [r, cols])?;
        Ok(r)
    }
}

/// Puts the call's name into a [`TensorParallel::shard`] error.
fn rename(e: Error, call: &str) -> Error {
    match e {
        Error::InvalidArgument(m) => Error::InvalidArgument(m.replacen("tensor parallel:", &format!("{call}:"), 1)),
        other => other,
    }
}

/// Rearranges `buf` from `tp` rank blocks of `[rows, c]` (one after another) into the
/// row-major `[rows, tp * c]` matrix whose column block r is rank block r.
fn blocks_to_columns<T: Element>(buf: &mut [T], rows: usize, c: usize, tp: usize) {
    if rows <= 1 || tp <= 1 || c == 0 {
        return;
    }
    let blocks = buf.to_vec();
    let width = tp * c;
    for (r, block) in blocks.chunks_exact(rows * c).enumerate() {
        for (row, src) in block.chunks_exact(c).enumerate() {
            buf[row * width + r * c..row * width + (r + 1) * c].copy_from_slice(src);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::blocks_to_columns;

    #[test]
    fn blocks_land_in_their_columns() {
        // 2 ranks, 3 rows, 2 columns each: rank r's element (row, j) is 100 r + 10 row + j.
        let mut buf: Vec<u32> = (0..2).flat_map(|r| (0..3).flat_map(move |row| (0..2).map(move |j| 100 * r + 10 * row + j))).collect();
        blocks_to_columns(&mut buf, 3, 2, 2);
        assert_eq!(buf, [0, 1, 100, 101, 10, 11, 110, 111, 20, 21, 120, 121]);
    }
}
