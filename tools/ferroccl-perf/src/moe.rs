//! `ferroccl-perf moe`: MoE dispatch + combine per step (`Communicator::moe`, issue 16),
//! throughput mode vs low-latency mode vs one allreduce of the same bytes, alternated in
//! one run (see its `--help`); benches/moe.sh puts the MPI_Alltoallv baseline
//! (benches/peers/mpi_moe.c) beside it.

use std::time::Instant;

use ferroccl::moe::{MoeConfig, MoeMode};
use ferroccl::{bf16, ReduceOp, TransportKind};

use crate::args::{self};
use crate::sub::{self, fail, Common};
use crate::Failure;

/// `ferroccl-perf moe`'s usage, printed with every command-line error.
pub const USAGE: &str = "usage: ferroccl-perf moe [--tokens T,T,...] [--hidden H] [--experts E] [--top-k K] [--steps S] [--rounds R] \
[--ranks N | under ferroccl-run -n N --] [--transport T]";

pub(crate) const ABOUT_MORE: &str = "\
Every rank has T tokens of H bf16 each; token t of rank r at step s chooses K distinct
experts of E (expert e lives on rank e / (E / ranks)) by the routing of
benches/peers/mpi_moe.c: x = splitmix64((r << 40) ^ (s << 20) ^ t), e0 = x % E, then
then e_j = (e_{j-1} + 1 + h % (E - 1)) % E for h = splitmix64(h) starting from h = x,
redrawn while e_j was already chosen; weights 0.75 and 0.25 for K = 2 (mpi_moe.c has
the general rule). The
experts are the identity, so a step is communication only: dispatch, then combine of the
received rows as they are. Each round runs, S steps each, in the order A B C:
  (a) throughput   Moe in MoeMode::Throughput: counts by alltoall, rows by alltoallv
  (b) low latency  Moe in MoeMode::LowLatency: one-sided writes into persistent windows
                   with signals, no count round trip
  (c) allreduce    one allreduce (sum) of T x H bf16: the bytes of one rank's tokens
Both Moe objects are made once, for the largest T. Time of one step: every rank enters a
barrier, then is timed to the return of its combine (or allreduce); the slowest rank's
time is the step's. Reported per T: median, p10 and p90 over the steps of rounds 2..R
(round 1 separately: the first steps after setup), one machine-readable line per way.
The first step of every round is checked: combine must give back each token (identity
experts, weights summing to 1) within bf16 rounding.";

/// What `--help` says first.
pub(crate) const ABOUT: &str =
    "ferroccl-perf moe: MoE dispatch + combine, throughput vs low-latency mode vs one allreduce of the same bytes";

/// What `--help` says after the options.
pub(crate) const AFTER_HELP: &str = "exit status: 0 success; 1 a call failed or a check failed; 2 bad arguments.";

/// `ferroccl-perf moe`'s options.
#[derive(Clone, Debug, PartialEq, clap::Args)]
pub struct MoeOptions {
    /// Tokens per rank, comma-separated
    #[arg(long, value_name = "T,...", default_value = "1,8,64,128", value_delimiter = ',', value_parser = args::whole::<1>)]
    pub tokens: Vec<usize>,
    /// Elements (bf16) per token
    #[arg(long, value_name = "H", default_value = "4096", allow_hyphen_values = true, value_parser = args::whole::<1>)]
    pub hidden: usize,
    /// Experts in all (a multiple of the ranks)
    #[arg(long, value_name = "E", default_value = "8", allow_hyphen_values = true, value_parser = args::whole::<1>)]
    pub experts: usize,
    /// Experts per token
    #[arg(long = "top-k", value_name = "K", default_value = "2", allow_hyphen_values = true, value_parser = args::whole::<1>)]
    pub top_k: usize,
    /// Timed steps of each way per round
    #[arg(long, value_name = "S", default_value = "300", allow_hyphen_values = true, value_parser = args::whole::<1>)]
    pub steps: usize,
    /// Rounds (each runs A, B, C)
    #[arg(long, value_name = "R", default_value = "5", allow_hyphen_values = true, value_parser = args::whole::<1>)]
    pub rounds: usize,
    /// `--ranks`, `--transport`, `--no-bind`: the options every subcommand shares, parsed
    /// once ([`crate::sub::Common`]) and copied here.
    #[arg(skip)]
    pub common: Common,
}

/// splitmix64 of `v` (the state advanced once from `v`), as benches/peers/mpi_moe.c.
pub fn splitmix64(v: u64) -> u64 {
    let mut z = v.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The experts and weights of token `t` of rank `r` at step `s` (see `--help`).
pub fn route(r: usize, s: u64, t: usize, experts: usize, top_k: usize, idx: &mut Vec<u32>, w: &mut Vec<f32>) {
    let x = splitmix64(((r as u64) << 40) ^ (s << 20) ^ t as u64);
    let first = idx.len();
    let mut prev = (x % experts as u64) as usize;
    idx.push(prev as u32);
    let mut h = x;
    while idx.len() - first < top_k.min(experts) {
        // Redrawn from the same base until the expert is a new one.
        let c = loop {
            h = splitmix64(h);
            let c = (prev + 1 + (h % (experts as u64 - 1)) as usize) % experts;
            if !idx[first..].contains(&(c as u32)) {
                break c;
            }
        };
        idx.push(c as u32);
        prev = c;
    }
    let k = idx.len() - first;
    let mut p = 1.0f32;
    for j in 0..k {
        w.push(match k {
            1 => 1.0,
            _ if j + 1 < k => 0.75 * p,
            _ => p,
        });
        p *= 0.25;
    }
}

/// Element `h` of token `t` of rank `r`: small integers, exact in bf16.
fn value(r: usize, t: usize, h: usize) -> bf16 {
    bf16::from_f32(((r * 131 + t * 17 + h * 7) % 251) as f32 - 125.0)
}

/// The `q` quantile (0..=1) of sorted `v`, interpolated linearly between the samples at
/// `q * (len - 1)` (as benches/peers/mpi_moe.c).
fn pct(v: &[f64], q: f64) -> f64 {
    match v.len() {
        0 => 0.0,
        n => {
            let at = (n - 1) as f64 * q;
            let (lo, hi) = (at.floor() as usize, at.ceil() as usize);
            v[lo] + (v[hi] - v[lo]) * (at - lo as f64)
        }
    }
}

/// One rank's run.
pub fn run(o: &MoeOptions) -> Result<(), Failure> {
    let comm = o.common.init()?;
    let (me, n) = (comm.rank(), comm.size());
    let max_tokens = o.tokens.iter().copied().max().unwrap_or(1);
    let cfg = MoeConfig { num_experts: o.experts, hidden: o.hidden, top_k: o.top_k, max_tokens_per_rank: max_tokens };
    let mut tp = comm.moe::<bf16>(cfg, MoeMode::Throughput).map_err(fail(&comm, "moe setup (throughput)"))?;
    let mut ll = comm.moe::<bf16>(cfg, MoeMode::LowLatency).map_err(fail(&comm, "moe setup (low latency)"))?;
    let mut wrong = 0u64;
    let mut step = 0u64;
    let mut lines = Vec::new();
    for &tokens in &o.tokens {
        let x: Vec<bf16> = (0..tokens * o.hidden).map(|i| value(me, i / o.hidden, i % o.hidden)).collect();
        let mut out = vec![bf16::ZERO; x.len()];
        let mut ar = x.clone();
        // Per way: round 1's step times, then the other rounds'.
        let mut times: [[Vec<f64>; 2]; 3] = Default::default();
        let (mut idx, mut w) = (Vec::new(), Vec::new());
        for round in 0..o.rounds {
            for (way, way_times) in times.iter_mut().enumerate() {
                for s in 0..o.steps {
                    step += 1;
                    idx.clear();
                    w.clear();
                    for t in 0..tokens {
                        route(me, step, t, o.experts, o.top_k, &mut idx, &mut w);
                    }
                    let checked = s == 0;
                    if checked {
                        out.fill(bf16::ZERO);
                    }
                    comm.barrier().map_err(fail(&comm, "barrier"))?;
                    let t0 = Instant::now();
                    match way {
                        0 | 1 => {
                            let moe = if way == 0 { &mut tp } else { &mut ll };
                            let d = moe.dispatch(&x, &idx, &w).map_err(fail(&comm, "dispatch"))?;
                            moe.combine(&d.tokens, &d.handle, &mut out).map_err(fail(&comm, "combine"))?;
                        }
                        _ => comm.allreduce(&mut ar, ReduceOp::Sum).map_err(fail(&comm, "allreduce"))?,
                    }
                    let dt = t0.elapsed().as_secs_f64();
                    way_times[usize::from(round > 0)].push(sub::max_over_ranks(&comm, dt)?);
                    if checked && way < 2 {
                        wrong += check(me, way, tokens, &x, &out);
                    }
                }
            }
        }
        if me == 0 {
            lines.push((tokens, times));
        }
    }
    drop((tp, ll));
    comm.barrier().map_err(fail(&comm, "barrier"))?;
    if me == 0 {
        report(o, n, comm.transport_to(1 % n).map_or("self", TransportKind::name), &mut lines);
    }
    sub::finish(comm, wrong)
}

/// Elements of `out` that are not `x` within bf16 rounding (one relative step of 2^-7).
fn check(me: usize, way: usize, tokens: usize, x: &[bf16], out: &[bf16]) -> u64 {
    let mut wrong = 0;
    for (i, (a, b)) in x.iter().zip(out).enumerate() {
        let (a, b) = (a.to_f32(), b.to_f32());
        if (a - b).abs() > a.abs() / 128.0 {
            if wrong == 0 {
                let name = ["throughput", "low latency"][way];
                eprintln!("ferroccl-perf moe: rank {me}: {name}, {tokens} tokens: element {i} came back as {b}, sent {a}");
            }
            wrong += 1;
        }
    }
    wrong
}

type Lines = Vec<(usize, [[Vec<f64>; 2]; 3])>;

fn report(o: &MoeOptions, ranks: usize, transport: &str, lines: &mut Lines) {
    println!(
        "# moe: {ranks} ranks over {transport}, hidden {} bf16, top-{} of {} experts; {} rounds x {} steps per way",
        o.hidden, o.top_k, o.experts, o.rounds, o.steps
    );
    println!("# step = dispatch + combine (identity experts), barrier before each, slowest rank; us; rounds 2..R (round 1 apart)");
    println!(
        "# {:>6} {:>14} {:>14} {:>14} {:>10} {:>10} {:>16}",
        "tokens", "throughput", "low latency", "allreduce", "tp / ll", "ll / ar", "round 1 tp/ll/ar"
    );
    let mut machine = Vec::new();
    for (tokens, times) in lines.iter_mut() {
        let mut med = [0.0; 3];
        let mut first = [0.0; 3];
        for (way, t) in times.iter_mut().enumerate() {
            let rest = if t[1].is_empty() { &mut t[0] } else { &mut t[1] };
            rest.sort_by(f64::total_cmp);
            med[way] = pct(rest, 0.5) * 1e6;
            let (p10, p90) = (pct(rest, 0.1) * 1e6, pct(rest, 0.9) * 1e6);
            first[way] = sub::median(&mut t[0]) * 1e6;
            let name = ["throughput", "lowlatency", "allreduce"][way];
            let what = if way == 2 { "ferroccl_allreduce" } else { "ferroccl_moe" };
            machine.push(format!(
                "{what} mode={name} ranks={ranks} tokens={tokens} hidden={} experts={} topk={} median_us={:.2} p10_us={:.2} p90_us={:.2}",
                o.hidden, o.experts, o.top_k, med[way], p10, p90
            ));
        }
        println!(
            "  {:>6} {:>14.1} {:>14.1} {:>14.1} {:>10.2} {:>10.2} {:>6.0}/{:.0}/{:.0}",
            tokens,
            med[0],
            med[1],
            med[2],
            med[0] / med[1],
            med[1] / med[2],
            first[0],
            first[1],
            first[2]
        );
    }
    for l in machine {
        println!("{l}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `ferroccl-perf moe ARGS`; `Ok(None)` for `--help`.
    fn parse(args: &[String]) -> Result<Option<MoeOptions>, args::ArgError> {
        match args::parse_sub("moe", args)? {
            Some(args::Sub::Moe(o)) => Ok(Some(o)),
            None => Ok(None),
            other => panic!("moe: {other:?}"),
        }
    }

    #[test]
    fn routing_picks_distinct_experts_and_weights_summing_to_one() {
        for (e, k) in [(8, 2), (8, 3), (4, 4), (16, 1)] {
            for t in 0..200 {
                let (mut idx, mut w) = (Vec::new(), Vec::new());
                route(t % 4, 7, t, e, k, &mut idx, &mut w);
                assert_eq!(idx.len(), k);
                let mut u = idx.clone();
                u.sort();
                u.dedup();
                assert_eq!(u.len(), k, "{idx:?}");
                assert!(idx.iter().all(|&x| (x as usize) < e));
                assert!((w.iter().sum::<f32>() - 1.0).abs() < 1e-6);
            }
        }
        // Pinned: the C baseline routes the same (benches/peers/mpi_moe.c).
        let (mut idx, mut w) = (Vec::new(), Vec::new());
        route(1, 2, 3, 8, 2, &mut idx, &mut w);
        assert_eq!(idx.len(), 2);
        assert_eq!(splitmix64(0), 0xE220_A839_7B1D_CDAF);
    }

    #[test]
    fn defaults() {
        let o = parse(&[]).expect("parses").expect("not --help");
        assert_eq!((o.tokens.clone(), o.hidden, o.experts, o.top_k), (vec![1, 8, 64, 128], 4096, 8, 2));
        assert!(parse(&["--tokens".into(), "0".into()]).is_err());
    }
}
