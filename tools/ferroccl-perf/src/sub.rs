//! What the measurement subcommands (`latency`, `idle`, `overlap`) share: their command
//! lines' common options, joining the job, and collecting one value per rank.

use ferroccl::{Communicator, Params, ReduceOp, TransportChoice};

use crate::args::ArgError;
use crate::Failure;

/// An option of a subcommand's command line: the flag and its value (`None` for a switch).
pub type Flag = (String, Option<String>);

/// Splits `args` (after the subcommand's name) into flags. `with_value` lists the flags
/// that take a value (next argument or after `=`), `switches` those that do not. `-h` /
/// `--help` gives `Ok(None)`.
pub fn flags(args: &[String], with_value: &[&str], switches: &[&str]) -> Result<Option<Vec<Flag>>, ArgError> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < args.len() {
        let arg = args[i].as_str();
        if arg == "-h" || arg == "--help" {
            return Ok(None);
        }
        let (flag, inline) = match arg.strip_prefix("--").and_then(|r| r.split_once('=')) {
            Some((f, v)) => (&arg[..f.len() + 2], Some(v.to_string())),
            None => (arg, None),
        };
        if switches.contains(&flag) && inline.is_none() {
            out.push((flag.to_string(), None));
        } else if with_value.contains(&flag) {
            let v = match inline {
                Some(v) => v,
                None => {
                    i += 1;
                    args.get(i).cloned().ok_or_else(|| ArgError::MissingValue(flag.to_string()))?
                }
            };
            out.push((flag.to_string(), Some(v)));
        } else {
            return Err(ArgError::UnknownOption(arg.to_string()));
        }
        i += 1;
    }
    Ok(Some(out))
}

/// A bad value of `flag`.
pub fn bad(flag: &str, value: &str, expected: &str) -> ArgError {
    ArgError::BadValue { flag: flag.to_string(), value: value.to_string(), expected: expected.to_string() }
}

/// A whole number, at least `min`.
pub fn count(flag: &str, v: &str, min: usize) -> Result<usize, ArgError> {
    v.trim().parse::<usize>().ok().filter(|&n| n >= min).ok_or_else(|| bad(flag, v, &format!("must be a whole number, {min} or more")))
}

/// A positive decimal number.
pub fn seconds(flag: &str, v: &str) -> Result<f64, ArgError> {
    v.trim().parse::<f64>().ok().filter(|s| s.is_finite() && *s > 0.0).ok_or_else(|| bad(flag, v, "must be a positive number of seconds"))
}

/// The options every subcommand takes: `--ranks N` and `--transport T`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Common {
    /// `--ranks N`: start N local ranks.
    pub ranks: Option<usize>,
    /// `--transport`.
    pub transport: Option<TransportChoice>,
}

/// The value-taking flags [`Common::take`] understands.
pub const COMMON_FLAGS: [&str; 2] = ["--ranks", "--transport"];

impl Common {
    /// Takes `--ranks` / `--transport` out of `flags` if it is one of them; `Ok(false)`
    /// for any other flag.
    pub fn take(&mut self, (flag, value): &Flag) -> Result<bool, ArgError> {
        let v = value.as_deref().unwrap_or("");
        match flag.as_str() {
            "--ranks" => {
                let n = count(flag, v, 1)?;
                if n > ferroccl_run::MAX_RANKS {
                    return Err(bad(flag, v, "must be a whole number of ranks, 1 to 1024"));
                }
                self.ranks = Some(n);
            }
            "--transport" => self.transport = Some(TransportChoice::parse(v).ok_or_else(|| bad(flag, v, "must be one of auto, shm, tcp"))?),
            _ => return Ok(false),
        }
        Ok(true)
    }

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
    move |source| Failure::Collective { rank, what, source }
}

/// The end of a subcommand on one rank: finalize, then fail if any checked element was wrong.
pub fn finish(comm: Communicator, wrong: u64) -> Result<(), Failure> {
    let rank = comm.rank();
    comm.finalize().map_err(|e| Failure::Collective { rank, what: "finalize".into(), source: e })?;
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

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn flags_split_values_and_switches() {
        let f =
            flags(&s(&["-n", "5", "--raw", "--sizes=8,4K", "--ranks", "2"]), &["-n", "--sizes", "--ranks"], &["--raw"]).unwrap().unwrap();
        assert_eq!(
            f,
            vec![
                ("-n".to_string(), Some("5".to_string())),
                ("--raw".to_string(), None),
                ("--sizes".to_string(), Some("8,4K".to_string())),
                ("--ranks".to_string(), Some("2".to_string()))
            ]
        );
        assert_eq!(flags(&s(&["-n", "1", "--help"]), &["-n"], &[]), Ok(None));
        assert_eq!(flags(&s(&["-n"]), &["-n"], &[]), Err(ArgError::MissingValue("-n".into())));
        assert_eq!(flags(&s(&["--raw=1"]), &[], &["--raw"]), Err(ArgError::UnknownOption("--raw=1".into())));
        let mut c = Common::default();
        assert_eq!(c.take(&("--ranks".into(), Some("3".into()))), Ok(true));
        assert_eq!(c.take(&("-n".into(), Some("3".into()))), Ok(false));
        assert!(c.take(&("--transport".into(), Some("pigeon".into()))).is_err());
        assert_eq!(c.ranks, Some(3));
    }

    #[test]
    fn medians() {
        assert_eq!(median(&mut []), 0.0);
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 2.5);
    }
}
