//! shm's setup: the inbox segment opened before the descriptor exchange ([`ShmSetup`]),
//! whether two descriptors are on one host ([`can_connect`]), and the peers' segments
//! mapped, pidfds opened and cross-memory attach probed ([`ShmSetup::connect_peers`]).

use super::*;

/// Whether shm reaches `peer`: both on one host (equal host identities) and both with an
/// inbox segment.
pub(crate) fn can_connect(me: &Descriptor, peer: &Descriptor) -> std::result::Result<(), String> {
    if peer.host_id != me.host_id {
        return Err(format!("it is on another host ({}, this is {})", peer.hostname, me.hostname));
    }
    match (&me.shm, &peer.shm) {
        (Some(_), Some(_)) => Ok(()),
        (_, None) => Err("it has no shared-memory segment".into()),
        (None, Some(_)) => Err("this rank has no shared-memory segment".into()),
    }
}

/// This rank's side of shm while the mesh is built: its inbox segment (the descriptor
/// names it) and the probe its peers read to learn whether they may pull from us.
#[derive(Debug)]
pub(crate) struct ShmSetup {
    pub(super) local: Arc<LocalShm>,
    /// Kept alive: peers probe cross-memory attach by reading it.
    pub(super) probe: Box<[u8; 64]>,
    pub(super) ring_bytes: usize,
    pub(super) inline_max: usize,
    pub(super) cma: bool,
}

impl ShmSetup {
    /// Creates this rank's inbox segment, sized for `world` senders.
    pub(crate) fn create(rank: usize, world: usize, params: &Params) -> Result<ShmSetup> {
        let name = format!("ferroccl-{}-{}-{}", std::process::id(), rank, unique_suffix());
        let local = LocalShm::create(&name, rank, world, params.shm_ring_bytes)
            .map_err(|e| Error::io(format!("rank {rank}: create shared-memory segment {name}"), e))?;
        Ok(ShmSetup {
            local: Arc::new(local),
            probe: Box::new([0x5a; 64]),
            ring_bytes: params.shm_ring_bytes,
            inline_max: params.shm_inline_max,
            cma: params.shm_cma,
        })
    }

    /// The doorbell peers ring (it lives in the segment, so that they can).
    pub(crate) fn bell(&self) -> Arc<dyn BellWords> {
        self.local.clone()
    }

    /// Closes the descriptor peers would open the segment through (when no peer uses shm;
    /// otherwise [`ShmNet::withdraw`], once every peer mapped it).
    pub(crate) fn withdraw(&self) {
        self.local.withdraw();
    }

    /// Our part of the descriptor.
    pub(crate) fn info(&self) -> ShmInfo {
        ShmInfo {
            name: self.local.name().to_string(),
            fd: self.local.fd().and_then(|f| u32::try_from(f).ok()).unwrap_or(0),
            probe_addr: self.probe.as_ptr() as u64,
            ring_bytes: self.ring_bytes as u64,
        }
    }

    /// Maps the inbox of every peer in `peers` (chosen for shm), opens a watch on each
    /// peer's process (a dead peer never drains its ring, so the fabric must see it go),
    /// and probes whether we may pull from it (said in our hello, [`ShmNet::greet`]).
    pub(crate) fn connect_peers(self, cx: &SetupCx<'_>, peers: &[usize]) -> Result<(ShmNet, Connected)> {
        let rank = cx.rank;
        let mut out = Connected::default();
        let mut net = ShmNet { local: self.local.clone(), peers: Vec::with_capacity(peers.len()), _probe: self.probe };
        for &p in peers {
            let d = &cx.descs[p];
            let info = d.shm.as_ref().ok_or_else(|| Error::internal(format!("shm chosen for rank {p}, which has no segment")))?;
            if info.ring_bytes != self.ring_bytes as u64 {
                return Err(Error::invalid(format!(
                    "FERROCCL_SHM_RING_BYTES differs between ranks: {} on rank {rank}, {} on rank {p}",
                    self.ring_bytes, info.ring_bytes
                )));
            }
            let ep = Arc::new(ShmEndpoint::connect(
                rank,
                p,
                d.pid as i32,
                info.fd as i32,
                &info.name,
                cx.size,
                self.ring_bytes,
                self.inline_max,
                self.cma,
                self.local.clone(),
            )?);
            let watch =
                ProcessWatch::new(d.pid as i32).map_err(|e| Error::io(format!("rank {rank}: watch rank {p} (pid {})", d.pid), e))?;
            out.watches.push((p, watch));
            let can_pull = self.cma && can_read_process(d.pid as i32, info.probe_addr);
            net.peers.push(ShmPeer { peer: p, ep: ep.clone(), can_pull });
            out.endpoints.push((p, ep as Arc<dyn Endpoint>));
        }
        Ok((net, out))
    }
}

pub(super) fn unique_suffix() -> String {
    let mut b = [0u8; 6];
    let _ = getrandom::fill(&mut b);
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The shm transport: ranks on one host (see the module docs).
#[derive(Debug)]
pub(crate) struct Shm;

impl Transport for Shm {
    fn kind(&self) -> TransportKind {
        TransportKind::Shm
    }

    /// This rank's inbox segment; without one (unless shm is required) peers on this host
    /// use another transport.
    fn open(&self, cx: &OpenCx<'_>, me: &mut Descriptor) -> Result<Opened> {
        match ShmSetup::create(cx.rank, cx.size, cx.params) {
            Ok(s) => {
                me.shm = Some(s.info());
                Ok(Opened::Yes(Box::new(s)))
            }
            Err(e) if cx.required => Err(e),
            Err(_) => Ok(Opened::No),
        }
    }

    fn can_connect(&self, me: &Descriptor, peer: &Descriptor) -> std::result::Result<(), String> {
        can_connect(me, peer)
    }
}

impl Setup for ShmSetup {
    /// The doorbell word in the inbox segment, so that peers on this host can wake us.
    fn bell(&self) -> Option<Bell> {
        Some(Bell::Mapped(ShmSetup::bell(self)))
    }

    fn connect(self: Box<Self>, cx: &SetupCx<'_>, peers: &[usize]) -> Result<(Box<dyn Net>, Connected)> {
        let (net, c) = self.connect_peers(cx, peers)?;
        Ok((Box::new(net), c))
    }

    fn unused(self: Box<Self>) {
        self.withdraw();
    }
}
