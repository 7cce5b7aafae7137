//! Binomial trees: in a tree of `n` ranks numbered from the root (`v = r - root`, mod n),
//! rank `v`'s parent is `v` with its lowest set bit cleared and its children are `v + 2^k`
//! for every `2^k` below that bit (the root: below `n`). Every rank is `ceil(log2 n)` hops
//! or fewer from the root, and the root sends `ceil(log2 n)` messages where a mesh's sends
//! `n - 1`.

pub(super) mod broadcast;

/// The position of rank `r` in the tree rooted at `root` (0 for the root).
pub(super) fn position(n: usize, r: usize, root: usize) -> usize {
    (r + n - root) % n
}

/// The parent's position of position `v` (> 0).
pub(super) fn parent(v: usize) -> usize {
    v & (v - 1)
}

/// The children's positions of position `v`, farthest (largest subtree) first.
pub(super) fn children(n: usize, v: usize) -> impl Iterator<Item = usize> {
    let limit = if v == 0 { n.next_power_of_two() } else { v & v.wrapping_neg() };
    (0..limit.trailing_zeros()).rev().map(move |k| v + (1 << k)).filter(move |&c| c < n)
}
