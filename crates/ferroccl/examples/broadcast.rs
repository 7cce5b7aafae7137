//! Broadcast: one rank (the root) has the data, afterwards every rank has it.
//!
//! ```text
//! cargo build --release --examples
//! ./target/release/ferroccl-run -n 4 -- ./target/release/examples/broadcast
//! ```
//!
//! Each rank in turn is the root and sends a buffer that only it could have made
//! (`root * 1000 + i`); every other rank checks what it received and the program exits with
//! status 1 on the first wrong element.

use std::process::ExitCode;

use ferroccl::Communicator;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("broadcast example: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Res<()> {
    let comm = Communicator::init()?;
    let (rank, n) = (comm.rank(), comm.size());
    let expected = |root: usize| -> Vec<i64> { (0..4096).map(|i| (root * 1000 + i) as i64).collect() };

    for root in 0..n {
        // The root's buffer holds the data; the others' buffers are overwritten. Every rank
        // passes the same root and a buffer of the same length.
        let mut buf = if rank == root { expected(root) } else { vec![-1i64; 4096] };
        comm.broadcast(&mut buf, root)?;
        if let Some(i) = buf.iter().zip(expected(root)).position(|(got, want)| *got != want) {
            return Err(format!("broadcast from rank {root}: element {i} is {}", buf[i]).into());
        }
    }
    if rank == 0 {
        println!("{n} broadcasts of 4096 i64, one from each rank, all received intact");
    }
    comm.finalize()?;
    Ok(())
}
