//! Launcher detection: who started this process, which rank it is, where the bootstrap
//! store is and which token proves membership of the job.
//!
//! # Precedence
//!
//! A launcher is chosen by its *rank* variable being set (non-empty); the first match wins:
//!
//! | # | launcher | rank variable | also read |
//! |---|---|---|---|
//! | 1 | FerroCCL (`ferroccl-run`, or set by hand) | `FERROCCL_RANK` | `FERROCCL_WORLD_SIZE`, `FERROCCL_STORE`, `FERROCCL_TOKEN` (all required), `FERROCCL_LOCAL_RANK`, `FERROCCL_LOCAL_WORLD_SIZE` (optional) |
//! | 2 | torchrun | `RANK` | `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE` (optional), `TORCHELASTIC_RUN_ID` |
//! | 3 | Open MPI (`mpirun`) | `OMPI_COMM_WORLD_RANK` | `OMPI_COMM_WORLD_SIZE`, `OMPI_COMM_WORLD_LOCAL_RANK`, `OMPI_COMM_WORLD_LOCAL_SIZE` (optional), `OMPI_MCA_ess_base_jobid` or `PMIX_NAMESPACE` |
//! | 4 | Slurm (`srun`) | `SLURM_PROCID` | `SLURM_NTASKS`, `SLURM_LOCALID` (optional), `SLURM_JOB_ID`, `SLURM_STEP_ID` |
//!
//! The innermost launcher wins: torchrun or `mpirun` started inside a Slurm allocation
//! still see the allocation's `SLURM_*` variables (which then describe the job step, not
//! this process), so torchrun's and Open MPI's variables are looked at before Slurm's.
//!
//! Once a launcher is chosen, its rank and world-size variables are required: a missing or
//! malformed one is an error that names the variable and the launcher (for example
//! "FERROCCL_RANK is set (ferroccl-run) but FERROCCL_WORLD_SIZE is missing"). The world
//! size must be at least 1 and the rank less than the world size; local rank and local
//! world size are optional and informational, but must be numbers when set.
//!
//! # Store address
//!
//! * FerroCCL: `FERROCCL_STORE` (`host:port`) names a store the launcher already serves:
//!   [`StoreRole::Connect`].
//! * torchrun: torchrun's own TCPStore already listens on `MASTER_PORT`, so FerroCCL's store
//!   is served by rank 0 on `MASTER_ADDR:(MASTER_PORT + 1)` ([`StoreRole::ServeOnRank0`]);
//!   that port must be free on the master host. If `FERROCCL_STORE` is set it wins (still
//!   served by rank 0, at that address).
//! * Open MPI and Slurm: `FERROCCL_STORE` if set, else `MASTER_ADDR:MASTER_PORT` (no +1:
//!   there is no torchrun store on it); rank 0 serves it. With neither, detection fails
//!   with an error that says what to set.
//!
//! Ports must be in 1..=65535; an IPv6 host may be written bare in `MASTER_ADDR` and is
//! bracketed in the resulting `host:port`.
//!
//! # Token
//!
//! `FERROCCL_TOKEN`, when set, is the job's token (it must not be empty). `ferroccl-run`
//! makes a fresh random one per job and it is required on the FerroCCL path. Under torchrun,
//! Open MPI and Slurm without `FERROCCL_TOKEN`, a token is *derived* from the job's identity
//! (torchrun: `TORCHELASTIC_RUN_ID`; Open MPI: `OMPI_MCA_ess_base_jobid` or
//! `PMIX_NAMESPACE`; Slurm: `SLURM_JOB_ID` and `SLURM_STEP_ID`), the store address and the
//! world size, and [`LaunchEnv::token_is_derived`] is true. A derived token is *job-scoped,
//! not secret*: it keeps the ranks of two jobs (or a stale store) from meeting by accident,
//! but anyone who can read the job's environment can compute it. Set `FERROCCL_TOKEN` to a
//! secret shared by the ranks where strangers can reach the store's port.

use sha2::{Digest, Sha256};

use crate::bootstrap::auth::hex;
use crate::error::{Error, Result};

/// The program that started this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// `ferroccl-run` (or `FERROCCL_*` variables set by hand).
    FerroCCL,
    /// PyTorch's `torchrun` (torch elastic).
    Torchrun,
    /// Slurm's `srun`.
    Slurm,
    /// Open MPI's `mpirun` / `mpiexec`.
    OpenMpi,
}

impl Launcher {
    /// A human name for errors ("ferroccl-run", "torchrun", "Slurm", "Open MPI").
    pub fn name(self) -> &'static str {
        match self {
            Launcher::FerroCCL => "ferroccl-run",
            Launcher::Torchrun => "torchrun",
            Launcher::Slurm => "Slurm",
            Launcher::OpenMpi => "Open MPI",
        }
    }
}

impl std::fmt::Display for Launcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Where the bootstrap store is, and who serves it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreRole {
    /// The launcher serves the store at this `host:port`; every rank connects.
    Connect(String),
    /// Rank 0 binds this `host:port` and serves the store; every rank (rank 0 included)
    /// connects to it.
    ServeOnRank0(String),
}

impl StoreRole {
    /// The store's `host:port`, whoever serves it.
    pub fn addr(&self) -> &str {
        match self {
            StoreRole::Connect(a) | StoreRole::ServeOnRank0(a) => a,
        }
    }
}

/// What the launcher told this process.
#[derive(Debug, Clone)]
pub struct LaunchEnv {
    /// Who started the job.
    pub launcher: Launcher,
    /// This process's rank, `0..world_size`.
    pub rank: usize,
    /// Number of ranks in the job (at least 1).
    pub world_size: usize,
    /// Rank among the ranks on this host, if the launcher says.
    pub local_rank: Option<usize>,
    /// Number of ranks on this host, if the launcher says.
    pub local_world_size: Option<usize>,
    /// Where the bootstrap store is.
    pub store: StoreRole,
    /// The job token every store and mesh connection must prove.
    pub token: String,
    /// True when `token` was derived from the job's identity (job-scoped, not secret)
    /// rather than given in `FERROCCL_TOKEN`.
    pub token_is_derived: bool,
}

/// The variable names one launcher uses.
struct Vars {
    rank: &'static str,
    size: &'static str,
    local_rank: Option<&'static str>,
    local_size: Option<&'static str>,
}

fn vars(l: Launcher) -> Vars {
    match l {
        Launcher::FerroCCL => Vars {
            rank: "FERROCCL_RANK",
            size: "FERROCCL_WORLD_SIZE",
            local_rank: Some("FERROCCL_LOCAL_RANK"),
            local_size: Some("FERROCCL_LOCAL_WORLD_SIZE"),
        },
        Launcher::Torchrun => {
            Vars { rank: "RANK", size: "WORLD_SIZE", local_rank: Some("LOCAL_RANK"), local_size: Some("LOCAL_WORLD_SIZE") }
        }
        Launcher::OpenMpi => Vars {
            rank: "OMPI_COMM_WORLD_RANK",
            size: "OMPI_COMM_WORLD_SIZE",
            local_rank: Some("OMPI_COMM_WORLD_LOCAL_RANK"),
            local_size: Some("OMPI_COMM_WORLD_LOCAL_SIZE"),
        },
        Launcher::Slurm => Vars { rank: "SLURM_PROCID", size: "SLURM_NTASKS", local_rank: Some("SLURM_LOCALID"), local_size: None },
    }
}

/// Detection order: the first launcher whose rank variable is set wins.
const ORDER: [Launcher; 4] = [Launcher::FerroCCL, Launcher::Torchrun, Launcher::OpenMpi, Launcher::Slurm];

fn env_err(var: &str, problem: impl Into<String>) -> Error {
    Error::Env { var: var.to_owned(), problem: problem.into() }
}

/// Reads the launcher's variables from the process environment. See the module
/// documentation for the precedence rules.
pub fn detect() -> Result<LaunchEnv> {
    detect_from(|k| std::env::var_os(k).map(|v| v.to_string_lossy().into_owned()))
}

/// Like [`detect`], reading variables through `get` (a test passes a map).
pub fn detect_from(get: impl Fn(&str) -> Option<String>) -> Result<LaunchEnv> {
    // Empty (or blank) values count as unset, as for every other FERROCCL_* knob; the
    // token is the exception (set-but-empty is an error, below).
    let var = |k: &str| get(k).map(|v| v.trim().to_owned()).filter(|v| !v.is_empty());

    let Some(launcher) = ORDER.into_iter().find(|&l| var(vars(l).rank).is_some()) else {
        return Err(env_err(
            "FERROCCL_RANK",
            "no launcher detected: none of FERROCCL_RANK (ferroccl-run), RANK (torchrun), \
             OMPI_COMM_WORLD_RANK (Open MPI) or SLURM_PROCID (Slurm) is set. Start the job with \
             ferroccl-run, torchrun, mpirun or srun, or set FERROCCL_RANK, FERROCCL_WORLD_SIZE, \
             FERROCCL_STORE and FERROCCL_TOKEN yourself",
        ));
    };
    let v = vars(launcher);
    let why = format!("{} is set ({launcher})", v.rank);
    let required = |name: &str| var(name).ok_or_else(|| env_err(name, format!("{why} but {name} is missing")));
    let number = |name: &str, value: &str| -> Result<usize> {
        value.parse::<usize>().map_err(|_| env_err(name, format!("{value:?} is not a non-negative integer ({launcher} launch)")))
    };
    let optional = |name: Option<&str>| -> Result<Option<usize>> {
        match name.and_then(|n| var(n).map(|val| (n, val))) {
            Some((n, val)) => number(n, &val).map(Some),
            None => Ok(None),
        }
    };

    let rank = number(v.rank, &required(v.rank)?)?;
    let world_size = number(v.size, &required(v.size)?)?;
    if world_size == 0 {
        return Err(env_err(v.size, format!("{}=0: a job needs at least 1 rank ({launcher} launch)", v.size)));
    }
    if rank >= world_size {
        return Err(env_err(
            v.rank,
            format!("{}={rank} is not less than {}={world_size} (ranks are numbered from 0; {launcher} launch)", v.rank, v.size),
        ));
    }
    let local_rank = optional(v.local_rank)?;
    let local_world_size = optional(v.local_size)?;
    if let (Some(lr), Some(lws), Some(lrn), Some(lsn)) = (local_rank, local_world_size, v.local_rank, v.local_size) {
        if lws == 0 || lr >= lws {
            return Err(env_err(lrn, format!("{lrn}={lr} is not less than {lsn}={lws} ({launcher} launch)")));
        }
    }

    let store = match launcher {
        Launcher::FerroCCL => StoreRole::Connect(host_port("FERROCCL_STORE", &required("FERROCCL_STORE")?)?),
        Launcher::Torchrun => match var("FERROCCL_STORE") {
            Some(s) => StoreRole::ServeOnRank0(host_port("FERROCCL_STORE", &s)?),
            None => {
                let (host, port) = master(&var, &why)?;
                let Some(next) = port.checked_add(1) else {
                    return Err(env_err(
                        "MASTER_PORT",
                        "MASTER_PORT=65535 leaves no port for FerroCCL's store, which rank 0 serves on \
                         MASTER_PORT+1 under torchrun; use a lower MASTER_PORT or set FERROCCL_STORE",
                    ));
                };
                StoreRole::ServeOnRank0(format!("{host}:{next}"))
            }
        },
        Launcher::Slurm | Launcher::OpenMpi => match var("FERROCCL_STORE") {
            Some(s) => StoreRole::ServeOnRank0(host_port("FERROCCL_STORE", &s)?),
            None if var("MASTER_ADDR").is_some() || var("MASTER_PORT").is_some() => {
                let (host, port) = master(&var, &why)?;
                StoreRole::ServeOnRank0(format!("{host}:{port}"))
            }
            None => {
                return Err(env_err(
                    "FERROCCL_STORE",
                    format!(
                        "{why} but no store address is given: set FERROCCL_STORE=host:port (an address \
                         rank 0 can listen on and every rank can reach, e.g. the first node of the job \
                         and a free port), or MASTER_ADDR and MASTER_PORT"
                    ),
                ))
            }
        },
    };

    let (token, token_is_derived) = match get("FERROCCL_TOKEN") {
        Some(t) if t.trim().is_empty() => {
            return Err(env_err("FERROCCL_TOKEN", "is set but empty; it must be the job's token (the same on every rank)"))
        }
        Some(t) => (t, false),
        None => (derive_token(launcher, &var, &store, world_size, &why)?, true),
    };

    Ok(LaunchEnv { launcher, rank, world_size, local_rank, local_world_size, store, token, token_is_derived })
}

/// `MASTER_ADDR` and `MASTER_PORT`, both required once either is needed.
fn master(var: &impl Fn(&str) -> Option<String>, why: &str) -> Result<(String, u16)> {
    let host = var("MASTER_ADDR")
        .ok_or_else(|| env_err("MASTER_ADDR", format!("{why} but MASTER_ADDR is missing (or set FERROCCL_STORE=host:port)")))?;
    let port = var("MASTER_PORT")
        .ok_or_else(|| env_err("MASTER_PORT", format!("{why} but MASTER_PORT is missing (or set FERROCCL_STORE=host:port)")))?;
    let port = port_number("MASTER_PORT", &port)?;
    // A bare IPv6 address needs brackets in host:port.
    let host = if host.contains(':') && !host.starts_with('[') { format!("[{host}]") } else { host };
    Ok((host, port))
}

fn port_number(name: &str, p: &str) -> Result<u16> {
    match p.parse::<u32>() {
        Ok(n @ 1..=65535) => Ok(n as u16),
        _ => Err(env_err(name, format!("port {p:?} is not a number in 1..=65535"))),
    }
}

/// Checks a `host:port` value (IPv6 hosts in brackets) and returns it trimmed.
fn host_port(name: &str, v: &str) -> Result<String> {
    let Some((host, port)) = v.rsplit_once(':') else {
        return Err(env_err(name, format!("{v:?} is not host:port")));
    };
    if host.is_empty() {
        return Err(env_err(name, format!("{v:?} has no host (expected host:port)")));
    }
    if host.contains(':') && !(host.starts_with('[') && host.ends_with(']')) {
        return Err(env_err(name, format!("{v:?}: an IPv6 host must be in brackets, as [::1]:29500")));
    }
    port_number(name, port)?;
    Ok(v.to_owned())
}

/// A job-scoped token from the launcher's job identity (not secret; see the module docs).
fn derive_token(
    launcher: Launcher,
    var: &impl Fn(&str) -> Option<String>,
    store: &StoreRole,
    world_size: usize,
    why: &str,
) -> Result<String> {
    let ids: Vec<String> = match launcher {
        Launcher::FerroCCL => return Err(env_err("FERROCCL_TOKEN", format!("{why} but FERROCCL_TOKEN is missing; ferroccl-run sets it"))),
        Launcher::Torchrun => var("TORCHELASTIC_RUN_ID").into_iter().collect(),
        Launcher::Slurm => match var("SLURM_JOB_ID") {
            Some(job) => vec![job, var("SLURM_STEP_ID").unwrap_or_default()],
            None => Vec::new(),
        },
        Launcher::OpenMpi => var("OMPI_MCA_ess_base_jobid").or_else(|| var("PMIX_NAMESPACE")).into_iter().collect(),
    };
    if ids.is_empty() {
        let from = match launcher {
            Launcher::Torchrun => "TORCHELASTIC_RUN_ID",
            Launcher::Slurm => "SLURM_JOB_ID",
            _ => "OMPI_MCA_ess_base_jobid or PMIX_NAMESPACE",
        };
        return Err(env_err(
            "FERROCCL_TOKEN",
            format!(
                "{why} but FERROCCL_TOKEN is not set and there is no job identity to derive one from \
                 ({from} is not set); set FERROCCL_TOKEN to the same secret on every rank (e.g. 64 random \
                 hex digits)"
            ),
        ));
    }
    let mut h = Sha256::new();
    let mut field = |b: &[u8]| {
        h.update((b.len() as u64).to_le_bytes());
        h.update(b);
    };
    field(b"ferroccl-derived-token-v1");
    field(launcher.name().as_bytes());
    for id in &ids {
        field(id.as_bytes());
    }
    field(store.addr().as_bytes());
    field(world_size.to_string().as_bytes());
    Ok(hex(&h.finalize()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn detect_with(pairs: &[(&str, &str)]) -> Result<LaunchEnv> {
        let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        detect_from(|k| m.get(k).cloned())
    }

    /// The error names `var` (as the variable) and every string in `says` appears in it.
    #[track_caller]
    fn env_error(pairs: &[(&str, &str)], var: &str, says: &[&str]) {
        match detect_with(pairs) {
            Err(e @ Error::Env { .. }) => {
                let Error::Env { var: v, .. } = &e else { unreachable!() };
                assert_eq!(v, var, "{e}");
                let text = e.to_string();
                for s in says {
                    assert!(text.contains(s), "{text:?} does not mention {s:?}");
                }
            }
            other => panic!("expected Env error on {var}, got {other:?}"),
        }
    }

    const FCCL: &[(&str, &str)] =
        &[("FERROCCL_RANK", "2"), ("FERROCCL_WORLD_SIZE", "4"), ("FERROCCL_STORE", "10.0.0.1:2345"), ("FERROCCL_TOKEN", "sekrit")];

    const TORCH: &[(&str, &str)] = &[
        ("RANK", "1"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "4"),
        ("MASTER_ADDR", "node0"),
        ("MASTER_PORT", "29500"),
        ("TORCHELASTIC_RUN_ID", "abc"),
    ];

    const SLURM: &[(&str, &str)] =
        &[("SLURM_PROCID", "3"), ("SLURM_NTASKS", "4"), ("SLURM_LOCALID", "1"), ("SLURM_JOB_ID", "777"), ("SLURM_STEP_ID", "0")];

    const OMPI: &[(&str, &str)] = &[
        ("OMPI_COMM_WORLD_RANK", "0"),
        ("OMPI_COMM_WORLD_SIZE", "2"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ("PMIX_NAMESPACE", "prterun-host-1234@1"),
    ];

    fn with(base: &[(&'static str, &'static str)], over: &[(&'static str, &'static str)]) -> Vec<(&'static str, &'static str)> {
        let mut v: Vec<_> = base.iter().filter(|(k, _)| !over.iter().any(|(o, _)| o == k)).copied().collect();
        v.extend(over.iter().filter(|(_, val)| *val != "<unset>").copied());
        v
    }

    #[test]
    fn ferroccl_variables() {
        let e = detect_with(FCCL).unwrap();
        assert_eq!(e.launcher, Launcher::FerroCCL);
        assert_eq!((e.rank, e.world_size, e.local_rank, e.local_world_size), (2, 4, None, None));
        assert_eq!(e.store, StoreRole::Connect("10.0.0.1:2345".into()));
        assert_eq!(e.token, "sekrit");
        assert!(!e.token_is_derived);
        let e = detect_with(&with(FCCL, &[("FERROCCL_LOCAL_RANK", "0"), ("FERROCCL_LOCAL_WORLD_SIZE", "2")])).unwrap();
        assert_eq!((e.local_rank, e.local_world_size), (Some(0), Some(2)));
    }

    #[test]
    fn ferroccl_wins_over_every_other_launcher() {
        let all: Vec<_> = [FCCL, TORCH, SLURM, OMPI].concat();
        assert_eq!(detect_with(&all).unwrap().launcher, Launcher::FerroCCL);
        let rest: Vec<_> = [TORCH, SLURM, OMPI].concat();
        assert_eq!(detect_with(&rest).unwrap().launcher, Launcher::Torchrun);
        let rest: Vec<_> = [SLURM, OMPI].concat();
        let e = detect_with(&with(&rest, &[("FERROCCL_STORE", "h:1")])).unwrap();
        assert_eq!(e.launcher, Launcher::OpenMpi);
        assert_eq!(e.rank, 0);
        // An empty rank variable counts as unset.
        let e = detect_with(&with(&rest, &[("FERROCCL_STORE", "h:1"), ("OMPI_COMM_WORLD_RANK", " ")])).unwrap();
        assert_eq!(e.launcher, Launcher::Slurm);
    }

    #[test]
    fn ferroccl_missing_or_bad_variables() {
        env_error(
            &with(FCCL, &[("FERROCCL_WORLD_SIZE", "<unset>")]),
            "FERROCCL_WORLD_SIZE",
            &["FERROCCL_RANK is set (ferroccl-run) but FERROCCL_WORLD_SIZE is missing"],
        );
        env_error(&with(FCCL, &[("FERROCCL_STORE", "<unset>")]), "FERROCCL_STORE", &["FERROCCL_STORE is missing"]);
        env_error(&with(FCCL, &[("FERROCCL_TOKEN", "<unset>")]), "FERROCCL_TOKEN", &["FERROCCL_TOKEN is missing"]);
        env_error(&with(FCCL, &[("FERROCCL_TOKEN", "")]), "FERROCCL_TOKEN", &["empty"]);
        env_error(&with(FCCL, &[("FERROCCL_RANK", "two")]), "FERROCCL_RANK", &["\"two\"", "ferroccl-run"]);
        env_error(&with(FCCL, &[("FERROCCL_RANK", "-1")]), "FERROCCL_RANK", &["\"-1\""]);
        env_error(&with(FCCL, &[("FERROCCL_WORLD_SIZE", "4x")]), "FERROCCL_WORLD_SIZE", &["\"4x\""]);
        env_error(&with(FCCL, &[("FERROCCL_WORLD_SIZE", "0"), ("FERROCCL_RANK", "0")]), "FERROCCL_WORLD_SIZE", &["at least 1"]);
        env_error(&with(FCCL, &[("FERROCCL_RANK", "4")]), "FERROCCL_RANK", &["FERROCCL_RANK=4", "FERROCCL_WORLD_SIZE=4"]);
        env_error(&with(FCCL, &[("FERROCCL_LOCAL_RANK", "x")]), "FERROCCL_LOCAL_RANK", &["\"x\""]);
        env_error(&with(FCCL, &[("FERROCCL_LOCAL_WORLD_SIZE", "x")]), "FERROCCL_LOCAL_WORLD_SIZE", &["\"x\""]);
        env_error(
            &with(FCCL, &[("FERROCCL_LOCAL_RANK", "2"), ("FERROCCL_LOCAL_WORLD_SIZE", "2")]),
            "FERROCCL_LOCAL_RANK",
            &["FERROCCL_LOCAL_WORLD_SIZE=2"],
        );
        for bad in ["nohost", ":80", "h:0", "h:65536", "h:port", "::1:80"] {
            env_error(&with(FCCL, &[("FERROCCL_STORE", bad)]), "FERROCCL_STORE", &[]);
        }
        assert_eq!(detect_with(&with(FCCL, &[("FERROCCL_STORE", "[::1]:80")])).unwrap().store.addr(), "[::1]:80");
    }

    #[test]
    fn torchrun_serves_on_master_port_plus_one() {
        let e = detect_with(TORCH).unwrap();
        assert_eq!(e.launcher, Launcher::Torchrun);
        assert_eq!((e.rank, e.world_size, e.local_rank, e.local_world_size), (1, 8, Some(1), Some(4)));
        assert_eq!(e.store, StoreRole::ServeOnRank0("node0:29501".into()));
        assert!(e.token_is_derived);
        assert_eq!(e.token.len(), 64);
        // Every rank of the job derives the same token; another job derives another.
        assert_eq!(detect_with(&with(TORCH, &[("RANK", "5"), ("LOCAL_RANK", "0")])).unwrap().token, e.token);
        assert_ne!(detect_with(&with(TORCH, &[("TORCHELASTIC_RUN_ID", "abd")])).unwrap().token, e.token);
        // FERROCCL_TOKEN wins over derivation.
        let t = detect_with(&with(TORCH, &[("FERROCCL_TOKEN", "given")])).unwrap();
        assert_eq!((t.token.as_str(), t.token_is_derived), ("given", false));
        // FERROCCL_STORE wins over MASTER_ADDR:MASTER_PORT+1, still served by rank 0.
        let s = detect_with(&with(TORCH, &[("FERROCCL_STORE", "other:1234")])).unwrap();
        assert_eq!(s.store, StoreRole::ServeOnRank0("other:1234".into()));
        // IPv6 master.
        let v6 = detect_with(&with(TORCH, &[("MASTER_ADDR", "fe80::1")])).unwrap();
        assert_eq!(v6.store.addr(), "[fe80::1]:29501");
    }

    #[test]
    fn torchrun_errors() {
        env_error(&with(TORCH, &[("WORLD_SIZE", "<unset>")]), "WORLD_SIZE", &["RANK is set (torchrun) but WORLD_SIZE is missing"]);
        env_error(&with(TORCH, &[("MASTER_ADDR", "<unset>")]), "MASTER_ADDR", &["torchrun", "MASTER_ADDR is missing"]);
        env_error(&with(TORCH, &[("MASTER_PORT", "<unset>")]), "MASTER_PORT", &["torchrun", "MASTER_PORT is missing"]);
        env_error(&with(TORCH, &[("MASTER_PORT", "99999")]), "MASTER_PORT", &["1..=65535"]);
        env_error(&with(TORCH, &[("MASTER_PORT", "65535")]), "MASTER_PORT", &["MASTER_PORT+1"]);
        env_error(&with(TORCH, &[("RANK", "8")]), "RANK", &["RANK=8", "WORLD_SIZE=8"]);
        env_error(&with(TORCH, &[("LOCAL_RANK", "x")]), "LOCAL_RANK", &["torchrun"]);
        env_error(&with(TORCH, &[("LOCAL_WORLD_SIZE", "1")]), "LOCAL_RANK", &["LOCAL_RANK=1", "LOCAL_WORLD_SIZE=1"]);
        env_error(&with(TORCH, &[("TORCHELASTIC_RUN_ID", "<unset>")]), "FERROCCL_TOKEN", &["TORCHELASTIC_RUN_ID"]);
        env_error(&with(TORCH, &[("FERROCCL_TOKEN", "  ")]), "FERROCCL_TOKEN", &["empty"]);
        env_error(&with(TORCH, &[("FERROCCL_STORE", "bad")]), "FERROCCL_STORE", &["host:port"]);
    }

    #[test]
    fn slurm() {
        let base = with(SLURM, &[("MASTER_ADDR", "n1"), ("MASTER_PORT", "4000")]);
        let e = detect_with(&base).unwrap();
        assert_eq!(e.launcher, Launcher::Slurm);
        assert_eq!((e.rank, e.world_size, e.local_rank, e.local_world_size), (3, 4, Some(1), None));
        // No +1 outside torchrun.
        assert_eq!(e.store, StoreRole::ServeOnRank0("n1:4000".into()));
        assert!(e.token_is_derived);
        let other_step = detect_with(&with(&base, &[("SLURM_STEP_ID", "1")])).unwrap();
        assert_ne!(other_step.token, e.token);
        let e = detect_with(&with(&base, &[("FERROCCL_STORE", "n2:5000")])).unwrap();
        assert_eq!(e.store, StoreRole::ServeOnRank0("n2:5000".into()));
        let e = detect_with(&with(SLURM, &[("FERROCCL_STORE", "n2:5000")])).unwrap();
        assert_eq!(e.store, StoreRole::ServeOnRank0("n2:5000".into()));

        env_error(SLURM, "FERROCCL_STORE", &["SLURM_PROCID is set (Slurm)", "set FERROCCL_STORE=host:port", "MASTER_ADDR and MASTER_PORT"]);
        env_error(&with(SLURM, &[("MASTER_ADDR", "n1")]), "MASTER_PORT", &["MASTER_PORT is missing"]);
        env_error(
            &with(&base, &[("SLURM_NTASKS", "<unset>")]),
            "SLURM_NTASKS",
            &["SLURM_PROCID is set (Slurm) but SLURM_NTASKS is missing"],
        );
        env_error(&with(&base, &[("SLURM_PROCID", "4")]), "SLURM_PROCID", &["SLURM_PROCID=4", "SLURM_NTASKS=4"]);
        env_error(&with(&base, &[("SLURM_LOCALID", "a")]), "SLURM_LOCALID", &["Slurm"]);
        env_error(&with(&base, &[("SLURM_JOB_ID", "<unset>")]), "FERROCCL_TOKEN", &["SLURM_JOB_ID"]);
        assert!(!detect_with(&with(&base, &[("SLURM_JOB_ID", "<unset>"), ("FERROCCL_TOKEN", "t")])).unwrap().token_is_derived);
    }

    #[test]
    fn open_mpi() {
        let base = with(OMPI, &[("FERROCCL_STORE", "h:9")]);
        let e = detect_with(&base).unwrap();
        assert_eq!(e.launcher, Launcher::OpenMpi);
        assert_eq!((e.rank, e.world_size, e.local_rank, e.local_world_size), (0, 2, Some(0), Some(2)));
        assert_eq!(e.store, StoreRole::ServeOnRank0("h:9".into()));
        assert!(e.token_is_derived);
        let jobid = detect_with(&with(&base, &[("PMIX_NAMESPACE", "<unset>"), ("OMPI_MCA_ess_base_jobid", "42")])).unwrap();
        assert!(jobid.token_is_derived);
        assert_ne!(jobid.token, e.token);
        let m = detect_with(&with(OMPI, &[("MASTER_ADDR", "m"), ("MASTER_PORT", "7")])).unwrap();
        assert_eq!(m.store, StoreRole::ServeOnRank0("m:7".into()));

        env_error(OMPI, "FERROCCL_STORE", &["OMPI_COMM_WORLD_RANK is set (Open MPI)", "FERROCCL_STORE=host:port"]);
        env_error(&with(&base, &[("OMPI_COMM_WORLD_SIZE", "<unset>")]), "OMPI_COMM_WORLD_SIZE", &["Open MPI", "missing"]);
        env_error(&with(&base, &[("OMPI_COMM_WORLD_SIZE", "zero")]), "OMPI_COMM_WORLD_SIZE", &["\"zero\""]);
        env_error(&with(&base, &[("OMPI_COMM_WORLD_LOCAL_SIZE", "?")]), "OMPI_COMM_WORLD_LOCAL_SIZE", &["\"?\""]);
        env_error(&with(&base, &[("PMIX_NAMESPACE", "<unset>")]), "FERROCCL_TOKEN", &["PMIX_NAMESPACE"]);
    }

    #[test]
    fn no_launcher_lists_what_was_looked_for() {
        env_error(
            &[("PATH", "/bin"), ("WORLD_SIZE", "2")],
            "FERROCCL_RANK",
            &["no launcher detected", "FERROCCL_RANK", "RANK (torchrun)", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"],
        );
    }
}
