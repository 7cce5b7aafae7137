//! # ferroccl-run: launch a FerroCCL job on one host
//!
//! `ferroccl-run` is to FerroCCL what `mpirun` or `torchrun` is to MPI or PyTorch, for one
//! host: it starts the job's bootstrap store, makes a fresh secret token, spawns `N` copies
//! of a program (the ranks) with the environment FerroCCL reads, prefixes their output with
//! their rank, and takes the whole job down when one rank fails.
//!
//! ```text
//! ferroccl-run -n N [--transport auto|shm|tcp|verbs] [--timeout S] [--grace S]
//!              [--no-prefix] [--bind|--no-bind] [-v|--verbose] -- PROGRAM [ARGS...]
//! ```
//!
//! | option | meaning |
//! | --- | --- |
//! | `-n N` (`-nN`, `--nproc N`, `--nproc=N`) | number of ranks, 1 to 1024 (required) |
//! | `--transport auto\|shm\|tcp\|verbs` | sets `FERROCCL_TRANSPORT` for every rank (otherwise the ranks inherit the runner's environment) |
//! | `--timeout S` | wall-clock limit for the whole job, in seconds (a decimal number); none by default |
//! | `--grace S` | after the first rank fails, how long the others may take to exit by themselves (default 5) |
//! | `--no-prefix` | pass the ranks' output through without the `[R] ` prefix |
//! | `--bind` | pin rank r to the (r mod k)-th of the k CPUs the runner may use (as `mpirun --bind-to core`), even when there are more ranks than CPUs |
//! | `--no-bind` | do not pin the ranks (leave them to the kernel) |
//! | `-v`, `--verbose` | print the store address, the ranks' pids and the wall time to stderr, and pass the ranks' flight-record lines on |
//! | `-h`, `--help` | print the help and exit 0 |
//!
//! Without `--bind` or `--no-bind`, the runner reads `FERROCCL_BIND` from its own
//! environment: `auto` (the default) pins rank r to the (r mod k)-th of the k CPUs the
//! runner may use when `N <= k` (as `mpirun` binds to core for `-np` <= cores), and pins
//! nothing when `N > k` (oversubscribed: ranks pinned by twos to one CPU could not be moved
//! apart by the kernel; `-v` says so in one line); `1`, `on` or `core` always pin (as
//! `--bind`), `0`, `off` or `none` never (as `--no-bind`); any other value is a bad command
//! line (exit 2). The command line wins over the variable. When the runner is told to pin
//! (`--bind`, `FERROCCL_BIND=on`) but cannot (no CPU list, or not started as the
//! `ferroccl-run` binary) it warns and runs the ranks unpinned; under `auto` it says so only
//! with `-v`.
//!
//! `--` ends the options; the first argument that is not an option also starts the
//! program, so `ferroccl-run -n 2 ./app --flag` works too: everything after the program is
//! the program's. Every option that takes a value accepts it as the next argument, whatever
//! it looks like, or after `=` (`--grace=0.5`). The command line is parsed with clap
//! (`args` module); a bad one is an error that names the option and the value, followed by
//! the usage line, and exit status 2.
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
//!    Once every rank has ended, the runner reads the ranks' flight records (the
//!    `ferroccl-flight` lines they write to stderr when a call fails for good, kept out of
//!    the output unless `-v`; or the files `FERROCCL_FLIGHT_RECORDER` names) and prints,
//!    per communicator, where the ranks' calls parted, then one line naming the culprits
//!    by the rank it launched them as (whatever a shrink renumbered): each world's, then
//!    any rank killed by a signal the runner did not send that no record names (one that
//!    died inside a shrink), e.g. `ferroccl-run: culprit: rank 3 (exited with status 1)`
//!    (see `ferroccl::flight`).
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
//! | 2 | bad command line (or a malformed `FERROCCL_STORE_MAX_VALUE` or `FERROCCL_BIND`) |
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
//! | `FERROCCL_BOUND_CPU` | only when the rank is pinned: the CPU it is pinned to (set by the exec shim once the pinning succeeded; removed otherwise, so a rank of a nested job never inherits its runner's) |
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
//!
//! ## The library
//!
//! [`main_with_args`] is the whole launcher (`ferroccl-perf --ranks N` runs its ranks
//! through it); [`parse_args`] is its command line, and [`cli`] what clap's errors mean
//! in the terms of FerroCCL's tools (shared with `ferroccl-perf`). [`testkit`] holds what the
//! `ferroccl-demo` and `ferroccl-selftest` programs of this package share: a pairing
//! schedule and data a receiver can check.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

/// `eprintln!` as one `write`: the runner's own lines share a pipe with the ranks' lines
/// (often one stream, as `2>&1`), and `eprintln!` writes a formatted line in pieces, so
/// another process's line could land inside it ("ferroccl-run: rank 3 [2] selftest: ...").
/// A line of up to `PIPE_BUF` (4 KiB) bytes written at once is never split.
macro_rules! say {
    ($($arg:tt)*) => { $crate::say_line(::std::format_args!($($arg)*)) };
}

mod args;
pub mod cli;
mod job;
mod output;
mod policy;
mod signals;
mod spawn;
mod supervise;
pub mod testkit;

use std::ffi::OsString;
use std::io::{self, Write};

pub use args::{parse_args, ArgError, Bind, Invocation, Options, DEFAULT_GRACE, MAX_RANKS, USAGE};
pub use supervise::DEFAULT_STORE_MAX_VALUE;

use spawn::{exec_rank, EXEC_SHIM_ARG};
use supervise::run;

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
            print!("{}", args::help());
            let _ = io::stdout().flush();
            0
        }
        Ok(Invocation::Run(opts)) => run(&opts),
        Err(e) => {
            say!("ferroccl-run: error: {e}");
            say!("{USAGE}");
            2
        }
    }
}

/// [`main_with_args`] for a program other than `ferroccl-run` that starts a job's ranks
/// from inside itself (`ferroccl-perf --ranks N`) and whose `main` hands its arguments to
/// [`exec_shim`] before anything else: the ranks are started through this program's own
/// exec shim, so they are pinned to CPUs as `ferroccl-run` pins them (`--bind`,
/// `--no-bind`, `FERROCCL_BIND`) and die with the launcher. Without that `main`, use
/// [`main_with_args`] (the ranks are then started directly and never pinned).
pub fn main_with_args_hosting_shim<I, S>(args: I) -> i32
where
    I: IntoIterator<Item = S>,
    S: Into<OsString>,
{
    spawn::host_exec_shim();
    main_with_args(args)
}

/// The per-rank exec shim of a program that calls [`main_with_args_hosting_shim`]: when
/// `args` (after the program name) are the shim's, pins this process as told and replaces
/// it with the rank, so it returns only when that failed: `Some(exit status)`. `None`: not
/// the shim's arguments, carry on.
pub fn exec_shim(args: &[OsString]) -> Option<i32> {
    (args.first().is_some_and(|a| a == EXEC_SHIM_ARG)).then(|| exec_rank(&args[1..]))
}

/// Writes `args` and a newline to stderr with one `write_all` (see `say!`).
fn say_line(args: std::fmt::Arguments<'_>) {
    let mut line = std::fmt::format(args);
    line.push('\n');
    // A closed stderr is ignored, where `eprintln!` would panic.
    let _ = io::stderr().lock().write_all(line.as_bytes());
}

/// A fresh job token: 32 random bytes from the OS as 64 lowercase hex digits.
pub fn new_token() -> io::Result<String> {
    Ok(ferroccl::bootstrap::new_token())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_is_fresh_hex() {
        let a = new_token().unwrap();
        let b = new_token().unwrap();
        assert_eq!(a.len(), 64);
        assert!(a.bytes().all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()));
        assert_ne!(a, b);
    }
}
