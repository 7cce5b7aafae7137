//! Pairwise-exchange algorithms: `n - 1` steps; in step `s` rank `r` sends to `r + s` and
//! receives from `r - s` (mod n), so every rank has one peer to send to and one to receive
//! from per step: no incast, and only a bounded window of steps in flight.

pub(super) mod alltoallv;
