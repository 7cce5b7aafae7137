//! Helpers shared by the thread-rank test binaries.

use ferroccl::bootstrap::{env::StoreRole, new_token, StoreServer};
use ferroccl::{Communicator, InitConfig, Params};

/// Runs `f` on `n` thread-ranks of one fresh job; returns each rank's result.
pub fn world<R: Send>(n: usize, params: &Params, f: impl Fn(Communicator) -> R + Sync) -> Vec<R> {
    let token = new_token();
    let store = StoreServer::start("127.0.0.1:0".parse().unwrap(), &token, 1 << 20).unwrap();
    let addr = store.addr().to_string();
    let out = std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|rank| {
                let (token, addr, f, params) = (token.clone(), addr.clone(), &f, params.clone());
                s.spawn(move || {
                    let cfg = InitConfig { rank, world_size: n, store: StoreRole::Connect(addr), token };
                    f(Communicator::init_with(cfg, params).expect("init"))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank panicked")).collect()
    });
    store.shutdown();
    out
}
