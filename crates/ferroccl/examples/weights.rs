//! One-sided memory: every rank publishes its "weights" (three scattered tensors) as
//! windows, and every step reads its left neighbour's with a transfer plan built once, after
//! the neighbour has updated them in place and signalled the step's version.
//!
//! ```text
//! cargo build --release --bins --examples
//! ./target/release/ferroccl-run -n 4 -- ./target/release/examples/weights
//! ```
//!
//! Windows are registered once for a scope; their handles (40 bytes each) travel in an
//! allgather. The reader never asks the owner to do anything: the owner's progress engine
//! serves the reads. Every value read is checked; a wrong one makes the program exit with
//! status 1.

use std::process::ExitCode;

use ferroccl::{Communicator, RemoteHandle};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("weights example: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Element `i` of tensor `t` of `rank`'s weights after `step`.
fn weight(rank: usize, t: usize, i: usize, step: u64) -> f32 {
    (rank * 1000 + t * 100) as f32 + i as f32 * 0.5 + step as f32
}

fn run() -> Res<()> {
    let comm = Communicator::init()?;
    let (rank, n) = (comm.rank(), comm.size());
    let left = (rank + n - 1) % n;
    let right = (rank + 1) % n;
    let sizes = [1000usize, 5000, 2000];
    let mut tensors: Vec<Vec<f32>> = sizes.iter().enumerate().map(|(t, &len)| (0..len).map(|i| weight(rank, t, i, 0)).collect()).collect();
    let mut copy = vec![0f32; sizes.iter().sum()];
    let steps = 5;
    comm.scope(|s| {
        // Register once: a read-write window per tensor (the owner updates them in place,
        // through the window), and one window the neighbour's weights land in.
        let mut windows = Vec::new();
        for t in tensors.iter_mut() {
            windows.push(s.register_mut(t)?);
        }
        let landing = s.register_mut(&mut copy)?;
        // Everyone's handles, to everyone.
        let mine: Vec<u8> = windows.iter().flat_map(|w| w.handle().to_bytes()).collect();
        let mut all = vec![0u8; mine.len() * n];
        comm.allgather_into(&mine, &mut all)?;
        let theirs: Vec<RemoteHandle> = all[left * mine.len()..(left + 1) * mine.len()]
            .chunks(RemoteHandle::BYTES)
            .map(RemoteHandle::from_bytes)
            .collect::<ferroccl::Result<_>>()?;
        // The plan: one read per tensor, all in flight at once, checked once here.
        let mut plan = comm.transfer_plan();
        let mut at = 0;
        for (h, &len) in theirs.iter().zip(&sizes) {
            plan = plan.read::<f32>(h, 0, &landing, at, len);
            at += len;
        }
        let mut plan = plan.build()?;
        for step in 1..=steps {
            // Update my weights in place, then tell my right neighbour (its reader) that
            // version `step` is there: a signal (no data) raised at the right neighbour.
            for (t, w) in windows.iter().enumerate() {
                let fresh: Vec<f32> = (0..sizes[t]).map(|i| weight(rank, t, i, step)).collect();
                w.write(0, &fresh)?;
            }
            comm.signal(right, step)?;
            // Wait until my left neighbour's version `step` is in place, then read it.
            comm.wait_signal(left, step)?;
            plan.run()?;
            let mut got = vec![0f32; at];
            landing.read(0, &mut got)?;
            let mut i0 = 0;
            for (t, &len) in sizes.iter().enumerate() {
                for i in 0..len {
                    if got[i0 + i] != weight(left, t, i, step) {
                        return Err(ferroccl::Error::InvalidArgument(format!("rank {rank}: step {step}: tensor {t}[{i}] is wrong")));
                    }
                }
                i0 += len;
            }
            // Nobody rewrites weights a neighbour is still reading.
            comm.barrier()?;
        }
        Ok(())
    })?;
    if rank == 0 {
        println!(
            "{steps} steps: every rank read its left neighbour's 3 tensors ({} floats) through one plan, checked",
            sizes.iter().sum::<usize>()
        );
    }
    comm.finalize()?;
    Ok(())
}
