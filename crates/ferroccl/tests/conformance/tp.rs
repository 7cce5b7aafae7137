//! Tensor parallelism (`ferroccl::tp`), over one instantiation's transport: every helper
//! against a local reference for 2 to 4 ranks, f32 and bf16 (small integers, so every sum
//! is exact whatever its order), blocking, grouped and in a scope; shapes that do not fit
//! the buffers or do not divide refused as `InvalidArgument` on the rank that passed them
//! (the communicator stays usable); shapes that differ between ranks a `Mismatch` on every
//! rank.

use std::time::Duration;

use ferroccl::tp::TensorParallel;
use ferroccl::{bf16, Communicator, Element, Error, Params};

use crate::harness::{all_ok, run_world, RankResult, Suite};

/// The element types under test, made from small integers.
trait Num: Element + Copy {
    fn of(v: i64) -> Self;
}

impl Num for f32 {
    fn of(v: i64) -> Self {
        v as f32
    }
}

impl Num for bf16 {
    fn of(v: i64) -> Self {
        bf16::from_f32(v as f32)
    }
}

/// Element (i, j) of rank r's input to call k: a small integer (sums of 4 stay exact in
/// bf16).
fn val(k: usize, r: usize, i: usize, j: usize) -> i64 {
    ((k * 31 + r * 7 + i * 5 + j * 3) % 23) as i64 - 11
}

fn params(s: &Suite, r: usize) -> Params {
    Params { timeout: Duration::from_secs(60), eager_max: 1024, ..s.params(r) }
}

/// A `[rows, cols]` matrix of `f(i, j)`.
fn matrix<T: Num>(rows: usize, cols: usize, f: impl Fn(usize, usize) -> i64) -> Vec<T> {
    (0..rows).flat_map(|i| (0..cols).map(move |j| (i, j))).map(|(i, j)| T::of(f(i, j))).collect()
}

fn same<T: Num>(r: usize, what: &str, got: &[T], want: &[T]) -> RankResult<()> {
    if got.len() != want.len() {
        return Err(format!("rank {r}: {what}: {} elements, expected {}", got.len(), want.len()));
    }
    match got.iter().zip(want).position(|(g, w)| g != w) {
        None => Ok(()),
        Some(i) => Err(format!("rank {r}: {what}: element {i} is {:?}, expected {:?}", got[i], want[i])),
    }
}

/// Every helper on one shape `[rows, cols]` (both divisible by the group's size), calls
/// numbered from `k`.
fn helpers_on<T: Num>(tp: &TensorParallel<'_>, k: usize, rows: usize, cols: usize) -> RankResult<()> {
    let (r, n) = (tp.rank(), tp.degree());
    let shape = [rows, cols];
    let e = |what: &'static str| move |e: Error| format!("rank {r}: {what} {shape:?}: {e}");
    let sum = |k: usize| move |i: usize, j: usize| (0..n).map(|p| val(k, p, i, j)).sum::<i64>();

    // Row-parallel: the sum of every rank's partial.
    let mut out: Vec<T> = matrix(rows, cols, |i, j| val(k, r, i, j));
    tp.row_parallel_reduce(&mut out, shape).map_err(e("row_parallel_reduce"))?;
    same(r, "row_parallel_reduce", &out, &matrix::<T>(rows, cols, sum(k)))?;

    // Column-parallel gathered: rank p holds columns p*c.. of one full matrix.
    let c = cols / n;
    let full = |i: usize, j: usize| val(k + 1, j / c.max(1), i, j);
    let local: Vec<T> = matrix(rows, c, |i, j| full(i, r * c + j));
    let mut got = vec![T::of(-99); rows * cols];
    tp.column_parallel_gather(&local, &mut got, shape).map_err(e("column_parallel_gather"))?;
    same(r, "column_parallel_gather", &got, &matrix::<T>(rows, cols, full))?;

    // Sequence parallel: this rank's rows of the sum, then every rank's rows gathered.
    let rr = rows / n;
    let partial: Vec<T> = matrix(rows, cols, |i, j| val(k + 2, r, i, j));
    let mut mine = vec![T::of(-99); rr * cols];
    tp.sequence_reduce_scatter(&partial, &mut mine, shape).map_err(e("sequence_reduce_scatter"))?;
    let s2 = sum(k + 2);
    same(r, "sequence_reduce_scatter", &mine, &matrix::<T>(rr, cols, |i, j| s2(r * rr + i, j)))?;
    let mut all = vec![T::of(-99); rows * cols];
    tp.sequence_allgather(&mine, &mut all, shape).map_err(e("sequence_allgather"))?;
    same(r, "sequence_allgather", &all, &matrix::<T>(rows, cols, s2))?;

    // Several partials as one group: small ones (fused) and one past the eager limit.
    let lens = [cols, 1, rows * cols, 600, 3];
    let mut bufs: Vec<Vec<T>> = lens.iter().enumerate().map(|(b, &len)| matrix(1, len, |_, j| val(k + 3 + b, r, 0, j))).collect();
    let mut views: Vec<&mut [T]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
    tp.row_parallel_reduce_many(&mut views).map_err(e("row_parallel_reduce_many"))?;
    for (b, (buf, &len)) in bufs.iter().zip(&lens).enumerate() {
        same(r, &format!("row_parallel_reduce_many buffer {b}"), buf, &matrix::<T>(1, len, sum(k + 3 + b)))?;
    }

    // The non-blocking forms, in one scope.
    let mut a: Vec<T> = matrix(rows, cols, |i, j| val(k + 9, r, i, j));
    let partial: Vec<T> = matrix(rows, cols, |i, j| val(k + 10, r, i, j));
    let mut scattered = vec![T::of(-99); rr * cols];
    let local: Vec<T> = matrix(rr, cols, |i, j| val(k + 11, r, i, j));
    let mut gathered = vec![T::of(-99); rows * cols];
    tp.comm()
        .scope(|s| {
            let q1 = tp.row_parallel_reduce_start(&s, &mut a, shape)?;
            let q2 = tp.sequence_reduce_scatter_start(&s, &partial, &mut scattered, shape)?;
            let q3 = tp.sequence_allgather_start(&s, &local, &mut gathered, shape)?;
            q1.wait()?;
            q2.wait()?;
            q3.wait()
        })
        .map_err(e("scope"))?;
    same(r, "row_parallel_reduce_start", &a, &matrix::<T>(rows, cols, sum(k + 9)))?;
    let s10 = sum(k + 10);
    same(r, "sequence_reduce_scatter_start", &scattered, &matrix::<T>(rr, cols, |i, j| s10(r * rr + i, j)))?;
    same(r, "sequence_allgather_start", &gathered, &matrix::<T>(rows, cols, |i, j| val(k + 11, i / rr.max(1), i % rr.max(1), j)))?;
    Ok(())
}

/// Every helper equals the local reference, 2 to 4 ranks, f32 and bf16, on a decode shape
/// (one row), a few rows, and empty matrices.
pub fn tp_helpers_equal_the_reference(s: &Suite) {
    for n in 2..=4usize {
        let res = run_world(
            n,
            |r| params(s, r),
            |comm: Communicator| -> RankResult<()> {
                let tp = TensorParallel::new(&comm);
                for (k, (rows, cols)) in [(n, 4 * n), (3 * n, 2 * n), (2 * n, n), (0, 0), (n, 40 * n)].into_iter().enumerate() {
                    helpers_on::<f32>(&tp, 20 * k, rows, cols)?;
                    helpers_on::<bf16>(&tp, 20 * k + 100, rows, cols)?;
                }
                // The decode shape: one row (rows == 1 is not divisible, so no sequence calls).
                let mut y: Vec<f32> = matrix(1, 8 * n, |i, j| val(7, comm.rank(), i, j));
                tp.row_parallel_reduce(&mut y, [1, 8 * n]).map_err(|e| e.to_string())?;
                let want: Vec<f32> = matrix(1, 8 * n, |i, j| (0..n).map(|p| val(7, p, i, j)).sum());
                same(comm.rank(), "decode row_parallel_reduce", &y, &want)?;
                let local: Vec<f32> = matrix(1, 8, |_, j| (comm.rank() * 8 + j) as i64);
                let mut full = vec![0f32; 8 * n];
                tp.column_parallel_gather(&local, &mut full, [1, 8 * n]).map_err(|e| e.to_string())?;
                same(comm.rank(), "decode column_parallel_gather", &full, &matrix::<f32>(1, 8 * n, |_, j| j as i64))?;
                comm.finalize().map_err(|e| e.to_string())
            },
        );
        all_ok(res).unwrap_or_else(|e| panic!("{:?}, {n} ranks: {e}", s.wire));
    }
}

/// Expects an `InvalidArgument` whose text contains every one of `needles`.
fn expect_invalid(r: usize, what: &str, res: ferroccl::Result<()>, needles: &[&str]) -> RankResult<()> {
    match res {
        Err(Error::InvalidArgument(m)) if needles.iter().all(|n| m.contains(n)) => Ok(()),
        other => Err(format!("rank {r}: {what}: expected InvalidArgument mentioning {needles:?}, got {other:?}")),
    }
}

/// Shapes that do not fit their buffers, or do not divide by the group's size, are
/// `InvalidArgument`s that name what was expected and what came, nothing goes on the wire
/// and the communicator stays usable (`finalize` compares every stream).
pub fn tp_bad_shapes_are_errors(s: &Suite) {
    let res = run_world(
        3,
        |r| params(s, r),
        |comm: Communicator| -> RankResult<()> {
            let r = comm.rank();
            let tp = TensorParallel::new(&comm);
            let mut out = vec![0f32; 12];
            expect_invalid(
                r,
                "row_parallel_reduce",
                tp.row_parallel_reduce(&mut out, [2, 5]),
                &["out has 12 elements", "expected 10", "[2, 5]"],
            )?;
            expect_invalid(r, "overflow", tp.row_parallel_reduce(&mut out, [usize::MAX, 2]), &["overflows"])?;
            let local = vec![0f32; 4];
            let mut full = vec![0f32; 12];
            expect_invalid(
                r,
                "column_parallel_gather cols",
                tp.column_parallel_gather(&local, &mut full, [2, 6 + 1]),
                &["column_parallel_gather", "cols = 7", "degree 3"],
            )?;
            expect_invalid(
                r,
                "column_parallel_gather local",
                tp.column_parallel_gather(&local, &mut full, [3, 6]),
                &["local has 4 elements", "expected 6", "[3, 2]"],
            )?;
            let mut small = vec![0f32; 11];
            expect_invalid(
                r,
                "column_parallel_gather out",
                tp.column_parallel_gather(&local, &mut small, [2, 6]),
                &["out has 11 elements", "expected 12", "[2, 6]"],
            )?;
            let partial = vec![0f32; 12];
            let mut mine = vec![0f32; 4];
            expect_invalid(
                r,
                "sequence_reduce_scatter rows",
                tp.sequence_reduce_scatter(&partial, &mut mine, [4, 3]),
                &["sequence_reduce_scatter", "rows = 4", "degree 3"],
            )?;
            let mut mine3 = vec![0f32; 3];
            expect_invalid(
                r,
                "sequence_reduce_scatter out",
                tp.sequence_reduce_scatter(&partial, &mut mine3, [3, 4]),
                &["out has 3 elements", "expected 4", "[1, 4]"],
            )?;
            expect_invalid(
                r,
                "sequence_allgather local",
                tp.sequence_allgather(&mine3, &mut full, [3, 4]),
                &["local has 3 elements", "expected 4", "[1, 4]"],
            )?;
            expect_invalid(
                r,
                "sequence_allgather out",
                tp.sequence_allgather(&mine, &mut small, [3, 4]),
                &["out has 11 elements", "expected 12", "[3, 4]"],
            )?;
            expect_invalid(r, "column_range", tp.column_range(10).map(drop), &["cols = 10", "degree 3"])?;
            comm.scope(|s| {
                expect_invalid(r, "start", tp.row_parallel_reduce_start(&s, &mut out, [5, 5]).map(drop), &["expected 25"])
                    .map_err(Error::InvalidArgument)
            })
            .map_err(|e| e.to_string())?;
            // Still usable: a good call of each, then finalize.
            out.fill(1.0);
            tp.row_parallel_reduce(&mut out, [3, 4]).map_err(|e| e.to_string())?;
            same(r, "after the errors", &out, &[3f32; 12])?;
            comm.finalize().map_err(|e| e.to_string())
        },
    );
    all_ok(res).unwrap_or_else(|e| panic!("{:?}: {e}", s.wire));
}

/// Ranks that pass different shapes (the buffers differ in length) fail with `Mismatch` on
/// every rank, whichever helper: rank 1 has one row more, or one column block wider.
pub fn tp_shapes_that_differ_across_ranks_fail_on_every_rank(s: &Suite) {
    for helper in ["row_parallel_reduce", "column_parallel_gather", "sequence_reduce_scatter", "sequence_allgather", "many"] {
        let res = run_world(
            2,
            |r| params(s, r),
            |comm: Communicator| -> RankResult<String> {
                let tp = TensorParallel::new(&comm);
                let extra = comm.rank(); // rank 1: one more row (two for the sequence calls)
                let (rows, cols) = (2 + 2 * extra, 4);
                let res = match helper {
                    "row_parallel_reduce" => tp.row_parallel_reduce(&mut vec![1f32; (2 + extra) * cols], [2 + extra, cols]),
                    "column_parallel_gather" => {
                        // Rank 0: [3, 4] (columns 2 each), rank 1: [3, 8] (4 each).
                        let c = 2 + 2 * extra;
                        tp.column_parallel_gather(&vec![1f32; 3 * c], &mut vec![0f32; 3 * 2 * c], [3, 2 * c])
                    }
                    "sequence_reduce_scatter" => {
                        tp.sequence_reduce_scatter(&vec![1f32; rows * cols], &mut vec![0f32; rows / 2 * cols], [rows, cols])
                    }
                    "sequence_allgather" => tp.sequence_allgather(&vec![1f32; rows / 2 * cols], &mut vec![0f32; rows * cols], [rows, cols]),
                    _ => {
                        let mut a = vec![1f32; 4];
                        let mut b = vec![1f32; 4 + extra];
                        tp.row_parallel_reduce_many(&mut [a.as_mut_slice(), b.as_mut_slice()])
                    }
                };
                match res {
                    Err(e @ Error::Mismatch { .. }) => Ok(e.to_string()),
                    other => Err(format!("rank {}: {helper}: expected Mismatch, got {other:?}", comm.rank())),
                }
            },
        );
        let msgs = all_ok(res).unwrap_or_else(|e| panic!("{:?}: {helper}: {e}", s.wire));
        assert_eq!(msgs.len(), 2);
    }
}
