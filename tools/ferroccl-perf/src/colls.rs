//! The benchmarked collectives: names, buffer layouts and nccl-tests' bandwidth formulas.
//!
//! # What `size` means (as in nccl-tests)
//!
//! The `size` column (and `-b` / `-e`) is the size in bytes of the *larger* per-rank buffer
//! of the call, and `algbw = size / time`:
//!
//! | collective | size | per-rank buffers | busbw / algbw |
//! | --- | --- | --- | --- |
//! | allreduce | `count * t` | send and recv: `count` | `2 (n - 1) / n` |
//! | allgather | `n * block * t` (the gathered output) | send: `block`, recv: `n * block` | `(n - 1) / n` |
//! | reduce_scatter | `n * block * t` (the input) | send: `n * block`, recv: `block` | `(n - 1) / n` |
//! | broadcast | `count * t` | one buffer: `count` | `1` |
//! | reduce | `count * t` | send and recv (root): `count` | `1` |
//! | alltoall | `n * block * t` (send buffer) | send and recv: `n * block` | `(n - 1) / n` |
//! | alltoallv | as alltoall (uniform counts: `block` to and from every rank) | as alltoall | `(n - 1) / n` |
//! | allgatherv | as allgather (uniform counts: `block` from every rank) | as allgather | `(n - 1) / n` |
//! | reduce_scatterv | as reduce_scatter (uniform counts: `block` to every rank) | as reduce_scatter | `(n - 1) / n` |
//! | sendrecv | `count * t` | send and recv: `count` | `1` |
//!
//! `t` is the element size. A requested size is rounded down to whole elements (and, for the
//! block collectives, to whole blocks of `n` equal parts), but never below one element (one
//! block): the `size` column shows the size actually moved. busbw is the bandwidth a link
//! would need for the call to take `time` with the best algorithm, so that numbers of
//! different collectives and rank counts can be compared with each other and with the
//! hardware's peak.

use ferroccl::DType;

/// One benchmarked collective.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Coll {
    /// `allreduce_into` / `allreduce`.
    AllReduce,
    /// `allgather_into` / `allgather`.
    AllGather,
    /// `reduce_scatter_into` / `reduce_scatter`.
    ReduceScatter,
    /// `broadcast` (in place only).
    Broadcast,
    /// `reduce_into` / `reduce`.
    Reduce,
    /// `alltoall` (out of place only).
    AllToAll,
    /// `alltoallv` with uniform counts (`block` elements to and from every rank, blocks in
    /// rank order; out of place only).
    AllToAllV,
    /// `sendrecv` in a ring: send to rank + 1, receive from rank - 1 (out of place only).
    SendRecv,
    /// `allgatherv` with uniform counts (`block` elements from every rank, in rank order;
    /// out of place only).
    AllGatherV,
    /// `reduce_scatterv` with uniform counts (`block` elements to every rank; out of place
    /// only).
    ReduceScatterV,
}

impl Coll {
    /// Every collective, in the order `all` runs them.
    pub const ALL: [Coll; 10] = [
        Coll::AllReduce,
        Coll::AllGather,
        Coll::ReduceScatter,
        Coll::Broadcast,
        Coll::Reduce,
        Coll::AllToAll,
        Coll::AllToAllV,
        Coll::SendRecv,
        Coll::AllGatherV,
        Coll::ReduceScatterV,
    ];

    /// The name on the command line and in the output.
    pub const fn name(self) -> &'static str {
        match self {
            Coll::AllReduce => "allreduce",
            Coll::AllGather => "allgather",
            Coll::ReduceScatter => "reduce_scatter",
            Coll::Broadcast => "broadcast",
            Coll::Reduce => "reduce",
            Coll::AllToAll => "alltoall",
            Coll::AllToAllV => "alltoallv",
            Coll::SendRecv => "sendrecv",
            Coll::AllGatherV => "allgatherv",
            Coll::ReduceScatterV => "reduce_scatterv",
        }
    }

    /// Parses a name (`reducescatter` and `reduce-scatter` are accepted too).
    pub fn parse(s: &str) -> Option<Coll> {
        let norm = s.trim().to_ascii_lowercase().replace('-', "_");
        let norm = if norm == "reducescatter" { "reduce_scatter".to_string() } else { norm };
        Coll::ALL.into_iter().find(|c| c.name() == norm)
    }

    /// The library's collective (with `root` for the rooted ones); `None` for sendrecv,
    /// which is point-to-point.
    pub const fn collective(self, root: usize) -> Option<ferroccl::Collective> {
        use ferroccl::Collective as C;
        Some(match self {
            Coll::AllReduce => C::AllReduce,
            Coll::AllGather => C::AllGather,
            Coll::ReduceScatter => C::ReduceScatter,
            Coll::Broadcast => C::Broadcast { root },
            Coll::Reduce => C::Reduce { root },
            Coll::AllToAll => C::AllToAll,
            Coll::AllToAllV => C::AllToAllV,
            Coll::AllGatherV => C::AllGatherV,
            Coll::ReduceScatterV => C::ReduceScatterV,
            Coll::SendRecv => return None,
        })
    }

    /// Whether the collective reduces (uses `-o`).
    pub const fn reduces(self) -> bool {
        matches!(self, Coll::AllReduce | Coll::ReduceScatter | Coll::Reduce | Coll::ReduceScatterV)
    }

    /// Whether the collective has a root (uses `--root`).
    pub const fn rooted(self) -> bool {
        matches!(self, Coll::Broadcast | Coll::Reduce)
    }

    /// Whether FerroCCL has an out-of-place form (broadcast is in place only).
    pub const fn has_out_of_place(self) -> bool {
        !matches!(self, Coll::Broadcast)
    }

    /// Whether FerroCCL has an in-place form (alltoall and sendrecv are out of place only).
    pub const fn has_in_place(self) -> bool {
        !matches!(self, Coll::AllToAll | Coll::AllToAllV | Coll::SendRecv | Coll::AllGatherV | Coll::ReduceScatterV)
    }

    /// Whether the `plan` column runs an in-place persistent plan
    /// (`comm.plan(op::allreduce(..))`, `op::broadcast`).
    pub const fn plan_in_place(self) -> bool {
        matches!(self, Coll::AllReduce | Coll::Broadcast)
    }

    /// Whether the `plan` column runs an out-of-place persistent plan
    /// (`comm.plan(op::allgather_into(..))`, `op::reduce_scatter_into`).
    pub const fn plan_out_of_place(self) -> bool {
        matches!(self, Coll::AllGather | Coll::ReduceScatter)
    }

    /// Whether the buffers are `n` equal blocks (the per-rank count is `size / n`).
    pub const fn blocked(self) -> bool {
        matches!(self, Coll::AllGather | Coll::ReduceScatter | Coll::AllToAll | Coll::AllToAllV | Coll::AllGatherV | Coll::ReduceScatterV)
    }

    /// nccl-tests' bus-bandwidth factor for `n` ranks: `busbw = algbw * factor`.
    pub fn bus_factor(self, n: usize) -> f64 {
        let n = n.max(1) as f64;
        match self {
            Coll::AllReduce => 2.0 * (n - 1.0) / n,
            Coll::AllGather | Coll::ReduceScatter | Coll::AllToAll | Coll::AllToAllV | Coll::AllGatherV | Coll::ReduceScatterV => {
                (n - 1.0) / n
            }
            Coll::Broadcast | Coll::Reduce | Coll::SendRecv => 1.0,
        }
    }

    /// The buffers of one row: `requested` bytes on `n` ranks of `dtype`.
    pub fn layout(self, requested: usize, n: usize, dtype: DType) -> Layout {
        let t = dtype.size();
        let n = n.max(1);
        if self.blocked() {
            let block = (requested / (t * n)).max(1);
            let total = block * n;
            let (send, recv) = match self {
                Coll::AllGather | Coll::AllGatherV => (block, total),
                Coll::ReduceScatter | Coll::ReduceScatterV => (total, block),
                _ => (total, total),
            };
            Layout { count: total, bytes: total * t, block, send, recv }
        } else {
            let count = (requested / t).max(1);
            Layout { count, bytes: count * t, block: count, send: count, recv: count }
        }
    }
}

impl std::fmt::Display for Coll {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The buffers of one row of the table, in elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// The `count` column: elements of the larger per-rank buffer (`bytes / t`).
    pub count: usize,
    /// The `size` column: bytes of the larger per-rank buffer; `algbw = bytes / time`.
    pub bytes: usize,
    /// Elements of one rank's block (allgather, reduce_scatter, alltoall), else `count`.
    pub block: usize,
    /// Elements of the out-of-place send buffer.
    pub send: usize,
    /// Elements of the out-of-place receive buffer (and of the in-place buffer).
    pub recv: usize,
}

/// Algorithm bandwidth in GB/s (1e9 bytes per second): `bytes / time`.
pub fn algbw(bytes: usize, time_us: f64) -> f64 {
    if time_us > 0.0 {
        bytes as f64 / (time_us * 1e-6) / 1e9
    } else {
        0.0
    }
}

/// Bus bandwidth in GB/s: `algbw * bus_factor(n)`.
pub fn busbw(coll: Coll, n: usize, bytes: usize, time_us: f64) -> f64 {
    algbw(bytes, time_us) * coll.bus_factor(n)
}

/// The sizes of a sweep: `min`, `min * factor`, ... up to `max`; `max` itself is added
/// when the progression steps over it (so `-b 8 -e 256M -f 4` ends with 256 MiB).
pub fn sweep(min: usize, max: usize, factor: usize) -> Vec<usize> {
    let mut v = Vec::new();
    let mut s = min;
    while s <= max {
        v.push(s);
        match s.checked_mul(factor) {
            Some(next) if next > s => s = next,
            _ => break,
        }
    }
    if v.last() != Some(&max) && min <= max {
        v.push(max);
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    /// nccl-tests' definitions, written out independently of `bus_factor`: for each
    /// collective, the bytes a rank must move over its link per byte of `size` with the best
    /// algorithm (ring allreduce: reduce-scatter + allgather, each (n-1)/n of the data).
    fn nccl_tests_factor(name: &str, n: usize) -> f64 {
        let n = n as f64;
        match name {
            "allreduce" => 2.0 * (n - 1.0) / n,
            "allgather" | "reduce_scatter" | "alltoall" | "alltoallv" | "allgatherv" | "reduce_scatterv" => (n - 1.0) / n,
            "broadcast" | "reduce" | "sendrecv" => 1.0,
            _ => panic!("unknown {name}"),
        }
    }

    #[test]
    fn bus_factors_match_nccl_tests() {
        for c in Coll::ALL {
            for n in 1..=16 {
                assert_eq!(c.bus_factor(n), nccl_tests_factor(c.name(), n), "{c} n={n}");
            }
        }
        // A few by hand.
        assert_eq!(Coll::AllReduce.bus_factor(2), 1.0);
        assert_eq!(Coll::AllReduce.bus_factor(4), 1.5);
        assert_eq!(Coll::AllReduce.bus_factor(8), 1.75);
        assert_eq!(Coll::AllGather.bus_factor(4), 0.75);
        assert_eq!(Coll::ReduceScatter.bus_factor(2), 0.5);
        assert_eq!(Coll::AllToAll.bus_factor(8), 0.875);
        assert_eq!(Coll::Broadcast.bus_factor(8), 1.0);
        assert_eq!(Coll::AllReduce.bus_factor(1), 0.0);
    }

    #[test]
    fn bandwidths_use_gb_per_second() {
        // 1 GB in 1 s.
        assert!((algbw(1_000_000_000, 1e6) - 1.0).abs() < 1e-12);
        // 256 MiB allreduce on 4 ranks in 100 ms: algbw 2.684 GB/s, busbw 1.5 times that.
        let bytes = 256 << 20;
        let a = algbw(bytes, 100_000.0);
        assert!((a - 2.68435456).abs() < 1e-9, "{a}");
        assert!((busbw(Coll::AllReduce, 4, bytes, 100_000.0) - 1.5 * a).abs() < 1e-9);
        assert!((busbw(Coll::AllGather, 4, bytes, 100_000.0) - 0.75 * a).abs() < 1e-9);
        assert!((busbw(Coll::Broadcast, 4, bytes, 100_000.0) - a).abs() < 1e-9);
        assert_eq!(algbw(100, 0.0), 0.0);
    }

    #[test]
    fn layouts_follow_nccl_tests_sizes() {
        // allreduce: 1 MiB of f32 = 262144 elements in and out.
        let l = Coll::AllReduce.layout(1 << 20, 4, DType::F32);
        assert_eq!((l.count, l.bytes, l.send, l.recv), (262144, 1 << 20, 262144, 262144));
        // allgather: size is the gathered output; each rank sends a quarter.
        let l = Coll::AllGather.layout(1 << 20, 4, DType::F32);
        assert_eq!((l.count, l.bytes, l.block, l.send, l.recv), (262144, 1 << 20, 65536, 65536, 262144));
        // reduce_scatter: size is the input.
        let l = Coll::ReduceScatter.layout(1 << 20, 4, DType::Bf16);
        assert_eq!((l.count, l.bytes, l.block, l.send, l.recv), (524288, 1 << 20, 131072, 524288, 131072));
        // alltoall: send and receive n blocks.
        let l = Coll::AllToAll.layout(1 << 20, 2, DType::F64);
        assert_eq!((l.count, l.block, l.send, l.recv), (131072, 65536, 131072, 131072));
        // Too small to split: one element per block, and the size column says so.
        let l = Coll::AllGather.layout(8, 4, DType::F32);
        assert_eq!((l.count, l.bytes, l.block), (4, 16, 1));
        let l = Coll::AllReduce.layout(1, 2, DType::F64);
        assert_eq!((l.count, l.bytes), (1, 8));
        // Rounded down to whole blocks.
        let l = Coll::ReduceScatter.layout(100, 3, DType::U8);
        assert_eq!((l.count, l.bytes, l.block), (99, 99, 33));
    }

    #[test]
    fn sweeps_end_at_max() {
        assert_eq!(sweep(8, 128, 4), vec![8, 32, 128]);
        assert_eq!(sweep(8, 256, 4), vec![8, 32, 128, 256]);
        assert_eq!(sweep(1024, 1024, 2), vec![1024]);
        assert_eq!(sweep(1 << 20, 256 << 20, 8), vec![1 << 20, 8 << 20, 64 << 20, 256 << 20]);
        assert_eq!(sweep(usize::MAX / 2, usize::MAX, 4), vec![usize::MAX / 2, usize::MAX]);
    }

    #[test]
    fn names_round_trip() {
        for c in Coll::ALL {
            assert_eq!(Coll::parse(c.name()), Some(c));
        }
        assert_eq!(Coll::parse("reduce-scatter"), Some(Coll::ReduceScatter));
        assert_eq!(Coll::parse("bcast"), None);
    }
}
