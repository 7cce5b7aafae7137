//! shm's unit tests.

use super::*;

/// Rank 1's endpoint to rank 0, both segments in this process.
fn pair() -> (Arc<LocalShm>, ShmEndpoint) {
    let ring = 1 << 16;
    let owner = Arc::new(LocalShm::create("ferroccl-test-last-words-0", 0, 2, ring).unwrap());
    let me = Arc::new(LocalShm::create("ferroccl-test-last-words-1", 1, 2, ring).unwrap());
    let pid = std::process::id() as i32;
    let ep = ShmEndpoint::connect(1, 0, pid, owner.fd().unwrap(), owner.name(), 2, ring, 4096, false, me).unwrap();
    (owner, ep)
}

#[test]
fn last_words_are_read_by_a_peer_and_the_first_stay() {
    let (owner, ep) = pair();
    assert_eq!(ep.last_words(), None, "nothing left yet");
    assert!(!owner.leave_last_words(&vec![7u8; LAST_MAX + 1]), "too long: not left");
    assert!(!owner.leave_last_words(&[]), "empty: not left");
    assert_eq!(ep.last_words(), None);
    assert!(owner.leave_last_words(b"first"));
    assert!(!owner.leave_last_words(b"second"), "a rank gives up once");
    assert_eq!(ep.last_words().as_deref(), Some(&b"first"[..]));
}
