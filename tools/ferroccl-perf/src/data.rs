//! Deterministic inputs and the reference results `-c 1` checks against.
//!
//! Rank `r`'s input element `i` is a small integer, a function of `(r, i mod 251)` and of
//! the operation: -2..=2 (0..=4 for unsigned types) for sum, min, max and avg; +-1 (with a
//! few 2s on rank 0) for prod. These values, every partial sum of up to 63 ranks and every
//! product are exactly representable in every dtype (bf16 holds integers up to 256 exactly; an i8 or u8 sum of 63 ranks does not wrap, so integer avg is exact whichever way it is computed),
//! so *every* reduction order gives the same bits and the reference (the kernels crate's
//! rank-order reduction, which defines the semantics) is exact. Integer sums and products
//! wrap, which is order-independent too.
//!
//! The period of 251 (a prime, so it never lines up with power-of-two chunk sizes) lets the
//! reference of a reduction be computed once, for 251 elements, whatever the buffer size.

use ferroccl::{Element, ReduceOp};
use ferroccl_kernels::{as_bytes, bf16, f16};

/// The period of the input pattern.
pub const PERIOD: usize = 251;

/// An element type whose values can be built from small integers.
pub trait Val: Element {
    /// `v` in this type (exact for the values the inputs use).
    fn from_small(v: i32) -> Self;
    /// Whether the type holds negative values.
    const SIGNED: bool;
}

macro_rules! val_as {
    ($($t:ty: $signed:expr),*) => { $(
        impl Val for $t {
            fn from_small(v: i32) -> Self {
                v as $t
            }
            const SIGNED: bool = $signed;
        }
    )* };
}
val_as!(f32: true, f64: true, i8: true, u8: false, i32: true, u32: false, i64: true, u64: false);

impl Val for f16 {
    fn from_small(v: i32) -> Self {
        f16::from_f32(v as f32)
    }
    const SIGNED: bool = true;
}

impl Val for bf16 {
    fn from_small(v: i32) -> Self {
        bf16::from_f32(v as f32)
    }
    const SIGNED: bool = true;
}

/// Rank `rank`'s input value at a position `m` (`0..PERIOD`) of the pattern.
pub fn small(rank: usize, m: usize, op: ReduceOp, signed: bool) -> i32 {
    let h = ((m * 7 + rank * 13 + m * rank * 3) % 5) as i32;
    match op {
        ReduceOp::Prod if rank == 0 && h == 1 => 2,
        ReduceOp::Prod if signed && h == 0 => -1,
        ReduceOp::Prod => 1,
        _ if signed => h - 2,
        _ => h,
    }
}

/// The input patterns of every rank and the reference reduction over all of them.
#[derive(Debug)]
pub struct Patterns<T> {
    /// `inputs[r][m]`: rank r's value at pattern position m.
    pub inputs: Vec<Vec<T>>,
    /// The rank-order reduction of `inputs` (by the kernels crate's reference).
    pub reduced: Vec<T>,
}

impl<T: Val> Patterns<T> {
    /// The patterns of `n` ranks for `op`.
    pub fn new(n: usize, op: ReduceOp) -> Self {
        let inputs: Vec<Vec<T>> = (0..n).map(|r| (0..PERIOD).map(|m| T::from_small(small(r, m, op, T::SIGNED))).collect()).collect();
        let srcs: Vec<&[T]> = inputs.iter().map(|v| v.as_slice()).collect();
        let mut reduced = inputs[0].clone();
        ferroccl_kernels::reference::reduce_many(op, &srcs, &mut reduced);
        Patterns { inputs, reduced }
    }

    /// Fills `buf` with rank `rank`'s input from global index `from` on.
    pub fn fill(&self, rank: usize, buf: &mut [T], from: usize) {
        fill_from(&self.inputs[rank], buf, from);
    }
}

/// `buf[k] = pattern[(from + k) % PERIOD]`.
pub fn fill_from<T: Copy>(pattern: &[T], buf: &mut [T], from: usize) {
    let mut m = from % PERIOD;
    for x in buf.iter_mut() {
        *x = pattern[m];
        m += 1;
        if m == PERIOD {
            m = 0;
        }
    }
}

/// Number of elements of `got` whose bits differ from `pattern[(from + k) % PERIOD]`.
pub fn count_wrong<T: Element>(pattern: &[T], got: &[T], from: usize) -> usize {
    let mut m = from % PERIOD;
    let mut wrong = 0;
    for x in got {
        if as_bytes(std::slice::from_ref(x)) != as_bytes(std::slice::from_ref(&pattern[m])) {
            wrong += 1;
        }
        m += 1;
        if m == PERIOD {
            m = 0;
        }
    }
    wrong
}

/// Flips the bits of the first byte of `buf` (the hidden `--corrupt-rank` option).
pub fn corrupt<T: Element>(buf: &mut [T]) {
    if let Some(first) = ferroccl_kernels::as_bytes_mut(buf).first_mut() {
        *first ^= 0xff;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reference must not depend on the reduction order: reduce pairwise in reverse and
    /// compare bit for bit.
    fn order_independent<T: Val>(n: usize, op: ReduceOp) {
        let p = Patterns::<T>::new(n, op);
        let mut acc = p.inputs[n - 1].clone();
        for r in (0..n - 1).rev() {
            let mut next = p.inputs[r].clone();
            ferroccl_kernels::reference::reduce_into(op.step(), &mut next, &acc);
            acc = next;
        }
        if op == ReduceOp::Avg {
            ferroccl_kernels::reference::finish_avg(&mut acc, n);
        }
        assert_eq!(count_wrong(&p.reduced, &acc, 0), 0, "{:?} n={n} {op}", T::DTYPE);
    }

    #[test]
    fn every_reduction_order_is_exact() {
        for n in [1, 2, 3, 4, 7, 16, 63] {
            for op in ReduceOp::ALL {
                order_independent::<f32>(n, op);
                order_independent::<f64>(n, op);
                order_independent::<f16>(n, op);
                order_independent::<bf16>(n, op);
                order_independent::<i8>(n, op);
                order_independent::<u8>(n, op);
                order_independent::<i32>(n, op);
                order_independent::<u32>(n, op);
                order_independent::<i64>(n, op);
                order_independent::<u64>(n, op);
            }
        }
    }

    #[test]
    fn ranks_differ_and_checks_count_elements() {
        let p = Patterns::<f32>::new(4, ReduceOp::Sum);
        assert_ne!(p.inputs[0], p.inputs[1]);
        let mut buf = vec![0f32; 1000];
        p.fill(2, &mut buf, 300);
        assert_eq!(count_wrong(&p.inputs[2], &buf, 300), 0);
        assert!(count_wrong(&p.inputs[2], &buf, 301) > 500, "a shifted pattern is mostly wrong");
        assert!(count_wrong(&p.inputs[1], &buf, 300) > 500, "another rank's pattern is mostly wrong");
        corrupt(&mut buf);
        assert_eq!(count_wrong(&p.inputs[2], &buf, 300), 1);
        buf[999] = 1e9;
        assert_eq!(count_wrong(&p.inputs[2], &buf, 300), 2);
    }
}
