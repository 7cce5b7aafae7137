//! Property tests: every kernel level equals the reference, bit for bit (NaN-ness for NaNs).

use proptest::collection::vec;
use proptest::prelude::*;

use super::{first_difference, levels, SameAs};
use crate::{as_bytes, bf16, f16, reference, DType, Element, ReduceOp};

/// Values of a type that exercise its corners: special values, random bit patterns and small
/// integers (so that sums and products stay finite and rounding ties show up).
trait Interesting: SameAs {
    fn strategy() -> BoxedStrategy<Self>;
}

macro_rules! float_values {
    ($t:ty, $bits:ty, $from_bits:expr, $from_f64:expr, [$($special:expr),* $(,)?]) => {
        impl Interesting for $t {
            fn strategy() -> BoxedStrategy<$t> {
                let specials: Vec<$t> = vec![$($special),*];
                prop_oneof![
                    2 => proptest::sample::select(specials),
                    3 => any::<$bits>().prop_map($from_bits),
                    3 => (-64i32..64).prop_map(|i| ($from_f64)(f64::from(i))),
                    2 => (-1.0e4f64..1.0e4).prop_map($from_f64),
                ]
                .boxed()
            }
        }
    };
}

float_values!(
    f32,
    u32,
    f32::from_bits,
    |x: f64| x as f32,
    [
        f32::NAN,
        -f32::NAN,
        f32::from_bits(0x7F80_0001),
        f32::INFINITY,
        f32::NEG_INFINITY,
        0.0,
        -0.0,
        f32::MIN_POSITIVE,
        -f32::MIN_POSITIVE,
        f32::from_bits(1),
        f32::from_bits(0x8000_0001),
        f32::from_bits(0x007F_FFFF),
        f32::MAX,
        f32::MIN,
        f32::EPSILON,
        1.0,
        -1.0,
        0.5,
        // Just below the bf16 and f16 rounding midpoints and on them.
        f32::from_bits(0x3F80_8000),
        f32::from_bits(0x3F81_8000),
        f32::from_bits(0x3F80_7FFF),
    ]
);
float_values!(
    f64,
    u64,
    f64::from_bits,
    |x: f64| x,
    [
        f64::NAN,
        -f64::NAN,
        f64::from_bits(0x7FF0_0000_0000_0001),
        f64::INFINITY,
        f64::NEG_INFINITY,
        0.0,
        -0.0,
        f64::MIN_POSITIVE,
        f64::from_bits(1),
        f64::from_bits(0x8000_0000_0000_0001),
        f64::MAX,
        f64::MIN,
        f64::EPSILON,
        1.0,
        -1.0,
        0.5,
    ]
);
float_values!(
    f16,
    u16,
    f16::from_bits,
    f16::from_f64,
    [
        f16::NAN,
        -f16::NAN,
        f16::from_bits(0x7C01),
        f16::INFINITY,
        f16::NEG_INFINITY,
        f16::ZERO,
        f16::NEG_ZERO,
        f16::MIN_POSITIVE,
        f16::from_bits(1),
        f16::from_bits(0x8001),
        f16::from_bits(0x03FF),
        f16::MAX,
        f16::MIN,
        f16::EPSILON,
        f16::ONE,
        f16::NEG_ONE,
        f16::from_f32(2048.0),
        f16::from_f32(0.000_488_281_25),
    ]
);
float_values!(
    bf16,
    u16,
    bf16::from_bits,
    bf16::from_f64,
    [
        bf16::NAN,
        -bf16::NAN,
        bf16::from_bits(0x7F81),
        bf16::INFINITY,
        bf16::NEG_INFINITY,
        bf16::ZERO,
        bf16::NEG_ZERO,
        bf16::MIN_POSITIVE,
        bf16::from_bits(1),
        bf16::from_bits(0x8001),
        bf16::from_bits(0x007F),
        bf16::MAX,
        bf16::MIN,
        bf16::EPSILON,
        bf16::ONE,
        bf16::NEG_ONE,
        bf16::from_f32(256.0),
        bf16::from_f32(0.003_906_25),
    ]
);

macro_rules! int_values {
    ($($t:ty),*) => { $(
        impl Interesting for $t {
            fn strategy() -> BoxedStrategy<$t> {
                prop_oneof![
                    2 => proptest::sample::select(vec![<$t>::MIN, <$t>::MAX, 0, 1, <$t>::MAX - 1, <$t>::MIN.wrapping_add(1), <$t>::MAX / 2 + 1]),
                    3 => any::<$t>(),
                    3 => (0i8..16).prop_map(|x| x as $t),
                ]
                .boxed()
            }
        }
    )* };
}
int_values!(i8, u8, i32, u32, i64, u64);

fn op() -> impl Strategy<Value = ReduceOp> {
    proptest::sample::select(ReduceOp::ALL.to_vec())
}

/// Lengths up to ~5000, biased toward short ones so that every tail length shows up.
fn len() -> impl Strategy<Value = usize> {
    prop_oneof![0usize..80, 0usize..5000]
}

/// `n` equal-length buffers.
fn buffers<T: Interesting>(n: impl Strategy<Value = usize>) -> impl Strategy<Value = Vec<Vec<T>>> {
    (len(), n).prop_flat_map(|(len, n)| vec(vec(T::strategy(), len), n))
}

/// `data`'s bytes at byte offset `offset` of a fresh buffer (so that they may be misaligned).
fn at_offset<T: Element>(data: &[T], offset: usize) -> Vec<u8> {
    let mut v = vec![0u8; offset];
    v.extend_from_slice(as_bytes(data));
    v
}

fn check_into<T: Interesting>(op: ReduceOp, bufs: &[Vec<T>], offsets: (usize, usize)) -> Result<(), TestCaseError> {
    let (acc, src) = (&bufs[0], &bufs[1]);
    let mut want = acc.clone();
    reference::reduce_into(op, &mut want, src);
    for k in levels() {
        let mut got = acc.clone();
        k.reduce_into(op, &mut got, src);
        if let Some(d) = first_difference(&got, &want) {
            return Err(TestCaseError::fail(format!("{} {op} reduce_into at level {}: {d}", T::DTYPE, k.level())));
        }
        let mut acc_b = at_offset(acc, offsets.0);
        let src_b = at_offset(src, offsets.1);
        k.reduce_into_bytes(T::DTYPE, op, &mut acc_b[offsets.0..], &src_b[offsets.1..]).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let got: Vec<T> = acc_b[offsets.0..].chunks(T::DTYPE.size()).map(bytemuck::pod_read_unaligned).collect();
        if let Some(d) = first_difference(&got, &want) {
            return Err(TestCaseError::fail(format!(
                "{} {op} reduce_into_bytes at level {} offsets {offsets:?}: {d}",
                T::DTYPE,
                k.level()
            )));
        }
    }
    if op == ReduceOp::Avg {
        let n = bufs.len();
        let mut want_avg = want.clone();
        reference::finish_avg(&mut want_avg, n);
        for k in levels() {
            let mut got = want.clone();
            k.finish_avg(&mut got, n);
            if let Some(d) = first_difference(&got, &want_avg) {
                return Err(TestCaseError::fail(format!("{} finish_avg at level {}: {d}", T::DTYPE, k.level())));
            }
            let mut b = at_offset(&want, offsets.0);
            k.finish_avg_bytes(T::DTYPE, &mut b[offsets.0..], n).map_err(|e| TestCaseError::fail(e.to_string()))?;
            let got: Vec<T> = b[offsets.0..].chunks(T::DTYPE.size()).map(bytemuck::pod_read_unaligned).collect();
            if let Some(d) = first_difference(&got, &want_avg) {
                return Err(TestCaseError::fail(format!("{} finish_avg_bytes at level {}: {d}", T::DTYPE, k.level())));
            }
        }
    }
    Ok(())
}

fn check_many<T: Interesting>(op: ReduceOp, bufs: &[Vec<T>], offset: usize) -> Result<(), TestCaseError> {
    let srcs: Vec<&[T]> = bufs.iter().map(|b| b.as_slice()).collect();
    let len = bufs[0].len();
    let mut want = vec![T::zeroed(); len];
    reference::reduce_many(op, &srcs, &mut want);
    // The bytes of source i start at byte offset (offset + i) % 8 of their own buffer.
    let shifted: Vec<(usize, Vec<u8>)> = bufs.iter().enumerate().map(|(i, b)| ((offset + i) % 8, at_offset(b, (offset + i) % 8))).collect();
    let src_bytes: Vec<&[u8]> = shifted.iter().map(|(o, v)| &v[*o..]).collect();
    for k in levels() {
        let mut got = vec![T::zeroed(); len];
        k.reduce_many(op, &srcs, &mut got);
        if let Some(d) = first_difference(&got, &want) {
            return Err(TestCaseError::fail(format!("{} {op} reduce_many of {} at level {}: {d}", T::DTYPE, srcs.len(), k.level())));
        }
        let mut out = vec![0u8; offset + len * T::DTYPE.size()];
        k.reduce_many_bytes(T::DTYPE, op, &src_bytes, &mut out[offset..]).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let got: Vec<T> = out[offset..].chunks(T::DTYPE.size()).map(bytemuck::pod_read_unaligned).collect();
        if let Some(d) = first_difference(&got, &want) {
            return Err(TestCaseError::fail(format!(
                "{} {op} reduce_many_bytes of {} at level {} offset {offset}: {d}",
                T::DTYPE,
                srcs.len(),
                k.level()
            )));
        }
    }
    Ok(())
}

macro_rules! props {
    ($($t:ty => $into:ident, $many:ident;)*) => { $(
        proptest! {
            #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

            #[test]
            fn $into(op in op(), bufs in buffers::<$t>(Just(2)), a in 0usize..8, s in 0usize..8) {
                check_into(op, &bufs, (a, s))?;
            }

            #[test]
            fn $many(op in op(), bufs in buffers::<$t>(1usize..=8), offset in 0usize..8) {
                check_many(op, &bufs, offset)?;
            }
        }
    )* };
}

props! {
    f32 => f32_reduce_into_matches_reference, f32_reduce_many_matches_reference;
    f64 => f64_reduce_into_matches_reference, f64_reduce_many_matches_reference;
    f16 => f16_reduce_into_matches_reference, f16_reduce_many_matches_reference;
    bf16 => bf16_reduce_into_matches_reference, bf16_reduce_many_matches_reference;
    i8 => i8_reduce_into_matches_reference, i8_reduce_many_matches_reference;
    u8 => u8_reduce_into_matches_reference, u8_reduce_many_matches_reference;
    i32 => i32_reduce_into_matches_reference, i32_reduce_many_matches_reference;
    u32 => u32_reduce_into_matches_reference, u32_reduce_many_matches_reference;
    i64 => i64_reduce_into_matches_reference, i64_reduce_many_matches_reference;
    u64 => u64_reduce_into_matches_reference, u64_reduce_many_matches_reference;
}

/// Every dtype goes through the byte API (the typed tests above already cover each type; this
/// one checks that the dtype tag selects the matching type).
#[test]
fn byte_api_dispatches_on_the_dtype_tag() {
    for dtype in DType::ALL {
        let size = dtype.size();
        let mut acc = vec![0u8; 4 * size];
        let mut src = vec![0u8; 4 * size];
        acc[0] = 1;
        src[0] = 1;
        // Integer 1 + 1 = 2 in the first element's low byte; floats add tiny subnormals/ints.
        crate::reduce_into_bytes(dtype, ReduceOp::Sum, &mut acc, &src).unwrap();
        assert_eq!(acc[0], 2, "{dtype}");
    }
}
