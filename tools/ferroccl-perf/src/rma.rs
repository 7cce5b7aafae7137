//! `ferroccl-perf rma`: moving a "model" of scattered tensors from one rank to another
//! every step with one-sided reads, the way the Monarch RDMA notebook compares it (see
//! `--help`).

use std::time::Instant;

use ferroccl::{Communicator, RemoteHandle, TransportKind, Window};

use crate::args::{self};
use crate::sub::{self, fail, Common};
use crate::Failure;

/// `ferroccl-perf rma`'s usage, printed with every command-line error.
pub const USAGE: &str = "usage: ferroccl-perf rma [--case tiny|small|large|all] [--steps N] [--rounds R] [--ranks 2 | under ferroccl-run -n 2 --] [--transport T]";

pub(crate) const ABOUT_MORE: &str = "\
Rank 1 holds a model of scattered f32 tensors; every step rank 0 reads all of it into one
buffer of its own, one of five ways (the Monarch notebook's experiment, plus references):
  (a) register   rank 1 registers every tensor afresh and sends the handles, rank 0 reads
                 each with read_into into plain memory (registering it: both sides register
                 every step, and every tensor costs a round trip)
  (b) contig     one contiguous window registered once, read by a transfer plan of one
                 read into a window of rank 0's (registered once too)
  (c) plan       scattered windows registered once, a transfer plan of one read per
                 tensor, all in flight at once
  memcpy         rank 0 copies the same bytes within its own memory
  sendrecv       rank 1 sends the contiguous bytes, rank 0 receives them (two-sided)
  read_into      one blocking read_into of (b)'s window into plain memory
  write_from     one blocking write_from of the same bytes into (b)'s window (the
                 other direction: rank 0 writes rank 1's window; not checked)
  shared read    read_into, from a window rank 1 made with alloc_window (a shared segment:
                 over shm rank 0 maps it and copies, rank 1 does nothing)
  shared write   write_from into that window (not checked)
  shared plan    (b) from that window: a plan of one read (over shm: copies by rank 0's
                 own thread, no job)
Cases: tiny (one 8-byte tensor: latency), small (10,000 + 50,000 + 20,000 f32),
1mib (one 1 MiB tensor), large (64 tensors of 1 MiB). Each round runs every way for N steps, in an order that
flips every round (the order above, then reversed, ...); the table gives, per way, the median
time of a step on rank 0 (barriers between steps are not timed), its bandwidth, and
ratios to memcpy and to (b). Every step's last element is checked.";

/// What `--help` says first.
pub(crate) const ABOUT: &str = "ferroccl-perf rma: one-sided reads of a scattered model, registered every step vs once vs a plan";

/// What `--help` says after the options.
pub(crate) const AFTER_HELP: &str = "exit status: 0 success; 1 a call failed or a check failed; 2 bad arguments.";

/// `ferroccl-perf rma`'s options.
#[derive(Clone, Debug, PartialEq, clap::Args)]
pub struct RmaOptions {
    /// tiny, small, 1mib, large or all
    #[arg(long, value_name = "CASE", default_value = "all", value_parser = ["tiny", "small", "1mib", "large", "all"])]
    pub case: String,
    /// Steps per way per round
    #[arg(long, value_name = "N", default_value = "30", allow_hyphen_values = true, value_parser = args::whole::<1>)]
    pub steps: usize,
    /// Rounds
    #[arg(long, value_name = "R", default_value = "5", allow_hyphen_values = true, value_parser = args::whole::<1>)]
    pub rounds: usize,
    /// `--ranks`, `--transport`, `--no-bind`: the options every subcommand shares, parsed
    /// once ([`crate::sub::Common`]) and copied here.
    #[arg(skip)]
    pub common: Common,
}

const WAYS: [&str; 10] = [
    "(a) register",
    "(b) contig",
    "(c) plan",
    "memcpy",
    "sendrecv",
    "read_into",
    "write_from",
    "shared read",
    "shared write",
    "shared plan",
];

/// One rank's run.
pub fn run(o: &RmaOptions) -> Result<(), Failure> {
    let comm = o.common.init()?;
    if comm.size() != 2 {
        let rank = comm.rank();
        let e = ferroccl::Error::InvalidArgument(format!("ferroccl-perf rma runs on 2 ranks, not {}", comm.size()));
        return Err(Failure::Collective { rank, what: "start".into(), source: Box::new(e) });
    }
    let cases: Vec<(&str, Vec<usize>)> =
        [("tiny", vec![2usize]), ("small", vec![10_000, 50_000, 20_000]), ("1mib", vec![1 << 18]), ("large", vec![1 << 18; 64])]
            .into_iter()
            .filter(|(c, _)| o.case == "all" || o.case == *c)
            .collect();
    let mut wrong = 0;
    for (name, sizes) in cases {
        wrong += one_case(&comm, o, name, &sizes)?;
    }
    sub::finish(comm, wrong)
}

/// Value `i` of the model in `step` (so that a step that moved stale bytes is caught).
fn val(i: usize, step: usize) -> f32 {
    ((i * 7 + step) % 1_000_003) as f32
}

fn one_case(comm: &Communicator, o: &RmaOptions, name: &str, sizes: &[usize]) -> Result<u64, Failure> {
    let me = comm.rank();
    let total: usize = sizes.iter().sum();
    let mut tensors: Vec<Vec<f32>> = sizes.iter().map(|&n| vec![0f32; n]).collect();
    let mut contig = vec![0f32; if me == 1 { total } else { 0 }];
    let mut dst = vec![0f32; total];
    // Plain (unregistered) memory: (a)'s and sendrecv's destination on rank 0, the source
    // of sendrecv on rank 1, memcpy's source on rank 0.
    let mut plain = vec![0f32; total];
    let local_src = vec![1f32; if me == 0 { total } else { 0 }];
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); WAYS.len()];
    let mut wrong = 0u64;
    comm.scope(|s| {
        // Set up once: (b)'s contiguous window, (c)'s windows, both plans.
        let wcontig = s.register_mut(&mut contig)?;
        let mut wts: Vec<Window<'_>> = Vec::new();
        for t in tensors.iter_mut() {
            wts.push(s.register_mut(t)?);
        }
        let wdst = s.register_mut(&mut dst)?;
        let wshared = comm.alloc_window::<f32>(if me == 1 { total } else { 0 })?;
        let mine: Vec<u8> =
            [wcontig.handle(), wshared.handle()].into_iter().chain(wts.iter().map(|w| w.handle())).flat_map(|h| h.to_bytes()).collect();
        let mut all = vec![0u8; mine.len() * 2];
        comm.allgather_into(&mine, &mut all)?;
        let theirs: Vec<RemoteHandle> =
            all[mine.len()..].chunks(RemoteHandle::BYTES).map(RemoteHandle::from_bytes).collect::<ferroccl::Result<_>>()?;
        let mut shared_plan = if me == 0 { Some(comm.transfer_plan().read::<f32>(&theirs[1], 0, &wdst, 0, total).build()?) } else { None };
        let (mut contig_plan, mut plan) = if me == 0 {
            let one = comm.transfer_plan().read::<f32>(&theirs[0], 0, &wdst, 0, total).build()?;
            let mut b = comm.transfer_plan();
            let mut at = 0;
            for (k, &n) in sizes.iter().enumerate() {
                b = b.read::<f32>(&theirs[2 + k], 0, &wdst, at, n);
                at += n;
            }
            (Some(one), Some(b.build()?))
        } else {
            (None, None)
        };
        let mut step = 0usize;
        for round in 0..o.rounds {
            let order: Vec<usize> = if round % 2 == 0 { (0..WAYS.len()).collect() } else { (0..WAYS.len()).rev().collect() };
            for &way in &order {
                for _ in 0..o.steps {
                    step += 1;
                    // The owner writes this step's model (every layout), then both meet.
                    let mut fresh: Vec<Vec<f32>> = Vec::new();
                    if me == 1 {
                        let mut at = 0;
                        for (k, w) in wts.iter().enumerate() {
                            w.write(sizes[k] - 1, &[val(at + sizes[k] - 1, step)])?;
                            at += sizes[k];
                        }
                        wcontig.write(total - 1, &[val(total - 1, step)])?;
                        wshared.write(total - 1, &[val(total - 1, step)])?;
                        plain[total - 1] = val(total - 1, step);
                        if way == 0 {
                            // (a) registers these copies of the tensors (made before the clock).
                            fresh = wts
                                .iter()
                                .zip(sizes)
                                .map(|(w, &n)| {
                                    let mut t = vec![0f32; n];
                                    w.read(0, &mut t).map(|()| t)
                                })
                                .collect::<ferroccl::Result<_>>()?;
                        }
                    }
                    comm.barrier()?;
                    let t0 = Instant::now();
                    match (way, me) {
                        (0, _) => comm.scope(|s2| {
                            // Registered afresh, handles sent, one read_into per tensor (each
                            // registering its destination too).
                            let mut ws = Vec::new();
                            for t in fresh.iter_mut() {
                                ws.push(s2.register_mut(t)?);
                            }
                            let bytes: Vec<u8> = ws.iter().flat_map(|w| w.handle().to_bytes()).collect();
                            let n = RemoteHandle::BYTES * sizes.len();
                            let mut all = vec![0u8; 2 * n];
                            let pad = vec![0u8; n - bytes.len()];
                            let mine: Vec<u8> = bytes.iter().chain(&pad).copied().collect();
                            comm.allgather_into(&mine, &mut all)?;
                            if me == 0 {
                                let mut at = 0;
                                for (k, c) in all[n..].chunks(RemoteHandle::BYTES).enumerate() {
                                    comm.read_into(&RemoteHandle::from_bytes(c)?, 0, &mut plain[at..at + sizes[k]])?;
                                    at += sizes[k];
                                }
                            }
                            comm.barrier()
                        })?,
                        (1, 0) => contig_plan.as_mut().map_or(Ok(()), |p| p.run())?,
                        (2, 0) => plan.as_mut().map_or(Ok(()), |p| p.run())?,
                        (3, 0) => wdst.write(0, &local_src)?,
                        (4, 0) => comm.recv(&mut plain, 1)?,
                        (4, 1) => comm.send(&plain, 0)?,
                        // One blocking call each, contiguous, into (from) plain memory.
                        (5, 0) => comm.read_into(&theirs[0], 0, &mut plain)?,
                        (6, 0) => comm.write_from(&theirs[0], 0, &local_src)?,
                        (7, 0) => comm.read_into(&theirs[1], 0, &mut plain)?,
                        (8, 0) => comm.write_from(&theirs[1], 0, &local_src)?,
                        (9, 0) => shared_plan.as_mut().map_or(Ok(()), |p| p.run())?,
                        _ => {}
                    }
                    let dt = t0.elapsed().as_secs_f64() * 1e6;
                    if me == 0 {
                        times[way].push(dt);
                        let last = match way {
                            0 | 4 | 5 | 7 => Some(plain[total - 1]),
                            1 | 2 | 9 => {
                                let mut l = [0f32];
                                wdst.read(total - 1, &mut l)?;
                                Some(l[0])
                            }
                            _ => None,
                        };
                        if last.is_some_and(|l| l != val(total - 1, step)) {
                            wrong += 1;
                        }
                    }
                    comm.barrier()?;
                }
            }
        }
        drop((contig_plan.take(), plan.take(), shared_plan.take()));
        comm.barrier()?;
        drop(wshared);
        Ok(())
    })
    .map_err(fail(comm, format!("rma {name}")))?;
    if me == 0 {
        report(comm, name, sizes, total, o, &mut times);
    }
    Ok(wrong)
}

fn report(comm: &Communicator, name: &str, sizes: &[usize], total: usize, o: &RmaOptions, times: &mut [Vec<f64>]) {
    let bytes = (total * 4) as f64;
    let transport = comm.transport_to(1).map_or("?", TransportKind::name);
    println!(
        "# rma {name}: {} tensor(s), {} B, 2 ranks over {transport}; {} rounds x {} steps per way, median us per step on rank 0",
        sizes.len(),
        total * 4,
        o.rounds,
        o.steps
    );
    println!("# {:<14} {:>12} {:>10} {:>10} {:>10}", "way", "us/step", "GB/s", "x memcpy", "x (b)");
    let med: Vec<f64> = times.iter_mut().map(|v| sub::median(v)).collect();
    for (k, w) in WAYS.iter().enumerate() {
        println!("  {:<14} {:>12.2} {:>10.2} {:>10.2} {:>10.2}", w, med[k], bytes / med[k] / 1e3, med[k] / med[3], med[k] / med[1]);
    }
}
