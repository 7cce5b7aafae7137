//! The `ferroccl-run` launcher binary. Everything lives in the library (`ferroccl_run`);
//! see its crate documentation for the command line, the environment contract and the
//! failure handling.
#![forbid(unsafe_code)]

fn main() {
    let code = ferroccl_run::main_with_args(std::env::args_os().skip(1));
    std::process::exit(code);
}
