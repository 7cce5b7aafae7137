//! Mutual challenge-response authentication on a fresh TCP stream.
//!
//! Both ends prove that they know the job token without sending it, and each end checks the
//! other's proof, so neither a stranger nor a stale or foreign server (a leftover store of
//! another job on the same port) is accepted.
//!
//! The exchange (all integers little endian):
//!
//! ```text
//! server -> client  "FCCL" | version u8 | ctx_len u8 | context | nonce_s[32]
//! client -> server  "FCCL" | version u8 | nonce_c[32] | mac_c[32]
//!     mac_c = HMAC-SHA256(token, label | context | "client" | nonce_s | nonce_c)
//! server -> client  0 | mac_s[32]                      (accepted)
//!     mac_s = HMAC-SHA256(token, label | context | "server" | nonce_c | nonce_s)
//!                or 1 | reason_len u8 | reason         (refused, then the server closes)
//! ```
//!
//! `label` is a fixed domain-separation string and every variable-length field inside the
//! MAC input is length-prefixed. `context` ("store", "mesh") keeps a proof made for one use
//! from being replayed in another; a context mismatch is reported as such. Fresh random
//! nonces on both sides make every proof single-use. MACs are compared in constant time.
//!
//! Every read and write is bounded by the caller's deadline (socket timeouts re-armed with
//! the time left before each call). Garbage, short reads and wrong magic give
//! [`Error::Protocol`]; a wrong token, a missing proof or a deadline that passes give
//! [`Error::Auth`]. Nothing here panics on any input.

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::error::{Error, Result};
use crate::wire::{DecodeError, Reader, Writer};

type HmacSha256 = Hmac<Sha256>;

const MAGIC: &[u8; 4] = b"FCCL";
const VERSION: u8 = 1;
const NONCE_LEN: usize = 32;
const MAC_LEN: usize = 32;
const STATUS_OK: u8 = 0;
const STATUS_REFUSED: u8 = 1;
const MAC_LABEL: &[u8] = b"ferroccl-auth-v1\0";

/// The reason both sides give when the client's proof does not match the server's token.
pub(crate) const WRONG_TOKEN: &str = "wrong job token";

const NO_SERVER_PROOF: &str = "the server did not prove it knows the job token \
    (a stale or foreign server, or its FERROCCL_TOKEN differs from ours)";

/// 32 random bytes from the operating system, as 64 lowercase hex digits: a fresh job token.
///
/// # Panics
///
/// Only if the operating system's random number generator fails, which FerroCCL cannot
/// recover from (it could not make nonces either).
pub fn new_token() -> String {
    let mut b = [0u8; 32];
    getrandom::fill(&mut b).expect("the OS random number generator failed while making a job token");
    hex(&b)
}

pub(crate) fn hex(b: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(b.len() * 2);
    for &x in b {
        s.push(DIGITS[usize::from(x >> 4)] as char);
        s.push(DIGITS[usize::from(x & 15)] as char);
    }
    s
}

fn nonce(peer: &str) -> Result<[u8; NONCE_LEN]> {
    let mut n = [0u8; NONCE_LEN];
    getrandom::fill(&mut n)
        .map_err(|e| Error::Auth { peer: peer.to_owned(), reason: format!("cannot draw a random nonce from the OS: {e}") })?;
    Ok(n)
}

/// The keyed MAC over one side's view of the exchange.
fn proof(token: &str, context: &str, role: &str, first: &[u8], second: &[u8], peer: &str) -> Result<HmacSha256> {
    let mut m = <HmacSha256 as Mac>::new_from_slice(token.as_bytes())
        .map_err(|e| Error::Auth { peer: peer.to_owned(), reason: format!("cannot key the MAC: {e}") })?;
    m.update(MAC_LABEL);
    for field in [context.as_bytes(), role.as_bytes()] {
        m.update(&(field.len() as u32).to_le_bytes());
        m.update(field);
    }
    m.update(first);
    m.update(second);
    Ok(m)
}

/// Re-arms both socket timeouts with the time left before `deadline`.
fn arm(s: &TcpStream, deadline: Instant, peer: &str, what: &str) -> Result<()> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(timed_out(peer, what));
    }
    // A zero timeout is an error for set_*_timeout; `left` is non-zero here.
    let left = left.max(Duration::from_millis(1));
    s.set_read_timeout(Some(left)).map_err(|e| Error::io(format!("set read timeout on connection with {peer}"), e))?;
    s.set_write_timeout(Some(left)).map_err(|e| Error::io(format!("set write timeout on connection with {peer}"), e))?;
    Ok(())
}

fn timed_out(peer: &str, what: &str) -> Error {
    Error::Auth { peer: peer.to_owned(), reason: format!("handshake deadline passed while {what}") }
}

/// Reads exactly `buf.len()` bytes before `deadline`.
fn read_full(s: &mut TcpStream, buf: &mut [u8], deadline: Instant, peer: &str, what: &str) -> Result<()> {
    let mut got = 0;
    while got < buf.len() {
        arm(s, deadline, peer, what)?;
        match s.read(&mut buf[got..]) {
            Ok(0) => {
                return Err(Error::protocol(
                    peer,
                    format!("connection closed during the authentication handshake while {what} (got {got} of {} bytes)", buf.len()),
                ))
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => return Err(timed_out(peer, what)),
            Err(e) => return Err(Error::io(format!("authentication handshake with {peer}: {what}"), e)),
        }
    }
    Ok(())
}

fn write_full(s: &mut TcpStream, buf: &[u8], deadline: Instant, peer: &str, what: &str) -> Result<()> {
    let mut sent = 0;
    while sent < buf.len() {
        arm(s, deadline, peer, what)?;
        match s.write(&buf[sent..]) {
            Ok(0) => return Err(Error::protocol(peer, format!("connection closed while {what}"))),
            Ok(n) => sent += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => return Err(timed_out(peer, what)),
            Err(e) => return Err(Error::io(format!("authentication handshake with {peer}: {what}"), e)),
        }
    }
    Ok(())
}

/// Clears the handshake's socket timeouts so that the caller starts from a clean socket.
fn disarm(s: &TcpStream, peer: &str) -> Result<()> {
    s.set_read_timeout(None).map_err(|e| Error::io(format!("clear read timeout on connection with {peer}"), e))?;
    s.set_write_timeout(None).map_err(|e| Error::io(format!("clear write timeout on connection with {peer}"), e))
}

fn printable(b: &[u8]) -> String {
    String::from_utf8_lossy(b).chars().map(|c| if c.is_control() { '?' } else { c }).collect()
}

/// The connecting side: checks the server's hello, proves it knows `token`, and checks the
/// server's proof in return. `peer` names the server in errors.
pub(crate) fn client_handshake(s: &mut TcpStream, token: &str, context: &'static str, peer: &str, deadline: Instant) -> Result<()> {
    let mut head = [0u8; 6];
    read_full(s, &mut head, deadline, peer, "waiting for the server's hello")?;
    if &head[..4] != MAGIC {
        return Err(Error::protocol(peer, format!("not a FerroCCL endpoint: expected magic \"FCCL\", got {:02x?}", &head[..4])));
    }
    if head[4] != VERSION {
        return Err(Error::protocol(peer, format!("handshake version {} is not supported (this side speaks version {VERSION})", head[4])));
    }
    let mut rest = vec![0u8; usize::from(head[5]) + NONCE_LEN];
    read_full(s, &mut rest, deadline, peer, "reading the server's hello")?;
    let (their_ctx, nonce_s) = rest.split_at(usize::from(head[5]));
    if their_ctx != context.as_bytes() {
        return Err(Error::protocol(
            peer,
            format!("peer offers a \"{}\" connection but this side wants \"{context}\"", printable(their_ctx)),
        ));
    }

    let nonce_c = nonce(peer)?;
    let mac_c = proof(token, context, "client", nonce_s, &nonce_c, peer)?.finalize().into_bytes();
    let mut msg = Vec::with_capacity(5 + NONCE_LEN + MAC_LEN);
    msg.extend_from_slice(MAGIC);
    msg.push(VERSION);
    msg.extend_from_slice(&nonce_c);
    msg.extend_from_slice(&mac_c);
    write_full(s, &msg, deadline, peer, "sending our proof")?;

    let mut status = [0u8; 1];
    read_full(s, &mut status, deadline, peer, "waiting for the server's verdict")?;
    match status[0] {
        STATUS_OK => {
            let mut mac_s = [0u8; MAC_LEN];
            read_full(s, &mut mac_s, deadline, peer, "reading the server's proof")?;
            let expected = proof(token, context, "server", &nonce_c, nonce_s, peer)?;
            if expected.verify_slice(&mac_s).is_err() {
                return Err(Error::Auth { peer: peer.to_owned(), reason: NO_SERVER_PROOF.into() });
            }
            disarm(s, peer)
        }
        STATUS_REFUSED => {
            let mut len = [0u8; 1];
            read_full(s, &mut len, deadline, peer, "reading the server's refusal")?;
            let mut why = vec![0u8; usize::from(len[0])];
            read_full(s, &mut why, deadline, peer, "reading the server's refusal")?;
            Err(Error::Auth { peer: peer.to_owned(), reason: format!("the server refused us: {}", printable(&why)) })
        }
        other => Err(Error::protocol(peer, format!("unknown handshake status byte {other:#04x}"))),
    }
}

/// The accepting side: sends a challenge, checks the client's proof (refusing it with a
/// reason the client will see) and proves in return that it knows `token`. `peer` names the
/// client in errors.
pub(crate) fn server_handshake(s: &mut TcpStream, token: &str, context: &'static str, peer: &str, deadline: Instant) -> Result<()> {
    let ctx_len =
        u8::try_from(context.len()).map_err(|_| Error::invalid(format!("handshake context {context:?} is longer than 255 bytes")))?;
    let nonce_s = nonce(peer)?;
    let mut hello = Writer::new();
    hello.raw(MAGIC).u8(VERSION).u8(ctx_len).raw(context.as_bytes()).raw(&nonce_s);
    write_full(s, &hello.finish(), deadline, peer, "sending our hello")?;

    let mut msg = [0u8; 5 + NONCE_LEN + MAC_LEN];
    read_full(s, &mut msg, deadline, peer, "waiting for the client's proof")?;
    let mut r = Reader::new(&msg);
    let parsed = (|| Ok::<_, DecodeError>((r.raw(4)?, r.u8()?, r.raw(NONCE_LEN)?, r.raw(MAC_LEN)?)))();
    let (magic, version, nonce_c, mac_c) = parsed.map_err(|e| Error::protocol(peer, format!("bad handshake message: {e}")))?;
    if magic != MAGIC {
        return Err(Error::protocol(peer, format!("not a FerroCCL client: expected magic \"FCCL\", got {magic:02x?}")));
    }
    if version != VERSION {
        let why = format!("handshake version {version} is not supported (this side speaks version {VERSION})");
        refuse(s, &why, deadline, peer);
        return Err(Error::protocol(peer, why));
    }
    if proof(token, context, "client", &nonce_s, nonce_c, peer)?.verify_slice(mac_c).is_err() {
        refuse(s, &format!("{WRONG_TOKEN} (the client's FERROCCL_TOKEN differs from this job's)"), deadline, peer);
        return Err(Error::Auth {
            peer: peer.to_owned(),
            reason: format!("{WRONG_TOKEN}: the client's proof does not match this job's token"),
        });
    }
    let mac_s = proof(token, context, "server", nonce_c, &nonce_s, peer)?.finalize().into_bytes();
    let mut ok = Vec::with_capacity(1 + MAC_LEN);
    ok.push(STATUS_OK);
    ok.extend_from_slice(&mac_s);
    write_full(s, &ok, deadline, peer, "sending our proof")?;
    disarm(s, peer)
}

/// Best effort: tells the client why it is refused. Errors are ignored (the caller is about
/// to drop the connection and report its own error).
fn refuse(s: &mut TcpStream, why: &str, deadline: Instant, peer: &str) {
    let why = &why.as_bytes()[..why.len().min(255)];
    let mut m = Vec::with_capacity(2 + why.len());
    m.push(STATUS_REFUSED);
    m.push(why.len() as u8);
    m.extend_from_slice(why);
    let _ = write_full(s, &m, deadline, peer, "sending our refusal");
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;
    use std::thread;

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        (c, s)
    }

    fn soon() -> Instant {
        Instant::now() + Duration::from_secs(5)
    }

    fn run(client_token: &str, server_token: &str, cctx: &'static str, sctx: &'static str) -> (Result<()>, Result<()>) {
        let (mut c, mut s) = pair();
        let st = server_token.to_owned();
        let h = thread::spawn(move || server_handshake(&mut s, &st, sctx, "client", soon()));
        let rc = client_handshake(&mut c, client_token, cctx, "server", soon());
        drop(c);
        (rc, h.join().unwrap())
    }

    #[test]
    fn same_token_succeeds_both_ways() {
        let t = new_token();
        let (c, s) = run(&t, &t, "store", "store");
        c.unwrap();
        s.unwrap();
    }

    #[test]
    fn new_token_is_64_hex_digits_and_fresh() {
        let a = new_token();
        assert_eq!(a.len(), 64);
        assert!(a.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
        assert_ne!(a, new_token());
    }

    fn assert_wrong_token(r: Result<()>, side: &str) {
        match r {
            Err(Error::Auth { reason, peer }) => {
                assert!(reason.contains(WRONG_TOKEN), "{side}: reason {reason:?} does not say the token is wrong");
                assert!(!peer.is_empty());
            }
            other => panic!("{side}: expected Error::Auth, got {other:?}"),
        }
    }

    #[test]
    fn wrong_token_fails_clearly_on_both_sides() {
        let (c, s) = run("not-the-token", &new_token(), "store", "store");
        assert_wrong_token(c, "client");
        assert_wrong_token(s, "server");
    }

    #[test]
    fn context_mismatch_is_refused() {
        let t = new_token();
        let (c, s) = run(&t, &t, "mesh", "store");
        match c {
            Err(Error::Protocol { what, .. }) => assert!(what.contains("\"store\"") && what.contains("\"mesh\""), "{what}"),
            other => panic!("expected Protocol, got {other:?}"),
        }
        assert!(s.is_err());
    }

    /// A server that does not know the token but claims success is refused by the client.
    #[test]
    fn fake_server_is_refused_by_client() {
        let (mut c, mut s) = pair();
        let h = thread::spawn(move || {
            let mut hello = Vec::new();
            hello.extend_from_slice(b"FCCL");
            hello.extend_from_slice(&[VERSION, 5]);
            hello.extend_from_slice(b"store");
            hello.extend_from_slice(&[7u8; NONCE_LEN]);
            s.write_all(&hello).unwrap();
            let mut reply = [0u8; 5 + NONCE_LEN + MAC_LEN];
            s.read_exact(&mut reply).unwrap();
            let mut fake = vec![STATUS_OK];
            fake.extend_from_slice(&[0xAB; MAC_LEN]);
            s.write_all(&fake).unwrap();
        });
        let r = client_handshake(&mut c, &new_token(), "store", "fake", soon());
        h.join().unwrap();
        match r {
            Err(Error::Auth { reason, peer }) => {
                assert_eq!(peer, "fake");
                assert!(reason.contains("did not prove it knows the job token"), "{reason}");
            }
            other => panic!("expected Error::Auth, got {other:?}"),
        }
    }

    #[test]
    fn wrong_magic_and_short_reads_are_protocol_errors() {
        // Server side: the client sends junk then closes.
        let (mut c, mut s) = pair();
        c.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        drop(c);
        let r = server_handshake(&mut s, "t", "store", "junk", soon());
        assert!(matches!(r, Err(Error::Protocol { ref peer, .. }) if peer == "junk"), "{r:?}");

        // Server side: 69 bytes of junk with the wrong magic.
        let (mut c, mut s) = pair();
        c.write_all(&[0x5a; 5 + NONCE_LEN + MAC_LEN]).unwrap();
        let r = server_handshake(&mut s, "t", "store", "junk", soon());
        assert!(matches!(r, Err(Error::Protocol { ref what, .. }) if what.contains("magic")), "{r:?}");

        // Client side: the server sends something else entirely.
        let (mut c, mut s) = pair();
        s.write_all(b"SSH-2.0-OpenSSH\r\n").unwrap();
        let r = client_handshake(&mut c, "t", "store", "ssh", soon());
        assert!(matches!(r, Err(Error::Protocol { ref what, .. }) if what.contains("magic")), "{r:?}");
    }

    #[test]
    fn silent_peer_hits_the_deadline() {
        let (mut c, _s) = pair();
        let t0 = Instant::now();
        let r = client_handshake(&mut c, "t", "store", "silent", Instant::now() + Duration::from_millis(150));
        assert!(t0.elapsed() < Duration::from_secs(3));
        assert!(matches!(r, Err(Error::Auth { ref reason, .. }) if reason.contains("deadline")), "{r:?}");
    }
}
