//! Ring algorithms: every rank sends to `rank + 1` and receives from `rank - 1` (mod n), in
//! `n - 1` steps per phase, chunked and pipelined. Bandwidth-optimal (each rank sends
//! `(n - 1) / n` of the data per phase) at the cost of `n - 1` latencies per phase.

pub(super) mod allgather;
pub(super) mod allreduce;
pub(super) mod reduce_scatter;
