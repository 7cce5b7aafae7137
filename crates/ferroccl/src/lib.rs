//! FerroCCL: collective communication for Rust.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod bootstrap;
pub mod comm;
pub mod error;
pub(crate) mod fabric;
pub mod params;
pub(crate) mod proto;
pub(crate) mod transport;
pub(crate) mod wire;

pub use comm::{Communicator, InitConfig};
pub use error::{Error, Result};
pub use ferroccl_kernels::{DType, Element};
pub use params::{Params, TransportChoice};
