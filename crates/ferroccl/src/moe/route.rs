//! The sans-IO half of MoE dispatch / combine: input checks, routing (which token goes to
//! which rank, with which local experts and weights), the packed bytes one rank sends
//! another (a header, routing metadata, rows), grouping received rows by local expert, and
//! both sums of the combine. No communicator, no clock: every function is a function of
//! its arguments, unit-tested below.
//!
//! # The packed bytes (one source rank to one destination rank, one step)
//!
//! A header of [`HEADER_BYTES`] (seven little-endian `u64`: magic and kind, sequence,
//! row count, status code and three details of the status), then, for a dispatch, the
//! metadata of each row ([`meta_words`] `u32` each: the token's index at its origin, then
//! per top-k slot the destination's local expert or [`NO_EXPERT`] and the weight's bits),
//! then the rows themselves (`hidden` elements each). A combine carries the header and rows
//! only: its rows come in the order of the dispatch's rows, which both sides know.

use std::fmt;

use ferroccl_kernels::{as_bytes, bf16, f16, Element};

/// The element types MoE dispatch / combine moves: `f32`, [`bf16`], [`f16`](struct@f16). Sums are
/// accumulated in `f32` whatever the type.
pub trait MoeFloat: Element + Copy + sealed::Sealed {
    /// The value as an `f32` (exact for all three types).
    fn to_f32(self) -> f32;
    /// The `f32` rounded to this type (round to nearest, ties to even).
    fn from_f32(x: f32) -> Self;
    /// `dst[i] = src[i].to_f32()` for a whole slice (as the library converts rows: with
    /// SIMD where the type and machine allow). The slices have the same length.
    fn widen_row(src: &[Self], dst: &mut [f32]) {
        dst.iter_mut().zip(src).for_each(|(d, &s)| *d = s.to_f32());
    }
    /// `dst[i] = Self::from_f32(src[i])` for a whole slice (same rounding as `from_f32`).
    fn narrow_row(src: &[f32], dst: &mut [Self]) {
        dst.iter_mut().zip(src).for_each(|(d, &s)| *d = Self::from_f32(s));
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for super::bf16 {}
    impl Sealed for super::f16 {}
}

impl MoeFloat for f32 {
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(x: f32) -> Self {
        x
    }
}

impl MoeFloat for bf16 {
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
    // The kernels crate's conversions, compiled for the CPU's SIMD level (branch-free on
    // the bits, exactly the values of `to_f32` / `from_f32`: round to nearest even, a NaN
    // stays a quiet NaN). The same loops as baseline x86-64 code made the narrowing a
    // sixth of a low-latency step's time at 8 tokens.
    fn widen_row(src: &[Self], dst: &mut [f32]) {
        ferroccl_kernels::widen_bf16(src, dst);
    }
    fn narrow_row(src: &[f32], dst: &mut [Self]) {
        ferroccl_kernels::narrow_bf16(src, dst);
    }
}

impl MoeFloat for f16 {
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
    // `half`'s slice conversions use F16C when the machine has it.
    fn widen_row(src: &[Self], dst: &mut [f32]) {
        use ferroccl_kernels::half::slice::HalfFloatSliceExt;
        src.convert_to_f32_slice(dst);
    }
    fn narrow_row(src: &[f32], dst: &mut [Self]) {
        use ferroccl_kernels::half::slice::HalfFloatSliceExt;
        dst.convert_from_f32_slice(src);
    }
}

/// Bytes of a packed header.
pub(crate) const HEADER_BYTES: usize = 7 * 8;
/// The first four bytes of a header's first word.
const MAGIC: u64 = 0x454f_4d46; // "FMOE" little endian
/// The local-expert slot of a top-k entry whose expert lives on another rank.
pub(crate) const NO_EXPERT: u32 = u32::MAX;

/// What a packed message carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Token rows and their metadata, origin to expert rank.
    Dispatch = 1,
    /// Weighted partial sums, expert rank to origin.
    Combine = 2,
}

/// `u32` words of one dispatched row's metadata: the token index, then (local expert,
/// weight bits) per top-k slot.
pub(crate) fn meta_words(top_k: usize) -> usize {
    1 + 2 * top_k
}

/// A layer's shape as every rank holds it (checked equal at construction).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Shape {
    pub num_experts: usize,
    pub hidden: usize,
    pub top_k: usize,
    pub max_tokens: usize,
    /// Ranks of the communicator.
    pub ranks: usize,
}

impl Shape {
    /// Experts per rank (`num_experts / ranks`).
    pub(crate) fn per_rank(&self) -> usize {
        self.num_experts / self.ranks.max(1)
    }

    /// What is wrong with the shape on a communicator of `ranks` ranks, if anything.
    pub(crate) fn problem(&self) -> Option<String> {
        let s = self;
        if s.hidden == 0 || s.top_k == 0 || s.num_experts == 0 {
            return Some(format!("hidden ({}), top_k ({}) and num_experts ({}) must be at least 1", s.hidden, s.top_k, s.num_experts));
        }
        if !s.num_experts.is_multiple_of(s.ranks) {
            return Some(format!("num_experts ({}) is not a multiple of the communicator's {} ranks", s.num_experts, s.ranks));
        }
        if s.top_k > s.num_experts {
            return Some(format!("top_k ({}) is above num_experts ({})", s.top_k, s.num_experts));
        }
        if u32::try_from(s.max_tokens).is_err() || u32::try_from(s.num_experts).is_err() {
            return Some(format!("max_tokens_per_rank ({}) and num_experts ({}) must be below 2^32", s.max_tokens, s.num_experts));
        }
        None
    }

    /// Bytes of one row of `T`.
    pub(crate) fn row_bytes<T: Element>(&self) -> usize {
        self.hidden * std::mem::size_of::<T>()
    }

    /// Bytes of one dispatch message holding `rows` rows of `T`.
    pub(crate) fn dispatch_bytes<T: Element>(&self, rows: usize) -> Option<usize> {
        let per = (meta_words(self.top_k) * 4).checked_add(self.row_bytes::<T>())?;
        rows.checked_mul(per)?.checked_add(HEADER_BYTES)
    }

    /// The low-latency combine window: per source a header (the source's `HEADER_BYTES` at
    /// `source × HEADER_BYTES`), then, from the returned offset (a multiple of 64), one row
    /// of `T` per (token, top-k slot): row `token × top_k + j`. `None` if it does not fit
    /// in memory. Returns (rows offset, window bytes).
    pub(crate) fn ll_combine_layout<T: Element>(&self) -> Option<(usize, usize)> {
        let rows_at = self.ranks.checked_mul(HEADER_BYTES)?.checked_next_multiple_of(64)?;
        let rows = self.max_tokens.checked_mul(self.top_k)?.checked_mul(self.row_bytes::<T>())?;
        Some((rows_at, rows_at.checked_add(rows)?))
    }
}

/// Bad input found by the rank that was given it, carried to every other rank in the
/// status of its packed header (so that they fail naming it, without waiting).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Bad {
    /// `tokens.len()` is not a multiple of `hidden`.
    TokensLen { len: u64, hidden: u64 },
    /// `topk_idx` (`which` 0) or `topk_weights` (`which` 1) is not `n × top_k` long.
    RouteLen { which: u64, len: u64, want: u64 },
    /// More tokens than `max_tokens_per_rank`.
    TooManyTokens { n: u64, max: u64 },
    /// An expert index at or past `num_experts`.
    Expert { token: u64, slot: u64, expert: u64 },
    /// The same expert twice in one token's top-k.
    Duplicate { token: u64, expert: u64 },
    /// A weight that is NaN or infinite.
    Weight { token: u64, slot: u64 },
    /// `expert_out.len()` differs from the dispatched rows × hidden.
    ExpertOutLen { len: u64, want: u64 },
    /// `out.len()` differs from `n × hidden`.
    OutLen { len: u64, want: u64 },
    /// A handle of another dispatch (another object, or an earlier step).
    Handle,
}

impl Bad {
    /// (code, details); code 0 means no problem.
    pub(crate) fn words(&self) -> [u64; 4] {
        match *self {
            Bad::TokensLen { len, hidden } => [1, len, hidden, 0],
            Bad::RouteLen { which, len, want } => [2, which, len, want],
            Bad::TooManyTokens { n, max } => [3, n, max, 0],
            Bad::Expert { token, slot, expert } => [4, token, slot, expert],
            Bad::Duplicate { token, expert } => [5, token, expert, 0],
            Bad::Weight { token, slot } => [6, token, slot, 0],
            Bad::ExpertOutLen { len, want } => [7, len, want, 0],
            Bad::OutLen { len, want } => [8, len, want, 0],
            Bad::Handle => [9, 0, 0, 0],
        }
    }

    /// The status `words` carries: `Ok(None)` for none, `Err(code)` for a code unknown here.
    pub(crate) fn from_words(w: [u64; 4]) -> Result<Option<Bad>, u64> {
        Ok(Some(match w[0] {
            0 => return Ok(None),
            1 => Bad::TokensLen { len: w[1], hidden: w[2] },
            2 => Bad::RouteLen { which: w[1], len: w[2], want: w[3] },
            3 => Bad::TooManyTokens { n: w[1], max: w[2] },
            4 => Bad::Expert { token: w[1], slot: w[2], expert: w[3] },
            5 => Bad::Duplicate { token: w[1], expert: w[2] },
            6 => Bad::Weight { token: w[1], slot: w[2] },
            7 => Bad::ExpertOutLen { len: w[1], want: w[2] },
            8 => Bad::OutLen { len: w[1], want: w[2] },
            9 => Bad::Handle,
            c => return Err(c),
        }))
    }
}

impl fmt::Display for Bad {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Bad::TokensLen { len, hidden } => write!(f, "tokens has {len} elements, not a multiple of hidden ({hidden})"),
            Bad::RouteLen { which, len, want } => {
                let name = if which == 0 { "topk_idx" } else { "topk_weights" };
                write!(f, "{name} has {len} entries, want n x top_k = {want}")
            }
            Bad::TooManyTokens { n, max } => write!(f, "{n} tokens, more than max_tokens_per_rank ({max})"),
            Bad::Expert { token, slot, expert } => {
                write!(f, "token {token} slot {slot}: expert index {expert} out of range (moe::MASKED leaves a slot empty)")
            }
            Bad::Duplicate { token, expert } => write!(f, "token {token} lists expert {expert} twice in its top-k"),
            Bad::Weight { token, slot } => write!(f, "token {token} slot {slot}: weight is not finite"),
            Bad::ExpertOutLen { len, want } => write!(f, "expert_out has {len} elements, want dispatched rows x hidden = {want}"),
            Bad::OutLen { len, want } => write!(f, "out has {len} elements, want n x hidden = {want}"),
            Bad::Handle => write!(f, "the handle is not the one of this object's last dispatch"),
        }
    }
}

/// Checks a dispatch's arguments; returns `n`, the number of tokens.
pub(crate) fn check_dispatch(shape: &Shape, tokens_len: usize, topk_idx: &[u32], topk_weights: &[f32]) -> Result<usize, Bad> {
    let (h, k) = (shape.hidden, shape.top_k);
    if !tokens_len.is_multiple_of(h) {
        return Err(Bad::TokensLen { len: tokens_len as u64, hidden: h as u64 });
    }
    let n = tokens_len / h;
    let want = n * k;
    if topk_idx.len() != want {
        return Err(Bad::RouteLen { which: 0, len: topk_idx.len() as u64, want: want as u64 });
    }
    if topk_weights.len() != want {
        return Err(Bad::RouteLen { which: 1, len: topk_weights.len() as u64, want: want as u64 });
    }
    if n > shape.max_tokens {
        return Err(Bad::TooManyTokens { n: n as u64, max: shape.max_tokens as u64 });
    }
    for t in 0..n {
        let idx = &topk_idx[t * k..(t + 1) * k];
        for (j, &e) in idx.iter().enumerate() {
            if e == NO_EXPERT {
                // A masked slot (`moe::MASKED`): nothing is sent for it, its weight unused.
                continue;
            }
            if e as usize >= shape.num_experts {
                return Err(Bad::Expert { token: t as u64, slot: j as u64, expert: u64::from(e) });
            }
            if idx[..j].contains(&e) {
                return Err(Bad::Duplicate { token: t as u64, expert: u64::from(e) });
            }
            if !topk_weights[t * k + j].is_finite() {
                return Err(Bad::Weight { token: t as u64, slot: j as u64 });
            }
        }
    }
    Ok(n)
}

/// The routing of one dispatch at its origin; kept by the object and refilled every step
/// (its vectors keep their capacity).
#[derive(Debug, Default)]
pub(crate) struct Route {
    /// `tokens[d]`: token indices sent to rank `d`, ascending.
    pub tokens: Vec<Vec<u32>>,
    /// `meta[d]`: [`meta_words`] words per row of `tokens[d]`.
    pub meta: Vec<Vec<u32>>,
    /// `slots[d]`: the (token, top-k slot) pairs whose expert lives on rank `d`.
    pub slots: Vec<usize>,
}

/// Routes `n` checked tokens (see [`check_dispatch`]) into `r`.
pub(crate) fn route_into(shape: &Shape, n: usize, topk_idx: &[u32], topk_weights: &[f32], r: &mut Route) {
    let (k, per, ranks) = (shape.top_k, shape.per_rank(), shape.ranks);
    r.tokens.resize_with(ranks, Vec::new);
    r.meta.resize_with(ranks, Vec::new);
    r.tokens.iter_mut().chain(r.meta.iter_mut()).for_each(Vec::clear);
    r.slots.clear();
    r.slots.resize(ranks, 0);
    for t in 0..n {
        let idx = &topk_idx[t * k..(t + 1) * k];
        let w = &topk_weights[t * k..(t + 1) * k];
        for d in 0..ranks {
            if !idx.iter().any(|&e| e as usize / per == d) {
                continue;
            }
            r.tokens[d].push(t as u32);
            let m = &mut r.meta[d];
            m.push(t as u32);
            for j in 0..k {
                let e = idx[j] as usize;
                match e / per == d {
                    true => {
                        m.extend([(e % per) as u32, w[j].to_bits()]);
                        r.slots[d] += 1;
                    }
                    false => m.extend([NO_EXPERT, 0]),
                }
            }
        }
    }
}

/// [`route_into`] a new [`Route`].
#[cfg(test)]
pub(crate) fn route(shape: &Shape, n: usize, topk_idx: &[u32], topk_weights: &[f32]) -> Route {
    let mut r = Route::default();
    route_into(shape, n, topk_idx, topk_weights, &mut r);
    r
}

/// A parsed header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    pub kind: u64,
    pub seq: u64,
    pub count: usize,
    pub bad: Option<Bad>,
}

fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

/// Appends a header to `out`.
pub(crate) fn pack_header(out: &mut Vec<u8>, kind: Kind, seq: u64, count: usize, bad: Option<&Bad>) {
    put_u64(out, MAGIC | (kind as u64) << 32);
    put_u64(out, seq);
    put_u64(out, count as u64);
    for w in bad.map_or([0; 4], Bad::words) {
        put_u64(out, w);
    }
}

/// Appends a dispatch message to `out`: the header, `meta`, and the rows of `tokens`
/// (`hidden` elements each) named by `rows`.
pub(crate) fn pack_dispatch<T: Element>(out: &mut Vec<u8>, seq: u64, hidden: usize, rows: &[u32], meta: &[u32], tokens: &[T]) {
    pack_dispatch_head(out, seq, rows.len(), meta);
    for &t in rows {
        let t = t as usize;
        out.extend_from_slice(as_bytes(&tokens[t * hidden..(t + 1) * hidden]));
    }
}

/// Appends a dispatch message's header and metadata (of `count` rows) to `out`: the rows
/// follow them.
pub(crate) fn pack_dispatch_head(out: &mut Vec<u8>, seq: u64, count: usize, meta: &[u32]) {
    pack_header(out, Kind::Dispatch, seq, count, None);
    for &m in meta {
        out.extend_from_slice(&m.to_le_bytes());
    }
}

/// Parses the header at the start of `bytes`; `Err` says what is wrong with it.
pub(crate) fn parse_header(bytes: &[u8], kind: Kind) -> Result<Header, String> {
    if bytes.len() < HEADER_BYTES {
        return Err(format!("a message of {} bytes, shorter than a header", bytes.len()));
    }
    let w = |i: usize| u64::from_le_bytes(bytes[i * 8..i * 8 + 8].try_into().unwrap_or([0; 8]));
    if w(0) & 0xffff_ffff != MAGIC || w(0) >> 32 != kind as u64 {
        return Err(format!("a header with tag {:#x}, not a {kind:?} header", w(0)));
    }
    let bad = Bad::from_words([w(3), w(4), w(5), w(6)]).map_err(|c| format!("unknown status code {c}"))?;
    let count = usize::try_from(w(2)).map_err(|_| format!("row count {} out of range", w(2)))?;
    Ok(Header { kind: kind as u64, seq: w(1), count, bad })
}

/// One source's dispatched rows, as received.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Received<'a> {
    /// [`meta_words`] little-endian `u32` words per row.
    pub meta: &'a [u8],
    /// The rows' bytes (`count × row_bytes`).
    pub rows: &'a [u8],
}

/// Splits a dispatch message's body (after the header) of `count` rows.
pub(crate) fn split_dispatch<'a>(shape: &Shape, row_bytes: usize, count: usize, body: &'a [u8]) -> Option<Received<'a>> {
    let mw = meta_words(shape.top_k);
    let meta_len = count.checked_mul(mw)?.checked_mul(4)?;
    let rows_len = count.checked_mul(row_bytes)?;
    if body.len() < meta_len.checked_add(rows_len)? {
        return None;
    }
    Some(Received { meta: &body[..meta_len], rows: &body[meta_len..meta_len + rows_len] })
}

/// What a rank received in one dispatch, for its combine; kept by the object and refilled
/// every step (its vectors keep their capacity).
#[derive(Debug, Default)]
pub(crate) struct Groups {
    /// Rows received from each source rank.
    pub counts: Vec<usize>,
    /// Per received row (sources in order), its (row in the grouped tokens, weight) per
    /// local expert it chose, in top-k order: `slots[slot_at[i]..slot_at[i + 1]]`.
    pub slots: Vec<(u32, f32)>,
    /// `received rows + 1` offsets into `slots`.
    pub slot_at: Vec<usize>,
    /// Per slot, where its result goes at the origin: `token × top_k + j` for top-k entry `j`
    /// of the origin's token (the low-latency combine's row in the origin's window).
    pub places: Vec<u32>,
    /// Scratch: rows per local expert, the next free row of each group, and where each
    /// grouped row comes from (source, row).
    sizes: Vec<usize>,
    next: Vec<usize>,
    order: Vec<(u32, u32)>,
}

/// Groups the rows received from every source (in source order) by local expert into a
/// new vector: rows grouped by local expert (expert 0's first), within a group by source
/// rank and then by the source's order, and `per_rank + 1` row offsets into it; `g` gets
/// what combine needs. `Err` names a metadata entry that is out of range (a corrupt
/// message).
pub(crate) fn group_into<T: MoeFloat>(shape: &Shape, from: &[Received<'_>], g: &mut Groups) -> Result<(Vec<T>, Vec<usize>), String> {
    let (k, per, h) = (shape.top_k, shape.per_rank(), shape.hidden);
    let mw = meta_words(k);
    let word = |row: &[u8], i: usize| u32::from_le_bytes([row[4 * i], row[4 * i + 1], row[4 * i + 2], row[4 * i + 3]]);
    g.sizes.clear();
    g.sizes.resize(per, 0);
    for r in from {
        for row in r.meta.chunks_exact(4 * mw) {
            for j in 0..k {
                match word(row, 1 + 2 * j) {
                    NO_EXPERT => {}
                    le if (le as usize) < per => g.sizes[le as usize] += 1,
                    le => return Err(format!("local expert {le} out of range (this rank has {per})")),
                }
            }
        }
    }
    let mut offsets = Vec::with_capacity(per + 1);
    offsets.push(0);
    for s in &g.sizes {
        offsets.push(offsets[offsets.len() - 1] + s);
    }
    let total = offsets[per];
    g.next.clone_from(&offsets);
    g.slots.clear();
    g.places.clear();
    g.slot_at.clear();
    g.slot_at.push(0);
    g.counts.clear();
    let rb = shape.row_bytes::<T>();
    // Where each group's rows come from, in the group's order: (source, row), so that the
    // rows are appended once each, group by group (no zero fill, no second pass).
    g.order.clear();
    g.order.resize(total, (0, 0));
    for (si, r) in from.iter().enumerate() {
        g.counts.push(r.meta.len() / (4 * mw));
        for (i, row) in r.meta.chunks_exact(4 * mw).enumerate() {
            let t = word(row, 0) as usize;
            if t >= shape.max_tokens {
                return Err(format!("token index {t} at or past max_tokens_per_rank ({})", shape.max_tokens));
            }
            for j in 0..k {
                let le = word(row, 1 + 2 * j);
                if le == NO_EXPERT {
                    continue;
                }
                g.places.push((t * k + j) as u32);
                let at = g.next[le as usize];
                g.next[le as usize] += 1;
                g.order[at] = (si as u32, i as u32);
                g.slots.push((at as u32, f32::from_bits(word(row, 2 + 2 * j))));
            }
            g.slot_at.push(g.slots.len());
        }
    }
    let mut tokens: Vec<T> = Vec::with_capacity(total * h);
    for &(si, i) in &g.order {
        let src = &from[si as usize].rows[i as usize * rb..(i as usize + 1) * rb];
        extend_from_bytes(&mut tokens, src);
    }
    Ok((tokens, offsets))
}

/// [`group_into`] with its results in one struct (tests).
#[cfg(test)]
#[derive(Debug)]
pub(crate) struct Grouped<T> {
    pub tokens: Vec<T>,
    pub offsets: Vec<usize>,
    pub slots: Vec<(u32, f32)>,
    pub slot_at: Vec<usize>,
}

#[cfg(test)]
pub(crate) fn group<T: MoeFloat>(shape: &Shape, from: &[Received<'_>]) -> Result<Grouped<T>, String> {
    let mut g = Groups::default();
    let (tokens, offsets) = group_into(shape, from, &mut g)?;
    Ok(Grouped { tokens, offsets, slots: g.slots, slot_at: g.slot_at })
}

/// Appends the elements of `T` in `bytes` (a whole number of them) to `out`: one copy,
/// viewed in place when aligned.
pub(crate) fn extend_from_bytes<T: MoeFloat>(out: &mut Vec<T>, bytes: &[u8]) {
    match bytemuck::try_cast_slice::<u8, T>(bytes) {
        Ok(v) => out.extend_from_slice(v),
        Err(_) => out.extend(bytes.chunks_exact(std::mem::size_of::<T>()).map(bytemuck::pod_read_unaligned::<T>)),
    }
}

/// `bytes` (a whole number of `T`) as elements: viewed in place when aligned for `T`, else
/// copied into `copy`.
fn elems<'a, T: MoeFloat>(bytes: &'a [u8], copy: &'a mut Vec<T>) -> &'a [T] {
    match bytemuck::try_cast_slice::<u8, T>(bytes) {
        Ok(v) => v,
        Err(_) => {
            extend_from_bytes(copy, bytes);
            copy
        }
    }
}

/// The expert rank's half of combine: per received row `rows` (in received order), the
/// sum in `f32` of `w · y` over its slots in top-k order, rounded once to `T`; appended to
/// `out` as bytes. One pass per row (`ferroccl_kernels::weighted_sum`: the products and
/// sums of a few elements at a time stay in registers).
pub(crate) fn partial_sums<T: MoeFloat>(
    hidden: usize,
    expert_out: &[T],
    slots: &[(u32, f32)],
    slot_at: &[usize],
    rows: std::ops::Range<usize>,
    out: &mut Vec<u8>,
) {
    let size = std::mem::size_of::<T>();
    let mut srcs: Vec<(&[T], f32)> = Vec::new();
    let mut row: Vec<T> = Vec::new();
    for i in rows {
        srcs.clear();
        srcs.extend(
            slots[slot_at[i]..slot_at[i + 1]].iter().map(|&(at, w)| (&expert_out[at as usize * hidden..(at as usize + 1) * hidden], w)),
        );
        let at = out.len();
        out.resize(at + hidden * size, 0);
        match bytemuck::try_cast_slice_mut::<u8, T>(&mut out[at..]) {
            Ok(dst) => ferroccl_kernels::weighted_sum(&srcs, dst),
            Err(_) => {
                row.resize(hidden, T::from_f32(0.0));
                ferroccl_kernels::weighted_sum(&srcs, &mut row);
                out[at..].copy_from_slice(as_bytes(&row));
            }
        }
    }
}

/// The origin's half of combine: `out[t]` (`hidden` elements per token, `n` tokens) is
/// the sum in `f32`, rounded once to `T`, of token `t`'s rows from the destinations in
/// ascending order; destination `d` sent back the rows of `tokens[d]` (its dispatch's
/// token list, in order) as the bytes `rows[d]`. A token no destination had is zeros.
/// `order` is scratch (reused).
pub(crate) fn sum_rows<T: MoeFloat>(hidden: usize, tokens: &[Vec<u32>], rows: &[&[u8]], order: &mut Vec<(u32, u32, u32)>, out: &mut [T]) {
    let rb = hidden * std::mem::size_of::<T>();
    let mut copies: Vec<Vec<T>> = (0..rows.len()).map(|_| Vec::new()).collect();
    let views: Vec<&[T]> = rows.iter().zip(copies.iter_mut()).map(|(r, c)| elems(r, c)).collect();
    // (token, destination, row): a stable sort by token keeps the destinations ascending.
    order.clear();
    for (d, ts) in tokens.iter().enumerate() {
        order.extend(
            ts.iter()
                .enumerate()
                .filter(|(j, _)| (j + 1) * rb <= rows.get(d).map_or(0, |r| r.len()))
                .map(|(j, &t)| (t, d as u32, j as u32)),
        );
    }
    order.sort_by_key(|&(t, _, _)| t);
    let mut srcs: Vec<(&[T], f32)> = Vec::new();
    let mut next = order.iter().peekable();
    for (t, dst) in out.chunks_exact_mut(hidden).enumerate() {
        srcs.clear();
        while let Some(&&(u, d, j)) = next.peek() {
            if u as usize != t {
                break;
            }
            let (d, j) = (d as usize, j as usize);
            srcs.push((&views[d][j * hidden..(j + 1) * hidden], 1.0));
            next.next();
        }
        ferroccl_kernels::weighted_sum(&srcs, dst);
    }
}

/// The low-latency origin's combine: `out[t]` (`hidden` elements per token) is the sum in
/// `f32` of `w[t × top_k + j] · y(t, j)` over the top-k slots `j` in order, rounded once to
/// `T`, where `y(t, j)` is row `t × top_k + j` of `rows` (the bytes of at least
/// `out.len() / hidden × top_k` rows of `T`, viewed in place, copied if not aligned).
pub(crate) fn sum_slots<T: MoeFloat>(hidden: usize, top_k: usize, rows: &[u8], (weights, live): (&[f32], &[bool]), out: &mut [T]) {
    let mut copy: Vec<T> = Vec::new();
    let rows = elems(rows, &mut copy);
    let mut srcs: Vec<(&[T], f32)> = Vec::with_capacity(top_k);
    for (t, dst) in out.chunks_exact_mut(hidden).enumerate() {
        srcs.clear();
        // A masked slot's row was never written this step: left out.
        srcs.extend(
            (0..top_k)
                .map(|j| t * top_k + j)
                .filter(|&r| live.get(r).copied().unwrap_or(true))
                .map(|r| (&rows[r * hidden..(r + 1) * hidden], weights[r])),
        );
        ferroccl_kernels::weighted_sum(&srcs, dst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(ranks: usize) -> Shape {
        Shape { num_experts: 2 * ranks, hidden: 2, top_k: 2, max_tokens: 4, ranks }
    }

    #[test]
    fn checks_name_the_first_problem() {
        let s = shape(2);
        assert_eq!(check_dispatch(&s, 3, &[], &[]), Err(Bad::TokensLen { len: 3, hidden: 2 }));
        assert_eq!(check_dispatch(&s, 2, &[0], &[1.0, 1.0]), Err(Bad::RouteLen { which: 0, len: 1, want: 2 }));
        assert_eq!(check_dispatch(&s, 2, &[0, 1], &[1.0]), Err(Bad::RouteLen { which: 1, len: 1, want: 2 }));
        assert_eq!(check_dispatch(&s, 10, &[0; 10], &[1.0; 10]), Err(Bad::TooManyTokens { n: 5, max: 4 }));
        assert_eq!(check_dispatch(&s, 2, &[0, 4], &[1.0, 1.0]), Err(Bad::Expert { token: 0, slot: 1, expert: 4 }));
        assert_eq!(check_dispatch(&s, 2, &[3, 3], &[1.0, 1.0]), Err(Bad::Duplicate { token: 0, expert: 3 }));
        assert_eq!(check_dispatch(&s, 2, &[3, 2], &[1.0, f32::NAN]), Err(Bad::Weight { token: 0, slot: 1 }));
        assert_eq!(check_dispatch(&s, 0, &[], &[]), Ok(0));
        for b in [Bad::Expert { token: 1, slot: 2, expert: 3 }, Bad::Handle, Bad::OutLen { len: 1, want: 2 }] {
            assert_eq!(Bad::from_words(b.words()), Ok(Some(b)));
        }
        assert_eq!(Bad::from_words([0; 4]), Ok(None));
        assert_eq!(Bad::from_words([99, 0, 0, 0]), Err(99));
    }

    #[test]
    fn shapes_are_checked() {
        assert!(shape(2).problem().is_none());
        assert!(Shape { num_experts: 3, ..shape(2) }.problem().unwrap().contains("multiple"));
        assert!(Shape { hidden: 0, ..shape(2) }.problem().is_some());
        assert!(Shape { top_k: 9, ..shape(2) }.problem().unwrap().contains("top_k"));
    }

    /// Routes 3 tokens over 2 ranks (experts 0, 1 on rank 0; 2, 3 on rank 1), packs, groups
    /// on both ranks, runs the identity expert, combines, and gets back Σ w · x.
    #[test]
    fn round_trip_gives_the_weighted_sum() {
        let s = shape(2);
        let x: Vec<f32> = vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let idx = [0u32, 1, 2, 0, 3, 2];
        let w = [0.5f32, 0.25, 2.0, 1.0, 0.5, 0.5];
        let n = check_dispatch(&s, x.len(), &idx, &w).unwrap();
        let r = route(&s, n, &idx, &w);
        assert_eq!(r.tokens, vec![vec![0, 1], vec![1, 2]]);
        // Rank 0 gets tokens 0 (experts 0, 1) and 1 (expert 0); rank 1 tokens 1 (2) and 2 (3, 2).
        let mut partials: Vec<Vec<u8>> = Vec::new();
        for d in 0..2 {
            let mut bytes = Vec::new();
            pack_dispatch(&mut bytes, 7, 2, &r.tokens[d], &r.meta[d], &x);
            assert_eq!(bytes.len(), s.dispatch_bytes::<f32>(r.tokens[d].len()).unwrap());
            let h = parse_header(&bytes, Kind::Dispatch).unwrap();
            assert_eq!((h.seq, h.count, h.bad), (7, r.tokens[d].len(), None));
            assert!(parse_header(&bytes, Kind::Combine).is_err());
            let rec = split_dispatch(&s, 8, h.count, &bytes[HEADER_BYTES..]).unwrap();
            let g: Grouped<f32> = group(&s, &[rec]).unwrap();
            if d == 0 {
                assert_eq!(g.offsets, vec![0, 2, 3]);
                assert_eq!(g.tokens, vec![1.0, 2.0, 3.0, 4.0, 1.0, 2.0]);
            } else {
                // Expert 2 (local 0): token 1, token 2; expert 3: token 2.
                assert_eq!(g.offsets, vec![0, 2, 3]);
                assert_eq!(g.tokens, vec![3.0, 4.0, 5.0, 6.0, 5.0, 6.0]);
            }
            let mut partial = Vec::new();
            let rows = g.slot_at.len() - 1;
            partial_sums(2, &g.tokens, &g.slots, &g.slot_at, 0..rows, &mut partial);
            partials.push(partial);
        }
        let mut out = vec![f32::NAN; n * 2];
        let rows: Vec<&[u8]> = partials.iter().map(|p| &p[..]).collect();
        sum_rows::<f32>(2, &r.tokens, &rows, &mut Vec::new(), &mut out);
        let want: Vec<f32> = (0..6).map(|i| x[i] * (w[i / 2 * 2] + w[i / 2 * 2 + 1])).collect();
        assert_eq!(out, want);
        // A token that went nowhere is zeros; misaligned rows are read too.
        let mut out = vec![f32::NAN; 4 * 2];
        let mut shifted = vec![0u8];
        shifted.extend_from_slice(&partials[1]);
        let rows: Vec<&[u8]> = vec![&partials[0][..], &shifted[1..]];
        sum_rows::<f32>(2, &r.tokens, &rows, &mut Vec::new(), &mut out);
        assert_eq!(&out[..6], &want[..]);
        assert_eq!(&out[6..], &[0.0, 0.0]);
    }

    #[test]
    fn corrupt_metadata_is_an_error_not_a_panic() {
        let s = shape(2);
        let rows = [0u8; 8];
        let meta: Vec<u8> = [0u32, 7, 0, NO_EXPERT, 0].iter().flat_map(|w| w.to_le_bytes()).collect();
        let rec = Received { meta: &meta, rows: &rows };
        assert!(group::<f32>(&s, &[rec]).unwrap_err().contains("local expert 7"));
        assert!(split_dispatch(&s, 8, 2, &[0u8; 10]).is_none());
        assert!(parse_header(&[0u8; 10], Kind::Dispatch).is_err());
    }

    #[test]
    fn slice_conversions_equal_the_scalar_ones() {
        let mut xs: Vec<f32> =
            vec![0.0, -0.0, 1.0, 1.0 + 1.0 / 256.0, 1.0 + 3.0 / 512.0, 65504.0, 1e30, -1e-30, f32::INFINITY, f32::MAX, f32::MIN_POSITIVE];
        let mut z = 12345u32;
        for _ in 0..2000 {
            z = z.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            xs.push(f32::from_bits(z));
        }
        xs.retain(|x| !x.is_nan());
        let mut b = vec![bf16::ZERO; xs.len()];
        bf16::narrow_row(&xs, &mut b);
        let mut h = vec![f16::ZERO; xs.len()];
        f16::narrow_row(&xs, &mut h);
        for (i, &x) in xs.iter().enumerate() {
            assert_eq!(b[i].to_bits(), bf16::from_f32(x).to_bits(), "bf16 of {x:e}");
            assert_eq!(h[i].to_bits(), f16::from_f32(x).to_bits(), "f16 of {x:e}");
        }
        let mut w = vec![0f32; xs.len()];
        bf16::widen_row(&b, &mut w);
        assert!(w.iter().zip(&b).all(|(w, b)| w.to_bits() == b.to_f32().to_bits()));
        f16::widen_row(&h, &mut w);
        assert!(w.iter().zip(&h).all(|(w, h)| w.to_bits() == h.to_f32().to_bits()));
        let mut nan = [bf16::ZERO];
        bf16::narrow_row(&[f32::NAN], &mut nan);
        assert!(nan[0].is_nan());
    }

    #[test]
    fn half_types_round_once() {
        let mut out: Vec<u8> = Vec::new();
        let y = [bf16::from_f32(1.0), bf16::from_f32(1.0 / 256.0)];
        // 1 + 1/256 rounds to 1 in bf16 (8 bits of mantissa), once.
        partial_sums(1, &y, &[(0, 1.0), (1, 1.0)], &[0, 2], 0..1, &mut out);
        assert_eq!(out, bf16::from_f32(1.0).to_le_bytes());
        // Misaligned bytes are read and written too.
        let mut grown: Vec<bf16> = Vec::new();
        let b = [0u8, 0x80, 0x3f, 0x00, 0x40];
        extend_from_bytes(&mut grown, &b[1..]);
        assert_eq!(grown, vec![bf16::from_f32(1.0), bf16::from_f32(2.0)]);
    }
}
