//! Starting the ranks: finding the program, each rank's command and environment, the exec
//! shim that ties a rank's life to the runner's, and pinning the ranks to CPUs (`--bind`,
//! `--no-bind`, `FERROCCL_BIND`).

use std::ffi::{CString, OsStr, OsString};
use std::io::{self, Read};
use std::net::SocketAddr;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;

use nix::sys::signal::Signal;

use crate::args::{Bind, Options};
use crate::job::{Job, Rank};
use crate::output::pump;

/// Hidden first argument that makes the binary a per-rank exec shim (see [`exec_rank`]).
pub(crate) const EXEC_SHIM_ARG: &str = "__ferroccl-run-exec-rank";

/// Set for a rank that is pinned to one CPU: that CPU's number. Never inherited.
const BOUND_CPU_VAR: &str = "FERROCCL_BOUND_CPU";

/// Finds `program` the way `execvp` would: a name with a slash is a path, anything else
/// is looked up in `PATH`. Errors are `NotFound` or `PermissionDenied`.
pub(crate) fn resolve_program(program: &OsStr) -> io::Result<PathBuf> {
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
/// (and then sets `FERROCCL_BOUND_CPU=CPU` for the program), and then replaces itself with
/// the program. The parent-death signal survives `execve`, so the rank itself carries it.
/// This keeps `unsafe` out of the runner: no `pre_exec` hook is needed.
pub(crate) fn exec_rank(args: &[OsString]) -> i32 {
    let [parent, cpu, path, argv @ ..] = args else {
        say!("ferroccl-run: internal error: bad exec-shim arguments");
        return 1;
    };
    if argv.is_empty() {
        say!("ferroccl-run: internal error: bad exec-shim arguments");
        return 1;
    }
    let parent: Option<i32> = parent.to_str().and_then(|p| p.parse().ok());
    #[cfg(target_os = "linux")]
    {
        if let Err(e) = nix::sys::prctl::set_pdeathsig(Signal::SIGKILL) {
            say!("ferroccl-run: warning: cannot set the parent-death signal: {e}");
        }
    }
    if parent.is_some_and(|p| nix::unistd::getppid().as_raw() != p) {
        // The runner died before we asked to follow it.
        return 1;
    }
    let mut bound = None;
    if let Some(cpu) = cpu.to_str().and_then(|c| c.parse::<usize>().ok()) {
        #[cfg(target_os = "linux")]
        {
            let mut set = nix::sched::CpuSet::new();
            let pinned = set.set(cpu).and_then(|()| nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set));
            match pinned {
                Ok(()) => bound = Some(cpu),
                Err(e) => say!("ferroccl-run: warning: cannot pin to CPU {cpu}: {e}"),
            }
        }
    }
    let to_c = |s: &OsStr| CString::new(s.as_bytes()).unwrap_or_default();
    let path_c = to_c(path);
    let argv_c: Vec<CString> = argv.iter().map(|a| to_c(a)).collect();
    // The environment as inherited, with FERROCCL_BOUND_CPU only when this rank is pinned.
    let mut env_c: Vec<CString> = std::env::vars_os()
        .filter(|(k, _)| k != BOUND_CPU_VAR)
        .filter_map(|(k, v)| CString::new([k.as_bytes(), b"=", v.as_bytes()].concat()).ok())
        .collect();
    if let Some(cpu) = bound {
        env_c.push(CString::new(format!("{BOUND_CPU_VAR}={cpu}")).unwrap_or_default());
    }
    let err = match nix::unistd::execve(&path_c, &argv_c, &env_c) {
        Err(e) => e,
        Ok(never) => match never {},
    };
    say!("ferroccl-run: cannot run {}: {err}", path.to_string_lossy());
    if err == nix::errno::Errno::ENOENT {
        127
    } else {
        126
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

/// The CPUs this process may run on, in order (the ranks are pinned to these).
fn allowed_cpus() -> Vec<usize> {
    #[cfg(target_os = "linux")]
    {
        if let Ok(set) = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0)) {
            return (0..nix::sched::CpuSet::count()).filter(|&c| set.is_set(c).unwrap_or(false)).collect();
        }
    }
    Vec::new()
}

/// Set by [`crate::main_with_args_hosting_shim`]: this binary, whatever its name, serves
/// the exec shim (its `main` hands its arguments to [`crate::exec_shim`] first).
static SHIM_HOST: AtomicBool = AtomicBool::new(false);

/// Declares this binary an exec-shim host (see [`SHIM_HOST`]).
pub(crate) fn host_exec_shim() {
    SHIM_HOST.store(true, Ordering::Relaxed);
}

/// The exec shim is this very binary; only used when it is the `ferroccl-run` launcher, or
/// a binary that declared it serves the shim (`ferroccl-perf --ranks`): a test harness or
/// another binary calling [`main_with_args`](crate::main_with_args) spawns directly.
///
/// The parent-death signal fires when the *thread* that spawned a rank exits; ranks are
/// spawned by the thread that runs the job, which outlives them.
fn shim_exe() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let name = exe.file_name()?.to_str()?;
    ((name == "ferroccl-run" || SHIM_HOST.load(Ordering::Relaxed)) && exe.is_file()).then_some(exe)
}

/// Spawns every rank and its two output pumps. On failure returns the exit status; the
/// ranks already started are left in `job` for the caller to kill.
pub(crate) fn spawn_all(opts: &Options, path: &Path, token: &str, store: SocketAddr, job: &mut Job) -> Result<(), i32> {
    let shim = shim_exe();
    let launcher_pid = std::process::id().to_string();
    let n = opts.nranks.to_string();
    // Only the exec shim pins; without it no CPU is usable for pinning.
    let cpus = if opts.bind == Bind::Never || shim.is_none() { Vec::new() } else { allowed_cpus() };
    let pin = opts.bind.pins(opts.nranks, cpus.len());
    match opts.bind {
        Bind::Always if !pin => {
            say!("ferroccl-run: warning: --bind: cannot pin the ranks here (no CPU list, or not started as ferroccl-run)");
        }
        Bind::Auto if !pin && opts.verbose => {
            if cpus.is_empty() {
                say!("ferroccl-run: not pinning the ranks: cannot pin them here (no CPU list, or not started as ferroccl-run)");
            } else {
                say!(
                    "ferroccl-run: not pinning the ranks: {} ranks > {} usable CPUs (oversubscribed; --bind pins them anyway)",
                    opts.nranks,
                    cpus.len()
                );
            }
        }
        _ => {}
    }
    let cpus = if pin { cpus } else { Vec::new() };
    for rank in 0..opts.nranks {
        let cpu = (!cpus.is_empty()).then(|| cpus[rank % cpus.len()]);
        let mut cmd = rank_command(opts, path, shim.as_deref(), cpu);
        cmd.env("FERROCCL_RANK", rank.to_string())
            .env("FERROCCL_WORLD_SIZE", &n)
            .env("FERROCCL_LOCAL_RANK", rank.to_string())
            .env("FERROCCL_LOCAL_WORLD_SIZE", &n)
            .env("FERROCCL_STORE", store.to_string())
            .env("FERROCCL_TOKEN", token)
            .env("FERROCCL_LAUNCHER_PID", &launcher_pid)
            .env_remove(BOUND_CPU_VAR);
        if let Some(t) = &opts.transport {
            cmd.env("FERROCCL_TRANSPORT", t);
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                say!("ferroccl-run: cannot start rank {rank} ({}): {e}", opts.program.to_string_lossy());
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
            match cpu {
                Some(c) => say!("ferroccl-run: rank {rank} pid {pid} on CPU {c}"),
                None => say!("ferroccl-run: rank {rank} pid {pid}"),
            }
        }
        let (Some(out), Some(err)) = streams else {
            say!("ferroccl-run: internal error: rank {rank} has no output pipes");
            return Err(1);
        };
        let prefix = opts.prefix;
        let flight = job.flight.clone();
        for (to_stderr, src) in [(false, Box::new(out) as Box<dyn Read + Send>), (true, Box::new(err))] {
            let spawned =
                thread::Builder::new().name(format!("rank{rank}-{}", if to_stderr { "err" } else { "out" })).stack_size(128 << 10).spawn({
                    let flight = to_stderr.then(|| (flight.clone(), opts.verbose));
                    move || pump(src, rank, to_stderr, prefix, flight)
                });
            match spawned {
                Ok(h) => job.pumps.push((rank, h)),
                Err(e) => {
                    say!("ferroccl-run: cannot start an output thread for rank {rank}: {e}");
                    return Err(1);
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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
