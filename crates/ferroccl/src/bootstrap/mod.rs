//! Bootstrap: the authenticated TCP key-value store and launcher-environment detection.
//!
//! * [`env`](mod@env) finds out who launched this process (FerroCCL's `ferroccl-run`, torchrun, Open
//!   MPI or Slurm), its rank and world size, where the store is and the job token.
//! * [`store`](mod@store) is the key-value store the ranks meet in: set / get / multi_get / wait / add,
//!   every blocking call with a deadline, served by the launcher or by rank 0.
//! * Every store (and mesh) connection starts with a mutual challenge-response over the job
//!   token (HMAC-SHA256 over fresh nonces, see `auth`): both sides prove they know the
//!   token without sending it, so a stranger, or a stale store of another job on the same
//!   port, is refused with a clear error on both sides.

pub(crate) mod auth;
pub mod env;
pub mod store;

pub use auth::new_token;
pub use store::{StoreClient, StoreServer};
