//! tcp's unit tests.

use super::*;
use crate::inbox::{Bell, Inbox};
use ferroccl_mem::InterfaceAddr;

fn iface(name: &str, ip: &str, up: bool) -> InterfaceAddr {
    InterfaceAddr { name: name.into(), ip: ip.parse().unwrap(), up, loopback: name == "lo" }
}

/// NCCL_SOCKET_IFNAME's rules: prefixes, `=` exact, `^` exclude; the first up match in
/// the kernel's order; its IPv4 address before its IPv6 one.
#[test]
fn interfaces_are_picked_as_nccl_picks_them() {
    let all = [
        iface("lo", "127.0.0.1", true),
        iface("lo", "::1", true),
        iface("eth0", "fd00::2", true),
        iface("eth0", "10.0.0.2", true),
        iface("eth1", "10.1.0.2", false),
        iface("eth10", "10.10.0.2", true),
        iface("ib0", "fd01::5", true),
    ];
    let pick = |f: &str| pick_interface(&IfnameFilter::parse(f).unwrap(), &all).map(|ip| ip.to_string());
    assert_eq!(pick("eth").as_deref(), Some("10.0.0.2"));
    assert_eq!(pick("=eth1"), None, "eth1 is down");
    assert_eq!(pick("eth1").as_deref(), Some("10.10.0.2"), "a prefix: eth10 after the down eth1");
    assert_eq!(pick("^lo,eth").as_deref(), Some("fd01::5"), "IPv6 when that is all it has");
    assert_eq!(pick("^=lo").as_deref(), Some("10.0.0.2"));
    assert_eq!(pick("lo").as_deref(), Some("127.0.0.1"));
    assert_eq!(pick("docker"), None);
}

/// The knob wins over the store's side; an unmatched filter is an error naming the
/// variable and the host's interfaces; an IPv6 listener advertises a parsable address.
#[test]
fn the_listen_address_follows_the_knobs() {
    let store_side: IpAddr = "127.0.0.1".parse().unwrap();
    let mut p = Params::default();
    assert_eq!(listen_ip(&p, store_side).unwrap(), store_side);
    p.socket_ifname = IfnameFilter::parse("lo");
    assert!(listen_ip(&p, "10.9.9.9".parse().unwrap()).unwrap().is_loopback());
    p.socket_ifname = IfnameFilter::parse("=no-such-interface");
    let e = listen_ip(&p, store_side).unwrap_err().to_string();
    assert!(e.contains("FERROCCL_SOCKET_IFNAME") && e.contains("=no-such-interface") && e.contains("lo 127.0.0.1"), "{e}");
    p.socket_addr = Some("::1".parse().unwrap());
    assert_eq!(listen_ip(&p, store_side).unwrap().to_string(), "::1");
    if let Ok(setup) = TcpSetup::listen(0, "::1".parse().unwrap(), &Params::default()) {
        let addr = setup.info().addr;
        assert!(addr.starts_with("[::1]:") && addr.parse::<SocketAddr>().is_ok(), "{addr}");
    }
}
use std::io::Read;
use std::net::TcpListener;

/// `read_rows` puts every row in its place and leaves the gaps alone, however the
/// stream cuts the bytes (here in pieces of 1 to 997 bytes, so reads end mid-row and
/// mid-batch), for more rows than one `readv` batch.
#[test]
fn read_rows_scatters_rows_from_any_cut_of_the_stream() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut a = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    let (mut b, _) = listener.accept().unwrap();
    let (rows, row, stride) = (150usize, 37usize, 50usize);
    let data: Vec<u8> = (0..rows * row).map(|i| (i % 251) as u8).collect();
    let sent = data.clone();
    let writer = std::thread::spawn(move || {
        let mut at = 0;
        let mut k = 1usize;
        while at < sent.len() {
            let n = (k * 389 % 997 + 1).min(sent.len() - at);
            a.write_all(&sent[at..at + n]).unwrap();
            a.flush().unwrap();
            std::thread::sleep(Duration::from_micros(200));
            at += n;
            k += 1;
        }
    });
    let mut dst = vec![0xeeu8; (rows - 1) * stride + row];
    read_rows(&mut b, &mut dst, rows, row, stride).unwrap();
    writer.join().unwrap();
    for r in 0..rows {
        assert_eq!(&dst[r * stride..r * stride + row], &data[r * row..(r + 1) * row], "row {r}");
        if r + 1 < rows {
            assert!(dst[r * stride + row..(r + 1) * stride].iter().all(|&x| x == 0xee), "gap after row {r}");
        }
    }
    // A stream that ends early is an error, not a short success.
    let mut c = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    let (mut d, _) = listener.accept().unwrap();
    c.write_all(&data[..row * 3 + 5]).unwrap();
    drop(c);
    assert!(read_rows(&mut d, &mut dst, rows, row, stride).is_err());
}

/// A best-effort send into a socket whose peer is not reading (its buffers full) is
/// refused (`Ok(false)`) and leaves the stream intact: once the peer reads again, every frame
/// arrives whole and in order, and ordinary sends go on. (Before, the send waited 10 ms
/// for room, gave up mid-frame and broke the connection for good: a probe sent while a
/// large transfer filled the socket killed the job.)
#[test]
fn a_best_effort_send_into_a_full_socket_leaves_the_stream_intact() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let a = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    let (mut b, _) = listener.accept().unwrap();
    let knobs = Knobs { sockets: 1, stripe_min: 1 << 20, zerocopy_min: None };
    let ep =
        TcpEndpoint::start(0, 1, vec![a], Arc::new(Inbox::new(0, Bell::heap())), Arc::new(Drive::default()), STAGE_MIN, knobs).unwrap();
    let msg = vec![7u8; 64 << 10];
    let mut sent = 0usize;
    loop {
        match ep.try_post_send_now(&msg, Instant::now() + Duration::from_millis(10)) {
            Ok(true) => sent += 1,
            Ok(false) => break,
            Err(e) => panic!("after {sent} frames: {e}"),
        }
        assert!(sent < 10_000, "the socket never filled");
    }
    // Again, after a while: still refused, still intact.
    std::thread::sleep(Duration::from_millis(30));
    assert!(matches!(ep.try_post_send_now(b"probe", Instant::now() + Duration::from_millis(10)), Ok(false)));
    // The peer reads again: a blocking send waits for room meanwhile.
    let reader = std::thread::spawn(move || {
        let mut frames = Vec::new();
        loop {
            let mut h = [0u8; HDR];
            b.read_exact(&mut h).unwrap();
            let len = u64::from_le_bytes(h[8..16].try_into().unwrap()) as usize;
            let mut body = vec![0u8; len];
            b.read_exact(&mut body).unwrap();
            let last = body == b"last";
            frames.push((h[0], body));
            if last {
                return frames;
            }
        }
    });
    ep.post_send(b"last", Instant::now() + Duration::from_secs(10)).unwrap();
    let frames = reader.join().unwrap();
    assert_eq!(frames.len(), sent + 1);
    assert!(frames[..sent].iter().all(|(k, body)| *k == K_MSG && *body == msg));
    ep.cut();
}

/// `lanes` connected loopback socket pairs: (this side's, the peer's).
fn socket_pairs(lanes: usize) -> (Vec<TcpStream>, Vec<TcpStream>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    (0..lanes)
        .map(|_| {
            let ours = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
            (ours, listener.accept().unwrap().0)
        })
        .unzip()
}

/// With several peers of one socket a driver's round asks epoll: only a socket with
/// bytes is named (by its index among the readings), a peer with several sockets every
/// round; once read, the socket is quiet again.
#[test]
fn a_driver_asks_only_the_sockets_with_bytes() {
    let inbox = Arc::new(Inbox::new(0, Bell::heap()));
    let drive = Arc::new(Drive::default());
    // Peers 1-3 with one socket each, peer 4 with two (read every round).
    let (mut eps, mut theirs) = (Vec::new(), Vec::new());
    for (peer, lanes) in [(1, 1), (2, 1), (3, 1), (4, 2)] {
        let (ours, them) = socket_pairs(lanes);
        let knobs = Knobs { sockets: lanes, stripe_min: 1 << 20, zerocopy_min: None };
        eps.push(TcpEndpoint::start(0, peer, ours, inbox.clone(), drive.clone(), STAGE_MIN, knobs).unwrap());
        theirs.push(them);
    }
    let readings: Vec<Arc<Reading>> = eps.iter().map(|e| e.lanes[0].reading.clone()).collect();
    let ready = Ready::new(0, &readings).unwrap().expect("3 peers of one socket are asked about");
    let asked = || {
        let mut v = Vec::new();
        ready.each(|i| v.push(i)).unwrap();
        v
    };
    assert_eq!(asked(), [3], "nothing arrived: only the striped peer");
    // Peer 2's reader thread cannot take the bytes while this holds its socket's lock.
    let held = readings[1].rd.lock().unwrap();
    theirs[1][0].write_all(&header(K_MSG, 0, 4, 0, 0)).unwrap();
    theirs[1][0].write_all(b"ping").unwrap();
    let until = Instant::now() + Duration::from_secs(5);
    while asked() != [1, 3] {
        assert!(Instant::now() < until, "peer 2's bytes were never reported: {:?}", asked());
        std::thread::sleep(Duration::from_millis(1));
    }
    drop(held);
    // Read (by a driver's pump here, or by the reader thread), the socket is quiet again.
    let _ = readings[1].drive_once();
    while asked() != [3] {
        assert!(Instant::now() < until, "peer 2's socket still reported after it was read: {:?}", asked());
        std::thread::sleep(Duration::from_millis(1));
    }
    // One peer of one socket (and any number of striped ones): nothing to ask.
    assert!(Ready::new(0, &readings[2..]).unwrap().is_none());
    for e in &eps {
        e.cut();
    }
}

/// A goodbye read on lane 1 before lane 0's (each lane has its own reader) ends that
/// lane only: the peer counts as closed once lane 0, which carries its last messages,
/// says goodbye too.
#[test]
fn only_lane_0s_goodbye_closes_the_peer() {
    let (ours, mut theirs) = socket_pairs(2);
    let inbox = Arc::new(Inbox::new(0, Bell::heap()));
    let knobs = Knobs { sockets: 2, stripe_min: 1 << 20, zerocopy_min: None };
    let ep = TcpEndpoint::start(0, 1, ours, inbox.clone(), Arc::new(Drive::default()), STAGE_MIN, knobs).unwrap();
    theirs[1].write_all(&header(K_BYE, 0, 0, 0, 0)).unwrap();
    let until = Instant::now() + Duration::from_secs(5);
    while !ep.lanes[1].reading.rd.lock().unwrap().ended {
        assert!(Instant::now() < until, "lane 1's goodbye was never read");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(!inbox.lock().closed.contains(&1), "lane 1's goodbye closed the peer");
    theirs[0].write_all(&header(K_BYE, 0, 0, 0, 0)).unwrap();
    while !inbox.lock().closed.contains(&1) {
        assert!(Instant::now() < until, "lane 0's goodbye did not close the peer");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(inbox.root_cause(Instant::now()).is_none(), "a goodbye is not a failure");
    ep.cut();
}

/// A frame its socket does not carry (a piece of a striped write on lane 0, a first
/// piece that names more pieces than there are other lanes, a message on lane 1) fails
/// the connection with a reason that names the frame's kind and the socket.
#[test]
fn frames_a_lane_does_not_carry_fail_the_connection() {
    let mut too_many = header(K_STRIPED, 0, 8, 1, 0);
    too_many[36..40].copy_from_slice(&2u32.to_le_bytes());
    for (lanes, bad_lane, h) in [(1, 0, header(K_STRIPE, 0, 8, 1, 0)), (2, 0, too_many), (2, 1, header(K_MSG, 0, 8, 0, 0))] {
        let (ours, mut theirs) = socket_pairs(lanes);
        let inbox = Arc::new(Inbox::new(0, Bell::heap()));
        let knobs = Knobs { sockets: lanes, stripe_min: 1 << 20, zerocopy_min: None };
        let ep = TcpEndpoint::start(0, 1, ours, inbox.clone(), Arc::new(Drive::default()), STAGE_MIN, knobs).unwrap();
        theirs[bad_lane].write_all(&h).unwrap();
        theirs[bad_lane].write_all(&[0u8; 8]).unwrap();
        let until = Instant::now() + Duration::from_secs(10);
        let fault = loop {
            if let Some(f) = inbox.root_cause(Instant::now()) {
                break f;
            }
            assert!(Instant::now() < until, "kind {} on socket {bad_lane} of {lanes}: the connection did not fail", h[0]);
            std::thread::sleep(Duration::from_millis(5));
        };
        let want = format!("kind {} that socket {bad_lane} of {lanes} does not carry", h[0]);
        assert!(fault.what.contains(&want) && fault.culprit == Some(1), "{fault:?}");
        ep.cut();
    }
}
