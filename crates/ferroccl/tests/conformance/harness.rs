//! What every test of the suite stands on: the instantiation's knobs ([`Suite`]), jobs of
//! thread-ranks on a fresh store, and the proptest runner.

use std::fmt::Debug;
use std::io::Write;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use ferroccl::bootstrap::env::StoreRole;
use ferroccl::bootstrap::{new_token, StoreServer};
use ferroccl::{Communicator, InitConfig, Params, TransportChoice};
use proptest::strategy::Strategy;
use proptest::test_runner::{Config as ProptestConfig, TestCaseError, TestRunner};

/// How the ranks of an instantiation are connected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wire {
    Shm,
    Tcp,
    /// tcp with 3 sockets per pair and every write of 4 KiB or more striped over them
    /// (`FERROCCL_TCP_SOCKETS`, `FERROCCL_TCP_STRIPE_MIN`).
    TcpStriped,
    /// tcp with every write of 4 KiB or more sent with `MSG_ZEROCOPY`, and those of 64 KiB
    /// or more also striped over 2 sockets (`FERROCCL_TCP_ZEROCOPY_MIN`).
    TcpZeroCopy,
    /// `auto` with two host ids: shm between ranks on the same "host", tcp across.
    /// Rank r is on host r % 2, except in the point-to-point properties, which draw each
    /// rank's host at random.
    Mixed,
    /// RDMA verbs: only where a device is (see [`verbs_here`]).
    Verbs,
}

/// One instantiation of the suite: a transport and how much work to run over it (case
/// counts, world sizes, message counts and sizes).
#[derive(Clone, Copy, Debug)]
pub struct Suite {
    pub wire: Wire,
    /// Whether promptness is asserted against the wall clock (not in an emulated VM, where
    /// the check is that the error is the right one, not the deadline).
    pub clocks: bool,
    /// Point-to-point: largest world of the random schedules and permutations.
    pub p2p_ranks: usize,
    /// Point-to-point: largest world of the split cases.
    pub split_ranks: usize,
    /// Point-to-point: most messages in one random schedule.
    pub schedule_msgs: usize,
    /// Point-to-point: most `sendrecv` rounds in one permutation case.
    pub perm_rounds: usize,
    /// Proptest cases of the random schedules.
    pub schedule_cases: u32,
    /// Proptest cases of the permutations.
    pub perm_cases: u32,
    /// Proptest cases of split.
    pub split_cases: u32,
    /// Proptest cases of the exact-value collectives (each runs every collective x dtype x
    /// op for two counts).
    pub collective_cases: u32,
    /// Collectives: largest world of the exact-value cases.
    pub collective_ranks: usize,
    /// Collectives: the world sizes of the random-float cases.
    pub float_ranks: &'static [usize],
    /// Collectives: elements (f32) per rank of the large allreduce.
    pub large_count: usize,
    /// Proptest cases of the interleaved non-blocking collectives.
    pub nonblocking_cases: u32,
    /// Runs of each persistent plan in the many-runs test.
    pub plan_runs: usize,
}

impl Wire {
    pub fn transport(self) -> TransportChoice {
        match self {
            Wire::Shm => TransportChoice::Shm,
            Wire::Tcp | Wire::TcpStriped | Wire::TcpZeroCopy => TransportChoice::Tcp,
            Wire::Mixed => TransportChoice::Auto,
            Wire::Verbs => TransportChoice::Verbs,
        }
    }

    /// The defaults with this transport, for a rank on host `host` (only [`Wire::Mixed`]
    /// looks at it); under [`Wire::Verbs`] the environment's RDMA device.
    pub fn params(self, host: usize) -> Params {
        let p = Params { transport: self.transport(), ..Params::default() };
        match self {
            Wire::Shm | Wire::Tcp => p,
            Wire::TcpStriped => Params { tcp_sockets: 3, tcp_stripe_min: 4096, ..p },
            Wire::TcpZeroCopy => Params { tcp_sockets: 2, tcp_stripe_min: 64 << 10, tcp_zerocopy_min: Some(4096), ..p },
            Wire::Mixed => Params { host_id: Some(format!("conformance-host-{host}")), ..p },
            Wire::Verbs => with_ib_env(p),
        }
    }
}

impl Suite {
    /// Whether this instantiation runs here (verbs needs a device); prints why not.
    pub fn here(&self, test: &str) -> bool {
        self.wire != Wire::Verbs || verbs_here(test)
    }

    /// [`Wire::params`] for rank `rank`, on host `rank % 2`.
    pub fn params(&self, rank: usize) -> Params {
        self.wire.params(rank % 2)
    }
}

/// Whether the verbs tests run here: the `verbs` feature and a device named by the
/// environment (the soft-RoCE VM sets `FERROCCL_IB_DEV`). `FERROCCL_VERBS_REQUIRED=1` turns
/// a skip into a failure.
pub fn verbs_here(test: &str) -> bool {
    let required = std::env::var("FERROCCL_VERBS_REQUIRED").is_ok_and(|v| v == "1");
    let here = verbs_device_named();
    assert!(here || !required, "{test}: FERROCCL_VERBS_REQUIRED=1 but no verbs here (feature `verbs` and FERROCCL_IB_DEV needed)");
    if !here {
        eprintln!("{test}: skipped (needs the `verbs` feature and FERROCCL_IB_DEV; see tools/softroce)");
    }
    here
}

/// The `verbs` feature is on and the environment names a device.
pub fn verbs_device_named() -> bool {
    cfg!(feature = "verbs") && std::env::var("FERROCCL_IB_DEV").is_ok_and(|v| !v.is_empty())
}

/// `p` with the environment's RDMA device and GID index (how the VM names them).
pub fn with_ib_env(mut p: Params) -> Params {
    p.ib_dev = std::env::var("FERROCCL_IB_DEV").ok().filter(|v| !v.is_empty());
    p.ib_gid_index = std::env::var("FERROCCL_IB_GID_INDEX").ok().and_then(|v| v.trim().parse().ok());
    p
}

pub type RankResult<R> = std::result::Result<R, String>;

/// Runs one job of `n` thread-ranks: a fresh store, `init_with(params(rank))` on every
/// thread concurrently, then `body(comm)`. Returns each rank's result (init errors and
/// panics included, as `Err`).
pub fn run_world<R: Send>(
    n: usize,
    params: impl Fn(usize) -> Params + Sync,
    body: impl Fn(Communicator) -> RankResult<R> + Sync,
) -> Vec<RankResult<R>> {
    let token = new_token();
    let server = StoreServer::start(fresh_store_bind(), &token, 64 << 20).expect("start store");
    let out = run_world_at(&server, &token, n, params, body);
    server.shutdown();
    out
}

/// A store address no earlier job of this process used: a new loopback IP per job (the whole
/// of 127.0.0.0/8 is local), port 0. Reusing an address (the OS reuses freed ports) trips
/// over the per-(store address, rank) init counter in `comm.rs` when the earlier job had a
/// different world size: see `sequential_jobs_on_one_store_address_with_different_sizes`.
pub fn fresh_store_bind() -> std::net::SocketAddr {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let c = NEXT.fetch_add(1, Ordering::Relaxed);
    let ip = std::net::Ipv4Addr::new(127, 1 + (c / (254 * 256) % 254) as u8, (c / 254 % 256) as u8, (c % 254 + 1) as u8);
    std::net::SocketAddr::new(ip.into(), 0)
}

/// [`run_world`] on a given store.
pub fn run_world_at<R: Send>(
    server: &StoreServer,
    token: &str,
    n: usize,
    params: impl Fn(usize) -> Params + Sync,
    body: impl Fn(Communicator) -> RankResult<R> + Sync,
) -> Vec<RankResult<R>> {
    let addr = server.addr().to_string();
    let watchdog = Watchdog::start(n);
    let out = std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let (token, addr, params, body) = (token.to_string(), addr.clone(), &params, &body);
                std::thread::Builder::new()
                    .name(format!("rank-{rank}"))
                    .spawn_scoped(s, move || {
                        let cfg = InitConfig { rank, world_size: n, store: StoreRole::Connect(addr), token };
                        let comm = Communicator::init_with(cfg, params(rank)).map_err(|e| format!("rank {rank}: init: {e}"))?;
                        body(comm)
                    })
                    .expect("spawn rank thread")
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(r, h)| h.join().unwrap_or_else(|p| Err(format!("rank {r} panicked: {}", panic_text(&p)))))
            .collect::<Vec<_>>()
    });
    watchdog.stop();
    out
}

/// The longest one world of rank threads may run. Every blocking call has a deadline, so
/// a world that runs longer hangs (a deadlock): rank threads cannot be killed, so the
/// test process is aborted, failing the run at once rather than at CI's limit (a
/// self-deadlock in a rank once held a CI run until its 90 minutes were up).
pub const WORLD_LIMIT: Duration = Duration::from_secs(300);

/// Aborts the process if a world is not over within [`WORLD_LIMIT`].
struct Watchdog {
    done: std::sync::mpsc::Sender<()>,
    thread: std::thread::JoinHandle<()>,
}

impl Watchdog {
    fn start(n: usize) -> Watchdog {
        let test = std::thread::current().name().unwrap_or("?").to_string();
        let (done, rx) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::spawn(move || {
            if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(WORLD_LIMIT) {
                // Straight to the process's stderr: the test harness captures `eprintln!`,
                // and an aborted test's capture is never shown.
                let _ = writeln!(
                    std::io::stderr(),
                    "conformance harness: test {test}: a world of {n} rank threads still runs after {WORLD_LIMIT:?} \
                     (every blocking call has a deadline: this is a hang); aborting the test process"
                );
                std::process::abort();
            }
        });
        Watchdog { done, thread }
    }

    fn stop(self) {
        let _ = self.done.send(());
        let _ = self.thread.join();
    }
}

fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default()
}

/// All ranks succeeded, or a description of every failure.
pub fn all_ok<R>(results: Vec<RankResult<R>>) -> std::result::Result<Vec<R>, String> {
    let errs: Vec<String> = results.iter().filter_map(|r| r.as_ref().err().cloned()).collect();
    if errs.is_empty() {
        Ok(results.into_iter().map(|r| r.ok().unwrap()).collect())
    } else {
        Err(errs.join("\n"))
    }
}

/// Deadline of every blocking call in the point-to-point properties: long enough for a
/// loaded 2-core machine, short enough that a hang fails the test in reasonable time.
pub const PROP_TIMEOUT: Duration = Duration::from_secs(20);

/// The longest a failing property may shrink before its case is reported.
pub const SHRINK_TIME: Duration = Duration::from_secs(90);

/// Runs `test` on the cases `config` asks for, drawn from `strategy`; panics with the
/// (shrunk) failing case and its error. Nothing is persisted: a failure worth keeping
/// becomes a test of its own.
///
/// Shrinking is bounded ([`SHRINK_TIME`]): a failing case here is often a call that ran
/// into its deadline, so every shrink step can cost a whole timeout, and unbounded
/// shrinking turned one failure into a suite that ran past the soft-RoCE VM's limit
/// without printing it.
pub fn check_cases<S: Strategy>(config: ProptestConfig, strategy: S, test: impl Fn(S::Value) -> Result<(), String>)
where
    S::Value: Debug,
{
    // 0 is proptest's "no limit".
    let bound = SHRINK_TIME.as_millis() as u32;
    let max_shrink_time = if config.max_shrink_time == 0 { bound } else { config.max_shrink_time.min(bound) };
    let config = ProptestConfig { failure_persistence: None, max_shrink_time, ..config };
    let mut runner = TestRunner::new(config);
    if let Err(e) = runner.run(&strategy, |case| test(case).map_err(TestCaseError::fail)) {
        panic!("{e}\n{runner}");
    }
}
