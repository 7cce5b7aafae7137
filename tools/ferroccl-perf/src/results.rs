//! What a sweep measured, as data: the rows of each collective's table (filled by
//! `bench`, printed and written by `report`).

use ferroccl::{DType, ReduceOp};

use crate::colls::Coll;

/// One variant (out-of-place or in-place) of one row, as rank 0 reports it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Cell {
    /// Mean time of one call in microseconds, the slowest rank's.
    pub time_us: f64,
    /// `size / time` in GB/s.
    pub algbw: f64,
    /// `algbw * bus factor` in GB/s.
    pub busbw: f64,
    /// Wrong elements summed over the ranks; `None` with `-c 0`.
    pub wrong: Option<u64>,
}

/// One row of the table.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    /// The `size` column (bytes).
    pub size: usize,
    /// The `count` column (elements).
    pub count: usize,
    /// The element type.
    pub dtype: DType,
    /// The reduction (`None` for collectives that do not reduce).
    pub op: Option<ReduceOp>,
    /// The root (`None` for collectives without one).
    pub root: Option<usize>,
    /// The algorithm setting the row ran with.
    pub algo: String,
    /// Out of place (`None`: not run, or FerroCCL has no such form).
    pub oop: Option<Cell>,
    /// In place (`None`: not run, or FerroCCL has no such form).
    pub ip: Option<Cell>,
}

/// The rows of one collective.
#[derive(Clone, Debug, PartialEq)]
pub struct CollResult {
    /// The collective.
    pub coll: Coll,
    /// Its rows, smallest size first.
    pub rows: Vec<Row>,
}

impl CollResult {
    /// nccl-tests' "Avg bus bandwidth": the mean busbw over every cell of the table.
    pub fn avg_busbw(&self) -> f64 {
        let v: Vec<f64> = self.rows.iter().flat_map(|r| [r.oop, r.ip]).flatten().map(|c| c.busbw).collect();
        if v.is_empty() {
            0.0
        } else {
            v.iter().sum::<f64>() / v.len() as f64
        }
    }

    /// Wrong elements over every cell.
    pub fn wrong(&self) -> u64 {
        self.rows.iter().flat_map(|r| [r.oop, r.ip]).flatten().filter_map(|c| c.wrong).sum()
    }
}
