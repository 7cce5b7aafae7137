//! End-to-end tests of the `ferroccl-run` binary. The ranks are small `/bin/sh` scripts, so
//! these tests exercise the launcher alone (environment, output, failure handling), not
//! the FerroCCL library.

use std::io::{BufRead, BufReader};
use std::process::{Command, Output, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

const RUNNER: &str = env!("CARGO_BIN_EXE_ferroccl-run");

/// Runs the launcher to completion; returns its output and how long it took.
fn launch(args: &[&str]) -> (Output, Duration) {
    let start = Instant::now();
    let out = Command::new(RUNNER).args(args).stdin(Stdio::null()).output().expect("spawn ferroccl-run");
    (out, start.elapsed())
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Whether `pid` is a live (not zombie) process.
fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the parenthesised command name.
        Ok(stat) => stat.rsplit_once(')').and_then(|(_, rest)| rest.trim_start().chars().next()) != Some('Z'),
        Err(_) => false,
    }
}

/// Asserts every pid is gone, allowing the kernel a moment to finish them.
fn assert_all_gone(pids: &[i32]) {
    let deadline = Instant::now() + Duration::from_secs(3);
    while pids.iter().any(|&p| alive(p)) {
        assert!(Instant::now() < deadline, "processes left behind: {:?}", pids.iter().filter(|&&p| alive(p)).collect::<Vec<_>>());
        thread::sleep(Duration::from_millis(20));
    }
}

/// The pids the ranks printed as `pid N` lines.
fn printed_pids(stdout: &str) -> Vec<i32> {
    stdout
        .lines()
        .filter_map(|l| l.split_once("pid ").map(|(_, p)| p.trim()))
        .flat_map(|p| p.split_whitespace().map(|x| x.parse::<i32>().expect("pid")).collect::<Vec<_>>())
        .collect()
}

/// Parses `[R] rank world store token` lines into (rank, world, store, token).
fn env_lines(stdout: &str) -> Vec<(usize, String, String, String)> {
    let mut rows: Vec<_> = stdout
        .lines()
        .map(|l| {
            let (tag, rest) = l.split_once("] ").expect("prefixed line");
            let r: usize = tag.strip_prefix('[').expect("prefix").parse().expect("rank");
            let f: Vec<&str> = rest.split_whitespace().collect();
            assert_eq!(f.len(), 6, "line {l:?}");
            assert_eq!(f[0], r.to_string(), "prefix and FERROCCL_RANK agree");
            assert_eq!(f[4], f[0], "FERROCCL_LOCAL_RANK = rank");
            assert_eq!(f[5], f[1], "FERROCCL_LOCAL_WORLD_SIZE = world size");
            (r, f[1].to_string(), f[2].to_string(), f[3].to_string())
        })
        .collect();
    rows.sort();
    rows
}

const ENV_SCRIPT: &str = "echo $FERROCCL_RANK $FERROCCL_WORLD_SIZE $FERROCCL_STORE $FERROCCL_TOKEN \
                          $FERROCCL_LOCAL_RANK $FERROCCL_LOCAL_WORLD_SIZE";

#[test]
fn environment_and_fresh_tokens() {
    let mut tokens = Vec::new();
    for _ in 0..2 {
        let (out, _) = launch(&["-n", "4", "--", "/bin/sh", "-c", ENV_SCRIPT]);
        assert_eq!(out.status.code(), Some(0), "stderr: {}", text(&out.stderr));
        let rows = env_lines(&text(&out.stdout));
        assert_eq!(rows.iter().map(|r| r.0).collect::<Vec<_>>(), vec![0, 1, 2, 3]);
        let (_, world, store, token) = &rows[0];
        assert_eq!(world, "4");
        assert!(store.starts_with("127.0.0.1:"), "store {store}");
        assert!(store[10..].parse::<u16>().is_ok_and(|p| p != 0), "store {store}");
        assert_eq!(token.len(), 64, "token {token}");
        assert!(token.bytes().all(|b| b.is_ascii_hexdigit()), "token {token}");
        for row in &rows {
            assert_eq!((&row.1, &row.2, &row.3), (world, store, token), "all ranks share the store and token");
        }
        tokens.push(token.clone());
    }
    assert_ne!(tokens[0], tokens[1], "every job gets its own token");
}

#[test]
fn launcher_pid_and_transport() {
    let child = Command::new(RUNNER)
        .args(["-n", "2", "--transport", "tcp", "--", "/bin/sh", "-c", "echo $FERROCCL_LAUNCHER_PID $FERROCCL_TRANSPORT"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let runner_pid = child.id();
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(0));
    let stdout = text(&out.stdout);
    for r in 0..2 {
        assert!(stdout.contains(&format!("[{r}] {runner_pid} tcp\n")), "{stdout}");
    }
}

#[test]
fn sixteen_ranks_succeed() {
    let (out, _) = launch(&["-n", "16", "--", "/bin/sh", "-c", "echo hello from $FERROCCL_RANK"]);
    assert_eq!(out.status.code(), Some(0), "stderr: {}", text(&out.stderr));
    let stdout = text(&out.stdout);
    for r in 0..16 {
        assert!(stdout.contains(&format!("[{r}] hello from {r}\n")), "rank {r} missing: {stdout}");
    }
    assert_eq!(stdout.lines().count(), 16);
}

#[test]
fn failing_rank_takes_the_job_down() {
    // Rank 2 fails at once; the others run a background sleep (a grandchild of the runner)
    // and wait for it, so the process-group kill is exercised too.
    let script = "if [ $FERROCCL_RANK = 2 ]; then exit 3; fi; sleep 30 & echo pid $$ $!; wait";
    let (out, took) = launch(&["-n", "4", "--grace", "0.5", "--", "/bin/sh", "-c", script]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "stderr: {stderr}");
    assert!(took < Duration::from_secs(10), "took {took:?}");
    assert!(stderr.contains("ferroccl-run: rank 2 exited with status 3"), "{stderr}");
    assert!(stderr.contains("ferroccl-run: killed ranks 0, 1, 3 (still running 0.5 s after rank 2 failed)"), "{stderr}");
    let pids = printed_pids(&text(&out.stdout));
    assert!(!pids.is_empty(), "no rank printed its pids");
    assert_all_gone(&pids);
}

#[test]
fn rank_killed_by_signal() {
    let script = "if [ $FERROCCL_RANK = 1 ]; then kill -9 $$; fi; exit 0";
    let (out, _) = launch(&["-n", "3", "--grace", "2", "--", "/bin/sh", "-c", script]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(137), "stderr: {stderr}");
    assert!(stderr.contains("ferroccl-run: rank 1 was killed by signal SIGKILL (9)"), "{stderr}");
}

#[test]
fn peers_exiting_on_their_own_within_grace() {
    // Like FerroCCL ranks that notice a dead peer: rank 0 fails, the others report and
    // exit by themselves; nothing is killed and the first failure decides the status.
    let script = "if [ $FERROCCL_RANK = 0 ]; then echo boom >&2; exit 5; fi; \
                  sleep 0.3; echo rank $FERROCCL_RANK saw the failure >&2; exit 0";
    let (out, took) = launch(&["-n", "3", "--", "/bin/sh", "-c", script]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(5), "stderr: {stderr}");
    assert!(took < Duration::from_secs(4), "waited for the whole grace: {took:?}");
    assert!(stderr.contains("[0] boom\n"), "{stderr}");
    assert!(stderr.contains("[1] rank 1 saw the failure\n"), "{stderr}");
    assert!(stderr.contains("[2] rank 2 saw the failure\n"), "{stderr}");
    assert!(stderr.contains("ferroccl-run: rank 0 exited with status 5"), "{stderr}");
    assert!(!stderr.contains("killed ranks"), "{stderr}");
}

#[test]
fn first_failure_decides_the_status() {
    let script = "case $FERROCCL_RANK in 0) sleep 0.3; exit 9;; 1) exit 4;; esac; exit 0";
    let (out, _) = launch(&["-n", "3", "--", "/bin/sh", "-c", script]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(4), "stderr: {stderr}");
    assert!(stderr.contains("rank 1 exited with status 4"), "{stderr}");
    assert!(stderr.contains("rank 0 exited with status 9"), "{stderr}");
}

#[test]
fn timeout_kills_running_ranks() {
    let script = "if [ $FERROCCL_RANK = 1 ]; then exit 0; fi; echo pid $$; exec sleep 30";
    let (out, took) = launch(&["-n", "3", "--timeout", "1", "--", "/bin/sh", "-c", script]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(124), "stderr: {stderr}");
    assert!(took >= Duration::from_millis(900) && took < Duration::from_secs(8), "took {took:?}");
    assert!(stderr.contains("ferroccl-run: timeout after 1 s; ranks still running: 0, 2"), "{stderr}");
    assert_all_gone(&printed_pids(&text(&out.stdout)));
}

#[test]
fn sigterm_to_runner_stops_everything() {
    let mut child = Command::new(RUNNER)
        .args(["-n", "3", "--", "/bin/sh", "-c", "sleep 30 & echo pid $$ $!; wait"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut pids = Vec::new();
    for _ in 0..3 {
        let line = lines.next().expect("a pid line").unwrap();
        pids.extend(printed_pids(&line));
    }
    assert_eq!(pids.len(), 6);
    let start = Instant::now();
    kill(Pid::from_raw(child.id() as i32), Signal::SIGTERM).unwrap();
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(143));
    assert!(start.elapsed() < Duration::from_secs(5), "took {:?}", start.elapsed());
    assert_all_gone(&pids);
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(stderr.contains("got SIGTERM"), "{stderr}");
}

#[test]
fn bad_arguments_exit_2() {
    let cases: &[(&[&str], &str)] = &[
        (&["--", "true"], "missing -n"),
        (&["-n", "0", "--", "true"], "-n \"0\""),
        (&["-n", "2000", "--", "true"], "1 to 1024"),
        (&["-n", "x", "--", "true"], "-n \"x\""),
        (&["-n", "2", "--timeout", "soon", "--", "true"], "--timeout \"soon\""),
        (&["-n", "2", "--grace", "-1", "--", "true"], "--grace \"-1\""),
        (&["-n", "2", "--frobnicate", "--", "true"], "unknown option \"--frobnicate\""),
        (&["-n", "2", "--"], "no program"),
        (&["-n", "2", "--transport", "carrier-pigeon", "--", "true"], "--transport \"carrier-pigeon\""),
    ];
    for (args, needle) in cases {
        let (out, _) = launch(args);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
        assert!(stderr.contains("usage: ferroccl-run -n N"), "{args:?}: {stderr}");
        assert!(out.stdout.is_empty());
    }
}

#[test]
fn help_and_missing_program() {
    let (out, _) = launch(&["--help"]);
    assert_eq!(out.status.code(), Some(0));
    assert!(text(&out.stdout).contains("usage: ferroccl-run"));

    let (out, _) = launch(&["-n", "2", "--", "ferroccl-surely-not-a-program"]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(127), "{stderr}");
    assert!(stderr.contains("cannot run ferroccl-surely-not-a-program"), "{stderr}");
}

#[test]
fn output_lines_are_prefixed_and_complete() {
    let script = "printf 'one\\n\\377bad\\nlast without newline'; printf 'oops\\n' >&2; printf 'err tail' >&2";
    let (out, _) = launch(&["-n", "2", "--", "/bin/sh", "-c", script]);
    assert_eq!(out.status.code(), Some(0));
    let stdout = text(&out.stdout);
    let stderr = text(&out.stderr);
    // Ranks interleave; each rank's own lines stay in order.
    let of_rank =
        |all: &str, r: usize| -> String { all.lines().filter(|l| l.starts_with(&format!("[{r}] "))).map(|l| format!("{l}\n")).collect() };
    for r in 0..2 {
        assert_eq!(of_rank(&stdout, r), format!("[{r}] one\n[{r}] \u{FFFD}bad\n[{r}] last without newline\n"), "{stdout:?}");
        assert_eq!(of_rank(&stderr, r), format!("[{r}] oops\n[{r}] err tail\n"), "{stderr:?}");
    }
    assert!(stdout.ends_with('\n') && stderr.ends_with('\n'));
    // Lines are never mixed: every line starts with a prefix.
    assert!(stdout.lines().all(|l| l.starts_with("[0] ") || l.starts_with("[1] ")), "{stdout:?}");
}

#[test]
fn no_prefix_passes_output_through() {
    let (out, _) = launch(&["-n", "1", "--no-prefix", "--", "/bin/sh", "-c", "printf 'plain\\ntail'"]);
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(out.stdout, b"plain\ntail");
}

#[test]
fn interleaved_output_keeps_lines_whole() {
    let script = "i=0; while [ $i -lt 200 ]; do echo rank-$FERROCCL_RANK-line-$i-xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx; i=$((i+1)); done";
    let (out, _) = launch(&["-n", "4", "--", "/bin/sh", "-c", script]);
    assert_eq!(out.status.code(), Some(0));
    let stdout = text(&out.stdout);
    assert_eq!(stdout.lines().count(), 800);
    for line in stdout.lines() {
        let (tag, rest) = line.split_once(' ').unwrap();
        let r = tag.trim_start_matches('[').trim_end_matches(']');
        assert!(rest.starts_with(&format!("rank-{r}-line-")) && rest.ends_with("xxxx"), "{line:?}");
    }
}

#[test]
fn ranks_can_reach_the_store_with_the_token() {
    use ferroccl::bootstrap::StoreClient;
    let mut child = Command::new(RUNNER)
        .args(["-n", "1", "--", "/bin/sh", "-c", "echo $FERROCCL_STORE $FERROCCL_TOKEN; exec sleep 30"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let fields: Vec<&str> = line.trim().trim_start_matches("[0] ").split(' ').collect();
    let (store, token) = (fields[0], fields[1]);
    let timeout = Duration::from_secs(5);
    let client = StoreClient::connect(store, token, 0, timeout).expect("connect with the job token");
    client.set("launcher-test", b"hello").unwrap();
    assert_eq!(client.get("launcher-test", timeout).unwrap(), b"hello");
    assert!(StoreClient::connect(store, &"0".repeat(64), 0, timeout).is_err(), "a wrong token must be refused");
    kill(Pid::from_raw(child.id() as i32), Signal::SIGTERM).unwrap();
    assert_eq!(child.wait().unwrap().code(), Some(143));
}

/// The CPUs this test may run on (as the runner it starts may), from /proc/self/status.
fn allowed_cpus() -> Vec<usize> {
    let me = std::fs::read_to_string("/proc/self/status").unwrap();
    let list = me.lines().find(|l| l.starts_with("Cpus_allowed_list")).unwrap().rsplit(['\t', ' ']).next().unwrap().to_string();
    list.split(',')
        .flat_map(|part| match part.split_once('-') {
            Some((a, b)) => (a.parse::<usize>().unwrap()..=b.parse::<usize>().unwrap()).collect::<Vec<_>>(),
            None => vec![part.parse().unwrap()],
        })
        .collect()
}

/// Each rank prints its allowed-CPU list and its FERROCCL_BOUND_CPU.
const CPU_SCRIPT: &str = "echo cpus $(grep Cpus_allowed_list /proc/self/status | cut -f2) bound ${FERROCCL_BOUND_CPU:-none}";

/// Runs `CPU_SCRIPT` on `n` ranks with `FERROCCL_BIND` as given (unset: `None`) and returns,
/// by rank, (allowed-CPU list, FERROCCL_BOUND_CPU or "none"), and the runner's stderr.
fn rank_cpus(n: usize, flags: &[&str], bind_env: Option<&str>) -> (Vec<(String, String)>, String) {
    let n_text = n.to_string();
    let mut args = vec!["-n", n_text.as_str()];
    args.extend_from_slice(flags);
    args.extend_from_slice(&["--", "sh", "-c", CPU_SCRIPT]);
    let mut cmd = Command::new(RUNNER);
    cmd.args(&args).stdin(Stdio::null()).env_remove("FERROCCL_BIND").env_remove("FERROCCL_BOUND_CPU");
    if let Some(v) = bind_env {
        cmd.env("FERROCCL_BIND", v);
    }
    let out = cmd.output().expect("spawn ferroccl-run");
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "{args:?}: {stderr}");
    let rows = (0..n)
        .map(|r| {
            let line = stdout.lines().find(|l| l.starts_with(&format!("[{r}] "))).unwrap_or_else(|| panic!("rank {r}: {stdout}"));
            let f: Vec<&str> = line.split_whitespace().collect();
            assert_eq!((f.len(), f[1], f[3]), (5, "cpus", "bound"), "{line}");
            (f[2].to_string(), f[4].to_string())
        })
        .collect();
    (rows, stderr)
}

#[test]
fn bind_pins_each_rank_to_one_cpu_round_robin() {
    let allowed = allowed_cpus();
    // --bind pins even when oversubscribed (3 ranks on a 2-CPU machine).
    let (rows, stderr) = rank_cpus(3, &["--bind"], None);
    for (r, (cpus, bound)) in rows.iter().enumerate() {
        let want = allowed[r % allowed.len()].to_string();
        assert_eq!((cpus, bound), (&want, &want), "rank {r}: {rows:?}");
    }
    assert_eq!(stderr, "");
    // FERROCCL_BIND=on is --bind; the command line wins over it.
    let (rows, _) = rank_cpus(3, &[], Some("on"));
    assert_eq!(rows[2].1, allowed[2 % allowed.len()].to_string(), "{rows:?}");
    let (rows, _) = rank_cpus(3, &["--no-bind"], Some("on"));
    assert!(rows.iter().all(|(_, b)| b == "none"), "{rows:?}");
}

#[test]
fn ranks_are_pinned_by_default_unless_oversubscribed() {
    let allowed = allowed_cpus();
    if allowed.len() < 2 {
        eprintln!("skipped: this test may use {} CPU(s), fewer than the 2 ranks it needs", allowed.len());
        return;
    }
    let whole = {
        let me = std::fs::read_to_string("/proc/self/status").unwrap();
        me.lines().find(|l| l.starts_with("Cpus_allowed_list")).unwrap().rsplit(['\t', ' ']).next().unwrap().to_string()
    };
    // Default (auto) with ranks <= CPUs: one CPU each, round robin, and FERROCCL_BOUND_CPU says which.
    for env in [None, Some("auto")] {
        let (rows, stderr) = rank_cpus(2, &[], env);
        for (r, (cpus, bound)) in rows.iter().enumerate() {
            let want = allowed[r].to_string();
            assert_eq!((cpus, bound), (&want, &want), "FERROCCL_BIND={env:?}, rank {r}: {rows:?}");
        }
        assert_eq!(stderr, "");
    }
    // --no-bind, FERROCCL_BIND=off: every rank keeps all the CPUs, and no FERROCCL_BOUND_CPU.
    for (flags, env) in [(&["--no-bind"][..], None), (&[][..], Some("off")), (&[][..], Some("0")), (&["--bind", "--no-bind"][..], None)] {
        let (rows, _) = rank_cpus(2, flags, env);
        assert!(rows.iter().all(|(cpus, bound)| cpus == &whole && bound == "none"), "{flags:?} {env:?}: {rows:?}");
    }
    // Oversubscribed (more ranks than CPUs): not pinned, silently; -v says why in one line.
    let n = allowed.len() + 1;
    let (rows, stderr) = rank_cpus(n, &[], None);
    assert!(rows.iter().all(|(cpus, bound)| cpus == &whole && bound == "none"), "{rows:?}");
    assert_eq!(stderr, "");
    let (_, stderr) = rank_cpus(n, &["-v"], None);
    let why: Vec<&str> = stderr.lines().filter(|l| l.contains("not pinning")).collect();
    assert_eq!(why.len(), 1, "{stderr}");
    assert!(why[0].contains(&format!("{n} ranks > {} usable CPUs", allowed.len())), "{stderr}");
    // A bad FERROCCL_BIND is a bad command line.
    let out = Command::new(RUNNER).args(["-n", "1", "--", "true"]).env("FERROCCL_BIND", "maybe").output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("FERROCCL_BIND=\"maybe\""), "{}", text(&out.stderr));
}
