//! # ferroccl-perf: the nccl-tests of FerroCCL
//!
//! Times FerroCCL's collectives over a sweep of sizes and prints nccl-tests' table (size,
//! count, type, redop, root; time, algbw, busbw and #wrong for out-of-place and in-place),
//! so that numbers read the same as NCCL's.
//!
//! ```text
//! ferroccl-perf <allreduce|allgather|reduce_scatter|broadcast|reduce|alltoall|alltoallv|sendrecv|all>
//!               [-b MIN] [-e MAX] [-f FACTOR] [-n ITERS] [-w WARMUP] [-d DTYPE] [-o OP]
//!               [-c 0|1] [-r|--root R] [--inplace | --no-inplace] [--algo A] [--transport T]
//!               [--ranks N] [--json FILE] [--plot FILE.svg] [--baseline FILE.json]
//!
//! # N ranks started by the launcher:
//! ferroccl-run -n 4 -- ferroccl-perf allreduce -b 8 -e 256M -f 4
//! # or by ferroccl-perf itself:
//! ferroccl-perf allreduce -b 8 -e 256M -f 4 --ranks 4 --transport shm --json /tmp/ar.json --plot /tmp/ar.svg
//! ```
//!
//! | option | meaning | default |
//! | --- | --- | --- |
//! | `-b`, `-e` | smallest and largest size: bytes, with K, M, G suffixes (powers of 1024) | 8, 32M |
//! | `-f` | size factor between rows (a whole number >= 2); the largest size is always the last row | 2 |
//! | `-n`, `-w` | timed iterations per size, and untimed warm-up iterations before them | 20, 5 |
//! | `-d` | f32 f64 f16 bf16 i8 u8 i32 u32 i64 u64 | f32 |
//! | `-o` | sum prod min max avg | sum |
//! | `-c 0\|1` | check one more call per size against the reference; count wrong elements | 1 |
//! | `-r`, `--root` | root of broadcast and reduce | 0 |
//! | `--inplace` / `--no-inplace` | run only the in-place / only the out-of-place variant | both |
//! | `--algo` | auto, ring, mesh, oneshot, chain, bruck, binomial, pairwise: `FERROCCL_ALGO` for this run | environment |
//! | `--transport` | auto, shm, tcp, verbs: `FERROCCL_TRANSPORT` for this run | environment |
//! | `--ranks N` | start N local ranks (the store, token, environment and CPU pinning of `ferroccl-run`, from its library: rank r on the r-th usable CPU when N <= CPUs, as `ferroccl-run` and `FERROCCL_BIND` decide) | under a launcher |
//! | `--no-bind` | with `--ranks`: leave the ranks unpinned (the kernel places them: an 8 B bf16 allreduce on 2 ranks read 60-90 us unpinned, 0.5-0.7 us pinned, on a 2-CPU machine) | pinned |
//! | `--json FILE` | every row, plus the run's metadata (ranks, transports, dtype, op, machine) | |
//! | `--plot FILE.svg` | busbw and time vs size, one line per collective and variant | |
//! | `--baseline FILE.json` | overlay an earlier `--json` file (or the MPI peer's) on the plot | |
//! | `--plan` | time persistent plans: built once per size, the timed calls are `plan.run()` (allreduce, broadcast in place; allgather, reduce_scatter out of place) | one-off calls |
//!
//! The long spellings of nccl-tests work too (`--minbytes`, `--maxbytes`, `--stepfactor`,
//! `--iters`, `--warmup`, `--datatype`, `--op`, `--check`), values go after a space or `=`
//! (and a short option's straight after it: `-b8`). The command lines are parsed with clap
//! ([`args`]); a bad one is an error naming the option and the value, with the usage line,
//! and exit status 2.
//!
//! More subcommands measure what the table cannot (each has its own `--help`):
//!
//! * `ferroccl-perf latency`: small-message latency of allreduce (or allgather, broadcast,
//!   reduce_scatter; f32 or bf16), blocking call vs persistent plan, alternating in one run
//!   ([`latency`]; benches/latency.sh adds Open MPI and MPICH);
//! * `ferroccl-perf idle`: the CPU time a communicator uses while idle, per rank ([`idle`]);
//! * `ferroccl-perf overlap`: compute + gradient allreduce, sequential vs overlapped with
//!   the non-blocking API ([`overlap`]);
//! * `ferroccl-perf rma`: one-sided reads of a scattered model, registered every step vs
//!   once vs a transfer plan ([`rma`]);
//! * `ferroccl-perf skew`: a small collective after CPU-bound work vs after a sleep
//!   ([`skew`]);
//! * `ferroccl-perf weights`: M->N weight sync (`Communicator::weight_sync`) of a model of
//!   `--model-bytes` in `--tensors` bf16 tensors (replicated, row- and column-sharded) from
//!   the first `--sources` ranks to the others, against the memcpy bound and against
//!   broadcasting every tensor from rank 0 ([`weights`]; benches/weights.sh gives issue 13's
//!   runs);
//! * `ferroccl-perf moe`: MoE dispatch + combine per step (`Communicator::moe`), throughput
//!   mode vs low-latency mode vs one allreduce of the same bytes, at `--tokens` per rank
//!   ([`moe`]; benches/moe.sh adds the MPI_Alltoallv baseline).
//!
//! `ferroccl-perf plot OUT.svg A.json [B.json ...]` draws results files (this tool's
//! `--json`, or benches/peers' MPI program's) in one picture without running anything;
//! files not written by ferroccl-perf are drawn dashed, as baselines.
//!
//! Every subcommand takes `--ranks N`, `--transport T` and `--no-bind` too (one clap
//! `Subcommand` enum, [`args::Sub`], with these shared options declared once). The header
//! and `--json` say where each rank ran (`# pinned: CPUs 0,1`, `pinned_cpus`).
//!
//! Without `--ranks` the ranks come from a launcher's environment (`ferroccl-run`, torchrun,
//! Open MPI, Slurm), as for any FerroCCL program; `--algo` and `--transport` then override
//! `FERROCCL_ALGO` / `FERROCCL_TRANSPORT` in the communicator's parameters.
//!
//! ## The columns
//!
//! * **size**: bytes of the larger per-rank buffer, as nccl-tests defines it (allgather: the
//!   gathered output; reduce_scatter: the input; alltoall, alltoallv (uniform counts): the send buffer; the others: the
//!   buffer); **count**: the same in elements. See [`colls`] for the table.
//! * **time**: mean microseconds per call over `-n` calls after `-w` warm-up calls, timed on
//!   every rank between barriers; the slowest rank's time is reported.
//! * **algbw** = size / time, in GB/s (1e9 bytes per second); **busbw** = algbw times
//!   nccl-tests' factor: allreduce 2(n-1)/n; allgather, reduce_scatter, alltoall(v) (n-1)/n;
//!   broadcast, reduce, sendrecv 1.
//! * **#wrong**: with `-c 1`, after the timed calls the buffers are filled again and one
//!   more call is checked element by element, bit for bit, against the reference computed
//!   on each rank (inputs are small integers, exact in every dtype and every reduction
//!   order; see [`data`]); the count is summed over the ranks. `N/A` with `-c 0`.
//! * **algo**: the algorithm setting (`--algo` / `FERROCCL_ALGO`, else the algorithm the
//!   library's cost model chose for that size, from `Communicator::algorithm_for`).
//! * `N/A` cells: the variant was not run, or FerroCCL has no such form (broadcast is in
//!   place only; alltoall(v) and sendrecv out of place only).
//!
//! The footer gives nccl-tests' "Avg bus bandwidth" (mean busbw over every cell) and the
//! total of wrong elements. Which size is running is printed on stderr.
//!
//! ## Exit status
//!
//! 0 success; 1 a collective failed, or #wrong > 0; 2 bad arguments.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod args;
pub mod bench;
pub mod colls;
pub mod data;
pub mod idle;
pub mod latency;
pub mod moe;
pub mod overlap;
pub mod plot;
pub mod report;
pub mod results;
pub mod rma;
pub mod skew;
pub mod sub;
pub mod weights;

use std::path::PathBuf;
use std::time::Instant;

use ferroccl::{Communicator, DType, Params, TransportKind};

use crate::args::{ArgError, Cmd, Options, USAGE};
use crate::report::JobInfo;
use crate::results::CollResult;

/// Why a run failed.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum Failure {
    /// A bad command line (exit 2).
    #[error(transparent)]
    Args(#[from] ArgError),
    /// Joining the job failed.
    #[error("cannot join the job: {0}{hint}", hint = if matches!(.0, ferroccl::Error::Env { .. }) {
        " (start ferroccl-perf with ferroccl-run -n N -- ferroccl-perf ..., or give --ranks N)"
    } else { "" })]
    Init(#[source] ferroccl::Error),
    /// A collective (or the collection of results) failed on this rank.
    #[error("rank {rank}: {what}: {source}")]
    Collective {
        /// This rank.
        rank: usize,
        /// What it was doing.
        what: String,
        /// The library's error.
        #[source]
        source: Box<ferroccl::Error>,
    },
    /// Writing `--json` or `--plot`, or reading `--baseline`, failed.
    #[error("{}: {what}", path.display())]
    Output {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        what: String,
    },
    /// The check found wrong elements.
    #[error("{0} wrong elements (see #wrong)")]
    Wrong(u64),
}

impl Failure {
    /// The process exit status for this failure.
    pub fn exit_code(&self) -> i32 {
        match self {
            Failure::Args(_) => 2,
            _ => 1,
        }
    }
}

/// The whole tool: parses `args` (after the program name), runs, returns the exit status.
pub fn main_with_args(args: &[String]) -> i32 {
    let sub = args.first().and_then(|a| args::Sub::usage_of(a).map(|u| (a.as_str(), u)));
    // Errors of a subcommand are prefixed with its name, and followed by its usage line.
    let (prefix, usage) = match sub {
        Some((name, usage)) => (format!("ferroccl-perf {name}"), usage),
        None => ("ferroccl-perf".to_string(), USAGE),
    };
    let o = match args::parse(args) {
        Ok(Cmd::Help(h)) => {
            print!("{h}");
            return 0;
        }
        Ok(Cmd::Run(o)) => o,
        Ok(Cmd::Sub(s)) => {
            let common = s.common();
            if let Some(n) = common.ranks {
                return spawn(n, common.no_bind, args);
            }
            return match s.run() {
                Ok(()) => 0,
                Err(e) => {
                    eprintln!("{prefix}: error: {e}");
                    if matches!(e, Failure::Args(_)) && matches!(*s, args::Sub::Plot(_)) {
                        eprintln!("{usage}");
                    }
                    e.exit_code()
                }
            };
        }
        Err(e) => {
            eprintln!("{prefix}: error: {e}");
            eprintln!("{usage}");
            return 2;
        }
    };
    if let Some(n) = o.ranks {
        return spawn_ranks(n, args, &o);
    }
    match run_rank(&o) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("ferroccl-perf: error: {e}");
            e.exit_code()
        }
    }
}

/// `--ranks N` of a benchmark: checks `--baseline` first, then [`spawn`].
fn spawn_ranks(n: usize, args: &[String], o: &Options) -> i32 {
    if let Some(b) = &o.baseline {
        if let Err(e) = load_baseline(b) {
            eprintln!("ferroccl-perf: error: --baseline {e}");
            return 2;
        }
    }
    spawn(n, !o.bind, args)
}

/// `--ranks N`: runs N copies of this executable as the ranks of a local job, through
/// `ferroccl-run`'s library (bootstrap store, fresh token, environment, failure handling:
/// when one rank fails the others get a grace period, then are killed; and pinning: each
/// rank is started through this binary as ferroccl-run's exec shim, which pins it to its
/// CPU as `ferroccl-run` does, unless `no_bind` (`--no-bind`) or `FERROCCL_BIND` says not).
fn spawn(n: usize, no_bind: bool, args: &[String]) -> i32 {
    if std::env::var_os("FERROCCL_RANK").is_some_and(|v| !v.is_empty()) {
        eprintln!("ferroccl-perf: error: --ranks {n}: already running as a rank of a job (FERROCCL_RANK is set); drop --ranks");
        return 2;
    }
    let exe = match std::env::current_exe() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("ferroccl-perf: error: --ranks: cannot find this executable to start the ranks: {e}");
            return 1;
        }
    };
    let mut run_args: Vec<std::ffi::OsString> = vec!["-n".into(), n.to_string().into(), "--no-prefix".into()];
    if no_bind {
        run_args.push("--no-bind".into());
    }
    run_args.extend(["--".into(), exe.into()]);
    run_args.extend(args::without_ranks(args).into_iter().map(Into::into));
    ferroccl_run::main_with_args_hosting_shim(run_args)
}

/// `ferroccl-perf plot OUT.svg A.json [B.json ...]`: draws the rows of results files
/// (ferroccl-perf's `--json`, or the MPI peer's) in one picture, without running anything.
/// Series with the same legend from several files (one sweep split into size ranges) are
/// joined into one line; files not written by ferroccl-perf are drawn as baselines (dashed).
pub(crate) fn plot_files(args: &[String]) -> Result<(), Failure> {
    let bad = |what: &str| Failure::Args(ArgError::BadValue { flag: "plot".into(), value: args.join(" "), expected: what.into() });
    let [out, inputs @ ..] = args else {
        return Err(bad("needs OUT.svg and at least one results file"));
    };
    if !out.to_ascii_lowercase().ends_with(".svg") || inputs.is_empty() {
        return Err(bad("needs OUT.svg and at least one results file"));
    }
    let mut series: Vec<plot::Series> = Vec::new();
    let mut labels: Vec<String> = Vec::new();
    let mut hosts: Vec<String> = Vec::new();
    for path in inputs {
        let path = std::path::Path::new(path);
        let fail = |what: String| Failure::Output { path: path.into(), what };
        let text = std::fs::read_to_string(path).map_err(|e| fail(e.to_string()))?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| fail(format!("not JSON: {e}")))?;
        let ours = v.get("tool").and_then(|t| t.as_str()) == Some("ferroccl-perf");
        let got = plot::series_from_json(&v, !ours).ok_or_else(|| fail("not a results file (no \"runs\" with \"rows\")".into()))?;
        for (key, list) in [("label", &mut labels), ("hostname", &mut hosts)] {
            let val = v.get(key).or_else(|| v.get("machine").and_then(|m| m.get(key))).and_then(|x| x.as_str());
            if let Some(x) = val.filter(|x| !list.iter().any(|l| l == x)) {
                list.push(x.to_string());
            }
        }
        for s in got {
            match series.iter_mut().find(|e| e.label == s.label) {
                Some(e) => {
                    e.points.extend(s.points);
                    e.points.sort_by(|a, b| a.0.total_cmp(&b.0));
                }
                None => series.push(s),
            }
        }
    }
    let title = format!("{} on {}", labels.join(" vs "), hosts.join(", "));
    std::fs::write(out, plot::render(&title, &series)).map_err(|e| Failure::Output { path: out.into(), what: e.to_string() })?;
    eprintln!("ferroccl-perf: wrote {out} ({} series)", series.len());
    Ok(())
}

/// Reads the series of a `--baseline` file.
fn load_baseline(path: &std::path::Path) -> Result<Vec<plot::Series>, Failure> {
    let fail = |what: String| Failure::Output { path: path.into(), what };
    let text = std::fs::read_to_string(path).map_err(|e| fail(e.to_string()))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| fail(format!("not JSON: {e}")))?;
    plot::series_from_json(&v, true).ok_or_else(|| fail("not a results file (no \"runs\" with \"rows\")".into()))
}

/// The algorithm setting the run uses: `--algo`, else `FERROCCL_ALGO`, else `auto`.
fn algo_setting(o: &Options, params: &Params) -> String {
    match &o.algo {
        Some(a) => a.clone(),
        None => params.algo.map_or_else(|| "auto".into(), |a| a.to_string()),
    }
}

/// One rank of the benchmark.
fn run_rank(o: &Options) -> Result<(), Failure> {
    let mut params = Params::from_env().map_err(Failure::Init)?;
    if let Some(a) = &o.algo {
        // `algo` checked the name: anything but auto parses.
        params.algo = ferroccl::Algo::parse(a);
    }
    if let Some(t) = o.transport {
        params.transport = t;
    }
    let algo = algo_setting(o, &params);
    let launch = ferroccl::bootstrap::env::detect().map_err(Failure::Init)?;
    let t0 = Instant::now();
    let comm = Communicator::init_with(launch.into(), params).map_err(Failure::Init)?;
    let init_ms = t0.elapsed().as_secs_f64() * 1e3;
    let n = comm.size();
    let bad =
        |flag: &str, v: usize, what: String| Failure::Args(ArgError::BadValue { flag: flag.into(), value: v.to_string(), expected: what });
    if o.root >= n && o.colls.iter().any(|c| c.rooted()) {
        return Err(bad("--root", o.root, format!("is out of range for {n} ranks")));
    }
    if let Some(r) = o.corrupt_rank.filter(|&r| r >= n) {
        return Err(bad("--corrupt-rank", r, format!("is out of range for {n} ranks")));
    }
    let baseline = match (&o.baseline, comm.rank()) {
        (Some(b), 0) => Some(load_baseline(b)?),
        _ => None,
    };
    // FERROCCL_BOUND_CPU: the CPU ferroccl-run's exec shim pinned this rank to (-1: none).
    let bound = std::env::var("FERROCCL_BOUND_CPU").ok().and_then(|c| c.parse::<u32>().ok()).map_or(-1.0, f64::from);
    let times = bench::gather(&comm, &[init_ms, bound, 0.0, 0.0]).map_err(|e| Failure::Collective {
        rank: comm.rank(),
        what: "collecting init times".into(),
        source: Box::new(e),
    })?;
    let info = times.map(|t| JobInfo {
        ranks: n,
        transports: (0..n)
            .map(|p| if p == comm.rank() { "self" } else { comm.transport_to(p).map_or("?", TransportKind::name) }.to_string())
            .collect(),
        hostname: comm.hostname_of(0).unwrap_or("?").to_string(),
        nproc: host_cpus(),
        init_ms: t.iter().map(|v| v[0]).fold(0.0, f64::max),
        setup_ms: comm.setup_time().as_secs_f64() * 1e3,
        algo: algo.clone(),
        pinned: t.iter().map(|v| (v[1] >= 0.0).then_some(v[1] as usize)).collect(),
    });
    if let Some(info) = &info {
        report::print_job_header(info, o);
    }
    let results = match o.dtype {
        DType::F32 => bench::sweep::<f32>(&comm, o, &algo),
        DType::F64 => bench::sweep::<f64>(&comm, o, &algo),
        DType::F16 => bench::sweep::<ferroccl_kernels::f16>(&comm, o, &algo),
        DType::Bf16 => bench::sweep::<ferroccl_kernels::bf16>(&comm, o, &algo),
        DType::I8 => bench::sweep::<i8>(&comm, o, &algo),
        DType::U8 => bench::sweep::<u8>(&comm, o, &algo),
        DType::I32 => bench::sweep::<i32>(&comm, o, &algo),
        DType::U32 => bench::sweep::<u32>(&comm, o, &algo),
        DType::I64 => bench::sweep::<i64>(&comm, o, &algo),
        DType::U64 => bench::sweep::<u64>(&comm, o, &algo),
    }?;
    let done = match &info {
        Some(info) => finish(info, o, &results, baseline),
        None => Ok(()),
    };
    comm.finalize().map_err(|e| Failure::Collective { rank: 0, what: "finalize".into(), source: Box::new(e) })?;
    done
}

/// The host's online CPUs (`/sys/devices/system/cpu/online`, as `0-7,9`), else the CPUs
/// this process may run on (a pinned rank may run on one).
fn host_cpus() -> usize {
    let online = std::fs::read_to_string("/sys/devices/system/cpu/online").ok().and_then(|s| {
        s.trim().split(',').try_fold(0usize, |n, r| match r.split_once('-') {
            Some((a, b)) => Some(n + b.parse::<usize>().ok()?.checked_sub(a.parse::<usize>().ok()?)? + 1),
            None => r.parse::<usize>().ok().map(|_| n + 1),
        })
    });
    online.filter(|&n| n > 0).unwrap_or_else(|| std::thread::available_parallelism().map_or(0, |p| p.get()))
}

/// Rank 0 after the sweep: JSON, plot, and the verdict of the check.
fn finish(info: &JobInfo, o: &Options, results: &[CollResult], baseline: Option<Vec<plot::Series>>) -> Result<(), Failure> {
    let value = report::to_json(info, o, results);
    if let Some(path) = &o.json {
        report::write_json(path, &value)?;
        eprintln!("ferroccl-perf: wrote {}", path.display());
    }
    if let Some(path) = &o.plot {
        let mut series = plot::series_from_json(&value, false).unwrap_or_default();
        series.extend(baseline.unwrap_or_default());
        let colls: Vec<&str> = o.colls.iter().map(|c| c.name()).collect();
        let title = format!(
            "{} {} {}, {} ranks, {} on {} (nproc {})",
            colls.join(", "),
            o.dtype,
            o.op,
            info.ranks,
            info.transport_summary().split(' ').next().unwrap_or(""),
            info.hostname,
            info.nproc
        );
        std::fs::write(path, plot::render(&title, &series)).map_err(|e| Failure::Output { path: path.clone(), what: e.to_string() })?;
        eprintln!("ferroccl-perf: wrote {}", path.display());
    }
    let wrong: u64 = results.iter().map(CollResult::wrong).sum();
    if wrong > 0 {
        return Err(Failure::Wrong(wrong));
    }
    Ok(())
}
