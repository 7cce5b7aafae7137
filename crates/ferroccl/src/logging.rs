//! Logs with levels and subsystems, as `NCCL_DEBUG` and `NCCL_DEBUG_SUBSYS` give them.
//!
//! FerroCCL emits its records through the [`log`] crate, each with the target of its
//! subsystem (`ferroccl::init`, `ferroccl::transport`, `ferroccl::coll`, `ferroccl::plan`,
//! `ferroccl::reg`, `ferroccl::health`; see [`Subsys`]). What is printed is the logger's
//! business:
//!
//! - an application that installs a logger of its own (`env_logger`, a `tracing` bridge,
//!   ...) gets FerroCCL's records there and filters them by target as it likes
//!   (`RUST_LOG=ferroccl::coll=info`);
//! - where none is installed and `FERROCCL_DEBUG` asks for logs (`WARN`, `INFO` or `TRACE`),
//!   the first communicator installs a small one that writes each record as one line to
//!   stderr, `ferroccl LEVEL subsys: message`, keeping the records of
//!   `FERROCCL_DEBUG_SUBSYS`'s subsystems at or above that level.
//!
//! What each level says: `WARN`, what went wrong or was given up (a fatal error and its
//! culprit, a path turned off); `INFO`, how the job was set up (transports, addresses,
//! knobs set) and, at each call's first occurrence, how it runs (algorithm, protocol,
//! chunks and the cost model's estimates: an explain plan); `TRACE`, every call and
//! registration. When no record is enabled a call site costs one relaxed load and a
//! compare (`log`'s maximum level); the messages are formatted only when enabled.

use std::io::Write;
use std::sync::OnceLock;

/// `FERROCCL_DEBUG`: the least severe records written (with FerroCCL's own logger).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum DebugLevel {
    /// Nothing (`0`, `off`; the default).
    #[default]
    Off,
    /// Failures and things given up (`WARN`).
    Warn,
    /// Setup and each call's first occurrence (`INFO`, also `1`).
    Info,
    /// Every call (`TRACE`).
    Trace,
}

impl DebugLevel {
    /// Parses `FERROCCL_DEBUG` (case-insensitive): `0`/`off`/`none`, `warn`, `info`/`1`,
    /// `trace`.
    pub fn parse(v: &str) -> Option<DebugLevel> {
        Some(match v.trim().to_ascii_lowercase().as_str() {
            "" | "0" | "off" | "none" | "false" | "no" => DebugLevel::Off,
            "warn" | "warning" => DebugLevel::Warn,
            "info" | "1" | "true" | "yes" | "on" => DebugLevel::Info,
            "trace" | "debug" | "all" => DebugLevel::Trace,
            _ => return None,
        })
    }

    fn filter(self) -> log::LevelFilter {
        match self {
            DebugLevel::Off => log::LevelFilter::Off,
            DebugLevel::Warn => log::LevelFilter::Warn,
            DebugLevel::Info => log::LevelFilter::Info,
            DebugLevel::Trace => log::LevelFilter::Trace,
        }
    }
}

/// The parts of FerroCCL a record comes from (`FERROCCL_DEBUG_SUBSYS`).
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Subsys {
    /// Communicator setup: transports chosen, knobs set, connection times.
    Init,
    /// The transports: addresses, devices, connections.
    Transport,
    /// Collectives: how each call runs (explain), and every call at `TRACE`.
    Coll,
    /// Persistent plans and transfer plans.
    Plan,
    /// The registration cache.
    Reg,
    /// Failures: fatal errors, their culprits, peers that died, aborts.
    Health,
}

impl Subsys {
    /// Every subsystem, in the order of the bits of [`SubsysSet`].
    pub const ALL: [Subsys; 6] = [Subsys::Init, Subsys::Transport, Subsys::Coll, Subsys::Plan, Subsys::Reg, Subsys::Health];

    /// Its name in `FERROCCL_DEBUG_SUBSYS` and in the lines written (`init`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            Subsys::Init => "init",
            Subsys::Transport => "transport",
            Subsys::Coll => "coll",
            Subsys::Plan => "plan",
            Subsys::Reg => "reg",
            Subsys::Health => "health",
        }
    }

    /// Its records' `log` target (`ferroccl::init`, ...).
    pub const fn target(self) -> &'static str {
        match self {
            Subsys::Init => "ferroccl::init",
            Subsys::Transport => "ferroccl::transport",
            Subsys::Coll => "ferroccl::coll",
            Subsys::Plan => "ferroccl::plan",
            Subsys::Reg => "ferroccl::reg",
            Subsys::Health => "ferroccl::health",
        }
    }

    fn bit(self) -> u8 {
        1 << Subsys::ALL.iter().position(|&s| s == self).unwrap_or(0)
    }

    fn from_target(t: &str) -> Option<Subsys> {
        Subsys::ALL.into_iter().find(|s| s.target() == t)
    }
}

/// A set of [`Subsys`] (`FERROCCL_DEBUG_SUBSYS`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SubsysSet(u8);

impl Default for SubsysSet {
    fn default() -> Self {
        SubsysSet::ALL
    }
}

impl SubsysSet {
    /// Every subsystem (the default).
    pub const ALL: SubsysSet = SubsysSet(0b11_1111);

    /// Whether `s` is in the set.
    pub fn contains(self, s: Subsys) -> bool {
        self.0 & s.bit() != 0
    }

    /// Parses `FERROCCL_DEBUG_SUBSYS` as NCCL parses `NCCL_DEBUG_SUBSYS`: names separated by
    /// commas, case-insensitive, `ALL` for every one; a leading `^` takes the complement of
    /// the list (`^reg,plan`: all but those). Unknown names are an error naming the known
    /// ones.
    pub fn parse(v: &str) -> Result<SubsysSet, String> {
        let v = v.trim();
        let (invert, list) = match v.strip_prefix('^') {
            Some(rest) => (true, rest),
            None => (false, v),
        };
        let mut bits = 0u8;
        for name in list.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            if name.eq_ignore_ascii_case("all") {
                bits = SubsysSet::ALL.0;
                continue;
            }
            match Subsys::ALL.into_iter().find(|s| s.name().eq_ignore_ascii_case(name)) {
                Some(s) => bits |= s.bit(),
                None => {
                    let known: Vec<&str> = Subsys::ALL.iter().map(|s| s.name()).collect();
                    return Err(format!("{name:?} is not a subsystem (one of {}, or all; ^ before the list excludes)", known.join(", ")));
                }
            }
        }
        Ok(SubsysSet(if invert { !bits & SubsysSet::ALL.0 } else { bits }))
    }
}

impl std::fmt::Display for SubsysSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = Subsys::ALL.iter().filter(|&&s| self.contains(s)).map(|s| s.name()).collect();
        f.write_str(&names.join(","))
    }
}

/// FerroCCL's own logger (see the module documentation).
#[derive(Debug)]
struct StderrLogger {
    level: log::LevelFilter,
    subsys: SubsysSet,
}

impl log::Log for StderrLogger {
    fn enabled(&self, m: &log::Metadata<'_>) -> bool {
        m.level() <= self.level && Subsys::from_target(m.target()).is_some_and(|s| self.subsys.contains(s))
    }

    fn log(&self, r: &log::Record<'_>) {
        if !self.enabled(r.metadata()) {
            return;
        }
        let sub = Subsys::from_target(r.target()).map_or("?", Subsys::name);
        // One `write` per record: ranks share the launcher's pipe, and a record written in
        // pieces could be cut by another process's line.
        let line = format!("ferroccl {} {sub}: {}\n", r.level(), r.args());
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
    }

    fn flush(&self) {}
}

static LOGGER: OnceLock<StderrLogger> = OnceLock::new();

/// Installs FerroCCL's stderr logger for `level` and `subsys` if the process has no logger
/// yet and `level` asks for records; the first call's settings stay (as the first
/// logger a process installs does). Whether FerroCCL's logger is the one in place.
pub(crate) fn install(level: DebugLevel, subsys: SubsysSet) -> bool {
    if level == DebugLevel::Off {
        return false;
    }
    let ours = LOGGER.get_or_init(|| StderrLogger { level: level.filter(), subsys });
    if log::set_logger(ours).is_ok() {
        log::set_max_level(ours.level);
        return true;
    }
    // A logger is in place already: ours, or the application's (which decides).
    std::ptr::eq(log::logger() as *const dyn log::Log as *const (), ours as *const StderrLogger as *const ())
}

/// Whether a record of `level` from `sub` would be written (for work done only to log).
pub(crate) fn enabled(sub: Subsys, level: log::Level) -> bool {
    level <= log::max_level() && log::logger().enabled(&log::Metadata::builder().level(level).target(sub.target()).build())
}

/// `log!` with a [`Subsys`]'s target: `flog!(Info, Coll, "...", args)`.
macro_rules! flog {
    ($level:ident, $sub:ident, $($arg:tt)+) => {
        ::log::log!(target: $crate::logging::Subsys::$sub.target(), ::log::Level::$level, $($arg)+)
    };
}
pub(crate) use flog;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_parse_as_nccl_debug_values_do() {
        assert_eq!(DebugLevel::parse("WARN"), Some(DebugLevel::Warn));
        assert_eq!(DebugLevel::parse("info"), Some(DebugLevel::Info));
        assert_eq!(DebugLevel::parse("1"), Some(DebugLevel::Info));
        assert_eq!(DebugLevel::parse(" Trace "), Some(DebugLevel::Trace));
        assert_eq!(DebugLevel::parse("0"), Some(DebugLevel::Off));
        assert_eq!(DebugLevel::parse("loud"), None);
        assert!(DebugLevel::Warn < DebugLevel::Info && DebugLevel::Info < DebugLevel::Trace);
    }

    #[test]
    fn subsystem_lists_parse_as_nccl_debug_subsys_does() {
        let s = SubsysSet::parse("INIT,coll").unwrap();
        assert!(s.contains(Subsys::Init) && s.contains(Subsys::Coll) && !s.contains(Subsys::Reg));
        let s = SubsysSet::parse("^reg,plan").unwrap();
        assert!(!s.contains(Subsys::Reg) && !s.contains(Subsys::Plan) && s.contains(Subsys::Health));
        assert_eq!(SubsysSet::parse("ALL").unwrap(), SubsysSet::ALL);
        assert_eq!(SubsysSet::parse("^all").unwrap().to_string(), "");
        let e = SubsysSet::parse("init,net").unwrap_err();
        assert!(e.contains("\"net\"") && e.contains("health"), "{e}");
        assert_eq!(SubsysSet::parse("coll,health").unwrap().to_string(), "coll,health");
    }

    #[test]
    fn targets_map_back_to_their_subsystems() {
        for s in Subsys::ALL {
            assert_eq!(Subsys::from_target(s.target()), Some(s));
        }
        assert_eq!(Subsys::from_target("other::crate"), None);
    }
}
