//! A communicator that is finalized leaves nothing behind in this process: no thread, no
//! socket or other file descriptor, no shared-memory mapping.

use std::time::Duration;

use ferroccl::bootstrap::{env::StoreRole, new_token, StoreServer};
use ferroccl::{Communicator, InitConfig, Params, TransportChoice};

fn count(dir: &str) -> usize {
    std::fs::read_dir(dir).map(|d| d.count()).unwrap_or(0)
}

fn shm_maps() -> usize {
    std::fs::read_to_string("/proc/self/maps").unwrap_or_default().lines().filter(|l| l.contains("ferroccl-")).count()
}

fn job(n: usize, transport: TransportChoice) {
    let token = new_token();
    let store = StoreServer::start("127.0.0.1:0".parse().unwrap(), &token, 1 << 20).unwrap();
    let addr = store.addr().to_string();
    std::thread::scope(|s| {
        for rank in 0..n {
            let (token, addr) = (token.clone(), addr.clone());
            s.spawn(move || {
                let cfg = InitConfig { rank, world_size: n, store: StoreRole::Connect(addr), token };
                let params = Params { transport, timeout: Duration::from_secs(30), ..Params::default() };
                let comm = Communicator::init_with(cfg, params).unwrap();
                let mut buf = vec![0u8; 200_000];
                let to = (rank + 1) % n;
                let from = (rank + n - 1) % n;
                comm.sendrecv(&vec![rank as u8; 200_000], to, &mut buf, from).unwrap();
                assert!(buf.iter().all(|&b| b == from as u8));
                comm.finalize().unwrap();
            });
        }
    });
    store.shutdown();
}

#[test]
fn finalize_leaves_no_thread_socket_or_mapping() {
    // Warm up once (lazy statics, the allocator), then measure a second round.
    job(3, TransportChoice::Tcp);
    let (threads, fds, maps) = (count("/proc/self/task"), count("/proc/self/fd"), shm_maps());
    for t in [TransportChoice::Tcp, TransportChoice::Shm, TransportChoice::Auto] {
        job(3, t);
    }
    // Other tests of this binary may run at the same time: allow them a moment to finish,
    // then compare.
    let settle = std::time::Instant::now() + Duration::from_secs(10);
    while std::time::Instant::now() < settle && (count("/proc/self/task") > threads || count("/proc/self/fd") > fds || shm_maps() > maps) {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(count("/proc/self/task"), threads, "threads left behind");
    assert_eq!(count("/proc/self/fd"), fds, "file descriptors left behind");
    assert_eq!(shm_maps(), maps, "shared-memory mappings left behind");
}
