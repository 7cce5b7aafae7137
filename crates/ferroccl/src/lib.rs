//! FerroCCL: collective communication for Rust.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod bootstrap;
pub mod error;
pub mod params;
pub(crate) mod wire;

pub use error::{Error, Result};
pub use ferroccl_kernels::{DType, Element};
