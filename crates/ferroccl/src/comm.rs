//! The communicator: a group of ranks that can talk to each other.

use std::collections::HashMap;
use std::net::ToSocketAddrs;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferroccl_kernels::{as_bytes, as_bytes_mut, Element};
use ferroccl_mem::region::{with_region, with_region_ro};

use crate::bootstrap::env::{self, LaunchEnv, StoreRole};
use crate::bootstrap::{StoreClient, StoreServer};
use crate::error::{Error, Result};
use crate::fabric::{Fabric, FabricConfig};
use crate::params::Params;
use crate::proto::{self, Cts, CHAN_INTERNAL, CHAN_USER, EAGER_HEADER};
use crate::transport::WriteTicket;

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
}

/// Counts inits per (store, rank) so that several communicators in one job get distinct
/// store keys (every rank inits them in the same order).
fn init_generation(store: &str, rank: usize) -> u64 {
    static GEN: Mutex<Option<HashMap<(String, usize), u64>>> = Mutex::new(None);
    let mut g = GEN.lock().unwrap_or_else(|e| e.into_inner());
    let m = g.get_or_insert_with(HashMap::new);
    let n = m.entry((store.to_string(), rank)).or_insert(0);
    let v = *n;
    *n += 1;
    v
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
        let gen = init_generation(&addr, cfg.rank);
        let fabric = Fabric::connect(FabricConfig {
            rank: cfg.rank,
            size: cfg.world_size,
            token: cfg.token,
            params,
            store,
            server: server as Option<StoreServer>,
            key_prefix: format!("ferroccl/{gen}"),
        })?;
        if fabric.params.debug {
            for p in 0..fabric.size {
                if p != fabric.rank {
                    eprintln!("ferroccl: rank {} -> rank {p}: {}", fabric.rank, fabric.transport_name(p));
                }
            }
            eprintln!("ferroccl: rank {} connected in {:?}", fabric.rank, fabric.setup_time);
        }
        let members = (0..cfg.world_size).collect();
        Ok(Communicator {
            fabric: Arc::new(fabric),
            id: 0,
            rank: cfg.rank,
            members,
            seqs: Mutex::default(),
            splits: Mutex::new(0),
            op_lock: Mutex::new(()),
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

    fn is_eager(&self, wpeer: usize, len: usize) -> Result<bool> {
        let ep = self.fabric.endpoint(wpeer)?;
        Ok(len <= self.fabric.params.eager_max && EAGER_HEADER + len <= ep.max_send())
    }

    /// The error for waiting on a peer that has already left.
    fn closed_error(&self, peer: usize, op: &str) -> Error {
        Error::PeerFailed {
            rank: self.rank,
            peer,
            op: op.to_string(),
            reason: "closed its communicator before this operation matched (finalized or dropped early?)".into(),
        }
    }

    /// Tells `wpeer` that this operation failed on our side, then returns `err`.
    fn fail_both(&self, wpeer: usize, chan: u8, seq: u32, err: Error) -> Error {
        self.fabric.shared.lock().set_fatal(usize::MAX, err.to_string());
        if let Ok(ep) = self.fabric.endpoint(wpeer) {
            let msg = proto::encode_err(self.id, chan, seq, &err.to_string());
            let _ = ep.post_send(&msg, Instant::now() + Duration::from_secs(1), &|| self.fabric.progress());
        }
        err
    }

    fn send_bytes(&self, chan: u8, peer: usize, data: &[u8], op: &str) -> Result<()> {
        let wpeer = self.peer_world(peer, op)?;
        if let Some(e) = self.fabric.fatal_error(op) {
            return Err(e);
        }
        let ep = self.fabric.endpoint(wpeer)?;
        let seq = self.next_seq(true, chan, peer);
        let deadline = self.deadline();
        let poll = || self.fabric.progress();
        if self.is_eager(wpeer, data.len())? {
            return ep.post_send(&proto::encode_eager(self.id, chan, seq, data), deadline, &poll);
        }
        // Rendezvous: wait for the receiver's clear-to-send, then write into its buffer.
        let key = (self.id, chan, wpeer);
        let cts: Cts = self.fabric.wait_until(op, deadline, |ev| {
            let q = ev.cts.entry(key).or_default();
            match q.front() {
                Some(c) if c.seq == seq => Ok(q.pop_front()),
                Some(c) => Err(Error::protocol(format!("rank {peer}"), format!("{op}: clear-to-send #{} arrived, expected #{seq}", c.seq))),
                None if ev.closed.contains(&wpeer) => Err(self.closed_error(peer, op)),
                None => Ok(None),
            }
        })?;
        if cts.len != data.len() as u64 {
            let e = Error::Mismatch {
                rank: self.rank,
                peer,
                op: op.to_string(),
                what: format!("this rank sends {} bytes, rank {peer} receives {}", data.len(), cts.len),
            };
            return Err(self.fail_both(wpeer, chan, seq, e));
        }
        with_region_ro(data, |src| -> Result<()> {
            let ticket = ep.post_write(src, 0, data.len(), cts.buf, 0, cts.imm, deadline, &poll)?;
            if let WriteTicket::Pending { slot, gen } = ticket {
                let shm = self.fabric.local_shm().ok_or_else(|| Error::invalid("internal: pull without shm"))?.clone();
                let r = self.fabric.wait_until(op, deadline, |_| match shm.pull_status(slot, gen) {
                    Some(Ok(())) => Ok(Some(())),
                    Some(Err(())) => Err(Error::Transport {
                        rank: self.rank,
                        peer,
                        transport: "shm",
                        what: format!("{op}: rank {peer} could not copy the data"),
                    }),
                    None => Ok(None),
                });
                // Revoke before the buffer goes back to the caller, success or not.
                shm.release_slot(slot);
                r?;
            }
            Ok(())
        })
    }

    fn recv_bytes(&self, chan: u8, peer: usize, buf: &mut [u8], op: &str) -> Result<()> {
        self.recv_bytes_then(chan, peer, buf, op, || Ok(()))
    }

    /// Receives, running `between` once the receive is ready (its clear-to-send posted) and
    /// before waiting for the data: `sendrecv` sends there, so no pattern of sendrecvs can
    /// deadlock.
    fn recv_bytes_then(&self, chan: u8, peer: usize, buf: &mut [u8], op: &str, between: impl FnOnce() -> Result<()>) -> Result<()> {
        let wpeer = self.peer_world(peer, op)?;
        if let Some(e) = self.fabric.fatal_error(op) {
            return Err(e);
        }
        let ep = self.fabric.endpoint(wpeer)?;
        let seq = self.next_seq(false, chan, peer);
        let deadline = self.deadline();
        let key = (self.id, chan, wpeer);
        let len = buf.len();
        let mismatch = |got: usize| Error::Mismatch {
            rank: self.rank,
            peer,
            op: op.to_string(),
            what: format!("this rank receives {len} bytes, rank {peer} sends {got}"),
        };
        if self.is_eager(wpeer, len)? {
            between()?;
            let msg = self.fabric.wait_until(op, deadline, |ev| {
                let q = ev.data.entry(key).or_default();
                match q.front() {
                    Some(m) if m.seq == seq => Ok(q.pop_front()),
                    Some(m) => Err(Error::protocol(format!("rank {peer}"), format!("{op}: message #{} arrived, expected #{seq}", m.seq))),
                    None if ev.closed.contains(&wpeer) => Err(self.closed_error(peer, op)),
                    None => Ok(None),
                }
            })?;
            if msg.data.len() != len {
                return Err(self.fail_both(wpeer, chan, seq, mismatch(msg.data.len())));
            }
            buf.copy_from_slice(&msg.data);
            return Ok(());
        }
        let poll = || self.fabric.progress();
        with_region(buf, |dst| -> Result<()> {
            let remote = self.fabric.register(dst);
            let imm = self.fabric.next_imm();
            let r = (|| {
                let cts = Cts { seq, len: len as u64, buf: remote, imm };
                ep.post_send(&proto::encode_cts(self.id, chan, &cts), deadline, &poll)?;
                between()?;
                self.fabric.wait_until(op, deadline, |ev| {
                    if ev.imms.remove(&(wpeer, imm)) {
                        return Ok(Some(()));
                    }
                    // The sender thinks this message is small: it came eagerly instead.
                    if let Some(m) = ev.data.get(&key).and_then(|q| q.front()).filter(|m| m.seq == seq) {
                        return Err(mismatch(m.data.len()));
                    }
                    if ev.closed.contains(&wpeer) {
                        return Err(self.closed_error(peer, op));
                    }
                    Ok(None)
                })
            })();
            self.fabric.deregister(remote.key);
            r.map_err(|e| match e {
                e @ Error::Mismatch { .. } => self.fail_both(wpeer, chan, seq, e),
                e => e,
            })
        })
    }

    /// Sends `data` to member `peer`, which must call [`Communicator::recv`] with a buffer of
    /// the same length. Returns once `data` may be reused.
    pub fn send<T: Element>(&self, data: &[T], peer: usize) -> Result<()> {
        let _g = self.op_lock.lock().unwrap_or_else(|e| e.into_inner());
        self.send_bytes(CHAN_USER, peer, as_bytes(data), &format!("send to rank {peer}"))
    }

    /// Receives into `buf` from member `peer`; the sender's length must equal `buf.len()`.
    pub fn recv<T: Element>(&self, buf: &mut [T], peer: usize) -> Result<()> {
        let _g = self.op_lock.lock().unwrap_or_else(|e| e.into_inner());
        self.recv_bytes(CHAN_USER, peer, as_bytes_mut(buf), &format!("recv from rank {peer}"))
    }

    /// Sends `data` to member `to` and receives `buf` from member `from` in one call, which
    /// cannot deadlock whatever pattern the members form (rings, pairs, shifts). `to` and
    /// `from` may be this rank itself (then `data` is copied into `buf`).
    pub fn sendrecv<T: Element>(&self, data: &[T], to: usize, buf: &mut [T], from: usize) -> Result<()> {
        let _g = self.op_lock.lock().unwrap_or_else(|e| e.into_inner());
        let op = format!("sendrecv (to rank {to}, from rank {from})");
        let (d, b) = (as_bytes(data), as_bytes_mut(buf));
        match (to == self.rank, from == self.rank) {
            (true, true) if d.len() == b.len() => {
                b.copy_from_slice(d);
                Ok(())
            }
            (true, true) => Err(Error::invalid(format!("{op}: sends {} bytes to itself but receives {}", d.len(), b.len()))),
            (true, false) | (false, true) => Err(Error::invalid(format!("{op}: only one side is this rank itself"))),
            (false, false) => self.recv_bytes_then(CHAN_USER, from, b, &op, || self.send_bytes(CHAN_USER, to, d, &op)),
        }
    }

    /// Waits until every member has entered the barrier (dissemination: ⌈log2 n⌉ rounds of
    /// empty messages).
    pub fn barrier(&self) -> Result<()> {
        let _g = self.op_lock.lock().unwrap_or_else(|e| e.into_inner());
        self.barrier_locked()
    }

    fn barrier_locked(&self) -> Result<()> {
        let n = self.size();
        let mut k = 1;
        while k < n {
            let to = (self.rank + k) % n;
            let from = (self.rank + n - k) % n;
            self.send_bytes(CHAN_INTERNAL, to, &[], "barrier")?;
            self.recv_bytes(CHAN_INTERNAL, from, &mut [], "barrier")?;
            k *= 2;
        }
        Ok(())
    }

    /// Splits the communicator, like `MPI_Comm_split`: members that pass the same `color`
    /// form a new communicator, ordered by `key` (ties by their rank here). `None` as the
    /// color leaves this rank out (it gets `Ok(None)`). Every member must call it.
    /// The new communicators share this one's connections.
    pub fn split(&self, color: Option<u32>, key: i64) -> Result<Option<Communicator>> {
        let _g = self.op_lock.lock().unwrap_or_else(|e| e.into_inner());
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
        Ok(Some(Communicator {
            fabric: self.fabric.clone(),
            id,
            rank,
            members,
            seqs: Mutex::default(),
            splits: Mutex::new(0),
            op_lock: Mutex::new(()),
        }))
    }

    /// Ends this rank's part: a barrier (so no member is still talking to it), then goodbye
    /// to every peer. Dropping a communicator without `finalize` skips the barrier.
    pub fn finalize(self) -> Result<()> {
        let r = {
            let _g = self.op_lock.lock().unwrap_or_else(|e| e.into_inner());
            self.barrier_locked()
        };
        if self.id == 0 {
            self.fabric.close();
        }
        r
    }

    /// Number of times a waiter slept on its doorbell (diagnostics).
    #[doc(hidden)]
    pub fn debug_wakeups(&self) -> u64 {
        self.fabric.wakeups()
    }
}
