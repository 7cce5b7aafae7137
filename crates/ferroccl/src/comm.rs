//! The communicator: a group of ranks that can talk to each other.

use std::collections::HashMap;
use std::net::ToSocketAddrs;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferroccl_kernels::{as_bytes, as_bytes_mut, Element};
use ferroccl_mem::region::{with_region, with_region_ro};

use crate::bootstrap::env::{self, LaunchEnv, StoreRole};
use crate::bootstrap::{StoreClient, StoreServer};
use crate::coll::ScratchCache;
use crate::error::{Error, Result};
use crate::fabric::{Fabric, FabricConfig, Poll};
use crate::p2p::{Ctx, RecvOp, SendOp};
use crate::params::Params;
use crate::proto::{Desc, CHAN_INTERNAL, CHAN_USER, NO_DESC};

/// How to reach the other ranks of a job, when not read from the environment.
#[derive(Debug, Clone)]
pub struct InitConfig {
    /// This rank, `0..world_size`.
    pub rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// The bootstrap store: connect to one, or serve it on rank 0.
    pub store: StoreRole,
    /// The job's token (see `FERROCCL_TOKEN`).
    pub token: String,
}

impl From<LaunchEnv> for InitConfig {
    fn from(e: LaunchEnv) -> Self {
        InitConfig { rank: e.rank, world_size: e.world_size, store: e.store, token: e.token }
    }
}

/// Sequence numbers of one communicator's ordered streams.
#[derive(Debug, Default)]
struct Seqs {
    send: HashMap<(u8, usize), u32>,
    recv: HashMap<(u8, usize), u32>,
}

/// A group of ranks: the world (from [`Communicator::init`]) or a part of it (from
/// [`Communicator::split`]). Sub-communicators share the world's connections.
///
/// Point-to-point calls between two ranks match in the order they are made, like NCCL's
/// (there are no tags). Every blocking call gives up after `FERROCCL_TIMEOUT` and fails
/// promptly, naming the rank, if a peer dies.
///
/// Calls on one communicator are serialised internally; it is `Send + Sync`.
#[derive(Debug)]
pub struct Communicator {
    fabric: Arc<Fabric>,
    id: u32,
    rank: usize,
    /// World rank of each member.
    members: Vec<usize>,
    seqs: Mutex<Seqs>,
    splits: Mutex<u32>,
    op_lock: Mutex<()>,
    scratch: ScratchCache,
    /// Whether any member is reached over tcp (fixed with the membership; the cost model
    /// reads it on every collective).
    any_tcp: bool,
}

/// Counts inits per (store, job token, world size, rank) so that several communicators in
/// one job get distinct store keys (every rank of a world inits them in the same order),
/// also when one store serves several jobs of different sizes in turn.
fn init_generation(store: &str, token: &str, world: usize, rank: usize) -> u64 {
    type Gens = HashMap<(String, String, usize, usize), u64>;
    static GEN: Mutex<Option<Gens>> = Mutex::new(None);
    let mut g = GEN.lock().unwrap_or_else(|e| e.into_inner());
    let m = g.get_or_insert_with(HashMap::new);
    let n = m.entry((store.to_string(), token.to_string(), world, rank)).or_insert(0);
    let v = *n;
    *n += 1;
    v
}

/// Ready when `done`; otherwise whether the last step moved anything.
pub(crate) fn poll_of(done: bool, moved: bool) -> Poll<()> {
    if done {
        Poll::Ready(())
    } else if moved {
        Poll::Moved
    } else {
        Poll::Idle
    }
}

fn fnv(parts: &[u64]) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for p in parts {
        for b in p.to_le_bytes() {
            h ^= u32::from(b);
            h = h.wrapping_mul(0x0100_0193);
        }
    }
    h
}

impl Communicator {
    /// Joins the job described by the environment: FerroCCL's own variables (set by
    /// `ferroccl-run`), torchrun's, Slurm's or Open MPI's, and the `FERROCCL_*` knobs.
    pub fn init() -> Result<Communicator> {
        let launch = env::detect()?;
        let params = Params::from_env()?;
        Self::init_with(launch.into(), params)
    }

    /// Joins a job described explicitly.
    pub fn init_with(cfg: InitConfig, params: Params) -> Result<Communicator> {
        if cfg.world_size == 0 || cfg.rank >= cfg.world_size {
            return Err(Error::invalid(format!("rank {} is not in a world of {} ranks", cfg.rank, cfg.world_size)));
        }
        params.validate()?;
        let timeout = params.timeout;
        let (addr, server) = match &cfg.store {
            StoreRole::Connect(a) => (a.clone(), None),
            StoreRole::ServeOnRank0(a) => {
                let server = if cfg.rank == 0 {
                    let sa = a
                        .to_socket_addrs()
                        .map_err(|e| Error::io(format!("resolve store address {a}"), e))?
                        .next()
                        .ok_or_else(|| Error::invalid(format!("store address {a} resolves to nothing")))?;
                    Some(StoreServer::start(sa, &cfg.token, params.store_max_value)?)
                } else {
                    None
                };
                (a.clone(), server)
            }
        };
        let store = StoreClient::connect(&addr, &cfg.token, cfg.rank, timeout)?;
        let gen = init_generation(&addr, &cfg.token, cfg.world_size, cfg.rank);
        let fabric = Fabric::connect(FabricConfig {
            rank: cfg.rank,
            size: cfg.world_size,
            token: cfg.token,
            params,
            store,
            server: server as Option<StoreServer>,
            key_prefix: format!("ferroccl/{}/{gen}", cfg.world_size),
        })?;
        if fabric.params.debug {
            for p in 0..fabric.size {
                if p != fabric.rank {
                    eprintln!("ferroccl: rank {} -> rank {p}: {}", fabric.rank, fabric.transport_name(p));
                }
            }
            eprintln!("ferroccl: rank {} connected in {:?}", fabric.rank, fabric.setup_time);
        }
        let members: Vec<usize> = (0..cfg.world_size).collect();
        let any_tcp = members.iter().any(|&w| fabric.transport_name(w) == "tcp");
        Ok(Communicator {
            any_tcp,
            fabric: Arc::new(fabric),
            id: 0,
            rank: cfg.rank,
            members,
            seqs: Mutex::default(),
            splits: Mutex::new(0),
            op_lock: Mutex::new(()),
            scratch: ScratchCache::default(),
        })
    }

    /// This rank's index in the communicator.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks in the communicator.
    pub fn size(&self) -> usize {
        self.members.len()
    }

    /// The world rank of member `rank` of this communicator.
    pub fn world_rank(&self, rank: usize) -> Option<usize> {
        self.members.get(rank).copied()
    }

    /// The transport to member `peer`: `"shm"`, `"tcp"` or `"self"`.
    pub fn transport_to(&self, peer: usize) -> Option<&'static str> {
        self.members.get(peer).map(|&w| self.fabric.transport_name(w))
    }

    /// Host name of member `peer`.
    pub fn hostname_of(&self, peer: usize) -> Option<&str> {
        self.members.get(peer).map(|&w| self.fabric.peers[w].hostname.as_str())
    }

    /// How long connecting the mesh took on this rank (store exchange included).
    pub fn setup_time(&self) -> Duration {
        self.fabric.setup_time
    }

    /// Whether any member is reached over tcp.
    pub(crate) fn any_tcp(&self) -> bool {
        self.any_tcp
    }

    pub(crate) fn scratch(&self) -> &ScratchCache {
        &self.scratch
    }

    pub(crate) fn fabric(&self) -> &Fabric {
        &self.fabric
    }

    /// The world rank of member `peer`, which must not be this rank.
    pub(crate) fn world_rank_checked(&self, peer: usize) -> Result<usize> {
        self.peer_world(peer, "collective")
    }

    /// The next sequence number of the collectives' stream with member `peer`.
    pub(crate) fn next_coll_seq(&self, send: bool, peer: usize) -> u32 {
        self.next_seq(send, crate::proto::CHAN_COLL, peer)
    }

    /// The blocking-call deadline (`FERROCCL_TIMEOUT`).
    pub fn timeout(&self) -> Duration {
        self.fabric.params.timeout
    }

    fn deadline(&self) -> Instant {
        Instant::now() + self.fabric.params.timeout
    }

    fn peer_world(&self, peer: usize, op: &str) -> Result<usize> {
        if peer == self.rank {
            return Err(Error::invalid(format!("rank {}: {op}: peer is this rank itself", self.rank)));
        }
        self.members.get(peer).copied().ok_or_else(|| {
            Error::invalid(format!("rank {}: {op}: peer {peer} is out of range (communicator of {} ranks)", self.rank, self.size()))
        })
    }

    fn next_seq(&self, send: bool, chan: u8, peer: usize) -> u32 {
        let mut s = self.seqs.lock().unwrap_or_else(|e| e.into_inner());
        let m = if send { &mut s.send } else { &mut s.recv };
        let v = m.entry((chan, peer)).or_insert(0);
        let out = *v;
        *v = v.wrapping_add(1);
        out
    }

    /// Everything that can be checked before a byte goes on the wire; errors here leave the
    /// communicator usable.
    fn check_peer(&self, peer: usize, op: &str) -> Result<usize> {
        let wpeer = self.peer_world(peer, op)?;
        self.fabric.endpoint(wpeer)?;
        if let Some(e) = self.fabric.fatal_error(op) {
            return Err(e);
        }
        Ok(wpeer)
    }

    /// The context transfers of this communicator run in.
    pub(crate) fn ctx<'a>(&'a self, chan: u8, op: &'a str, desc: Desc) -> Ctx<'a> {
        Ctx {
            fabric: &self.fabric,
            comm: self.id,
            chan,
            rank: self.rank,
            op,
            deadline: self.deadline(),
            desc,
            describe: crate::coll::describe,
            eager_max: self.fabric.params.eager_max,
        }
    }

    /// Sends to a member already checked by [`Communicator::check_peer`]. Any error is
    /// fatal (the caller poisons).
    fn send_bytes(&self, chan: u8, peer: usize, data: &[u8], op: &str) -> Result<()> {
        let wpeer = self.check_peer(peer, op)?;
        let seq = self.next_seq(true, chan, peer);
        let cx = self.ctx(chan, op, NO_DESC);
        with_region_ro(data, |src| {
            let mut s = SendOp::new(peer, wpeer, seq, src.clone(), 0, data.len());
            self.fabric.run_until(op, cx.deadline, &|| vec![wpeer], || {
                let moved = s.advance(&cx)?;
                Ok(poll_of(s.is_done(), moved))
            })
            // `s` drops here, inside the registration: a lent pull slot is revoked first.
        })
    }

    /// Receives from a member already checked, running `between` once the receive is ready
    /// (its clear-to-send posted) and before waiting for the data: `sendrecv` sends there,
    /// so no pattern of sendrecvs can deadlock. Any error is fatal (the caller poisons).
    fn recv_bytes_then(&self, chan: u8, peer: usize, buf: &mut [u8], op: &str, between: impl FnOnce() -> Result<()>) -> Result<()> {
        let wpeer = self.check_peer(peer, op)?;
        let seq = self.next_seq(false, chan, peer);
        let cx = self.ctx(chan, op, NO_DESC);
        let len = buf.len();
        with_region(buf, |dst| {
            let mut r = RecvOp::new(peer, wpeer, seq, dst.clone(), 0, len);
            let res = (|| {
                r.advance(&cx)?;
                between()?;
                self.fabric.run_until(op, cx.deadline, &|| vec![wpeer], || {
                    let moved = r.advance(&cx)?;
                    Ok(poll_of(r.is_done(), moved))
                })
            })();
            self.fabric.deregister(dst.id());
            res
        })
    }

    fn recv_bytes(&self, chan: u8, peer: usize, buf: &mut [u8], op: &str) -> Result<()> {
        self.recv_bytes_then(chan, peer, buf, op, || Ok(()))
    }

    /// Runs one whole operation (point-to-point or collective), serialised with the
    /// communicator's other calls: an error after its checks is fatal for the fabric.
    pub(crate) fn run<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let _g = self.op_lock.lock().unwrap_or_else(|e| e.into_inner());
        f().map_err(|e| self.fabric.poison(e))
    }

    /// Sends `data` to member `peer`, which must call [`Communicator::recv`] with a buffer of
    /// the same length. Returns once `data` may be reused.
    pub fn send<T: Element>(&self, data: &[T], peer: usize) -> Result<()> {
        let op = format!("send to rank {peer}");
        self.check_peer(peer, &op)?;
        self.run(|| self.send_bytes(CHAN_USER, peer, as_bytes(data), &op))
    }

    /// Receives into `buf` from member `peer`; the sender's length must equal `buf.len()`.
    pub fn recv<T: Element>(&self, buf: &mut [T], peer: usize) -> Result<()> {
        let op = format!("recv from rank {peer}");
        self.check_peer(peer, &op)?;
        self.run(|| self.recv_bytes(CHAN_USER, peer, as_bytes_mut(buf), &op))
    }

    /// Sends `data` to member `to` and receives `buf` from member `from` in one call, which
    /// cannot deadlock whatever pattern the members form (rings, pairs, shifts). `to` and
    /// `from` may both be this rank itself (then `data` is copied into `buf`).
    pub fn sendrecv<T: Element>(&self, data: &[T], to: usize, buf: &mut [T], from: usize) -> Result<()> {
        let op = format!("sendrecv (to rank {to}, from rank {from})");
        let (d, b) = (as_bytes(data), as_bytes_mut(buf));
        match (to == self.rank, from == self.rank) {
            (true, true) if d.len() == b.len() => {
                b.copy_from_slice(d);
                Ok(())
            }
            (true, true) => Err(Error::invalid(format!("{op}: sends {} bytes to itself but receives {}", d.len(), b.len()))),
            (true, false) | (false, true) => Err(Error::invalid(format!("{op}: only one side is this rank itself"))),
            (false, false) => {
                self.check_peer(to, &op)?;
                self.check_peer(from, &op)?;
                self.run(|| self.recv_bytes_then(CHAN_USER, from, b, &op, || self.send_bytes(CHAN_USER, to, d, &op)))
            }
        }
    }

    /// Waits until every member has entered the barrier (dissemination: ⌈log2 n⌉ rounds of
    /// empty messages).
    pub fn barrier(&self) -> Result<()> {
        self.run(|| self.barrier_inner())
    }

    fn barrier_inner(&self) -> Result<()> {
        let n = self.size();
        let mut k = 1;
        while k < n {
            let to = (self.rank + k) % n;
            let from = (self.rank + n - k) % n;
            let op = format!("barrier (round {}: rank {to} / rank {from})", k.trailing_zeros());
            self.send_bytes(CHAN_INTERNAL, to, &[], &op)?;
            self.recv_bytes(CHAN_INTERNAL, from, &mut [], &op)?;
            k *= 2;
        }
        Ok(())
    }

    /// Splits the communicator, like `MPI_Comm_split`: members that pass the same `color`
    /// form a new communicator, ordered by `key` (ties by their rank here). `None` as the
    /// color leaves this rank out (it gets `Ok(None)`). Every member must call it.
    /// The new communicators share this one's connections.
    pub fn split(&self, color: Option<u32>, key: i64) -> Result<Option<Communicator>> {
        self.run(|| self.split_inner(color, key))
    }

    fn split_inner(&self, color: Option<u32>, key: i64) -> Result<Option<Communicator>> {
        let n = self.size();
        let mine = {
            let mut b = Vec::with_capacity(13);
            b.push(u8::from(color.is_some()));
            b.extend_from_slice(&color.unwrap_or(0).to_le_bytes());
            b.extend_from_slice(&key.to_le_bytes());
            b
        };
        let mut all = vec![mine.clone(); n];
        // Everyone sends its 13 bytes to everyone (eager, so the sends never wait).
        for p in 0..n {
            if p != self.rank {
                self.send_bytes(CHAN_INTERNAL, p, &mine, "split")?;
            }
        }
        for (p, slot) in all.iter_mut().enumerate() {
            if p != self.rank {
                self.recv_bytes(CHAN_INTERNAL, p, slot, "split")?;
            }
        }
        let count = {
            let mut s = self.splits.lock().unwrap_or_else(|e| e.into_inner());
            *s += 1;
            *s
        };
        let Some(c) = color else { return Ok(None) };
        let mut group: Vec<(i64, usize)> = all
            .iter()
            .enumerate()
            .filter(|(_, b)| b[0] == 1 && u32::from_le_bytes([b[1], b[2], b[3], b[4]]) == c)
            .map(|(p, b)| {
                let mut k = [0u8; 8];
                k.copy_from_slice(&b[5..13]);
                (i64::from_le_bytes(k), p)
            })
            .collect();
        group.sort();
        let members: Vec<usize> = group.iter().map(|&(_, p)| self.members[p]).collect();
        let rank = group.iter().position(|&(_, p)| p == self.rank).ok_or_else(|| Error::invalid("internal: split lost this rank"))?;
        let id = fnv(&[u64::from(self.id), u64::from(count), u64::from(c)]).max(1);
        let any_tcp = members.iter().any(|&w| self.fabric.transport_name(w) == "tcp");
        Ok(Some(Communicator {
            any_tcp,
            fabric: self.fabric.clone(),
            id,
            rank,
            members,
            seqs: Mutex::default(),
            splits: Mutex::new(0),
            op_lock: Mutex::new(()),
            scratch: ScratchCache::default(),
        }))
    }

    /// Ends this rank's part: a barrier (so no member is still talking to it), then goodbye
    /// to every peer. Dropping a communicator without `finalize` skips the barrier.
    pub fn finalize(self) -> Result<()> {
        let r = self.run(|| self.barrier_inner());
        if self.id == 0 {
            self.fabric.close();
        }
        r
    }
}
