//! The command line, parsed by clap (derive API).
//!
//! Every error is an [`ArgError`] that names the option and the value
//! (`-b "8X": must be a positive size in bytes, ...`), whatever clap's own wording; an
//! option that has a short name is named by it. Options that take a value take the next
//! argument whatever it looks like (`-w -1` is a bad warm-up, not an unknown option).

use std::path::PathBuf;

use clap::error::ErrorKind;
use clap::{Command, CommandFactory, FromArgMatches, Parser, Subcommand};
use ferroccl::{DType, ReduceOp, TransportChoice};
use ferroccl_run::cli::{self, Problem};

use crate::colls::Coll;
use crate::sub::Common;
use crate::{idle, latency, moe, overlap, rma, skew, weights, Failure};

/// The one-line usage printed with every command-line error.
pub const USAGE: &str = "usage: ferroccl-perf <allreduce|allgather|reduce_scatter|broadcast|reduce|alltoall|alltoallv|sendrecv|all> \
[-b MIN] [-e MAX] [-f FACTOR] [-n ITERS] [-w WARMUP] [-d DTYPE] [-o OP] [-c 0|1] [--inplace|--no-inplace] \
[--plan] [--algo A] [--transport T] [--ranks N] [--root R] [--json FILE] [--plot FILE.svg] [--baseline FILE.json]
       ferroccl-perf <latency|idle|overlap|rma|skew|weights|plot> ... (see ferroccl-perf --help)";

/// `--help`'s usage lines.
const HELP_USAGE: &str = "\
ferroccl-perf COLLECTIVE [OPTIONS]
       ferroccl-run -n N -- ferroccl-perf COLLECTIVE [OPTIONS]
       ferroccl-perf COMMAND [OPTIONS]   (the commands below; ferroccl-perf COMMAND --help for theirs)
       ferroccl-perf plot OUT.svg RESULTS.json [MORE.json ...]";

/// The end of `--help`, after the options.
const AFTER_HELP: &str = "\
size: bytes of the larger per-rank buffer (allgather: the gathered output; reduce_scatter:
the input; alltoall, alltoallv (uniform counts): the send buffer). algbw = size / time; busbw = algbw * factor, with
nccl-tests' factors: allreduce 2(n-1)/n; allgather, reduce_scatter, alltoall(v) (n-1)/n;
broadcast, reduce, sendrecv 1. time: mean of ITERS calls after WARMUP, the slowest rank's.

exit status: 0 success; 1 a collective failed or #wrong > 0; 2 bad arguments.";

/// The template of every `--help` of this tool: about, usage, options, the rest.
pub(crate) const HELP_TEMPLATE: &str = "{about}\n\nusage: {usage}\n\n{before-help}{all-args}{after-help}";

/// The whole command line as clap sees it: a subcommand ([`Sub`]), or else the collective
/// benchmark (a collective and its options, which [`parse`] checks and makes the
/// [`Options`] of; their `Default` holds the defaults). The options every subcommand shares
/// ([`Common`]) are declared once, here, global to every subcommand. [`command`] gives every
/// subcommand the same help template and option rules.
#[derive(Debug, Parser)]
#[command(
    name = "ferroccl-perf",
    about = "ferroccl-perf: nccl-tests-style benchmark of FerroCCL's collectives",
    override_usage = HELP_USAGE,
    help_template = HELP_TEMPLATE,
    after_help = AFTER_HELP,
    args_override_self = true,
    max_term_width = 100,
    // A subcommand is the first argument; after an option, a word is a collective.
    args_conflicts_with_subcommands = true,
    disable_help_subcommand = true
)]
struct Cli {
    /// A measurement subcommand instead of the collective benchmark.
    #[command(subcommand)]
    sub: Option<Sub>,
    /// `--ranks`, `--transport`, `--no-bind`: shared by every subcommand.
    #[command(flatten)]
    common: Common,
    /// allreduce, allgather, reduce_scatter, broadcast, reduce, alltoall, alltoallv, sendrecv or all
    // Several are taken (and each checked, in order) so that an unknown name is reported
    // before a second one; [`parse`] refuses the second.
    #[arg(value_name = "COLLECTIVE", value_parser = collectives)]
    colls: Vec<Colls>,
    /// Smallest size (default 8; suffixes K, M, G = 2^10, 2^20, 2^30)
    #[arg(short = 'b', long = "minbytes", value_name = "SIZE", allow_hyphen_values = true, value_parser = size)]
    min_bytes: Option<usize>,
    /// Largest size (default 32M)
    #[arg(short = 'e', long = "maxbytes", value_name = "SIZE", allow_hyphen_values = true, value_parser = size)]
    max_bytes: Option<usize>,
    /// Multiply the size by F (whole number >= 2) each row (default 2); MAX is always the
    /// last row
    #[arg(short = 'f', long = "stepfactor", value_name = "F", allow_hyphen_values = true, value_parser = whole::<2>)]
    factor: Option<usize>,
    /// Timed iterations per size (default 20)
    #[arg(short = 'n', long = "iters", value_name = "N", allow_hyphen_values = true, value_parser = whole::<1>)]
    iters: Option<usize>,
    /// Untimed iterations before them (default 5)
    #[arg(short = 'w', long = "warmup", value_name = "N", allow_hyphen_values = true, value_parser = whole::<0>)]
    warmup: Option<usize>,
    /// f32 f64 f16 bf16 i8 u8 i32 u32 i64 u64 (default f32)
    #[arg(short = 'd', long = "datatype", value_name = "T", allow_hyphen_values = true, value_parser = dtype)]
    dtype: Option<DType>,
    /// sum prod min max avg (default sum)
    #[arg(short = 'o', long = "op", value_name = "OP", allow_hyphen_values = true, value_parser = op)]
    op: Option<ReduceOp>,
    /// 1: check every element of one more call per size against the reference and count
    /// wrong elements in #wrong (default 1)
    #[arg(short = 'c', long = "check", value_name = "0|1", allow_hyphen_values = true, value_parser = check)]
    check: Option<bool>,
    /// Root of broadcast and reduce (default 0)
    #[arg(short = 'r', long = "root", value_name = "R", allow_hyphen_values = true, value_parser = rank)]
    root: Option<usize>,
    /// Run the in-place variant only
    #[arg(long, overrides_with = "no_inplace")]
    inplace: bool,
    /// Run the out-of-place variant only (default: both)
    #[arg(long, overrides_with = "inplace")]
    no_inplace: bool,
    /// auto, ring, mesh, oneshot, chain, bruck, binomial, pairwise (FERROCCL_ALGO for this run)
    #[arg(long, value_name = "A", allow_hyphen_values = true, value_parser = algo)]
    algo: Option<String>,
    /// Write every row and the run's metadata as JSON
    #[arg(long, value_name = "FILE", allow_hyphen_values = true, value_parser = path)]
    json: Option<PathBuf>,
    /// Draw busbw and time vs size as an SVG
    #[arg(long, value_name = "FILE.svg", allow_hyphen_values = true, value_parser = svg)]
    plot: Option<PathBuf>,
    /// Overlay the rows of an earlier --json file (or benches/peers' MPI program) on the plot
    #[arg(long, value_name = "FILE.json", allow_hyphen_values = true, value_parser = path)]
    baseline: Option<PathBuf>,
    /// Time persistent plans: each size builds its plan once (comm.plan of op::allreduce,
    /// op::allgather_into, op::reduce_scatter_into, op::broadcast) and the timed calls are
    /// plan.run(); -c 1 refills the inputs through plan.input_mut()/output_mut() and checks
    /// plan.output(). Plans exist for allreduce and broadcast in place, allgather and
    /// reduce_scatter out of place: the other variant's cells are N/A; `all` runs those
    /// four; reduce, alltoall(v), sendrecv, and a variant no plan has (--no-inplace
    /// allreduce), are errors
    #[arg(long)]
    plan: bool,
    /// Rank R flips a byte of its result before the check (to test that the check sees it)
    #[arg(long, hide = true, value_name = "R", allow_hyphen_values = true, value_parser = rank)]
    corrupt_rank: Option<usize>,
}

/// A collective named on the command line (`all`: every one), and its name.
#[derive(Clone, Debug)]
struct Colls(Vec<Coll>, String);

/// The subcommands: each is `ferroccl-perf NAME [OPTIONS]`, with its own `--help`, and the
/// shared options ([`Common`]) copied into its options' `common` by [`parse`].
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq, Subcommand)]
pub enum Sub {
    /// `latency`.
    #[command(about = latency::ABOUT, override_usage = usage(latency::USAGE), before_help = latency::ABOUT_MORE, after_help = latency::AFTER_HELP)]
    Latency(latency::LatencyOptions),
    /// `idle`.
    #[command(about = idle::ABOUT, override_usage = usage(idle::USAGE), before_help = idle::ABOUT_MORE, after_help = idle::AFTER_HELP)]
    Idle(idle::IdleOptions),
    /// `overlap`.
    #[command(about = overlap::ABOUT, override_usage = usage(overlap::USAGE), before_help = overlap::ABOUT_MORE, after_help = overlap::AFTER_HELP)]
    Overlap(overlap::OverlapOptions),
    /// `rma`.
    #[command(about = rma::ABOUT, override_usage = usage(rma::USAGE), before_help = rma::ABOUT_MORE, after_help = rma::AFTER_HELP)]
    Rma(rma::RmaOptions),
    /// `skew`.
    #[command(about = skew::ABOUT, override_usage = usage(skew::USAGE), before_help = skew::ABOUT_MORE, after_help = skew::AFTER_HELP)]
    Skew(skew::SkewOptions),
    /// `weights`.
    #[command(about = weights::ABOUT, override_usage = usage(weights::USAGE), before_help = weights::ABOUT_MORE, after_help = weights::AFTER_HELP)]
    Weights(weights::WeightsOptions),
    /// `moe`.
    #[command(about = moe::ABOUT, override_usage = usage(moe::USAGE), before_help = moe::ABOUT_MORE, after_help = moe::AFTER_HELP)]
    Moe(moe::MoeOptions),
    /// `plot`.
    #[command(about = PLOT_ABOUT, override_usage = usage(PLOT_USAGE))]
    Plot(PlotArgs),
}

/// `ferroccl-perf plot`'s usage, printed with every command-line error.
pub const PLOT_USAGE: &str = "usage: ferroccl-perf plot OUT.svg RESULTS.json [MORE.json ...]";

const PLOT_ABOUT: &str = "ferroccl-perf plot: draw results files (--json of this tool, or benches/peers' MPI program's) in one \
picture, without running anything; files not written by ferroccl-perf are drawn dashed, as baselines";

/// `ferroccl-perf plot`'s arguments.
#[derive(Clone, Debug, PartialEq, Eq, clap::Args)]
pub struct PlotArgs {
    /// OUT.svg, then one or more results files
    #[arg(value_name = "FILE", allow_hyphen_values = true)]
    pub files: Vec<String>,
}

/// A usage line without its `usage: ` (the help template adds it).
fn usage(u: &'static str) -> &'static str {
    u.strip_prefix("usage: ").unwrap_or(u)
}

impl Sub {
    /// The usage line of the subcommand named `name` (for its command-line errors).
    pub fn usage_of(name: &str) -> Option<&'static str> {
        let u = match name {
            "latency" => latency::USAGE,
            "idle" => idle::USAGE,
            "overlap" => overlap::USAGE,
            "rma" => rma::USAGE,
            "skew" => skew::USAGE,
            "weights" => weights::USAGE,
            "moe" => moe::USAGE,
            "plot" => PLOT_USAGE,
            _ => return None,
        };
        Some(u.lines().next().unwrap_or(u))
    }

    /// The subcommand's options that [`Common`] sets (`None`: `plot`, which runs nothing).
    fn common_mut(&mut self) -> Option<&mut Common> {
        match self {
            Sub::Latency(o) => Some(&mut o.common),
            Sub::Idle(o) => Some(&mut o.common),
            Sub::Overlap(o) => Some(&mut o.common),
            Sub::Rma(o) => Some(&mut o.common),
            Sub::Skew(o) => Some(&mut o.common),
            Sub::Weights(o) => Some(&mut o.common),
            Sub::Moe(o) => Some(&mut o.common),
            Sub::Plot(_) => None,
        }
    }

    /// The shared options given to the subcommand.
    pub fn common(&self) -> Common {
        self.clone().common_mut().map(|c| *c).unwrap_or_default()
    }

    /// Runs the subcommand on this rank (or, for `plot`, runs it).
    pub fn run(&self) -> Result<(), Failure> {
        match self {
            Sub::Latency(o) => latency::run(o),
            Sub::Idle(o) => idle::run(o),
            Sub::Overlap(o) => overlap::run(o),
            Sub::Rma(o) => rma::run(o),
            Sub::Skew(o) => skew::run(o),
            Sub::Weights(o) => weights::run(o),
            Sub::Moe(o) => moe::run(o),
            Sub::Plot(p) => crate::plot_files(&p.files),
        }
    }
}

/// The command line's clap command: [`Cli`]'s, every subcommand with the same help
/// template, option rules (the last of a repeated option wins) and width.
fn command() -> Command {
    Cli::command().mut_subcommands(|s| {
        let name = format!("ferroccl-perf {}", s.get_name());
        s.help_template(HELP_TEMPLATE).args_override_self(true).max_term_width(100).bin_name(name)
    })
}

/// `--help`.
pub fn help() -> String {
    command().render_help().to_string()
}

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
    /// With `--ranks`: pin the ranks to CPUs as ferroccl-run does (`false`: `--no-bind`).
    pub bind: bool,
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
            bind: true,
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
    /// `--help` (of the tool or of a subcommand): the text to print.
    Help(String),
    /// A benchmark.
    Run(Box<Options>),
    /// A subcommand, its shared options filled in.
    Sub(Box<Sub>),
}

/// A bad command line; the message names the argument.
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ArgError {
    /// No collective was named.
    #[error("missing the collective (allreduce, allgather, reduce_scatter, broadcast, reduce, alltoall, alltoallv, sendrecv or all)")]
    MissingCollective,
    /// The collective is not known.
    #[error("unknown collective {0:?} (allreduce, allgather, reduce_scatter, broadcast, reduce, alltoall, alltoallv, sendrecv or all)")]
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
    /// Anything else clap finds wrong, in its words.
    #[error("{0}")]
    Other(String),
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

/// Parses the arguments after the program name.
pub fn parse<S: AsRef<str>>(args: &[S]) -> Result<Cmd, ArgError> {
    let mut cmd = command();
    let matches = cmd.try_get_matches_from_mut(std::iter::once("ferroccl-perf").chain(args.iter().map(AsRef::as_ref)));
    let cli = match matches.and_then(|m| Cli::from_arg_matches(&m)) {
        Ok(cli) => cli,
        Err(e) if e.kind() == ErrorKind::DisplayHelp => return Ok(Cmd::Help(e.render().to_string())),
        Err(e) => {
            // A subcommand's error names its options: look them up in its command.
            let sub = args.first().and_then(|a| cmd.find_subcommand(a.as_ref())).cloned();
            return Err(ArgError::from_clap(&e, sub.as_ref().unwrap_or(&cmd), args));
        }
    };
    if let Some(mut sub) = cli.sub {
        match sub.common_mut() {
            Some(c) => *c = cli.common,
            None if cli.common != Common::default() => {
                return Err(ArgError::Other("plot runs no ranks: --ranks, --transport and --no-bind do not apply".into()))
            }
            None => {}
        }
        return Ok(Cmd::Sub(Box::new(sub)));
    }
    let mut named = cli.colls.into_iter();
    let colls = named.next().ok_or(ArgError::MissingCollective)?.0;
    if let Some(Colls(_, second)) = named.next() {
        return Err(ArgError::ExtraArgument(second));
    }
    let d = Options::default();
    let mut o = Options {
        colls,
        min_bytes: cli.min_bytes.unwrap_or(d.min_bytes),
        max_bytes: cli.max_bytes.unwrap_or(d.max_bytes),
        factor: cli.factor.unwrap_or(d.factor),
        iters: cli.iters.unwrap_or(d.iters),
        warmup: cli.warmup.unwrap_or(d.warmup),
        dtype: cli.dtype.unwrap_or(d.dtype),
        op: cli.op.unwrap_or(d.op),
        check: cli.check.unwrap_or(d.check),
        variants: match (cli.inplace, cli.no_inplace) {
            (true, _) => Variants::InPlaceOnly,
            (_, true) => Variants::OutOfPlaceOnly,
            _ => d.variants,
        },
        algo: cli.algo,
        transport: cli.common.transport,
        ranks: cli.common.ranks,
        bind: !cli.common.no_bind,
        root: cli.root.unwrap_or(d.root),
        json: cli.json,
        plot: cli.plot,
        baseline: cli.baseline,
        plan: cli.plan,
        corrupt_rank: cli.corrupt_rank,
    };
    let all = o.colls.len() > 1;
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

/// Parses `ferroccl-perf NAME ARGS`, a subcommand's command line; `Ok(None)` for `--help`.
pub fn parse_sub<S: AsRef<str>>(name: &str, args: &[S]) -> Result<Option<Sub>, ArgError> {
    let all: Vec<&str> = std::iter::once(name).chain(args.iter().map(AsRef::as_ref)).collect();
    match parse(&all)? {
        Cmd::Sub(s) => Ok(Some(*s)),
        Cmd::Help(_) => Ok(None),
        Cmd::Run(_) => Err(ArgError::Other(format!("{name:?} is not a subcommand"))),
    }
}

/// Why a value parser refused a value: what it expected. [`ArgError::from_clap`] makes it
/// an [`ArgError::BadValue`] naming the option and the value.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub(crate) struct Expected(pub(crate) String);

impl ArgError {
    /// The error for what clap found wrong with `args`, given to `cmd`.
    fn from_clap<S: AsRef<str>>(e: &clap::Error, cmd: &Command, args: &[S]) -> ArgError {
        match Problem::of(e, cmd, args) {
            // Our value parsers' own errors: complete, or what was expected.
            Problem::BadValue { reason: Some(r), .. } if r.is::<ArgError>() => {
                r.downcast_ref::<ArgError>().cloned().unwrap_or_else(|| ArgError::Other(cli::message(e)))
            }
            Problem::BadValue { option, value, reason: Some(r) } if r.is::<Expected>() => bad(&option, &value, &r.to_string()),
            Problem::MissingValue(option) => ArgError::MissingValue(option),
            Problem::UnknownOption(option) => ArgError::UnknownOption(option),
            Problem::Unexpected(arg) => ArgError::ExtraArgument(arg),
            _ => ArgError::Other(cli::message(e)),
        }
    }
}

fn bad(flag: &str, value: &str, expected: &str) -> ArgError {
    ArgError::BadValue { flag: flag.to_string(), value: value.to_string(), expected: expected.to_string() }
}

/// The positional argument: one collective, or `all`.
fn collectives(v: &str) -> Result<Colls, ArgError> {
    if v == "all" {
        return Ok(Colls(Coll::ALL.to_vec(), v.to_string()));
    }
    Coll::parse(v).map(|c| Colls(vec![c], v.to_string())).ok_or_else(|| ArgError::UnknownCollective(v.to_string()))
}

/// `-b`, `-e`: a positive size.
fn size(v: &str) -> Result<usize, Expected> {
    parse_size(v).filter(|&b| b > 0).ok_or_else(|| Expected("must be a positive size in bytes, like 8, 64K, 1M or 256M".into()))
}

/// A whole number, at least `MIN`.
pub(crate) fn whole<const MIN: usize>(v: &str) -> Result<usize, Expected> {
    v.trim().parse::<usize>().ok().filter(|&n| n >= MIN).ok_or_else(|| Expected(format!("must be a whole number, {MIN} or more")))
}

/// A rank (`--root`, `--corrupt-rank`).
fn rank(v: &str) -> Result<usize, Expected> {
    v.trim().parse::<usize>().map_err(|_| Expected("must be a rank, 0 or more".into()))
}

/// `--ranks`: 1 to [`ferroccl_run::MAX_RANKS`].
pub(crate) fn ranks(v: &str) -> Result<usize, Expected> {
    let n = v.trim().parse::<usize>().ok().filter(|n| (1..=ferroccl_run::MAX_RANKS).contains(n));
    n.ok_or_else(|| Expected("must be a whole number of ranks, 1 to 1024".into()))
}

/// A positive number of seconds.
pub(crate) fn seconds(v: &str) -> Result<f64, Expected> {
    v.trim()
        .parse::<f64>()
        .ok()
        .filter(|s| s.is_finite() && *s > 0.0)
        .ok_or_else(|| Expected("must be a positive number of seconds".into()))
}

/// `--transport`.
pub(crate) fn transport(v: &str) -> Result<TransportChoice, Expected> {
    TransportChoice::parse(v).ok_or_else(|| Expected("must be one of auto, shm, tcp, verbs".into()))
}

fn dtype(v: &str) -> Result<DType, Expected> {
    DType::parse(v.trim()).ok_or_else(|| Expected("must be one of f32 f64 f16 bf16 i8 u8 i32 u32 i64 u64".into()))
}

fn op(v: &str) -> Result<ReduceOp, Expected> {
    ReduceOp::parse(v.trim()).ok_or_else(|| Expected("must be one of sum prod min max avg".into()))
}

fn check(v: &str) -> Result<bool, Expected> {
    match v.trim() {
        "0" => Ok(false),
        "1" => Ok(true),
        _ => Err(Expected("must be 0 or 1".into())),
    }
}

/// `--algo`, lower-cased: auto or one of the library's algorithms.
fn algo(v: &str) -> Result<String, Expected> {
    let a = v.trim().to_ascii_lowercase();
    if a != "auto" && ferroccl::Algo::parse(&a).is_none() {
        let names: Vec<&str> = ferroccl::Algo::ALL.iter().map(|a| a.name()).collect();
        return Err(Expected(format!("must be one of auto, {}", names.join(", "))));
    }
    Ok(a)
}

fn path(v: &str) -> Result<PathBuf, Expected> {
    Ok(PathBuf::from(v))
}

/// `--plot`: a file name ending in .svg.
fn svg(v: &str) -> Result<PathBuf, Expected> {
    if !v.to_ascii_lowercase().ends_with(".svg") {
        return Err(Expected("must name an .svg file".into()));
    }
    Ok(PathBuf::from(v))
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
        assert!(matches!(parse(&["--help"]), Ok(Cmd::Help(h)) if h.contains("--minbytes")));
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
    fn spellings_repeats_and_order() {
        // nccl-tests' long names, `=`, and a short option's value attached.
        let o = run(&[
            "allreduce",
            "--minbytes=1K",
            "--maxbytes",
            "4K",
            "-f4",
            "--iters=3",
            "-w",
            "0",
            "--datatype",
            "i8",
            "--op=min",
            "--check",
            "0",
        ]);
        assert_eq!((o.min_bytes, o.max_bytes, o.factor, o.iters, o.warmup), (1024, 4096, 4, 3, 0));
        assert_eq!((o.dtype, o.op, o.check), (DType::I8, ReduceOp::Min, false));
        // The last of a repeated option wins, also between --inplace and --no-inplace.
        let o = run(&["allreduce", "-b", "8", "-b", "16", "--inplace", "--no-inplace"]);
        assert_eq!((o.min_bytes, o.variants), (16, Variants::OutOfPlaceOnly));
        assert_eq!(run(&["allreduce", "--no-inplace", "--inplace"]).variants, Variants::InPlaceOnly);
        // Errors name the option as it was given, and come in command-line order.
        assert!(err(&["allreduce", "--minbytes", "8X"]).contains("--minbytes \"8X\""));
        assert!(err(&["allreduce", "--root=-1"]).contains("--root \"-1\""));
        assert!(err(&["allreduce", "--maxbytes"]).contains("--maxbytes needs a value"));
        assert!(err(&["allreduc", "allgather"]).contains("unknown collective \"allreduc\""));
        assert!(err(&["allreduc", "-b", "8X"]).contains("unknown collective \"allreduc\""));
        assert!(err(&["allreduce", "-b", "8X", "-e", "8Y"]).contains("-b \"8X\""));
        // Help text.
        let h = help();
        for option in ["--minbytes", "--stepfactor", "--inplace", "--baseline", "--plan", "busbw", "exit status"] {
            assert!(h.contains(option), "{option}: {h}");
        }
        assert!(!h.contains("corrupt"), "--corrupt-rank is hidden: {h}");
    }

    #[test]
    fn subcommands_share_the_common_options() {
        let Ok(Some(Sub::Idle(o))) = parse_sub("idle", &["--no-bind", "--ranks", "3", "--transport", "tcp", "--seconds", "1"]) else {
            panic!("idle parses")
        };
        assert_eq!((o.common.ranks, o.common.transport, o.common.no_bind), (Some(3), Some(TransportChoice::Tcp), true));
        assert_eq!(parse_sub("moe", &["--help"]), Ok(None));
        assert!(
            matches!(parse(&["latency", "--help"]), Ok(Cmd::Help(h)) if h.contains("comm.plan(op::allreduce") && h.contains("--no-bind"))
        );
        assert!(!run(&["allreduce", "--ranks", "2", "--no-bind"]).bind);
        assert!(run(&["allreduce", "--ranks", "2"]).bind);
        // A subcommand's bad value is named as given; a subcommand after an option is a collective.
        assert!(err(&["latency", "--ranks", "0"]).contains("--ranks \"0\""));
        assert!(err(&["rma", "-n", "1"]).contains("unknown option \"-n\""));
        assert!(err(&["-b", "8", "latency"]).contains("unknown collective \"latency\""));
        assert!(err(&["--ranks", "2", "plot", "a.svg"]).contains("collective"));
        assert_eq!(Sub::usage_of("plot"), Some(PLOT_USAGE));
    }

    #[test]
    fn ranks_are_taken_out_of_the_rank_arguments() {
        assert_eq!(without_ranks(&["allreduce", "--ranks", "4", "-b", "8"]), vec!["allreduce", "-b", "8"]);
        assert_eq!(without_ranks(&["--ranks=2", "all"]), vec!["all"]);
    }
}
