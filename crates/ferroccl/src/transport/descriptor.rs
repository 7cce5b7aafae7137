//! What a rank publishes about itself while the mesh is built: one [`Descriptor`], packed
//! into one store value, all of them exchanged in one all-gather by mesh setup. The facts
//! every transport decides by come first (pid, host identity, host name, the eager limit),
//! then each transport's own part: [`ShmInfo`], [`TcpInfo`], [`VerbsInfo`]. A transport
//! reads its part of two descriptors to say whether it can reach a peer (`can_connect`),
//! and of the peer's to connect to it.
//!
//! The verbs part holds the queue-pair data of every queue pair this rank made ready for
//! its peers (one per other rank), as raw bytes: the layout is the same in a build without
//! the `verbs` feature, which decodes it without being able to use it.

use crate::wire::{DResult, DecodeError, Reader, Writer};

/// Length of a queue pair's connect data (QPN, PSN, LID, GID: `ferroccl_verbs::ConnectInfo`).
pub(crate) const QP_CONNECT_LEN: usize = 26;

/// What a rank publishes about itself (see the module docs).
#[derive(Debug, Clone)]
pub(crate) struct Descriptor {
    /// The publishing rank (a world rank), checked against the key it was read from.
    pub(crate) rank: u32,
    pub(crate) pid: u32,
    /// Ranks with equal host ids are on one host: same boot, mount and pid namespaces.
    pub(crate) host_id: String,
    /// For messages.
    pub(crate) hostname: String,
    /// `FERROCCL_EAGER_MAX`, which must agree between ranks.
    pub(crate) eager_max: u64,
    /// This rank's inbox segment (`None`: no shm here).
    pub(crate) shm: Option<ShmInfo>,
    /// This rank's listener (`None`: no tcp here).
    pub(crate) tcp: Option<TcpInfo>,
    /// This rank's queue pairs, or why it has none.
    pub(crate) verbs: VerbsInfo,
}

/// The shm part: where peers map this rank's inbox segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ShmInfo {
    /// The segment's memfd name and descriptor number (opened through `/proc/<pid>/fd`).
    pub(crate) name: String,
    pub(crate) fd: u32,
    /// An address in this process that peers read to learn whether cross-memory attach
    /// works from them to us.
    pub(crate) probe_addr: u64,
    /// `FERROCCL_SHM_RING_BYTES`, which must agree between shm peers.
    pub(crate) ring_bytes: u64,
}

/// The tcp part: the address this rank listens on, and the connections it wants per peer
/// (`FERROCCL_TCP_SOCKETS`; a pair uses the smaller of its two ranks' numbers).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TcpInfo {
    pub(crate) addr: String,
    pub(crate) sockets: u8,
}

/// The verbs part.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum VerbsInfo {
    /// This rank offers no verbs (no device under `auto`, or another `FERROCCL_TRANSPORT`).
    Off,
    /// `FERROCCL_TRANSPORT=verbs`, but this rank cannot use verbs, and this is why: its peers
    /// fail at once with the reason instead of waiting for it.
    Failed(String),
    /// The device, its port's active MTU, and a queue pair ready to connect per other rank.
    Ready(VerbsReady),
}

/// A rank's usable verbs device and the queue pairs it created for its peers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct VerbsReady {
    pub(crate) dev: String,
    /// The port's active MTU in bytes (both ends of a queue pair use the smaller one).
    pub(crate) mtu: u32,
    pub(crate) qps: Vec<QpInfo>,
}

/// One queue pair a rank created for `peer`, and the eager ring `peer` writes into.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct QpInfo {
    pub(crate) peer: u32,
    /// QPN, PSN, LID, GID (`ferroccl_verbs::ConnectInfo::to_bytes`).
    pub(crate) connect: [u8; QP_CONNECT_LEN],
    pub(crate) ring_addr: u64,
    pub(crate) ring_rkey: u32,
}

impl VerbsReady {
    /// The queue pair this rank created for `peer`.
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    pub(crate) fn qp_for(&self, peer: usize) -> Option<&QpInfo> {
        self.qps.iter().find(|q| q.peer as usize == peer)
    }
}

const NONE: u8 = 0;
const SOME: u8 = 1;
const VERBS_OFF: u8 = 0;
const VERBS_READY: u8 = 1;
const VERBS_FAILED: u8 = 2;

impl Descriptor {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new();
        w.u32(self.rank).u32(self.pid).str(&self.host_id).str(&self.hostname).u64(self.eager_max);
        match &self.shm {
            None => w.u8(NONE),
            Some(s) => w.u8(SOME).str(&s.name).u32(s.fd).u64(s.probe_addr).u64(s.ring_bytes),
        };
        match &self.tcp {
            None => w.u8(NONE),
            Some(t) => w.u8(SOME).str(&t.addr).u8(t.sockets),
        };
        match &self.verbs {
            VerbsInfo::Off => w.u8(VERBS_OFF),
            VerbsInfo::Failed(why) => w.u8(VERBS_FAILED).str(why),
            VerbsInfo::Ready(v) => {
                w.u8(VERBS_READY).str(&v.dev).u32(v.mtu).u32(u32::try_from(v.qps.len()).expect("under 2^32 peers"));
                for q in &v.qps {
                    w.u32(q.peer).raw(&q.connect).u64(q.ring_addr).u32(q.ring_rkey);
                }
                &mut w
            }
        };
        w.finish()
    }

    pub(crate) fn decode(b: &[u8]) -> DResult<Descriptor> {
        let mut r = Reader::new(b);
        let (rank, pid) = (r.u32()?, r.u32()?);
        let (host_id, hostname) = (r.str()?.to_string(), r.str()?.to_string());
        let eager_max = r.u64()?;
        let shm = match r.u8()? {
            NONE => None,
            SOME => Some(ShmInfo { name: r.str()?.to_string(), fd: r.u32()?, probe_addr: r.u64()?, ring_bytes: r.u64()? }),
            t => return Err(DecodeError(format!("shm part tag {t}"))),
        };
        let tcp = match r.u8()? {
            NONE => None,
            SOME => Some(TcpInfo { addr: r.str()?.to_string(), sockets: r.u8()? }),
            t => return Err(DecodeError(format!("tcp part tag {t}"))),
        };
        let verbs = match r.u8()? {
            VERBS_OFF => VerbsInfo::Off,
            VERBS_FAILED => VerbsInfo::Failed(r.str()?.to_string()),
            VERBS_READY => {
                let (dev, mtu, n) = (r.str()?.to_string(), r.u32()?, r.u32()? as usize);
                // Each entry is 42 bytes: a count beyond what is left is garbage, not a
                // reason to allocate.
                if n > r.remaining() / (4 + QP_CONNECT_LEN + 12) {
                    return Err(DecodeError(format!("{n} queue pairs in {} bytes", r.remaining())));
                }
                let mut qps = Vec::with_capacity(n);
                for _ in 0..n {
                    let peer = r.u32()?;
                    let mut connect = [0u8; QP_CONNECT_LEN];
                    connect.copy_from_slice(r.raw(QP_CONNECT_LEN)?);
                    qps.push(QpInfo { peer, connect, ring_addr: r.u64()?, ring_rkey: r.u32()? });
                }
                VerbsInfo::Ready(VerbsReady { dev, mtu, qps })
            }
            t => return Err(DecodeError(format!("verbs part tag {t}"))),
        };
        r.end()?;
        Ok(Descriptor { rank, pid, host_id, hostname, eager_max, shm, tcp, verbs })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(verbs: VerbsInfo) -> Descriptor {
        Descriptor {
            rank: 3,
            pid: 4242,
            host_id: "boot/mnt/pid".into(),
            hostname: "node-a".into(),
            eager_max: 65536,
            shm: Some(ShmInfo { name: "ferroccl-1-3-abc".into(), fd: 7, probe_addr: 0xdead_beef, ring_bytes: 1 << 20 }),
            tcp: Some(TcpInfo { addr: "10.0.0.1:4000".into(), sockets: 4 }),
            verbs,
        }
    }

    #[test]
    fn round_trips_every_part() {
        let ready = VerbsReady {
            dev: "rxe0".into(),
            mtu: 1024,
            qps: vec![
                QpInfo { peer: 0, connect: [1; QP_CONNECT_LEN], ring_addr: 0x1000, ring_rkey: 9 },
                QpInfo { peer: 5, connect: [2; QP_CONNECT_LEN], ring_addr: 0x2000, ring_rkey: 10 },
            ],
        };
        for verbs in [VerbsInfo::Off, VerbsInfo::Failed("no device".into()), VerbsInfo::Ready(ready)] {
            let d = sample(verbs);
            let back = Descriptor::decode(&d.encode()).expect("decodes");
            assert_eq!((back.rank, back.pid, &back.host_id, &back.hostname, back.eager_max), (3, 4242, &d.host_id, &d.hostname, 65536));
            assert_eq!((&back.shm, &back.tcp, &back.verbs), (&d.shm, &d.tcp, &d.verbs));
        }
        let bare = Descriptor { shm: None, tcp: None, ..sample(VerbsInfo::Off) };
        let back = Descriptor::decode(&bare.encode()).expect("decodes");
        assert_eq!((back.shm, back.tcp), (None, None));
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        let good = sample(VerbsInfo::Ready(VerbsReady { dev: "d".into(), mtu: 4096, qps: vec![] })).encode();
        for cut in 0..good.len() {
            assert!(Descriptor::decode(&good[..cut]).is_err(), "a descriptor cut at {cut} decoded");
        }
        let mut long = good.clone();
        long.push(0);
        assert!(Descriptor::decode(&long).is_err());
        // A queue-pair count far beyond the bytes that follow.
        let mut huge = good;
        let n = huge.len();
        huge[n - 4..].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(Descriptor::decode(&huge).is_err());
    }
}
