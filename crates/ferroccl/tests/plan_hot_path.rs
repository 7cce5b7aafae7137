//! A persistent plan's run moves data only: counted over hundreds of runs on two
//! thread-ranks (shm), it makes no allocation (a counting global allocator sees every
//! allocation of the process, both ranks' threads included) and no registration (the
//! registration cache's counters). Alone in its test binary, so no other test allocates
//! meanwhile.

use std::sync::Barrier;
use std::time::Duration;

use ferroccl::bootstrap::{env::StoreRole, new_token, StoreServer};
use ferroccl::{Communicator, InitConfig, Params, ReduceOp, TransportChoice};
use ferroccl_mem::alloc_count::{allocations, CountingAlloc};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

#[test]
fn plan_runs_allocate_and_register_nothing() {
    const N: usize = 2;
    const RUNS: usize = 300;
    let token = new_token();
    let store = StoreServer::start("127.0.0.1:0".parse().unwrap(), &token, 1 << 20).unwrap();
    let addr = store.addr().to_string();
    let params = Params { transport: TransportChoice::Shm, timeout: Duration::from_secs(60), ..Params::default() };
    let barrier = Barrier::new(N);
    let counts: Vec<(u64, u64, u64)> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..N)
            .map(|rank| {
                let (token, addr, params, barrier) = (token.clone(), addr.clone(), params.clone(), &barrier);
                s.spawn(move || {
                    let cfg = InitConfig { rank, world_size: N, store: StoreRole::Connect(addr), token };
                    let comm = Communicator::init_with(cfg, params).expect("init");
                    let mut tiny = vec![0.0f32; 2]; // 8 B
                    let mut small = vec![0.0f32; 1024]; // 4 KiB
                    let mut large = vec![0.0f32; 100_000]; // rendezvous, chunked
                    let mut ag_send = vec![0u32; 64];
                    let mut ag_recv = vec![0u32; 64 * N];
                    let mut p1 = comm.plan(ferroccl::op::allreduce(&mut tiny, ReduceOp::Sum)).unwrap();
                    let mut p2 = comm.plan(ferroccl::op::allreduce(&mut small, ReduceOp::Sum)).unwrap();
                    let mut p3 = comm.plan(ferroccl::op::allreduce(&mut large, ReduceOp::Max)).unwrap();
                    let mut p4 = comm.plan(ferroccl::op::allgather_into(&mut ag_send, &mut ag_recv)).unwrap();
                    let mut run_all = |k: usize| {
                        p1.output_mut().fill(k as f32);
                        p1.run().unwrap();
                        assert_eq!(p1.output()[1], (k * N) as f32);
                        p2.output_mut().fill(1.0);
                        p2.run().unwrap();
                        assert_eq!(p2.output()[1023], N as f32);
                        p3.output_mut()[7] = (rank + k) as f32;
                        p3.run().unwrap();
                        assert_eq!(p3.output()[7], (N - 1 + k) as f32);
                        p4.input_mut().unwrap().fill(k as u32);
                        p4.run().unwrap();
                        assert_eq!(p4.output()[64 * N - 1], k as u32);
                    };
                    // Warm up: pools, queues and tables reach their working size.
                    for k in 0..50 {
                        run_all(k);
                    }
                    barrier.wait();
                    let (a0, r0) = (allocations(), comm.registration_stats().registrations);
                    for k in 50..50 + RUNS {
                        run_all(k);
                    }
                    let (a1, r1) = (allocations(), comm.registration_stats().registrations);
                    barrier.wait();
                    drop((p1, p2, p3, p4));
                    comm.finalize().unwrap();
                    (a1 - a0, r1 - r0, r0)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    store.shutdown();
    for (rank, (allocs, regs, regs_at_build)) in counts.into_iter().enumerate() {
        assert!(regs_at_build > 0, "rank {rank}: the plans registered nothing when built?");
        assert_eq!(regs, 0, "rank {rank}: {regs} registrations in {RUNS} runs of 4 plans");
        assert_eq!(allocs, 0, "rank {rank}: {allocs} allocations (process-wide) during {RUNS} runs of 4 plans");
    }
}
