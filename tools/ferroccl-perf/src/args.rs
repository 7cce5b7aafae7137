//! The command line.

use std::path::PathBuf;

use ferroccl::{DType, ReduceOp, TransportChoice};

use crate::colls::Coll;

/// The one-line usage printed with every command-line error.
pub const USAGE: &str = "usage: ferroccl-perf <allreduce|allgather|reduce_scatter|broadcast|reduce|alltoall|sendrecv|all> \
[-b MIN] [-e MAX] [-f FACTOR] [-n ITERS] [-w WARMUP] [-d DTYPE] [-o OP] [-c 0|1] [--inplace|--no-inplace] \
[--plan] [--algo A] [--transport T] [--ranks N] [--root R] [--json FILE] [--plot FILE.svg] [--baseline FILE.json]
       ferroccl-perf <latency|idle|overlap|plot> ... (see ferroccl-perf --help)";

/// `--help`.
pub const HELP: &str = "\
ferroccl-perf: nccl-tests-style benchmark of FerroCCL's collectives

usage: ferroccl-perf COLLECTIVE [OPTIONS]
       ferroccl-run -n N -- ferroccl-perf COLLECTIVE [OPTIONS]
       ferroccl-perf plot OUT.svg RESULTS.json [MORE.json ...]
       ferroccl-perf latency [OPTIONS]   small-message latency, blocking call vs plan
       ferroccl-perf idle [OPTIONS]      CPU time an idle communicator uses
       ferroccl-perf overlap [OPTIONS]   compute + allreduce, sequential vs non-blocking
       (ferroccl-perf latency|idle|overlap --help for theirs)

COLLECTIVE: allreduce, allgather, reduce_scatter, broadcast, reduce, alltoall, sendrecv, all

options:
  -b, --minbytes SIZE    smallest size (default 8; suffixes K, M, G = 2^10, 2^20, 2^30)
  -e, --maxbytes SIZE    largest size (default 32M)
  -f, --stepfactor F     multiply the size by F (whole number >= 2) each row (default 2);
                         MAX is always the last row
  -n, --iters N          timed iterations per size (default 20)
  -w, --warmup N         untimed iterations before them (default 5)
  -d, --datatype T       f32 f64 f16 bf16 i8 u8 i32 u32 i64 u64 (default f32)
  -o, --op OP            sum prod min max avg (default sum)
  -c, --check 0|1        1: check every element of one more call per size against the
                         reference and count wrong elements in #wrong (default 1)
  -r, --root R           root of broadcast and reduce (default 0)
  --inplace              run the in-place variant only
  --no-inplace           run the out-of-place variant only (default: both)
  --algo A               auto, ring, mesh, oneshot, chain (FERROCCL_ALGO for this run)
  --transport T          auto, shm, tcp, verbs (FERROCCL_TRANSPORT for this run)
  --ranks N              start N local ranks (no launcher needed)
  --json FILE            write every row and the run's metadata as JSON
  --plot FILE.svg        draw busbw and time vs size as an SVG
  --baseline FILE.json   overlay the rows of an earlier --json file (or benches/peers'
                         MPI program) on the plot
  --plan                 time persistent plans: each size builds its plan once
                         (comm.allreduce_plan, allgather_plan, reduce_scatter_plan,
                         broadcast_plan) and the timed calls are plan.run(); -c 1 refills
                         the inputs through plan.input_mut()/output_mut() and checks
                         plan.output(). Plans exist for allreduce and broadcast in place,
                         allgather and reduce_scatter out of place: the other variant's
                         cells are N/A; `all` runs those four; reduce, alltoall, sendrecv,
                         and a variant no plan has (--no-inplace allreduce), are errors
  -h, --help             print this help

size: bytes of the larger per-rank buffer (allgather: the gathered output; reduce_scatter:
the input; alltoall: the send buffer). algbw = size / time; busbw = algbw * factor, with
nccl-tests' factors: allreduce 2(n-1)/n; allgather, reduce_scatter, alltoall (n-1)/n;
broadcast, reduce, sendrecv 1. time: mean of ITERS calls after WARMUP, the slowest rank's.

exit status: 0 success; 1 a collective failed or #wrong > 0; 2 bad arguments.
";

/// Which variants to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Variants {
    /// Out of place and in place (nccl-tests' default).
    Both,
    /// `--inplace`.
    InPlaceOnly,
    /// `--no-inplace`.
    OutOfPlaceOnly,
}

/// A parsed command line.
#[derive(Clone, Debug, PartialEq)]
pub struct Options {
    /// The collectives to run, in order (`all`: every one).
    pub colls: Vec<Coll>,
    /// `-b`.
    pub min_bytes: usize,
    /// `-e`.
    pub max_bytes: usize,
    /// `-f`.
    pub factor: usize,
    /// `-n`.
    pub iters: usize,
    /// `-w`.
    pub warmup: usize,
    /// `-d`.
    pub dtype: DType,
    /// `-o`.
    pub op: ReduceOp,
    /// `-c`.
    pub check: bool,
    /// `--inplace` / `--no-inplace`.
    pub variants: Variants,
    /// `--algo` (`None`: leave `FERROCCL_ALGO` as it is; `Some("auto")`: the cost model).
    pub algo: Option<String>,
    /// `--transport`.
    pub transport: Option<TransportChoice>,
    /// `--ranks`.
    pub ranks: Option<usize>,
    /// `--root`.
    pub root: usize,
    /// `--json`.
    pub json: Option<PathBuf>,
    /// `--plot`.
    pub plot: Option<PathBuf>,
    /// `--baseline`.
    pub baseline: Option<PathBuf>,
    /// `--plan`: time persistent plans instead of one-off calls.
    pub plan: bool,
    /// Hidden `--corrupt-rank R`: rank R flips a byte of its result before the check (to
    /// test that the check sees it).
    pub corrupt_rank: Option<usize>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            colls: vec![Coll::AllReduce],
            min_bytes: 8,
            max_bytes: 32 << 20,
            factor: 2,
            iters: 20,
            warmup: 5,
            dtype: DType::F32,
            op: ReduceOp::Sum,
            check: true,
            variants: Variants::Both,
            algo: None,
            transport: None,
            ranks: None,
            root: 0,
            json: None,
            plot: None,
            baseline: None,
            plan: false,
            corrupt_rank: None,
        }
    }
}

/// What the command line asks for.
#[derive(Clone, Debug, PartialEq)]
pub enum Cmd {
    /// `--help`.
    Help,
    /// A benchmark.
    Run(Box<Options>),
}

/// A bad command line; the message names the argument.
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ArgError {
    /// No collective was named.
    #[error("missing the collective (allreduce, allgather, reduce_scatter, broadcast, reduce, alltoall, sendrecv or all)")]
    MissingCollective,
    /// The collective is not known.
    #[error("unknown collective {0:?} (allreduce, allgather, reduce_scatter, broadcast, reduce, alltoall, sendrecv or all)")]
    UnknownCollective(String),
    /// Two collectives were named.
    #[error("a second collective {0:?} (name one, or all)")]
    ExtraArgument(String),
    /// An option this tool does not know.
    #[error("unknown option {0:?}")]
    UnknownOption(String),
    /// An option that needs a value came last.
    #[error("{0} needs a value")]
    MissingValue(String),
    /// A value that does not parse or is out of range.
    #[error("{flag} {value:?}: {expected}")]
    BadValue {
        /// The option.
        flag: String,
        /// What was given.
        value: String,
        /// What is allowed.
        expected: String,
    },
    /// `--plan` with a collective, or a variant, that has no persistent plan.
    #[error("--plan: {coll} has no {what} (plans: allreduce and broadcast in place, allgather and reduce_scatter out of place)")]
    NoPlan {
        /// The collective.
        coll: String,
        /// What is missing: "persistent plan", "out-of-place plan", "in-place plan".
        what: String,
    },
}

/// Parses a size: a whole number of bytes with an optional suffix K, M or G (powers of
/// 1024; `KB`, `KiB` and lower case are accepted too).
pub fn parse_size(s: &str) -> Option<usize> {
    let t = s.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    if digits == 0 {
        return None;
    }
    let n: usize = t[..digits].parse().ok()?;
    let shift = match t[digits..].to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        _ => return None,
    };
    n.checked_mul(1usize << shift)
}

/// Renders a size the way it is usually written: `8`, `64K`, `1M`, `1536` (not a whole K).
pub fn format_size(b: usize) -> String {
    for (shift, suffix) in [(30, "G"), (20, "M"), (10, "K")] {
        if b >= 1 << shift && b.is_multiple_of(1 << shift) {
            return format!("{}{suffix}", b >> shift);
        }
    }
    b.to_string()
}

fn bad(flag: &str, value: &str, expected: &str) -> ArgError {
    ArgError::BadValue { flag: flag.to_string(), value: value.to_string(), expected: expected.to_string() }
}

/// Parses the arguments after the program name.
pub fn parse<S: AsRef<str>>(args: &[S]) -> Result<Cmd, ArgError> {
    let mut o = Options::default();
    let mut coll: Option<Vec<Coll>> = None;
    let mut i = 0;
    while i < args.len() {
        let arg = args[i].as_ref();
        if !arg.starts_with('-') || arg == "-" {
            if coll.is_some() {
                return Err(ArgError::ExtraArgument(arg.to_string()));
            }
            coll = Some(if arg == "all" {
                Coll::ALL.to_vec()
            } else {
                vec![Coll::parse(arg).ok_or_else(|| ArgError::UnknownCollective(arg.to_string()))?]
            });
            i += 1;
            continue;
        }
        let (flag, inline) = match arg.strip_prefix("--").and_then(|r| r.split_once('=')) {
            Some((f, v)) => (&arg[..f.len() + 2], Some(v)),
            None => (arg, None),
        };
        let value = |i: &mut usize| -> Result<String, ArgError> {
            if let Some(v) = inline {
                return Ok(v.to_string());
            }
            *i += 1;
            args.get(*i).map(|v| v.as_ref().to_string()).ok_or_else(|| ArgError::MissingValue(flag.to_string()))
        };
        let count = |v: &str, min: usize, what: &str| -> Result<usize, ArgError> {
            v.trim().parse::<usize>().ok().filter(|&n| n >= min).ok_or_else(|| bad(flag, v, what))
        };
        let size = |v: &str| -> Result<usize, ArgError> {
            parse_size(v).filter(|&b| b > 0).ok_or_else(|| bad(flag, v, "must be a positive size in bytes, like 8, 64K, 1M or 256M"))
        };
        let no_value = |f: &str| inline.is_none() && flag == f;
        match flag {
            "-h" | "--help" if inline.is_none() => return Ok(Cmd::Help),
            _ if no_value("--plan") => o.plan = true,
            _ if no_value("--inplace") => o.variants = Variants::InPlaceOnly,
            _ if no_value("--no-inplace") => o.variants = Variants::OutOfPlaceOnly,
            "-b" | "--minbytes" => o.min_bytes = size(&value(&mut i)?)?,
            "-e" | "--maxbytes" => o.max_bytes = size(&value(&mut i)?)?,
            "-f" | "--stepfactor" => o.factor = count(&value(&mut i)?, 2, "must be a whole number, 2 or more")?,
            "-n" | "--iters" => o.iters = count(&value(&mut i)?, 1, "must be a whole number, 1 or more")?,
            "-w" | "--warmup" => o.warmup = count(&value(&mut i)?, 0, "must be a whole number, 0 or more")?,
            "-d" | "--datatype" => {
                let v = value(&mut i)?;
                o.dtype = DType::parse(v.trim()).ok_or_else(|| bad(flag, &v, "must be one of f32 f64 f16 bf16 i8 u8 i32 u32 i64 u64"))?;
            }
            "-o" | "--op" => {
                let v = value(&mut i)?;
                o.op = ReduceOp::parse(v.trim()).ok_or_else(|| bad(flag, &v, "must be one of sum prod min max avg"))?;
            }
            "-c" | "--check" => {
                let v = value(&mut i)?;
                o.check = match v.trim() {
                    "0" => false,
                    "1" => true,
                    _ => return Err(bad(flag, &v, "must be 0 or 1")),
                };
            }
            "-r" | "--root" => o.root = count(&value(&mut i)?, 0, "must be a rank, 0 or more")?,
            "--algo" => {
                let v = value(&mut i)?;
                let a = v.trim().to_ascii_lowercase();
                if a != "auto" && !ferroccl::params::ALGO_NAMES.contains(&a.as_str()) {
                    let names = ferroccl::params::ALGO_NAMES.join(", ");
                    return Err(bad(flag, &v, &format!("must be one of auto, {names}")));
                }
                o.algo = Some(a);
            }
            "--transport" => {
                let v = value(&mut i)?;
                o.transport = Some(TransportChoice::parse(&v).ok_or_else(|| bad(flag, &v, "must be one of auto, shm, tcp, verbs"))?);
            }
            "--ranks" => {
                o.ranks = Some(count(&value(&mut i)?, 1, "must be a whole number of ranks, 1 to 1024").and_then(|n| {
                    if n <= ferroccl_run::MAX_RANKS {
                        Ok(n)
                    } else {
                        Err(bad("--ranks", &n.to_string(), "must be a whole number of ranks, 1 to 1024"))
                    }
                })?);
            }
            "--json" => o.json = Some(PathBuf::from(value(&mut i)?)),
            "--plot" => {
                let v = value(&mut i)?;
                if !v.to_ascii_lowercase().ends_with(".svg") {
                    return Err(bad(flag, &v, "must name an .svg file"));
                }
                o.plot = Some(PathBuf::from(v));
            }
            "--baseline" => o.baseline = Some(PathBuf::from(value(&mut i)?)),
            "--corrupt-rank" => o.corrupt_rank = Some(count(&value(&mut i)?, 0, "must be a rank")?),
            _ => return Err(ArgError::UnknownOption(arg.to_string())),
        }
        i += 1;
    }
    let all = coll.as_ref().is_some_and(|c| c.len() > 1);
    o.colls = coll.ok_or(ArgError::MissingCollective)?;
    if o.plan {
        o.colls = plan_colls(&o.colls, o.variants, all)?;
    }
    if o.min_bytes > o.max_bytes {
        return Err(bad("-e", &o.max_bytes.to_string(), &format!("is smaller than -b {}", o.min_bytes)));
    }
    if o.baseline.is_some() && o.plot.is_none() {
        return Err(bad("--baseline", &o.baseline.as_ref().map(|p| p.display().to_string()).unwrap_or_default(), "needs --plot"));
    }
    if let (Some(n), r) = (o.ranks, o.root) {
        if r >= n && o.colls.iter().any(|c| c.rooted()) {
            return Err(bad("--root", &r.to_string(), &format!("is out of range for --ranks {n}")));
        }
    }
    if let (Some(n), Some(r)) = (o.ranks, o.corrupt_rank) {
        if r >= n {
            return Err(bad("--corrupt-rank", &r.to_string(), &format!("is out of range for --ranks {n}")));
        }
    }
    Ok(Cmd::Run(Box::new(o)))
}

/// With `--plan`: the collectives to run. `all` keeps those with a plan of the variants
/// asked for; a collective named alone must have one.
fn plan_colls(colls: &[Coll], variants: Variants, all: bool) -> Result<Vec<Coll>, ArgError> {
    let missing = |c: Coll| -> Option<&'static str> {
        let (ip, oop) = (c.plan_in_place(), c.plan_out_of_place());
        match variants {
            _ if !ip && !oop => Some("persistent plan"),
            Variants::InPlaceOnly if !ip => Some("in-place plan (drop --inplace)"),
            Variants::OutOfPlaceOnly if !oop => Some("out-of-place plan (drop --no-inplace)"),
            _ => None,
        }
    };
    let keep: Vec<Coll> = colls.iter().copied().filter(|&c| missing(c).is_none()).collect();
    match colls.iter().find(|&&c| missing(c).is_some()) {
        Some(&c) if !all || keep.is_empty() => {
            Err(ArgError::NoPlan { coll: if all { "all".into() } else { c.name().into() }, what: missing(c).unwrap_or_default().into() })
        }
        _ => Ok(keep),
    }
}

/// The arguments with `--ranks N` (or `--ranks=N`) taken out: what each rank is given.
pub fn without_ranks<S: AsRef<str>>(args: &[S]) -> Vec<String> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < args.len() {
        let a = args[i].as_ref();
        if a == "--ranks" {
            i += 2;
            continue;
        }
        if !a.starts_with("--ranks=") {
            out.push(a.to_string());
        }
        i += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(args: &[&str]) -> Options {
        match parse(args) {
            Ok(Cmd::Run(o)) => *o,
            other => panic!("{args:?}: {other:?}"),
        }
    }

    fn err(args: &[&str]) -> String {
        match parse(args) {
            Err(e) => e.to_string(),
            Ok(c) => panic!("{args:?} parsed: {c:?}"),
        }
    }

    #[test]
    fn parses_an_nccl_tests_command_line() {
        let o = run(&[
            "allreduce",
            "-b",
            "8",
            "-e",
            "256M",
            "-f",
            "4",
            "-n",
            "10",
            "-w",
            "2",
            "-d",
            "bf16",
            "-o",
            "max",
            "-c",
            "0",
            "--inplace",
            "--algo",
            "ring",
            "--transport",
            "shm",
            "--ranks",
            "4",
            "--root",
            "3",
            "--json",
            "/tmp/x.json",
            "--plot",
            "/tmp/x.svg",
            "--baseline=/tmp/b.json",
        ]);
        assert_eq!(o.colls, vec![Coll::AllReduce]);
        assert_eq!((o.min_bytes, o.max_bytes, o.factor, o.iters, o.warmup), (8, 256 << 20, 4, 10, 2));
        assert_eq!((o.dtype, o.op, o.check, o.variants), (DType::Bf16, ReduceOp::Max, false, Variants::InPlaceOnly));
        assert_eq!((o.algo.as_deref(), o.transport, o.ranks, o.root), (Some("ring"), Some(TransportChoice::Shm), Some(4), 3));
        assert_eq!(o.baseline, Some(PathBuf::from("/tmp/b.json")));
        assert_eq!(run(&["all"]).colls, Coll::ALL.to_vec());
        assert_eq!(run(&["broadcast"]).variants, Variants::Both);
        assert_eq!(run(&["--no-inplace", "alltoall"]).variants, Variants::OutOfPlaceOnly);
        assert_eq!(parse(&["--help"]), Ok(Cmd::Help));
    }

    #[test]
    fn plan_keeps_the_collectives_that_have_plans() {
        let o = run(&["allreduce", "--plan"]);
        assert!(o.plan);
        assert_eq!(o.colls, vec![Coll::AllReduce]);
        assert_eq!(run(&["all", "--plan"]).colls, vec![Coll::AllReduce, Coll::AllGather, Coll::ReduceScatter, Coll::Broadcast]);
        assert_eq!(run(&["all", "--plan", "--inplace"]).colls, vec![Coll::AllReduce, Coll::Broadcast]);
        assert_eq!(run(&["all", "--plan", "--no-inplace"]).colls, vec![Coll::AllGather, Coll::ReduceScatter]);
        assert!(!run(&["all"]).plan);
    }

    #[test]
    fn sizes_parse_with_suffixes() {
        assert_eq!(parse_size("8"), Some(8));
        assert_eq!(parse_size("64K"), Some(64 << 10));
        assert_eq!(parse_size("1M"), Some(1 << 20));
        assert_eq!(parse_size("256m"), Some(256 << 20));
        assert_eq!(parse_size("2GiB"), Some(2 << 30));
        assert_eq!(parse_size("1KB"), Some(1024));
        for bad in ["", "K", "1.5M", "-8", "8X", "99999999999999999999G"] {
            assert_eq!(parse_size(bad), None, "{bad}");
        }
        assert_eq!(format_size(8), "8");
        assert_eq!(format_size(64 << 10), "64K");
        assert_eq!(format_size(256 << 20), "256M");
        assert_eq!(format_size(1536), "1536");
    }

    #[test]
    fn errors_name_the_argument() {
        let cases: &[(&[&str], &str)] = &[
            (&[], "missing the collective"),
            (&["allreduc"], "allreduc"),
            (&["allreduce", "allgather"], "allgather"),
            (&["allreduce", "-b", "8X"], "-b \"8X\""),
            (&["allreduce", "-b", "0"], "-b \"0\""),
            (&["allreduce", "-e"], "-e needs a value"),
            (&["allreduce", "-b", "1M", "-e", "1K"], "-e"),
            (&["allreduce", "-f", "1"], "-f \"1\""),
            (&["allreduce", "-n", "0"], "-n \"0\""),
            (&["allreduce", "-w", "x"], "-w \"x\""),
            (&["allreduce", "-d", "f8"], "-d \"f8\""),
            (&["allreduce", "-o", "xor"], "-o \"xor\""),
            (&["allreduce", "-c", "2"], "-c \"2\""),
            (&["allreduce", "--algo", "bubble"], "--algo \"bubble\""),
            (&["allreduce", "--transport", "pigeon"], "--transport \"pigeon\""),
            (&["allreduce", "--ranks", "0"], "--ranks \"0\""),
            (&["allreduce", "--ranks", "2000"], "--ranks"),
            (&["broadcast", "--ranks", "2", "--root", "2"], "--root \"2\""),
            (&["allreduce", "--ranks", "2", "--corrupt-rank", "5"], "--corrupt-rank"),
            (&["allreduce", "--plot", "x.png"], "--plot \"x.png\""),
            (&["allreduce", "--baseline", "b.json"], "--baseline"),
            (&["allreduce", "--frobnicate"], "--frobnicate"),
            (&["allreduce", "--inplace=1"], "--inplace=1"),
            (&["reduce", "--plan"], "--plan: reduce has no persistent plan"),
            (&["allreduce", "--plan", "--no-inplace"], "--plan: allreduce has no out-of-place plan"),
            (&["allgather", "--plan", "--inplace"], "--plan: allgather has no in-place plan"),
            (&["alltoall", "--plan"], "alltoall has no persistent plan"),
            (&["all", "--plan=1"], "--plan=1"),
        ];
        for (args, want) in cases {
            let e = err(args);
            assert!(e.contains(want), "{args:?}: {e:?} does not contain {want:?}");
        }
    }

    #[test]
    fn ranks_are_taken_out_of_the_rank_arguments() {
        assert_eq!(without_ranks(&["allreduce", "--ranks", "4", "-b", "8"]), vec!["allreduce", "-b", "8"]);
        assert_eq!(without_ranks(&["--ranks=2", "all"]), vec!["all"]);
    }
}
