//! Non-blocking calls, groups and persistent plans: overlap communication with other work,
//! submit several operations as one, and set up a repeated allreduce once.
//!
//! ```text
//! cargo build --release --examples
//! ./target/release/ferroccl-run -n 4 -- ./target/release/examples/nonblocking
//! ```
//!
//! Every result is checked against what it must be; a wrong one makes the program exit
//! with status 1.

use std::process::ExitCode;

use ferroccl::{Communicator, ReduceOp};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nonblocking example: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Res<()> {
    let comm = Communicator::init()?;
    let (rank, n) = (comm.rank(), comm.size());
    let sum = (n * (n + 1) / 2) as f32; // of rank + 1 over every rank

    // 1. A scope: calls started in it return a Request at once; the buffers stay borrowed
    //    until the scope ends, and the scope waits for whatever is still running.
    let mut grads = vec![(rank + 1) as f32; 1 << 18];
    let mut steps = [1u32];
    let local_work = comm.scope(|s| {
        let g = s.start(ferroccl::op::allreduce(&mut grads, ReduceOp::Sum))?;
        drop(s.start(ferroccl::op::allreduce(&mut steps, ReduceOp::Sum))?); // not waited for here: the scope does
                                                                            // ... computation that does not touch the buffers runs while both are in flight ...
        let work: u64 = (0..100_000u64).map(|i| i % 7).sum();
        g.wait()?;
        Ok(work)
    })?;
    if grads.iter().any(|&x| x != sum) || steps[0] != n as u32 {
        return Err(format!("rank {rank}: a non-blocking allreduce gave a wrong result").into());
    }

    // 2. A group: several operations submitted as one unit, completed together.
    let (mut a, mut b) = (vec![rank as i32; 16], vec![rank as f64; 16]);
    comm.group(|g| {
        g.add(ferroccl::op::allreduce(&mut a, ReduceOp::Min))?;
        g.add(ferroccl::op::allreduce(&mut b, ReduceOp::Max))
    })?;
    if a.iter().any(|&x| x != 0) || b.iter().any(|&x| x != (n - 1) as f64) {
        return Err(format!("rank {rank}: a grouped allreduce gave a wrong result").into());
    }

    // 3. A persistent plan: schedule, scratch and registration set up once; each run only
    //    moves data. The plan owns the buffer while it lives: write inputs and read results
    //    through it.
    let mut buf = vec![0f32; 1 << 16];
    let mut plan = comm.plan(ferroccl::op::allreduce(&mut buf, ReduceOp::Sum))?;
    for step in 0..10 {
        plan.output_mut().fill((rank + step) as f32); // this step's input
        plan.run()?;
        let want = (n * (n - 1) / 2 + n * step) as f32; // sum of rank + step
        if plan.output().iter().any(|&x| x != want) {
            return Err(format!("rank {rank}: plan step {step} gave a wrong result").into());
        }
    }
    drop(plan);

    if rank == 0 {
        println!("scope, group and 10 plan runs over {n} ranks checked (local work: {local_work})");
    }
    comm.finalize()?;
    Ok(())
}
