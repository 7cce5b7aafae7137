//! The `ferroccl-perf` binary: everything lives in the library (`ferroccl_perf`); see its
//! crate documentation for the command line, the columns and the formulas.
#![forbid(unsafe_code)]

fn main() {
    let os_args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    // `--ranks N` starts the ranks through this binary (ferroccl-run's exec shim, which
    // pins each to its CPU and then becomes the rank).
    if let Some(code) = ferroccl_run::exec_shim(&os_args) {
        std::process::exit(code);
    }
    let mut args = Vec::new();
    for a in os_args {
        match a.into_string() {
            Ok(s) => args.push(s),
            Err(a) => {
                eprintln!("ferroccl-perf: error: argument {a:?} is not valid UTF-8");
                std::process::exit(2);
            }
        }
    }
    std::process::exit(ferroccl_perf::main_with_args(&args));
}
