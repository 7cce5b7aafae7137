//! The error type of every fallible call in this crate.

use std::io;
use std::time::Duration;

/// What went wrong in a verbs call.
///
/// Each variant names the verb (or the step) that failed; OS errors are kept as the
/// [`source`](std::error::Error::source).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// This build of `ferroccl-verbs` has no RDMA support.
    #[error(
        "RDMA verbs support is not compiled in: rebuild with the `verbs` cargo feature \
         (it needs libibverbs-dev, librdmacm-dev, libclang-dev and pkg-config)"
    )]
    FeatureDisabled,

    /// The verbs library found no RDMA device at all.
    #[error(
        "no RDMA device found (no InfiniBand/RoCE driver loaded? for soft-RoCE: \
         `rdma link add rxe0 type rxe netdev <netdev>`)"
    )]
    NoDevice,

    /// No device has the requested name.
    #[error("no RDMA device named {name:?} (devices: {available:?})")]
    DeviceNotFound {
        /// The name that was asked for.
        name: String,
        /// The names of the devices that exist.
        available: Vec<String>,
    },

    /// A verb returned an error.
    #[error("{verb} failed: {source}")]
    Verb {
        /// The libibverbs function that failed, e.g. `ibv_modify_qp(RTR)`.
        verb: &'static str,
        /// The OS error it reported.
        #[source]
        source: io::Error,
    },

    /// Registering memory failed because it would pin more than `RLIMIT_MEMLOCK`.
    #[error(
        "ibv_reg_mr of {requested} bytes failed ({source}): registered memory is pinned and \
         counts against RLIMIT_MEMLOCK, which is {limit} bytes here (8 MiB by default for \
         non-root users on recent kernels); raise it with \
         `ulimit -l unlimited` (or a `memlock` line in /etc/security/limits.conf, \
         LimitMEMLOCK=infinity for a systemd service, `--ulimit memlock=-1` for docker)"
    )]
    MemlockLimit {
        /// Bytes the registration asked for.
        requested: usize,
        /// The soft `RLIMIT_MEMLOCK` in bytes.
        limit: u64,
        /// The OS error `ibv_reg_mr` reported.
        #[source]
        source: io::Error,
    },

    /// An argument is out of range (a slice outside its region, a GID index past the
    /// table, a length that does not fit a work request).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// A work request completed with an error status.
    #[error("work request {wr_id} on QP {qp_num} completed with {status} (vendor error {vendor_err:#x})")]
    WorkCompletion {
        /// The caller's id of the work request.
        wr_id: u64,
        /// The QP the work request was posted on.
        qp_num: u32,
        /// The completion status, as libibverbs names it (e.g. `IBV_WC_REM_ACCESS_ERR`).
        status: &'static str,
        /// The provider's vendor error code.
        vendor_err: u32,
    },

    /// Waiting for completions ran past its deadline.
    #[error("timed out after {waited:?} waiting for {wanted} completion(s), got {got}")]
    Timeout {
        /// How long the wait lasted.
        waited: Duration,
        /// How many completions were awaited.
        wanted: usize,
        /// How many arrived.
        got: usize,
    },
}

fn copy_io(e: &io::Error) -> io::Error {
    match e.raw_os_error() {
        Some(code) => io::Error::from_raw_os_error(code),
        None => io::Error::new(e.kind(), e.to_string()),
    }
}

impl Error {
    /// A copy, for reporting one failure to several waiters (an OS error keeps its code).
    pub fn duplicate(&self) -> Error {
        match self {
            Error::FeatureDisabled => Error::FeatureDisabled,
            Error::NoDevice => Error::NoDevice,
            Error::DeviceNotFound { name, available } => Error::DeviceNotFound { name: name.clone(), available: available.clone() },
            Error::Verb { verb, source } => Error::Verb { verb, source: copy_io(source) },
            Error::MemlockLimit { requested, limit, source } => {
                Error::MemlockLimit { requested: *requested, limit: *limit, source: copy_io(source) }
            }
            Error::InvalidArgument(s) => Error::InvalidArgument(s.clone()),
            Error::WorkCompletion { wr_id, qp_num, status, vendor_err } => {
                Error::WorkCompletion { wr_id: *wr_id, qp_num: *qp_num, status, vendor_err: *vendor_err }
            }
            Error::Timeout { waited, wanted, got } => Error::Timeout { waited: *waited, wanted: *wanted, got: *got },
        }
    }
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_say_what_to_do() {
        let e = Error::FeatureDisabled.to_string();
        assert!(e.contains("`verbs` cargo feature"), "{e}");
        let e = Error::MemlockLimit { requested: 1 << 20, limit: 65536, source: io::Error::from_raw_os_error(12) }.to_string();
        assert!(e.contains("RLIMIT_MEMLOCK") && e.contains("ulimit -l") && e.contains("65536"), "{e}");
        let e = Error::Verb { verb: "ibv_modify_qp(RTR)", source: io::Error::from_raw_os_error(22) };
        assert!(e.to_string().starts_with("ibv_modify_qp(RTR) failed: "), "{e}");
        assert!(std::error::Error::source(&e).is_some());
    }
}
