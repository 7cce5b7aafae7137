//! verbs' setup: the device opened with a queue pair and an eager ring per other rank
//! before the descriptor exchange ([`VerbsSetup::open`]), the queue pairs of the peers
//! chosen for verbs connected, and the `verbs-ready` round ([`VerbsSetup::connect_peers`]).

use super::*;

/// An opened, usable device.
#[derive(Debug)]
pub(super) struct VerbsDevice {
    pub(super) ctx: Context,
    pub(super) gid_index: u8,
    /// `FERROCCL_IB_TIMEOUT`.
    pub(super) ack_timeout: u8,
}

impl VerbsDevice {
    /// Opens `FERROCCL_IB_DEV` (or the first device) and checks that port 1 is active
    /// and has a usable GID. Every failure says why verbs cannot be used here.
    pub(super) fn open(rank: usize, params: &Params) -> Result<VerbsDevice> {
        let list = DeviceList::new().map_err(verr(rank, "list RDMA devices"))?;
        let dev = match &params.ib_dev {
            Some(name) => list.find(name).map_err(verr(rank, "FERROCCL_IB_DEV"))?,
            None => list.iter().next().ok_or(ferroccl_verbs::Error::NoDevice).map_err(verr(rank, "find an RDMA device"))?,
        };
        let name = dev.name();
        let ctx = dev.open().map_err(verr(rank, format!("open RDMA device {name}")))?;
        let port = ctx.query_port(1).map_err(verr(rank, format!("query port 1 of {name}")))?;
        if port.state != ferroccl_verbs::PortState::Active {
            return Err(Error::Transport {
                rank,
                peer: None,
                transport: TransportKind::Verbs,
                what: format!("port 1 of RDMA device {name} is not active ({:?})", port.state),
            });
        }
        let gid_index = match params.ib_gid_index {
            Some(i) => i,
            None => {
                // RoCE: an IPv4-mapped GID, RoCE v2 if the port says which (NICs list a v1
                // and a v2 entry per address); InfiniBand: index 0.
                let n = u8::try_from(port.gid_table_len.clamp(0, 255)).unwrap_or(u8::MAX);
                let ipv4: Vec<u8> = (0..n).filter(|&i| ctx.query_gid(1, i).is_ok_and(|g| g.ipv4().is_some())).collect();
                let v2 = |i: &&u8| {
                    std::fs::read_to_string(format!("/sys/class/infiniband/{name}/ports/1/gid_attrs/types/{i}"))
                        .is_ok_and(|t| t.trim().eq_ignore_ascii_case("RoCE v2"))
                };
                ipv4.iter().find(v2).or(ipv4.first()).copied().unwrap_or(0)
            }
        };
        Ok(VerbsDevice { ctx, gid_index, ack_timeout: params.ib_timeout })
    }

    /// The device's name, advertised in the rank's descriptor.
    pub(super) fn name(&self) -> String {
        self.ctx.name().to_string()
    }

    /// How every queue pair on this device is made.
    pub(super) fn qp_options(&self) -> QpOptions {
        QpOptions {
            gid_index: self.gid_index,
            max_send_wr: SQ_DEPTH,
            max_recv_wr: RQ_DEPTH,
            // Writes into the eager rings and rendezvous targets; reads of windows.
            remote_access: Access::REMOTE_WRITE | Access::REMOTE_READ,
            // Dead peers must be noticed: retry transport errors a bounded number of
            // times; receiver-not-ready (a busy peer) forever. 6, not 7: soft-RoCE (rxe)
            // treats a retry count of 7 like the RNR count's 7, as "retry forever", and a
            // keepalive to a dead peer then never fails.
            retry_cnt: 6,
            timeout: self.ack_timeout,
            rnr_retry: 7,
            ..QpOptions::default()
        }
    }
}

/// Whether verbs reaches `peer`: both ranks have a usable device and made a queue pair for
/// each other.
pub(crate) fn can_connect(me: &Descriptor, peer: &Descriptor) -> std::result::Result<(), String> {
    let them = format!("rank {} (on {})", peer.rank, peer.hostname);
    match (&me.verbs, &peer.verbs) {
        (VerbsInfo::Ready(mine), VerbsInfo::Ready(theirs)) => {
            if theirs.qp_for(me.rank as usize).is_some() && mine.qp_for(peer.rank as usize).is_some() {
                Ok(())
            } else {
                Err(format!("{them} and rank {} made no queue pair for each other (FERROCCL_TRANSPORT differs between ranks?)", me.rank))
            }
        }
        (VerbsInfo::Ready(_), VerbsInfo::Failed(why)) => Err(format!("{them} has no usable RDMA device: {why}")),
        (VerbsInfo::Ready(_), VerbsInfo::Off) => {
            Err(format!("{them} has no usable RDMA device (FERROCCL_TRANSPORT differs between ranks?)"))
        }
        (_, _) => Err(format!("rank {} has no usable RDMA device", me.rank)),
    }
}

/// One queue pair made before the descriptor is published, for one peer: its data and
/// its receive ring's go into the descriptor.
pub(super) struct PreparedQp {
    pub(super) qp: QueuePair<ferroccl_verbs::Init>,
    pub(super) recv_ring: MemoryRegion,
}

/// This rank's side of verbs while the mesh is built: the device, the protection domain,
/// the completion queue, and a queue pair with its eager receive ring for every other rank
/// (which peers verbs will carry is known only once every descriptor is in; the queue
/// pairs of the others are dropped then).
pub(crate) struct VerbsSetup {
    pub(super) rank: usize,
    pub(super) dev: VerbsDevice,
    pub(super) pd: ProtectionDomain,
    pub(super) cq: CompletionQueue,
    pub(super) chan: ferroccl_verbs::CompletionChannel,
    /// This port's active MTU.
    pub(super) mtu: Mtu,
    /// Indexed by world rank (`None` for this rank).
    pub(super) qps: Vec<Option<PreparedQp>>,
}

impl std::fmt::Debug for VerbsSetup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsSetup").field("rank", &self.rank).field("dev", &self.dev.name()).finish_non_exhaustive()
    }
}

impl VerbsSetup {
    /// Opens `FERROCCL_IB_DEV` (or the first device) and creates the protection domain,
    /// the completion queue and channel, and per other rank a queue pair with its eager
    /// receive slots. Every failure says why verbs cannot be used here.
    pub(crate) fn open(rank: usize, size: usize, params: &Params) -> Result<VerbsSetup> {
        let dev = VerbsDevice::open(rank, params)?;
        let ctx = &dev.ctx;
        let pd = ctx.alloc_pd().map_err(verr(rank, "ibv_alloc_pd"))?;
        let npeers = size.saturating_sub(1) as u32;
        let cq_cap = npeers.saturating_mul(SQ_DEPTH + RQ_DEPTH).saturating_add(64);
        let chan = ctx.create_comp_channel().map_err(verr(rank, "ibv_create_comp_channel"))?;
        let cq = ctx.create_cq_with_channel(cq_cap, &chan).map_err(verr(rank, "ibv_create_cq"))?;
        let options = dev.qp_options();
        // Both ends of a queue pair must use one path MTU: each publishes its port's, and
        // each uses the smaller of the two.
        let mtu = ctx.query_port(1).map_err(verr(rank, "query port 1"))?.active_mtu;
        let mut qps = Vec::with_capacity(size);
        for p in 0..size {
            if p == rank {
                qps.push(None);
                continue;
            }
            let qp = pd.create_rc_qp(&cq, &cq, &options).map_err(verr(rank, format!("create a queue pair for rank {p}")))?;
            let recv_ring = pd
                .alloc_region(SLOTS * SLOT_BYTES, Access::REMOTE_WRITE)
                .map_err(verr(rank, format!("register receive slots for rank {p}")))?;
            qps.push(Some(PreparedQp { qp, recv_ring }));
        }
        Ok(VerbsSetup { rank, dev, pd, cq, chan, mtu, qps })
    }

    /// Our part of the descriptor: the device, the MTU, and per peer the queue pair's
    /// (QPN, PSN, LID, GID) and the receive ring's address and key.
    pub(crate) fn info(&self) -> Result<VerbsInfo> {
        let rank = self.rank;
        let mut qps = Vec::with_capacity(self.qps.len());
        for (p, prep) in self.qps.iter().enumerate() {
            let Some(prep) = prep else { continue };
            let info = prep.qp.info().map_err(verr(rank, format!("connect info for rank {p}")))?;
            let ring = prep.recv_ring.remote(0..SLOTS * SLOT_BYTES).map_err(verr(rank, "receive slots"))?;
            qps.push(QpInfo { peer: p as u32, connect: info.to_bytes(), ring_addr: ring.addr, ring_rkey: ring.rkey });
        }
        Ok(VerbsInfo::Ready(VerbsReady { dev: self.dev.name(), mtu: self.mtu.bytes(), qps }))
    }

    /// Connects the queue pairs of `peers` (chosen for verbs) to theirs, with the data in
    /// their descriptors (RTR, then RTS), then waits until every one of them is connected
    /// too (the `verbs-ready` round): a queue pair not yet ready to receive drops what
    /// arrives, and the sender would see it only after its retries (seconds). A rank that
    /// fails here publishes why in place of its ready mark, so its peers fail at once.
    /// The queue pairs made for other peers are dropped.
    pub(crate) fn connect_peers(mut self, cx: &SetupCx<'_>, peers: &[usize]) -> Result<(Arc<VerbsNet>, Connected)> {
        const READY: &str = "verbs-ready";
        let rank = cx.rank;
        let (stage, slots) = match self.connect_qps(cx, peers) {
            Ok(x) => x,
            Err(e) => {
                let mut w = Writer::new();
                w.u8(TAG_ERR).str(&e.to_string());
                let _ = cx.exchange.publish(READY, &w.finish());
                return Err(e);
            }
        };
        cx.exchange.publish(READY, &[TAG_OK])?;
        let readies = cx.exchange.gather(READY, peers, cx.deadline)?;
        for (&p, b) in peers.iter().zip(&readies) {
            if let Some(why) = peer_error(b) {
                return Err(Error::Transport {
                    rank,
                    peer: Some(p),
                    transport: TransportKind::Verbs,
                    what: format!("rank {p} could not connect: {why}"),
                });
            }
        }
        let VerbsSetup { pd, cq, chan, .. } = self;
        let stop = Arc::new(AtomicBool::new(false));
        let inbox = cx.inbox.clone();
        let net = Arc::new(VerbsNet {
            waker_stop: stop.clone(),
            waker: Mutex::new(None),
            rank,
            pd,
            cq,
            stage,
            stage_free: Mutex::new(if STAGE_SLOTS == 64 { u64::MAX } else { (1u64 << STAGE_SLOTS) - 1 }),
            peers: slots,
            direct: Mutex::new(DirectSlots::default()),
            reads: Mutex::new(ReadSlots::default()),
            staged_bytes: AtomicU64::new(0),
            direct_bytes: AtomicU64::new(0),
            read_bytes: AtomicU64::new(0),
            window_write_bytes: AtomicU64::new(0),
            polled: Mutex::new(Vec::with_capacity(256)),
            credits_owed: AtomicBool::new(false),
            inbox: inbox.clone(),
        });
        let waker = {
            let (cq, weak) = (net.cq.clone(), Arc::downgrade(&net));
            std::thread::Builder::new()
                .name("ferroccl-verbs-cq".into())
                .spawn(move || wake_loop(&chan, &cq, &inbox, &stop, &weak))
                .map_err(|e| Error::io(format!("rank {rank}: spawn the verbs completion thread"), e))?
        };
        *lock(&net.waker) = Some(waker);
        // Peers on this host are watched like shm peers, so that a dead one is noticed
        // without waiting for a work request to fail.
        let mut out = Connected::default();
        let me = &cx.descs[rank];
        for &p in peers {
            out.endpoints.push((p, Arc::new(VerbsEndpoint::new(net.clone(), p)) as Arc<dyn Endpoint>));
            let d = &cx.descs[p];
            if d.host_id == me.host_id {
                if let Ok(w) = ProcessWatch::new(d.pid as i32) {
                    out.watches.push((p, w));
                }
            }
        }
        Ok((net, out))
    }

    /// Registers the staging slots, and per peer in `peers` the send slots, posts its
    /// receives and connects its queue pair (RTR, RTS) to the peer's.
    pub(super) fn connect_qps(&mut self, cx: &SetupCx<'_>, peers: &[usize]) -> Result<(MemoryRegion, Vec<Option<Peer>>)> {
        let rank = self.rank;
        let stage = self.pd.alloc_region(STAGE_SLOTS * STAGE_BYTES, Access::empty()).map_err(verr(rank, "register the staging slots"))?;
        let mut slots: Vec<Option<Peer>> = (0..cx.size).map(|_| None).collect();
        for &p in peers {
            let bad = |what: String| Error::protocol(format!("rank {p}"), format!("verbs connect info: {what}"));
            let Some(VerbsInfo::Ready(theirs)) = cx.descs.get(p).map(|d| &d.verbs) else {
                return Err(bad("it published no queue pairs".into()));
            };
            let entry = theirs
                .qp_for(rank)
                .ok_or_else(|| bad(format!("no queue pair for rank {rank} (FERROCCL_TRANSPORT differs between ranks?)")))?;
            let info = ConnectInfo::from_bytes(&entry.connect).map_err(|e| bad(e.to_string()))?;
            let their_mtu = Mtu::from_bytes(theirs.mtu).ok_or_else(|| bad(format!("path MTU {}", theirs.mtu)))?;
            let mtu = if their_mtu.bytes() < self.mtu.bytes() { their_mtu } else { self.mtu };
            let prep = self
                .qps
                .get_mut(p)
                .and_then(Option::take)
                .ok_or_else(|| Error::internal(format!("rank {rank}: no verbs queue pair made for rank {p}")))?;
            let send_ring = self
                .pd
                .alloc_region(SLOTS * SLOT_BYTES, Access::empty())
                .map_err(verr(rank, format!("register send slots for rank {p}")))?;
            for _ in 0..RQ_DEPTH {
                prep.qp.post_recv_empty(wr_id(WR_RECV, p, 0)).map_err(verr(rank, format!("post receives for rank {p}")))?;
            }
            let qp = prep
                .qp
                .ready_to_receive_with_mtu(&info, Some(mtu))
                .and_then(|q| q.ready_to_send())
                .map_err(verr(rank, format!("connect the queue pair to rank {p}")))?;
            slots[p] = Some(Peer {
                peer: p,
                qp,
                send_ring,
                recv_ring: prep.recv_ring,
                remote: RemoteRing { addr: entry.ring_addr, rkey: entry.ring_rkey },
                st: Mutex::new(PeerState::default()),
            });
        }
        Ok((stage, slots))
    }
}

/// First byte of a published ready mark: the rest is empty, or the reason the rank could
/// not connect.
pub(super) const TAG_OK: u8 = 1;
pub(super) const TAG_ERR: u8 = 2;

/// The reason a peer published instead of its data, if it did.
pub(super) fn peer_error(b: &[u8]) -> Option<String> {
    let mut r = Reader::new(b);
    match r.u8() {
        Ok(TAG_ERR) => Some(r.str().map(str::to_string).unwrap_or_else(|_| "(unreadable reason)".into())),
        _ => None,
    }
}

/// The verbs transport: RC queue pairs between ranks with RDMA devices (see the module
/// docs).
#[derive(Debug)]
pub(crate) struct Verbs;

impl Transport for Verbs {
    fn kind(&self) -> TransportKind {
        TransportKind::Verbs
    }

    /// `auto` keeps verbs for ranks on other hosts: on one host it is shm, or tcp where a
    /// rank has no segment.
    fn allowed(&self, choice: TransportChoice, same_host: bool) -> bool {
        choice.named().map_or(!same_host, |k| k == TransportKind::Verbs)
    }

    /// The device, with a queue pair and an eager ring per other rank. Required
    /// (`FERROCCL_TRANSPORT=verbs`), a failure is published as the reason (so the peers
    /// fail at once too) and then fails setup; under `auto` the rank goes without verbs.
    fn open(&self, cx: &OpenCx<'_>, me: &mut Descriptor) -> Result<Opened> {
        if !cx.required && !ferroccl_verbs::ENABLED {
            return Ok(Opened::No);
        }
        match VerbsSetup::open(cx.rank, cx.size, cx.params).and_then(|v| Ok((v.info()?, v))) {
            Ok((info, v)) => {
                me.verbs = info;
                Ok(Opened::Yes(Box::new(v)))
            }
            Err(e) if cx.required => {
                me.verbs = VerbsInfo::Failed(e.to_string());
                Ok(Opened::Failed(e))
            }
            Err(_) => Ok(Opened::No),
        }
    }

    fn can_connect(&self, me: &Descriptor, peer: &Descriptor) -> std::result::Result<(), String> {
        can_connect(me, peer)
    }
}

impl Setup for VerbsSetup {
    fn connect(self: Box<Self>, cx: &SetupCx<'_>, peers: &[usize]) -> Result<(Box<dyn Net>, Connected)> {
        let (net, c) = self.connect_peers(cx, peers)?;
        Ok((Box::new(net), c))
    }
}
