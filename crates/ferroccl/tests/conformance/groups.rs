//! Group calls, over one instantiation's transport: a send to this rank itself and its
//! receive in one group (a local copy, as in NCCL; alone, next to sends to and receives
//! from the other ranks, next to collectives; mismatches refused before anything starts),
//! and the calls a group has besides allreduce, allgather, reduce_scatter and broadcast
//! (alltoall, reduce and the in-place forms) against the reference.
//!
//! Values are small integers, so every algorithm's result is exactly the reference whatever
//! its reduction order.

use std::time::Duration;

use ferroccl::{bf16, f16, Communicator, Error, LlChoice, Params, ReduceOp};

use crate::harness::{all_ok, run_world, RankResult, Suite};

/// Rank r's input value at index i of operation k.
fn val(k: usize, r: usize, i: usize) -> i64 {
    ((k * 31 + r * 7 + i * 3) % 23) as i64 - 11
}

/// Expects an `InvalidArgument` whose text contains `needle`.
fn expect_invalid(r: usize, what: &str, res: ferroccl::Result<()>, needle: &str) -> RankResult<()> {
    match res {
        Err(Error::InvalidArgument(m)) if m.contains(needle) => Ok(()),
        other => Err(format!("rank {r}: {what}: expected InvalidArgument mentioning {needle:?}, got {other:?}")),
    }
}

/// Sends to this rank itself and receives from it in groups: alone; in an exchange with
/// every rank (this one included: a MoE layer's dispatch), two copies matched in order,
/// one past the eager limit, one empty, next to an allreduce; in a group started in a
/// scope. Then what is refused, on every rank alike, before anything starts: lengths that
/// differ (also when only the order makes them differ), a send or a receive left without
/// its partner, and a blocking or non-blocking send or receive to itself outside a group
/// (pointing to `group` and `sendrecv`). The communicator stays usable, and `finalize`
/// (which compares every stream) agrees: the copies put nothing on the wire.
pub fn groups_send_and_receive_to_self(s: &Suite) {
    let res = run_world(
        3,
        |r| Params { timeout: Duration::from_secs(60), eager_max: 1024, ..s.params(r) },
        |comm: Communicator| -> RankResult<()> {
            let (r, n) = (comm.rank(), comm.size());
            let e = |e: Error| format!("rank {r}: {e}");
            // A group of one self pair, the receive added first.
            let data: Vec<u32> = (0..5).map(|i| val(0, r, i) as u32).collect();
            let mut got = vec![0u32; 5];
            comm.group(|g| {
                g.add(ferroccl::op::recv(&mut got, r))?;
                g.add(ferroccl::op::send(&data, r))
            })
            .map_err(e)?;
            if got != data {
                return Err(format!("rank {r}: self copy alone: {got:?}, sent {data:?}"));
            }
            // An exchange with every rank, this one included; block p goes to rank p and
            // has (p + 1) * 3 elements. Two more self pairs (matched in order: the k-th
            // send to itself into the k-th receive from itself), one past the eager limit,
            // one empty, and an allreduce in the same group.
            let blocks: Vec<Vec<f32>> = (0..n).map(|p| (0..(p + 1) * 3).map(|i| val(p, r, i) as f32).collect()).collect();
            let mut inbox: Vec<Vec<f32>> = (0..n).map(|_| vec![0.0; (r + 1) * 3]).collect();
            let big: Vec<u8> = (0..5000).map(|i| (i * 7 + r) as u8).collect();
            let mut big_back = vec![0u8; 5000];
            let (empty, mut empty_back) = (Vec::<bf16>::new(), Vec::<bf16>::new());
            let mut sum = vec![r as i32 + 1; 4];
            comm.group(|g| {
                for (p, b) in blocks.iter().enumerate() {
                    g.add(ferroccl::op::send(b, p))?;
                }
                g.add(ferroccl::op::send(&big, r))?;
                g.add(ferroccl::op::allreduce(&mut sum, ReduceOp::Sum))?;
                g.add(ferroccl::op::send(&empty, r))?;
                for (p, b) in inbox.iter_mut().enumerate() {
                    g.add(ferroccl::op::recv(b, p))?;
                }
                g.add(ferroccl::op::recv(&mut big_back, r))?;
                g.add(ferroccl::op::recv(&mut empty_back, r))
            })
            .map_err(e)?;
            for (p, b) in inbox.iter().enumerate() {
                if b.iter().enumerate().any(|(i, &x)| x != val(r, p, i) as f32) {
                    return Err(format!("rank {r}: exchange: block from rank {p}: {b:?}"));
                }
            }
            if big_back != big || !empty_back.is_empty() {
                return Err(format!("rank {r}: self copy past the eager limit differs"));
            }
            if sum != [(n * (n + 1) / 2) as i32; 4] {
                return Err(format!("rank {r}: allreduce next to self copies: {sum:?}"));
            }
            // A group started in a scope, next to a non-blocking allreduce.
            let (mut a, x, mut y) = (vec![1u64; 3], vec![f16::from_f32(r as f32 + 0.5); 7], vec![f16::ZERO; 7]);
            comm.scope(|sc| {
                let ra = sc.start(ferroccl::op::allreduce(&mut a, ReduceOp::Sum))?;
                let rg = sc.group(|g| {
                    g.add(ferroccl::op::send(&x, r))?;
                    g.add(ferroccl::op::recv(&mut y, r))
                })?;
                rg.wait()?;
                ra.wait()
            })
            .map_err(e)?;
            if a != [n as u64; 3] || y != x {
                return Err(format!("rank {r}: self copy in a scope: {a:?} {y:?}"));
            }
            // Refused before anything starts (every rank alike, so nobody waits).
            let mut three = [0u32; 3];
            let mut nine = [0u32; 9];
            let mut four = [0u32; 4];
            let mut peer_buf = [0u8; 2];
            let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
            let lengths = comm.group(|g| {
                g.add(ferroccl::op::send(&[1u32; 4], r))?;
                g.add(ferroccl::op::recv(&mut three, r))
            });
            expect_invalid(r, "self send and receive of other lengths", lengths, "differ in length")?;
            let order = comm.group(|g| {
                g.add(ferroccl::op::send(&[1u32; 4], r))?;
                g.add(ferroccl::op::send(&[2u32; 9], r))?;
                g.add(ferroccl::op::recv(&mut nine, r))?;
                g.add(ferroccl::op::recv(&mut four, r))
            });
            expect_invalid(r, "self pairs matched in order", order, "differ in length")?;
            let mut lone = vec![1.0f32; 8];
            let unmatched_send = comm.group(|g| {
                g.add(ferroccl::op::send(&[1u8; 2], next))?;
                g.add(ferroccl::op::allreduce(&mut lone, ReduceOp::Sum))?;
                g.add(ferroccl::op::send(&[5u32; 3], r))?;
                g.add(ferroccl::op::recv(&mut peer_buf, prev))
            });
            expect_invalid(r, "self send without a receive", unmatched_send, "no matching receive")?;
            let unmatched_recv = comm.group(|g| g.add(ferroccl::op::recv(&mut four, r)));
            expect_invalid(r, "self receive without a send", unmatched_recv, "no matching send")?;
            expect_invalid(r, "blocking send to itself", comm.send(&[1u8, 2], r), "group")?;
            expect_invalid(r, "blocking recv from itself", comm.recv(&mut peer_buf, r), "sendrecv")?;
            let lone_send = comm.scope(|sc| sc.start(ferroccl::op::send(&[1u8; 2], r)).map(drop));
            expect_invalid(r, "non-blocking send to itself", lone_send, "group")?;
            if lone != [1.0; 8] {
                return Err(format!("rank {r}: a refused group ran its allreduce: {lone:?}"));
            }
            // Nothing was poisoned, nothing left on a stream.
            let mut from_prev = [0u8; 2];
            comm.sendrecv(&[r as u8; 2], next, &mut from_prev, prev).map_err(e)?;
            if from_prev != [prev as u8; 2] {
                return Err(format!("rank {r}: ring after refused groups: {from_prev:?}"));
            }
            comm.finalize().map_err(e)
        },
    );
    if let Err(m) = all_ok(res) {
        panic!("{:?}: {m}", s.wire);
    }
}

/// Alltoall, reduce, reduce_in_place, allgather_in_place and reduce_scatter_in_place in one
/// group with a small allreduce (fused) and an allreduce_into, at counts that fit the
/// low-latency slots and past them, with the default parameters and with the low-latency
/// protocol forced (over shm; elsewhere the same run); every result against the reference.
pub fn groups_take_every_scope_call(s: &Suite) {
    for forced_ll in [false, true] {
        let res = run_world(
            4,
            |r| {
                let p = Params { timeout: Duration::from_secs(60), ..s.params(r) };
                if forced_ll {
                    Params { ll: LlChoice::Force, ll_max_bytes: 4096, ..p }
                } else {
                    p
                }
            },
            |comm: Communicator| -> RankResult<()> {
                let (r, n) = (comm.rank(), comm.size());
                let e = |e: Error| format!("rank {r} (forced ll: {forced_ll}): {e}");
                for (k, c) in [(0usize, 1usize), (1, 5), (2, 700)] {
                    let (root, root2) = (k % n, (k + 1) % n);
                    let send_a: Vec<i32> = (0..c * n).map(|i| val(k, r, i) as i32).collect();
                    let mut recv_a = vec![0i32; c * n];
                    let send_r: Vec<f32> = (0..c).map(|i| val(k + 1, r, i) as f32).collect();
                    let mut recv_r = vec![0f32; if r == root { c } else { 0 }];
                    let mut rip: Vec<i64> = (0..c).map(|i| val(k + 2, r, i)).collect();
                    let mut agip: Vec<u32> = (0..c * n).map(|j| if j / c == r { val(k + 3, r, j % c) as u32 } else { 0 }).collect();
                    let mut rsip: Vec<f64> = (0..c * n).map(|j| val(k + 4, r, j) as f64).collect();
                    let mut small = vec![r as u32 + 1; 3];
                    let send_i: Vec<i64> = (0..c).map(|i| val(k + 5, r, i)).collect();
                    let mut recv_i = vec![0i64; c];
                    comm.group(|g| {
                        g.add(ferroccl::op::alltoall(&send_a, &mut recv_a))?;
                        g.add(ferroccl::op::reduce_into(&send_r, &mut recv_r, ReduceOp::Sum, root))?;
                        g.add(ferroccl::op::allreduce(&mut small, ReduceOp::Sum))?;
                        g.add(ferroccl::op::reduce(&mut rip, ReduceOp::Max, root2))?;
                        g.add(ferroccl::op::allgather(&mut agip))?;
                        g.add(ferroccl::op::allreduce_into(&send_i, &mut recv_i, ReduceOp::Min))?;
                        g.add(ferroccl::op::reduce_scatter(&mut rsip, ReduceOp::Sum))
                    })
                    .map_err(e)?;
                    let at = |what: &str| format!("rank {r} (forced ll: {forced_ll}), count {c}: {what}");
                    if recv_a.iter().enumerate().any(|(j, &x)| x != val(k, j / c, r * c + j % c) as i32) {
                        return Err(at(&format!("alltoall {recv_a:?}")));
                    }
                    if r == root && recv_r.iter().enumerate().any(|(i, &x)| x != (0..n).map(|q| val(k + 1, q, i)).sum::<i64>() as f32) {
                        return Err(at(&format!("reduce to rank {root}: {recv_r:?}")));
                    }
                    if r == root2 && rip.iter().enumerate().any(|(i, &x)| Some(x) != (0..n).map(|q| val(k + 2, q, i)).max()) {
                        return Err(at(&format!("reduce_in_place to rank {root2}: {rip:?}")));
                    }
                    if agip.iter().enumerate().any(|(j, &x)| x != val(k + 3, j / c, j % c) as u32) {
                        return Err(at(&format!("allgather_in_place {agip:?}")));
                    }
                    let block = &rsip[r * c..][..c];
                    if block.iter().enumerate().any(|(i, &x)| x != (0..n).map(|q| val(k + 4, q, r * c + i)).sum::<i64>() as f64) {
                        return Err(at(&format!("reduce_scatter_in_place, block {r}: {block:?}")));
                    }
                    if small != [(n * (n + 1) / 2) as u32; 3] {
                        return Err(at(&format!("allreduce {small:?}")));
                    }
                    if recv_i.iter().enumerate().any(|(i, &x)| Some(x) != (0..n).map(|q| val(k + 5, q, i)).min()) {
                        return Err(at(&format!("allreduce_into {recv_i:?}")));
                    }
                }
                comm.finalize().map_err(e)
            },
        );
        if let Err(m) = all_ok(res) {
            panic!("{:?}: {m}", s.wire);
        }
    }
}
