//! A transfer plan's run moves data only: counted over hundreds of runs on two thread-ranks
//! (shm), each reading three scattered windows of the other, writing one into it, reading
//! and writing the other's shared window (`alloc_window`, copied directly) and raising its
//! signal at the end of the run, it makes no allocation (a counting global
//! allocator sees every allocation of the process, both ranks' threads and their window
//! servers included) and no registration. Alone in its test binary, so no other test
//! allocates meanwhile.

use std::sync::Barrier;
use std::time::Duration;

use ferroccl::bootstrap::{env::StoreRole, new_token, StoreServer};
use ferroccl::{Communicator, InitConfig, Params, RemoteHandle, TransportChoice};
use ferroccl_mem::alloc_count::{allocations, CountingAlloc};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

#[test]
fn transfer_plan_runs_allocate_and_register_nothing() {
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
                    let mut a = vec![rank as f32; 10_000];
                    let mut b = vec![rank as f32; 50_000];
                    let mut c = vec![rank as f32; 20_000];
                    let mut dst = vec![0f32; 81_000];
                    let mut inbox = vec![0f32; 64];
                    let out = comm.scope(|sc| {
                        let (wa, wb, wc) = (sc.register_mut(&mut a)?, sc.register_mut(&mut b)?, sc.register_mut(&mut c)?);
                        let (wd, wi) = (sc.register_mut(&mut dst)?, sc.register_mut(&mut inbox)?);
                        let shared = comm.alloc_window::<f32>(2000)?;
                        shared.write(0, &vec![rank as f32; 2000])?;
                        let mine: Vec<u8> = [&wa, &wb, &wc, &wi, &shared].iter().flat_map(|w| w.handle().to_bytes()).collect();
                        let mut all = vec![0u8; mine.len() * N];
                        comm.allgather_into(&mine, &mut all)?;
                        let peer = 1 - rank;
                        let h = |k: usize| RemoteHandle::from_bytes(&all[(5 * peer + k) * 40..(5 * peer + k + 1) * 40]);
                        let mut plan = comm
                            .transfer_plan()
                            .read::<f32>(&h(0)?, 0, &wd, 0, 10_000)
                            .read::<f32>(&h(1)?, 0, &wd, 10_000, 50_000)
                            .read::<f32>(&h(2)?, 0, &wd, 60_000, 20_000)
                            .write::<f32>(&wa, 0, &h(3)?, 0, 64)
                            .read::<f32>(&h(4)?, 0, &wd, 80_000, 1000)
                            .write::<f32>(&wa, 0, &h(4)?, 1000, 1000)
                            .signal(peer)
                            .build()?;
                        // Warm up: pools, queues and tables reach their working size.
                        for _ in 0..50 {
                            plan.run()?;
                        }
                        barrier.wait();
                        let (a0, r0) = (allocations(), comm.registration_stats().registrations);
                        for _ in 0..RUNS {
                            plan.run()?;
                        }
                        let (a1, r1) = (allocations(), comm.registration_stats().registrations);
                        barrier.wait();
                        let mut last = [0f32];
                        wd.read(79_999, &mut last)?;
                        assert_eq!(last[0], peer as f32);
                        wd.read(80_999, &mut last)?;
                        assert_eq!(last[0], peer as f32, "the read of the peer's shared window");
                        shared.read(1999, &mut last)?;
                        assert_eq!(last[0], peer as f32, "the peer's write into my shared window");
                        assert_eq!(comm.registration_stats().peer_windows_mapped, 1, "the peer's shared window is mapped");
                        comm.barrier()?;
                        drop(shared);
                        Ok((a1 - a0, r1 - r0, r0))
                    });
                    let out = out.expect("plan");
                    comm.finalize().unwrap();
                    out
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    store.shutdown();
    for (rank, (allocs, regs, regs_at_build)) in counts.into_iter().enumerate() {
        assert!(regs_at_build > 0, "rank {rank}: nothing registered when the plan was built and warmed up?");
        assert_eq!(regs, 0, "rank {rank}: {regs} registrations in {RUNS} runs");
        assert_eq!(allocs, 0, "rank {rank}: {allocs} allocations (process-wide) during {RUNS} runs");
    }
}
