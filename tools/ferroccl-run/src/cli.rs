//! What clap finds wrong with a command line, in the terms of FerroCCL's tools.
//!
//! `ferroccl-run` and `ferroccl-perf` parse with clap, but their errors are their own
//! (`-b "8X": must be a positive size ...`, `unknown option "--bogus=3"`, `-e needs a
//! value`): [`Problem::of`] reads a clap error's context and names the option the way it
//! was given on the command line, for each tool to make its own error of.

use std::error::Error;

use clap::error::{ContextKind, ContextValue, ErrorKind};
use clap::Command;

/// What is wrong with a command line, as far as clap can tell.
#[non_exhaustive]
#[derive(Debug)]
pub enum Problem<'e> {
    /// `-h` or `--help`: not a problem, the help was asked for.
    Help,
    /// A value parser refused `value` of `option`; `reason` is the parser's own error.
    BadValue {
        /// The option, as it was given (`--minbytes`, `-b`).
        option: String,
        /// The value.
        value: String,
        /// The value parser's error.
        reason: Option<&'e (dyn Error + 'static)>,
    },
    /// An option that takes a value came last, as it was given.
    MissingValue(String),
    /// An option the command does not have, as it was given (`--bogus=3`, or `--verbose=1`
    /// for a switch).
    UnknownOption(String),
    /// A positional argument too many.
    Unexpected(String),
    /// Anything else, in clap's words.
    Other(String),
}

impl<'e> Problem<'e> {
    /// The problem clap's error `e` describes, for the command `cmd` given `args` (after
    /// the program's name). Every option that takes a value should allow hyphen values,
    /// so that a missing value can only be the last argument's.
    pub fn of<S: AsRef<str>>(e: &'e clap::Error, cmd: &Command, args: &[S]) -> Problem<'e> {
        let context = |kind| match e.get(kind) {
            Some(ContextValue::String(s)) => s.as_str(),
            _ => "",
        };
        let (arg, value) = (context(ContextKind::InvalidArg), context(ContextKind::InvalidValue));
        let args: Vec<&str> = args.iter().map(AsRef::as_ref).collect();
        match e.kind() {
            ErrorKind::DisplayHelp => Problem::Help,
            ErrorKind::ValueValidation => {
                Problem::BadValue { option: as_spelled(cmd, arg, &args, Some(value)), value: value.to_string(), reason: e.source() }
            }
            // "a value is required for '--maxbytes <SIZE>' but none was supplied"
            ErrorKind::InvalidValue => Problem::MissingValue(as_spelled(cmd, arg, &args, None)),
            ErrorKind::UnknownArgument if arg.len() > 1 && arg.starts_with('-') => Problem::UnknownOption(as_given(&args, arg)),
            ErrorKind::UnknownArgument => Problem::Unexpected(arg.to_string()),
            // A value given to a switch: `--plan=1`.
            ErrorKind::TooManyValues => Problem::UnknownOption(format!("{arg}={value}")),
            _ => Problem::Other(message(e)),
        }
    }
}

/// Clap's message for `e`, without its "error: " and what follows the first line.
pub fn message(e: &clap::Error) -> String {
    let text = e.to_string();
    let line = text.lines().next().unwrap_or_default();
    line.strip_prefix("error: ").unwrap_or(line).to_string()
}

/// How `args` spelled the option that clap renders as `rendered` (`--maxbytes <SIZE>`):
/// the spelling used with `value` (`-b 8`, `--maxbytes=8`, `-b8`), or for a missing value
/// (`value` `None`) the last argument's; else its short name, if it has one.
fn as_spelled(cmd: &Command, rendered: &str, args: &[&str], value: Option<&str>) -> String {
    let word = rendered.split(' ').next().unwrap_or_default();
    let found = cmd.get_arguments().find(|a| match word.strip_prefix("--") {
        Some(long) => a.get_long() == Some(long),
        None => word.strip_prefix('-').and_then(|s| s.chars().next()).is_some_and(|c| a.get_short() == Some(c)),
    });
    let Some(found) = found else {
        return word.to_string();
    };
    let names: Vec<String> =
        found.get_short().map(|c| format!("-{c}")).into_iter().chain(found.get_long().map(|l| format!("--{l}"))).collect();
    for (i, a) in args.iter().enumerate().rev() {
        let given = names.iter().find(|n| match value {
            None => i + 1 == args.len() && a == n,
            Some(v) => (a == n && args.get(i + 1) == Some(&v)) || *a == format!("{n}={v}") || (n.len() == 2 && *a == format!("{n}{v}")),
        });
        if let Some(n) = given {
            return n.clone();
        }
    }
    names.into_iter().next().unwrap_or_else(|| word.to_string())
}

/// The argument as it was given: clap names an unknown `--x=1` as `--x`, and an unknown
/// `=` in `-v=1` as `-=`.
fn as_given(args: &[&str], name: &str) -> String {
    let with_value = format!("{name}=");
    let long = args.iter().find(|a| **a == name || a.starts_with(&with_value));
    let short = || match name.strip_prefix('-').filter(|c| c.chars().count() == 1) {
        Some(c) => args.iter().find(|a| a.starts_with('-') && !a.starts_with("--") && a[1..].contains(c)),
        None => None,
    };
    long.or_else(short).map_or(name, |a| a).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory, Parser};

    #[derive(Debug, Parser)]
    #[command(args_override_self = true)]
    struct Cli {
        #[arg(short = 'b', long = "minbytes", allow_hyphen_values = true, value_parser = positive)]
        min: Option<usize>,
        #[arg(long)]
        plan: bool,
        #[arg(short)]
        verbose: bool,
    }

    fn positive(v: &str) -> Result<usize, String> {
        v.parse::<usize>().ok().filter(|&n| n > 0).ok_or_else(|| "must be positive".to_string())
    }

    fn problem(args: &[&str]) -> String {
        let e = Cli::try_parse_from(std::iter::once("t").chain(args.iter().copied())).unwrap_err();
        format!("{:?}", Problem::of(&e, &Cli::command(), args))
    }

    #[test]
    fn options_are_named_as_given() {
        for (args, option) in [
            (&["-b", "0"][..], "\"-b\""),
            (&["--minbytes", "0"], "\"--minbytes\""),
            (&["--minbytes=0"], "\"--minbytes\""),
            (&["-b0"], "\"-b\""),
            (&["-b", "8", "--minbytes", "-1"], "\"--minbytes\""),
        ] {
            let p = problem(args);
            assert!(p.starts_with("BadValue") && p.contains(option), "{args:?}: {p}");
        }
        assert_eq!(problem(&["--minbytes"]), "MissingValue(\"--minbytes\")");
        assert_eq!(problem(&["-b"]), "MissingValue(\"-b\")");
        assert_eq!(problem(&["--bogus=3"]), "UnknownOption(\"--bogus=3\")");
        assert_eq!(problem(&["--plan=1"]), "UnknownOption(\"--plan=1\")");
        assert_eq!(problem(&["-v=1"]), "UnknownOption(\"-v=1\")");
        assert_eq!(problem(&["-x"]), "UnknownOption(\"-x\")");
        assert_eq!(problem(&["extra"]), "Unexpected(\"extra\")");
        assert_eq!(problem(&["--help"]), "Help");
    }
}
