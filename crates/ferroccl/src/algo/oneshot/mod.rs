//! One-shot algorithms for small messages: a single round in which every rank sends its
//! whole input to every other rank, then reduces locally in rank order.

pub(super) mod allreduce;
