//! One thread against a `ParPool` of N threads, alternated (A B A B ...), for an f32 max
//! of two buffers (`reduce_into`) at several sizes: the data behind the default of
//! `FERROCCL_REDUCE_PAR_MIN`. Prints per size the median time of each side over the
//! rounds, and the median of the per-round ratios.
//!
//!   cargo run --release -p ferroccl-kernels --example par_ab -- [THREADS] [ROUNDS]

use std::hint::black_box;
use std::time::Instant;

use ferroccl_kernels::{DType, Kernels, ParPool, ReduceOp};

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let threads: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(2);
    let rounds: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(9);
    let k = Kernels::detected();
    let pool = ParPool::new(threads).expect("pool");
    println!("# f32 max (reduce_into; memory-bound as a sum is, without denormals), 1 thread vs {threads}, {rounds} rounds alternated, kernels {}", k.level());
    println!("{:>10} {:>12} {:>12} {:>8}", "size", "1 thread us", "pool us", "ratio");
    for size in [64usize << 10, 256 << 10, 512 << 10, 1 << 20, 4 << 20, 64 << 20, 256 << 20] {
        let mut acc = vec![1u8; size];
        let src = vec![2u8; size];
        // Calls per timing: at least ~50 ms of work.
        let calls = ((64usize << 20) / size).clamp(1, 2000);
        let (mut one, mut par, mut ratio) = (Vec::new(), Vec::new(), Vec::new());
        for r in 0..rounds {
            let mut time = |use_pool: bool| {
                let t = Instant::now();
                for _ in 0..calls {
                    if use_pool {
                        pool.reduce_into_bytes(k, DType::F32, ReduceOp::Max, black_box(&mut acc), black_box(&src)).unwrap();
                    } else {
                        k.reduce_into_bytes(DType::F32, ReduceOp::Max, black_box(&mut acc), black_box(&src)).unwrap();
                    }
                }
                t.elapsed().as_secs_f64() * 1e6 / calls as f64
            };
            let (a, b) = if r % 2 == 0 {
                let a = time(false);
                (a, time(true))
            } else {
                let b = time(true);
                (time(false), b)
            };
            one.push(a);
            par.push(b);
            ratio.push(b / a);
        }
        println!("{:>10} {:>12.1} {:>12.1} {:>8.2}", size, median(&mut one), median(&mut par), median(&mut ratio));
    }
}
