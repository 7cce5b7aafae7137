//! Plain-old-data types in the data-movement calls: a 16-byte `#[repr(C)]` struct of mixed
//! fields (routing metadata, as expert parallelism sends it) through send/recv, sendrecv,
//! allgather (and in place, and as a plan), broadcast, alltoall, alltoallv (random counts,
//! zeros included), gather, scatterv, a scope (gatherv, scatter, alltoall), a group (self
//! send/recv included) and a window, on 2 to 4 ranks and every protocol, checked value by value; a zero-sized type refused by every
//! call, leaving the communicator usable; counts that disagree between a sender and its
//! receiver an error on both sides, naming the type, not a hang.

use std::time::{Duration, Instant};

use ferroccl::{Communicator, Error, Params, ProtoChoice};

use crate::harness::{all_ok, run_world, Suite};

/// Routing metadata of one token: 16 bytes, four field types, no padding.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
struct Route {
    token: u32,
    expert: u16,
    slot: u16,
    gate: f32,
    bias: i32,
}

/// Nothing to move.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
struct Nothing;

const SENTINEL: Route = Route { token: u32::MAX, expert: u16::MAX, slot: u16::MAX, gate: -1.0, bias: i32::MIN };

/// The `i`-th route rank `r` sends in stream `k` of case `seed` (every field differs with
/// each argument; `gate` is exact).
fn route(r: usize, i: usize, k: u64, seed: u64) -> Route {
    let x = mix(seed ^ k.wrapping_mul(0x9E37_79B9) ^ ((r as u64) << 32) ^ i as u64);
    Route {
        token: x as u32,
        expert: (x >> 32) as u16,
        slot: (x >> 48) as u16,
        gate: ((x >> 8) % 4001) as f32 / 8.0 - 250.0,
        bias: -((x >> 20) as i32 & 0x7FFF_FFFF),
    }
}

fn routes(r: usize, len: usize, k: u64, seed: u64) -> Vec<Route> {
    (0..len).map(|i| route(r, i, k, seed)).collect()
}

/// splitmix64's finaliser.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn params(s: &Suite, proto: ProtoChoice, timeout: Duration, rank: usize) -> Params {
    // Eager up to 256 bytes (16 routes): the counts below take both protocols.
    Params { timeout, proto, eager_max: 256, shm_ring_bytes: 1 << 16, ..s.params(rank) }
}

fn same(what: &str, got: &[Route], want: &[Route]) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!("{what}: got {} routes, want {}", got.len(), want.len()));
    }
    match got.iter().zip(want).position(|(g, w)| g != w) {
        None => Ok(()),
        Some(i) => Err(format!("{what}: route {i} is {:?}, want {:?}", got[i], want[i])),
    }
}

/// The count matrix of case `seed`: `c[p][q]` routes go from rank p to rank q (0 to 40,
/// about one in four 0); every rank draws the same.
fn counts(n: usize, seed: u64) -> Vec<Vec<usize>> {
    (0..n).map(|p| (0..n).map(|q| (mix(seed ^ (p * 16 + q) as u64 ^ 0xC0) % 54).saturating_sub(13) as usize).collect()).collect()
}

fn displs(c: &[usize]) -> Vec<usize> {
    c.iter().scan(0, |at, &x| Some(std::mem::replace(at, *at + x))).collect()
}

/// Every data-movement call with `Route`, on 2 to 4 ranks and every protocol.
pub fn pod_structs_move_exactly(s: &Suite) {
    let protos = [ProtoChoice::Auto, ProtoChoice::Eager, ProtoChoice::Rendezvous];
    for n in 2..=4 {
        for (k, proto) in protos.into_iter().enumerate() {
            let seed = mix((n * 3 + k) as u64);
            let res = run_world(n, |r| params(s, proto, Duration::from_secs(60), r), |comm| every_call(comm, seed));
            if let Err(e) = all_ok(res) {
                panic!("{:?} {n} ranks {proto:?} seed {seed:#x}: {e}", s.wire);
            }
        }
    }
}

fn every_call(comm: Communicator, seed: u64) -> Result<(), String> {
    let (n, r) = (comm.size(), comm.rank());
    let e = |what: &'static str| move |err: Error| format!("rank {r}/{n}: {what}: {err}");
    let len = 1 + (mix(seed) % 40) as usize;

    // send / recv in pairs (0 -> 1, 2 -> 3), then back.
    if r ^ 1 < n {
        let peer = r ^ 1;
        for k in 0..2u64 {
            let sender = (r % 2) as u64 == k;
            if sender {
                comm.send(&routes(r, len, k, seed), peer).map_err(e("send"))?;
            } else {
                let mut got = vec![SENTINEL; len];
                comm.recv(&mut got, peer).map_err(e("recv"))?;
                same(&format!("rank {r}: recv from {peer}"), &got, &routes(peer, len, k, seed))?;
            }
        }
    }

    // sendrecv around the ring.
    let (to, from) = ((r + 1) % n, (r + n - 1) % n);
    let mut got = vec![SENTINEL; len];
    comm.sendrecv(&routes(r, len, 2, seed), to, &mut got, from).map_err(e("sendrecv"))?;
    same(&format!("rank {r}: sendrecv from {from}"), &got, &routes(from, len, 2, seed))?;

    // allgather, out of place and in place.
    let all: Vec<Route> = (0..n).flat_map(|p| routes(p, len, 3, seed)).collect();
    let mut got = vec![SENTINEL; n * len];
    comm.allgather_into(&routes(r, len, 3, seed), &mut got).map_err(e("allgather"))?;
    same(&format!("rank {r}: allgather"), &got, &all)?;
    let mut buf = vec![SENTINEL; n * len];
    buf[r * len..(r + 1) * len].copy_from_slice(&routes(r, len, 3, seed));
    comm.allgather(&mut buf).map_err(e("allgather_in_place"))?;
    same(&format!("rank {r}: allgather_in_place"), &buf, &all)?;

    // broadcast from every root.
    for root in 0..n {
        let mut buf = if r == root { routes(root, len, 4, seed) } else { vec![SENTINEL; len] };
        comm.broadcast(&mut buf, root).map_err(e("broadcast"))?;
        same(&format!("rank {r}: broadcast from {root}"), &buf, &routes(root, len, 4, seed))?;
    }

    // alltoall: block q of rank p's send is routes(p, .., 5 + q).
    let send: Vec<Route> = (0..n).flat_map(|q| routes(r, len, 5 + q as u64, seed)).collect();
    let mut got = vec![SENTINEL; n * len];
    comm.alltoall(&send, &mut got).map_err(e("alltoall"))?;
    let want: Vec<Route> = (0..n).flat_map(|p| routes(p, len, 5 + r as u64, seed)).collect();
    same(&format!("rank {r}: alltoall"), &got, &want)?;

    // alltoallv with random counts (zeros included).
    let c = counts(n, seed);
    let (sc, rc): (Vec<usize>, Vec<usize>) = ((0..n).map(|q| c[r][q]).collect(), (0..n).map(|p| c[p][r]).collect());
    let send: Vec<Route> = (0..n).flat_map(|q| routes(r, c[r][q], 10 + q as u64, seed)).collect();
    let mut got = vec![SENTINEL; rc.iter().sum()];
    comm.alltoallv(&send, &sc, &displs(&sc), &mut got, &rc, &displs(&rc)).map_err(e("alltoallv"))?;
    let want: Vec<Route> = (0..n).flat_map(|p| routes(p, c[p][r], 10 + r as u64, seed)).collect();
    same(&format!("rank {r}: alltoallv {c:?}"), &got, &want)?;

    // gather and scatterv (random counts) at every root.
    for (root, row) in c.iter().enumerate() {
        let mut got = vec![SENTINEL; if r == root { n * len } else { 0 }];
        comm.gather(&routes(r, len, 20, seed), &mut got, root).map_err(e("gather"))?;
        if r == root {
            let want: Vec<Route> = (0..n).flat_map(|p| routes(p, len, 20, seed)).collect();
            same(&format!("rank {r}: gather at {root}"), &got, &want)?;
        }
        let all: Vec<Route> = row.iter().enumerate().flat_map(|(q, &k)| routes(root, k, 30 + q as u64, seed)).collect();
        let send = if r == root { all } else { Vec::new() };
        let mut got = vec![SENTINEL; row[r]];
        comm.scatterv(&send, row, &displs(row), &mut got, root).map_err(e("scatterv"))?;
        same(&format!("rank {r}: scatterv from {root}"), &got, &routes(root, row[r], 30 + r as u64, seed))?;
    }

    // A group: a send to itself, the ring both ways, an alltoallv and an allgather.
    let mine = routes(r, len, 40, seed);
    let mut self_got = vec![SENTINEL; len];
    let mut ring_got = vec![SENTINEL; len];
    let ring_send = routes(r, len, 41, seed);
    let send: Vec<Route> = (0..n).flat_map(|q| routes(r, c[q][r], 50 + q as u64, seed)).collect();
    let (sc, rc): (Vec<usize>, Vec<usize>) = ((0..n).map(|q| c[q][r]).collect(), (0..n).map(|p| c[r][p]).collect());
    let mut v_got = vec![SENTINEL; rc.iter().sum()];
    let mut ag_got = vec![SENTINEL; n * len];
    let ag_send = routes(r, len, 60, seed);
    comm.group(|g| {
        g.add(ferroccl::op::recv(&mut self_got, r))?;
        g.add(ferroccl::op::recv(&mut ring_got, from))?;
        g.add(ferroccl::op::alltoallv(&send, &sc, &displs(&sc), &mut v_got, &rc, &displs(&rc)))?;
        g.add(ferroccl::op::send(&ring_send, to))?;
        g.add(ferroccl::op::allgather_into(&ag_send, &mut ag_got))?;
        g.add(ferroccl::op::send(&mine, r))
    })
    .map_err(e("group"))?;
    same(&format!("rank {r}: group self send/recv"), &self_got, &mine)?;
    same(&format!("rank {r}: group recv from {from}"), &ring_got, &routes(from, len, 41, seed))?;
    let want: Vec<Route> = (0..n).flat_map(|p| routes(p, c[r][p], 50 + r as u64, seed)).collect();
    same(&format!("rank {r}: group alltoallv"), &v_got, &want)?;
    let want: Vec<Route> = (0..n).flat_map(|p| routes(p, len, 60, seed)).collect();
    same(&format!("rank {r}: group allgather"), &ag_got, &want)?;

    // Non-blocking, in a scope: a gatherv (rank p sends c[p][0]) and a scatter at rank 0,
    // and an alltoall, in flight together.
    let gv_send = routes(r, c[r][0], 90, seed);
    let gv_counts: Vec<usize> = (0..n).map(|p| c[p][0]).collect();
    let mut gv_got = vec![SENTINEL; if r == 0 { gv_counts.iter().sum() } else { 0 }];
    let (gc, gd) = if r == 0 { (gv_counts.clone(), displs(&gv_counts)) } else { (Vec::new(), Vec::new()) };
    let sc_all = routes(0, n * len, 91, seed);
    let sc_send = if r == 0 { sc_all.clone() } else { Vec::new() };
    let mut sc_got = vec![SENTINEL; len];
    let a2a_send: Vec<Route> = (0..n).flat_map(|q| routes(r, len, 92 + q as u64, seed)).collect();
    let mut a2a_got = vec![SENTINEL; n * len];
    comm.scope(|sc| {
        let a = sc.start(ferroccl::op::gatherv(&gv_send, &mut gv_got, &gc, &gd, 0))?;
        let b = sc.start(ferroccl::op::scatter(&sc_send, &mut sc_got, 0))?;
        let x = sc.start(ferroccl::op::alltoall(&a2a_send, &mut a2a_got))?;
        x.wait()?;
        b.wait()?;
        a.wait()
    })
    .map_err(e("scope"))?;
    if r == 0 {
        let want: Vec<Route> = (0..n).flat_map(|p| routes(p, c[p][0], 90, seed)).collect();
        same(&format!("rank {r}: scope gatherv"), &gv_got, &want)?;
    }
    same(&format!("rank {r}: scope scatter"), &sc_got, &sc_all[r * len..(r + 1) * len])?;
    let want: Vec<Route> = (0..n).flat_map(|p| routes(p, len, 92 + r as u64, seed)).collect();
    same(&format!("rank {r}: scope alltoall"), &a2a_got, &want)?;

    // A persistent allgather, run twice with rewritten input.
    let mut send = vec![SENTINEL; len];
    let mut recv = vec![SENTINEL; n * len];
    {
        let mut plan = comm.plan(ferroccl::op::allgather_into(&mut send, &mut recv)).map_err(e("allgather_plan"))?;
        for k in 70..72u64 {
            plan.input_mut().unwrap_or_default().copy_from_slice(&routes(r, len, k, seed));
            plan.run().map_err(e("allgather plan run"))?;
            let want: Vec<Route> = (0..n).flat_map(|p| routes(p, len, k, seed)).collect();
            same(&format!("rank {r}: allgather plan run {k}"), plan.output(), &want)?;
        }
    }

    // A window of routes: the owner writes, then reads through its handle.
    let w = comm.alloc_window::<Route>(len + 2).map_err(e("alloc_window"))?;
    w.write(1, &routes(r, len, 80, seed)).map_err(e("window write"))?;
    let mut got = vec![SENTINEL; len];
    comm.read_into(&w.handle(), 1, &mut got).map_err(e("read_into"))?;
    same(&format!("rank {r}: window read_into"), &got, &routes(r, len, 80, seed))?;
    let mut got = vec![SENTINEL; 1];
    w.read(len + 1, &mut got).map_err(e("window read"))?;
    same(&format!("rank {r}: window read of an untouched route"), &got, &[bytemuck::Zeroable::zeroed()])?;
    drop(w);

    comm.finalize().map_err(e("finalize"))
}

/// Every call refuses a zero-sized type with `InvalidArgument` naming it, before anything
/// moves: the communicator stays usable.
pub fn pod_zero_sized_types_are_refused(s: &Suite) {
    let res = run_world(
        2,
        |r| params(s, ProtoChoice::Auto, Duration::from_secs(20), r),
        |comm| {
            let r = comm.rank();
            let peer = 1 - r;
            let mut buf = [Nothing; 4];
            let one = [1usize, 1];
            let at = [0usize, 1];
            let calls: Vec<(&str, ferroccl::Result<()>)> = vec![
                ("send", comm.send(&[Nothing; 2], peer)),
                ("recv", comm.recv(&mut buf, peer)),
                ("sendrecv", comm.sendrecv(&[Nothing; 2], peer, &mut [Nothing; 2], peer)),
                ("allgather", comm.allgather_into(&[Nothing; 2], &mut buf)),
                ("allgather_in_place", comm.allgather(&mut buf)),
                ("broadcast", comm.broadcast(&mut buf, 0)),
                ("alltoall", comm.alltoall(&[Nothing; 4], &mut buf)),
                ("alltoallv", comm.alltoallv(&[Nothing; 2], &one, &at, &mut [Nothing; 2], &one, &at)),
                ("gather", comm.gather(&[Nothing; 2], &mut buf, 0)),
                ("scatterv", comm.scatterv(&[Nothing; 2], &one, &at, &mut [Nothing; 1], 0)),
                ("group send", comm.group(|g| g.add(ferroccl::op::send(&[Nothing; 2], peer)))),
                ("scope recv", comm.scope(|sc| sc.start(ferroccl::op::recv(&mut buf, peer))?.wait())),
                ("alloc_window", comm.alloc_window::<Nothing>(4).map(drop)),
            ];
            for (what, res) in calls {
                match res {
                    Err(Error::InvalidArgument(m)) if m.contains("Nothing") && m.contains("zero-sized") => {}
                    other => return Err(format!("rank {r}: {what} of a zero-sized type: {other:?}")),
                }
            }
            // Nothing went on the wire, and the communicator is usable.
            let mut got = [SENTINEL; 3];
            comm.sendrecv(&routes(r, 3, 0, 1), peer, &mut got, peer).map_err(|e| format!("rank {r}: sendrecv after: {e}"))?;
            same(&format!("rank {r}: sendrecv after"), &got, &routes(peer, 3, 0, 1))?;
            comm.finalize().map_err(|e| format!("rank {r}: finalize: {e}"))
        },
    );
    all_ok(res).unwrap_or_else(|e| panic!("{:?}: {e}", s.wire));
}

/// Rank 0 sends `send` routes, rank 1 expects `expect` (eager and rendezvous): the
/// receiver's call fails, the sender's fails in the call or at its next one, both with the
/// mismatch (naming the type), none at the deadline. The same for an alltoallv.
pub fn pod_count_mismatch_fails_on_both_sides(s: &Suite) {
    for (send, expect) in [(3, 5), (5, 3), (4000, 6000), (6000, 4000), (0, 2)] {
        mismatch_case(s, send, expect, false);
    }
    for (send, expect) in [(3, 5), (300, 200)] {
        mismatch_case(s, send, expect, true);
    }
}

fn mismatch_case(s: &Suite, send: usize, expect: usize, alltoallv: bool) {
    let res = run_world(
        2,
        |r| params(s, ProtoChoice::Auto, Duration::from_secs(5), r),
        |comm| {
            let me = comm.rank();
            comm.barrier().map_err(|e| format!("rank {me}: barrier before: {e}"))?;
            let t0 = Instant::now();
            let first = if alltoallv {
                let (sc, rc) = if me == 0 { (vec![1, send], vec![1, 2]) } else { (vec![2, 1], vec![expect, 1]) };
                let data = routes(me, sc.iter().sum(), 0, 9);
                let mut got = vec![SENTINEL; rc.iter().sum()];
                comm.alltoallv(&data, &sc, &displs(&sc), &mut got, &rc, &displs(&rc))
            } else if me == 0 {
                comm.send(&routes(0, send, 0, 9), 1)
            } else {
                comm.recv(&mut vec![SENTINEL; expect], 0)
            };
            let (in_call, err) = match first {
                Err(e) => (true, e),
                Ok(()) => match comm.barrier() {
                    Err(e) => (false, e),
                    Ok(()) => return Err(format!("rank {me}: the mismatch went unnoticed")),
                },
            };
            Ok((in_call, matches!(err, Error::Mismatch { .. }), err.to_string(), t0.elapsed()))
        },
    );
    let sides = all_ok(res).unwrap_or_else(|e| panic!("{:?}: {e}", s.wire));
    let ctx = format!("{:?}, alltoallv {alltoallv}, rank 0 sends {send}, rank 1 expects {expect}: {sides:#?}", s.wire);
    assert!(sides[1].0, "the receiver's call succeeded: {ctx}");
    for (r, (_, mismatch, err, after)) in sides.iter().enumerate() {
        assert!(*mismatch, "rank {r} did not report Error::Mismatch: {ctx}");
        assert!(!err.contains("timed out"), "rank {r} waited for the deadline: {ctx}");
        if s.clocks {
            assert!(*after < Duration::from_secs(3), "rank {r} failed only after {after:?}: {ctx}");
        }
    }
    // The receiver speaks of the sizes in routes.
    assert!(sides[1].2.contains("Route"), "the receiver's error does not name the type: {ctx}");
}
