//! A weight sync's per-sync path (`with_buffer_mut`, `publish`, `wait_consumed`, `pull`)
//! makes no registration and no window, maps no further window, and allocates nothing,
//! after a warm-up (pools, queues and tables at their working size): counted over 200 syncs
//! on two thread-ranks (shm) with a counting global allocator that sees every allocation of
//! the process, the engines' threads included. Its plans (the reads, the publishing and
//! acknowledging signals) and its signal waits (the sources' waits for acknowledgements,
//! the destinations' waits for the next version) are all built at setup and rerun; a wait
//! made per call (`Communicator::wait_signal`, a schedule and a job each time) used to cost
//! 19 allocations per sync here (3,846 in 200). Alone in its test binary, so no other test
//! allocates meanwhile.

use std::sync::Barrier;
use std::time::Duration;

use ferroccl::bootstrap::{env::StoreRole, new_token, StoreServer};
use ferroccl::reshard::{ModelLayout, Placement, TensorLayout};
use ferroccl::{Communicator, DType, InitConfig, Params, TransportChoice, WeightRole};
use ferroccl_mem::alloc_count::{allocations, CountingAlloc};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

#[test]
fn weight_syncs_register_nothing_and_allocate_nothing() {
    const SYNCS: u64 = 200;
    let token = new_token();
    let store = StoreServer::start("127.0.0.1:0".parse().unwrap(), &token, 1 << 20).unwrap();
    let addr = store.addr().to_string();
    let params = Params { transport: TransportChoice::Shm, timeout: Duration::from_secs(60), ..Params::default() };
    // Row shards on one side, column shards on the other: strided pieces.
    let w = |p| TensorLayout::new("w", DType::Bf16, [256, 128], p);
    let b = |p| TensorLayout::new("b", DType::F32, [256, 1], p);
    let src = ModelLayout::new(1, vec![w(Placement::replicated(1)), b(Placement::replicated(1))]).unwrap();
    let dst = ModelLayout::new(1, vec![w(Placement::cols(&[128])), b(Placement::rows(&[256]))]).unwrap();
    let barrier = Barrier::new(2);
    let counts: Vec<(u64, u64, usize, usize)> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|rank| {
                let (token, addr, params, barrier, src, dst) = (token.clone(), addr.clone(), params.clone(), &barrier, &src, &dst);
                s.spawn(move || {
                    let cfg = InitConfig { rank, world_size: 2, store: StoreRole::Connect(addr), token };
                    let comm = Communicator::init_with(cfg, params).expect("init");
                    let mut ws = comm.weight_sync(src, &[0], dst, &[1]).expect("weight_sync");
                    let mut sync = |v: u64| match ws.role() {
                        WeightRole::Source(_) => {
                            ws.with_buffer_mut(|b| b[0] = v as u8).expect("write");
                            ws.publish(v).expect("publish");
                            ws.wait_consumed(v).expect("wait_consumed");
                        }
                        _ => ws.pull(v).expect("pull"),
                    };
                    // Warm up: pools, queues and tables reach their working size.
                    for v in 1..=50 {
                        sync(v);
                    }
                    // And let every thread the ranks started (their engines' progress
                    // threads, spawned at setup) run its start-up, which allocates, on a
                    // loaded machine too.
                    std::thread::sleep(Duration::from_millis(200));
                    barrier.wait();
                    let st = comm.registration_stats();
                    let a0 = allocations();
                    for v in 51..=50 + SYNCS {
                        sync(v);
                    }
                    let a1 = allocations();
                    barrier.wait();
                    let st1 = comm.registration_stats();
                    if let WeightRole::Destination(_) = ws.role() {
                        let first = ws.with_current(|v, b| (v, b[0])).expect("current");
                        assert_eq!(first, (50 + SYNCS, (50 + SYNCS) as u8));
                    }
                    drop(ws);
                    comm.barrier().unwrap();
                    comm.finalize().unwrap();
                    (
                        a1 - a0,
                        st1.registrations - st.registrations,
                        st1.windows - st.windows,
                        st1.peer_windows_mapped - st.peer_windows_mapped,
                    )
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    store.shutdown();
    let allocs = counts[0].0.max(counts[1].0);
    eprintln!("weight sync: {allocs} allocations (process-wide) in {SYNCS} syncs");
    for (rank, (_, regs, windows, mapped)) in counts.into_iter().enumerate() {
        assert_eq!(regs, 0, "rank {rank}: {regs} registrations in {SYNCS} syncs");
        assert_eq!(windows, 0, "rank {rank}: {windows} windows made in {SYNCS} syncs");
        assert_eq!(mapped, 0, "rank {rank}: {mapped} windows mapped in {SYNCS} syncs");
    }
    assert_eq!(allocs, 0, "{allocs} allocations (process-wide) in {SYNCS} syncs");
}
