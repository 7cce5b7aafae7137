//! verbs' registered memory and one-sided access without the owner: receive targets,
//! window and write-source registrations ([`register_user`], [`register_window`],
//! [`register_source`]), peers' window regions ([`RemoteRegion`]) read with RDMA READ
//! and written with RDMA WRITE, and the transport's [`RemoteMemory`] (revocation).

use super::*;

/// A peer's window as this rank reads it with RDMA READ: the address, rkey and length of
/// its memory region, as the owner gave them (`WINFO`), and whether the owner has revoked
/// them (`REVOKE`). A read is issued only while not revoked, and counts as in flight from
/// then until its completion is polled; the holder answers a revocation only once none
/// is, so no READ reaches the owner's region after it answered.
#[derive(Debug)]
pub(crate) struct RemoteRegion {
    pub(super) addr: u64,
    pub(super) rkey: u32,
    pub(super) len: u64,
    /// Whether the owner registered the region with `REMOTE_WRITE` (a read-write window):
    /// only then are RDMA WRITEs posted to it (the NIC would refuse them otherwise).
    pub(super) writable: bool,
    pub(super) state: Mutex<RegionState>,
}

#[derive(Debug, Default)]
pub(super) struct RegionState {
    pub(super) revoked: bool,
    /// Work requests reserved or posted and not yet completed.
    pub(super) in_flight: u64,
}

impl RemoteRegion {
    /// The window's length in bytes.
    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    /// Whether the owner lets this rank write the region with RDMA WRITE.
    pub(crate) fn writable(&self) -> bool {
        self.writable
    }

    /// No read is issued from now on.
    pub(crate) fn revoke(&self) {
        lock(&self.state).revoked = true;
    }

    /// Whether reads issued before [`revoke`](Self::revoke) are still in flight.
    pub(crate) fn in_flight(&self) -> bool {
        lock(&self.state).in_flight > 0
    }

    /// Reserves `n` reads unless revoked.
    pub(super) fn reserve(&self, n: u64) -> bool {
        let mut st = lock(&self.state);
        if st.revoked {
            return false;
        }
        st.in_flight += n;
        true
    }

    pub(super) fn done(&self, n: u64) {
        let mut st = lock(&self.state);
        st.in_flight = st.in_flight.saturating_sub(n);
    }
}

/// Address, rkey and length of a window's memory region, as its owner gives them to a
/// reader (`WINFO_REPLY`).
pub(crate) fn region_info(mr: &UserMr) -> (u64, u32, u64) {
    (mr.as_ptr() as u64, mr.rkey(), mr.len() as u64)
}

/// A memory region over a receive target: the rendezvous registration of a verbs peer.
pub(crate) type UserMr = MemoryRegion;

/// Registers `[offset, offset + len)` of `h` for a peer's RDMA WRITE, leasing the range
/// (see the module docs) until the returned region drops.
pub(crate) fn register_user(net: &VerbsNet, h: &RegionHandle, offset: usize, len: usize) -> Result<(RemoteBuf, UserMr)> {
    let lease = h.lease_mut(offset, len).map_err(|e| Error::internal(format!("rank {}: verbs receive buffer: {e}", net.rank)))?;
    let mr = net.pd.register_lease(lease, Access::REMOTE_WRITE).map_err(verr(net.rank, format!("register a {len}-byte receive buffer")))?;
    Ok((RemoteBuf { addr: mr.as_ptr() as u64, len: len as u64, key: u64::from(mr.rkey()) }, mr))
}

/// Registers the whole of window `h` as the source of zero-copy RDMA WRITEs (local read
/// only), once, when the window is made. The memory region holds a read lease on the
/// window's region, so the window's scope cannot end while it (or a work request posted
/// from it, see [`DirectSlots`]) lives. Fails naming the window's size (and, when the
/// memlock limit refused it, that limit and how to raise it).
///
/// A read-write window (`writable`) is registered over a writable lease with
/// `REMOTE_WRITE` too, so verbs peers write it with RDMA WRITE; a read-only window's
/// region allows `REMOTE_READ` only, and the NIC refuses a write through its rkey.
pub(crate) fn register_window(net: &VerbsNet, h: &RegionHandle, writable: bool) -> Result<UserMr> {
    let len = h.len();
    let bad = |e| Error::invalid(format!("rank {}: a {len}-byte window: {e}", net.rank));
    let what = format!("register a {len}-byte window for zero-copy reads and writes by verbs peers");
    if writable {
        let lease = h.lease_mut(0, len).map_err(bad)?;
        net.pd.register_lease(lease, Access::REMOTE_READ | Access::REMOTE_WRITE).map_err(verr(net.rank, what))
    } else {
        let lease = h.lease(0, len).map_err(bad)?;
        net.pd.register_lease(lease, Access::REMOTE_READ).map_err(verr(net.rank, what))
    }
}

/// Registers `[offset, offset + len)` of `h` as the source of RDMA WRITEs to a peer's
/// window (local read only), over a read lease held until the region drops (the last
/// work request posted from it holds a clone until its completion is polled).
pub(crate) fn register_source(net: &VerbsNet, h: &RegionHandle, offset: usize, len: usize) -> Result<Arc<UserMr>> {
    let lease = h.lease(offset, len).map_err(|e| Error::internal(format!("rank {}: verbs write source: {e}", net.rank)))?;
    net.pd
        .register_lease(lease, Access::empty())
        .map(Arc::new)
        .map_err(verr(net.rank, format!("register a {len}-byte source of a write to a window")))
}

/// Waits until no work request posted from `mr` is in flight (the caller holds the only
/// other clone), polling the completion queue, until `deadline`; returns whether it is
/// unused. A window's removal calls it, so its memory region (and lease) outlives every
/// read posted from it; past the deadline the region goes when the last completion is
/// polled.
pub(crate) fn wait_unused(net: &VerbsNet, mr: &Arc<UserMr>, deadline: Instant) -> bool {
    let mut backoff = Backoff::default();
    loop {
        if Arc::strong_count(mr) == 1 {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        let seen = net.inbox.bell_seen();
        if matches!(net.poll(), Ok(true)) {
            backoff.moved();
            continue;
        }
        backoff.idle(WAIT_NAP, Some(deadline), |until| net.inbox.sleep(seen, until, || false));
    }
}

/// Remote reads and writes of peers' windows.
impl VerbsEndpoint {
    /// Reads `r`'s rows of the peer's window `region` into `dst` with RDMA READs (pieces of
    /// at most [`DIRECT_BYTES`]; the last piece of each row reports the row's immediate to
    /// this rank's inbox when its completion is polled, as a peer's write with immediate
    /// does). Returns `Ok(false)`, having posted nothing, when the owner has revoked the
    /// region. Every piece must lie inside the region and inside `dst` (checked here, as
    /// the device checks the rkey's bounds), and `dst` must allow local writes.
    pub(crate) fn post_read(
        &self,
        region: &Arc<RemoteRegion>,
        dst: &Arc<UserMr>,
        r: &ReadReq,
        deadline: Instant,
        poll: &dyn Fn() -> Result<()>,
    ) -> Result<bool> {
        self.post_rma(region, dst, r, false, deadline, poll)
    }

    /// Writes `r`'s rows from `src` (the local side: `local_offset`, `local_stride`) into
    /// the peer's window `region` with RDMA WRITEs (no immediate: the owner's CPU takes no
    /// part), as [`post_read`](Self::post_read) reads: the last piece of each row reports
    /// the row's immediate to this rank's own inbox when its (signaled) completion is
    /// polled, which on a reliable connection means the peer's NIC has acknowledged it,
    /// so its bytes are placed in the window. Returns `Ok(false)`, having posted nothing,
    /// when the owner has revoked the region. The region must be writable (checked here:
    /// the NIC would refuse the write and break the connection).
    pub(crate) fn post_write_to(
        &self,
        region: &Arc<RemoteRegion>,
        src: &Arc<UserMr>,
        r: &ReadReq,
        deadline: Instant,
        poll: &dyn Fn() -> Result<()>,
    ) -> Result<bool> {
        if !region.writable {
            return Err(Error::internal(format!("rank {}: RDMA WRITE to a read-only window of rank {}", self.rank, self.peer)));
        }
        self.post_rma(region, src, r, true, deadline, poll)
    }

    /// [`post_read`](Self::post_read) (`write` false) or
    /// [`post_write_to`](Self::post_write_to) (`write` true).
    pub(super) fn post_rma(
        &self,
        region: &Arc<RemoteRegion>,
        dst: &Arc<UserMr>,
        r: &ReadReq,
        write: bool,
        deadline: Instant,
        poll: &dyn Fn() -> Result<()>,
    ) -> Result<bool> {
        let pe = self.net.peer(self.peer)?;
        let pieces_per_row = r.row.div_ceil(DIRECT_BYTES).max(1) as u64;
        let total = pieces_per_row * u64::from(r.rows);
        for i in 0..r.rows {
            let (ro, lo) = (
                r.remote_offset.checked_add(u64::from(i).saturating_mul(r.remote_stride)),
                (i as usize).checked_mul(r.local_stride).and_then(|x| x.checked_add(r.local_offset)),
            );
            let fits_remote = ro.and_then(|o| o.checked_add(r.row as u64)).is_some_and(|e| e <= region.len);
            let fits_local = lo.and_then(|o| o.checked_add(r.row)).is_some_and(|e| e <= dst.len());
            if !fits_remote || !fits_local {
                return Err(Error::internal(format!(
                    "rank {}: RDMA {} row {i} of {} bytes does not fit the {}-byte window of rank {} or the {}-byte local buffer",
                    self.rank,
                    if write { "WRITE" } else { "READ" },
                    r.row,
                    region.len,
                    self.peer,
                    dst.len()
                )));
            }
        }
        if !region.reserve(total) {
            return Ok(false);
        }
        let mut posted = 0u64;
        let res = self.post_rma_pieces(pe, region, dst, r, write, pieces_per_row, &mut posted, deadline, poll);
        // What was reserved and not posted is not in flight.
        region.done(total - posted);
        res.map(|()| true)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn post_rma_pieces(
        &self,
        pe: &Peer,
        region: &Arc<RemoteRegion>,
        dst: &Arc<UserMr>,
        r: &ReadReq,
        write: bool,
        pieces_per_row: u64,
        posted: &mut u64,
        deadline: Instant,
        poll: &dyn Fn() -> Result<()>,
    ) -> Result<()> {
        let start = Instant::now();
        let mut backoff = Backoff::default();
        for i in 0..r.rows {
            let ro = r.remote_offset + u64::from(i) * r.remote_stride;
            let lo = r.local_offset + i as usize * r.local_stride;
            let mut k = 0u64;
            while k < pieces_per_row {
                let pos = k as usize * DIRECT_BYTES;
                let piece = (r.row - pos.min(r.row)).min(DIRECT_BYTES);
                let last = k + 1 == pieces_per_row;
                let mut st = lock(&pe.st);
                if st.dead {
                    return Err(self.dead_err());
                }
                if st.sq_used >= SQ_DEPTH {
                    drop(st);
                    self.net.wait_round(self.peer, "verbs read (send queue full)", start, deadline, &mut backoff, poll)?;
                    continue;
                }
                let remote = RemoteSlice { addr: region.addr + ro + pos as u64, len: piece as u32, rkey: region.rkey };
                let slot = self.net.hold_read(ReadHold {
                    _dst: dst.clone(),
                    region: region.clone(),
                    imm: last.then(|| r.imm.wrapping_add(i) & !IMM_CTRL),
                });
                let off = lo + pos;
                let id = wr_id(WR_READ, self.peer, slot);
                let res = if write {
                    pe.qp.post_write_from(id, dst, off..off + piece, remote, None, true)
                } else {
                    pe.qp.post_read_into(id, dst, off..off + piece, remote, true)
                };
                if let Err(e) = res {
                    drop(st);
                    // Not posted: let go of the slot without counting a completion.
                    let _ = self.net.take_read(slot);
                    let what = if write { "write" } else { "read" };
                    return Err(verr(self.rank, format!("{what} {piece} bytes of a window of rank {}", self.peer))(e));
                }
                st.sq_used += 1;
                *posted += 1;
                drop(st);
                if write {
                    self.net.window_write_bytes.fetch_add(piece as u64, Ordering::Relaxed);
                } else {
                    self.net.read_bytes.fetch_add(piece as u64, Ordering::Relaxed);
                }
                k += 1;
            }
        }
        Ok(())
    }
}

impl RemoteMemory for VerbsNet {
    fn register_window(&self, h: &RegionHandle, writable: bool) -> Result<UserMr> {
        register_window(self, h, writable)
    }

    /// Sends the revocation to each holder and waits, polling the completion queue, until
    /// each has answered `REVOKED` (it issues no more READs on the window's region and none
    /// of its READs is in flight), its connection is gone (its queue pair reads nothing any
    /// more), or `deadline` passes.
    fn revoke(self: Arc<Self>, msg: &[u8], holders: &[usize], answered: &dyn Fn(&mut Events, usize) -> bool, deadline: Instant) -> usize {
        if holders.is_empty() {
            return 0;
        }
        let net = &self;
        let mut waiting: Vec<usize> = Vec::with_capacity(holders.len());
        for &p in holders {
            // A holder that cannot be told is one whose connection is gone.
            if VerbsEndpoint::to(net, p).post_send(msg, deadline, &|| Ok(())).is_ok() {
                waiting.push(p);
            }
        }
        let inbox = self.inbox();
        let mut backoff = Backoff::default();
        loop {
            let seen = inbox.bell_seen();
            {
                let mut ev = inbox.lock();
                waiting.retain(|&p| !answered(&mut ev, p) && !ev.closed.contains(&p));
            }
            waiting.retain(|&p| !VerbsEndpoint::to(net, p).is_dead());
            if waiting.is_empty() || Instant::now() >= deadline {
                return waiting.len();
            }
            if matches!(self.poll(), Ok(true)) {
                backoff.moved();
                continue;
            }
            backoff.idle(REVOKE_NAP, Some(deadline), |until| inbox.sleep(seen, until, || false));
        }
    }

    fn wait_unused(&self, mr: &Arc<UserMr>, deadline: Instant) -> bool {
        wait_unused(self, mr, deadline)
    }

    fn region_info(&self, mr: &UserMr) -> (u64, u32, u64) {
        region_info(mr)
    }

    fn bytes(&self) -> RemoteBytes {
        let (staged, zero_copy) = self.write_bytes();
        RemoteBytes { staged, zero_copy, window_writes: self.window_write_bytes(), reads: self.read_bytes() }
    }
}

/// How long a removal waiting for `REVOKED` parks at a time (the completion thread rings
/// the doorbell sooner when a message arrives).
const REVOKE_NAP: Duration = Duration::from_micros(200);
