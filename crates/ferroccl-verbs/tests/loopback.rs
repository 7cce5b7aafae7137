//! Real verbs traffic between two RC queue pairs on one device, connected to each other.
//!
//! Needs a verbs device: run inside the soft-RoCE VM (`tools/softroce/run.sh test`),
//! which sets `FERROCCL_IB_DEV` and `FERROCCL_IB_GID_INDEX`. Without `FERROCCL_IB_DEV`
//! each test says it is skipped and passes, unless `FERROCCL_VERBS_REQUIRED=1`.
#![cfg(feature = "verbs")]

use std::time::Duration;

use ferroccl_verbs::{
    Access, Completion, CompletionQueue, Context, DeviceList, Error, MemoryRegion, PortState, ProtectionDomain, QpOptions, QueuePair,
    ReadyToSend, WcOpcode, WcStatus,
};

/// Every wait on a completion ends by this deadline: a lost completion fails the test.
const DEADLINE: Duration = Duration::from_secs(20);
const MIB: usize = 1 << 20;

/// The device under test and its RoCEv2 GID index, or `None` (skip) outside the VM.
fn device() -> Option<(String, u8)> {
    match std::env::var("FERROCCL_IB_DEV") {
        Ok(dev) => {
            let gid = std::env::var("FERROCCL_IB_GID_INDEX").map_or(0, |g| g.parse().expect("FERROCCL_IB_GID_INDEX"));
            Some((dev, gid))
        }
        Err(_) => {
            assert!(
                std::env::var("FERROCCL_VERBS_REQUIRED").as_deref() != Ok("1"),
                "FERROCCL_VERBS_REQUIRED=1 but FERROCCL_IB_DEV is not set"
            );
            eprintln!("skipped: FERROCCL_IB_DEV is not set (no verbs device; see tools/softroce)");
            None
        }
    }
}

/// Two connected RC QPs on one device, each with its own CQ.
struct Pair {
    pd: ProtectionDomain,
    a: QueuePair<ReadyToSend>,
    b: QueuePair<ReadyToSend>,
    cq_a: CompletionQueue,
    cq_b: CompletionQueue,
}

fn pair() -> Option<Pair> {
    let (dev, gid_index) = device()?;
    let ctx = Context::open(&dev).expect("open device");
    let pd = ctx.alloc_pd().expect("alloc pd");
    let cq_a = ctx.create_cq(64).expect("create cq a");
    let cq_b = ctx.create_cq(64).expect("create cq b");
    let options = QpOptions { gid_index, ..QpOptions::default() };
    let a = pd.create_rc_qp(&cq_a, &cq_a, &options).expect("create qp a");
    let b = pd.create_rc_qp(&cq_b, &cq_b, &options).expect("create qp b");
    let (ia, ib) = (a.info().expect("info a"), b.info().expect("info b"));
    assert_ne!(ia.qpn, ib.qpn);
    let a = a.ready_to_receive(&ib).expect("a RTR").ready_to_send().expect("a RTS");
    let b = b.ready_to_receive(&ia).expect("b RTR").ready_to_send().expect("b RTS");
    Some(Pair { pd, a, b, cq_a, cq_b })
}

fn wait_one(cq: &CompletionQueue) -> Completion {
    let mut c = cq.wait(1, DEADLINE).expect("completion within the deadline");
    c.pop().expect("one completion")
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8).collect()
}

fn contents(mr: &MemoryRegion, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    mr.read(0, &mut v);
    v
}

#[test]
fn device_list_and_port() {
    let Some((dev, gid_index)) = device() else { return };
    let list = DeviceList::new().expect("device list");
    assert!(list.names().contains(&dev), "{dev} not in {:?}", list.names());
    let ctx = list.find(&dev).expect("find").open().expect("open");
    drop(list); // an open context outlives the list
    let port = ctx.query_port(1).expect("query port");
    assert_eq!(port.state, PortState::Active);
    assert!(port.active_mtu.bytes() >= 256, "{port:?}");
    let gid = ctx.query_gid(1, gid_index).expect("query gid");
    if let Ok(ip) = std::env::var("FERROCCL_IB_IP") {
        assert_eq!(gid.ipv4().map(|a| a.to_string()), Some(ip), "gid {gid}");
    }
    assert!(ferroccl_verbs::available());
    match Context::open("no-such-device") {
        Err(Error::DeviceNotFound { name, available }) => {
            assert_eq!(name, "no-such-device");
            assert!(available.contains(&dev));
        }
        other => panic!("expected DeviceNotFound, got {other:?}"),
    }
}

#[test]
fn send_recv_with_and_without_immediate() {
    let Some(p) = pair() else { return };
    let src = p.pd.alloc_region(4096, Access::empty()).unwrap(); // send source: local read only
    let dst = p.pd.alloc_region(8192, Access::LOCAL_WRITE).unwrap(); // receive target: no remote access
    let data = pattern(4096, 7);
    src.write(0, &data);
    // SAFETY: `dst` and `src` stay registered and untouched until the completions below.
    unsafe {
        p.b.post_recv(100, Some(dst.local(0..4096).unwrap())).unwrap();
        p.b.post_recv(101, Some(dst.local(4096..8192).unwrap())).unwrap();
        p.a.post_send(1, src.local(0..4096).unwrap(), None, true).unwrap();
        p.a.post_send(2, src.local(0..100).unwrap(), Some(0xfeed_0001), true).unwrap();
    }
    let sent = p.cq_a.wait(2, DEADLINE).unwrap();
    for c in &sent {
        assert_eq!(c.status, WcStatus::SUCCESS, "{c:?}");
        assert_eq!(c.opcode, WcOpcode::Send);
    }
    let got = p.cq_b.wait(2, DEADLINE).unwrap();
    let (r1, r2) = (&got[0], &got[1]);
    assert_eq!((r1.wr_id, r1.status, r1.opcode, r1.byte_len, r1.imm), (100, WcStatus::SUCCESS, WcOpcode::Recv, 4096, None));
    assert_eq!((r2.wr_id, r2.byte_len, r2.imm), (101, 100, Some(0xfeed_0001)));
    assert_eq!(r1.qp_num, p.b.qpn());
    let mut back = vec![0u8; 8192];
    dst.read(0, &mut back);
    assert_eq!(&back[..4096], &data[..]);
    assert_eq!(&back[4096..4196], &data[..100]);
}

#[test]
fn rdma_write_one_mib() {
    let Some(p) = pair() else { return };
    let src = p.pd.alloc_region(MIB, Access::empty()).unwrap();
    let dst = p.pd.alloc_region(MIB, Access::REMOTE_WRITE).unwrap();
    let data = pattern(MIB, 42);
    src.write(0, &data);
    // SAFETY: both regions stay registered and untouched until the completion.
    unsafe { p.a.post_write(2, src.local(0..MIB).unwrap(), dst.remote(0..MIB).unwrap(), true).unwrap() };
    let c = wait_one(&p.cq_a).into_result().unwrap();
    assert_eq!((c.wr_id, c.opcode), (2, WcOpcode::RdmaWrite));
    assert!(contents(&dst, MIB) == data, "RDMA WRITE data mismatch");
    // The peer saw no completion: a plain write consumes no receive.
    let mut none = Vec::new();
    assert_eq!(p.cq_b.poll(&mut none, 4).unwrap(), 0);
}

#[test]
fn rdma_write_with_immediate_completes_a_receive() {
    let Some(p) = pair() else { return };
    let len = 64 * 1024;
    let src = p.pd.alloc_region(len, Access::empty()).unwrap();
    let dst = p.pd.alloc_region(2 * len, Access::REMOTE_WRITE).unwrap();
    let data = pattern(len, 3);
    src.write(0, &data);
    // SAFETY: the regions stay registered and untouched until the completions.
    unsafe {
        p.b.post_recv(200, None).unwrap(); // a zero-byte receive is enough for WRITE_WITH_IMM
        p.a.post_write_imm(4, src.local(0..len).unwrap(), dst.remote(len..2 * len).unwrap(), 0xC0FFEE, true).unwrap();
    }
    let w = wait_one(&p.cq_a).into_result().unwrap();
    assert_eq!((w.wr_id, w.opcode), (4, WcOpcode::RdmaWrite));
    let r = wait_one(&p.cq_b).into_result().unwrap();
    assert_eq!((r.wr_id, r.opcode, r.imm, r.byte_len), (200, WcOpcode::RecvRdmaWithImm, Some(0xC0FFEE), len as u32));
    let mut got = vec![0u8; len];
    dst.read(len, &mut got);
    assert!(got == data, "WRITE_WITH_IMM data mismatch");
}

#[test]
fn rdma_read_one_mib() {
    let Some(p) = pair() else { return };
    let remote = p.pd.alloc_region(MIB, Access::REMOTE_READ).unwrap();
    let local = p.pd.alloc_region(MIB, Access::LOCAL_WRITE).unwrap();
    let data = pattern(MIB, 99);
    remote.write(0, &data);
    // SAFETY: both regions stay registered and untouched until the completion.
    unsafe { p.a.post_read(3, local.local(0..MIB).unwrap(), remote.remote(0..MIB).unwrap(), true).unwrap() };
    let c = wait_one(&p.cq_a).into_result().unwrap();
    assert_eq!((c.wr_id, c.opcode, c.byte_len), (3, WcOpcode::RdmaRead, MIB as u32));
    assert!(contents(&local, MIB) == data, "RDMA READ data mismatch");
}

#[test]
fn safe_rdma_read_into_a_local_write_region() {
    let Some(p) = pair() else { return };
    let remote = p.pd.alloc_region(MIB, Access::REMOTE_READ).unwrap();
    let local = p.pd.alloc_region(2 * MIB, Access::LOCAL_WRITE).unwrap();
    let data = pattern(MIB, 41);
    remote.write(0, &data);
    p.a.post_read_into(11, &local, MIB..2 * MIB, remote.remote(0..MIB).unwrap(), true).unwrap();
    let c = wait_one(&p.cq_a).into_result().unwrap();
    assert_eq!((c.wr_id, c.opcode, c.byte_len), (11, WcOpcode::RdmaRead, MIB as u32));
    let mut got = vec![0u8; MIB];
    local.read(MIB, &mut got);
    assert!(got == data, "RDMA READ (post_read_into) data mismatch");
    // A target without LOCAL_WRITE, or a range outside it, is refused before the device
    // sees it.
    let ro = p.pd.alloc_region(4096, Access::empty()).unwrap();
    let e = p.a.post_read_into(12, &ro, 0..4096, remote.remote(0..4096).unwrap(), true);
    assert!(matches!(e, Err(Error::InvalidArgument(_))), "{e:?}");
    let e = p.a.post_read_into(13, &local, 2 * MIB - 8..2 * MIB + 8, remote.remote(0..16).unwrap(), true);
    assert!(matches!(e, Err(Error::InvalidArgument(_))), "{e:?}");
}

#[test]
fn write_to_a_bad_rkey_is_an_error_completion() {
    let Some(p) = pair() else { return };
    let src = p.pd.alloc_region(4096, Access::empty()).unwrap();
    let dst = p.pd.alloc_region(4096, Access::REMOTE_WRITE).unwrap();
    let mut bad = dst.remote(0..4096).unwrap();
    bad.rkey ^= 0x00ab_cd00;
    // SAFETY: the regions stay registered until the completions.
    unsafe { p.a.post_write(5, src.local(0..4096).unwrap(), bad, true).unwrap() };
    let c = wait_one(&p.cq_a);
    assert_eq!((c.wr_id, c.status), (5, WcStatus::REMOTE_ACCESS_ERROR), "{c:?}");
    match c.into_result() {
        Err(e @ Error::WorkCompletion { wr_id: 5, .. }) => assert!(e.to_string().contains("IBV_WC_REM_ACCESS_ERR"), "{e}"),
        other => panic!("expected a WorkCompletion error, got {other:?}"),
    }
    // The QP is now in the error state: later work is flushed, not lost.
    // SAFETY: as above.
    unsafe { p.a.post_write(6, src.local(0..16).unwrap(), dst.remote(0..16).unwrap(), true).unwrap() };
    let c = wait_one(&p.cq_a);
    assert_eq!((c.wr_id, c.status), (6, WcStatus::FLUSHED), "{c:?}");
}

#[test]
fn read_without_remote_read_access_is_refused() {
    let Some(p) = pair() else { return };
    let remote = p.pd.alloc_region(4096, Access::REMOTE_WRITE).unwrap(); // writable, not readable
    let local = p.pd.alloc_region(4096, Access::LOCAL_WRITE).unwrap();
    // SAFETY: the regions stay registered until the completion.
    unsafe { p.a.post_read(7, local.local(0..4096).unwrap(), remote.remote(0..4096).unwrap(), true).unwrap() };
    let c = wait_one(&p.cq_a);
    assert_eq!((c.wr_id, c.status), (7, WcStatus::REMOTE_ACCESS_ERROR), "{c:?}");
}

#[test]
fn bad_arguments_are_errors() {
    let Some(p) = pair() else { return };
    let mr = p.pd.alloc_region(4096, Access::REMOTE_WRITE).unwrap();
    assert!(matches!(mr.local(4000..4097), Err(Error::InvalidArgument(_))));
    assert!(matches!(mr.remote(4096..4097), Err(Error::InvalidArgument(_))));
    assert!(matches!(p.pd.alloc_region(0, Access::empty()), Err(Error::InvalidArgument(_))));
    let remote = mr.remote(0..16).unwrap();
    assert!(remote.slice(8, 8).is_ok() && remote.slice(8, 9).is_err());
    // A write longer than its target is refused before it reaches the device.
    // SAFETY: nothing is posted (the call fails its argument check).
    let e = unsafe { p.a.post_write(8, mr.local(0..32).unwrap(), remote, true) };
    assert!(matches!(e, Err(Error::InvalidArgument(_))), "{e:?}");
    // A GID index past the table is refused with a message.
    let cq = p.pd.context().create_cq(4).unwrap();
    let qp = p.pd.create_rc_qp(&cq, &cq, &QpOptions { gid_index: 250, ..QpOptions::default() }).unwrap();
    assert!(matches!(qp.info(), Err(Error::InvalidArgument(_)) | Err(Error::Verb { .. })));
}

#[test]
fn handles_keep_their_parents_alive() {
    let Some((dev, gid_index)) = device() else { return };
    let (a, b, cq, mr_src, mr_dst) = {
        let ctx = Context::open(&dev).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(8).unwrap();
        let o = QpOptions { gid_index, ..QpOptions::default() };
        let a = pd.create_rc_qp(&cq, &cq, &o).unwrap();
        let b = pd.create_rc_qp(&cq, &cq, &o).unwrap();
        let (ia, ib) = (a.info().unwrap(), b.info().unwrap());
        let a = a.ready_to_receive(&ib).unwrap().ready_to_send().unwrap();
        let b = b.ready_to_receive(&ia).unwrap().ready_to_send().unwrap();
        let src = pd.alloc_region(64, Access::empty()).unwrap();
        let dst = pd.alloc_region(64, Access::REMOTE_WRITE).unwrap();
        (a, b, cq, src, dst) // ctx and pd dropped here
    };
    mr_src.write(0, b"still alive");
    // SAFETY: the regions stay registered and untouched until the completion.
    unsafe { a.post_write(9, mr_src.local(0..11).unwrap(), mr_dst.remote(0..11).unwrap(), true).unwrap() };
    wait_one(&cq).into_result().unwrap();
    let mut got = [0u8; 11];
    mr_dst.read(0, &mut got);
    assert_eq!(&got, b"still alive");
    drop((a, b));
}

#[test]
fn registering_past_the_memlock_limit_says_so() {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    use rustix::thread::{capabilities, set_capabilities, CapabilitySet};
    let Some((dev, _)) = device() else { return };
    let pd = Context::open(&dev).unwrap().alloc_pd().unwrap();
    // Root has CAP_IPC_LOCK, which lifts the limit: drop it from this thread's
    // effective set (keeping it permitted) and lower the soft limit, then restore both.
    let caps = capabilities(None).unwrap();
    let old = getrlimit(Resource::Memlock);
    let mut lowered = caps;
    lowered.effective.remove(CapabilitySet::IPC_LOCK);
    set_capabilities(None, lowered).unwrap();
    setrlimit(Resource::Memlock, Rlimit { current: Some(64 * 1024), maximum: old.maximum }).unwrap();
    let result = pd.alloc_region(4 * MIB, Access::LOCAL_WRITE);
    setrlimit(Resource::Memlock, old).unwrap();
    set_capabilities(None, caps).unwrap();
    match result {
        Err(e @ Error::MemlockLimit { requested, limit: 65536, .. }) => {
            assert_eq!(requested, 4 * MIB);
            let msg = e.to_string();
            assert!(msg.contains("RLIMIT_MEMLOCK") && msg.contains("ulimit -l"), "{msg}");
        }
        other => panic!("expected MemlockLimit, got {other:?}"),
    }
    // With the limit back, the same registration works.
    pd.alloc_region(4 * MIB, Access::LOCAL_WRITE).unwrap();
}

#[test]
fn completion_channel_wakes_a_sleeper_and_leases_register_user_memory() {
    let Some((dev, gid_index)) = device() else { return };
    let ctx = Context::open(&dev).expect("open device");
    let pd = ctx.alloc_pd().expect("alloc pd");
    let chan = ctx.create_comp_channel().expect("completion channel");
    let cq_b = ctx.create_cq_with_channel(64, &chan).expect("cq with channel");
    let cq_a = ctx.create_cq(64).expect("cq a");
    assert!(cq_a.req_notify().is_err(), "arming a CQ without a channel must fail");
    let options = QpOptions { gid_index, ..QpOptions::default() };
    let a = pd.create_rc_qp(&cq_a, &cq_a, &options).expect("qp a");
    let b = pd.create_rc_qp(&cq_b, &cq_b, &options).expect("qp b");
    let (ia, ib) = (a.info().expect("info a"), b.info().expect("info b"));
    let a = a.ready_to_receive(&ib).expect("a RTR").ready_to_send().expect("a RTS");
    let b = b.ready_to_receive(&ia).expect("b RTR").ready_to_send().expect("b RTS");
    b.post_recv_empty(9).expect("post empty receive");
    cq_b.req_notify().expect("arm");
    // Nothing yet: the wait times out.
    assert!(!chan.wait(&cq_b, Duration::from_millis(10)).expect("wait"));

    // The target is a user buffer registered through a lease on its region.
    let src = pd.alloc_region(4096, Access::empty()).expect("src");
    src.write(0, &pattern(4096, 3));
    let mut user = vec![0u8; 8192];
    ferroccl_mem::with_region(&mut user, |h| {
        let lease = h.lease_mut(4096, 4096).expect("lease");
        let mr = pd.register_lease(lease, Access::REMOTE_WRITE).expect("register lease");
        let remote = mr.remote(0..4096).expect("remote");
        a.post_write_from(1, &src, 0..4096, remote, Some(77), true).expect("post write with imm");
        assert!(chan.wait(&cq_b, DEADLINE).expect("wait for the event"), "no completion event");
        let c = wait_one(&cq_b);
        assert_eq!((c.wr_id, c.imm, c.status), (9, Some(77), WcStatus::SUCCESS));
        wait_one(&cq_a).into_result().expect("write completion");
        // Dropping the region deregisters it, then releases the lease: the scope can end.
        drop(mr);
        // A read lease takes REMOTE_READ (peers read the bytes), never a write right.
        let mr = pd.register_lease(h.lease(0, 4096).expect("read lease"), Access::REMOTE_READ).expect("register a read lease");
        assert!(mr.access().contains(Access::REMOTE_READ));
        drop(mr);
        let e = pd.register_lease(h.lease(0, 4096).expect("read lease"), Access::REMOTE_WRITE);
        assert!(matches!(e, Err(Error::InvalidArgument(_))), "{e:?}");
    });
    assert_eq!(&user[4096..], &pattern(4096, 3)[..]);
    assert!(user[..4096].iter().all(|&x| x == 0));
}
