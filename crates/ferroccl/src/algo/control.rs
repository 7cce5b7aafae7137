//! Schedules of the calls that are not collectives over user data: point-to-point
//! send, receive and sendrecv, the dissemination barrier, and the all-to-all exchange of
//! fixed-size records that `split` runs.

use super::{Action, Buf, Schedule, Slice, Step};

/// One send of `len` bytes of `Output` to `peer`.
pub(crate) fn send(peer: usize, len: usize) -> Schedule {
    Schedule { steps: vec![Step { op: Action::Send { peer, src: Slice::new(Buf::Output, 0, len) }, deps: vec![] }], scratch_bytes: 0 }
}

/// One receive of `len` bytes into `Output` from `peer`.
pub(crate) fn recv(peer: usize, len: usize) -> Schedule {
    Schedule { steps: vec![Step { op: Action::Recv { peer, dst: Slice::new(Buf::Output, 0, len) }, deps: vec![] }], scratch_bytes: 0 }
}

/// A send to this rank itself and its receive, matched in a group: `len` bytes of `Input`
/// copied into `Output`, nothing on the wire.
pub(crate) fn self_copy(len: usize) -> Schedule {
    let op = Action::Copy { dst: Slice::new(Buf::Output, 0, len), src: Slice::new(Buf::Input, 0, len) };
    Schedule { steps: vec![Step { op, deps: vec![] }], scratch_bytes: 0 }
}

/// The receive first (its clear-to-send goes out before anything waits), then the send of
/// `Input`: no pattern of sendrecvs can deadlock.
pub(crate) fn sendrecv(to: usize, send_len: usize, from: usize, recv_len: usize) -> Schedule {
    Schedule {
        steps: vec![
            Step { op: Action::Recv { peer: from, dst: Slice::new(Buf::Output, 0, recv_len) }, deps: vec![] },
            Step { op: Action::Send { peer: to, src: Slice::new(Buf::Input, 0, send_len) }, deps: vec![] },
        ],
        scratch_bytes: 0,
    }
}

/// Dissemination barrier: in round k send to rank + 2^k and receive from rank - 2^k; a
/// round's send waits for the previous round's receive. Empty messages.
pub(crate) fn barrier(rank: usize, n: usize) -> Schedule {
    let mut steps: Vec<Step> = Vec::new();
    let mut k = 1;
    while k < n {
        let deps: Vec<usize> = if steps.is_empty() { vec![] } else { vec![steps.len() - 1] };
        steps.push(Step { op: Action::Send { peer: (rank + k) % n, src: Slice::new(Buf::Output, 0, 0) }, deps: deps.clone() });
        steps.push(Step { op: Action::Recv { peer: (rank + n - k) % n, dst: Slice::new(Buf::Output, 0, 0) }, deps });
        k *= 2;
    }
    Schedule { steps, scratch_bytes: 0 }
}

/// Every rank sends its `rec`-byte record (`Input`) to every other rank, and receives
/// rank p's into `Output[p * rec..]`. All transfers independent (sent eagerly, they never
/// wait for each other).
pub(crate) fn exchange(rank: usize, n: usize, rec: usize) -> Schedule {
    let mut steps = Vec::new();
    for p in (0..n).filter(|&p| p != rank) {
        steps.push(Step { op: Action::Send { peer: p, src: Slice::new(Buf::Input, 0, rec) }, deps: vec![] });
        steps.push(Step { op: Action::Recv { peer: p, dst: Slice::new(Buf::Output, p * rec, rec) }, deps: vec![] });
    }
    Schedule { steps, scratch_bytes: 0 }
}
