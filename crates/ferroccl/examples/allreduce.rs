//! Allreduce: every rank contributes a buffer and every rank gets the element-wise sum
//! (or max, min, ...) of all of them.
//!
//! ```text
//! cargo build --release --examples
//! ./target/release/ferroccl-run -n 4 -- ./target/release/examples/allreduce
//! ```
//!
//! Each rank fills its buffer with `rank + 1`, so after a sum every element must be
//! 1 + 2 + ... + n = n(n+1)/2 on every rank. The program checks that and exits with status 1
//! (naming the first wrong element) if it is not so.

use std::process::ExitCode;

use ferroccl::{Communicator, ReduceOp};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("allreduce example: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Res<()> {
    // Joins the job: ferroccl-run (or torchrun, Slurm, Open MPI) said in the environment
    // which rank this is, how many there are, and where to meet.
    let comm = Communicator::init()?;
    let (rank, n) = (comm.rank(), comm.size());

    // Sum, in place: the buffer holds this rank's input before, the result after.
    let mut grads = vec![(rank + 1) as f32; 1 << 20];
    comm.allreduce(&mut grads, ReduceOp::Sum)?;
    let want = (n * (n + 1) / 2) as f32;
    check("sum", &grads, want)?;

    // The same call works for any element type and reduction: here the largest rank.
    let mut top = [rank as u64; 8];
    comm.allreduce(&mut top, ReduceOp::Max)?;
    check("max", &top, (n - 1) as u64)?;

    if rank == 0 {
        println!("allreduce of {} f32 over {n} ranks: every element is {want}, as it should be", grads.len());
    }
    // Collective, like the calls above: every rank must get here. It checks that every
    // rank made the same calls and fails if not.
    comm.finalize()?;
    Ok(())
}

/// Fails, naming the first element that is not `want`.
fn check<T: PartialEq + std::fmt::Debug>(what: &str, got: &[T], want: T) -> Res<()> {
    match got.iter().position(|x| *x != want) {
        None => Ok(()),
        Some(i) => Err(format!("{what}: element {i} is {:?}, expected {want:?}", got[i]).into()),
    }
}
