//! What the measurement subcommands (`latency`, `idle`, `overlap`, ...) share: their
//! command lines' common options, joining the job, and collecting one value per rank.

use ferroccl::{Communicator, Params, ReduceOp, TransportChoice};

use crate::args;
use crate::Failure;

/// The options every subcommand (and the collective benchmark) takes: `--ranks N`,
/// `--transport T`, `--no-bind`. Declared once, global to the command line
/// ([`crate::args`] flattens it into the top level), so each subcommand's `--help` lists
/// them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::Args)]
pub struct Common {
    /// Start N local ranks (no launcher needed); they are pinned to CPUs as ferroccl-run
    /// pins them (FERROCCL_BIND, default auto: rank r on the r-th usable CPU when N <= CPUs)
    #[arg(long, global = true, value_name = "N", allow_hyphen_values = true, value_parser = args::ranks)]
    pub ranks: Option<usize>,
    /// auto, shm, tcp, verbs (FERROCCL_TRANSPORT for this run)
    #[arg(long, global = true, value_name = "T", allow_hyphen_values = true, value_parser = args::transport)]
    pub transport: Option<TransportChoice>,
    /// With --ranks: do not pin the ranks to CPUs (leave them to the kernel)
    #[arg(long, global = true)]
    pub no_bind: bool,
}

impl Common {
    /// Joins the job (the launcher's environment), with `--transport` applied.
    pub fn init(&self) -> Result<Communicator, Failure> {
        let mut params = Params::from_env().map_err(Failure::Init)?;
        if let Some(t) = self.transport {
            params.transport = t;
        }
        let launch = ferroccl::bootstrap::env::detect().map_err(Failure::Init)?;
        Communicator::init_with(launch.into(), params).map_err(Failure::Init)
    }
}

/// A library error on this rank, with what it was doing.
pub fn fail(comm: &Communicator, what: impl Into<String>) -> impl FnOnce(ferroccl::Error) -> Failure {
    let (rank, what) = (comm.rank(), what.into());
    move |source| Failure::Collective { rank, what, source: Box::new(source) }
}

/// The end of a subcommand on one rank: finalize, then fail if any checked element was wrong.
pub fn finish(comm: Communicator, wrong: u64) -> Result<(), Failure> {
    let rank = comm.rank();
    comm.finalize().map_err(|e| Failure::Collective { rank, what: "finalize".into(), source: Box::new(e) })?;
    if wrong > 0 {
        return Err(Failure::Wrong(wrong));
    }
    Ok(())
}

/// The largest of every rank's `v` (on every rank).
pub fn max_over_ranks(comm: &Communicator, v: f64) -> Result<f64, Failure> {
    let mut x = [v];
    comm.allreduce(&mut x, ReduceOp::Max).map_err(fail(comm, "collecting the slowest rank's time"))?;
    Ok(x[0])
}

/// The median of `v` (sorted in place); 0 for an empty slice.
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians() {
        assert_eq!(median(&mut []), 0.0);
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 2.5);
    }
}
