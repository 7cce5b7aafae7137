//! Hand-written tests of the documented semantics, run against the reference and every level.

use super::{first_difference, levels, SameAs};
use crate::reference::{CANONICAL_NAN_BF16, CANONICAL_NAN_F16, CANONICAL_NAN_F32, CANONICAL_NAN_F64};
use crate::{as_bytes, as_bytes_mut, bf16, f16, reference, DType, KernelError, Kernels, ReduceOp, SimdLevel};

/// `reduce_into(op, acc, src)` by the reference and by every level, all equal to `want`.
fn into_all<T: SameAs>(op: ReduceOp, acc: &[T], src: &[T], want: &[T]) {
    let mut r = acc.to_vec();
    reference::reduce_into(op, &mut r, src);
    assert_eq!(first_difference(&r, want), None, "reference {} {op}", T::DTYPE);
    for k in levels() {
        let mut got = acc.to_vec();
        k.reduce_into(op, &mut got, src);
        assert_eq!(first_difference(&got, want), None, "{} {op} at {}", T::DTYPE, k.level());
    }
}

/// `reduce_many(op, srcs)` by the reference and by every level, all equal to `want`.
fn many_all<T: SameAs>(op: ReduceOp, srcs: &[&[T]], want: &[T]) {
    let mut r = vec![T::zeroed(); want.len()];
    reference::reduce_many(op, srcs, &mut r);
    assert_eq!(first_difference(&r, want), None, "reference {} {op}", T::DTYPE);
    for k in levels() {
        let mut got = vec![T::zeroed(); want.len()];
        k.reduce_many(op, srcs, &mut got);
        assert_eq!(first_difference(&got, want), None, "{} {op} at {}", T::DTYPE, k.level());
    }
}

/// `n` copies of `x` (long enough to go through the vector loops, not just the tails).
fn rep<T: Copy>(x: T, n: usize) -> Vec<T> {
    vec![x; n]
}

const N: usize = 67;

#[test]
fn ops_have_names() {
    for op in ReduceOp::ALL {
        assert_eq!(ReduceOp::parse(op.name()), Some(op));
        assert_eq!(op.to_string(), op.name());
    }
    assert_eq!(ReduceOp::parse("mean"), None);
    assert_eq!(ReduceOp::Avg.step(), ReduceOp::Sum);
    assert_eq!(ReduceOp::Max.step(), ReduceOp::Max);
}

#[test]
fn detected_level_is_the_best_available() {
    let best = *SimdLevel::available().last().unwrap();
    assert_eq!(SimdLevel::detected(), best);
    assert_eq!(Kernels::detected().level(), best);
    for level in SimdLevel::ALL {
        assert_eq!(Kernels::for_level(level).is_some(), level.is_available(), "{level}");
    }
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512bf16") && std::is_x86_feature_detected!("avx512bw") {
        assert_eq!(best, SimdLevel::Avx512Bf16);
    }
}

#[test]
fn min_max_propagate_the_canonical_nan() {
    let canonical = f32::from_bits(CANONICAL_NAN_F32);
    // A NaN with a payload and a sign on either side gives exactly the canonical NaN.
    let odd_nan = f32::from_bits(0xFFC0_1234);
    for op in [ReduceOp::Min, ReduceOp::Max] {
        for (a, b) in [(odd_nan, 1.0f32), (1.0, odd_nan), (f32::INFINITY, f32::NAN), (f32::NAN, f32::NAN)] {
            for k in levels() {
                let mut acc = rep(a, N);
                k.reduce_into(op, &mut acc, &rep(b, N));
                assert!(acc.iter().all(|x| x.to_bits() == CANONICAL_NAN_F32), "{op} at {}", k.level());
                let mut out = rep(0.0f32, N);
                k.reduce_many(op, &[&rep(1.0, N)[..], &rep(a, N), &rep(b, N), &rep(2.0, N)], &mut out);
                assert!(out.iter().all(|x| x.to_bits() == CANONICAL_NAN_F32), "{op} many at {}", k.level());
            }
        }
        into_all(op, &rep(f64::from_bits(0xFFF0_0000_0000_0001), N), &rep(0.0, N), &rep(f64::from_bits(CANONICAL_NAN_F64), N));
        into_all(op, &rep(f16::ONE, N), &rep(f16::from_bits(0xFE01), N), &rep(f16::from_bits(CANONICAL_NAN_F16), N));
        into_all(op, &rep(bf16::from_bits(0xFF81), N), &rep(bf16::ONE, N), &rep(bf16::from_bits(CANONICAL_NAN_BF16), N));
        for k in levels() {
            let mut acc = rep(1.0f32, N);
            k.reduce_into(op, &mut acc, &rep(canonical, N));
            assert!(acc.iter().all(|x| x.is_nan()));
        }
    }
    // Sum, Prod and Avg give some NaN.
    into_all(ReduceOp::Sum, &rep(f32::INFINITY, N), &rep(f32::NEG_INFINITY, N), &rep(f32::NAN, N));
    into_all(ReduceOp::Prod, &rep(0.0f32, N), &rep(f32::INFINITY, N), &rep(f32::NAN, N));
    many_all(ReduceOp::Avg, &[&rep(f16::NAN, N)[..], &rep(f16::ONE, N)], &rep(f16::NAN, N));
}

#[test]
fn negative_zero_is_below_positive_zero() {
    for (a, b) in [(-0.0f32, 0.0f32), (0.0, -0.0)] {
        into_all(ReduceOp::Max, &rep(a, N), &rep(b, N), &rep(0.0, N));
        into_all(ReduceOp::Min, &rep(a, N), &rep(b, N), &rep(-0.0, N));
        many_all(ReduceOp::Max, &[&rep(a, N)[..], &rep(b, N), &rep(-0.0, N)], &rep(0.0, N));
        many_all(ReduceOp::Min, &[&rep(a, N)[..], &rep(b, N), &rep(0.0, N)], &rep(-0.0, N));
        into_all(ReduceOp::Max, &rep(f64::from(a), N), &rep(f64::from(b), N), &rep(0.0, N));
        into_all(ReduceOp::Min, &rep(f64::from(a), N), &rep(f64::from(b), N), &rep(-0.0, N));
        into_all(ReduceOp::Max, &rep(f16::from_f32(a), N), &rep(f16::from_f32(b), N), &rep(f16::ZERO, N));
        into_all(ReduceOp::Min, &rep(f16::from_f32(a), N), &rep(f16::from_f32(b), N), &rep(f16::NEG_ZERO, N));
        into_all(ReduceOp::Max, &rep(bf16::from_f32(a), N), &rep(bf16::from_f32(b), N), &rep(bf16::ZERO, N));
        into_all(ReduceOp::Min, &rep(bf16::from_f32(a), N), &rep(bf16::from_f32(b), N), &rep(bf16::NEG_ZERO, N));
    }
    // -0 + -0 = -0, -0 + +0 = +0 (IEEE).
    into_all(ReduceOp::Sum, &rep(-0.0f32, N), &rep(-0.0, N), &rep(-0.0, N));
    into_all(ReduceOp::Sum, &rep(-0.0f32, N), &rep(0.0, N), &rep(0.0, N));
    // Infinities order as numbers.
    into_all(ReduceOp::Max, &rep(f32::NEG_INFINITY, N), &rep(f32::MIN, N), &rep(f32::MIN, N));
}

#[test]
fn half_types_round_ties_to_even_once() {
    // 1 + 2^-11 lies halfway between f16 1.0 and 1.0 + 2^-10: the even one is 1.0.
    let one = f16::ONE;
    let half_ulp = f16::from_f32(2f32.powi(-11));
    into_all(ReduceOp::Sum, &rep(one, N), &rep(half_ulp, N), &rep(one, N));
    // (1 + 2^-10) + 2^-11 is halfway between odd 1 + 2^-10 and even 1 + 2^-9.
    let odd = f16::from_f32(1.0 + 2f32.powi(-10));
    into_all(ReduceOp::Sum, &rep(odd, N), &rep(half_ulp, N), &rep(f16::from_f32(1.0 + 2f32.powi(-9)), N));
    // bf16: 1 + 2^-8 rounds to 1, (1 + 2^-7) + 2^-8 to 1 + 2^-6.
    let b_half_ulp = bf16::from_f32(2f32.powi(-8));
    into_all(ReduceOp::Sum, &rep(bf16::ONE, N), &rep(b_half_ulp, N), &rep(bf16::ONE, N));
    let b_odd = bf16::from_f32(1.0 + 2f32.powi(-7));
    into_all(ReduceOp::Sum, &rep(b_odd, N), &rep(b_half_ulp, N), &rep(bf16::from_f32(1.0 + 2f32.powi(-6)), N));
    // Overflow rounds to infinity.
    into_all(ReduceOp::Sum, &rep(f16::MAX, N), &rep(f16::MAX, N), &rep(f16::INFINITY, N));
    into_all(ReduceOp::Sum, &rep(bf16::MAX, N), &rep(bf16::MAX, N), &rep(bf16::INFINITY, N));

    // reduce_many rounds once: 2048 + 1 + 1 = 2050 in f32, exact in f16; stepwise f16
    // rounding gives 2048 + 1 = 2048 (tie to even), + 1 = 2048.
    let big = f16::from_f32(2048.0);
    many_all(ReduceOp::Sum, &[&rep(big, N)[..], &rep(one, N), &rep(one, N)], &rep(f16::from_f32(2050.0), N));
    let mut acc = rep(big, N);
    crate::reduce_into(ReduceOp::Sum, &mut acc, &rep(one, N));
    crate::reduce_into(ReduceOp::Sum, &mut acc, &rep(one, N));
    assert_eq!(acc[0], big);
}

#[test]
fn half_subnormals_are_kept() {
    // No flush-to-zero: the smallest subnormals add up (vcvtneps2bf16 alone would flush them).
    let b1 = bf16::from_bits(1);
    into_all(ReduceOp::Sum, &rep(b1, N), &rep(b1, N), &rep(bf16::from_bits(2), N));
    many_all(ReduceOp::Sum, &[&rep(b1, N)[..], &rep(b1, N), &rep(b1, N)], &rep(bf16::from_bits(3), N));
    let h1 = f16::from_bits(1);
    into_all(ReduceOp::Sum, &rep(h1, N), &rep(h1, N), &rep(f16::from_bits(2), N));
    let s1 = f32::from_bits(1);
    into_all(ReduceOp::Sum, &rep(s1, N), &rep(s1, N), &rep(f32::from_bits(2), N));
    // A product underflowing into the bf16 subnormal range: 2^-70 * 2^-60 = 2^-130.
    let a = bf16::from_f32(2f32.powi(-70));
    let b = bf16::from_f32(2f32.powi(-60));
    into_all(ReduceOp::Prod, &rep(a, N), &rep(b, N), &rep(bf16::from_bits(0x0008), N));
}

#[test]
fn integers_wrap() {
    into_all(ReduceOp::Sum, &rep(i8::MAX, N), &rep(1, N), &rep(i8::MIN, N));
    into_all(ReduceOp::Sum, &rep(u8::MAX, N), &rep(1, N), &rep(0, N));
    into_all(ReduceOp::Prod, &rep(i32::MAX, N), &rep(2, N), &rep(-2, N));
    into_all(ReduceOp::Prod, &rep(u64::MAX, N), &rep(u64::MAX, N), &rep(1, N));
    into_all(ReduceOp::Min, &rep(i64::MIN, N), &rep(i64::MAX, N), &rep(i64::MIN, N));
    into_all(ReduceOp::Max, &rep(u32::MAX, N), &rep(0, N), &rep(u32::MAX, N));
    many_all(ReduceOp::Sum, &[&rep(i32::MAX, N)[..], &rep(i32::MAX, N), &rep(2, N)], &rep(0, N));
}

#[test]
fn integer_avg_is_exact_and_truncates_toward_zero() {
    // -3/2 = -1.5 -> -1, 3/2 -> 1, -5 + -4 + 0 = -9, / 3 = -3, -10/4 = -2.5 -> -2.
    many_all(ReduceOp::Avg, &[&[-3i8, 3, -5, -10][..], &[0, 0, -4, 0], &[0, 0, 0, 0][..]], &[-1, 1, -3, -3]);
    many_all(ReduceOp::Avg, &[&rep(-3i32, N)[..], &rep(0, N)], &rep(-1, N));
    many_all(ReduceOp::Avg, &[&rep(-10i64, N)[..], &rep(0, N), &rep(0, N), &rep(0, N)], &rep(-2, N));
    // The sums overflow the type, the average does not.
    many_all(ReduceOp::Avg, &[&rep(i64::MAX, N)[..], &rep(i64::MAX, N)], &rep(i64::MAX, N));
    many_all(ReduceOp::Avg, &[&rep(i8::MIN, N)[..], &rep(i8::MIN, N), &rep(i8::MIN, N)], &rep(i8::MIN, N));
    many_all(ReduceOp::Avg, &[&rep(u64::MAX, N)[..], &rep(u64::MAX - 2, N)], &rep(u64::MAX - 1, N));
    // Pairwise steps + finish_avg: exact while the sum does not wrap.
    for k in levels() {
        let mut acc = rep(-7i32, N);
        k.reduce_into(ReduceOp::Avg, &mut acc, &rep(2, N));
        k.finish_avg(&mut acc, 2);
        assert_eq!(acc, rep(-2, N), "{}", k.level());
    }
}

#[test]
fn float_avg_divides_once() {
    // f16: sum in f32 (2048 + 1 + 1 + 0 = 2050), / 4 = 512.5 exactly, rounded once.
    let v = |x: f32| rep(f16::from_f32(x), N);
    many_all(ReduceOp::Avg, &[&v(2048.0)[..], &v(1.0), &v(1.0), &v(0.0)], &v(512.5));
    // Pairwise f16 steps round 2049 to 2048 first: 2048 / 4 = 512.
    for k in levels() {
        let mut acc = v(2048.0);
        for s in [v(1.0), v(1.0), v(0.0)] {
            k.reduce_into(ReduceOp::Avg, &mut acc, &s);
        }
        k.finish_avg(&mut acc, 4);
        assert_eq!(acc, v(512.0), "{}", k.level());
    }
    // f32: one division of the rank-order sum.
    many_all(ReduceOp::Avg, &[&rep(1.0f32, N)[..], &rep(2.0, N), &rep(4.0, N)], &rep(7.0f32 / 3.0, N));
    many_all(ReduceOp::Avg, &[&rep(1.0f64, N)[..], &rep(2.0, N), &rep(4.0, N)], &rep(7.0f64 / 3.0, N));
    // bf16: 1 + 1 + 2^-8 = 2.00390625 in f32, / 3, rounded once.
    let b = |x: f32| rep(bf16::from_f32(x), N);
    many_all(ReduceOp::Avg, &[&b(1.0)[..], &b(1.0), &b(2f32.powi(-8))], &b((2.0 + 2f32.powi(-8)) / 3.0));
}

#[test]
fn byte_api_reports_bad_lengths() {
    let mut acc = [0u8; 8];
    assert_eq!(
        crate::reduce_into_bytes(DType::F32, ReduceOp::Sum, &mut acc, &[0u8; 4]),
        Err(KernelError::LengthMismatch { acc: 8, src: 4 })
    );
    assert_eq!(
        crate::reduce_into_bytes(DType::F32, ReduceOp::Sum, &mut acc[..6], &[0u8; 6]),
        Err(KernelError::NotMultipleOfElement { dtype: DType::F32, len: 6 })
    );
    let e = crate::reduce_many_bytes(DType::I32, ReduceOp::Max, &[&[0u8; 8][..], &[0u8; 12]], &mut acc).unwrap_err();
    assert_eq!(e, KernelError::SourceLengthMismatch { index: 1, src: 12, out: 8 });
    assert_eq!(e.to_string(), "length mismatch: srcs[1] is 12 bytes but out is 8 bytes");
    assert_eq!(crate::reduce_many_bytes(DType::I32, ReduceOp::Max, &[], &mut acc), Err(KernelError::NoInputs));
    assert_eq!(crate::finish_avg_bytes(DType::F16, &mut acc, 0), Err(KernelError::ZeroContributions));
    assert!(KernelError::NotMultipleOfElement { dtype: DType::F64, len: 12 }.to_string().contains("12 bytes"));
    // Nothing was written.
    assert_eq!(acc, [0u8; 8]);
}

#[test]
fn byte_api_handles_misaligned_buffers_longer_than_a_chunk() {
    // 3000 f64 = 24000 bytes: several scratch chunks, at an odd offset.
    let a: Vec<f64> = (0..3000).map(f64::from).collect();
    let b: Vec<f64> = (0..3000).map(|i| f64::from(i) * 0.5).collect();
    let mut want = a.clone();
    reference::reduce_into(ReduceOp::Sum, &mut want, &b);
    let mut acc = vec![0u8; 1];
    acc.extend_from_slice(as_bytes(&a));
    let mut src = vec![0u8; 3];
    src.extend_from_slice(as_bytes(&b));
    crate::reduce_into_bytes(DType::F64, ReduceOp::Sum, &mut acc[1..], &src[3..]).unwrap();
    let mut got = vec![0f64; 3000];
    as_bytes_mut(&mut got).copy_from_slice(&acc[1..]);
    assert_eq!(got, want);
}

#[test]
#[should_panic(expected = "lengths differ")]
fn typed_api_panics_on_length_mismatch() {
    crate::reduce_into(ReduceOp::Sum, &mut [1.0f32, 2.0], &[1.0]);
}
