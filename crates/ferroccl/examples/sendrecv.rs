//! Point to point: a ring shift with `sendrecv`, then a message from every rank to rank 0
//! with `send` / `recv`.
//!
//! ```text
//! cargo build --release --examples
//! ./target/release/ferroccl-run -n 4 -- ./target/release/examples/sendrecv
//! ```
//!
//! Messages between two ranks match in the order they are sent (there are no tags), and a
//! receive buffer must be exactly as long as what is sent. Every received value is checked;
//! a wrong one makes the program exit with status 1.

use std::process::ExitCode;

use ferroccl::Communicator;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sendrecv example: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Res<()> {
    let comm = Communicator::init()?;
    let (rank, n) = (comm.rank(), comm.size());
    let (right, left) = ((rank + 1) % n, (rank + n - 1) % n);

    // Ring shift: send to the right, receive from the left, both at once, so it cannot
    // deadlock however many ranks there are.
    let mine = vec![rank as u32; 1 << 16];
    let mut from_left = vec![u32::MAX; 1 << 16];
    comm.sendrecv(&mine, right, &mut from_left, left)?;
    if from_left.iter().any(|&x| x != left as u32) {
        return Err(format!("rank {rank}: the ring shift from rank {left} delivered wrong data").into());
    }

    // Gather by hand: every other rank sends its rank and the size to rank 0, which
    // receives them in rank order.
    if rank == 0 {
        for peer in 1..n {
            let mut got = [0u64; 2];
            comm.recv(&mut got, peer)?;
            if got != [peer as u64, n as u64] {
                return Err(format!("rank 0: rank {peer} sent {got:?}").into());
            }
        }
        println!("ring shift over {n} ranks and {} messages to rank 0 checked", n - 1);
    } else {
        comm.send(&[rank as u64, n as u64], 0)?;
    }
    comm.finalize()?;
    Ok(())
}
