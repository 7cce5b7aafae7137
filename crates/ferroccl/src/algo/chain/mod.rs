//! Chain algorithms: data flows from the root along `root, root + 1, ..., root - 1`
//! (mod n), chunked and pipelined, so every link carries the message once.

pub(super) mod broadcast;
