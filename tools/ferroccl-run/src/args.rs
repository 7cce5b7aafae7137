//! The command line: options, their defaults, and what is wrong with a bad one.

use std::ffi::{OsStr, OsString};
use std::time::Duration;

/// The one-line usage printed with every command-line error.
pub const USAGE: &str =
    "usage: ferroccl-run -n N [--transport auto|shm|tcp|verbs] [--timeout S] [--grace S] [--no-prefix] [--bind] [-v|--verbose] -- PROGRAM [ARGS...]";

/// The most ranks one job may have.
pub const MAX_RANKS: usize = 1024;

/// How long the other ranks may run on after the first failure, unless `--grace` says.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(5);

pub(crate) const HELP: &str = "\
ferroccl-run: launch N FerroCCL ranks on this host

usage: ferroccl-run -n N [OPTIONS] -- PROGRAM [ARGS...]

options:
  -n N, --nproc N          number of ranks (1 to 1024), required
  --transport auto|shm|tcp|verbs set FERROCCL_TRANSPORT for every rank
  --timeout S              kill the job after S seconds (exit 124)
  --grace S                after a rank fails, let the others exit on their own for
                           S seconds before SIGTERM/SIGKILL (default 5)
  --no-prefix              do not prefix output lines with [RANK]
  --bind                   pin rank r to the (r mod k)-th of the k CPUs this runner may
                           use (as mpirun --bind-to core); unpinned, the kernel may keep
                           two ranks on one core for a whole run
  -v, --verbose            print store address, pids and wall time to stderr
  -h, --help               print this help

Each rank gets FERROCCL_RANK, FERROCCL_WORLD_SIZE, FERROCCL_LOCAL_RANK,
FERROCCL_LOCAL_WORLD_SIZE, FERROCCL_STORE, FERROCCL_TOKEN, FERROCCL_LAUNCHER_PID
(and FERROCCL_TRANSPORT with --transport).

exit status: 0 if all ranks succeed; else the first failing rank's status (128+signal
if killed by a signal); 124 on timeout; 128+signal if the runner is interrupted;
127 program not found; 2 bad arguments.
";

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
    /// `--bind`: pin rank r to the (r mod k)-th of the k CPUs the runner may use.
    pub bind: bool,
    /// `-v`.
    pub verbose: bool,
    /// The program each rank runs.
    pub program: OsString,
    /// Its arguments.
    pub args: Vec<OsString>,
}

/// What the command line asks for.
#[derive(Debug, Clone, PartialEq)]
pub enum Invocation {
    /// `--help`.
    Help,
    /// Run a job.
    Run(Options),
}

/// Parses the arguments after the program name.
pub fn parse_args<S: AsRef<OsStr>>(args: &[S]) -> Result<Invocation, ArgError> {
    let mut nranks: Option<usize> = None;
    let mut transport = None;
    let mut timeout = None;
    let mut grace = DEFAULT_GRACE;
    let mut prefix = true;
    let mut bind = false;
    let mut verbose = false;
    let mut program: Option<&[S]> = None;

    let mut i = 0;
    while i < args.len() {
        let raw = args[i].as_ref();
        let Some(arg) = raw.to_str() else {
            // Not UTF-8: cannot be one of our options, so it starts the program.
            program = Some(&args[i..]);
            break;
        };
        if arg == "--" {
            program = Some(&args[i + 1..]);
            break;
        }
        if !arg.starts_with('-') || arg == "-" {
            program = Some(&args[i..]);
            break;
        }
        let (flag, inline): (&str, Option<&str>) = if let Some(rest) = arg.strip_prefix("--") {
            match rest.split_once('=') {
                Some((f, v)) => (&arg[..f.len() + 2], Some(v)),
                None => (arg, None),
            }
        } else if arg.len() > 2 && arg.starts_with("-n") {
            ("-n", Some(&arg[2..]))
        } else {
            (arg, None)
        };
        // Fetches the option's value: after '=' or the next argument.
        let value = |i: &mut usize| -> Result<String, ArgError> {
            if let Some(v) = inline {
                return Ok(v.to_string());
            }
            *i += 1;
            let v = args.get(*i).ok_or_else(|| ArgError::MissingValue(flag.to_string()))?;
            v.as_ref().to_str().map(str::to_string).ok_or_else(|| ArgError::NotUtf8(flag.to_string()))
        };
        match flag {
            "-h" | "--help" if inline.is_none() => return Ok(Invocation::Help),
            "-v" | "--verbose" if inline.is_none() => verbose = true,
            "--no-prefix" if inline.is_none() => prefix = false,
            "--bind" if inline.is_none() => bind = true,
            "-n" | "--nproc" => {
                let v = value(&mut i)?;
                match v.trim().parse::<usize>() {
                    Ok(n) if (1..=MAX_RANKS).contains(&n) => nranks = Some(n),
                    _ => return Err(ArgError::BadRanks(v)),
                }
            }
            "--transport" => {
                let v = value(&mut i)?;
                let t = v.trim().to_ascii_lowercase();
                if !matches!(t.as_str(), "auto" | "shm" | "tcp" | "verbs") {
                    return Err(ArgError::BadTransport(v));
                }
                transport = Some(t);
            }
            "--timeout" => {
                let v = value(&mut i)?;
                let d = parse_seconds(&v).filter(|d| !d.is_zero()).ok_or(ArgError::BadSeconds {
                    flag: "--timeout",
                    value: v,
                    expected: "must be a positive number of seconds",
                })?;
                timeout = Some(d);
            }
            "--grace" => {
                let v = value(&mut i)?;
                grace = parse_seconds(&v).ok_or(ArgError::BadSeconds {
                    flag: "--grace",
                    value: v,
                    expected: "must be a number of seconds, 0 or more",
                })?;
            }
            _ => return Err(ArgError::UnknownOption(arg.to_string())),
        }
        i += 1;
    }

    let nranks = nranks.ok_or(ArgError::MissingRanks)?;
    let (program, args) = match program {
        Some([program, args @ ..]) => (program.as_ref().to_os_string(), args.iter().map(|a| a.as_ref().to_os_string()).collect()),
        _ => return Err(ArgError::MissingProgram),
    };
    Ok(Invocation::Run(Options { nranks, transport, timeout, grace, prefix, bind, verbose, program, args }))
}

/// Parses a non-negative, finite number of seconds ("5", "0.25", "1e3").
pub(crate) fn parse_seconds(s: &str) -> Option<Duration> {
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
