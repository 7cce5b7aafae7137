//! One-sided windows: reads and writes between random ranks checked byte for byte against
//! a model, concurrent readers of one window, and every refusal (forged key, dropped
//! window, another job's handle, out of range, write through a read-only handle) leaving
//! every byte outside a live window, and inside it, as it was (guard bytes around every
//! window).

use std::time::Duration;

use ferroccl::{Access, Communicator, Error, Params, Refusal, RemoteHandle};
use proptest::prelude::*;
use proptest::test_runner::Config as ProptestConfig;

use crate::harness::{all_ok, check_cases, run_world, RankResult, Suite, Wire};

/// Bytes of guard on each side of every window.
const GUARD: usize = 64;
const GUARD_BYTE: u8 = 0xEE;

fn params(s: &Suite, rank: usize) -> Params {
    Params { timeout: Duration::from_secs(20), ..s.params(rank) }
}

/// Every rank's handle, gathered (each rank contributes its own).
fn gather_handles(comm: &Communicator, mine: &RemoteHandle) -> RankResult<Vec<RemoteHandle>> {
    let n = comm.size();
    let mut all = vec![0u8; RemoteHandle::BYTES * n];
    comm.allgather_into(&mine.to_bytes(), &mut all).map_err(|e| format!("rank {}: allgather handles: {e}", comm.rank()))?;
    all.chunks(RemoteHandle::BYTES).map(|c| RemoteHandle::from_bytes(c).map_err(|e| e.to_string())).collect()
}

/// The byte rank `r` writes at position `i` of rank `owner`'s window in `round`.
fn byte(owner: usize, r: usize, i: usize, round: u64) -> u8 {
    (owner as u64 * 131 + r as u64 * 31 + i as u64 * 7 + round * 13) as u8
}

/// The most stripes a window is cut into per round.
const MAX_STRIPES: usize = 512;

/// A case: ranks, window bytes per rank, rounds of (writes, then reads) and a seed that
/// cuts each owner's window into stripes written by different ranks.
#[derive(Debug, Clone)]
struct Case {
    n: usize,
    len: usize,
    rounds: u64,
    seed: u64,
}

fn case(max_ranks: usize) -> impl Strategy<Value = Case> {
    (2..=max_ranks, prop_oneof![1..64usize, 64..5000usize, Just(300_000usize)], 1..3u64, any::<u64>())
        .prop_map(|(n, len, rounds, seed)| Case { n, len, rounds, seed })
}

/// Which rank writes byte `i` of `owner`'s window in `round` (stripes of a seeded width,
/// at most [`MAX_STRIPES`] of them: a 300,000-byte window cut into one-byte stripes was
/// 300,000 blocking writes, minutes under soft-RoCE, and its ranks timed out in the
/// barrier waiting for each other).
fn writer(c: &Case, owner: usize, i: usize, round: u64) -> usize {
    let width = (1 + (c.seed as usize % 97) * (1 + owner) * (1 + round as usize)).max(c.len.div_ceil(MAX_STRIPES));
    (i / width + owner + round as usize) % c.n
}

/// The contiguous stripes of `owner`'s window that rank `r` writes in `round`.
fn stripes(c: &Case, owner: usize, r: usize, round: u64) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < c.len {
        let w = writer(c, owner, i, round);
        let start = i;
        while i < c.len && writer(c, owner, i, round) == w {
            i += 1;
        }
        if w == r {
            out.push((start, i - start));
        }
    }
    out
}

fn run_case(s: &Suite, c: &Case) -> Result<(), String> {
    let res = run_world(
        c.n,
        |r| params(s, r),
        |comm| -> RankResult<()> {
            let me = comm.rank();
            let e = |what: &str| {
                let what = what.to_string();
                move |err: Error| format!("rank {me}: {what}: {err}")
            };
            let mut mem = vec![GUARD_BYTE; c.len + 2 * GUARD];
            let (head, rest) = mem.split_at_mut(GUARD);
            let (win, tail) = rest.split_at_mut(c.len);
            win.fill(0);
            comm.scope(|sc| {
                let w = sc.register_mut(&mut *win)?;
                let hs = gather_handles(&comm, &w.handle()).map_err(Error::InvalidArgument)?;
                for round in 0..c.rounds {
                    // Writes: my stripes of every window (mine included), then a barrier.
                    for (owner, h) in hs.iter().enumerate() {
                        for (start, len) in stripes(c, owner, me, round) {
                            let data: Vec<u8> = (start..start + len).map(|i| byte(owner, me, i, round)).collect();
                            comm.write_from(h, start, &data)?;
                        }
                    }
                    comm.barrier()?;
                    // Reads: every window whole, from a rank-dependent starting owner.
                    for k in 0..c.n {
                        let owner = (me + k) % c.n;
                        let mut got = vec![0u8; c.len];
                        comm.read_into(&hs[owner], 0, &mut got)?;
                        for (i, &b) in got.iter().enumerate() {
                            let want = byte(owner, writer(c, owner, i, round), i, round);
                            if b != want {
                                return Err(Error::InvalidArgument(format!(
                                    "round {round}: byte {i} of rank {owner}'s window reads {b}, expected {want}"
                                )));
                            }
                        }
                    }
                    comm.barrier()?;
                }
                drop(w);
                Ok(())
            })
            .map_err(e("windows"))?;
            if head.iter().chain(tail.iter()).any(|&b| b != GUARD_BYTE) {
                return Err(format!("rank {me}: a guard byte around the window changed"));
            }
            comm.finalize().map_err(e("finalize"))
        },
    );
    all_ok(res).map(|_| ())
}

/// Random windows, writes in seeded stripes from every rank, then every window read whole
/// by every rank: every byte equals the model, and no guard byte changes.
pub fn windows_read_and_write_exactly(s: &Suite) {
    let cases = s.nonblocking_cases.max(2) * 2;
    check_cases(ProptestConfig { cases, ..ProptestConfig::default() }, case(s.p2p_ranks.min(4)), |c| run_case(s, &c));
}

/// Every rank reads rank 0's window many times at once, in scopes (several reads in flight
/// per rank); every read sees the window's bytes.
pub fn concurrent_reads_of_one_window(s: &Suite) {
    let n = s.p2p_ranks.min(4);
    let len = 100_003;
    let res = run_world(
        n,
        |r| params(s, r),
        |comm| -> RankResult<()> {
            let me = comm.rank();
            let src: Vec<u32> = (0..len as u32).map(|i| i.wrapping_mul(2_654_435_761)).collect();
            comm.scope(|sc| {
                let w = sc.register(&src)?;
                let hs = gather_handles(&comm, &w.handle()).map_err(Error::InvalidArgument)?;
                let h0 = hs[0];
                let mut bufs: Vec<Vec<u32>> = (0..6).map(|_| vec![0u32; len / 3]).collect();
                comm.scope(|inner| {
                    let mut reqs = Vec::new();
                    for (k, b) in bufs.iter_mut().enumerate() {
                        reqs.push(inner.read_into(&h0, (k % 3) * (len / 3), b)?);
                    }
                    for r in reqs {
                        r.wait()?;
                    }
                    Ok(())
                })?;
                for (k, b) in bufs.iter().enumerate() {
                    let off = (k % 3) * (len / 3);
                    if b[..] != src[off..off + len / 3] {
                        return Err(Error::InvalidArgument(format!("rank {me}: read {k} of rank 0's window differs")));
                    }
                }
                comm.barrier()
            })
            .map_err(|e| format!("rank {me}: {e}"))?;
            comm.finalize().map_err(|e| format!("rank {me}: finalize: {e}"))
        },
    );
    all_ok(res).unwrap();
}

/// Forged keys, another job's handle, ranges outside the window, writes through a
/// read-only handle, handles of dropped windows, and bytes that are not a handle: each is
/// refused with its reason (or an invalid argument, for the bytes), nothing in or around
/// any window changes, and the communicator stays usable.
pub fn refused_accesses_touch_nothing(s: &Suite) {
    let res = run_world(
        3,
        |r| params(s, r),
        |comm| -> RankResult<()> {
            let me = comm.rank();
            let n = comm.size();
            let len = 4096;
            let mut rw = vec![GUARD_BYTE; len + 2 * GUARD];
            let ro_src: Vec<u8> = (0..len).map(|i| (i * 3) as u8).collect();
            let mut ro = vec![GUARD_BYTE; len + 2 * GUARD];
            ro[GUARD..GUARD + len].copy_from_slice(&ro_src);
            let mut dead_mem = vec![0u8; 64];
            let rw_before = rw.clone();
            let ro_before = ro.clone();
            let expect = |what: &str, r: ferroccl::Result<()>, want: Refusal| -> ferroccl::Result<()> {
                match r {
                    Err(Error::Refused { reason, .. }) if reason == want => Ok(()),
                    other => Err(Error::InvalidArgument(format!("rank {me}: {what}: expected a refusal ({want:?}), got {other:?}"))),
                }
            };
            comm.scope(|sc| {
                let w_rw = sc.register_mut(&mut rw[GUARD..GUARD + len])?;
                let w_ro = sc.register(&ro[GUARD..GUARD + len])?;
                let dead = sc.register_mut(&mut dead_mem)?;
                let rws = gather_handles(&comm, &w_rw.handle()).map_err(Error::InvalidArgument)?;
                let ros = gather_handles(&comm, &w_ro.handle()).map_err(Error::InvalidArgument)?;
                let deads = gather_handles(&comm, &dead.handle()).map_err(Error::InvalidArgument)?;
                drop(dead);
                // Every rank's dead window is dropped before anyone uses a handle to one.
                comm.barrier()?;
                let peer = (me + 1) % n;
                let mut buf = vec![0u8; 256];
                // A forged key: the right owner, window and job; another key.
                let mut forged = rws[peer].to_bytes();
                forged[16] ^= 0x5a;
                let forged = RemoteHandle::from_bytes(&forged)?;
                expect("read with a forged key", comm.read_into(&forged, 0, &mut buf), Refusal::NoWindow)?;
                expect("write with a forged key", comm.write_from(&forged, 0, &buf), Refusal::NoWindow)?;
                // Another window id (one that was never made) with the real key.
                let mut other_id = rws[peer].to_bytes();
                other_id[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
                let other_id = RemoteHandle::from_bytes(&other_id)?;
                expect("read of a window id never made", comm.read_into(&other_id, 0, &mut buf), Refusal::NoWindow)?;
                // A dropped window.
                expect("read of a dropped window", comm.read_into(&deads[peer], 0, &mut buf[..8]), Refusal::NoWindow)?;
                expect("write to a dropped window", comm.write_from(&deads[peer], 0, &buf[..8]), Refusal::NoWindow)?;
                // Another job: caught here, and (with the length forged larger) at the owner.
                let mut job = rws[peer].to_bytes();
                job[24] ^= 1;
                let job = RemoteHandle::from_bytes(&job)?;
                expect("read with another job's handle", comm.read_into(&job, 0, &mut buf), Refusal::OtherJob)?;
                // Out of range: caught here by the handle's length...
                expect("read past the end", comm.read_into(&rws[peer], len - 100, &mut buf), Refusal::OutOfRange)?;
                expect("write past the end", comm.write_from(&rws[peer], len, &buf[..1]), Refusal::OutOfRange)?;
                expect("offset overflow", comm.read_into(&rws[peer], usize::MAX, &mut buf), Refusal::OutOfRange)?;
                // ... and by the owner when the handle lies about its length.
                let mut long = rws[peer].to_bytes();
                long[32..40].copy_from_slice(&(len as u64 * 4).to_le_bytes());
                let long = RemoteHandle::from_bytes(&long)?;
                expect("read past the real end", comm.read_into(&long, len, &mut buf), Refusal::OutOfRange)?;
                expect("write past the real end", comm.write_from(&long, len - 8, &buf[..16]), Refusal::OutOfRange)?;
                // Read-only: refused here, and by the owner when the handle claims more.
                if ros[peer].access() != Access::ReadOnly {
                    return Err(Error::InvalidArgument(format!("rank {me}: a window over &[u8] is not read-only")));
                }
                expect("write through a read-only handle", comm.write_from(&ros[peer], 0, &buf[..8]), Refusal::ReadOnly)?;
                let mut claims = ros[peer].to_bytes();
                claims[12] = 2;
                let claims = RemoteHandle::from_bytes(&claims)?;
                expect("write through a forged read-write handle", comm.write_from(&claims, 0, &buf[..8]), Refusal::ReadOnly)?;
                // Bytes that are not a handle.
                if RemoteHandle::from_bytes(&[0u8; 39]).is_ok() || RemoteHandle::from_bytes(&[7u8; 40]).is_ok() {
                    return Err(Error::InvalidArgument(format!("rank {me}: garbage parsed as a handle")));
                }
                // Nothing of that poisoned anything: a legal read of the read-only window.
                comm.read_into(&ros[peer], 0, &mut buf)?;
                if buf[..] != ro_src[..256] {
                    return Err(Error::InvalidArgument(format!("rank {me}: read-only window reads wrong")));
                }
                comm.barrier()?;
                drop((w_rw, w_ro));
                Ok(())
            })
            .map_err(|e| format!("rank {me}: {e}"))?;
            if rw != rw_before || ro != ro_before {
                return Err(format!("rank {me}: a refused access changed a window or its guard bytes"));
            }
            comm.finalize().map_err(|e| format!("rank {me}: finalize: {e}"))
        },
    );
    all_ok(res).unwrap();
}

/// A library-allocated window: written by every other rank, read back by its owner.
pub fn allocated_windows_are_written_by_peers(s: &Suite) {
    let n = 3;
    let res = run_world(
        n,
        |r| params(s, r),
        |comm| -> RankResult<()> {
            let me = comm.rank();
            let run = || -> ferroccl::Result<()> {
                let w = comm.alloc_window::<u64>(n * 1000)?;
                let hs = gather_handles(&comm, &w.handle()).map_err(Error::InvalidArgument)?;
                for (owner, h) in hs.iter().enumerate() {
                    let data: Vec<u64> = (0..1000).map(|i| (owner * 1_000_000 + me * 1000 + i) as u64).collect();
                    comm.write_from(h, me * 1000, &data)?;
                }
                comm.barrier()?;
                let mut mine = vec![0u64; n * 1000];
                w.read(0, &mut mine)?;
                for (i, &v) in mine.iter().enumerate() {
                    let want = (me * 1_000_000 + i) as u64;
                    if v != want {
                        return Err(Error::InvalidArgument(format!("rank {me}: element {i} is {v}, expected {want}")));
                    }
                }
                let st = comm.registration_stats();
                if st.windows != 1 || st.window_bytes != (n * 1000 * 8) as u64 || st.windows_registered != 1 {
                    return Err(Error::InvalidArgument(format!("rank {me}: window statistics {st:?}")));
                }
                comm.barrier()
            };
            run().map_err(|e| format!("rank {me}: {e}"))?;
            comm.finalize().map_err(|e| format!("rank {me}: finalize: {e}"))
        },
    );
    all_ok(res).unwrap();
}

/// A transfer plan of scattered reads (three "tensors" of every other rank into one
/// buffer, as in the Monarch notebook) and writes (a slice of each tensor into the next
/// rank's inbox window), run many times with the sources rewritten between runs: every run
/// moves the current bytes.
pub fn transfer_plans_run_many_times_with_rewritten_sources(s: &Suite) {
    let n = s.p2p_ranks.clamp(2, 3);
    let sizes = [1000usize, 5000, 2000];
    let total: usize = sizes.iter().sum();
    let runs = s.plan_runs;
    let res = run_world(
        n,
        |r| params(s, r),
        |comm| -> RankResult<()> {
            let me = comm.rank();
            let from = (me + 1) % n;
            let to = (me + n - 1) % n;
            let mut tensors: Vec<Vec<f32>> = sizes.iter().map(|&len| vec![0f32; len]).collect();
            let mut dst = vec![0f32; total];
            let mut inbox = vec![0f32; 3 * 16];
            let value = |rank: usize, t: usize, i: usize, run: usize| (rank * 100_000 + t * 10_000 + i + run) as f32;
            let mut go = || -> ferroccl::Result<()> {
                comm.scope(|sc| {
                    let mut ws = Vec::new();
                    for t in tensors.iter_mut() {
                        ws.push(sc.register_mut(t)?);
                    }
                    let wd = sc.register_mut(&mut dst)?;
                    let wi = sc.register_mut(&mut inbox)?;
                    let mut mine: Vec<RemoteHandle> = ws.iter().map(|w| w.handle()).collect();
                    mine.push(wi.handle());
                    let mut all = vec![0u8; RemoteHandle::BYTES * 4 * n];
                    let bytes: Vec<u8> = mine.iter().flat_map(|h| h.to_bytes()).collect();
                    comm.allgather_into(&bytes, &mut all)?;
                    let hs: Vec<RemoteHandle> =
                        all.chunks(RemoteHandle::BYTES).map(RemoteHandle::from_bytes).collect::<ferroccl::Result<_>>()?;
                    let theirs = &hs[4 * from..4 * from + 4];
                    let mut b = comm.transfer_plan();
                    let mut at = 0;
                    for (t, &len) in sizes.iter().enumerate() {
                        b = b.read::<f32>(&theirs[t], 0, &wd, at, len);
                        at += len;
                    }
                    let next_inbox = hs[4 * to + 3];
                    for (t, w) in ws.iter().enumerate() {
                        b = b.write::<f32>(w, 0, &next_inbox, t * 16, 16);
                    }
                    let mut plan = b.build()?;
                    if plan.transfers() != 6 {
                        return Err(Error::InvalidArgument(format!("rank {me}: {} transfers", plan.transfers())));
                    }
                    for run in 0..runs {
                        // Rewrite: the first 16 and the last element of every tensor.
                        for (t, w) in ws.iter().enumerate() {
                            let head: Vec<f32> = (0..16).map(|i| value(me, t, i, run)).collect();
                            w.write(0, &head)?;
                            w.write(sizes[t] - 1, &[value(me, t, sizes[t] - 1, run)])?;
                        }
                        comm.barrier()?;
                        plan.run()?;
                        comm.barrier()?;
                        let mut at = 0;
                        for (t, &len) in sizes.iter().enumerate() {
                            let (mut head, mut last) = ([0f32; 16], [0f32]);
                            wd.read(at, &mut head)?;
                            wd.read(at + len - 1, &mut last)?;
                            let mut inb = [0f32; 16];
                            wi.read(t * 16, &mut inb)?;
                            for i in 0..16 {
                                // My inbox holds what rank `from` (whose next rank down I am) wrote.
                                if head[i] != value(from, t, i, run) || inb[i] != value(from, t, i, run) {
                                    return Err(Error::InvalidArgument(format!(
                                        "rank {me}: run {run}: tensor {t} element {i}: read {} (want {}), inbox {} (want {})",
                                        head[i],
                                        value(from, t, i, run),
                                        inb[i],
                                        value(from, t, i, run)
                                    )));
                                }
                            }
                            if last[0] != value(from, t, len - 1, run) {
                                return Err(Error::InvalidArgument(format!("rank {me}: run {run}: tensor {t}: last element")));
                            }
                            at += len;
                        }
                    }
                    if plan.runs() != runs as u64 {
                        return Err(Error::InvalidArgument(format!("rank {me}: {} runs", plan.runs())));
                    }
                    Ok(())
                })
            };
            go().map_err(|e| format!("rank {me}: {e}"))?;
            comm.finalize().map_err(|e| format!("rank {me}: finalize: {e}"))
        },
    );
    all_ok(res).unwrap();
}

/// A plan's entries are checked when it is built: overlapping destinations (named by their
/// indices), ranges outside either window, reads into a read-only window, writes through a
/// read-only handle, another job's handle.
pub fn transfer_plans_refuse_bad_entries(s: &Suite) {
    let res = run_world(
        2,
        |r| params(s, r),
        |comm| -> RankResult<()> {
            let me = comm.rank();
            let src = vec![1u32; 100];
            let mut dst = vec![0u32; 100];
            let mut go = || -> ferroccl::Result<()> {
                comm.scope(|sc| {
                    let ro = sc.register(&src)?;
                    let rw = sc.register_mut(&mut dst)?;
                    let mut all = vec![0u8; RemoteHandle::BYTES * 4];
                    let mine: Vec<u8> = [ro.handle(), rw.handle()].iter().flat_map(|h| h.to_bytes()).collect();
                    comm.allgather_into(&mine, &mut all)?;
                    let peer = 1 - me;
                    let h_ro = RemoteHandle::from_bytes(&all[(2 * peer) * 40..(2 * peer + 1) * 40])?;
                    let h_rw = RemoteHandle::from_bytes(&all[(2 * peer + 1) * 40..(2 * peer + 2) * 40])?;
                    let expect = |what: &str, r: ferroccl::Result<ferroccl::TransferPlan<'_>>, needle: &str| -> ferroccl::Result<()> {
                        match r {
                            Err(Error::InvalidArgument(m)) if m.contains(needle) => Ok(()),
                            Err(e) => Err(Error::InvalidArgument(format!("rank {me}: {what}: expected {needle:?}, got {e}"))),
                            Ok(_) => Err(Error::InvalidArgument(format!("rank {me}: {what}: built"))),
                        }
                    };
                    expect(
                        "overlapping reads",
                        comm.transfer_plan().read::<u32>(&h_ro, 0, &rw, 0, 10).read::<u32>(&h_ro, 50, &rw, 5, 10).build(),
                        "entries 0 and 1 land in overlapping bytes",
                    )?;
                    expect(
                        "overlapping writes",
                        comm.transfer_plan()
                            .write::<u32>(&ro, 0, &h_rw, 0, 10)
                            .read::<u32>(&h_ro, 0, &rw, 0, 1)
                            .write::<u32>(&ro, 20, &h_rw, 9, 3)
                            .build(),
                        "entries 0 and 2 land in overlapping bytes",
                    )?;
                    expect("remote range", comm.transfer_plan().read::<u32>(&h_ro, 95, &rw, 0, 10).build(), "entry 0")?;
                    expect("local range", comm.transfer_plan().read::<u32>(&h_ro, 0, &rw, 95, 10).build(), "local window")?;
                    expect(
                        "read into read-only",
                        comm.transfer_plan().read::<u32>(&h_ro, 0, &ro, 0, 10).build(),
                        "read-only local window",
                    )?;
                    expect("write to read-only", comm.transfer_plan().write::<u32>(&rw, 0, &h_ro, 0, 10).build(), "read-only")?;
                    let mut other = h_rw.to_bytes();
                    other[24] ^= 1;
                    let other = RemoteHandle::from_bytes(&other)?;
                    expect("another job", comm.transfer_plan().read::<u32>(&other, 0, &rw, 0, 1).build(), "another job")?;
                    expect("overflow", comm.transfer_plan().read::<u32>(&h_ro, usize::MAX, &rw, 0, 1).build(), "overflow")?;
                    // Disjoint entries build and run.
                    let mut ok = comm.transfer_plan().read::<u32>(&h_ro, 0, &rw, 0, 50).read::<u32>(&h_ro, 50, &rw, 50, 50).build()?;
                    ok.run()?;
                    let mut got = vec![0u32; 100];
                    rw.read(0, &mut got)?;
                    if got != vec![1u32; 100] {
                        return Err(Error::InvalidArgument(format!("rank {me}: plan read wrong values")));
                    }
                    comm.barrier()
                })
            };
            go().map_err(|e| format!("rank {me}: {e}"))?;
            comm.finalize().map_err(|e| format!("rank {me}: finalize: {e}"))
        },
    );
    all_ok(res).unwrap();
}

/// `put_signal` raises the signal only after its bytes have landed: the owner, waiting for
/// each round's signal, finds that round's data complete in its window; `signal` (no data)
/// and `signal_value` read the same signal; signals only rise.
pub fn put_signal_lands_the_data_before_the_signal(s: &Suite) {
    let rounds = 40usize;
    let len = 3000usize;
    let res = run_world(
        2,
        |r| params(s, r),
        |comm| -> RankResult<()> {
            let me = comm.rank();
            let mut slots = vec![0u32; rounds * len];
            let data = |k: usize| -> Vec<u32> { (0..len).map(|i| (k * 1_000_003 + i) as u32).collect() };
            let mut go = || -> ferroccl::Result<()> {
                comm.scope(|sc| {
                    let w = sc.register_mut(&mut slots)?;
                    let mut all = vec![0u8; RemoteHandle::BYTES * 2];
                    comm.allgather_into(&w.handle().to_bytes(), &mut all)?;
                    let h1 = RemoteHandle::from_bytes(&all[40..80])?;
                    if me == 0 {
                        for k in 1..=rounds {
                            comm.put_signal(&h1, (k - 1) * len, &data(k), k as u64)?;
                        }
                        comm.signal(1, 1_000)?;
                        comm.signal(1, 7)?; // lower: the signal stays at 1000
                    } else {
                        for k in 1..=rounds {
                            let v = comm.wait_signal(0, k as u64)?;
                            if v < k as u64 {
                                return Err(Error::InvalidArgument(format!("wait_signal({k}) returned {v}")));
                            }
                            let mut got = vec![0u32; len];
                            w.read((k - 1) * len, &mut got)?;
                            if got != data(k) {
                                return Err(Error::InvalidArgument(format!("round {k}: the signal came before the data")));
                            }
                        }
                        comm.wait_signal(0, 1_000)?;
                    }
                    comm.barrier()?;
                    if me == 1 && comm.signal_value(0) != 1_000 {
                        return Err(Error::InvalidArgument(format!("signal_value(0) is {}", comm.signal_value(0))));
                    }
                    // A signal to itself.
                    comm.signal(me, 5)?;
                    if comm.wait_signal(me, 5)? != 5 || comm.signal_value(me) != 5 {
                        return Err(Error::InvalidArgument("a signal to itself".into()));
                    }
                    comm.barrier()
                })
            };
            go().map_err(|e| format!("rank {me}: {e}"))?;
            comm.finalize().map_err(|e| format!("rank {me}: finalize: {e}"))
        },
    );
    all_ok(res).unwrap();
}

/// A plan whose entry names a window dropped since the plan was built fails its run with
/// the refusal, but only once its other transfers are over: their data has landed, and
/// nothing lands later (the communicator stays usable, and a rebuilt plan runs).
pub fn a_refused_plan_entry_fails_the_run_after_the_others_land(s: &Suite) {
    let res = run_world(
        2,
        |r| params(s, r),
        |comm| -> RankResult<()> {
            let me = comm.rank();
            let peer = 1 - me;
            let src: Vec<u64> = (0..30_000).map(|i| (me * 1_000_000 + i) as u64).collect();
            let mut gone = vec![0u64; 10];
            let mut dst = vec![0u64; 30_010];
            let mut go = || -> ferroccl::Result<()> {
                comm.scope(|sc| {
                    let w = sc.register(&src)?;
                    let g = sc.register_mut(&mut gone)?;
                    let d = sc.register_mut(&mut dst)?;
                    let mine: Vec<u8> = [w.handle(), g.handle()].iter().flat_map(|h| h.to_bytes()).collect();
                    let mut all = vec![0u8; mine.len() * 2];
                    comm.allgather_into(&mine, &mut all)?;
                    let hw = RemoteHandle::from_bytes(&all[peer * 80..peer * 80 + 40])?;
                    let hg = RemoteHandle::from_bytes(&all[peer * 80 + 40..peer * 80 + 80])?;
                    let mut plan = comm
                        .transfer_plan()
                        .read::<u64>(&hw, 0, &d, 0, 15_000)
                        .read::<u64>(&hg, 0, &d, 30_000, 10)
                        .read::<u64>(&hw, 15_000, &d, 15_000, 15_000)
                        .build()?;
                    plan.run()?;
                    // The peer's first run reads my `gone` window too: it must be over
                    // before I drop that window.
                    comm.barrier()?;
                    drop(g);
                    comm.barrier()?;
                    d.write(0, &vec![0u64; 30_010])?;
                    match plan.run() {
                        Err(Error::Refused { reason: Refusal::NoWindow, owner, .. }) if owner == peer => {}
                        other => return Err(Error::InvalidArgument(format!("rank {me}: expected a refusal, got {other:?}"))),
                    }
                    let mut got = vec![0u64; 30_000];
                    d.read(0, &mut got)?;
                    let want: Vec<u64> = (0..30_000).map(|i| (peer * 1_000_000 + i) as u64).collect();
                    if got != want {
                        return Err(Error::InvalidArgument(format!("rank {me}: the other entries had not landed when the run failed")));
                    }
                    comm.barrier()?;
                    let mut ok = comm.transfer_plan().read::<u64>(&hw, 0, &d, 0, 30_000).build()?;
                    ok.run()?;
                    comm.barrier()
                })
            };
            go().map_err(|e| format!("rank {me}: {e}"))?;
            comm.finalize().map_err(|e| format!("rank {me}: finalize: {e}"))
        },
    );
    all_ok(res).unwrap();
}

/// 2-D blocks: column shards of a row-major matrix move as one transfer each, read and
/// written; two shards land interleaved in one destination (not an overlap); rows that
/// would overlap are refused when the plan is built.
pub fn strided_blocks_move_column_shards(s: &Suite) {
    use ferroccl::Strided;
    let (rows, cols) = (64usize, 48usize);
    let res = run_world(
        2,
        |r| params(s, r),
        |comm| -> RankResult<()> {
            let me = comm.rank();
            let peer = 1 - me;
            let m = |rank: usize, r: usize, c: usize| (rank * 100_000 + r * 1000 + c) as u32;
            let mut mat: Vec<u32> = (0..rows * cols).map(|i| m(me, i / cols, i % cols)).collect();
            let mut dst = vec![0u32; rows * cols + 2 * GUARD];
            let mut go = || -> ferroccl::Result<()> {
                comm.scope(|sc| {
                    let w = sc.register_mut(&mut mat)?;
                    let d = sc.register_mut(&mut dst)?;
                    let mut all = vec![0u8; RemoteHandle::BYTES * 2];
                    comm.allgather_into(&w.handle().to_bytes(), &mut all)?;
                    let h = RemoteHandle::from_bytes(&all[peer * 40..peer * 40 + 40])?;
                    let g = GUARD; // elements of guard before the destination matrix
                                   // The peer's columns 16..40 into my columns 0..24, its columns 0..24 into
                                   // my columns 24..48: two blocks interleaved row by row.
                    let a = Strided { rows, row_len: 24, from_stride: cols, to_stride: cols };
                    let mut plan =
                        comm.transfer_plan().read_strided::<u32>(&h, 16, &d, g, a).read_strided::<u32>(&h, 0, &d, g + 24, a).build()?;
                    plan.run()?;
                    let mut got = vec![0u32; rows * cols + 2 * GUARD];
                    d.read(0, &mut got)?;
                    for r in 0..rows {
                        for c in 0..cols {
                            let want = if c < 24 { m(peer, r, c + 16) } else { m(peer, r, c - 24) };
                            if got[g + r * cols + c] != want {
                                return Err(Error::InvalidArgument(format!(
                                    "rank {me}: [{r}][{c}] = {}, want {want}",
                                    got[g + r * cols + c]
                                )));
                            }
                        }
                    }
                    if got[..g].iter().chain(&got[g + rows * cols..]).any(|&x| x != 0) {
                        return Err(Error::InvalidArgument(format!("rank {me}: a strided read wrote outside its rows")));
                    }
                    comm.barrier()?;
                    // Write my destination's columns 0..8 back into the peer's columns 40..48.
                    let back = Strided { rows, row_len: 8, from_stride: cols, to_stride: cols };
                    comm.transfer_plan().write_strided::<u32>(&d, g, &h, 40, back).build()?.run()?;
                    comm.barrier()?;
                    let mut mine = vec![0u32; rows * cols];
                    w.read(0, &mut mine)?;
                    for r in 0..rows {
                        for c in 0..cols {
                            // My columns 40..48 now hold what the peer read from my columns 16..24.
                            let want = if c >= 40 { m(me, r, c - 40 + 16) } else { m(me, r, c) };
                            if mine[r * cols + c] != want {
                                return Err(Error::InvalidArgument(format!(
                                    "rank {me}: after the write [{r}][{c}] = {}, want {want}",
                                    mine[r * cols + c]
                                )));
                            }
                        }
                    }
                    // Refused when built: two blocks whose rows cross, rows on each other,
                    // and a block past the end of the window.
                    let crossing = comm
                        .transfer_plan()
                        .read_strided::<u32>(&h, 0, &d, g, Strided { rows: 4, row_len: 10, from_stride: cols, to_stride: cols })
                        .read_strided::<u32>(&h, 0, &d, g + 9, Strided { rows: 4, row_len: 10, from_stride: cols, to_stride: cols })
                        .build();
                    let own = comm
                        .transfer_plan()
                        .read_strided::<u32>(&h, 0, &d, g, Strided { rows: 4, row_len: 10, from_stride: cols, to_stride: 5 })
                        .build();
                    let past = comm
                        .transfer_plan()
                        .read_strided::<u32>(&h, 40, &d, g, Strided { rows, row_len: 9, from_stride: cols, to_stride: cols })
                        .build();
                    for (what, r, needle) in [
                        ("crossing blocks", crossing, "entries 0 and 1"),
                        ("rows on each other", own, "land on each other"),
                        ("past the end", past, "do not fit"),
                    ] {
                        match r {
                            Err(Error::InvalidArgument(msg)) if msg.contains(needle) => {}
                            Err(e) => return Err(Error::InvalidArgument(format!("rank {me}: {what}: {e}"))),
                            Ok(_) => return Err(Error::InvalidArgument(format!("rank {me}: {what}: built"))),
                        }
                    }
                    comm.barrier()
                })
            };
            go().map_err(|e| format!("rank {me}: {e}"))?;
            comm.finalize().map_err(|e| format!("rank {me}: finalize: {e}"))
        },
    );
    all_ok(res).unwrap();
}

/// A plan's signal (`TransferPlanBuilder::signal`) is raised at the end of every run, after
/// every write of the run has landed: the target, waiting for each run's version, finds
/// that run's data in its window, every time; `run` numbers the runs 1, 2, ...
pub fn transfer_plan_signals_follow_their_writes(s: &Suite) {
    let runs = 30u64;
    let sizes = [3000usize, 200, 7000];
    let total: usize = sizes.iter().sum();
    let res = run_world(
        2,
        |r| params(s, r),
        |comm| -> RankResult<()> {
            let me = comm.rank();
            let mut tensors: Vec<Vec<f32>> = sizes.iter().map(|&n| vec![0f32; n]).collect();
            let mut inbox = vec![0f32; total];
            let mut go = || -> ferroccl::Result<()> {
                comm.scope(|sc| {
                    let mut ws = Vec::new();
                    for t in tensors.iter_mut() {
                        ws.push(sc.register_mut(t)?);
                    }
                    let wi = sc.register_mut(&mut inbox)?;
                    let mut all = vec![0u8; RemoteHandle::BYTES * 2];
                    comm.allgather_into(&wi.handle().to_bytes(), &mut all)?;
                    let h1 = RemoteHandle::from_bytes(&all[40..80])?;
                    if me == 0 {
                        let mut b = comm.transfer_plan();
                        let mut at = 0;
                        for (t, w) in ws.iter().enumerate() {
                            b = b.write::<f32>(w, 0, &h1, at, sizes[t]);
                            at += sizes[t];
                        }
                        let mut plan = b.signal(1).build()?;
                        for k in 1..=runs {
                            for (t, w) in ws.iter().enumerate() {
                                w.write(0, &vec![k as f32; sizes[t]])?;
                            }
                            if k % 2 == 0 {
                                plan.run_with_signal(k)?
                            } else {
                                plan.run()?
                            }
                            comm.barrier()?;
                        }
                    } else {
                        for k in 1..=runs {
                            let v = comm.wait_signal(0, k)?;
                            let mut got = vec![0f32; total];
                            wi.read(0, &mut got)?;
                            if v != k || got.iter().any(|&x| x != k as f32) {
                                return Err(Error::InvalidArgument(format!("run {k}: signal {v}, data not all {k}")));
                            }
                            comm.barrier()?;
                        }
                    }
                    comm.barrier()
                })
            };
            go().map_err(|e| format!("rank {me}: {e}"))?;
            comm.finalize().map_err(|e| format!("rank {me}: finalize: {e}"))
        },
    );
    all_ok(res).unwrap();
}

/// Bytes of the window `reads_of_windows_are_zero_copy_over_verbs` reads: over one
/// zero-copy piece (8 MiB), so a whole read is split, and odd.
const ZC_LEN: usize = (8 << 20) + 4099;

/// A window is registered with verbs once, when it is made, and peers read it with RDMA
/// READ, without its owner: over verbs the owner's statistics show the window's bytes
/// registered (`window_bytes_verbs`), no `GET` served and no byte written by the owner
/// (zero copy or staged), and the reader's show exactly the bytes read as RDMA READs
/// (it fails if reads still went to the owner). Over shm and tcp nothing is registered
/// with verbs and the owner serves the three reads (`gets_served`). Then a window leaked with
/// `mem::forget` ends with its scope (its memory region's lease must not keep the scope
/// waiting) and is gone from the statistics.
pub fn reads_of_windows_are_zero_copy_over_verbs(s: &Suite) {
    let verbs = s.wire == Wire::Verbs;
    let res = run_world(
        2,
        |r| params(s, r),
        |comm| -> RankResult<()> {
            let me = comm.rank();
            let fail = |what: String| Error::InvalidArgument(format!("rank {me}: {what}"));
            let run = || -> ferroccl::Result<()> {
                let data: Vec<u8> = (0..ZC_LEN).map(|i| (i * 7 + me * 3 + 1) as u8).collect();
                // (offset, length) of each read rank 1 makes of rank 0's window.
                let reads = [(0, ZC_LEN), (4097, 100_003), (ZC_LEN - 1, 1)];
                let read_bytes: usize = reads.iter().map(|r| r.1).sum();
                comm.scope(|sc| {
                    let w = sc.register(&data)?;
                    let hs = gather_handles(&comm, &w.handle()).map_err(Error::InvalidArgument)?;
                    let before = comm.registration_stats();
                    let want = if verbs { ZC_LEN as u64 } else { 0 };
                    if before.windows != 1 || before.window_bytes_verbs != want {
                        return Err(fail(format!("window statistics before the reads {before:?}, expected {want} bytes with verbs")));
                    }
                    comm.barrier()?;
                    if me == 1 {
                        for &(off, len) in &reads {
                            let mut got = vec![0u8; len];
                            comm.read_into(&hs[0], off, &mut got)?;
                            if let Some(i) = (0..len).find(|&i| got[i] != ((off + i) * 7 + 1) as u8) {
                                return Err(fail(format!("read of [{off}, +{len}): byte {i} is {}", got[i])));
                            }
                        }
                    }
                    comm.barrier()?;
                    let after = comm.registration_stats();
                    let zero_copy = after.verbs_zero_copy_bytes - before.verbs_zero_copy_bytes;
                    let staged = after.verbs_staged_bytes - before.verbs_staged_bytes;
                    let served = after.gets_served - before.gets_served;
                    let read = after.verbs_read_bytes - before.verbs_read_bytes;
                    let want_served = if !verbs && me == 0 { reads.len() as u64 } else { 0 };
                    let want_read = if verbs && me == 1 { read_bytes as u64 } else { 0 };
                    if zero_copy != 0 || staged != 0 || served != want_served || read != want_read {
                        return Err(fail(format!(
                            "while rank 1 read {read_bytes} bytes: the owner wrote {zero_copy} bytes zero copy and {staged} staged \
                             (expected 0 and 0) and served {served} GETs (expected {want_served}); {read} bytes read with RDMA \
                             READ (expected {want_read}); statistics {after:?}"
                        )));
                    }
                    if after.windows_registered != before.windows_registered {
                        return Err(fail(format!("reads registered windows: statistics {after:?}")));
                    }
                    let held = if verbs && me == 1 { 1 } else { 0 };
                    if after.peer_regions_held != held {
                        return Err(fail(format!("{} peer regions held, expected {held}: {after:?}", after.peer_regions_held)));
                    }
                    comm.barrier()?;
                    Ok(())
                })?;
                comm.scope(|sc| {
                    let w = sc.register(&data)?;
                    std::mem::forget(w);
                    Ok(())
                })?;
                let st = comm.registration_stats();
                if st.windows != 0 || st.window_bytes_verbs != 0 || st.windows_registered != 2 {
                    return Err(fail(format!("statistics after the scopes {st:?}: no window should be left")));
                }
                comm.barrier()
            };
            run().map_err(|e| format!("rank {me}: {e}"))?;
            comm.finalize().map_err(|e| format!("rank {me}: finalize: {e}"))
        },
    );
    all_ok(res).unwrap();
}

/// Writes of registered read-write windows larger than `FERROCCL_EAGER_MAX` are RDMA
/// WRITEs by the writer over verbs: the owner serves no `PUT` for them (every byte arrives,
/// including with `put_signal`, whose signal the owner sees only after the data), the
/// writer counts their bytes in `verbs_window_write_bytes`; the one small write is a
/// single `PUT` the owner serves; over shm and tcp the owner serves them all. A write
/// through a forged read-write handle of a read-only window is refused (`ReadOnly`): a
/// large one before anything reaches the NIC, a small one by the owner; the window is
/// untouched.
pub fn writes_of_windows_are_zero_copy_over_verbs(s: &Suite) {
    let res = run_world(
        2,
        |r| params(s, r),
        |comm| -> RankResult<()> {
            let me = comm.rank();
            let verbs = comm.transport_to(1 - me) == Some(ferroccl::TransportKind::Verbs);
            if s.wire == Wire::Verbs && !verbs {
                return Err(format!("rank {me}: the verbs suite reaches rank {} without verbs", 1 - me));
            }
            let fail = |what: String| Error::InvalidArgument(format!("rank {me}: {what}"));
            let run = || -> ferroccl::Result<()> {
                let src: Vec<u8> = (0..ZC_LEN).map(|i| (i * 5 + 3) as u8).collect();
                let ro_mem = vec![9u8; 4096];
                let mut dst = vec![0u8; ZC_LEN];
                // (offset, length) of each write rank 1 makes into rank 0's window: two
                // above the eager limit (RDMA WRITEs over verbs), one byte (a `PUT`).
                let writes = [(0usize, ZC_LEN / 2), (ZC_LEN / 2 + 13, 100_003), (ZC_LEN - 1, 1)];
                let eager = Params::default().eager_max;
                let (small, big): (Vec<&(usize, usize)>, Vec<_>) = writes.iter().partition(|w| w.1 <= eager);
                let written: usize = big.iter().map(|w| w.1).sum();
                // `put_signal` of more than the eager limit: RDMA WRITE, then the signal.
                let signalled = 4096..4096 + eager + 4096;
                comm.scope(|sc| {
                    let w = sc.register_mut(&mut dst)?;
                    let ro = sc.register(&ro_mem)?;
                    let hs = gather_handles(&comm, &w.handle()).map_err(Error::InvalidArgument)?;
                    let ros = gather_handles(&comm, &ro.handle()).map_err(Error::InvalidArgument)?;
                    let before = comm.registration_stats();
                    comm.barrier()?;
                    if me == 1 {
                        for &(off, len) in &writes {
                            comm.write_from(&hs[0], off, &src[off..off + len])?;
                        }
                        comm.put_signal(&hs[0], signalled.start, &src[signalled.clone()], 1)?;
                        // Forged read-write (and, for the large write, longer than the
                        // window): a small write is refused by the owner (a `PUT` it
                        // serves), over verbs a large one here, before anything reaches
                        // the NIC (elsewhere the owner finds its range wrong first).
                        let mut claims = ros[0].to_bytes();
                        claims[12] = 2;
                        claims[32..40].copy_from_slice(&(ZC_LEN as u64).to_le_bytes());
                        let claims = RemoteHandle::from_bytes(&claims)?;
                        let lens: &[usize] = if verbs { &[8, eager + 1] } else { &[8] };
                        for &len in lens {
                            match comm.write_from(&claims, 0, &src[..len]) {
                                Err(Error::Refused { reason: Refusal::ReadOnly, .. }) => {}
                                other => return Err(fail(format!("write of {len} bytes through a forged read-write handle: {other:?}"))),
                            }
                        }
                    } else {
                        comm.wait_signal(1, 1)?;
                    }
                    comm.barrier()?;
                    let after = comm.registration_stats();
                    let served = after.puts_served - before.puts_served;
                    let moved = after.verbs_window_write_bytes - before.verbs_window_write_bytes;
                    let want_moved = if verbs && me == 1 { (written + signalled.len()) as u64 } else { 0 };
                    // The small writes and the small forged one.
                    let want_served = if verbs && me == 0 { small.len() as u64 + 1 } else { 0 };
                    if (verbs && served != want_served) || (!verbs && me == 0 && served == 0) || moved != want_moved {
                        return Err(fail(format!(
                            "while rank 1 wrote {written} + {} bytes (and {} small writes): the owner served {served} PUTs \
                             (expected {}); {moved} bytes written with RDMA WRITE (expected {want_moved}); statistics {after:?}",
                            signalled.len(),
                            small.len(),
                            if verbs { want_served.to_string() } else { "some".into() }
                        )));
                    }
                    drop(w);
                    drop(ro);
                    Ok(())
                })?;
                if me == 0 {
                    for &(off, len) in &writes {
                        if let Some(i) = (off..off + len).find(|&i| dst[i] != src[i]) {
                            return Err(fail(format!("write of [{off}, +{len}): byte {i} is {}", dst[i])));
                        }
                    }
                    if ro_mem.iter().any(|&b| b != 9) {
                        return Err(fail("a read-only window was written".into()));
                    }
                }
                comm.barrier()
            };
            run().map_err(|e| format!("rank {me}: {e}"))?;
            comm.finalize().map_err(|e| format!("rank {me}: finalize: {e}"))
        },
    );
    all_ok(res).unwrap();
}

/// Allocated windows are shared segments: ranks reached over shm map them at the first
/// access and copy in and out directly (counted in `peer_windows_mapped`), by every path
/// (blocking, in a scope, a plan with strided rows, `put_signal`); a forged key or length
/// finds no segment and the owner refuses the access; a handle whose segment flag is forged
/// onto a registered window still works (served by its owner); a window dropped while a
/// peer reads it in a loop gives that peer whole correct reads until the first refusal
/// (`NoWindow`), and refusals only after it.
pub fn shared_windows_are_mapped_and_refused_after_drop(s: &Suite) {
    use ferroccl::{Strided, TransportKind};
    let n = 3usize;
    let len = 4096usize;
    let res = run_world(
        n,
        |r| params(s, r),
        |comm| -> RankResult<()> {
            let me = comm.rank();
            let near: Vec<usize> = (0..n).filter(|&q| q != me && comm.transport_to(q) == Some(TransportKind::Shm)).collect();
            if s.wire == crate::harness::Wire::Shm && near.len() != n - 1 {
                return Err(format!("rank {me}: shm suite, but peers {near:?} are reached over shm"));
            }
            let val = |owner: usize, writer: usize, i: usize| (owner * 1_000_000 + writer * 10_000 + i) as u32;
            let mut plain = vec![0u32; 64];
            let mut go = || -> ferroccl::Result<()> {
                let w = comm.alloc_window::<u32>(len)?;
                if !w.handle().is_shared() {
                    return Err(Error::InvalidArgument(format!("rank {me}: alloc_window made no shared segment")));
                }
                let hs = gather_handles(&comm, &w.handle()).map_err(Error::InvalidArgument)?;
                // Writes: my stripe of every window (mine included), half blocking, half put_signal.
                let stripe = len / n;
                for (owner, h) in hs.iter().enumerate() {
                    let data: Vec<u32> = (0..stripe).map(|i| val(owner, me, i)).collect();
                    if owner % 2 == 0 {
                        comm.write_from(h, me * stripe, &data)?;
                    } else {
                        comm.put_signal(h, me * stripe, &data, 1)?;
                    }
                }
                for from in 0..n {
                    if me % 2 == 1 {
                        comm.wait_signal(from, 1)?;
                    }
                }
                comm.barrier()?;
                let want = |owner: usize| -> Vec<u32> {
                    (0..len).map(|i| if i < n * stripe { val(owner, i / stripe, i % stripe) } else { 0 }).collect()
                };
                // Reads: blocking, and two in a scope.
                for (owner, h) in hs.iter().enumerate() {
                    let mut got = vec![0u32; len];
                    comm.read_into(h, 0, &mut got)?;
                    if got != want(owner) {
                        return Err(Error::InvalidArgument(format!("rank {me}: blocking read of rank {owner}'s window")));
                    }
                    let (mut a, mut b) = (vec![0u32; 100], vec![0u32; 100]);
                    comm.scope(|sc| {
                        let ra = sc.read_into(h, 7, &mut a)?;
                        let rb = sc.read_into(h, len - 100, &mut b)?;
                        ra.wait()?;
                        rb.wait()
                    })?;
                    if a[..] != want(owner)[7..107] || b[..] != want(owner)[len - 100..] {
                        return Err(Error::InvalidArgument(format!("rank {me}: scoped reads of rank {owner}'s window")));
                    }
                }
                // A plan: column 3..7 of every row of the next rank's window, seen as 64 x 64.
                let next = (me + 1) % n;
                let mut cols = vec![0u32; 64 * 4];
                comm.scope(|sc| {
                    let d = sc.register_mut(&mut cols)?;
                    let shape = Strided { rows: 64, row_len: 4, from_stride: 64, to_stride: 4 };
                    comm.transfer_plan().read_strided::<u32>(&hs[next], 3, &d, 0, shape).build()?.run()
                })?;
                let wn = want(next);
                if (0..64).any(|r| cols[r * 4..r * 4 + 4] != wn[r * 64 + 3..r * 64 + 7]) {
                    return Err(Error::InvalidArgument(format!("rank {me}: strided plan read of rank {next}'s window")));
                }
                // A plan of a read and a write with the next rank's window, run five times
                // (on shm, copies by this thread), then each rank finds the last run's write.
                // (Everyone has checked the windows before anyone writes them again.)
                comm.barrier()?;
                let mut small = vec![0u32; 16];
                comm.scope(|sc| {
                    let d = sc.register_mut(&mut small)?;
                    let mut p =
                        comm.transfer_plan().read::<u32>(&hs[next], 0, &d, 0, 8).write::<u32>(&d, 8, &hs[next], len - 8, 8).build()?;
                    for k in 0..5u32 {
                        d.write(8, &[me as u32 * 100 + k; 8])?;
                        p.run()?;
                    }
                    let mut head = [0u32; 8];
                    d.read(0, &mut head)?;
                    if head[..] != wn[..8] {
                        return Err(Error::InvalidArgument(format!("rank {me}: plan read of rank {next}'s window")));
                    }
                    Ok(())
                })?;
                comm.barrier()?;
                let prev = (me + n - 1) % n;
                let mut tail = [0u32; 8];
                w.read(len - 8, &mut tail)?;
                if tail != [prev as u32 * 100 + 4; 8] {
                    return Err(Error::InvalidArgument(format!("rank {me}: rank {prev}'s plan wrote {tail:?} into my window")));
                }
                let mapped = comm.registration_stats().peer_windows_mapped;
                if mapped != near.len() {
                    return Err(Error::InvalidArgument(format!("rank {me}: {mapped} peer windows mapped, {} peers on shm", near.len())));
                }
                // Forged: another key, a longer length. Neither finds a segment; the owner refuses.
                let mut buf = vec![0u32; 8];
                let mut forged = hs[next].to_bytes();
                forged[16] ^= 0x5a;
                match comm.read_into(&RemoteHandle::from_bytes(&forged)?, 0, &mut buf) {
                    Err(Error::Refused { reason: Refusal::NoWindow, .. }) => {}
                    other => return Err(Error::InvalidArgument(format!("rank {me}: forged key: {other:?}"))),
                }
                let mut longer = hs[next].to_bytes();
                longer[32..40].copy_from_slice(&((len as u64 + 64) * 4).to_le_bytes());
                match comm.read_into(&RemoteHandle::from_bytes(&longer)?, len, &mut buf) {
                    Err(Error::Refused { reason: Refusal::OutOfRange, .. }) => {}
                    other => return Err(Error::InvalidArgument(format!("rank {me}: forged length: {other:?}"))),
                }
                // A registered window whose handle claims a segment: its owner serves it.
                comm.scope(|sc| {
                    let p = sc.register_mut(&mut plain)?;
                    p.write(0, &[me as u32 + 40; 64])?;
                    let ps = gather_handles(&comm, &p.handle()).map_err(Error::InvalidArgument)?;
                    let mut claim = ps[next].to_bytes();
                    claim[13] = 1;
                    let claim = RemoteHandle::from_bytes(&claim)?;
                    let mut got = vec![0u32; 64];
                    comm.read_into(&claim, 0, &mut got)?;
                    if got != vec![next as u32 + 40; 64] {
                        return Err(Error::InvalidArgument(format!("rank {me}: registered window behind a forged segment flag")));
                    }
                    comm.barrier()
                })?;
                // Rank 0 drops its window while rank 1 reads it in a loop.
                comm.barrier()?;
                if me == 0 {
                    std::thread::sleep(Duration::from_millis(20));
                    drop(w);
                    comm.barrier()?;
                } else {
                    let w0 = want(0);
                    let t0 = std::time::Instant::now();
                    let (mut ok, mut refused) = (0u64, 0u64);
                    loop {
                        let mut got = vec![0u32; 512];
                        match comm.read_into(&hs[0], 1000, &mut got) {
                            Ok(()) if refused == 0 => {
                                if got[..] != w0[1000..1512] {
                                    return Err(Error::InvalidArgument(format!("rank {me}: read {ok} during the drop is wrong")));
                                }
                                ok += 1;
                            }
                            Ok(()) => return Err(Error::InvalidArgument(format!("rank {me}: a read succeeded after a refusal"))),
                            Err(Error::Refused { reason: Refusal::NoWindow, .. }) => {
                                refused += 1;
                                if refused == 3 {
                                    break;
                                }
                            }
                            Err(e) => return Err(e),
                        }
                        if t0.elapsed() > Duration::from_secs(15) {
                            return Err(Error::InvalidArgument(format!("rank {me}: no refusal 15 s after the drop")));
                        }
                    }
                    match comm.write_from(&hs[0], 0, &[1u32]) {
                        Err(Error::Refused { reason: Refusal::NoWindow, .. }) => {}
                        other => return Err(Error::InvalidArgument(format!("rank {me}: write after the drop: {other:?}"))),
                    }
                    comm.barrier()?;
                    drop(w);
                }
                comm.barrier()
            };
            go().map_err(|e| format!("rank {me}: {e}"))?;
            comm.finalize().map_err(|e| format!("rank {me}: finalize: {e}"))
        },
    );
    all_ok(res).unwrap();
}

/// Signals need no window: ranks that never made one raise and wait for each other's
/// signals (both ways, several values), and a rank whose windows are all dropped still
/// answers requests (with a refusal).
pub fn signals_need_no_window(s: &Suite) {
    let res = run_world(
        2,
        |r| params(s, r),
        |comm| -> RankResult<()> {
            let me = comm.rank();
            let peer = 1 - me;
            let go = || -> ferroccl::Result<()> {
                for v in [1u64, 2, 10] {
                    if me == 0 {
                        comm.signal(peer, v)?;
                        comm.wait_signal(peer, v)?;
                    } else {
                        comm.wait_signal(peer, v)?;
                        comm.signal(peer, v)?;
                    }
                }
                let w = comm.alloc_window::<u8>(16)?;
                let hs = gather_handles(&comm, &w.handle()).map_err(Error::InvalidArgument)?;
                drop(w);
                comm.barrier()?;
                let mut b = [0u8; 4];
                match comm.read_into(&hs[peer], 0, &mut b) {
                    Err(Error::Refused { reason: Refusal::NoWindow, .. }) => {}
                    other => return Err(Error::InvalidArgument(format!("read of a dropped last window: {other:?}"))),
                }
                comm.barrier()
            };
            go().map_err(|e| format!("rank {me}: {e}"))?;
            comm.finalize().map_err(|e| format!("rank {me}: finalize: {e}"))
        },
    );
    all_ok(res).unwrap();
}

/// A window dropped while a peer reads it in a loop (over verbs with RDMA READs of the
/// window's memory region, which the drop revokes before deregistering it): the reader
/// gets whole, correct reads (blocking 1 MiB reads, and pairs of reads in flight together
/// in a scope), then only `NoWindow` refusals, never a broken connection; after it the
/// communicator works (a barrier, an allreduce), and no peer's region is held any more.
/// Over verbs the reads before the drop went without the owner (`verbs_read_bytes`).
pub fn reads_during_a_drop_are_whole_then_refused(s: &Suite) {
    const LEN: usize = 1 << 20;
    let verbs = s.wire == Wire::Verbs;
    let res = run_world(
        2,
        |r| params(s, r),
        |comm| -> RankResult<()> {
            let me = comm.rank();
            let fail = |what: String| Error::InvalidArgument(format!("rank {me}: {what}"));
            let run = || -> ferroccl::Result<()> {
                let data: Vec<u8> = (0..LEN).map(|i| (i * 13 + 5) as u8).collect();
                let w = comm.alloc_window::<u8>(LEN)?;
                w.write(0, &data)?;
                let hs = gather_handles(&comm, &w.handle()).map_err(Error::InvalidArgument)?;
                comm.barrier()?;
                if me == 0 {
                    // Rank 1 says when it has read a few times (and holds the region over
                    // verbs); then the window goes while it keeps reading.
                    comm.wait_signal(1, 1)?;
                    drop(w);
                } else {
                    let before = comm.registration_stats();
                    let t0 = std::time::Instant::now();
                    let (mut ok, mut refused) = (0u64, 0u64);
                    let mut whole = vec![0u8; LEN];
                    let (mut a, mut b) = (vec![0u8; 4096], vec![0u8; 4096]);
                    loop {
                        let k = ok + refused;
                        let r = if k % 2 == 0 {
                            comm.read_into(&hs[0], 0, &mut whole).map(|()| whole == data)
                        } else {
                            comm.scope(|sc| {
                                let ra = sc.read_into(&hs[0], 100, &mut a)?;
                                let rb = sc.read_into(&hs[0], LEN - 4096, &mut b)?;
                                let (x, y) = (ra.wait(), rb.wait());
                                x.and(y)
                            })
                            .map(|()| a[..] == data[100..4196] && b[..] == data[LEN - 4096..])
                        };
                        match r {
                            Ok(true) if refused == 0 => {
                                ok += 1;
                                if ok == 4 {
                                    comm.signal(0, 1)?;
                                }
                            }
                            Ok(true) => return Err(fail(format!("read {k} succeeded after {refused} refusals"))),
                            Ok(false) => return Err(fail(format!("read {k} returned wrong bytes ({ok} whole reads before it)"))),
                            Err(Error::Refused { reason: Refusal::NoWindow, .. }) => {
                                refused += 1;
                                if refused == 4 {
                                    break;
                                }
                            }
                            Err(e) => return Err(fail(format!("read {k} ({ok} whole reads, {refused} refusals before it): {e}"))),
                        }
                        if t0.elapsed() > Duration::from_secs(30) {
                            return Err(fail(format!("{ok} reads and {refused} refusals in 30 s: the drop did not end them")));
                        }
                    }
                    if ok < 4 {
                        return Err(fail(format!("only {ok} reads before the refusals")));
                    }
                    let read = comm.registration_stats().verbs_read_bytes - before.verbs_read_bytes;
                    if verbs && read < 4 * 4096 {
                        return Err(fail(format!("{read} bytes read with RDMA READ over verbs")));
                    }
                    drop(w);
                }
                // The connection is whole: a barrier and a collective.
                comm.barrier()?;
                let mut x = [me as u64 + 1, 10];
                comm.allreduce(&mut x, ferroccl::ReduceOp::Sum)?;
                if x != [3, 20] {
                    return Err(fail(format!("allreduce after the drop gave {x:?}")));
                }
                let st = comm.registration_stats();
                if st.peer_regions_held != 0 || st.windows != 0 {
                    return Err(fail(format!("statistics after the drops {st:?}: no window or peer region should be left")));
                }
                comm.barrier()
            };
            run().map_err(|e| format!("rank {me}: {e}"))?;
            comm.finalize().map_err(|e| format!("rank {me}: finalize: {e}"))
        },
    );
    all_ok(res).unwrap();
}
