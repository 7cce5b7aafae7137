//! The nccl-tests-style table on stdout and the `--json` file.

use std::path::Path;

use serde_json::{json, Value};

use crate::args::{format_size, Options};
use crate::colls::Coll;
use crate::results::{Cell, CollResult, Row};
use crate::Failure;

/// What the header and the JSON metadata say about the job.
#[derive(Clone, Debug)]
pub struct JobInfo {
    /// Number of ranks.
    pub ranks: usize,
    /// Rank 0's transport to each rank (`self` for itself).
    pub transports: Vec<String>,
    /// Rank 0's host name.
    pub hostname: String,
    /// Logical CPUs of rank 0's host.
    pub nproc: usize,
    /// `Communicator::init` time in milliseconds, the slowest rank's.
    pub init_ms: f64,
    /// Rank 0's mesh setup time in milliseconds (`Communicator::setup_time`).
    pub setup_ms: f64,
    /// The algorithm setting (`auto` or a name).
    pub algo: String,
    /// The CPU each rank is pinned to (`FERROCCL_BOUND_CPU`, set by ferroccl-run and by
    /// `--ranks` unless `--no-bind`), by rank; `None`: not pinned.
    pub pinned: Vec<Option<usize>>,
}

impl JobInfo {
    /// "shm" when every peer uses the same transport, else "1 shm, 2 tcp, ...".
    pub fn transport_summary(&self) -> String {
        let peers: Vec<(usize, &String)> = self.transports.iter().enumerate().filter(|(_, t)| t.as_str() != "self").collect();
        match peers.first() {
            None => "self (one rank)".into(),
            Some((_, first)) if peers.iter().all(|(_, t)| t == first) => format!("{first} (every peer of rank 0)"),
            _ => peers.iter().map(|(p, t)| format!("0->{p} {t}")).collect::<Vec<_>>().join(", "),
        }
    }

    /// "CPUs 0,1,2,3" (rank r on the r-th), "no (...)", or by rank with `-` for unpinned.
    pub fn pinned_summary(&self) -> String {
        let cpu = |c: &Option<usize>| c.map_or_else(|| "-".to_string(), |c| c.to_string());
        if self.pinned.iter().all(Option::is_none) {
            "no (the kernel places the ranks)".into()
        } else if self.pinned.iter().all(Option::is_some) {
            format!("CPUs {} (rank r on the r-th)", self.pinned.iter().map(cpu).collect::<Vec<_>>().join(","))
        } else {
            format!("by rank {}", self.pinned.iter().map(cpu).collect::<Vec<_>>().join(","))
        }
    }
}

/// The job header (printed once, before the tables).
pub fn print_job_header(info: &JobInfo, o: &Options) {
    let colls: Vec<&str> = o.colls.iter().map(|c| c.name()).collect();
    println!("# ferroccl-perf {}: {}", env!("CARGO_PKG_VERSION"), colls.join(", "));
    println!(
        "#  ranks {}, dtype {}, op {}, root {}, sizes {} .. {} x{}, iters {}, warmup {}, check {}",
        info.ranks,
        o.dtype,
        o.op,
        o.root,
        format_size(o.min_bytes),
        format_size(o.max_bytes),
        o.factor,
        o.iters,
        o.warmup,
        u8::from(o.check)
    );
    if o.plan {
        println!("#  calls: persistent plans (built once per size; timed: plan.run(); plans are in place for allreduce and broadcast, out of place for allgather and reduce_scatter)");
    }
    println!("#  host {} (nproc {})", info.hostname, info.nproc);
    println!("#  transport: {}", info.transport_summary());
    println!("#  pinned: {}", info.pinned_summary());
    println!("#  init: {:.1} ms (slowest rank; mesh setup {:.1} ms on rank 0)", info.init_ms, info.setup_ms);
    if info.algo == "auto" {
        println!("#  algorithm: auto (the library's cost model picks per call; the algo column shows its choice)");
    } else {
        println!("#  algorithm: {} (FERROCCL_ALGO; collectives without a {} variant keep the cost model's choice)", info.algo, info.algo);
    }
}

const GROUP: usize = 34;
const LEAD: usize = 51;

/// The column header of one collective's table.
pub fn print_table_header(coll: Coll) {
    println!("#");
    println!("# {coll}: busbw = algbw * {}", factor_text(coll));
    let blank = "";
    println!("{}", format!("#{blank:LEAD$}{:^GROUP$}{:^GROUP$}", "out-of-place", "in-place").trim_end());
    println!(
        "{}",
        columns(["size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw", "#wrong", "algo"])
    );
    println!("{}", columns(["(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", "", ""]));
}

/// A header line: the fields in the rows' widths.
fn columns(f: [&str; 14]) -> String {
    let line = format!(
        "#{:>12} {:>13} {:>7} {:>7} {:>7} {:>9} {:>7} {:>7} {:>7} {:>9} {:>7} {:>7} {:>7}  {}",
        f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7], f[8], f[9], f[10], f[11], f[12], f[13]
    );
    line.trim_end().to_string()
}

fn factor_text(coll: Coll) -> &'static str {
    match coll {
        Coll::AllReduce => "2(n-1)/n",
        Coll::AllGather | Coll::ReduceScatter | Coll::AllToAll | Coll::AllToAllV | Coll::AllGatherV | Coll::ReduceScatterV => "(n-1)/n",
        Coll::Broadcast | Coll::Reduce | Coll::SendRecv => "1",
    }
}

fn time_text(us: f64) -> String {
    if us < 10_000.0 {
        format!("{us:.2}")
    } else {
        format!("{us:.0}")
    }
}

fn cell_text(c: Option<Cell>) -> [String; 4] {
    match c {
        None => ["N/A".into(), "N/A".into(), "N/A".into(), "N/A".into()],
        Some(c) => [
            time_text(c.time_us),
            format!("{:.2}", c.algbw),
            format!("{:.2}", c.busbw),
            c.wrong.map_or_else(|| "N/A".to_string(), |w| w.to_string()),
        ],
    }
}

/// One row of the table, as printed.
pub fn row_text(r: &Row) -> String {
    let [t0, a0, b0, w0] = cell_text(r.oop);
    let [t1, a1, b1, w1] = cell_text(r.ip);
    let op = r.op.map_or("none", |o| o.name());
    let root = r.root.map_or(-1, |x| x as i64);
    format!(
        " {:>12} {:>13} {:>7} {:>7} {:>7} {:>9} {:>7} {:>7} {:>7} {:>9} {:>7} {:>7} {:>7}  {}",
        r.size,
        r.count,
        r.dtype.name(),
        op,
        root,
        t0,
        a0,
        b0,
        w0,
        t1,
        a1,
        b1,
        w1,
        r.algo
    )
}

/// Prints one row.
pub fn print_row(r: &Row) {
    println!("{}", row_text(r));
}

/// The footer of one collective's table.
pub fn print_table_footer(res: &CollResult, o: &Options) {
    if o.check {
        let w = res.wrong();
        println!("# {}: wrong elements: {w} {}", res.coll, if w == 0 { "OK" } else { "FAILED" });
    } else {
        println!("# {}: wrong elements: N/A (-c 0)", res.coll);
    }
    println!("# Avg bus bandwidth    : {:.3} GB/s", res.avg_busbw());
}

fn cell_json(c: Option<Cell>) -> Value {
    match c {
        None => Value::Null,
        Some(c) => json!({ "time_us": c.time_us, "algbw": c.algbw, "busbw": c.busbw, "wrong": c.wrong }),
    }
}

/// The whole run as JSON: metadata and every row.
pub fn to_json(info: &JobInfo, o: &Options, results: &[CollResult]) -> Value {
    let runs: Vec<Value> = results
        .iter()
        .map(|res| {
            let rows: Vec<Value> = res
                .rows
                .iter()
                .map(|r| {
                    json!({
                        "size": r.size,
                        "count": r.count,
                        "type": r.dtype.name(),
                        "redop": r.op.map_or("none", |o| o.name()),
                        "root": r.root.map_or(-1, |x| x as i64),
                        "algo": r.algo,
                        "out_of_place": cell_json(r.oop),
                        "in_place": cell_json(r.ip),
                    })
                })
                .collect();
            json!({
                "collective": res.coll.name(),
                "bus_factor": res.coll.bus_factor(info.ranks),
                "avg_busbw": res.avg_busbw(),
                "wrong": if o.check { json!(res.wrong()) } else { Value::Null },
                "rows": rows,
            })
        })
        .collect();
    json!({
        "tool": "ferroccl-perf",
        "label": if o.plan { "FerroCCL plan" } else { "FerroCCL" },
        "plan": o.plan,
        "version": env!("CARGO_PKG_VERSION"),
        "ranks": info.ranks,
        "transport": info.transport_summary(),
        "transports": info.transports,
        "dtype": o.dtype.name(),
        "op": o.op.name(),
        "root": o.root,
        "iters": o.iters,
        "warmup": o.warmup,
        "check": o.check,
        "algo": info.algo,
        "init_ms": info.init_ms,
        "pinned_cpus": info.pinned,
        "machine": { "hostname": info.hostname, "nproc": info.nproc },
        "runs": runs,
    })
}

/// Writes `value` to `path`, pretty-printed.
pub fn write_json(path: &Path, value: &Value) -> Result<(), Failure> {
    let text = serde_json::to_string_pretty(value).map_err(|e| Failure::Output { path: path.into(), what: e.to_string() })?;
    std::fs::write(path, text + "\n").map_err(|e| Failure::Output { path: path.into(), what: e.to_string() })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferroccl::{DType, ReduceOp};

    fn row() -> Row {
        Row {
            size: 1 << 20,
            count: 262144,
            dtype: DType::F32,
            op: Some(ReduceOp::Sum),
            root: None,
            algo: "auto".into(),
            oop: Some(Cell { time_us: 250.0, algbw: 4.19, busbw: 6.29, wrong: Some(0) }),
            ip: None,
        }
    }

    #[test]
    fn rows_have_the_nccl_tests_columns() {
        let t = row_text(&row());
        let f: Vec<&str> = t.split_whitespace().collect();
        assert_eq!(f, ["1048576", "262144", "f32", "sum", "-1", "250.00", "4.19", "6.29", "0", "N/A", "N/A", "N/A", "N/A", "auto"]);
    }

    #[test]
    fn json_has_metadata_and_rows() {
        let info = JobInfo {
            ranks: 2,
            transports: vec!["self".into(), "shm".into()],
            hostname: "h".into(),
            nproc: 8,
            init_ms: 3.0,
            setup_ms: 2.0,
            algo: "auto".into(),
            pinned: vec![Some(0), Some(1)],
        };
        let res = CollResult { coll: Coll::AllReduce, rows: vec![row()] };
        let v = to_json(&info, &Options::default(), &[res]);
        assert_eq!(v["ranks"], 2);
        assert_eq!(v["transport"], "shm (every peer of rank 0)");
        assert_eq!(v["machine"]["nproc"], 8);
        assert_eq!(v["pinned_cpus"], json!([0, 1]));
        assert_eq!(info.pinned_summary(), "CPUs 0,1 (rank r on the r-th)");
        let unpinned = JobInfo { pinned: vec![None, None], ..info.clone() };
        assert!(unpinned.pinned_summary().starts_with("no"));
        assert_eq!(v["runs"][0]["collective"], "allreduce");
        assert_eq!(v["runs"][0]["rows"][0]["out_of_place"]["busbw"], 6.29);
        assert!(v["runs"][0]["rows"][0]["in_place"].is_null());
        assert_eq!(v["runs"][0]["avg_busbw"], 6.29);
    }
}
