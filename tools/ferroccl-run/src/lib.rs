//! # ferroccl-run: launch a FerroCCL job on one host
//!
//! `ferroccl-run` is to FerroCCL what `mpirun` or `torchrun` is to MPI or PyTorch, for one
//! host: it starts the job's bootstrap store, makes a fresh secret token, spawns `N` copies
//! of a program (the ranks) with the environment FerroCCL reads, prefixes their output with
//! their rank, and takes the whole job down when one rank fails.
//!
//! ```text
//! ferroccl-run -n N [--transport auto|shm|tcp|verbs] [--timeout S] [--grace S]
//!              [--no-prefix] [--bind] [-v|--verbose] -- PROGRAM [ARGS...]
//! ```
//!
//! | option | meaning |
//! | --- | --- |
//! | `-n N` (`-nN`, `--nproc N`, `--nproc=N`) | number of ranks, 1 to 1024 (required) |
//! | `--transport auto\|shm\|tcp\|verbs` | sets `FERROCCL_TRANSPORT` for every rank (otherwise the ranks inherit the runner's environment) |
//! | `--timeout S` | wall-clock limit for the whole job, in seconds (a decimal number); none by default |
//! | `--grace S` | after the first rank fails, how long the others may take to exit by themselves (default 5) |
//! | `--no-prefix` | pass the ranks' output through without the `[R] ` prefix |
//! | `--bind` | pin rank r to the (r mod k)-th of the k CPUs the runner may use (as `mpirun --bind-to core`) |
//! | `-v`, `--verbose` | print the store address, the ranks' pids and the wall time to stderr |
//! | `-h`, `--help` | print the help and exit 0 |
//!
//! `--` ends the options; the first argument that is not an option also starts the
//! program, so `ferroccl-run -n 2 ./app --flag` works too. Every option that takes a value
//! accepts it as the next argument or after `=` (`--grace=0.5`).
//!
//! ## What the runner does
//!
//! 1. **Store.** It starts the bootstrap store in-process on `127.0.0.1` (a free port),
//!    accepting values up to `FERROCCL_STORE_MAX_VALUE` bytes (read from the runner's own
//!    environment, default 67108864 = 64 MiB). The token is 32 random bytes from the OS,
//!    written as 64 lowercase hex digits, fresh for every job.
//! 2. **Ranks.** It spawns `N` processes, rank `0..N`, each in its own process group, with
//!    stdin from `/dev/null` and the environment below added to the runner's own. On Linux
//!    each rank also gets the parent-death signal `SIGKILL`, so no rank outlives a runner
//!    that is killed outright (`kill -9`); FerroCCL ranks additionally watch
//!    `FERROCCL_LAUNCHER_PID`.
//! 3. **Output.** Every line a rank writes to stdout goes to the runner's stdout as
//!    `[R] line`, stderr to stderr. A line is written whole (no two ranks' lines are ever
//!    mixed), bytes that are not UTF-8 are replaced by U+FFFD, a last line without a newline
//!    is still printed (a newline is added), and a line longer than 1 MiB is split. With
//!    `--no-prefix` the bytes pass through untouched, still a whole line at a time.
//! 4. **Failure.** A rank fails when it exits with a non-zero status or is killed by a
//!    signal. On the first failure the runner prints
//!    `ferroccl-run: rank 2 exited with status 3` (or
//!    `ferroccl-run: rank 1 was killed by signal SIGKILL (9)`), then gives the other ranks
//!    `--grace` seconds to exit on their own: FerroCCL ranks notice the dead peer and exit
//!    with an error of their own, which is the message worth reading (later failures are
//!    printed the same way). Ranks still running after the grace get `SIGTERM`, and
//!    `SIGKILL` one second later, and the runner prints
//!    `ferroccl-run: killed ranks 0, 3 (still running 5 s after rank 2 failed)`.
//! 5. **Timeout.** When `--timeout` passes with ranks still running it prints
//!    `ferroccl-run: timeout after S s; ranks still running: 0, 2`, then sends `SIGTERM`
//!    and, one second later, `SIGKILL` to them.
//! 6. **Signals.** `SIGINT` (Ctrl-C), `SIGTERM` or `SIGHUP` to the runner are forwarded as
//!    `SIGTERM` to every rank still running, followed by `SIGKILL` two seconds later (at
//!    once on a second signal). The ranks live in their own process groups, so a Ctrl-C at
//!    the terminal reaches them only through the runner.
//! 7. **Clean-up.** Signals go to a rank's whole process group, so helpers a rank started
//!    (a shell's children) go with it; processes left in a rank's group after the job are
//!    killed too. The runner then shuts the store down and waits for every output stream
//!    to be drained, so no line is lost.
//!
//! ## Exit status
//!
//! | status | when |
//! | --- | --- |
//! | 0 | every rank exited with status 0 |
//! | the first failing rank's status | a rank failed: its exit status, or 128 + signal number if a signal killed it (137 for `SIGKILL`); a rank killed by a signal, or one that panicked (status 101), within 250 ms after an ordinary failure counts as the first (the others were most likely reacting to its death) |
//! | 124 | `--timeout` passed (and no rank had failed before) |
//! | 130, 143, 129 | the runner got `SIGINT`, `SIGTERM` or `SIGHUP` (128 + signal) |
//! | 127, 126 | the program was not found, or is not executable |
//! | 2 | bad command line (or a malformed `FERROCCL_STORE_MAX_VALUE`) |
//! | 1 | the runner itself failed (the store could not start, a spawn failed) |
//!
//! ## Environment of each rank
//!
//! | variable | value |
//! | --- | --- |
//! | `FERROCCL_RANK` | the rank, `0..N` |
//! | `FERROCCL_WORLD_SIZE` | `N` |
//! | `FERROCCL_LOCAL_RANK` | the rank (all ranks are on this host) |
//! | `FERROCCL_LOCAL_WORLD_SIZE` | `N` |
//! | `FERROCCL_STORE` | `ip:port` of the bootstrap store, e.g. `127.0.0.1:40321` |
//! | `FERROCCL_TOKEN` | the job's secret: 64 hex digits; every store and mesh connection proves it knows it |
//! | `FERROCCL_LAUNCHER_PID` | the runner's pid; FerroCCL ranks fail promptly if it dies |
//! | `FERROCCL_TRANSPORT` | only with `--transport`: `auto`, `shm`, `tcp` or `verbs` |
//!
//! Everything else in the runner's environment is passed on unchanged.
//!
//! ## Example
//!
//! ```text
//! $ ferroccl-run -n 2 -- sh -c 'echo hello from $FERROCCL_RANK of $FERROCCL_WORLD_SIZE'
//! [0] hello from 0 of 2
//! [1] hello from 1 of 2
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

use std::ffi::{CString, OsStr, OsString};
use std::fmt;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, SocketAddr};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use ferroccl::bootstrap::StoreServer;
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

/// The one-line usage printed with every command-line error.
pub const USAGE: &str =
    "usage: ferroccl-run -n N [--transport auto|shm|tcp|verbs] [--timeout S] [--grace S] [--no-prefix] [--bind] [-v|--verbose] -- PROGRAM [ARGS...]";

/// The most ranks one job may have.
pub const MAX_RANKS: usize = 1024;

/// After an ordinary failure, how long a rank killed by a signal still counts as the root
/// cause (the first failure).
const ROOT_CAUSE_WINDOW: Duration = Duration::from_millis(250);

/// How long the other ranks may run on after the first failure, unless `--grace` says.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(5);

/// Default of `FERROCCL_STORE_MAX_VALUE`: 64 MiB.
pub const DEFAULT_STORE_MAX_VALUE: usize = 64 << 20;

/// Between `SIGTERM` and `SIGKILL` when the runner stops ranks after a failure or a timeout.
const TERM_TO_KILL: Duration = Duration::from_secs(1);
/// Between `SIGTERM` and `SIGKILL` when the runner itself was asked to stop.
const SIGNAL_TERM_TO_KILL: Duration = Duration::from_secs(2);
/// How long to wait for output streams after every rank has exited.
const DRAIN_WAIT: Duration = Duration::from_secs(3);
/// Longest line passed on whole; longer ones are split.
const MAX_LINE: usize = 1 << 20;
/// Hidden first argument that makes the binary a per-rank exec shim (see [`exec_rank`]).
const EXEC_SHIM_ARG: &str = "__ferroccl-run-exec-rank";

const HELP: &str = "\
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
fn parse_seconds(s: &str) -> Option<Duration> {
    let secs: f64 = s.trim().parse().ok()?;
    if !(0.0..=1e9).contains(&secs) {
        return None;
    }
    Duration::try_from_secs_f64(secs).ok()
}

/// Runs the launcher on the arguments after the program name and returns the exit status.
///
/// This is the whole of `ferroccl-run`: `main` calls it and exits with what it returns.
pub fn main_with_args<I, S>(args: I) -> i32
where
    I: IntoIterator<Item = S>,
    S: Into<OsString>,
{
    let args: Vec<OsString> = args.into_iter().map(Into::into).collect();
    if args.first().is_some_and(|a| a == EXEC_SHIM_ARG) {
        return exec_rank(&args[1..]);
    }
    match parse_args(&args) {
        Ok(Invocation::Help) => {
            print!("{HELP}");
            let _ = io::stdout().flush();
            0
        }
        Ok(Invocation::Run(opts)) => run(&opts),
        Err(e) => {
            eprintln!("ferroccl-run: error: {e}");
            eprintln!("{USAGE}");
            2
        }
    }
}

/// A fresh job token: 32 random bytes from the OS as 64 lowercase hex digits.
pub fn new_token() -> io::Result<String> {
    Ok(ferroccl::bootstrap::new_token())
}

/// Reads `FERROCCL_STORE_MAX_VALUE` through `get` (unset or empty: the default).
fn store_max_value(get: impl Fn(&str) -> Option<String>) -> Result<usize, String> {
    ferroccl::Params::from_lookup(get).map(|p| p.store_max_value).map_err(|e| e.to_string())
}

/// "SIGKILL (9)", or "signal 42" for one nix does not name.
fn signal_name(sig: i32) -> String {
    match Signal::try_from(sig) {
        Ok(s) => format!("{} ({sig})", s.as_str()),
        Err(_) => format!("{sig}"),
    }
}

/// How a rank ended, as a phrase: "exited with status 3", "was killed by signal SIGKILL (9)".
struct Describe(ExitStatus);

impl fmt::Display for Describe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(code) = self.0.code() {
            write!(f, "exited with status {code}")
        } else if let Some(sig) = self.0.signal() {
            write!(f, "was killed by signal {}", signal_name(sig))?;
            if self.0.core_dumped() {
                write!(f, " (core dumped)")?;
            }
            Ok(())
        } else {
            write!(f, "ended with {:?}", self.0)
        }
    }
}

/// Rust's exit status for a process whose main thread panicked.
const PANIC_STATUS: i32 = 101;

/// Whether a rank crashed (killed by a signal, or panicked: status 101) rather than exited
/// with an error of its own: the likelier root cause of a failed job.
fn is_crash(st: ExitStatus) -> bool {
    st.signal().is_some() || st.code() == Some(PANIC_STATUS)
}

/// The runner's exit status for a failed rank: its code, or 128 + the signal.
fn status_code(st: ExitStatus) -> i32 {
    st.code().or_else(|| st.signal().map(|s| 128 + s)).unwrap_or(1)
}

/// "0, 2, 3".
fn rank_list(ranks: &[usize]) -> String {
    ranks.iter().map(usize::to_string).collect::<Vec<_>>().join(", ")
}

/// Seconds as a short decimal: 5, 0.5, 1.25.
fn secs(d: Duration) -> String {
    let s = format!("{:.3}", d.as_secs_f64());
    let s = s.trim_end_matches('0').trim_end_matches('.');
    s.to_string()
}

/// Finds `program` the way `execvp` would: a name with a slash is a path, anything else
/// is looked up in `PATH`. Errors are `NotFound` or `PermissionDenied`.
fn resolve_program(program: &OsStr) -> io::Result<PathBuf> {
    let is_exec = |p: &Path| p.metadata().map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0);
    if program.as_bytes().contains(&b'/') {
        let p = PathBuf::from(program);
        return match is_exec(&p) {
            Ok(true) => Ok(p),
            Ok(false) => Err(io::Error::new(io::ErrorKind::PermissionDenied, "not an executable file")),
            Err(e) => Err(e),
        };
    }
    if program.is_empty() {
        return Err(io::Error::new(io::ErrorKind::NotFound, "empty program name"));
    }
    let path = std::env::var_os("PATH").unwrap_or_else(|| OsString::from("/usr/local/bin:/usr/bin:/bin"));
    let mut denied = false;
    for dir in std::env::split_paths(&path) {
        let dir = if dir.as_os_str().is_empty() { PathBuf::from(".") } else { dir };
        let candidate = dir.join(program);
        match is_exec(&candidate) {
            Ok(true) => return Ok(candidate),
            Ok(false) => denied |= candidate.is_file(),
            Err(_) => {}
        }
    }
    if denied {
        Err(io::Error::new(io::ErrorKind::PermissionDenied, "found in PATH but not executable"))
    } else {
        Err(io::Error::new(io::ErrorKind::NotFound, "not found in PATH"))
    }
}

/// The per-rank exec shim: `ferroccl-run __ferroccl-run-exec-rank PARENT_PID CPU PATH ARGV0 ARGS...`
/// (`CPU` is `-` for no binding).
///
/// Asks the kernel to `SIGKILL` this process when its parent (the runner) dies, checks the
/// runner is still the parent (it may have died before the request), pins itself to `CPU`
/// (`--bind`), and then replaces itself with the program. The parent-death signal survives `execve`, so the rank itself
/// carries it. This keeps `unsafe` out of the runner: no `pre_exec` hook is needed.
fn exec_rank(args: &[OsString]) -> i32 {
    let [parent, cpu, path, argv @ ..] = args else {
        eprintln!("ferroccl-run: internal error: bad exec-shim arguments");
        return 1;
    };
    if argv.is_empty() {
        eprintln!("ferroccl-run: internal error: bad exec-shim arguments");
        return 1;
    }
    let parent: Option<i32> = parent.to_str().and_then(|p| p.parse().ok());
    #[cfg(target_os = "linux")]
    {
        if let Err(e) = nix::sys::prctl::set_pdeathsig(Signal::SIGKILL) {
            eprintln!("ferroccl-run: warning: cannot set the parent-death signal: {e}");
        }
    }
    if parent.is_some_and(|p| nix::unistd::getppid().as_raw() != p) {
        // The runner died before we asked to follow it.
        return 1;
    }
    if let Some(cpu) = cpu.to_str().and_then(|c| c.parse::<usize>().ok()) {
        #[cfg(target_os = "linux")]
        {
            let mut set = nix::sched::CpuSet::new();
            let pinned = set.set(cpu).and_then(|()| nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set));
            if let Err(e) = pinned {
                eprintln!("ferroccl-run: warning: cannot pin to CPU {cpu}: {e}");
            }
        }
    }
    let to_c = |s: &OsStr| CString::new(s.as_bytes()).unwrap_or_default();
    let path_c = to_c(path);
    let argv_c: Vec<CString> = argv.iter().map(|a| to_c(a)).collect();
    let err = match nix::unistd::execv(&path_c, &argv_c) {
        Err(e) => e,
        Ok(never) => match never {},
    };
    eprintln!("ferroccl-run: cannot run {}: {err}", path.to_string_lossy());
    if err == nix::errno::Errno::ENOENT {
        127
    } else {
        126
    }
}

/// Copies one output stream of one rank to the runner's stream, a line at a time.
fn pump(src: impl Read, rank: usize, to_stderr: bool, prefix: bool) {
    let mut reader = BufReader::with_capacity(64 << 10, src);
    let tag = format!("[{rank}] ");
    let mut line: Vec<u8> = Vec::new();
    let mut out: Vec<u8> = Vec::new();
    let emit = |line: &[u8], out: &mut Vec<u8>| {
        out.clear();
        if prefix {
            out.extend_from_slice(tag.as_bytes());
            let body = line.strip_suffix(b"\n").unwrap_or(line);
            out.extend_from_slice(String::from_utf8_lossy(body).as_bytes());
            out.push(b'\n');
        } else {
            out.extend_from_slice(line);
        }
        // Errors (a closed stdout) are ignored: the rank's output is still drained, so it
        // never blocks on a full pipe.
        if to_stderr {
            let _ = io::stderr().lock().write_all(out);
        } else {
            let mut so = io::stdout().lock();
            let _ = so.write_all(out).and_then(|()| so.flush());
        }
    };
    loop {
        let buf = match reader.fill_buf() {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        };
        if buf.is_empty() {
            break;
        }
        let (take, complete) = match buf.iter().position(|&b| b == b'\n') {
            Some(i) => (i + 1, true),
            None => (buf.len(), false),
        };
        line.extend_from_slice(&buf[..take]);
        reader.consume(take);
        if complete || line.len() >= MAX_LINE {
            emit(&line, &mut out);
            line.clear();
        }
    }
    if !line.is_empty() {
        emit(&line, &mut out);
    }
}

/// One spawned rank.
#[derive(Debug)]
struct Rank {
    rank: usize,
    pid: i32,
    child: Child,
    status: Option<ExitStatus>,
}

impl Rank {
    /// Signals the rank's whole process group (the rank and what it started).
    fn signal_group(&self, sig: Signal) {
        let _ = killpg(Pid::from_raw(self.pid), sig);
    }
}

/// Everything the runner started that must be taken down at the end.
#[derive(Debug)]
struct Job {
    ranks: Vec<Rank>,
    pumps: Vec<(usize, JoinHandle<()>)>,
    verbose: bool,
}

/// The runner's decision to stop the ranks still running.
#[derive(Debug)]
struct Stopping {
    kill_at: Instant,
    kill_sent: bool,
}

impl Job {
    fn running(&self) -> Vec<usize> {
        self.ranks.iter().filter(|r| r.status.is_none()).map(|r| r.rank).collect()
    }

    fn signal_running(&self, sig: Signal) {
        for r in self.ranks.iter().filter(|r| r.status.is_none()) {
            r.signal_group(sig);
        }
    }

    /// Sends SIGTERM to the running ranks and schedules SIGKILL `after` from now.
    fn begin_stop(&self, stopping: &mut Option<Stopping>, after: Duration) {
        self.signal_running(Signal::SIGTERM);
        let kill_at = Instant::now() + after;
        match stopping {
            Some(s) => s.kill_at = s.kill_at.min(kill_at),
            None => *stopping = Some(Stopping { kill_at, kill_sent: false }),
        }
    }

    /// Kills whatever is still running, reaps every rank, and cleans up what the ranks
    /// left in their process groups. Used on every way out once ranks were spawned.
    fn kill_and_reap(&mut self) {
        self.signal_running(Signal::SIGKILL);
        for r in &mut self.ranks {
            if r.status.is_none() {
                r.status = r.child.wait().ok();
            }
        }
        self.sweep_groups();
    }

    /// Kills processes that outlived their rank in its process group (a background child
    /// of a rank that exited): they would be orphans, and may hold the output pipes open.
    fn sweep_groups(&self) {
        for r in &self.ranks {
            let pg = Pid::from_raw(r.pid);
            if killpg(pg, None).is_ok() {
                if self.verbose {
                    eprintln!("ferroccl-run: killing processes left behind in rank {}'s process group", r.rank);
                }
                let _ = killpg(pg, Signal::SIGKILL);
            }
        }
    }

    /// Waits (a bounded time) for every output stream to be drained and joins its thread.
    fn drain_output(&mut self) {
        let deadline = Instant::now() + DRAIN_WAIT;
        while Instant::now() < deadline && !self.pumps.iter().all(|(_, h)| h.is_finished()) {
            thread::sleep(Duration::from_millis(5));
        }
        let mut stuck: Vec<usize> = Vec::new();
        for (rank, h) in self.pumps.drain(..) {
            if h.is_finished() {
                let _ = h.join();
            } else if !stuck.contains(&rank) {
                stuck.push(rank);
            }
        }
        if !stuck.is_empty() {
            eprintln!(
                "ferroccl-run: output of ranks {} still open {} s after they exited (a process outside their group holds it); not waiting",
                rank_list(&stuck),
                secs(DRAIN_WAIT)
            );
        }
    }
}

/// Builds the command for one rank: through the exec shim when this binary can be found
/// (so the rank dies with the runner), else directly.
fn rank_command(opts: &Options, path: &Path, shim: Option<&Path>, cpu: Option<usize>) -> Command {
    let mut cmd = match shim {
        Some(exe) => {
            let mut c = Command::new(exe);
            c.arg(EXEC_SHIM_ARG).arg(std::process::id().to_string());
            c.arg(cpu.map_or_else(|| "-".to_string(), |c| c.to_string())).arg(path).arg(&opts.program);
            c
        }
        None => {
            let mut c = Command::new(path);
            c.arg0(&opts.program);
            c
        }
    };
    cmd.args(&opts.args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).process_group(0);
    cmd
}

/// The CPUs this process may run on, in order (for `--bind`).
fn allowed_cpus() -> Vec<usize> {
    #[cfg(target_os = "linux")]
    {
        if let Ok(set) = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0)) {
            return (0..nix::sched::CpuSet::count()).filter(|&c| set.is_set(c).unwrap_or(false)).collect();
        }
    }
    Vec::new()
}

/// The exec shim is this very binary; only used when it is the `ferroccl-run` launcher
/// (a test harness or another binary calling [`main_with_args`] spawns directly).
///
/// The parent-death signal fires when the *thread* that spawned a rank exits; ranks are
/// spawned by the thread that runs the job, which outlives them.
fn shim_exe() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let name = exe.file_name()?.to_str()?;
    (name == "ferroccl-run" && exe.is_file()).then_some(exe)
}

/// Runs one job to the end and returns the runner's exit status.
fn run(opts: &Options) -> i32 {
    let started = Instant::now();
    let max_value = match store_max_value(|k| std::env::var(k).ok()) {
        Ok(v) => v,
        Err(msg) => {
            eprintln!("ferroccl-run: error: {msg}");
            return 2;
        }
    };
    let path = match resolve_program(&opts.program) {
        Ok(p) => p,
        Err(e) => {
            let code = if e.kind() == io::ErrorKind::PermissionDenied { 126 } else { 127 };
            eprintln!("ferroccl-run: cannot run {}: {e}", opts.program.to_string_lossy());
            return code;
        }
    };
    let token = match new_token() {
        Ok(t) => t,
        Err(e) => {
            eprintln!("ferroccl-run: cannot make a job token: {e}");
            return 1;
        }
    };
    let mut signals = match Signals::new([SIGINT, SIGTERM, SIGHUP]) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("ferroccl-run: cannot install signal handlers: {e}");
            return 1;
        }
    };
    let store = match StoreServer::start(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)), &token, max_value) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("ferroccl-run: cannot start the bootstrap store: {e}");
            signals.handle().close();
            return 1;
        }
    };
    let store_addr = store.addr();
    if opts.verbose {
        eprintln!("ferroccl-run: store at {store_addr}, {} ranks", opts.nranks);
    }

    let mut job = Job { ranks: Vec::with_capacity(opts.nranks), pumps: Vec::new(), verbose: opts.verbose };
    let code = match spawn_all(opts, &path, &token, store_addr, &mut job) {
        Ok(()) => monitor(opts, &mut job, &mut signals, started),
        Err(code) => code,
    };
    job.kill_and_reap();
    job.drain_output();
    store.shutdown();
    signals.handle().close();
    if opts.verbose {
        eprintln!("ferroccl-run: wall time {} s, exit status {code}", secs(started.elapsed()));
    }
    let _ = io::stdout().flush();
    code
}

/// Spawns every rank and its two output pumps. On failure returns the exit status; the
/// ranks already started are left in `job` for the caller to kill.
fn spawn_all(opts: &Options, path: &Path, token: &str, store: SocketAddr, job: &mut Job) -> Result<(), i32> {
    let shim = shim_exe();
    let launcher_pid = std::process::id().to_string();
    let n = opts.nranks.to_string();
    let cpus = if opts.bind { allowed_cpus() } else { Vec::new() };
    if opts.bind && (cpus.is_empty() || shim.is_none()) {
        eprintln!("ferroccl-run: warning: --bind: cannot pin the ranks here (no CPU list, or not started as ferroccl-run)");
    }
    for rank in 0..opts.nranks {
        let cpu = (!cpus.is_empty()).then(|| cpus[rank % cpus.len()]);
        let mut cmd = rank_command(opts, path, shim.as_deref(), cpu);
        cmd.env("FERROCCL_RANK", rank.to_string())
            .env("FERROCCL_WORLD_SIZE", &n)
            .env("FERROCCL_LOCAL_RANK", rank.to_string())
            .env("FERROCCL_LOCAL_WORLD_SIZE", &n)
            .env("FERROCCL_STORE", store.to_string())
            .env("FERROCCL_TOKEN", token)
            .env("FERROCCL_LAUNCHER_PID", &launcher_pid);
        if let Some(t) = &opts.transport {
            cmd.env("FERROCCL_TRANSPORT", t);
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                eprintln!("ferroccl-run: cannot start rank {rank} ({}): {e}", opts.program.to_string_lossy());
                return Err(match e.kind() {
                    io::ErrorKind::NotFound => 127,
                    io::ErrorKind::PermissionDenied => 126,
                    _ => 1,
                });
            }
        };
        let pid = child.id() as i32;
        let streams = (child.stdout.take(), child.stderr.take());
        job.ranks.push(Rank { rank, pid, child, status: None });
        if opts.verbose {
            eprintln!("ferroccl-run: rank {rank} pid {pid}");
        }
        let (Some(out), Some(err)) = streams else {
            eprintln!("ferroccl-run: internal error: rank {rank} has no output pipes");
            return Err(1);
        };
        let prefix = opts.prefix;
        for (to_stderr, src) in [(false, Box::new(out) as Box<dyn Read + Send>), (true, Box::new(err))] {
            let spawned = thread::Builder::new()
                .name(format!("rank{rank}-{}", if to_stderr { "err" } else { "out" }))
                .stack_size(128 << 10)
                .spawn(move || pump(src, rank, to_stderr, prefix));
            match spawned {
                Ok(h) => job.pumps.push((rank, h)),
                Err(e) => {
                    eprintln!("ferroccl-run: cannot start an output thread for rank {rank}: {e}");
                    return Err(1);
                }
            }
        }
    }
    Ok(())
}

/// Watches the ranks until all have exited; handles failure, timeout and signals.
fn monitor(opts: &Options, job: &mut Job, signals: &mut Signals, started: Instant) -> i32 {
    let poll = if opts.nranks <= 64 { Duration::from_millis(10) } else { Duration::from_millis(20) };
    let deadline = opts.timeout.map(|t| started + t);
    let mut first_failure: Option<(usize, ExitStatus, Instant)> = None;
    let mut got_signal: Option<i32> = None;
    let mut timed_out = false;
    let mut stopping: Option<Stopping> = None;

    loop {
        for r in job.ranks.iter_mut().filter(|r| r.status.is_none()) {
            let st = match r.child.try_wait() {
                Ok(Some(st)) => st,
                Ok(None) => continue,
                Err(e) => {
                    eprintln!("ferroccl-run: cannot wait for rank {}: {e}", r.rank);
                    ExitStatus::from_raw(1 << 8)
                }
            };
            r.status = Some(st);
            // Once the runner is stopping the job, exits are its own doing.
            if stopping.is_none() && !st.success() {
                eprintln!("ferroccl-run: rank {} {}", r.rank, Describe(st));
                // A rank killed by a signal, or one that panicked, is the likelier root cause
                // than one that exited with an error after noticing it: if one shows up
                // shortly after an ordinary failure (a dying process's teardown can take
                // longer than its peers need to notice it and exit), it counts as the first
                // failure.
                let replaces = match &first_failure {
                    None => true,
                    Some((_, first, at)) => at.elapsed() < ROOT_CAUSE_WINDOW && is_crash(st) && !is_crash(*first),
                };
                if replaces {
                    first_failure = Some((r.rank, st, Instant::now()));
                }
            } else if opts.verbose {
                eprintln!("ferroccl-run: rank {} (pid {}) {}", r.rank, r.pid, Describe(st));
            }
        }
        let running = job.running();
        if running.is_empty() {
            break;
        }

        for sig in signals.pending() {
            if got_signal.is_none() {
                got_signal = Some(sig);
                eprintln!("ferroccl-run: got {}; sending SIGTERM to ranks {}", signal_name(sig), rank_list(&running));
                job.begin_stop(&mut stopping, SIGNAL_TERM_TO_KILL);
            } else {
                eprintln!("ferroccl-run: got {} again; sending SIGKILL to ranks {}", signal_name(sig), rank_list(&running));
                job.signal_running(Signal::SIGKILL);
                if let Some(s) = &mut stopping {
                    s.kill_sent = true;
                }
            }
        }

        let now = Instant::now();
        if stopping.is_none() {
            if let Some((failed, _, at)) = first_failure {
                if now >= at + opts.grace {
                    eprintln!(
                        "ferroccl-run: killed ranks {} (still running {} s after rank {failed} failed)",
                        rank_list(&running),
                        secs(opts.grace)
                    );
                    job.begin_stop(&mut stopping, TERM_TO_KILL);
                }
            }
        }
        if stopping.is_none() && deadline.is_some_and(|d| now >= d) {
            timed_out = true;
            eprintln!(
                "ferroccl-run: timeout after {} s; ranks still running: {}",
                secs(opts.timeout.unwrap_or_default()),
                rank_list(&running)
            );
            job.begin_stop(&mut stopping, TERM_TO_KILL);
        }
        if let Some(s) = &mut stopping {
            if !s.kill_sent && now >= s.kill_at {
                s.kill_sent = true;
                job.signal_running(Signal::SIGKILL);
            }
        }
        thread::sleep(poll);
    }

    if let Some(sig) = got_signal {
        128 + sig
    } else if let Some((_, st, _)) = first_failure {
        status_code(st)
    } else if timed_out {
        124
    } else {
        0
    }
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

    #[test]
    fn token_is_fresh_hex() {
        let a = new_token().unwrap();
        let b = new_token().unwrap();
        assert_eq!(a.len(), 64);
        assert!(a.bytes().all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()));
        assert_ne!(a, b);
    }

    #[test]
    fn store_max_value_from_env() {
        let only = |v: &'static str| move |k: &str| (k == "FERROCCL_STORE_MAX_VALUE").then(|| v.to_string());
        assert_eq!(store_max_value(|_| None), Ok(DEFAULT_STORE_MAX_VALUE));
        assert_eq!(store_max_value(only(" ")), Ok(DEFAULT_STORE_MAX_VALUE));
        assert_eq!(store_max_value(only("1024")), Ok(1024));
        assert!(store_max_value(only("lots")).unwrap_err().contains("FERROCCL_STORE_MAX_VALUE"));
        assert!(store_max_value(only("0")).is_err());
    }

    #[test]
    fn formatting() {
        assert_eq!(secs(Duration::from_secs(5)), "5");
        assert_eq!(secs(Duration::from_millis(500)), "0.5");
        assert_eq!(secs(Duration::from_millis(1250)), "1.25");
        assert_eq!(rank_list(&[1, 3]), "1, 3");
        assert_eq!(signal_name(9), "SIGKILL (9)");
        assert_eq!(Describe(ExitStatus::from_raw(3 << 8)).to_string(), "exited with status 3");
        assert_eq!(Describe(ExitStatus::from_raw(9)).to_string(), "was killed by signal SIGKILL (9)");
        assert_eq!(status_code(ExitStatus::from_raw(9)), 137);
        assert!(is_crash(ExitStatus::from_raw(9)) && is_crash(ExitStatus::from_raw(101 << 8)));
        assert!(!is_crash(ExitStatus::from_raw(1 << 8)) && !is_crash(ExitStatus::from_raw(3 << 8)));
        assert_eq!(status_code(ExitStatus::from_raw(3 << 8)), 3);
    }

    #[test]
    fn program_lookup() {
        assert!(resolve_program(OsStr::new("sh")).is_ok());
        assert!(resolve_program(OsStr::new("/bin/sh")).is_ok());
        let e = resolve_program(OsStr::new("ferroccl-no-such-program-xyz")).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
        let e = resolve_program(OsStr::new("./no/such/file")).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
    }
}
