//! Sum via `reduce_into` against a memcpy baseline, per input-buffer size.
//!
//! Throughput is **memory traffic**: the bytes read plus the bytes written by one call. For a
//! buffer of `S` bytes, memcpy (`copy_from_slice`) reads `S` and writes `S` (2·S);
//! `reduce_into` reads `acc` and `src` and writes `acc` (3·S). Both are memory-bound at the
//! large sizes, so their GB/s are directly comparable: equal GB/s means the reduction moves
//! data as fast as a copy does.
//!
//! Run with `cargo bench -p ferroccl-kernels --bench reduce`. The kernels are the detected
//! level's; at 1 MiB, `LEVEL/TYPE` entries show the other available levels for comparison.

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use ferroccl_kernels::{bf16, f16, Element, Kernels, ReduceOp, SimdLevel};

const SIZES: [(usize, &str); 3] = [(64 << 10, "64KiB"), (1 << 20, "1MiB"), (64 << 20, "64MiB")];

fn bench_sum<T: Element>(
    c: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    k: Kernels,
    name: &str,
    bytes: usize,
    label: &str,
    one: T,
) {
    let n = bytes / std::mem::size_of::<T>();
    let mut acc = vec![one; n];
    let src = vec![one; n];
    c.throughput(Throughput::Bytes(3 * bytes as u64));
    c.bench_function(BenchmarkId::new(name, label), |b| {
        b.iter(|| {
            k.reduce_into(ReduceOp::Sum, black_box(&mut acc[..]), black_box(&src[..]));
        })
    });
}

fn reduce_into_sum(c: &mut Criterion) {
    let k = Kernels::detected();
    eprintln!("kernels: {}", k.level());
    for (bytes, label) in SIZES {
        let mut g = c.benchmark_group(format!("sum/{label}"));
        g.sample_size(10).warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(1));
        let mut dst = vec![1u8; bytes];
        let src = vec![2u8; bytes];
        g.throughput(Throughput::Bytes(2 * bytes as u64));
        g.bench_function(BenchmarkId::new("memcpy", label), |b| b.iter(|| black_box(&mut dst[..]).copy_from_slice(black_box(&src[..]))));
        bench_sum(&mut g, k, "f32", bytes, label, 1.0f32);
        bench_sum(&mut g, k, "f16", bytes, label, f16::ONE);
        bench_sum(&mut g, k, "bf16", bytes, label, bf16::ONE);
        bench_sum(&mut g, k, "f64", bytes, label, 1.0f64);
        bench_sum(&mut g, k, "i32", bytes, label, 1i32);
        if bytes == 1 << 20 {
            for level in SimdLevel::available().into_iter().filter(|&l| l != k.level()) {
                let other = Kernels::for_level(level).expect("available");
                bench_sum(&mut g, other, &format!("{level}/f32"), bytes, label, 1.0f32);
                bench_sum(&mut g, other, &format!("{level}/f16"), bytes, label, f16::ONE);
                bench_sum(&mut g, other, &format!("{level}/bf16"), bytes, label, bf16::ONE);
            }
        }
        g.finish();
    }
}

criterion_group!(benches, reduce_into_sum);
criterion_main!(benches);
