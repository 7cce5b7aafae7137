//! Helpers shared by the `ferroccl-demo` and `ferroccl-selftest` programs (this package's
//! binaries) and usable by any program that checks a job's mesh: a round-robin pairing
//! schedule in which every pair of ranks meets once ([`partner`], [`rounds`]), data that
//! the receiver can recompute to check a transfer byte for byte ([`fill`],
//! [`first_mismatch`]), and the small argument and size helpers the programs use
//! ([`flag`], [`parse_size`], [`human`]).
//!
//! ```
//! use ferroccl_run::testkit::{fill, first_mismatch, partner, rounds};
//!
//! // 4 ranks: 3 rounds, and in round 0 rank 0 meets the same peer that meets it.
//! assert_eq!(rounds(4), 3);
//! let p = partner(4, 0, 0).unwrap();
//! assert_eq!(partner(4, 0, p), Some(0));
//! // What rank 1 sends to rank 2, rank 2 can check.
//! let mut buf = vec![0u8; 100];
//! fill(&mut buf, 7, 1, 2);
//! assert_eq!(first_mismatch(&buf, 7, 1, 2), None);
//! ```

/// Round-robin tournament: for `round` in `0..rounds(n)`, the partner of `rank`, or `None`
/// when it sits the round out (odd `n`). Every pair meets exactly once, and within a round
/// the pairing is symmetric.
pub fn partner(n: usize, round: usize, rank: usize) -> Option<usize> {
    let m = if n.is_multiple_of(2) { n } else { n + 1 }; // with a phantom rank for odd n
    let k = m - 1; // rounds
    let p = if rank == m - 1 {
        // The fixed rank meets the one that would otherwise meet itself.
        (0..k).find(|&i| (round + k - i) % k == i)?
    } else {
        let q = (round + k - rank % k) % k;
        if q == rank {
            m - 1
        } else {
            q
        }
    };
    if p >= n || p == rank {
        None
    } else {
        Some(p)
    }
}

/// Number of rounds of [`partner`].
pub fn rounds(n: usize) -> usize {
    if n <= 1 {
        0
    } else if n.is_multiple_of(2) {
        n - 1
    } else {
        n
    }
}

/// Fills `buf` with bytes that depend on (seed, from, to, len), so the receiver can
/// recompute what it should get.
pub fn fill(buf: &mut [u8], seed: u64, from: usize, to: usize) {
    let mut x = seed ^ ((from as u64) << 40) ^ ((to as u64) << 20) ^ (buf.len() as u64) ^ 0x9e37_79b9_7f4a_7c15;
    let mut chunks = buf.chunks_exact_mut(8);
    for c in &mut chunks {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        c.copy_from_slice(&x.to_le_bytes());
    }
    for b in chunks.into_remainder() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
}

/// Index of the first byte where `got` differs from what `from` should have sent.
pub fn first_mismatch(got: &[u8], seed: u64, from: usize, to: usize) -> Option<usize> {
    let mut want = vec![0u8; got.len()];
    fill(&mut want, seed, from, to);
    got.iter().zip(&want).position(|(a, b)| a != b)
}

/// Parses `--name value` pairs after a subcommand.
pub fn flag<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).map(|s| s.as_str())
}

/// Parses a size like `4096`, `64K`, `1M`, `64MiB`.
pub fn parse_size(s: &str) -> Option<usize> {
    let s = s.trim();
    let (num, mult) = match s.trim_end_matches("iB").trim_end_matches('B') {
        t if t.ends_with(['K', 'k']) => (&t[..t.len() - 1], 1usize << 10),
        t if t.ends_with(['M', 'm']) => (&t[..t.len() - 1], 1 << 20),
        t if t.ends_with(['G', 'g']) => (&t[..t.len() - 1], 1 << 30),
        t => (t, 1),
    };
    num.parse::<usize>().ok()?.checked_mul(mult)
}

/// Formats a byte count the way people read it.
pub fn human(n: usize) -> String {
    if n >= 1 << 30 && n.is_multiple_of(1 << 30) {
        format!("{} GiB", n >> 30)
    } else if n >= 1 << 20 && n.is_multiple_of(1 << 20) {
        format!("{} MiB", n >> 20)
    } else if n >= 1 << 10 && n.is_multiple_of(1 << 10) {
        format!("{} KiB", n >> 10)
    } else {
        format!("{n} B")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[allow(clippy::needless_range_loop)]
    fn every_pair_meets_once() {
        for n in 1..=17 {
            let mut met = vec![vec![0; n]; n];
            for r in 0..rounds(n) {
                for a in 0..n {
                    if let Some(b) = partner(n, r, a) {
                        assert_eq!(partner(n, r, b), Some(a), "n {n} round {r} rank {a}");
                        met[a][b] += 1;
                    }
                }
            }
            for a in 0..n {
                for b in 0..n {
                    assert_eq!(met[a][b], usize::from(a != b), "n {n}: {a} met {b} {} times", met[a][b]);
                }
            }
        }
    }

    #[test]
    fn fill_is_reproducible_and_distinct() {
        let mut a = vec![0u8; 1001];
        let mut b = vec![0u8; 1001];
        fill(&mut a, 1, 0, 1);
        fill(&mut b, 1, 1, 0);
        assert_ne!(a, b);
        assert_eq!(first_mismatch(&a, 1, 0, 1), None);
        a[777] ^= 1;
        assert_eq!(first_mismatch(&a, 1, 0, 1), Some(777));
    }

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("64MiB"), Some(64 << 20));
        assert_eq!(parse_size("4K"), Some(4096));
        assert_eq!(parse_size("17"), Some(17));
        assert_eq!(parse_size("x"), None);
    }
}
