//! Every `FERROCCL_*` knob, in one place.
//!
//! Each knob is declared once in [`PARAMS`] (name, default, meaning) and read once, into a
//! [`Params`] value, by [`Params::from_env`]. `docs/params.md` lists the same table; a test
//! keeps the two in step. Launcher variables (rank, world size, store, token) are parsed by
//! `bootstrap::env`, but are declared here too so that this module is the whole list.

use std::time::Duration;

use crate::algo::Algo;
use crate::error::{Error, Result};
pub use crate::logging::{DebugLevel, Subsys, SubsysSet};
use crate::transport_kind::TransportKind;

/// One declared knob.
#[derive(Debug, Clone, Copy)]
pub struct Param {
    /// The environment variable.
    pub name: &'static str,
    /// Its default, as written in the docs ("" when there is none).
    pub default: &'static str,
    /// What it does.
    pub doc: &'static str,
}

/// Every knob FerroCCL reads.
pub const PARAMS: &[Param] = &[
    Param { name: "FERROCCL_RANK", default: "", doc: "This process's rank in the job (set by ferroccl-run)." },
    Param { name: "FERROCCL_WORLD_SIZE", default: "", doc: "Number of ranks in the job (set by ferroccl-run)." },
    Param { name: "FERROCCL_LOCAL_RANK", default: "", doc: "Rank among the ranks on this host (set by ferroccl-run; informational)." },
    Param { name: "FERROCCL_LOCAL_WORLD_SIZE", default: "", doc: "Number of ranks on this host (set by ferroccl-run; informational)." },
    Param { name: "FERROCCL_STORE", default: "", doc: "host:port of the bootstrap store (set by ferroccl-run). Under torchrun, Slurm or Open MPI it is served by rank 0 at this address, or else at MASTER_ADDR:(MASTER_PORT+1) (torchrun's own store holds MASTER_PORT)." },
    Param { name: "FERROCCL_TOKEN", default: "", doc: "The job's secret token; every store and mesh connection proves it knows it. ferroccl-run makes a fresh one per job." },
    Param { name: "FERROCCL_LAUNCHER_PID", default: "", doc: "Pid of the launcher (set by ferroccl-run); ranks fail promptly if it dies." },
    Param { name: "FERROCCL_TRANSPORT", default: "auto", doc: "auto, shm, tcp or verbs. auto: shm between ranks on the same host; verbs to other hosts when both ends have a usable RDMA device (and the build has the `verbs` feature), tcp otherwise. shm: fail if a peer is on another host. verbs: RDMA verbs to every peer (same host too); an error if there is no device or the build lacks the `verbs` feature." },
    Param { name: "FERROCCL_IB_DEV", default: "", doc: "RDMA device the verbs transport opens (e.g. mlx5_0, rxe0). Default: the first device that libibverbs lists." },
    Param { name: "FERROCCL_IB_TIMEOUT", default: "18", doc: "Verbs ACK timeout exponent (as NCCL_IB_TIMEOUT): a work request is retried after 4.096 us x 2^T without an acknowledgement, 7 tries in all, then fails; so a dead peer on another host is noticed after about 7 x 4.096 us x 2^T (18: about 7.5 s). 1 to 31." },
    Param { name: "FERROCCL_IB_GID_INDEX", default: "", doc: "GID table index of port 1 used as the source address (RoCE v2: the entry holding the netdev's IPv4 address). Default: the first IPv4-mapped GID of the port, else index 0 (InfiniBand)." },
    Param { name: "FERROCCL_TIMEOUT", default: "300", doc: "Seconds any blocking call may wait (store, connect, send, recv, barrier) before it fails with a timeout error." },
    Param { name: "FERROCCL_HOST_ID", default: "", doc: "Overrides this host's identity used to find ranks on the same host (as NCCL_HOSTID). Default: boot id + mount and pid namespaces." },
    Param { name: "FERROCCL_SOCKET_ADDR", default: "", doc: "IP address the TCP transport listens on and advertises. Default: an address of FERROCCL_SOCKET_IFNAME's interfaces if set, else the local address of the connection to the store." },
    Param { name: "FERROCCL_SOCKET_IFNAME", default: "", doc: "Interfaces the TCP transport may listen on, in NCCL_SOCKET_IFNAME's syntax: comma-separated name prefixes (eth,ib), `=` before the list for exact names (=eth0), `^` to exclude (^lo,docker; ^=lo). The first up interface that matches gives the address (its first IPv4 one, else its IPv6 one; link-local IPv6 left out); none matching is an error that lists the host's interfaces. FERROCCL_SOCKET_ADDR wins over it. Default: the local address of the connection to the store." },
    Param { name: "FERROCCL_TCP_SOCKETS", default: "1", doc: "TCP connections per pair of ranks (1 to 16; a pair uses the smaller of its two ranks' values). With more than one, one-sided writes of at least FERROCCL_TCP_STRIPE_MIN bytes (the chunks of large collectives and of rendezvous transfers) are cut into one piece per connection, written side by side without waiting on any one of them and received each on its own thread; messages and smaller writes keep the first connection. 1 by default: on this project's machine (2 CPUs, loopback) more connections gained nothing (see docs/params.md); raise it where one TCP flow cannot fill the link and a rank has cores to spare." },
    Param { name: "FERROCCL_TCP_STRIPE_MIN", default: "262144", doc: "Smallest one-sided write (bytes) cut across the FERROCCL_TCP_SOCKETS connections of a pair; each piece is at least 4 KiB." },
    Param { name: "FERROCCL_TCP_ZEROCOPY_MIN", default: "0", doc: "Smallest one-sided write (bytes) the TCP transport sends with MSG_ZEROCOPY (the kernel sends from the buffer's pinned pages instead of copying them; the write returns once the kernel has let go of them, which takes the peer's acknowledgement). 0: never. Off by default: over loopback the kernel copies anyway, and waiting for the acknowledgement made transfers 3-6x slower (see docs/params.md); it can pay only on a NIC with scatter-gather, for large writes. Pages that cannot be pinned (the memlock limit) are sent the usual way." },
    Param { name: "FERROCCL_SHM_RING_BYTES", default: "1048576", doc: "Bytes of each per-peer shared-memory ring (eager data and control messages)." },
    Param { name: "FERROCCL_SHM_INLINE_MAX", default: "16384", doc: "Largest one-sided write copied through the ring; larger ones are single-copied (process_vm_readv) when allowed." },
    Param { name: "FERROCCL_SHM_CMA", default: "0", doc: "1: large shm writes are single-copied by the receiver with process_vm_readv (cross-memory attach) when the kernel allows it; 0: they are copied through the ring in chunks. Off by default: measured slower for collectives on this project's machine (see docs/params.md)." },
    Param { name: "FERROCCL_EAGER_MAX", default: "65536", doc: "Largest point-to-point message sent eagerly (one copy through the transport's slots); larger messages use rendezvous (zero copy into the receiver's buffer). Also the largest one-sided write to a window over verbs that is copied through messages to its owner; larger ones are RDMA WRITEs from their registered source." },
    Param { name: "FERROCCL_ALGO", default: "auto", doc: "Collective algorithm: auto (cost model), ring, mesh, oneshot, chain, bruck (allreduce, allgather), binomial (broadcast), pairwise (alltoallv only) or ll (the low-latency protocol on shared memory, for communicators whose ranks are all on one host, up to FERROCCL_LL_MAX_BYTES); ^ll: never ll. A name applies to the collectives it implements (and, for ll, fit its slots); the others keep the cost model's choice. Must be the same on every rank (alltoallv alone tolerates mesh on some ranks and pairwise on others)." },
    Param { name: "FERROCCL_PROTO", default: "auto", doc: "Protocol for collective transfers: auto (the low-latency protocol where the cost model picks it; else eager up to FERROCCL_EAGER_MAX, rendezvous above), eager (every chunk through the transport's slots), rendezvous (every chunk written straight into the receiver's buffer), ll (the low-latency protocol for every call that fits its slots, auto for the others) or ^ll (never the low-latency protocol). Must be the same on every rank." },
    Param { name: "FERROCCL_LL_MAX_BYTES", default: "262144", doc: "Bytes of each of the two low-latency data slots a rank keeps per communicator whose ranks are all on one host, beside 130 header lines (16.25 KiB; each rank maps every member's): the largest contribution a low-latency call carries (allreduce, broadcast, reduce, allgather: the message; reduce_scatter, alltoall: ranks x the block). 0: no slots, no low-latency protocol. Must be the same on every rank." },
    Param { name: "FERROCCL_SPIN_US", default: "auto", doc: "Microseconds a waiting low-latency call spins before it yields the CPU and then sleeps. auto: 50 when every rank of the host has a CPU of its own, 0 when ranks share CPUs (spinning there takes the CPU from the rank being waited for); then it yields for up to 500 us (50 us when ranks share CPUs) and sleeps on its doorbell." },
    Param { name: "FERROCCL_REDUCE_THREADS", default: "auto", doc: "Threads a rank's local reductions and copies of large pieces run on (the calling thread and a pool of its own; results are bit-identical to one thread's). auto: the CPUs this process may run on divided by the ranks on this machine (ranks sharing its host name), at least 1: a rank that owns a host with many cores uses them, ranks that share cores never oversubscribe them. 1 to 256." },
    Param { name: "FERROCCL_REDUCE_PAR_MIN", default: "262144", doc: "Smallest local reduction or copy (bytes) that runs on several threads when FERROCCL_REDUCE_THREADS allows more than one; smaller ones stay on the calling thread (handing out the pieces costs more than it saves: measured, f32, 2 threads against 1, 64 KiB 2.7x slower, 256 KiB 0.71x, 1 MiB 0.62x, 4 MiB to 256 MiB 0.51-0.56x; `cargo run --release -p ferroccl-kernels --example par_ab`)." },
    Param { name: "FERROCCL_CHUNK_BYTES", default: "524288", doc: "Largest piece a collective moves at once; larger blocks are cut into chunks that flow in a pipeline (power of two, 4 KiB to 1 GiB)." },
    Param { name: "FERROCCL_SLOTS", default: "4", doc: "Chunks in flight per peer in the pipelined collective algorithms (mesh, in-place ring): the pipeline's depth, and the scratch memory it needs (slots x FERROCCL_CHUNK_BYTES per peer). 1 to 64. Must be the same on every rank." },
    Param { name: "FERROCCL_STORE_MAX_VALUE", default: "67108864", doc: "Largest value (bytes) the bootstrap store accepts; larger set requests are refused." },
    Param { name: "FERROCCL_REG_CACHE_ENTRIES", default: "256", doc: "Registrations the registration cache keeps (keyed by address range; least recently used are evicted first, never one in use). Repeated calls on the same buffer reuse its registration." },
    Param { name: "FERROCCL_DEBUG", default: "0", doc: "Logs, as NCCL_DEBUG: 0 (none), WARN (failures and their culprits, paths given up), INFO (also setup: transports, addresses, knobs set; and each call's first occurrence: algorithm, protocol, chunks, the cost model's estimates), TRACE (also every call and registration); 1 means INFO. Records go through the `log` crate (targets ferroccl::init, ::transport, ::coll, ::plan, ::reg, ::health) to the application's logger; where it installed none, the first communicator installs one that writes them to stderr as `ferroccl LEVEL subsys: message`." },
    Param { name: "FERROCCL_DEBUG_SUBSYS", default: "all", doc: "Subsystems whose records FerroCCL's stderr logger writes, as NCCL_DEBUG_SUBSYS: comma-separated names among init, transport, coll, plan, reg, health (or all); a leading ^ excludes the list (^reg,plan)." },
    Param { name: "FERROCCL_FLIGHT_RECORDER", default: "stderr", doc: "Where a rank writes its flight record (each communicator's last FERROCCL_FLIGHT_ENTRIES calls: number, collective, dtype, count, algorithm, done or pending) when a call fails for good (a fatal error, a timeout): stderr, a path prefix (the record goes to PREFIX<launch rank>.<pid>, made exclusively with mode 0600: a file or symbolic link already there is never followed or overwritten; one line on stderr says so), or off (none written; the last 16 calls are still kept, as they answer the peers' probes). ferroccl-run reads the records and names the first call the ranks parted at and who never reached it." },
    Param { name: "FERROCCL_FLIGHT_ENTRIES", default: "64", doc: "Calls each communicator's flight recorder keeps, rounded up to a power of two, at least 16 (up to 65536). Recording is a few stores per call into memory of its own (no clock)." },
];

/// The protocol of collective transfers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProtoChoice {
    /// Eager up to `FERROCCL_EAGER_MAX`, rendezvous above.
    Auto,
    /// Every chunk eager (bounded by the transport's slot size).
    Eager,
    /// Every chunk by rendezvous.
    Rendezvous,
}

/// Whether collectives may use the low-latency protocol on shared memory
/// (`FERROCCL_PROTO=ll|^ll`, `FERROCCL_ALGO=ll|^ll`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LlChoice {
    /// Where the cost model picks it.
    Auto,
    /// For every call that fits its slots.
    Force,
    /// Never.
    Off,
}

/// Which transport to use between ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransportChoice {
    /// shm on the same host; verbs to other hosts where both ends have an RDMA device;
    /// tcp otherwise.
    Auto,
    /// shm only (an error if a peer is on another host).
    Shm,
    /// tcp for every peer.
    Tcp,
    /// RDMA verbs for every peer (an error without a device or the `verbs` feature).
    Verbs,
}

impl TransportChoice {
    /// The transport this choice names (`None`: `auto`, the transports' own preference).
    pub(crate) fn named(self) -> Option<TransportKind> {
        match self {
            TransportChoice::Auto => None,
            TransportChoice::Shm => Some(TransportKind::Shm),
            TransportChoice::Tcp => Some(TransportKind::Tcp),
            TransportChoice::Verbs => Some(TransportKind::Verbs),
        }
    }

    /// Parses `auto`, `shm`, `tcp` or `verbs`.
    pub fn parse(s: &str) -> Option<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" | "" => Some(TransportChoice::Auto),
            "shm" => Some(TransportChoice::Shm),
            "tcp" => Some(TransportChoice::Tcp),
            "verbs" | "ib" | "rdma" => Some(TransportChoice::Verbs),
            _ => None,
        }
    }
}

/// `FERROCCL_SOCKET_IFNAME`, in `NCCL_SOCKET_IFNAME`'s syntax: a comma-separated list of
/// interface names, prefixes unless the list starts with `=` (exact names), selecting
/// unless it starts with `^` (excluding; `^=` excludes exact names).
///
/// ```
/// use ferroccl::params::IfnameFilter;
///
/// let f = IfnameFilter::parse("^lo,docker").unwrap();
/// assert!(f.matches("eth0") && !f.matches("lo") && !f.matches("docker0"));
/// let f = IfnameFilter::parse("=eth0").unwrap();
/// assert!(f.matches("eth0") && !f.matches("eth01"));
/// assert_eq!(f.to_string(), "=eth0");
/// assert!(IfnameFilter::parse("^").is_none());
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IfnameFilter {
    /// `^`: the names are excluded, every other interface matches.
    pub exclude: bool,
    /// `=`: the names are exact, not prefixes.
    pub exact: bool,
    /// The names (or prefixes), none empty.
    pub names: Vec<String>,
}

impl IfnameFilter {
    /// Parses the variable's value; `None` when it names nothing.
    pub fn parse(v: &str) -> Option<IfnameFilter> {
        let v = v.trim();
        let (exclude, v) = v.strip_prefix('^').map_or((false, v), |r| (true, r));
        let (exact, v) = v.strip_prefix('=').map_or((false, v), |r| (true, r));
        let names: Vec<String> = v.split(',').map(str::trim).filter(|n| !n.is_empty()).map(str::to_string).collect();
        (!names.is_empty()).then_some(IfnameFilter { exclude, exact, names })
    }

    /// Whether interface `name` is one the filter selects.
    pub fn matches(&self, name: &str) -> bool {
        let listed = self.names.iter().any(|n| if self.exact { name == n } else { name.starts_with(n.as_str()) });
        listed != self.exclude
    }
}

impl std::fmt::Display for IfnameFilter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (x, e) = (if self.exclude { "^" } else { "" }, if self.exact { "=" } else { "" });
        write!(f, "{x}{e}{}", self.names.join(","))
    }
}

/// The knobs that shape a communicator, read from the environment or set by hand.
#[derive(Clone, Debug)]
pub struct Params {
    /// `FERROCCL_TRANSPORT`.
    pub transport: TransportChoice,
    /// `FERROCCL_TIMEOUT`.
    pub timeout: Duration,
    /// `FERROCCL_HOST_ID`.
    pub host_id: Option<String>,
    /// `FERROCCL_SOCKET_ADDR`.
    pub socket_addr: Option<std::net::IpAddr>,
    /// `FERROCCL_SOCKET_IFNAME`.
    pub socket_ifname: Option<IfnameFilter>,
    /// `FERROCCL_TCP_SOCKETS`: connections per pair of ranks.
    pub tcp_sockets: usize,
    /// `FERROCCL_TCP_STRIPE_MIN`.
    pub tcp_stripe_min: usize,
    /// `FERROCCL_TCP_ZEROCOPY_MIN`: `None` for never.
    pub tcp_zerocopy_min: Option<usize>,
    /// `FERROCCL_SHM_RING_BYTES`.
    pub shm_ring_bytes: usize,
    /// `FERROCCL_SHM_INLINE_MAX`.
    pub shm_inline_max: usize,
    /// `FERROCCL_SHM_CMA`.
    pub shm_cma: bool,
    /// `FERROCCL_EAGER_MAX`.
    pub eager_max: usize,
    /// `FERROCCL_LAUNCHER_PID`.
    pub launcher_pid: Option<i32>,
    /// `FERROCCL_DEBUG`.
    pub debug: DebugLevel,
    /// `FERROCCL_DEBUG_SUBSYS`.
    pub debug_subsys: SubsysSet,
    /// `FERROCCL_FLIGHT_RECORDER`.
    pub flight_recorder: FlightDest,
    /// `FERROCCL_FLIGHT_ENTRIES`.
    pub flight_entries: usize,
    /// `FERROCCL_STORE_MAX_VALUE` (read by whoever serves the store).
    pub store_max_value: usize,
    /// `FERROCCL_ALGO`: `None` for the cost model, else the algorithm to use for the
    /// collectives it implements (the others keep the cost model's choice).
    pub algo: Option<Algo>,
    /// `FERROCCL_PROTO`.
    pub proto: ProtoChoice,
    /// `FERROCCL_PROTO=ll|^ll` or `FERROCCL_ALGO=ll|^ll`.
    pub ll: LlChoice,
    /// `FERROCCL_LL_MAX_BYTES`: data bytes of each low-latency slot (0: none).
    pub ll_max_bytes: usize,
    /// `FERROCCL_SPIN_US`: `None` for the default of the machine's case.
    pub spin_us: Option<u64>,
    /// `FERROCCL_REDUCE_THREADS`: `None` for auto (the CPUs this process may run on divided
    /// by the ranks on this machine, at least 1).
    pub reduce_threads: Option<usize>,
    /// `FERROCCL_REDUCE_PAR_MIN`.
    pub reduce_par_min: usize,
    /// `FERROCCL_CHUNK_BYTES`.
    pub chunk_bytes: usize,
    /// `FERROCCL_SLOTS`.
    pub slots: usize,
    /// `FERROCCL_REG_CACHE_ENTRIES`.
    pub reg_cache_entries: usize,
    /// `FERROCCL_IB_DEV`: `None` for the first device.
    pub ib_dev: Option<String>,
    /// `FERROCCL_IB_GID_INDEX`: `None` for the first IPv4-mapped GID (else 0).
    pub ib_gid_index: Option<u8>,
    /// `FERROCCL_IB_TIMEOUT`: the verbs ACK timeout exponent.
    pub ib_timeout: u8,
    /// `FERROCCL_INJECT_FAULT`: for FerroCCL's own tests, a fault to inject.
    pub inject_fault: Option<InjectedFault>,
}

/// Where a rank writes its flight record (`FERROCCL_FLIGHT_RECORDER`; see [`crate::flight`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FlightDest {
    /// Calls are not recorded.
    Off,
    /// To stderr (the default).
    Stderr,
    /// To the file `PREFIX<launch rank>.<pid>` (a path prefix), made exclusively.
    Files(std::path::PathBuf),
}

/// Where `FERROCCL_INJECT_FAULT` makes a rank fail, as an internal error, in the middle of
/// a transfer (after the call has started and its peers may be waiting for it), or die
/// during a shrink. For FerroCCL's own tests: they check that such a failure reaches every
/// rank at once.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultSite {
    /// Reading an eager send's source buffer (`send-source`).
    SendSource,
    /// Copying an eager message into the receive buffer (`recv-buffer`).
    RecvBuffer,
    /// A local reduction step of a collective's schedule (`reduce-step`).
    ReduceStep,
    /// Copying a fused group's results back into the callers' buffers (`fused-copy`).
    FusedCopy,
    /// In [`crate::Communicator::shrink`], right after the survivors decided the new
    /// membership (this rank in it): the process dies (aborts), as a second failure during
    /// recovery (`shrink`).
    Shrink,
    /// In [`crate::Communicator::shrink`], once this rank's connections of the shrunk
    /// communicator are up, before the survivors confirm it: the process dies (aborts)
    /// (`shrink-built`).
    ShrinkBuilt,
}

impl FaultSite {
    /// The sites and their names in `FERROCCL_INJECT_FAULT`.
    pub const ALL: [(FaultSite, &'static str); 6] = [
        (FaultSite::SendSource, "send-source"),
        (FaultSite::RecvBuffer, "recv-buffer"),
        (FaultSite::ReduceStep, "reduce-step"),
        (FaultSite::FusedCopy, "fused-copy"),
        (FaultSite::Shrink, "shrink"),
        (FaultSite::ShrinkBuilt, "shrink-built"),
    ];
}

/// A fault injected at `site` on world rank `rank` (`FERROCCL_INJECT_FAULT=site@rank`),
/// every time the rank gets there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InjectedFault {
    /// Where.
    pub site: FaultSite,
    /// On which world rank.
    pub rank: usize,
}

impl Default for Params {
    fn default() -> Self {
        Params {
            transport: TransportChoice::Auto,
            timeout: Duration::from_secs(300),
            host_id: None,
            socket_addr: None,
            socket_ifname: None,
            tcp_sockets: 1,
            tcp_stripe_min: 256 << 10,
            tcp_zerocopy_min: None,
            shm_ring_bytes: 1 << 20,
            shm_inline_max: 16 << 10,
            shm_cma: false,
            eager_max: 64 << 10,
            launcher_pid: None,
            debug: DebugLevel::Off,
            debug_subsys: SubsysSet::ALL,
            flight_recorder: FlightDest::Stderr,
            flight_entries: 64,
            store_max_value: 64 << 20,
            algo: None,
            proto: ProtoChoice::Auto,
            ll: LlChoice::Auto,
            ll_max_bytes: 256 << 10,
            spin_us: None,
            reduce_threads: None,
            reduce_par_min: 256 << 10,
            chunk_bytes: 512 << 10,
            slots: 4,
            reg_cache_entries: 256,
            ib_dev: None,
            ib_gid_index: None,
            ib_timeout: 18,
            inject_fault: None,
        }
    }
}

fn parse_num<T: std::str::FromStr>(var: &str, v: &str) -> Result<T> {
    v.trim().parse().map_err(|_| Error::Env { var: var.into(), problem: format!("{v:?} is not a valid number") })
}

impl Params {
    /// Reads every knob from the process environment.
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Reads every knob through `get` (a test can pass a map instead of the environment).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let mut p = Params::default();
        let get = |k: &str| get(k).filter(|v| !v.trim().is_empty());
        if let Some(v) = get("FERROCCL_TRANSPORT") {
            p.transport = TransportChoice::parse(&v).ok_or_else(|| Error::Env {
                var: "FERROCCL_TRANSPORT".into(),
                problem: format!("{v:?} is not one of auto, shm, tcp, verbs"),
            })?;
        }
        p.ib_dev = get("FERROCCL_IB_DEV").map(|v| v.trim().to_string());
        if let Some(v) = get("FERROCCL_IB_GID_INDEX") {
            p.ib_gid_index = Some(parse_num("FERROCCL_IB_GID_INDEX", &v)?);
        }
        if let Some(v) = get("FERROCCL_IB_TIMEOUT") {
            p.ib_timeout = parse_num("FERROCCL_IB_TIMEOUT", &v)?;
            if !(1..=31).contains(&p.ib_timeout) {
                return Err(Error::Env { var: "FERROCCL_IB_TIMEOUT".into(), problem: format!("{v:?} must be between 1 and 31") });
            }
        }
        if let Some(v) = get("FERROCCL_TIMEOUT") {
            let secs: f64 = parse_num("FERROCCL_TIMEOUT", &v)?;
            if !(secs > 0.0 && secs.is_finite() && secs <= 365.0 * 24.0 * 3600.0) {
                return Err(Error::Env { var: "FERROCCL_TIMEOUT".into(), problem: format!("{v:?} must be a positive number of seconds") });
            }
            p.timeout = Duration::from_secs_f64(secs);
        }
        p.host_id = get("FERROCCL_HOST_ID");
        if let Some(v) = get("FERROCCL_SOCKET_ADDR") {
            p.socket_addr = Some(
                v.trim()
                    .parse()
                    .map_err(|_| Error::Env { var: "FERROCCL_SOCKET_ADDR".into(), problem: format!("{v:?} is not an IP address") })?,
            );
        }
        if let Some(v) = get("FERROCCL_SOCKET_IFNAME") {
            p.socket_ifname = Some(IfnameFilter::parse(&v).ok_or_else(|| Error::Env {
                var: "FERROCCL_SOCKET_IFNAME".into(),
                problem: format!("{v:?} names no interface (want e.g. eth, =eth0, ^lo,docker)"),
            })?);
        }
        if let Some(v) = get("FERROCCL_SHM_RING_BYTES") {
            p.shm_ring_bytes = parse_num("FERROCCL_SHM_RING_BYTES", &v)?;
            if !(4096..=(1 << 30)).contains(&p.shm_ring_bytes) || !p.shm_ring_bytes.is_power_of_two() {
                return Err(Error::Env {
                    var: "FERROCCL_SHM_RING_BYTES".into(),
                    problem: format!("{v:?} must be a power of two between 4096 and 1 GiB"),
                });
            }
        }
        if let Some(v) = get("FERROCCL_SHM_INLINE_MAX") {
            p.shm_inline_max = parse_num("FERROCCL_SHM_INLINE_MAX", &v)?;
        }
        if let Some(v) = get("FERROCCL_SHM_CMA") {
            p.shm_cma = parse_bool("FERROCCL_SHM_CMA", &v)?;
        }
        if let Some(v) = get("FERROCCL_EAGER_MAX") {
            p.eager_max = parse_num("FERROCCL_EAGER_MAX", &v)?;
        }
        if let Some(v) = get("FERROCCL_LAUNCHER_PID") {
            p.launcher_pid = Some(parse_num("FERROCCL_LAUNCHER_PID", &v)?);
        }
        if let Some(v) = get("FERROCCL_STORE_MAX_VALUE") {
            p.store_max_value = parse_num("FERROCCL_STORE_MAX_VALUE", &v)?;
            if p.store_max_value == 0 {
                return Err(Error::Env { var: "FERROCCL_STORE_MAX_VALUE".into(), problem: "must be a positive number of bytes".into() });
            }
        }
        if let Some(v) = get("FERROCCL_REG_CACHE_ENTRIES") {
            p.reg_cache_entries = parse_num("FERROCCL_REG_CACHE_ENTRIES", &v)?;
        }
        if let Some(v) = get("FERROCCL_ALGO") {
            if v.trim().eq_ignore_ascii_case("^ll") {
                p.ll = LlChoice::Off;
            } else if !v.trim().eq_ignore_ascii_case("auto") {
                let Some(algo) = Algo::parse(&v) else {
                    let names: Vec<&str> = Algo::ALL.iter().map(|a| a.name()).collect();
                    let problem = format!("{v:?} is not one of auto, {}, ^ll", names.join(", "));
                    return Err(Error::Env { var: "FERROCCL_ALGO".into(), problem });
                };
                p.algo = Some(algo);
            }
        }
        if let Some(v) = get("FERROCCL_PROTO") {
            match v.trim().to_ascii_lowercase().as_str() {
                "auto" => p.proto = ProtoChoice::Auto,
                "eager" | "simple" => p.proto = ProtoChoice::Eager,
                "rendezvous" | "rndv" => p.proto = ProtoChoice::Rendezvous,
                "ll" => p.ll = LlChoice::Force,
                "^ll" => p.ll = LlChoice::Off,
                _ => {
                    return Err(Error::Env {
                        var: "FERROCCL_PROTO".into(),
                        problem: format!("{v:?} is not one of auto, eager, rendezvous, ll, ^ll"),
                    })
                }
            }
        }
        if let Some(v) = get("FERROCCL_LL_MAX_BYTES") {
            p.ll_max_bytes = parse_num("FERROCCL_LL_MAX_BYTES", &v)?;
            if p.ll_max_bytes > 64 << 20 {
                return Err(Error::Env { var: "FERROCCL_LL_MAX_BYTES".into(), problem: format!("{v:?} must be at most 64 MiB") });
            }
        }
        if let Some(v) = get("FERROCCL_SPIN_US") {
            if !v.trim().eq_ignore_ascii_case("auto") {
                let us: u64 = parse_num("FERROCCL_SPIN_US", &v)?;
                if us > 1_000_000 {
                    return Err(Error::Env { var: "FERROCCL_SPIN_US".into(), problem: format!("{v:?} must be at most 1000000 (1 s)") });
                }
                p.spin_us = Some(us);
            }
        }
        if let Some(v) = get("FERROCCL_REDUCE_THREADS") {
            if !v.trim().eq_ignore_ascii_case("auto") {
                let t: usize = parse_num("FERROCCL_REDUCE_THREADS", &v)?;
                if !(1..=256).contains(&t) {
                    return Err(Error::Env { var: "FERROCCL_REDUCE_THREADS".into(), problem: format!("{v:?} must be auto or 1 to 256") });
                }
                p.reduce_threads = Some(t);
            }
        }
        if let Some(v) = get("FERROCCL_TCP_SOCKETS") {
            p.tcp_sockets = parse_num("FERROCCL_TCP_SOCKETS", &v)?;
            if !(1..=16).contains(&p.tcp_sockets) {
                return Err(Error::Env { var: "FERROCCL_TCP_SOCKETS".into(), problem: format!("{v:?} must be between 1 and 16") });
            }
        }
        if let Some(v) = get("FERROCCL_TCP_STRIPE_MIN") {
            p.tcp_stripe_min = parse_num("FERROCCL_TCP_STRIPE_MIN", &v)?;
        }
        if let Some(v) = get("FERROCCL_TCP_ZEROCOPY_MIN") {
            let n: usize = parse_num("FERROCCL_TCP_ZEROCOPY_MIN", &v)?;
            p.tcp_zerocopy_min = (n > 0).then_some(n);
        }
        if let Some(v) = get("FERROCCL_REDUCE_PAR_MIN") {
            p.reduce_par_min = parse_num("FERROCCL_REDUCE_PAR_MIN", &v)?;
        }
        if let Some(v) = get("FERROCCL_CHUNK_BYTES") {
            p.chunk_bytes = parse_num("FERROCCL_CHUNK_BYTES", &v)?;
            if !(4096..=(1 << 30)).contains(&p.chunk_bytes) || !p.chunk_bytes.is_power_of_two() {
                return Err(Error::Env {
                    var: "FERROCCL_CHUNK_BYTES".into(),
                    problem: format!("{v:?} must be a power of two between 4096 and 1 GiB"),
                });
            }
        }
        if let Some(v) = get("FERROCCL_SLOTS") {
            p.slots = parse_num("FERROCCL_SLOTS", &v)?;
            if !(1..=64).contains(&p.slots) {
                return Err(Error::Env { var: "FERROCCL_SLOTS".into(), problem: format!("{v:?} must be between 1 and 64") });
            }
        }
        if let Some(v) = get("FERROCCL_INJECT_FAULT") {
            let bad = || Error::Env {
                var: "FERROCCL_INJECT_FAULT".into(),
                problem: format!(
                    "{v:?} is not SITE@RANK with SITE one of {}",
                    FaultSite::ALL.iter().map(|(_, n)| *n).collect::<Vec<_>>().join(", ")
                ),
            };
            let (site, rank) = v.trim().split_once('@').ok_or_else(bad)?;
            let site = FaultSite::ALL.iter().find(|(_, n)| *n == site).map(|(s, _)| *s).ok_or_else(bad)?;
            p.inject_fault = Some(InjectedFault { site, rank: rank.parse().map_err(|_| bad())? });
        }
        if let Some(v) = get("FERROCCL_DEBUG") {
            p.debug = DebugLevel::parse(&v).ok_or_else(|| Error::Env {
                var: "FERROCCL_DEBUG".into(),
                problem: format!("{v:?} is not one of 0, WARN, INFO, TRACE (1 means INFO)"),
            })?;
        }
        if let Some(v) = get("FERROCCL_FLIGHT_RECORDER") {
            p.flight_recorder = match v.trim() {
                "" | "stderr" => FlightDest::Stderr,
                x if x.eq_ignore_ascii_case("off") || x == "0" => FlightDest::Off,
                prefix => FlightDest::Files(prefix.into()),
            };
        }
        if let Some(v) = get("FERROCCL_FLIGHT_ENTRIES") {
            p.flight_entries = parse_num("FERROCCL_FLIGHT_ENTRIES", &v)?;
            if p.flight_entries > 65536 {
                return Err(Error::Env { var: "FERROCCL_FLIGHT_ENTRIES".into(), problem: format!("{v:?} must be at most 65536") });
            }
        }
        if let Some(v) = get("FERROCCL_DEBUG_SUBSYS") {
            p.debug_subsys = SubsysSet::parse(&v).map_err(|problem| Error::Env { var: "FERROCCL_DEBUG_SUBSYS".into(), problem })?;
        }
        Ok(p)
    }
}

impl Params {
    /// The threads of a rank's local reductions (`FERROCCL_REDUCE_THREADS`): as set, or for
    /// auto the CPUs this process may run on divided by `ranks_on_machine`, at least 1.
    pub(crate) fn reduce_threads_here(&self, ranks_on_machine: usize) -> usize {
        self.reduce_threads.unwrap_or_else(|| {
            let cpus = std::thread::available_parallelism().map_or(1, usize::from);
            (cpus / ranks_on_machine.max(1)).max(1)
        })
    }

    /// Whether `FERROCCL_INJECT_FAULT` asks world rank `rank` to fail at `site`.
    pub(crate) fn injects(&self, site: FaultSite, rank: usize) -> bool {
        self.inject_fault.is_some_and(|f| f.site == site && f.rank == rank)
    }

    /// Checks values set by hand (from_env already checks what it reads).
    pub fn validate(&self) -> Result<()> {
        let bad = |what: String| Err(Error::InvalidArgument(format!("Params: {what}")));
        if !(4096..=(1 << 30)).contains(&self.shm_ring_bytes) || !self.shm_ring_bytes.is_power_of_two() {
            return bad(format!("shm_ring_bytes {} must be a power of two between 4096 and 1 GiB", self.shm_ring_bytes));
        }
        if self.timeout.is_zero() || self.timeout > Duration::from_secs(365 * 24 * 3600) {
            return bad(format!("timeout {:?} must be positive and at most a year", self.timeout));
        }
        if self.store_max_value == 0 {
            return bad("store_max_value must be positive".into());
        }
        if self.reg_cache_entries == 0 {
            return bad("reg_cache_entries must be at least 1".into());
        }
        if !(4096..=(1 << 30)).contains(&self.chunk_bytes) || !self.chunk_bytes.is_power_of_two() {
            return bad(format!("chunk_bytes {} must be a power of two between 4096 and 1 GiB", self.chunk_bytes));
        }
        if !(1..=64).contains(&self.slots) {
            return bad(format!("slots {} must be between 1 and 64", self.slots));
        }
        if !(1..=31).contains(&self.ib_timeout) {
            return bad(format!("ib_timeout {} must be between 1 and 31", self.ib_timeout));
        }
        if self.ll_max_bytes > 64 << 20 {
            return bad(format!("ll_max_bytes {} must be at most 64 MiB", self.ll_max_bytes));
        }
        if self.spin_us.is_some_and(|us| us > 1_000_000) {
            return bad("spin_us must be at most 1000000 (1 s)".into());
        }
        if self.flight_entries > 65536 {
            return bad(format!("flight_entries {} must be at most 65536", self.flight_entries));
        }
        if self.reduce_threads.is_some_and(|t| !(1..=256).contains(&t)) {
            return bad("reduce_threads must be 1 to 256".into());
        }
        Ok(())
    }
}

fn parse_bool(var: &str, v: &str) -> Result<bool> {
    match v.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(Error::Env { var: var.into(), problem: format!("{v:?} is not 0 or 1") }),
    }
}

/// The value of `FERROCCL_TIMEOUT` (or its default) for callers outside a communicator.
pub fn timeout_from_env() -> Result<Duration> {
    Params::from_env().map(|p| p.timeout)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn with(pairs: &[(&str, &str)]) -> Result<Params> {
        let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Params::from_lookup(|k| m.get(k).cloned())
    }

    #[test]
    fn defaults_match_the_declared_table() {
        let p = with(&[]).unwrap();
        let d = |n: &str| PARAMS.iter().find(|p| p.name == n).unwrap().default;
        assert_eq!(p.timeout.as_secs().to_string(), d("FERROCCL_TIMEOUT"));
        assert_eq!(p.shm_ring_bytes.to_string(), d("FERROCCL_SHM_RING_BYTES"));
        assert_eq!(p.shm_inline_max.to_string(), d("FERROCCL_SHM_INLINE_MAX"));
        assert_eq!(p.eager_max.to_string(), d("FERROCCL_EAGER_MAX"));
        assert_eq!(p.store_max_value.to_string(), d("FERROCCL_STORE_MAX_VALUE"));
        assert_eq!(p.chunk_bytes.to_string(), d("FERROCCL_CHUNK_BYTES"));
        assert_eq!(p.slots.to_string(), d("FERROCCL_SLOTS"));
        assert_eq!(p.ll_max_bytes.to_string(), d("FERROCCL_LL_MAX_BYTES"));
        assert_eq!((p.ll, p.spin_us), (LlChoice::Auto, None));
        assert_eq!((p.reduce_threads, p.reduce_par_min.to_string().as_str()), (None, d("FERROCCL_REDUCE_PAR_MIN")));
        assert_eq!(with(&[("FERROCCL_REDUCE_THREADS", "4")]).unwrap().reduce_threads, Some(4));
        assert_eq!(with(&[("FERROCCL_REDUCE_THREADS", "auto")]).unwrap().reduce_threads, None);
        assert!(with(&[("FERROCCL_REDUCE_THREADS", "0")]).is_err());
        assert!(with(&[("FERROCCL_REDUCE_THREADS", "many")]).is_err());
        assert_eq!(
            (p.tcp_sockets.to_string().as_str(), p.tcp_stripe_min.to_string().as_str()),
            (d("FERROCCL_TCP_SOCKETS"), d("FERROCCL_TCP_STRIPE_MIN"))
        );
        assert_eq!((p.tcp_zerocopy_min, d("FERROCCL_TCP_ZEROCOPY_MIN")), (None, "0"));
        let t = with(&[("FERROCCL_TCP_SOCKETS", "4"), ("FERROCCL_TCP_ZEROCOPY_MIN", "65536")]).unwrap();
        assert_eq!((t.tcp_sockets, t.tcp_zerocopy_min), (4, Some(65536)));
        assert_eq!(p.transport, TransportChoice::Auto);
        assert_eq!((p.ib_dev, p.ib_gid_index), (None, None));
        assert_eq!(p.ib_timeout.to_string(), d("FERROCCL_IB_TIMEOUT"));
        let p = with(&[("FERROCCL_TRANSPORT", "Verbs"), ("FERROCCL_IB_DEV", "rxe0"), ("FERROCCL_IB_GID_INDEX", "1")]).unwrap();
        assert_eq!((p.transport, p.ib_dev.as_deref(), p.ib_gid_index), (TransportChoice::Verbs, Some("rxe0"), Some(1)));
    }

    #[test]
    fn bad_values_name_the_variable() {
        for (k, v) in [
            ("FERROCCL_TRANSPORT", "carrier-pigeon"),
            ("FERROCCL_TIMEOUT", "-1"),
            ("FERROCCL_TIMEOUT", "soon"),
            ("FERROCCL_SHM_RING_BYTES", "1000"),
            ("FERROCCL_SOCKET_ADDR", "not-an-ip"),
            ("FERROCCL_SOCKET_IFNAME", "^"),
            ("FERROCCL_SOCKET_IFNAME", " , "),
            ("FERROCCL_DEBUG", "maybe"),
            ("FERROCCL_DEBUG_SUBSYS", "init,net"),
            ("FERROCCL_FLIGHT_ENTRIES", "100000"),
            ("FERROCCL_ALGO", "bubble"),
            ("FERROCCL_PROTO", "pigeon"),
            ("FERROCCL_LL_MAX_BYTES", "1G"),
            ("FERROCCL_SPIN_US", "forever"),
            ("FERROCCL_CHUNK_BYTES", "1000"),
            ("FERROCCL_IB_GID_INDEX", "300"),
            ("FERROCCL_IB_TIMEOUT", "32"),
            ("FERROCCL_TCP_SOCKETS", "0"),
            ("FERROCCL_TCP_SOCKETS", "17"),
            ("FERROCCL_TCP_STRIPE_MIN", "big"),
            ("FERROCCL_TCP_ZEROCOPY_MIN", "-1"),
        ] {
            let e = with(&[(k, v)]).unwrap_err().to_string();
            assert!(e.contains(k), "{e}");
        }
    }

    #[test]
    fn ll_can_be_forced_or_forbidden() {
        assert_eq!(with(&[("FERROCCL_PROTO", "ll")]).unwrap().ll, LlChoice::Force);
        assert_eq!(with(&[("FERROCCL_PROTO", "^LL")]).unwrap().ll, LlChoice::Off);
        assert_eq!(with(&[("FERROCCL_ALGO", "^ll")]).unwrap().ll, LlChoice::Off);
        let p = with(&[("FERROCCL_ALGO", "ll")]).unwrap();
        assert_eq!((p.algo, p.ll), (Some(Algo::Ll), LlChoice::Auto));
        let p = with(&[("FERROCCL_SPIN_US", "0"), ("FERROCCL_LL_MAX_BYTES", "0")]).unwrap();
        assert_eq!((p.spin_us, p.ll_max_bytes), (Some(0), 0));
    }

    #[test]
    fn docs_list_every_param() {
        let doc = include_str!("../../../docs/params.md");
        for p in PARAMS {
            assert!(doc.contains(&format!("`{}`", p.name)), "docs/params.md misses {}", p.name);
        }
    }
}
