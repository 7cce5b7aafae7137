//! The command line: options, their defaults, and what is wrong with a bad one.
//!
//! Parsed by clap (derive API) into [`Options`]; every error is an [`ArgError`] that names
//! the option and the value, whatever clap's own wording. Options that take a value take
//! the next argument whatever it looks like (`--grace -1` is a bad grace, not an unknown
//! option), and the first argument that is not an option starts the program: it and
//! everything after it belong to the program.
//!
//! Binding is the one choice that also comes from the environment: `--bind` / `--no-bind`
//! (the last one given wins) override `FERROCCL_BIND` (`auto`, the default; `1`, `on` or
//! `core`: always; `0`, `off` or `none`: never), which the runner reads itself. Under `auto`
//! the ranks are pinned when there are at least as many usable CPUs as ranks (as `mpirun`
//! binds to core for `-np` <= cores) and left to the kernel when there are more ranks
//! ([`Bind::pins`] decides).

use std::ffi::{OsStr, OsString};
use std::time::Duration;

use clap::builder::{OsStringValueParser, TypedValueParser};
use clap::error::ErrorKind;
use clap::{CommandFactory, Parser};

use crate::cli::{self, Problem};

/// The one-line usage printed with every command-line error.
pub const USAGE: &str =
    "usage: ferroccl-run -n N [--transport auto|shm|tcp|verbs] [--timeout S] [--grace S] [--no-prefix] [--bind|--no-bind] [-v|--verbose] -- PROGRAM [ARGS...]";

/// The most ranks one job may have.
pub const MAX_RANKS: usize = 1024;

/// How long the other ranks may run on after the first failure, unless `--grace` says.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(5);

/// The end of `--help`, after the options.
const AFTER_HELP: &str = "\
Each rank gets FERROCCL_RANK, FERROCCL_WORLD_SIZE, FERROCCL_LOCAL_RANK,
FERROCCL_LOCAL_WORLD_SIZE, FERROCCL_STORE, FERROCCL_TOKEN, FERROCCL_LAUNCHER_PID
(and FERROCCL_TRANSPORT with --transport, FERROCCL_BOUND_CPU when pinned).

Binding: by default rank r is pinned to the (r mod k)-th of the k CPUs this runner may
use when ranks <= k, and not pinned when ranks > k (oversubscribed). FERROCCL_BIND=auto
(default), 1/on/core (always) or 0/off/none (never) sets the default; --bind and
--no-bind override it.

exit status: 0 if all ranks succeed; else the first failing rank's status (128+signal
if killed by a signal); 124 on timeout; 128+signal if the runner is interrupted;
127 program not found; 2 bad arguments.";

/// The command line as clap sees it; [`parse_args`] turns it into [`Options`].
#[derive(Debug, Parser)]
#[command(
    name = "ferroccl-run",
    about = "ferroccl-run: launch N FerroCCL ranks on this host",
    override_usage = "ferroccl-run -n N [OPTIONS] -- PROGRAM [ARGS...]",
    help_template = "{about}\n\nusage: {usage}\n\n{all-args}{after-help}",
    max_term_width = 100,
    after_help = AFTER_HELP,
    args_override_self = true
)]
struct Cli {
    /// Number of ranks (1 to 1024), required
    #[arg(short = 'n', long = "nproc", value_name = "N", allow_hyphen_values = true,
          value_parser = OsStringValueParser::new().try_map(ranks))]
    nranks: Option<usize>,
    /// Set FERROCCL_TRANSPORT for every rank
    #[arg(long, value_name = "auto|shm|tcp|verbs", allow_hyphen_values = true,
          value_parser = OsStringValueParser::new().try_map(transport))]
    transport: Option<String>,
    /// Kill the job after S seconds (exit 124)
    #[arg(long, value_name = "S", allow_hyphen_values = true, value_parser = OsStringValueParser::new().try_map(timeout))]
    timeout: Option<Duration>,
    /// After a rank fails, let the others exit on their own for S seconds before
    /// SIGTERM/SIGKILL (default 5)
    #[arg(long, value_name = "S", allow_hyphen_values = true, value_parser = OsStringValueParser::new().try_map(grace))]
    grace: Option<Duration>,
    /// Do not prefix output lines with [RANK]
    #[arg(long)]
    no_prefix: bool,
    /// Pin rank r to the (r mod k)-th of the k CPUs this runner may use (as mpirun --bind-to
    /// core), even with more ranks than CPUs. Default: pinned when ranks <= k (FERROCCL_BIND)
    #[arg(long, overrides_with = "no_bind")]
    bind: bool,
    /// Do not pin the ranks to CPUs (leave them to the kernel)
    #[arg(long, overrides_with = "bind")]
    no_bind: bool,
    /// Print store address, pids and wall time to stderr, and the ranks' flight records
    #[arg(short, long)]
    verbose: bool,
    /// The program every rank runs, then its arguments (all of them the program's)
    #[arg(value_name = "PROGRAM", num_args = 1.., trailing_var_arg = true)]
    command: Vec<OsString>,
}

/// `--help`.
pub(crate) fn help() -> String {
    Cli::command().render_help().to_string()
}

/// What is wrong with a command line.
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ArgError {
    /// `-n` was not given.
    #[error("missing -n N (the number of ranks)")]
    MissingRanks,
    /// `-n` is not a whole number in `1..=MAX_RANKS`.
    #[error("-n {0:?}: the number of ranks must be a whole number from 1 to 1024")]
    BadRanks(String),
    /// A seconds value that does not parse or is out of range.
    #[error("{flag} {value:?}: {expected}")]
    BadSeconds {
        /// The option.
        flag: &'static str,
        /// What was given.
        value: String,
        /// What is allowed.
        expected: &'static str,
    },
    /// `--transport` names no known transport.
    #[error("--transport {0:?}: must be one of auto, shm, tcp, verbs")]
    BadTransport(String),
    /// An option that takes a value came last.
    #[error("{0} needs a value")]
    MissingValue(String),
    /// An option this runner does not know (or a value given to a flag that takes none).
    #[error("unknown option {0:?}")]
    UnknownOption(String),
    /// Nothing to run.
    #[error("no program to run (give it after --)")]
    MissingProgram,
    /// An option's value is not valid UTF-8.
    #[error("the value of {0} is not valid UTF-8")]
    NotUtf8(String),
    /// `FERROCCL_BIND` (read when neither `--bind` nor `--no-bind` is given) is not one of
    /// its values.
    #[error("FERROCCL_BIND={0:?}: must be auto, 1, on, core, 0, off or none")]
    BadBindEnv(String),
    /// Anything else clap finds wrong, in its words.
    #[error("{0}")]
    Other(String),
}

/// A parsed command line.
#[derive(Debug, Clone, PartialEq)]
pub struct Options {
    /// Number of ranks.
    pub nranks: usize,
    /// `--transport`, lower-cased (`auto`, `shm`, `tcp` or `verbs`).
    pub transport: Option<String>,
    /// `--timeout`.
    pub timeout: Option<Duration>,
    /// `--grace`.
    pub grace: Duration,
    /// False with `--no-prefix`.
    pub prefix: bool,
    /// Whether rank r is pinned to the (r mod k)-th of the k CPUs the runner may use:
    /// `--bind`, `--no-bind`, else `FERROCCL_BIND`, else [`Bind::Auto`].
    pub bind: Bind,
    /// `-v`.
    pub verbose: bool,
    /// The program each rank runs.
    pub program: OsString,
    /// Its arguments.
    pub args: Vec<OsString>,
}

/// Whether the ranks are pinned to CPUs (`--bind`, `--no-bind`, `FERROCCL_BIND`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Bind {
    /// Pin when there are at least as many usable CPUs as ranks; otherwise (oversubscribed)
    /// leave the ranks to the kernel. The default (`FERROCCL_BIND=auto`).
    #[default]
    Auto,
    /// Always pin, rank r to CPU r mod k, even with more ranks than CPUs (`--bind`,
    /// `FERROCCL_BIND=1|on|core`).
    Always,
    /// Never pin (`--no-bind`, `FERROCCL_BIND=0|off|none`).
    Never,
}

impl Bind {
    /// Reads a `FERROCCL_BIND` value (any case, surrounding blanks ignored); `None` when it
    /// is not one of auto, 1, on, core, 0, off, none. Empty means auto.
    pub fn from_env_value(v: &str) -> Option<Bind> {
        match v.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Some(Bind::Auto),
            "1" | "on" | "core" => Some(Bind::Always),
            "0" | "off" | "none" => Some(Bind::Never),
            _ => None,
        }
    }

    /// Whether `ranks` ranks are pinned, given `cpus` usable CPUs (0: the CPU list is not
    /// known, so nothing can be pinned). [`Bind::Auto`] pins when `ranks <= cpus`: with
    /// more ranks than CPUs, several ranks pinned to one CPU could not be moved apart by
    /// the kernel, which is worse than not pinning them.
    pub fn pins(self, ranks: usize, cpus: usize) -> bool {
        match self {
            Bind::Always => cpus > 0,
            Bind::Never => false,
            Bind::Auto => cpus > 0 && ranks <= cpus,
        }
    }
}

/// What the command line asks for.
#[derive(Debug, Clone, PartialEq)]
pub enum Invocation {
    /// `--help`.
    Help,
    /// Run a job.
    Run(Options),
}

/// Parses the arguments after the program name (and `FERROCCL_BIND` from this process's
/// environment, when neither `--bind` nor `--no-bind` is given).
pub fn parse_args<S: AsRef<OsStr>>(args: &[S]) -> Result<Invocation, ArgError> {
    parse_args_with_bind_env(args, std::env::var_os("FERROCCL_BIND").as_deref())
}

/// [`parse_args`] with `FERROCCL_BIND`'s value given (`None`: unset).
fn parse_args_with_bind_env<S: AsRef<OsStr>>(args: &[S], bind_env: Option<&OsStr>) -> Result<Invocation, ArgError> {
    let argv = std::iter::once(OsStr::new("ferroccl-run")).chain(args.iter().map(AsRef::as_ref));
    let cli = match Cli::try_parse_from(argv) {
        Ok(cli) => cli,
        Err(e) if e.kind() == ErrorKind::DisplayHelp => return Ok(Invocation::Help),
        Err(e) => return Err(ArgError::from_clap(&e, args)),
    };
    let nranks = cli.nranks.ok_or(ArgError::MissingRanks)?;
    let mut command = cli.command.into_iter();
    let program = command.next().ok_or(ArgError::MissingProgram)?;
    // The command line wins; the variable is read (and checked) only when it says nothing.
    let bind = match (cli.bind, cli.no_bind, bind_env) {
        (true, _, _) => Bind::Always,
        (_, true, _) => Bind::Never,
        (false, false, None) => Bind::Auto,
        (false, false, Some(v)) => {
            let text = v.to_string_lossy();
            Bind::from_env_value(&text).ok_or_else(|| ArgError::BadBindEnv(text.into_owned()))?
        }
    };
    Ok(Invocation::Run(Options {
        nranks,
        transport: cli.transport,
        timeout: cli.timeout,
        grace: cli.grace.unwrap_or(DEFAULT_GRACE),
        prefix: !cli.no_prefix,
        bind,
        verbose: cli.verbose,
        program,
        args: command.collect(),
    }))
}

impl ArgError {
    /// The error for what clap found wrong with `args`.
    fn from_clap<S: AsRef<OsStr>>(e: &clap::Error, args: &[S]) -> ArgError {
        // Option values are checked as text by their parsers; a name that is not text can
        // only be the program's.
        let text: Vec<&str> = args.iter().map(|a| a.as_ref().to_str().unwrap_or_default()).collect();
        match Problem::of(e, &Cli::command(), &text) {
            // Our value parsers' own errors.
            Problem::BadValue { reason: Some(r), .. } if r.is::<ArgError>() => {
                r.downcast_ref::<ArgError>().cloned().unwrap_or(ArgError::Other(cli::message(e)))
            }
            Problem::MissingValue(option) => ArgError::MissingValue(option),
            Problem::UnknownOption(option) | Problem::Unexpected(option) => ArgError::UnknownOption(option),
            _ => ArgError::Other(cli::message(e)),
        }
    }
}

/// The value of `flag` as text.
fn utf8(flag: &str, v: OsString) -> Result<String, ArgError> {
    v.into_string().map_err(|_| ArgError::NotUtf8(flag.to_string()))
}

/// `-n`: a whole number from 1 to [`MAX_RANKS`].
fn ranks(v: OsString) -> Result<usize, ArgError> {
    let v = utf8("-n", v)?;
    match v.trim().parse::<usize>() {
        Ok(n) if (1..=MAX_RANKS).contains(&n) => Ok(n),
        _ => Err(ArgError::BadRanks(v)),
    }
}

/// `--transport`: auto, shm, tcp or verbs, in any case; lower-cased.
fn transport(v: OsString) -> Result<String, ArgError> {
    let v = utf8("--transport", v)?;
    let t = v.trim().to_ascii_lowercase();
    if !matches!(t.as_str(), "auto" | "shm" | "tcp" | "verbs") {
        return Err(ArgError::BadTransport(v));
    }
    Ok(t)
}

/// `--timeout`: a positive number of seconds.
fn timeout(v: OsString) -> Result<Duration, ArgError> {
    let v = utf8("--timeout", v)?;
    match parse_seconds(&v).filter(|d| !d.is_zero()) {
        Some(d) => Ok(d),
        None => Err(ArgError::BadSeconds { flag: "--timeout", value: v, expected: "must be a positive number of seconds" }),
    }
}

/// `--grace`: a number of seconds, 0 or more.
fn grace(v: OsString) -> Result<Duration, ArgError> {
    let v = utf8("--grace", v)?;
    match parse_seconds(&v) {
        Some(d) => Ok(d),
        None => Err(ArgError::BadSeconds { flag: "--grace", value: v, expected: "must be a number of seconds, 0 or more" }),
    }
}

/// Parses a non-negative, finite number of seconds ("5", "0.25", "1e3").
fn parse_seconds(s: &str) -> Option<Duration> {
    let secs: f64 = s.trim().parse().ok()?;
    if !(0.0..=1e9).contains(&secs) {
        return None;
    }
    Duration::try_from_secs_f64(secs).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Invocation, ArgError> {
        parse_args(args)
    }

    fn opts(args: &[&str]) -> Options {
        match parse(args) {
            Ok(Invocation::Run(o)) => o,
            other => panic!("{args:?}: {other:?}"),
        }
    }

    #[test]
    fn full_command_line() {
        let o = opts(&["-n", "4", "--transport", "TCP", "--timeout", "2.5", "--grace=0.5", "--no-prefix", "-v", "--", "prog", "-n", "x"]);
        assert_eq!(o.nranks, 4);
        assert_eq!(o.transport.as_deref(), Some("tcp"));
        assert_eq!(o.timeout, Some(Duration::from_millis(2500)));
        assert_eq!(o.grace, Duration::from_millis(500));
        assert!(!o.prefix);
        assert!(o.verbose);
        assert_eq!(o.program, "prog");
        assert_eq!(o.args, vec![OsString::from("-n"), OsString::from("x")]);
    }

    #[test]
    fn defaults_and_short_forms() {
        let o = opts(&["-n8", "prog", "--grace", "1"]);
        assert_eq!(o.nranks, 8);
        assert_eq!(o.transport, None);
        assert_eq!(o.timeout, None);
        assert_eq!(o.grace, DEFAULT_GRACE);
        assert!(o.prefix && !o.verbose);
        assert_eq!(o.args, vec![OsString::from("--grace"), OsString::from("1")]);
        assert_eq!(opts(&["--nproc=3", "--", "p"]).nranks, 3);
        assert_eq!(opts(&["--nproc", "1024", "p"]).nranks, 1024);
        assert_eq!(opts(&["-n", "1", "--grace", "0", "p"]).grace, Duration::ZERO);
    }

    #[test]
    fn help() {
        assert_eq!(parse(&["--help"]), Ok(Invocation::Help));
        assert_eq!(parse(&["-n", "2", "-h"]), Ok(Invocation::Help));
    }

    #[test]
    fn everything_after_the_program_is_its_own() {
        let os = |v: &[&str]| v.iter().map(OsString::from).collect::<Vec<_>>();
        let o = opts(&["-n", "2", "prog", "--", "-n", "x", "--help", "-v"]);
        assert_eq!((o.program.as_os_str(), o.args), (OsStr::new("prog"), os(&["--", "-n", "x", "--help", "-v"])));
        let o = opts(&["-n", "2", "--", "--", "x"]);
        assert_eq!((o.program.as_os_str(), o.args), (OsStr::new("--"), os(&["x"])));
        assert_eq!(opts(&["-n", "1", "-"]).program, "-");
        // Names that are not UTF-8 run too; option values must be text.
        use std::os::unix::ffi::OsStringExt;
        let odd = OsString::from_vec(vec![b'p', 0xff]);
        match parse_args(&[OsString::from("-n"), "2".into(), odd.clone()]) {
            Ok(Invocation::Run(o)) => assert_eq!(o.program, odd),
            other => panic!("{other:?}"),
        }
        assert_eq!(parse_args(&[OsString::from("-n"), odd]), Err(ArgError::NotUtf8("-n".into())));
    }

    #[test]
    fn repeated_options_and_hyphen_values() {
        let o = opts(&["-n", "2", "-n", "3", "--no-prefix", "--no-prefix", "--grace", "1", "--grace=2", "p"]);
        assert_eq!((o.nranks, o.prefix, o.grace), (3, false, Duration::from_secs(2)));
        // The value of an option is the next argument, whatever it looks like.
        assert_eq!(parse(&["-n", "--", "p"]), Err(ArgError::BadRanks("--".into())));
        assert_eq!(
            parse(&["-n", "2", "--timeout", "-v", "p"]),
            Err(ArgError::BadSeconds { flag: "--timeout", value: "-v".into(), expected: "must be a positive number of seconds" })
        );
        // An unknown option is named as it was given.
        assert_eq!(parse(&["-n", "2", "--bogus=3", "p"]), Err(ArgError::UnknownOption("--bogus=3".into())));
        assert_eq!(parse(&["-n", "2", "-x", "p"]), Err(ArgError::UnknownOption("-x".into())));
    }

    #[test]
    fn bind_flags_and_env_precedence() {
        let with_env = |args: &[&str], env: Option<&str>| match parse_args_with_bind_env(args, env.map(OsStr::new)) {
            Ok(Invocation::Run(o)) => Ok(o.bind),
            Ok(other) => panic!("{other:?}"),
            Err(e) => Err(e),
        };
        // Nothing said: auto.
        assert_eq!(with_env(&["-n", "2", "p"], None), Ok(Bind::Auto));
        assert_eq!(with_env(&["-n", "2", "--bind", "p"], None), Ok(Bind::Always));
        assert_eq!(with_env(&["-n", "2", "--no-bind", "p"], None), Ok(Bind::Never));
        // The last of --bind / --no-bind wins.
        assert_eq!(with_env(&["-n", "2", "--bind", "--no-bind", "p"], None), Ok(Bind::Never));
        assert_eq!(with_env(&["-n", "2", "--no-bind", "--bind", "p"], None), Ok(Bind::Always));
        assert_eq!(with_env(&["-n", "2", "--bind", "--bind", "p"], None), Ok(Bind::Always));
        // FERROCCL_BIND, in any case, when the command line says nothing.
        for (v, want) in [
            ("auto", Bind::Auto),
            ("", Bind::Auto),
            ("1", Bind::Always),
            ("on", Bind::Always),
            ("CORE", Bind::Always),
            ("0", Bind::Never),
            (" off ", Bind::Never),
            ("none", Bind::Never),
        ] {
            assert_eq!(with_env(&["-n", "2", "p"], Some(v)), Ok(want), "FERROCCL_BIND={v:?}");
        }
        // The command line wins over the variable (which is then not even checked).
        assert_eq!(with_env(&["-n", "2", "--bind", "p"], Some("off")), Ok(Bind::Always));
        assert_eq!(with_env(&["-n", "2", "--no-bind", "p"], Some("on")), Ok(Bind::Never));
        assert_eq!(with_env(&["-n", "2", "--no-bind", "p"], Some("bogus")), Ok(Bind::Never));
        // A bad value is an error that names the variable.
        assert_eq!(with_env(&["-n", "2", "p"], Some("yes")), Err(ArgError::BadBindEnv("yes".into())));
        let msg = ArgError::BadBindEnv("2".into()).to_string();
        assert!(msg.contains("FERROCCL_BIND") && msg.contains("\"2\""), "{msg}");
        // --bind / --no-bind take no value, and belong to the program after it.
        assert_eq!(parse(&["-n", "2", "--no-bind=1", "p"]), Err(ArgError::UnknownOption("--no-bind=1".into())));
        let o = opts(&["-n", "2", "p", "--no-bind"]);
        assert_eq!(o.args, vec![OsString::from("--no-bind")]);
    }

    #[test]
    fn auto_binds_only_without_oversubscription() {
        // (ranks, usable CPUs) -> pinned under auto.
        for (ranks, cpus, pinned) in [(1, 1, true), (2, 2, true), (2, 8, true), (8, 8, true), (3, 2, false), (9, 8, false), (1, 0, false)] {
            assert_eq!(Bind::Auto.pins(ranks, cpus), pinned, "auto, {ranks} ranks, {cpus} CPUs");
        }
        // --bind pins even when oversubscribed; only an unknown CPU list stops it.
        assert!(Bind::Always.pins(3, 2) && Bind::Always.pins(1024, 1) && Bind::Always.pins(1, 4));
        assert!(!Bind::Always.pins(2, 0));
        // --no-bind never pins.
        assert!(!Bind::Never.pins(1, 8) && !Bind::Never.pins(8, 8) && !Bind::Never.pins(9, 8));
        assert_eq!(Bind::default(), Bind::Auto);
        assert_eq!(Bind::from_env_value("sometimes"), None);
    }

    #[test]
    fn help_text() {
        let h = super::help();
        assert!(h.contains("usage: ferroccl-run -n N"), "{h}");
        for option in [
            "--nproc",
            "--transport",
            "--timeout",
            "--grace",
            "--no-prefix",
            "--bind",
            "--no-bind",
            "FERROCCL_BIND",
            "--verbose",
            "FERROCCL_LAUNCHER_PID",
            "exit status",
        ] {
            assert!(h.contains(option), "{option}: {h}");
        }
    }

    #[test]
    fn errors() {
        assert_eq!(parse(&["--", "prog"]), Err(ArgError::MissingRanks));
        assert_eq!(parse(&["-n", "0", "prog"]), Err(ArgError::BadRanks("0".into())));
        assert_eq!(parse(&["-n", "1025", "prog"]), Err(ArgError::BadRanks("1025".into())));
        assert_eq!(parse(&["-n", "four", "prog"]), Err(ArgError::BadRanks("four".into())));
        assert_eq!(parse(&["-n", "-3", "prog"]), Err(ArgError::BadRanks("-3".into())));
        assert_eq!(parse(&["-n"]), Err(ArgError::MissingValue("-n".into())));
        assert_eq!(parse(&["-n", "2", "--"]), Err(ArgError::MissingProgram));
        assert_eq!(parse(&["-n", "2"]), Err(ArgError::MissingProgram));
        assert_eq!(parse(&["-n", "2", "--bogus", "p"]), Err(ArgError::UnknownOption("--bogus".into())));
        assert_eq!(parse(&["-n", "2", "--verbose=1", "p"]), Err(ArgError::UnknownOption("--verbose=1".into())));
        assert_eq!(parse(&["-n", "2", "--transport", "ib", "p"]), Err(ArgError::BadTransport("ib".into())));
        for bad in ["x", "-1", "nan", "inf", "0"] {
            assert!(matches!(parse(&["-n", "2", "--timeout", bad, "p"]), Err(ArgError::BadSeconds { flag: "--timeout", .. })), "{bad}");
        }
        assert!(matches!(parse(&["-n", "2", "--grace", "-1", "p"]), Err(ArgError::BadSeconds { flag: "--grace", .. })));
        assert_eq!(parse(&["-n", "2", "--grace"]), Err(ArgError::MissingValue("--grace".into())));
        // The message names the problem.
        let msg = parse(&["-n", "0", "p"]).unwrap_err().to_string();
        assert!(msg.contains("-n") && msg.contains("1 to 1024"), "{msg}");
    }
}
