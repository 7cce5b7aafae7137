//! ferroccl-demo: every pair of ranks exchanges and verifies data, then rank 0 prints who
//! talked to whom, over which transport, and how fast (latency at 8 B, bandwidth at 1 MiB
//! and 64 MiB), next to this machine's single-thread memcpy bandwidth measured in the same
//! run; then an allreduce (f32 sum, verified) at a few sizes with its bus bandwidth.
//!
//! ```text
//! ferroccl-run -n 4 -- ferroccl-demo [--iters N] [--sizes 8,1M,64M] [--allreduce 8,64K,1M,16M]
//! ```
#![forbid(unsafe_code)]

use std::time::Instant;

use ferroccl::comm::Communicator;
use ferroccl::{ReduceOp, TransportKind};
use ferroccl_run::testkit::{fill, first_mismatch, flag, human, parse_size, partner, rounds};

type R<T> = Result<T, Box<dyn std::error::Error>>;

fn main() {
    let t0 = Instant::now();
    let comm = match Communicator::init() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("ferroccl-demo: {e}");
            std::process::exit(1);
        }
    };
    let init = t0.elapsed();
    if let Err(e) = run(&comm, init.as_secs_f64()).and_then(|()| comm.finalize().map_err(Into::into)) {
        eprintln!("ferroccl-demo: error: {e}");
        std::process::exit(1);
    }
}

/// One measured pair: (rank, peer, size, seconds per one-way transfer, transport code).
type Row = (usize, usize, usize, f64, usize);

const TRANSPORTS: [&str; 4] = ["shm", "tcp", "verbs", "?"];

/// Times `iters` ping-pongs of `size` bytes with `p` and returns the one-way time.
fn pingpong(comm: &Communicator, p: usize, size: usize, iters: usize, seed: u64) -> R<f64> {
    let me = comm.rank();
    let mut out = vec![0u8; size];
    let mut inb = vec![0u8; size];
    fill(&mut out, seed, me, p);
    let mut one = |check: bool| -> R<()> {
        if me < p {
            comm.send(&out, p)?;
            comm.recv(&mut inb, p)?;
        } else {
            comm.recv(&mut inb, p)?;
            comm.send(&out, p)?;
        }
        if check {
            if let Some(i) = first_mismatch(&inb, seed, p, me) {
                return Err(format!("{} from rank {p}: byte {i} is wrong", human(size)).into());
            }
        }
        Ok(())
    };
    one(true)?; // warm-up, and the data check
    let t = Instant::now();
    for _ in 0..iters {
        one(false)?;
    }
    Ok(t.elapsed().as_secs_f64() / (2 * iters) as f64)
}

fn memcpy_gbps(size: usize) -> f64 {
    let src = vec![1u8; size];
    let mut dst = vec![0u8; size];
    dst.copy_from_slice(&src);
    let iters = ((1usize << 30) / size.max(1)).clamp(3, 1000);
    let t = Instant::now();
    for _ in 0..iters {
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
    }
    (size * iters) as f64 / t.elapsed().as_secs_f64() / 1e9
}

fn run(comm: &Communicator, init_s: f64) -> R<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let sizes: Vec<usize> = flag(&args, "--sizes")
        .unwrap_or("8,1M,64M")
        .split(',')
        .map(|s| parse_size(s).ok_or_else(|| format!("bad size {s:?}")))
        .collect::<Result<_, _>>()?;
    let iters_arg: Option<usize> = flag(&args, "--iters").and_then(|s| s.parse().ok());
    let (n, me) = (comm.size(), comm.rank());
    let ar_sizes: Vec<usize> = flag(&args, "--allreduce")
        .unwrap_or("8,64K,1M,16M")
        .split(',')
        .filter(|s| !s.is_empty())
        .map(|s| parse_size(s).ok_or_else(|| format!("bad size {s:?}")))
        .collect::<Result<_, _>>()?;
    let mut rows: Vec<Row> = Vec::new();
    for (si, &size) in sizes.iter().enumerate() {
        let iters = iters_arg.unwrap_or(if size <= 4096 {
            2000
        } else if size <= (1 << 20) {
            50
        } else {
            4
        });
        for round in 0..rounds(n) {
            if let Some(p) = partner(n, round, me) {
                let t = pingpong(comm, p, size, iters, 100 + si as u64)?;
                let code = TRANSPORTS.iter().position(|&x| Some(x) == comm.transport_to(p).map(TransportKind::name)).unwrap_or(3);
                rows.push((me, p, size, t, code));
            }
            comm.barrier()?;
        }
    }
    let ar = allreduce_table(comm, &ar_sizes)?;
    // Gather everyone's rows on rank 0.
    let encode =
        |rows: &[Row]| -> Vec<f64> { rows.iter().flat_map(|&(a, b, s, t, c)| [a as f64, b as f64, s as f64, t, c as f64]).collect() };
    let mine = encode(&rows);
    if me != 0 {
        comm.send(&[mine.len() as u64], 0)?;
        comm.send(&mine, 0)?;
        return Ok(());
    }
    let mut all = mine;
    for p in 1..n {
        let mut len = [0u64];
        comm.recv(&mut len, p)?;
        let mut buf = vec![0f64; len[0] as usize];
        comm.recv(&mut buf, p)?;
        all.extend(buf);
    }
    let memcpy = memcpy_gbps(64 << 20);
    println!("ferroccl-demo: {n} ranks, init {:.1} ms on rank 0, all data verified", init_s * 1e3);
    println!("single-thread memcpy (64 MiB), same run: {memcpy:.2} GB/s");
    print!("{:<16} {:<10}", "pair", "transport");
    for &s in &sizes {
        print!(" {:>22}", human(s));
    }
    println!();
    for a in 0..n {
        for b in (a + 1)..n {
            let pair = |c: &&[f64]| (c[0] as usize, c[1] as usize) == (a, b) || (c[0] as usize, c[1] as usize) == (b, a);
            let transport = all.chunks_exact(5).find(pair).map(|c| TRANSPORTS[(c[4] as usize).min(3)]).unwrap_or("?");
            print!("{:<16} {:<10}", format!("rank {a} <-> {b}"), transport);
            for &s in &sizes {
                let ts: Vec<f64> = all.chunks_exact(5).filter(|c| c[2] as usize == s && pair(c)).map(|c| c[3]).collect();
                let t = ts.iter().sum::<f64>() / ts.len().max(1) as f64;
                if s <= 4096 {
                    print!(" {:>22}", format!("{:.2} us", t * 1e6));
                } else {
                    let gbps = s as f64 / t / 1e9;
                    print!(" {:>22}", format!("{gbps:.2} GB/s ({:.2}x memcpy)", gbps / memcpy));
                }
            }
            println!();
        }
    }
    if !ar.is_empty() {
        println!("allreduce, f32 sum, {n} ranks (busbw = 2(n-1)/n x bytes / time, as nccl-tests)");
        println!("{:>10} {:>12} {:>12} {:>22}", "size", "time", "algbw", "busbw");
        for (size, t) in ar {
            let algbw = size as f64 / t / 1e9;
            let busbw = algbw * 2.0 * (n as f64 - 1.0) / n as f64;
            println!("{:>10} {:>9.1} us {:>7.2} GB/s {:>7.2} GB/s ({:.2}x memcpy)", human(size), t * 1e6, algbw, busbw, busbw / memcpy);
        }
    }
    Ok(())
}

/// Times allreduce (f32 sum) at each size; every rank checks the result. Returns (bytes,
/// seconds per call, max over ranks) on every rank.
fn allreduce_table(comm: &Communicator, sizes: &[usize]) -> R<Vec<(usize, f64)>> {
    let (n, me) = (comm.size(), comm.rank());
    let mut out = Vec::new();
    for &size in sizes {
        let count = (size / 4).max(1);
        let mut buf: Vec<f32> = (0..count).map(|i| ((i + me) % 7) as f32).collect();
        comm.allreduce(&mut buf, ReduceOp::Sum)?;
        let want = |i: usize| (0..n).map(|r| ((i + r) % 7) as f32).sum::<f32>();
        if let Some(i) = (0..count).find(|&i| buf[i] != want(i)) {
            return Err(format!("allreduce of {}: element {i} is {}, want {}", human(size), buf[i], want(i)).into());
        }
        let iters = if size <= 65536 {
            500
        } else if size <= (1 << 20) {
            50
        } else {
            5
        };
        comm.barrier()?;
        let t = Instant::now();
        for _ in 0..iters {
            comm.allreduce(&mut buf, ReduceOp::Sum)?;
        }
        let mut dt = [t.elapsed().as_secs_f64() / iters as f64];
        comm.allreduce(&mut dt, ReduceOp::Max)?;
        out.push((count * 4, dt[0]));
    }
    Ok(out)
}
