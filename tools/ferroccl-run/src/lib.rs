//! The ferroccl-run launcher (in progress).
#![forbid(unsafe_code)]
