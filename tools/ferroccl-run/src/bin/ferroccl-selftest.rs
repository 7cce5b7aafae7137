//! ferroccl-selftest: checks a job's mesh, run under ferroccl-run (or any supported launcher).
//!
//! ```text
//! ferroccl-selftest exchange [--sizes 0,1,4097,4K,1M,64M] [--seed S]   every pair, both ways, checked byte for byte
//! ferroccl-selftest barrier [--iters N]
//! ferroccl-selftest split                                              split into two groups that work independently
//! ferroccl-selftest kill --victim R --during barrier|transfer|read|plan|allreduce
//!                                                                      rank R SIGKILLs itself mid-operation (allreduce: of 4 f32)
//! ferroccl-selftest stranger                                           strangers knock on the store and the mesh
//! ferroccl-selftest all [--sizes ...]                                  exchange + barrier + split in one job
//! ferroccl-selftest stall --rank R --secs S                            rank R arrives S seconds late to a barrier
//! ferroccl-selftest mismatch --bytes N                                 rank 0 sends N bytes, rank 1 expects N+1
//! ferroccl-selftest stop [--during send|allreduce]                    rank 1 SIGSTOPs itself in the middle of a 512 MiB send to rank 0
//!                                                                      (allreduce: while every rank loops on an allreduce of 4 f32)
//! ferroccl-selftest coll [--counts 0,1,7,1000,65537]                 every collective, f32/bf16/i32, sum/max/avg, checked
//! ferroccl-selftest soak [--ops N]                                    N mixed calls (random collective, size, dtype; blocking, scopes, plans),
//!                                                                      checked; RSS, fds, threads and /dev/shm entries sampled and held flat
//! ferroccl-selftest flood                                              rank 0 floods rank 1 with messages; rank 1 never reads, then dies
//! ferroccl-selftest engine [--runs N]                                  non-blocking collectives in flight together, plans run N times, groups, checked
//! ferroccl-selftest abort                                              rank 0 aborts while rank 1 waits in an allreduce; both must fail promptly
//! ferroccl-selftest fault --case C [--count N]                         a deliberate misuse; every rank must report an error (see `fault`)
//! ferroccl-selftest die-in-init --victim R --after-ms D [--delay-ms L] rank R SIGKILLs itself D ms into init; the others start init L ms late
//! ferroccl-selftest scope --case kill|stop|abort|mismatch              4 ranks: a failure reaches only the communicators it must (see `scope`)
//! ferroccl-selftest shrink --victim R[,R...] [--stop] [--dies-in-shrink R[,R...]]
//!                                                                      survivors of each victim's death shrink and carry on (see `shrink`)
//! ferroccl-selftest weights [--sources M] [--versions V]               M->N weight sync: the first M ranks (default half) train, the others
//!                   [--kill-source-at V | --kill-dest-at V]            pull and check every byte of every version; the last source (or
//!                                                                      destination) SIGKILLs itself mid-write (before pulling) of version V
//! ```
//! Global option: `--fake-hosts K` pretends ranks live on hosts of K ranks each
//! (FERROCCL_HOST_ID = rank / K), to exercise mixed shm/tcp meshes on one machine.
//! Exit status 0 when every check passed; on failure it prints `selftest: rank R error: ...`.
#![forbid(unsafe_code)]

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use ferroccl::comm::Communicator;
use ferroccl::TransportKind;
use ferroccl_run::testkit::{fill, first_mismatch, flag, human, parse_size, partner, rounds};

type R<T> = Result<T, Box<dyn std::error::Error>>;

/// What a rank holds, sampled: resident memory (KiB), open file descriptors, threads, and
/// FerroCCL's entries in /dev/shm (the whole job's).
fn holdings() -> [u64; 4] {
    let count = |dir: &str| std::fs::read_dir(dir).map(|d| d.count() as u64).unwrap_or(0);
    let rss = std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1).and_then(|p| p.parse::<u64>().ok()))
        .unwrap_or(0)
        * 4;
    let shm = std::fs::read_dir("/dev/shm")
        .map(|d| d.filter_map(|e| e.ok()).filter(|e| e.file_name().to_string_lossy().contains("ferroccl")).count() as u64)
        .unwrap_or(0);
    [rss, count("/proc/self/fd"), count("/proc/self/task"), shm]
}

/// `--ops` (default 4,000) mixed calls, the same sequence on every rank (a seeded generator):
/// allreduce (f32, bf16, i32), allgather, broadcast (a rotating root), reduce_scatter,
/// scopes of two non-blocking allreduces, and persistent plans run three times, of 1 to
/// 65,536 elements; every result checked. At the start and every 250 calls the rank samples
/// its resident memory, file descriptors, threads and the job's /dev/shm entries; after the
/// first 1,000 calls (warm-up: caches fill) descriptors, threads and shm entries must not
/// move and memory must not grow by more than 8 MiB.
fn soak(comm: &Communicator, args: &[String]) -> R<()> {
    use ferroccl::ReduceOp;
    use ferroccl_kernels::bf16;
    let ops: usize = flag(args, "--ops").unwrap_or("4000").parse()?;
    let (n, me) = (comm.size(), comm.rank());
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let tri = (n * (n + 1) / 2) as f32;
    let mut samples: Vec<(usize, [u64; 4])> = Vec::new();
    let at_start = holdings();
    let bad = |what: String| -> Box<dyn std::error::Error> { format!("rank {me}: soak: {what}").into() };
    for i in 0..ops {
        let count = 1 + (next() % 65_536) as usize;
        match next() % 7 {
            0 => {
                let mut x = vec![(me + 1) as f32; count];
                comm.allreduce(&mut x, ReduceOp::Sum)?;
                if x.iter().any(|&v| v != tri) {
                    return Err(bad(format!("call {i}: f32 allreduce of {count} gave {}", x[0])));
                }
            }
            1 => {
                let mut x = vec![bf16::from_f32((me + 1) as f32); count];
                comm.allreduce(&mut x, ReduceOp::Sum)?;
                if x.iter().any(|&v| v.to_f32() != tri) {
                    return Err(bad(format!("call {i}: bf16 allreduce of {count} gave {}", x[0])));
                }
            }
            2 => {
                let send: Vec<i32> = (0..count).map(|k| (me * 1000 + k % 1000) as i32).collect();
                let mut got = vec![0i32; count * n];
                comm.allgather_into(&send, &mut got)?;
                if (0..n).any(|r| got[r * count..][..count].iter().enumerate().any(|(k, &v)| v != (r * 1000 + k % 1000) as i32)) {
                    return Err(bad(format!("call {i}: allgather of {count} is wrong")));
                }
            }
            3 => {
                let root = i % n;
                let mut x = vec![if me == root { (i % 251) as u8 } else { 0 }; count];
                comm.broadcast(&mut x, root)?;
                if x.iter().any(|&v| v != (i % 251) as u8) {
                    return Err(bad(format!("call {i}: broadcast of {count} from {root} is wrong")));
                }
            }
            4 => {
                let per = count.div_ceil(n);
                let send = vec![(me + 1) as f32; per * n];
                let mut got = vec![0f32; per];
                comm.reduce_scatter_into(&send, &mut got, ReduceOp::Sum)?;
                if got.iter().any(|&v| v != tri) {
                    return Err(bad(format!("call {i}: reduce_scatter of {per} per rank gave {}", got[0])));
                }
            }
            5 => {
                let mut a = vec![(me + 1) as f32; count];
                let mut b = vec![me as i32; 1 + count / 7];
                comm.scope(|s| {
                    let ra = s.start(ferroccl::op::allreduce(&mut a, ReduceOp::Sum))?;
                    let rb = s.start(ferroccl::op::allreduce(&mut b, ReduceOp::Max))?;
                    rb.wait()?;
                    ra.wait()
                })?;
                if a.iter().any(|&v| v != tri) || b.iter().any(|&v| v != (n - 1) as i32) {
                    return Err(bad(format!("call {i}: a scope's allreduces of {count} are wrong")));
                }
            }
            _ => {
                let mut x = vec![0f32; count];
                let mut plan = comm.plan(ferroccl::op::allreduce(&mut x, ReduceOp::Sum))?;
                for run in 0..3 {
                    plan.output_mut().fill((me + run) as f32);
                    plan.run()?;
                    let want: f32 = (0..n).map(|r| (r + run) as f32).sum();
                    if plan.output().iter().any(|&v| v != want) {
                        return Err(bad(format!("call {i}: plan run {run} of {count} is wrong")));
                    }
                }
            }
        }
        if (i + 1) % 250 == 0 {
            samples.push((i + 1, holdings()));
        }
    }
    comm.barrier()?;
    let after: Vec<&(usize, [u64; 4])> = samples.iter().filter(|s| s.0 > ops.min(1000)).collect();
    let (Some(first), Some(last)) = (after.first(), after.last()) else {
        return Err(bad(format!("{ops} calls are too few to sample after the warm-up")));
    };
    let show = |s: &[u64; 4]| format!("rss {} KiB, fds {}, threads {}, shm {}", s[0], s[1], s[2], s[3]);
    for (k, name) in [(1, "file descriptors"), (2, "threads"), (3, "/dev/shm entries")] {
        if after.iter().any(|s| s.1[k] != first.1[k]) {
            let seen: Vec<u64> = after.iter().map(|s| s.1[k]).collect();
            return Err(bad(format!("{name} moved after the warm-up: {seen:?}")));
        }
    }
    if last.1[0] > first.1[0] + 8 * 1024 {
        return Err(bad(format!("memory grew after the warm-up: {} -> {}", show(&first.1), show(&last.1))));
    }
    println!(
        "selftest: rank {me} soak: {ops} calls checked; at the start: {}; after call {}: {}; after call {}: {}",
        show(&at_start),
        first.0,
        show(&first.1),
        last.0,
        show(&last.1)
    );
    Ok(())
}

/// Ends a subcommand that ends the process itself: 0, or 1 saying `selftest: WHAT error: ...`.
fn exit_with(what: &str, r: R<()>) -> ! {
    match r {
        Ok(()) => std::process::exit(0),
        Err(e) => {
            eprintln!("selftest: {what} error: {e}");
            std::process::exit(1);
        }
    }
}

/// Stops (SIGSTOP) or kills (SIGKILL) this process 0.3 s from now, from another thread.
fn signal_self_soon(stop: bool) {
    use nix::sys::signal::Signal;
    let sig = if stop { Signal::SIGSTOP } else { Signal::SIGKILL };
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        let _ = nix::sys::signal::kill(nix::unistd::getpid(), sig);
    });
}

/// Shrink after failures, in rounds: in round k every rank loops on small allreduces and
/// the process launched as the k-th of `--victim R[,R...]` kills itself 0.3 s in (SIGKILL),
/// or with `--stop` stops itself (SIGSTOP: the others time out, and the shrink leaves it
/// out at its deadline; one victim only). The survivors see the failure (after a kill its
/// root cause must name the victim's process: launch rank and pid, whatever the shrunk
/// numbering), shrink, check their new ranks and the first collectives of the shrunk
/// communicator (small and large allreduce, barrier, allgather of the launch ranks), run
/// 200 more allreduces, and go on to the next round on it. `--dies-in-shrink R[,R...]`:
/// launch ranks that die inside the first shrink (the test sets `FERROCCL_INJECT_FAULT`),
/// which the survivors must leave out. At the end the survivors finalize and exit 0 (the
/// lowest then kills a stopped victim; the job's status is the victims').
fn shrink(comm: Communicator, args: &[String]) -> ! {
    let run = || -> R<()> {
        use ferroccl::ReduceOp;
        let list = |name: &str| -> R<Vec<usize>> {
            flag(args, name)
                .map_or(Ok(Vec::new()), |s| s.split(',').map(|v| v.parse().map_err(|_| format!("{name}: {v:?}").into())).collect())
        };
        let victims = list("--victim")?;
        if victims.is_empty() {
            return Err("--victim R[,R...] required".into());
        }
        let in_shrink = list("--dies-in-shrink")?;
        let stop = args.iter().any(|a| a == "--stop");
        let (n0, me) = (comm.size(), comm.rank());
        let mut pids = vec![0u32; n0];
        comm.allgather_into(&[std::process::id()], &mut pids)?;
        let mut alive: Vec<usize> = (0..n0).collect();
        let mut comm = comm;
        for (round, &victim) in victims.iter().enumerate() {
            if me == victim {
                signal_self_soon(stop);
            }
            let start = Instant::now();
            let mut calls = 0u64;
            let want: f32 = alive.iter().map(|&r| (r + 1) as f32).sum();
            let err = loop {
                let mut x = [(me + 1) as f32; 4];
                match comm.allreduce(&mut x, ReduceOp::Sum) {
                    Ok(()) if x == [want; 4] => calls += 1,
                    Ok(()) => return Err(format!("rank {me}: allreduce gave {x:?}, expected {want}").into()),
                    Err(e) => break e,
                }
                if start.elapsed() > Duration::from_secs(60) {
                    return Err("the victim never died".into());
                }
            };
            println!("selftest: rank {me} saw the failure after {:.3}s and {calls} calls: {err}", start.elapsed().as_secs_f64());
            if !stop {
                let cause = err.root_cause().ok_or("no root cause")?;
                let process = cause.process.as_ref().ok_or_else(|| format!("rank {me}: the root cause names no process: {cause}"))?;
                if (process.launch_rank, process.pid) != (victim, pids[victim]) {
                    return Err(format!(
                        "rank {me}: round {round}: the root cause names {process}, not launch rank {victim} (pid {})",
                        pids[victim]
                    )
                    .into());
                }
                println!("selftest: rank {me} round {round}: root cause: {cause}");
            }
            let t = Instant::now();
            let small = comm.shrink()?;
            let took = t.elapsed();
            drop(comm);
            alive.retain(|&r| r != victim && (round > 0 || !in_shrink.contains(&r)));
            let (n2, r2) = (small.size(), small.rank());
            if n2 != alive.len() || alive.get(r2) != Some(&me) {
                return Err(format!(
                    "rank {me}: shrunk to rank {r2} of {n2}, expected rank {} of {}",
                    alive.iter().position(|&r| r == me).unwrap_or(usize::MAX),
                    alive.len()
                )
                .into());
            }
            // The first collectives, checked: launch ranks gathered, sums of launch rank + 1.
            let mut olds = vec![0u32; n2];
            small.allgather_into(&[me as u32], &mut olds)?;
            if olds.iter().map(|&o| o as usize).collect::<Vec<_>>() != alive {
                return Err(format!("rank {me}: the shrunk communicator gathered launch ranks {olds:?}, expected {alive:?}").into());
            }
            let want2 = alive.iter().map(|&r| (r + 1) as f32).sum::<f32>();
            for len in [4usize, 300_000] {
                let mut x = vec![(me + 1) as f32; len];
                small.allreduce(&mut x, ReduceOp::Sum)?;
                if x.iter().any(|&v| v != want2) {
                    return Err(format!("rank {me}: shrunk allreduce of {len} gave {} (expected {want2})", x[0]).into());
                }
            }
            small.barrier()?;
            for _ in 0..200 {
                let mut x = [(me + 1) as f32; 4];
                small.allreduce(&mut x, ReduceOp::Sum)?;
                if x != [want2; 4] {
                    return Err(format!("rank {me}: shrunk allreduce gave {x:?}").into());
                }
            }
            println!("selftest: rank {me} shrank to rank {r2} of {n2} in {:.3}s; 203 calls after it ok", took.as_secs_f64());
            comm = small;
        }
        let lowest = comm.rank() == 0;
        comm.finalize()?;
        if stop && lowest {
            // Nobody else would end the stopped rank.
            let victim = nix::unistd::Pid::from_raw(pids[victims[0]] as i32);
            let _ = nix::sys::signal::kill(victim, nix::sys::signal::Signal::SIGKILL);
        }
        Ok(())
    };
    exit_with("shrink", run())
}

/// Failure scope, on 4 ranks: the world, `pair` (split by rank / 2: {0, 1} and {2, 3}) and
/// `sub` (split from `pair`, the same members). `--case kill`: rank 3 SIGKILLs itself (or
/// `stop`: SIGSTOPs itself) while every rank loops on world allreduces; after the world's
/// failure ranks 0 and 1 run 200 checked allreduces on `pair` and on `sub` and finalize
/// them, rank 2 finds `pair` failed (naming rank 3 when killed); exit 0 (the lowest kills a
/// stopped victim; the job's status is the victim's). `abort`: rank 0 aborts `pair`; ranks
/// 0 and 1 find `pair` and `sub` aborted (rank 1: by rank 0); ranks 2 and 3 run 200 on
/// their `pair`; then every rank runs 100 on the world and finalizes it. `mismatch`: ranks
/// 0 and 1 call `pair`'s allreduce with different counts (both fail); then `sub` and the
/// world run 100 checked allreduces each and are finalized. `shrink`: a split {1, 2, 3} is
/// made, rank 3 SIGKILLs itself as in `kill`; ranks 1 and 2 shrink that split (to 2 ranks),
/// then ranks 0-2 the world (to 3), each shrunk communicator runs 100 checked allreduces
/// and is finalized; ranks 0 and 1 then run 100 on `pair` (never shrunk). Each rank prints
/// what it saw.
fn scope(comm: Communicator, args: &[String]) -> ! {
    let run = || -> R<()> {
        use ferroccl::{Error, ReduceOp};
        let case = flag(args, "--case").unwrap_or("kill").to_string();
        let (n, me) = (comm.size(), comm.rank());
        if n != 4 {
            return Err("scope needs 4 ranks".into());
        }
        let mut pids = vec![0u32; n];
        comm.allgather_into(&[std::process::id()], &mut pids)?;
        let pair = comm.split(Some((me / 2) as u32), me as i64)?.ok_or("no pair")?;
        let sub = pair.split(Some(0), me as i64)?.ok_or("no sub")?;
        comm.barrier()?;
        // `calls` checked allreduces of 4 f32 on `c`, whose members' world ranks are `ws`.
        let sums = |c: &Communicator, ws: &[usize], calls: usize| -> ferroccl::Result<Result<(), String>> {
            let want = ws.iter().map(|&w| (w + 1) as f32).sum::<f32>();
            for _ in 0..calls {
                let mut x = [(me + 1) as f32; 4];
                c.allreduce(&mut x, ReduceOp::Sum)?;
                if x != [want; 4] {
                    return Ok(Err(format!("rank {me}: allreduce gave {x:?}, expected {want}")));
                }
            }
            Ok(Ok(()))
        };
        let mine: Vec<usize> = if me < 2 { vec![0, 1] } else { vec![2, 3] };
        let world: Vec<usize> = (0..n).collect();
        let blame = |e: &Error| e.root_cause().and_then(|c| c.rank);
        let victim = 3;
        // Rank 3 kills (or stops) itself while every rank loops on world allreduces: the
        // world's error.
        let world_fails = |stop: bool| -> R<Error> {
            if me == victim {
                signal_self_soon(stop);
            }
            let start = Instant::now();
            loop {
                match sums(&comm, &world, 1) {
                    Ok(Ok(())) => {}
                    Ok(Err(bad)) => return Err(bad.into()),
                    Err(e) => return Ok(e),
                }
                if start.elapsed() > Duration::from_secs(60) {
                    return Err("the victim never failed".into());
                }
            }
        };
        match case.as_str() {
            "kill" | "stop" => {
                let stop = case == "stop";
                let err = world_fails(stop)?;
                if !stop && blame(&err) != Some(victim) {
                    return Err(format!("rank {me}: the world's error does not blame rank {victim}: {err}").into());
                }
                if me < 2 {
                    sums(&pair, &mine, 200)?.map_err(|e| format!("pair: {e}"))?;
                    sums(&sub, &mine, 200)?.map_err(|e| format!("sub: {e}"))?;
                    sub.finalize()?;
                    pair.finalize()?;
                    println!("selftest: rank {me} scope {case}: world failed: {err}; pair and sub carried on: 400 calls checked");
                    if stop && me == 0 {
                        let v = nix::unistd::Pid::from_raw(pids[victim] as i32);
                        let _ = nix::sys::signal::kill(v, nix::sys::signal::Signal::SIGKILL);
                    }
                } else {
                    let perr = match sums(&pair, &mine, 1) {
                        Ok(_) => return Err(format!("rank {me}: pair with the failed rank {victim} still worked").into()),
                        Err(e) => e,
                    };
                    if !stop && blame(&perr) != Some(victim) {
                        return Err(format!("rank {me}: the pair's error does not blame rank {victim}: {perr}").into());
                    }
                    println!("selftest: rank {me} scope {case}: world failed: {err}; pair failed: {perr}");
                }
            }
            "shrink" => {
                // {0} and {1, 2, 3}: a split that loses a member and keeps two.
                let trio = comm.split(Some(u32::from(me >= 1)), me as i64)?.ok_or("no trio")?;
                comm.barrier()?;
                let err = world_fails(false)?;
                if blame(&err) != Some(victim) {
                    return Err(format!("rank {me}: the world's error does not blame rank {victim}: {err}").into());
                }
                // The survivors of a communicator shrink it: the trio's two (ranks 1, 2),
                // then the world's three; a communicator without the victim needs none.
                let shrunk = |c: &Communicator, ws: &[usize]| -> R<()> {
                    let s = c.shrink()?;
                    let at = ws.iter().position(|&w| w == me);
                    if s.size() != ws.len() || Some(s.rank()) != at {
                        return Err(
                            format!("rank {me}: shrunk to rank {} of {}, expected {at:?} of {}", s.rank(), s.size(), ws.len()).into()
                        );
                    }
                    sums(&s, ws, 100)?.map_err(|e| format!("shrunk {ws:?}: {e}"))?;
                    Ok(s.finalize()?)
                };
                if me >= 1 {
                    shrunk(&trio, &[1, 2])?;
                }
                shrunk(&comm, &[0, 1, 2])?;
                if me < 2 {
                    sums(&pair, &mine, 100)?.map_err(|e| format!("pair: {e}"))?;
                    sub.finalize()?;
                    pair.finalize()?;
                }
                println!("selftest: rank {me} scope shrink: world failed: {err}; shrunk and carried on");
            }
            "abort" => {
                if me == 0 {
                    std::thread::sleep(Duration::from_millis(100));
                    pair.abort();
                }
                if me < 2 {
                    let by = if me == 0 { None } else { Some(0) };
                    let start = Instant::now();
                    let perr = loop {
                        match sums(&pair, &mine, 1) {
                            Ok(Ok(())) if start.elapsed() < Duration::from_secs(30) => {}
                            Ok(r) => return Err(format!("rank {me}: the pair was never aborted ({r:?})").into()),
                            Err(e) => break e,
                        }
                    };
                    let serr = sums(&sub, &mine, 1).err().ok_or("the split of the aborted pair still works")?;
                    for (what, e) in [("pair", &perr), ("sub", &serr)] {
                        if !matches!(e, Error::Aborted { by: b, .. } if *b == by) {
                            return Err(format!("rank {me}: {what}: expected aborted by {by:?}, got {e}").into());
                        }
                    }
                    println!("selftest: rank {me} scope abort: pair: {perr}; sub: {serr}");
                    drop((sub, pair));
                } else {
                    sums(&pair, &mine, 200)?.map_err(|e| format!("pair: {e}"))?;
                    sums(&sub, &mine, 200)?.map_err(|e| format!("sub: {e}"))?;
                    sub.finalize()?;
                    pair.finalize()?;
                    println!("selftest: rank {me} scope abort: the other pair carried on: 400 calls checked");
                }
                sums(&comm, &world, 100)?.map_err(|e| format!("world: {e}"))?;
                comm.finalize()?;
                println!("selftest: rank {me} scope abort: world carried on: 100 calls checked");
            }
            "mismatch" => {
                if me < 2 {
                    let mut x = vec![1.0f32; 8 + 4 * me];
                    match pair.allreduce(&mut x, ReduceOp::Sum) {
                        Err(e @ Error::Mismatch { .. }) => println!("selftest: rank {me} scope mismatch: pair: {e}"),
                        other => return Err(format!("rank {me}: a mismatched pair allreduce gave {other:?}").into()),
                    }
                    if sums(&pair, &mine, 1).is_ok() {
                        return Err(format!("rank {me}: the failed pair still works").into());
                    }
                    drop(pair);
                } else {
                    sums(&pair, &mine, 100)?.map_err(|e| format!("pair: {e}"))?;
                    pair.finalize()?;
                }
                sums(&sub, &mine, 100)?.map_err(|e| format!("sub: {e}"))?;
                sub.finalize()?;
                sums(&comm, &world, 100)?.map_err(|e| format!("world: {e}"))?;
                comm.finalize()?;
                println!("selftest: rank {me} scope mismatch: sub and world carried on: 200 calls checked");
            }
            other => return Err(format!("unknown --case {other}").into()),
        }
        Ok(())
    };
    exit_with("scope", run())
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(cmd) = args.first().cloned() else {
        eprintln!("usage: ferroccl-selftest exchange|barrier|split|kill|stranger [options]");
        std::process::exit(2);
    };
    let rest = &args[1..];
    if cmd == "die-in-init" {
        die_in_init(rest);
    }
    let init = || -> ferroccl::Result<Communicator> {
        let Some(k) = flag(rest, "--fake-hosts").and_then(|v| v.parse::<usize>().ok()) else {
            return Communicator::init();
        };
        let launch = ferroccl::bootstrap::env::detect()?;
        let mut params = ferroccl::Params::from_env()?;
        params.host_id = Some(format!("fake-host-{}", launch.rank / k.max(1)));
        Communicator::init_with(launch.into(), params)
    };
    let t_init = Instant::now();
    let comm = match init() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("selftest: init error: {e}");
            // A fault case whose culprit fails before a slow rank's init is done fails
            // that rank's init: its fault line says so, like any other failed call.
            if cmd == "fault" {
                if let Ok(launch) = ferroccl::bootstrap::env::detect() {
                    let case = flag(rest, "--case").unwrap_or("").to_string();
                    report_fault(launch.rank, &case, t_init, Err(e));
                }
            }
            std::process::exit(1);
        }
    };
    let rank = comm.rank();
    println!("selftest: rank {rank} pid {}", std::process::id());
    let result = match cmd.as_str() {
        "exchange" => exchange(&comm, rest),
        "barrier" => barrier(&comm, rest),
        "split" => split(&comm),
        "kill" => kill(&comm, rest),
        "stranger" => stranger(&comm, rest),
        "all" => exchange(&comm, rest).and_then(|()| barrier(&comm, rest)).and_then(|()| split(&comm)),
        "stall" => stall(&comm, rest),
        "mismatch" => mismatch(&comm, rest),
        "stop" => stop(&comm, rest),
        "flood" => flood(&comm),
        "coll" => coll(&comm, rest),
        "engine" => engine(&comm, rest),
        "abort" => abort(comm),
        "fault" => fault(comm, rest),
        "weights" => weights(&comm, rest),
        "shrink" => shrink(comm, rest),
        "scope" => scope(comm, rest),
        "soak" => soak(&comm, rest),
        other => Err(format!("unknown subcommand {other:?}").into()),
    };
    match result.and_then(|()| comm.finalize().map_err(Into::into)) {
        Ok(()) => println!("selftest: rank {rank} ok"),
        Err(e) => {
            eprintln!("selftest: rank {rank} error: {e}");
            std::process::exit(1);
        }
    }
}

/// Prints rank `r`'s `fault` line for `case` (how long it took to fail, and the error's
/// root cause as data) and exits: 1 when it failed, 0 when it did not.
fn report_fault(r: usize, case: &str, t: Instant, res: ferroccl::Result<()>) -> ! {
    match res {
        Err(e) => {
            println!("selftest: rank {r} fault {case}: failed after {:.3}s: {e}", t.elapsed().as_secs_f64());
            match e.root_cause() {
                Some(c) => println!(
                    "selftest: rank {r} fault {case}: root cause {:?} at rank {}",
                    c.kind,
                    c.rank.map_or("unknown".to_string(), |x| x.to_string())
                ),
                None => println!("selftest: rank {r} fault {case}: no root cause"),
            }
            std::process::exit(1)
        }
        Ok(()) => {
            println!("selftest: rank {r} fault {case}: no error after {:.3}s", t.elapsed().as_secs_f64());
            std::process::exit(0)
        }
    }
}

/// Rank `--victim` SIGKILLs itself `--after-ms` into its `Communicator::init` (with the
/// others starting theirs `--delay-ms` later, it dies while its own part of the mesh setup
/// is done and it waits for theirs). Every other rank must fail (init or the barrier after
/// it) instead of waiting; the test then checks that nothing was left behind.
fn die_in_init(args: &[String]) -> ! {
    let num = |f: &str, d: u64| flag(args, f).and_then(|v| v.parse::<u64>().ok()).unwrap_or(d);
    let launch = match ferroccl::bootstrap::env::detect() {
        Ok(l) => l,
        Err(e) => {
            eprintln!("selftest: init error: {e}");
            std::process::exit(1);
        }
    };
    let (rank, victim) = (launch.rank, num("--victim", 1) as usize);
    println!("selftest: rank {rank} pid {}", std::process::id());
    let t0 = Instant::now();
    if rank == victim {
        let after = Duration::from_millis(num("--after-ms", 0));
        std::thread::spawn(move || {
            std::thread::sleep(after);
            let _ = nix::sys::signal::kill(nix::unistd::getpid(), nix::sys::signal::Signal::SIGKILL);
        });
    } else {
        std::thread::sleep(Duration::from_millis(num("--delay-ms", 300)));
    }
    let res = Communicator::init().and_then(|c| {
        c.barrier()?;
        c.finalize()
    });
    let secs = t0.elapsed().as_secs_f64();
    match res {
        Ok(()) => {
            println!("selftest: rank {rank} no error after {secs:.3} s");
            std::process::exit(0)
        }
        Err(e) => {
            println!("selftest: rank {rank} saw the failure after {secs:.3} s: {e}");
            std::process::exit(1)
        }
    }
}

/// Every pair exchanges buffers of every size, both ways, and checks them.
fn exchange_sizes(comm: &Communicator, sizes: &[usize], seed: u64) -> R<()> {
    let (n, me) = (comm.size(), comm.rank());
    for &size in sizes {
        let mut out = vec![0u8; size];
        let mut inb = vec![0u8; size];
        for round in 0..rounds(n) {
            let Some(p) = partner(n, round, me) else { continue };
            fill(&mut out, seed, me, p);
            inb.iter_mut().for_each(|b| *b = 0);
            comm.sendrecv(&out, p, &mut inb, p)?;
            if let Some(i) = first_mismatch(&inb, seed, p, me) {
                return Err(format!("{} from rank {p}: byte {i} is wrong", human(size)).into());
            }
        }
    }
    Ok(())
}

fn exchange(comm: &Communicator, args: &[String]) -> R<()> {
    let sizes: Vec<usize> = flag(args, "--sizes")
        .unwrap_or("0,1,4097,4K,1M,64M")
        .split(',')
        .map(|s| parse_size(s).ok_or_else(|| format!("bad size {s:?}")))
        .collect::<Result<_, _>>()?;
    let seed = flag(args, "--seed").and_then(|s| s.parse().ok()).unwrap_or(42);
    let t = Instant::now();
    exchange_sizes(comm, &sizes, seed)?;
    // Also plain send/recv in a ring, the order-sensitive way.
    let (n, me) = (comm.size(), comm.rank());
    if n > 1 {
        let mut a = vec![0u8; 100_003];
        let mut b = vec![0u8; 100_003];
        fill(&mut a, seed, me, (me + 1) % n);
        if me % 2 == 0 {
            comm.send(&a, (me + 1) % n)?;
            comm.recv(&mut b, (me + n - 1) % n)?;
        } else {
            comm.recv(&mut b, (me + n - 1) % n)?;
            comm.send(&a, (me + 1) % n)?;
        }
        if let Some(i) = first_mismatch(&b, seed, (me + n - 1) % n, me) {
            return Err(format!("ring send/recv: byte {i} is wrong").into());
        }
    }
    comm.barrier()?;
    println!(
        "selftest: rank {me} exchanged {} sizes with {} peers in {:.3}s ({})",
        sizes.len(),
        n - 1,
        t.elapsed().as_secs_f64(),
        (0..n)
            .filter(|&p| p != me)
            .map(|p| format!("{p}:{}", comm.transport_to(p).map_or("?", TransportKind::name)))
            .collect::<Vec<_>>()
            .join(" ")
    );
    Ok(())
}

fn barrier(comm: &Communicator, args: &[String]) -> R<()> {
    let iters: usize = flag(args, "--iters").and_then(|s| s.parse().ok()).unwrap_or(100);
    let t = Instant::now();
    for _ in 0..iters {
        comm.barrier()?;
    }
    println!("selftest: rank {} {iters} barriers, {:.1} us each", comm.rank(), t.elapsed().as_secs_f64() * 1e6 / iters as f64);
    Ok(())
}

fn split(comm: &Communicator) -> R<()> {
    let (n, me) = (comm.size(), comm.rank());
    // Two groups by parity, ordered backwards by key; the last rank of an odd world sits
    // out when n >= 3 to test the "no color" case.
    let out = n >= 3 && n % 2 == 1 && me == n - 1;
    let color = if out { None } else { Some((me % 2) as u32) };
    let sub = comm.split(color, -(me as i64))?;
    let Some(sub) = sub else {
        println!("selftest: rank {me} sat out of the split");
        comm.barrier()?;
        return Ok(());
    };
    let members: Vec<usize> = (0..n).filter(|&r| r % 2 == me % 2 && !(n >= 3 && n % 2 == 1 && r == n - 1)).collect();
    if sub.size() != members.len() {
        return Err(format!("sub-communicator has {} ranks, expected {}", sub.size(), members.len()).into());
    }
    // Keys are -rank, so the order is reversed.
    let want_rank = members.iter().rev().position(|&r| r == me).ok_or("lost")?;
    if sub.rank() != want_rank {
        return Err(format!("sub rank {} expected {want_rank}", sub.rank()).into());
    }
    // The groups work independently: different amounts of traffic, different sizes.
    let iters = if me % 2 == 0 { 20 } else { 5 };
    for i in 0..iters {
        exchange_sizes(&sub, &[0, 7, 70_000 + i], 1000 + i as u64 + (me % 2) as u64)?;
        sub.barrier()?;
    }
    // A split of the split.
    if let Some(solo) = sub.split(Some(sub.rank() as u32), 0)? {
        if solo.size() != 1 || solo.rank() != 0 {
            return Err("a split into singletons is wrong".into());
        }
        solo.barrier()?;
    }
    drop(sub);
    comm.barrier()?;
    println!("selftest: rank {me} split ok (group {}, {} members)", me % 2, members.len());
    Ok(())
}

fn kill(comm: &Communicator, args: &[String]) -> R<()> {
    let victim: usize = flag(args, "--victim").and_then(|s| s.parse().ok()).ok_or("--victim R required")?;
    let during = flag(args, "--during").unwrap_or("barrier").to_string();
    let (n, me) = (comm.size(), comm.rank());
    comm.barrier()?;
    let big = vec![7u8; 8 << 20];
    let mut inb = vec![0u8; 8 << 20];
    // One-sided: every rank's 8 MiB window, read by the rank below it (whole, or by a plan
    // of four 2 MiB reads), then a barrier.
    let window = comm.alloc_window::<u8>(8 << 20)?;
    let mut all = vec![0u8; ferroccl::RemoteHandle::BYTES * n];
    comm.allgather_into(&window.handle().to_bytes(), &mut all)?;
    let next = ferroccl::RemoteHandle::from_bytes(&all[(me + 1) % n * 40..][..40])?;
    let landing = comm.alloc_window::<u8>(8 << 20)?;
    let mut plan = (0..4).fold(comm.transfer_plan(), |b, k| b.read::<u8>(&next, k << 21, &landing, k << 21, 1 << 21)).build()?;
    // Every rank is set up (over verbs, registering a window takes a while in an emulated
    // VM): the victim dies at an arbitrary moment in the middle of the work below.
    comm.barrier()?;
    if me == victim {
        std::thread::spawn(|| {
            std::thread::sleep(Duration::from_millis(300));
            let _ = nix::sys::signal::kill(nix::unistd::getpid(), nix::sys::signal::Signal::SIGKILL);
        });
    }
    let start = Instant::now();
    let stop = start + Duration::from_secs(60);
    let res: R<()> = (|| {
        while Instant::now() < stop {
            match during.as_str() {
                // A survivor that failed first drops its window: a read of it is then refused
                // (an answer, not the failure); the barrier after it reports the failure.
                "read" => {
                    match comm.read_into(&next, 0, &mut inb) {
                        Err(ferroccl::Error::Refused { .. }) => {}
                        r => r?,
                    }
                    comm.barrier()?;
                }
                "plan" => {
                    match plan.run() {
                        Err(ferroccl::Error::Refused { .. }) => {}
                        r => r?,
                    }
                    comm.barrier()?;
                }
                "transfer" => {
                    for round in 0..rounds(n) {
                        if let Some(p) = partner(n, round, me) {
                            comm.sendrecv(&big, p, &mut inb, p)?;
                        }
                    }
                }
                // Small enough for the low-latency slots (shm, one host).
                "allreduce" => {
                    let mut x = [me as f32; 4];
                    comm.allreduce(&mut x, ferroccl::ReduceOp::Sum)?;
                }
                _ => comm.barrier()?,
            }
        }
        Ok(())
    })();
    match res {
        Ok(()) => Err("the victim's death went unnoticed for 60 s".into()),
        Err(e) => {
            println!("selftest: rank {me} saw the failure after {:.3}s: {e}", start.elapsed().as_secs_f64());
            Err(e)
        }
    }
}

fn stranger(comm: &Communicator, args: &[String]) -> R<()> {
    let _ = args;
    if comm.rank() == 0 {
        let store = std::env::var("FERROCCL_STORE")?;
        // Garbage bytes.
        if let Ok(mut s) = std::net::TcpStream::connect(&store) {
            let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
            let _ = s.write_all(b"GET / HTTP/1.0\r\n\r\n\xff\xff\xff\xff garbage");
            let mut sink = [0u8; 256];
            let _ = s.read(&mut sink);
        }
        // A wrong token.
        match ferroccl::bootstrap::StoreClient::connect(&store, "not-the-token", 99, Duration::from_secs(5)) {
            Ok(_) => return Err("the store accepted a wrong token".into()),
            Err(e) => println!("selftest: stranger with a wrong token was refused: {e}"),
        }
        // No token at all: connect and hang up at once.
        drop(std::net::TcpStream::connect(&store));
    }
    // The job is unaffected.
    exchange_sizes(comm, &[0, 1, 4096, 1 << 20], 7)?;
    comm.barrier()?;
    Ok(())
}

fn stall(comm: &Communicator, args: &[String]) -> R<()> {
    let late: usize = flag(args, "--rank").and_then(|s| s.parse().ok()).unwrap_or(1);
    let secs: f64 = flag(args, "--secs").and_then(|s| s.parse().ok()).unwrap_or(5.0);
    if comm.rank() == late {
        std::thread::sleep(Duration::from_secs_f64(secs));
    }
    let t = Instant::now();
    let r = comm.barrier();
    if let Err(e) = &r {
        println!("selftest: rank {} barrier failed after {:.3}s: {e}", comm.rank(), t.elapsed().as_secs_f64());
    }
    Ok(r?)
}

fn mismatch(comm: &Communicator, args: &[String]) -> R<()> {
    let n: usize = flag(args, "--bytes").and_then(|s| s.parse().ok()).unwrap_or(16);
    match comm.rank() {
        0 => comm.send(&vec![1u8; n], 1)?,
        1 => {
            let mut b = vec![0u8; n + 1];
            comm.recv(&mut b, 0)?;
        }
        _ => {}
    }
    Ok(())
}

fn stop(comm: &Communicator, args: &[String]) -> R<()> {
    if flag(args, "--during") == Some("allreduce") {
        return stop_in_allreduce(comm);
    }
    let n = 512 << 20;
    match comm.rank() {
        1 => {
            let data = vec![3u8; n];
            std::thread::spawn(|| {
                std::thread::sleep(Duration::from_millis(50));
                let _ = nix::sys::signal::kill(nix::unistd::getpid(), nix::sys::signal::Signal::SIGSTOP);
            });
            comm.send(&data, 0)?;
        }
        0 => {
            let mut buf = vec![0u8; n];
            let t = Instant::now();
            let r = comm.recv(&mut buf, 1);
            if let Err(e) = &r {
                println!("selftest: rank 0 recv failed after {:.3}s: {e}", t.elapsed().as_secs_f64());
            }
            r?;
        }
        _ => {}
    }
    Ok(())
}

/// Every rank loops on an allreduce of 4 f32 (the low-latency protocol over shm); rank 1
/// SIGSTOPs itself 300 ms in. The others must give up at their deadline, naming rank 1:
/// each prints `rank R allreduce failed after S s: ERROR` and, for a timeout, `rank R
/// timeout waiting for [...]`.
fn stop_in_allreduce(comm: &Communicator) -> R<()> {
    let me = comm.rank();
    comm.barrier()?;
    if me == 1 {
        std::thread::spawn(|| {
            std::thread::sleep(Duration::from_millis(300));
            let _ = nix::sys::signal::kill(nix::unistd::getpid(), nix::sys::signal::Signal::SIGSTOP);
        });
    }
    let start = Instant::now();
    let mut last = Instant::now();
    loop {
        let mut x = [me as f32; 4];
        last = match comm.allreduce(&mut x, ferroccl::ReduceOp::Sum) {
            Ok(()) => Instant::now(),
            Err(e) => {
                println!(
                    "selftest: rank {me} allreduce failed after {:.3}s ({:.3}s after the last call returned): {e}",
                    start.elapsed().as_secs_f64(),
                    last.elapsed().as_secs_f64()
                );
                if let ferroccl::Error::Timeout { waiting_for, .. } = &e {
                    println!("selftest: rank {me} timeout waiting for {waiting_for:?}");
                }
                return Err(e.into());
            }
        };
        if start.elapsed() > Duration::from_secs(60) {
            return Err("rank 1's stop went unnoticed for 60 s".into());
        }
    }
}

fn flood(comm: &Communicator) -> R<()> {
    match comm.rank() {
        0 => {
            let msg = vec![1u8; 60_000];
            let t = Instant::now();
            loop {
                if let Err(e) = comm.send(&msg, 1) {
                    println!("selftest: rank 0 send failed after {:.3}s: {e}", t.elapsed().as_secs_f64());
                    return Err(e.into());
                }
                if t.elapsed() > Duration::from_secs(60) {
                    return Err("the receiver's death went unnoticed".into());
                }
            }
        }
        1 => {
            // Never read; die once rank 0's ring to us is surely full.
            std::thread::sleep(Duration::from_millis(500));
            let _ = nix::sys::signal::kill(nix::unistd::getpid(), nix::sys::signal::Signal::SIGKILL);
            Ok(())
        }
        _ => Ok(()),
    }
}

/// An exactly representable value for every dtype (so any reduction order gives the
/// reference result bit for bit).
trait Exact: ferroccl::Element + Copy {
    fn exact(i: u64) -> Self;
}
impl Exact for f32 {
    fn exact(i: u64) -> Self {
        (i % 17) as f32 - 8.0
    }
}
impl Exact for ferroccl_kernels::bf16 {
    fn exact(i: u64) -> Self {
        ferroccl_kernels::bf16::from_f32((i % 17) as f32 - 8.0)
    }
}
impl Exact for i32 {
    fn exact(i: u64) -> Self {
        (i.wrapping_mul(2654435761) >> 3) as i32
    }
}

fn vals<X: Exact>(rank: usize, len: usize, salt: u64) -> Vec<X> {
    (0..len as u64).map(|i| X::exact(i.wrapping_mul(31).wrapping_add(rank as u64 * 1_000_003).wrapping_add(salt))).collect()
}

fn coll_one<X: Exact>(comm: &Communicator, count: usize, op: ferroccl::ReduceOp) -> R<()> {
    use ferroccl_kernels::reduce_many;
    let (n, r) = (comm.size(), comm.rank());
    let ins: Vec<Vec<X>> = (0..n).map(|k| vals(k, count, 1)).collect();
    let wide: Vec<Vec<X>> = (0..n).map(|k| vals(k, count * n, 2)).collect();
    let red = |v: &[Vec<X>]| {
        let mut out = v[0].clone();
        reduce_many(op, &v.iter().map(|x| x.as_slice()).collect::<Vec<_>>(), &mut out);
        out
    };
    let (want, want_wide) = (red(&ins), red(&wide));
    let bad = |what: &str| format!("{what}: count {count} {} {op}: wrong result", X::DTYPE);
    let mut out = vec![X::exact(0); count];
    comm.allreduce_into(&ins[r], &mut out, op)?;
    if out != want {
        return Err(bad("allreduce").into());
    }
    let mut buf = ins[r].clone();
    comm.allreduce(&mut buf, op)?;
    if buf != want {
        return Err(bad("allreduce in place").into());
    }
    let mut out = vec![X::exact(0); count * n];
    comm.allgather_into(&ins[r], &mut out)?;
    if out != ins.concat() {
        return Err(bad("allgather").into());
    }
    let mut out = vec![X::exact(0); count];
    comm.reduce_scatter_into(&wide[r], &mut out, op)?;
    if out[..] != want_wide[r * count..(r + 1) * count] {
        return Err(bad("reduce_scatter").into());
    }
    let root = count % n;
    let mut buf = if r == root { ins[root].clone() } else { vec![X::exact(5); count] };
    comm.broadcast(&mut buf, root)?;
    if buf != ins[root] {
        return Err(bad("broadcast").into());
    }
    let mut out = vec![X::exact(0); count];
    comm.reduce_into(&ins[r], &mut out, op, root)?;
    if r == root && out != want {
        return Err(bad("reduce").into());
    }
    let mut out = vec![X::exact(0); count * n];
    comm.alltoall(&wide[r], &mut out)?;
    let a2a: Vec<X> = (0..n).flat_map(|k| wide[k][r * count..(r + 1) * count].to_vec()).collect();
    if out != a2a {
        return Err(bad("alltoall").into());
    }
    Ok(())
}

fn coll(comm: &Communicator, args: &[String]) -> R<()> {
    use ferroccl::ReduceOp;
    let counts: Vec<usize> = flag(args, "--counts")
        .unwrap_or("0,1,7,1000,65537")
        .split(',')
        .map(|s| parse_size(s).ok_or_else(|| format!("bad count {s:?}")))
        .collect::<Result<_, _>>()?;
    let t = Instant::now();
    for &count in &counts {
        for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Avg] {
            coll_one::<f32>(comm, count, op)?;
            coll_one::<ferroccl_kernels::bf16>(comm, count, op)?;
            coll_one::<i32>(comm, count, op)?;
        }
    }
    comm.barrier()?;
    println!("selftest: rank {} collectives ok for counts {counts:?} in {:.3}s", comm.rank(), t.elapsed().as_secs_f64());
    Ok(())
}

/// The progress engine's API over real processes: non-blocking collectives in flight
/// together and waited in a rank-dependent order, persistent plans run many times with
/// their buffers rewritten, and a group of small allreduces (fused).
fn engine(comm: &Communicator, args: &[String]) -> R<()> {
    use ferroccl::ReduceOp;
    let runs: usize = flag(args, "--runs").unwrap_or("200").parse()?;
    let (n, r) = (comm.size(), comm.rank());
    let t = Instant::now();
    for round in 0..5usize {
        let mut a = vec![(r + round) as f32; 1000];
        let mut b = vec![r as i64; 300_000];
        let send = vec![(r * 3 + round) as u32; 4097];
        let mut gathered = vec![0u32; 4097 * n];
        let mut c = vec![1u8; 3];
        comm.scope(|s| {
            let ra = s.start(ferroccl::op::allreduce(&mut a, ReduceOp::Sum))?;
            let rb = s.start(ferroccl::op::allreduce(&mut b, ReduceOp::Max))?;
            let rg = s.start(ferroccl::op::allgather_into(&send, &mut gathered))?;
            drop(s.start(ferroccl::op::allreduce(&mut c, ReduceOp::Sum))?);
            // Every rank waits in another order.
            match (r + round) % 3 {
                0 => {
                    rg.wait()?;
                    rb.wait()?;
                    ra.wait()
                }
                1 => {
                    while !ra.test()? {
                        std::thread::yield_now();
                    }
                    rg.wait()?;
                    rb.wait()
                }
                _ => {
                    rb.wait()?;
                    ra.wait()?;
                    rg.wait()
                }
            }
        })?;
        let sum_a: f32 = (0..n).map(|q| (q + round) as f32).sum();
        if a.iter().any(|&x| x != sum_a) || b.iter().any(|&x| x != (n - 1) as i64) || c != [n as u8; 3] {
            return Err(format!("round {round}: non-blocking allreduce wrong").into());
        }
        for q in 0..n {
            if gathered[q * 4097..(q + 1) * 4097].iter().any(|&x| x != (q * 3 + round) as u32) {
                return Err(format!("round {round}: allgather block {q} wrong").into());
            }
        }
    }
    let mut small = vec![0.0f32; 16];
    let mut large = vec![0.0f32; 200_000];
    {
        let mut ps = comm.plan(ferroccl::op::allreduce(&mut small, ReduceOp::Sum))?;
        let mut pl = comm.plan(ferroccl::op::allreduce(&mut large, ReduceOp::Sum))?;
        for k in 0..runs {
            ps.output_mut().fill((r + k) as f32);
            ps.run()?;
            let want: f32 = (0..n).map(|q| (q + k) as f32).sum();
            if ps.output().iter().any(|&x| x != want) {
                return Err(format!("plan run {k}: {} != {want}", ps.output()[0]).into());
            }
            if k % 20 == 0 {
                pl.output_mut().fill(k as f32);
                pl.run()?;
                if pl.output().iter().any(|&x| x != (k * n) as f32) {
                    return Err(format!("large plan run {k} wrong").into());
                }
            }
        }
    }
    let mut parts: Vec<Vec<i32>> = (1..8).map(|k| vec![r as i32 * k; k as usize]).collect();
    comm.group(|g| {
        for p in parts.iter_mut() {
            g.add(ferroccl::op::allreduce(p, ReduceOp::Sum))?;
        }
        Ok(())
    })?;
    let rsum: i32 = (0..n as i32).sum();
    for (k, p) in parts.iter().enumerate() {
        if p.iter().any(|&x| x != rsum * (k as i32 + 1)) {
            return Err(format!("group allreduce {k} wrong: {p:?}").into());
        }
    }
    println!("selftest: rank {r} engine ok ({runs} plan runs, {:.2}s)", t.elapsed().as_secs_f64());
    Ok(())
}

/// Rank 0 aborts (from another thread) while it sits in an allreduce rank 1 never joins,
/// and rank 1 waits to receive, on a communicator split from the world (so that neither
/// is a transfer left behind by the other's collective), a message rank 0 never sends:
/// rank 0's call fails with Aborted, rank 1's names rank 0. Prints the times.
fn abort(comm: Communicator) -> ! {
    let r = comm.rank();
    let mut buf = vec![1.0f32; 1000];
    let sub = match comm.split(Some(0), r as i64) {
        Ok(Some(s)) => s,
        other => {
            eprintln!("selftest: rank {r} error: split: {other:?}");
            std::process::exit(1)
        }
    };
    let t = Instant::now();
    let res = std::thread::scope(|s| {
        if r == 0 {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(300));
                comm.abort();
            });
            comm.allreduce(&mut buf, ferroccl::ReduceOp::Sum)
        } else {
            // Rank 1 waits for a message that never comes.
            sub.recv(&mut buf[..1], 0)
        }
    });
    match res {
        Err(e @ ferroccl::Error::Aborted { .. }) => {
            println!("selftest: rank {r} aborted after {:.3}s: {e}", t.elapsed().as_secs_f64());
            std::process::exit(0)
        }
        other => {
            eprintln!("selftest: rank {r} error: expected an abort, got {other:?}");
            std::process::exit(1)
        }
    }
}

/// A deliberate misuse, after a barrier (so that every rank starts its faulty step at about
/// the same time).
/// Every rank prints `selftest: rank R fault CASE: failed after S s: ERROR` (and exits 1) or
/// `selftest: rank R fault CASE: no error` (exit 0: the misuse went unnoticed on that rank).
/// The time counts from the start of the faulty step to the error, finalize included.
///
/// Cases (`--count N` elements of f32, default 1000: eager; 100000: rendezvous):
/// * `bcast-root`: rank 0 broadcasts from root 0, every other rank from root 1;
/// * `bcast-root-next`: the same, then every rank allreduces (none may complete it);
/// * `unmatched-send`: rank 0 sends rank 1 a message rank 1 never receives;
/// * `send-then-coll`: rank 0 sends rank 1 a message, then allreduces; the others only
///   allreduce (rank 1 never receives it);
/// * `recv-then-coll`: rank 1 receives from rank 0, then allreduces; the others only
///   allreduce (rank 0 never sends);
/// * `p2p-across-coll` (no misuse: every rank must succeed): rank 0 sends rank 1 a
///   message in a scope and, before waiting for it, allreduces; rank 1 allreduces, then
///   receives it; then the same the other way round (rank 1's receive in a scope);
/// * `extra-call`: rank 0 makes a broadcast the others do not, then all allreduce;
/// * `skip`: the last rank skips an allreduce and goes on to finalize;
/// * `p2p-len`: rank 0 sends N elements, rank 1 receives N + 1, then both barrier;
/// * `reduce-root`: every rank calls reduce with itself as the root (nobody sends);
/// * `mid-transfer`: send 0 -> 1, allreduce, a fused group of two allreduces, with a
///   barrier after each (run with `FERROCCL_INJECT_FAULT` to fail one rank mid-transfer);
/// * `after-finalize`: every rank finalizes the world, then calls allreduce three times and
///   shrink once on a communicator split from it (each call must fail, saying so);
/// * `ll-coll-mismatch`: rank 0 calls allreduce of N elements, the others allgather of N
///   (both low-latency calls over shm when N is small);
/// * `ll-vs-mesh`: rank 0 calls allreduce of 4 elements (low-latency over shm), the others
///   of N (a schedule when N is large: 1,000,000).
fn fault(comm: Communicator, args: &[String]) -> ! {
    use ferroccl::ReduceOp;
    let case = flag(args, "--case").unwrap_or("").to_string();
    let count: usize = flag(args, "--count").and_then(|s| s.parse().ok()).unwrap_or(1000);
    let (n, r) = (comm.size(), comm.rank());
    let report = |t: Instant, res: ferroccl::Result<()>| -> ! { report_fault(r, &case, t, res) };
    // A fast rank may find the fault while a slow one is still in this barrier: its
    // barrier then fails with the fault, which counts.
    let t = Instant::now();
    if let Err(e) = comm.barrier() {
        report(t, Err(e));
    }
    let mut buf = vec![r as f32; count];
    let t = Instant::now();
    let res: ferroccl::Result<()> = match case.as_str() {
        "bcast-root" => comm.broadcast(&mut buf, usize::from(r != 0).min(n - 1)),
        // The same, then an allreduce: no rank may complete it on top of the broadcast that
        // did not match (a rank whose broadcast returned may learn of it only now).
        "bcast-root-next" => comm.broadcast(&mut buf, usize::from(r != 0).min(n - 1)).and_then(|()| {
            let mut x = [1f32; 4];
            let res = comm.allreduce(&mut x, ReduceOp::Sum);
            if res.is_ok() {
                println!("selftest: rank {r} fault {case}: completed the next allreduce on top of it");
            }
            res
        }),
        "unmatched-send" => match r {
            0 => comm.send(&buf, 1),
            _ => Ok(()),
        },
        // A point-to-point transfer left behind by a collective: rank 0 sends rank 1 a
        // message, then allreduces; rank 1 (and everyone else) only allreduces. Or rank 1
        // waits to receive a message rank 0 never sends.
        "send-then-coll" => match r {
            0 => comm.send(&buf, 1).and_then(|()| comm.allreduce(&mut buf, ReduceOp::Sum)),
            _ => comm.allreduce(&mut buf, ReduceOp::Sum),
        },
        "recv-then-coll" => match r {
            1 => comm.recv(&mut buf, 0).and_then(|()| comm.allreduce(&mut buf, ReduceOp::Sum)),
            _ => comm.allreduce(&mut buf, ReduceOp::Sum),
        },
        // Not a misuse: a send (or receive) left running in a scope while its thread makes
        // a collective first (after 200 ms of other work), the peer taking part in the
        // collective before it receives (or sends). Every rank must succeed.
        "p2p-across-coll" => {
            let mut x = vec![1f32; 4];
            let mut got = vec![0f32; count];
            let res = match r {
                0 => comm.scope(|s| {
                    let q = s.start(ferroccl::op::send(&buf, 1))?;
                    std::thread::sleep(Duration::from_millis(200));
                    comm.allreduce(&mut x, ReduceOp::Sum)?;
                    q.wait()
                }),
                1 => comm.allreduce(&mut x, ReduceOp::Sum).and_then(|()| comm.recv(&mut got, 0)),
                _ => comm.allreduce(&mut x, ReduceOp::Sum),
            };
            let res = res.and_then(|()| match r {
                0 => comm.allreduce(&mut x, ReduceOp::Sum).and_then(|()| comm.send(&buf, 1)),
                1 => comm.scope(|s| {
                    let q = s.start(ferroccl::op::recv(&mut got, 0))?;
                    std::thread::sleep(Duration::from_millis(200));
                    comm.allreduce(&mut x, ReduceOp::Sum)?;
                    q.wait()
                }),
                _ => comm.allreduce(&mut x, ReduceOp::Sum),
            });
            match res {
                Ok(()) if r == 1 && got.iter().any(|&v| v != 0.0) => Err(ferroccl::Error::InvalidArgument(format!("received {}", got[0]))),
                Ok(()) if x != [(n * n) as f32; 4] => Err(ferroccl::Error::InvalidArgument(format!("allreduce gave {x:?}"))),
                other => other,
            }
        }
        "extra-call" => {
            let first = if r == 0 { comm.broadcast(&mut buf, 0) } else { Ok(()) };
            first.and_then(|()| comm.allreduce(&mut buf, ReduceOp::Sum))
        }
        "skip" => {
            if r == n - 1 {
                Ok(())
            } else {
                comm.allreduce(&mut buf, ReduceOp::Sum)
            }
        }
        "p2p-len" => match r {
            0 => comm.send(&buf, 1).and_then(|()| comm.barrier()),
            1 => comm.recv(&mut vec![0f32; count + 1], 0).and_then(|()| comm.barrier()),
            _ => comm.barrier(),
        },
        "reduce-root" => {
            let mut out = vec![0f32; count];
            comm.reduce_into(&buf, &mut out, ReduceOp::Sum, r)
        }
        // The last rank panics instead of joining the allreduce (its communicator drops
        // while the thread unwinds): the others must fail at once, naming it.
        "panic" => {
            if r == n - 1 {
                panic!("selftest: rank {r} panics on purpose");
            }
            comm.allreduce(&mut buf, ReduceOp::Sum)
        }
        // Point-to-point (0 -> 1), an allreduce and a fused group, each followed by a
        // barrier: with FERROCCL_INJECT_FAULT set, one rank fails mid-transfer and the
        // others must fail at once, naming it.
        "mid-transfer" => (|| {
            match r {
                0 if n > 1 => comm.send(&buf, 1)?,
                1 => comm.recv(&mut buf, 0)?,
                _ => {}
            }
            comm.barrier()?;
            comm.allreduce(&mut buf, ReduceOp::Sum)?;
            comm.barrier()?;
            let (mut a, mut b) = (vec![1f32; 16], vec![2f32; 16]);
            comm.group(|g| {
                g.add(ferroccl::op::allreduce(&mut a, ReduceOp::Sum))?;
                g.add(ferroccl::op::allreduce(&mut b, ReduceOp::Sum))
            })?;
            comm.barrier()
        })(),
        "after-finalize" => {
            let sub = match comm.split(Some(0), r as i64) {
                Ok(Some(s)) => s,
                Ok(None) => report(t, Err(ferroccl::Error::InvalidArgument("split left this rank out".into()))),
                Err(e) => report(t, Err(e)),
            };
            if let Err(e) = comm.finalize() {
                report(t, Err(e));
            }
            let t = Instant::now();
            let mut refused = Vec::new();
            for _ in 0..3 {
                match sub.allreduce(&mut buf, ReduceOp::Sum) {
                    Err(e @ ferroccl::Error::Finalized { .. }) => refused.push(e),
                    Err(e) => report(t, Err(e)),
                    Ok(()) => report(t, Ok(())),
                }
            }
            // A shrink too: there is nothing left to recover.
            match sub.shrink() {
                Err(e @ ferroccl::Error::Finalized { .. }) => refused.push(e),
                Err(e) => report(t, Err(e)),
                Ok(_) => report(t, Ok(())),
            }
            println!("selftest: rank {r} fault {case}: refused {} of 4 calls", refused.len());
            report(t, Err(refused.remove(0)))
        }
        "ll-coll-mismatch" => {
            if r == 0 {
                comm.allreduce(&mut buf, ReduceOp::Sum)
            } else {
                comm.allgather_into(&buf, &mut vec![0f32; count * n])
            }
        }
        "ll-vs-mesh" => {
            let len = if r == 0 { count.min(4) } else { count };
            comm.allreduce(&mut buf[..len], ReduceOp::Sum)
        }
        other => {
            eprintln!("selftest: rank {r} error: unknown fault case {other:?}");
            std::process::exit(2)
        }
    };
    report(t, res.and_then(|()| comm.finalize()))
}

/// `extent` cut into `parts` shards, sizes 1 : 2 : 3 ... (uneven), adding up to `extent`.
fn uneven(extent: usize, parts: usize) -> Vec<usize> {
    let total = parts * (parts + 1) / 2;
    let cut = |i: usize| extent * (i * (i + 1) / 2) / total;
    (0..parts).map(|i| cut(i + 1) - cut(i)).collect()
}

/// `extent` cut into `parts` equal shards (the first ones one larger when it does not divide).
fn even(extent: usize, parts: usize) -> Vec<usize> {
    (0..parts).map(|i| extent / parts + usize::from(i < extent % parts)).collect()
}

/// An empty first shard, then [`uneven`] shards (one shard of all when `parts` is 1).
fn with_empty(extent: usize, parts: usize) -> Vec<usize> {
    match parts {
        1 => vec![extent],
        _ => std::iter::once(0).chain(uneven(extent, parts - 1)).collect(),
    }
}

/// Two replicas of even row shards when `ranks` is even, else uneven row shards.
fn mesh(extent: usize, ranks: usize) -> ferroccl::reshard::Placement {
    use ferroccl::reshard::Placement;
    match ranks % 2 {
        0 => Placement::rows_replicated(&even(extent, ranks / 2), 2),
        _ => Placement::rows(&uneven(extent, ranks)),
    }
}

/// The `weights` model: twelve tensors (f32 and bf16, 0.9 MB) placed one way over `m`
/// trainer ranks and another way over `n` inference ranks: replicated, row and column
/// shards (even, uneven, one empty), and 2-replica meshes. Tensor 0 is row-sharded evenly
/// over the trainers and replicated on every inference rank, so every inference rank reads
/// from every trainer.
fn weights_model(m: usize, n: usize) -> R<(ferroccl::reshard::ModelLayout, ferroccl::reshard::ModelLayout)> {
    use ferroccl::reshard::{ModelLayout, Placement as P, TensorLayout};
    use ferroccl::DType::{Bf16, F32};
    type Side = fn(usize, usize) -> P;
    #[rustfmt::skip]
    let spec: [(&str, ferroccl::DType, [usize; 2], Side, Side); 12] = [
        ("embed", Bf16, [256, 64], |e, k| P::rows(&even(e, k)), |_, k| P::replicated(k)),
        ("l0.qkv", F32, [64, 192], |_, k| P::cols(&uneven(192, k)), |e, k| P::rows(&uneven(e, k))),
        ("l0.out", Bf16, [192, 64], |e, k| P::rows(&with_empty(e, k)), |_, k| P::cols(&even(64, k))),
        ("l0.norm", F32, [192, 1], |_, k| P::replicated(k), |e, k| P::rows(&uneven(e, k))),
        ("l0.up", Bf16, [192, 256], mesh, |_, k| P::cols(&uneven(256, k))),
        ("l0.down", F32, [256, 192], |_, k| P::cols(&even(192, k)), mesh),
        ("l1.qkv", Bf16, [64, 192], |e, k| P::rows(&uneven(e, k)), |_, k| P::cols(&with_empty(192, k))),
        ("l1.out", F32, [192, 64], |_, k| P::replicated(k), |_, k| P::cols(&uneven(64, k))),
        ("l1.norm", Bf16, [1, 192], |_, k| P::cols(&uneven(192, k)), |_, k| P::replicated(k)),
        ("l1.up", F32, [192, 256], |e, k| P::rows(&even(e, k)), |e, k| P::rows(&uneven(e, k))),
        ("l1.down", Bf16, [256, 192], |_, k| P::cols(&with_empty(192, k)), mesh),
        ("head", F32, [100, 301], |_, k| P::cols(&uneven(301, k)), |e, k| P::rows(&even(e, k))),
    ];
    let side = |ranks: usize, src: bool| {
        let tensors = spec.iter().map(|&(name, dt, shape, s, d)| {
            let place = if src { s } else { d };
            TensorLayout::new(name, dt, shape, place(shape[0], ranks))
        });
        ModelLayout::new(ranks, tensors.collect())
    };
    Ok((side(m, true)?, side(n, false)?))
}

/// Element (`row`, `col`) of tensor `t` in `version`, as its little-endian bytes (the first
/// `dtype.size()` of them): exact in f32 (integers below 2^24) and in bf16 (-127..=127),
/// and different in every version for every element.
fn weight_bytes(dtype: ferroccl::DType, t: usize, row: usize, col: usize, version: u64) -> [u8; 4] {
    let (t, row, col) = (t as u64, row as u64, col as u64);
    match dtype {
        ferroccl::DType::Bf16 => {
            let x = ((t * 31 + row * 7 + col * 3 + version * 13) % 255) as f32 - 127.0;
            let b = ferroccl_kernels::bf16::from_f32(x).to_le_bytes();
            [b[0], b[1], 0, 0]
        }
        _ => (((t * 1_000_003 + row * 7919 + col * 131 + version * 104_729) % 16_777_213) as f32).to_le_bytes(),
    }
}

/// Calls `f(tensor, row, col, byte offset in the buffer, element bytes)` for every element
/// `rank` holds in `layout`.
fn each_element(
    layout: &ferroccl::reshard::ModelLayout,
    rank: usize,
    mut f: impl FnMut(usize, usize, usize, usize, usize) -> R<()>,
) -> R<()> {
    for (t, tl) in layout.tensors().iter().enumerate() {
        let (Some(b), Some(off)) = (layout.block(rank, t), layout.offset(rank, t)) else { continue };
        let es = tl.dtype().size();
        for r in 0..b.rows {
            for c in 0..b.cols {
                f(t, b.row0 + r, b.col0 + c, off + (r * b.cols + c) * es, es)?;
            }
        }
    }
    Ok(())
}

/// Checks every byte of `rank`'s buffer `buf` against `version` of `layout`; the error names
/// the first wrong element.
fn check_weights(layout: &ferroccl::reshard::ModelLayout, rank: usize, version: u64, buf: &[u8]) -> R<()> {
    each_element(layout, rank, |t, row, col, at, es| {
        let tl = &layout.tensors()[t];
        let want = weight_bytes(tl.dtype(), t, row, col, version);
        if buf[at..at + es] != want[..es] {
            return Err(format!(
                "version {version}: tensor {} ({}) row {row} col {col} is {:02x?}, want {:02x?}",
                tl.name(),
                tl.dtype(),
                &buf[at..at + es],
                &want[..es]
            )
            .into());
        }
        Ok(())
    })
}

/// M->N weight sync (issue 13) over real processes: the first `--sources M` ranks (default
/// half, at least one) are trainers, the others inference ranks, with the
/// [`weights_model`] laid out differently on each side. For each of `--versions V`
/// (default 5) the trainers write every element as a function of (tensor, global row,
/// column, version) and publish it; each inference rank pulls it and checks every byte of
/// its buffer. Prints `selftest: rank R weights ok: V versions, B bytes per sync (...)`.
///
/// `--kill-source-at V`: the last trainer SIGKILLs itself after writing half of its buffer
/// for version V. `--kill-dest-at V`: the last inference rank SIGKILLs itself when it
/// should pull version V. A rank whose sync fails prints `selftest: rank R weights failed
/// at version V: ERROR`, an inference rank followed by `; holding version H, verified`
/// once it checked every byte of its current (front) buffer, which must be the last
/// version it pulled completely.
fn weights(comm: &Communicator, args: &[String]) -> R<()> {
    use ferroccl::WeightRole;
    let (n, me) = (comm.size(), comm.rank());
    let num =
        |f: &str| -> R<Option<u64>> { flag(args, f).map(|v| v.parse::<u64>().map_err(|e| format!("{f} {v}: {e}").into())).transpose() };
    let m = num("--sources")?.map_or((n / 2).max(1), |v| v as usize);
    if n < 2 || m == 0 || m >= n {
        return Err(format!("weights needs at least one source and one destination: --sources {m} of {n} ranks").into());
    }
    let versions = num("--versions")?.unwrap_or(5);
    let (kill_source_at, kill_dest_at) = (num("--kill-source-at")?, num("--kill-dest-at")?);
    let (src, dst) = weights_model(m, n - m)?;
    let (src_ranks, dst_ranks): (Vec<usize>, Vec<usize>) = ((0..m).collect(), (m..n).collect());
    let t = Instant::now();
    let mut ws = comm.weight_sync(&src, &src_ranks, &dst, &dst_ranks)?;
    let die = |what: &str| {
        println!("selftest: rank {me} kills itself {what}");
        let _ = nix::sys::signal::kill(nix::unistd::getpid(), nix::sys::signal::Signal::SIGKILL);
    };
    let (role, bytes) = match ws.role() {
        WeightRole::Source(i) => (format!("source {i} of {m}"), ws.routing_table().bytes_from(i)),
        WeightRole::Destination(j) => (format!("destination {j} of {}", n - m), ws.routing_table().bytes_to(j)),
        WeightRole::None => return Err("this rank has no role in the weight sync".into()),
    };
    for v in 1..=versions {
        let step: R<()> = match ws.role() {
            WeightRole::Source(i) => (|| {
                ws.with_buffer_mut(|buf| {
                    let mut fresh = vec![0u8; buf.len()];
                    each_element(&src, i, |t, row, col, at, es| {
                        fresh[at..at + es].copy_from_slice(&weight_bytes(src.tensors()[t].dtype(), t, row, col, v)[..es]);
                        Ok(())
                    })?;
                    if kill_source_at == Some(v) && i == m - 1 {
                        let half = buf.len() / 2;
                        buf[..half].copy_from_slice(&fresh[..half]);
                        die(&format!("after writing {half} of {} bytes of version {v}", buf.len()));
                    }
                    buf.copy_from_slice(&fresh);
                    Ok::<(), Box<dyn std::error::Error>>(())
                })??;
                ws.publish(v)?;
                if v == versions {
                    ws.wait_consumed(v)?;
                }
                Ok(())
            })(),
            WeightRole::Destination(j) => {
                if kill_dest_at == Some(v) && me == n - 1 {
                    die(&format!("instead of pulling version {v}"));
                }
                match ws.pull(v) {
                    Ok(()) => ws.with_current(|got, buf| match got == v {
                        true => check_weights(&dst, j, v, buf),
                        false => Err(format!("pulled version {v}, the current version is {got}").into()),
                    })?,
                    Err(e) => {
                        // The front buffer must still hold the last version pulled, whole.
                        let held = ws.with_current(|h, buf| if h == 0 { Ok(h) } else { check_weights(&dst, j, h, buf).map(|()| h) })?;
                        let held = held.map_err(|bad| format!("pull of version {v} failed ({e}), and then {bad}"))?;
                        if held != v - 1 {
                            return Err(format!("pull of version {v} failed ({e}), and then the current version is {held}").into());
                        }
                        println!("selftest: rank {me} weights failed at version {v}: {e}; holding version {held}, verified");
                        return Err(e.into());
                    }
                }
            }
            WeightRole::None => Ok(()),
        };
        if let Err(e) = step {
            println!("selftest: rank {me} weights failed at version {v}: {e}");
            return Err(e);
        }
    }
    drop(ws);
    comm.barrier()?;
    println!("selftest: rank {me} weights ok: {versions} versions, {bytes} bytes per sync ({role}, {:.3}s)", t.elapsed().as_secs_f64());
    Ok(())
}
