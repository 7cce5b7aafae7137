//! Mixture-of-experts dispatch and combine (DeepEP-like), over collectives or one-sided
//! windows (issue 16; see `docs/moe.md`).
//!
//! Every member of a communicator makes one [`Moe`] object per layer shape, collectively
//! ([`Communicator::moe`]). Expert `e` lives on rank `e / experts_per_rank`
//! (`experts_per_rank = num_experts / size()`). Each step:
//!
//! * [`Moe::dispatch`]`(tokens, topk_idx, topk_weights)` sends every token once to each
//!   rank that owns at least one of its `top_k` experts, and returns what this rank
//!   received, grouped by local expert ([`Dispatched`]);
//! * the caller runs its local experts over [`Dispatched::tokens`], row for row;
//! * [`Moe::combine`]`(expert_out, handle, out)` gives every token, at its origin and in its
//!   original order, `Σ_k w_k · y_{e_k}(x_t)`.
//!
//! Rounding: in throughput mode the expert rank sums `w_k · y` in `f32` over its own
//! experts of a token in top-k order and rounds once to `T`, and the origin sums the
//! ranks' rows in `f32` in ascending rank order and rounds once to `T`; in low-latency mode
//! the expert outputs come back unweighted and the origin sums `w_k · y_k` in `f32` in
//! top-k order, rounding once. For `f32` with values whose sums are exact (integers,
//! dyadic weights) the result is exact; for `bf16` / `f16` see `docs/moe.md` for the
//! bounds.
//!
//! Two modes ([`MoeMode`]): **Throughput** exchanges counts (with each rank's input
//! status) in an `alltoall` and the packed rows and metadata in an `alltoallv`; combine is
//! the reverse `alltoallv`. **LowLatency** (decode) writes into persistent windows made at
//! construction, with `put_signal`, and needs no count round trip.
//!
//! Low-latency objects share the fabric's signals (one per pair of ranks) with every other
//! user of signals, and every rank must make the sends of all its `Moe` objects in the
//! same order; see [`Moe::dispatch_send`] and `docs/moe.md` (limitations).
//!
//! ```
//! # use ferroccl::bootstrap::{env::StoreRole, new_token, StoreServer};
//! # use ferroccl::{Communicator, InitConfig, Params};
//! # let token = new_token();
//! # let store = StoreServer::start("127.0.0.1:0".parse().unwrap(), &token, 1 << 20)?;
//! # let cfg = InitConfig { rank: 0, world_size: 1, store: StoreRole::Connect(store.addr().to_string()), token };
//! # let comm = Communicator::init_with(cfg, Params::default())?;
//! use ferroccl::moe::{MoeConfig, MoeMode};
//!
//! let cfg = MoeConfig { num_experts: 8, hidden: 16, top_k: 2, max_tokens_per_rank: 4 };
//! let mut moe = comm.moe::<f32>(cfg, MoeMode::LowLatency)?; // collective, once
//! let x = vec![1.0f32; 4 * 16];
//! let idx = [0u32, 5, 1, 2, 7, 6, 3, 4];
//! let w = [0.5f32; 8];
//! let d = moe.dispatch(&x, &idx, &w)?;
//! let y: Vec<f32> = d.tokens.iter().map(|v| v * 2.0).collect(); // the local experts
//! let mut out = vec![0f32; x.len()];
//! moe.combine(&y, &d.handle, &mut out)?; // out[t] = Σ_k w_k · y_{e_k}(x_t)
//! assert!(out.iter().all(|&v| v == 2.0));
//! # Ok::<(), ferroccl::Error>(())
//! ```

mod route;
mod signal;

use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::reshard::Fingerprint;
use crate::window::{RemoteHandle, Window};
use signal::Which;

pub use route::MoeFloat;

/// A top-k slot's expert index that means "no expert": nothing is sent for the slot, and it
/// adds nothing at combine (its weight is not read). A token whose slots are all masked is
/// sent nowhere and combines to zeros. So one object of top-k serves calls that route fewer
/// than k experts per token (say, every token to one expert with top-2).
pub const MASKED: u32 = route::NO_EXPERT;
use route::{Bad, Groups, Kind, Route, Shape, HEADER_BYTES};

/// A layer's MoE shape; every member passes the same one (checked at construction).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MoeConfig {
    /// Experts in all; a multiple of the communicator's size.
    pub num_experts: usize,
    /// Elements per token row.
    pub hidden: usize,
    /// Experts each token chooses (at most `num_experts`).
    pub top_k: usize,
    /// The most tokens any rank passes to one dispatch (sizes the low-latency buffers).
    pub max_tokens_per_rank: usize,
}

/// How a [`Moe`] object moves its rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MoeMode {
    /// Count exchange (`alltoall`) then `alltoallv` of packed rows and metadata; combine is
    /// the reverse `alltoallv`. Buffers grow to the largest step and are reused.
    Throughput,
    /// Persistent windows sized for `max_tokens_per_rank`, written with `put_signal`; no
    /// count round trip (decode).
    LowLatency,
}

/// What one dispatch delivered to this rank.
#[derive(Debug, Clone, PartialEq)]
pub struct Dispatched<T> {
    /// Received rows (`hidden` elements each), grouped by local expert: expert 0's rows
    /// first; within an expert's group, by source rank, then in the source's token order.
    pub tokens: Vec<T>,
    /// `experts_per_rank + 1` offsets in rows: local expert `i`'s rows are
    /// `expert_offsets[i]..expert_offsets[i + 1]`.
    pub expert_offsets: Vec<usize>,
    /// What [`Moe::combine`] needs to send the results back.
    pub handle: MoeHandle,
}

/// Names one dispatch, for its combine (only the object and step that made it accept it;
/// the routing itself stays in the object, which has one step in flight at a time).
#[derive(Debug, Clone, PartialEq)]
pub struct MoeHandle {
    object: u64,
    step: u64,
    /// Tokens this rank had.
    n: usize,
    /// Rows of [`Dispatched::tokens`].
    rows: usize,
}

impl MoeHandle {
    /// Tokens this rank passed to the dispatch (the rows `out` of the combine has).
    pub fn num_tokens(&self) -> usize {
        self.n
    }

    /// Rows this rank received (the rows `expert_out` of the combine has).
    pub fn num_rows(&self) -> usize {
        self.rows
    }
}

/// Where an object is in its dispatch / combine cycle.
#[derive(Debug)]
enum State {
    Idle,
    /// A dispatch was sent (sequence value `seq`, low latency) and not yet received.
    DispatchSent {
        seq: u64,
        n: usize,
    },
    /// A dispatch of step `step` was received; its combine is next.
    Dispatched,
    /// A combine was sent and not yet received.
    CombineSent {
        seq: u64,
    },
    /// A step failed where the peers may not agree on where they are: unusable.
    Broken,
}

/// The low-latency mode's windows and the peers' handles.
#[derive(Debug)]
struct Ll {
    /// Per source a region of `dregion` bytes for its dispatch message.
    dispatch: Window<'static>,
    /// Per source a header, then from `crows` one row per (token, top-k slot) of this
    /// rank's (see `Shape::ll_combine_layout`).
    combine: Window<'static>,
    /// Per member: (its dispatch window, its combine window).
    peers: Vec<(RemoteHandle, RemoteHandle)>,
    dregion: usize,
    crows: usize,
}

impl Ll {
    /// This rank's `which` window.
    fn window(&self, which: Which) -> &Window<'static> {
        match which {
            Which::Dispatch => &self.dispatch,
            Which::Combine => &self.combine,
        }
    }
}

/// One layer's MoE dispatch / combine on a communicator; see the [module
/// documentation](self).
#[derive(Debug)]
pub struct Moe<'c, T: MoeFloat> {
    comm: &'c Communicator,
    shape: Shape,
    mode: MoeMode,
    object: u64,
    /// The object's signal slot and sequence (low latency).
    signals: signal::Signals,
    step: u64,
    state: State,
    ll: Option<Ll>,
    /// Reused between steps: packed messages going out, and coming in; a low-latency
    /// message's header (and metadata) while its rows are copied.
    send: Vec<u8>,
    head: Vec<u8>,
    recv: Vec<u8>,
    /// Scratch of combine's sums: (token, destination, row) (reused).
    order: Vec<(u32, u32, u32)>,
    /// Byte ranges of `recv` per peer.
    recv_at: Vec<(usize, usize)>,
    /// The last dispatch's routing at this rank as an origin (and its top-k weights,
    /// `n × top_k`), and what it received as an expert rank: what its combine needs.
    route: Route,
    weights: Vec<f32>,
    /// Per (token, top-k slot) of the last dispatch: not masked ([`MASKED`]).
    live: Vec<bool>,
    groups: Groups,
    /// Rows the last dispatch received from each source, and sent to each destination.
    last_recv: Vec<usize>,
    last_sent: Vec<usize>,
    _t: PhantomData<T>,
}

/// A dispatch that was sent and is not yet received; see [`Moe::dispatch_send`].
#[must_use = "a sent dispatch must be received (`recv`) before the next call on its object"]
#[derive(Debug)]
pub struct PendingDispatch<'a, 'c, T: MoeFloat> {
    moe: &'a mut Moe<'c, T>,
    /// Throughput mode: the result, already there.
    ready: Option<Dispatched<T>>,
}

/// A combine that was sent and is not yet received; see [`Moe::combine_send`].
#[must_use = "a sent combine must be received (`recv`) before the next call on its object"]
#[derive(Debug)]
pub struct PendingCombine<'a, 'c, T: MoeFloat> {
    moe: &'a mut Moe<'c, T>,
    handle: &'a MoeHandle,
}

/// Numbers objects, so that a handle is only accepted by the object that made it.
static OBJECTS: AtomicU64 = AtomicU64::new(1);

/// Bytes each member contributes to the construction's allgather: a status (0 ok, 1 its
/// own arguments rejected, 2 allocating failed), the fingerprint of its arguments, its
/// lowest unclaimed signal slot, its dispatch and combine window handles (low latency),
/// and its arguments themselves ([`CONFIG_BYTES`] at [`CONFIG_AT`]: so that a member that
/// passed others is told which field differs, with both values).
const SETUP_BYTES: usize = CONFIG_AT + CONFIG_BYTES;

/// Where a member's arguments start in its setup bytes.
const CONFIG_AT: usize = 17 + 2 * RemoteHandle::BYTES;

/// A member's arguments on the wire: `num_experts`, `hidden`, `top_k`,
/// `max_tokens_per_rank` (8 bytes each, little endian), the mode (1 byte), the element
/// type's name (8 bytes, zero-padded).
const CONFIG_BYTES: usize = 4 * 8 + 1 + 8;

fn encode_config(cfg: &MoeConfig, mode: MoeMode, dtype: &str) -> [u8; CONFIG_BYTES] {
    let mut b = [0u8; CONFIG_BYTES];
    for (i, v) in [cfg.num_experts, cfg.hidden, cfg.top_k, cfg.max_tokens_per_rank].into_iter().enumerate() {
        b[i * 8..i * 8 + 8].copy_from_slice(&(v as u64).to_le_bytes());
    }
    b[32] = mode as u8;
    let name = dtype.as_bytes();
    let n = name.len().min(8);
    b[33..33 + n].copy_from_slice(&name[..n]);
    b
}

/// The fields of two encoded configs (`a` of member `ma`, `b` of member `mb`) that differ:
/// "member 2's hidden is 5, member 0's 3".
fn config_differences(ma: usize, a: &[u8], mb: usize, b: &[u8]) -> Vec<String> {
    let field = |c: &[u8], i: usize| -> String {
        match i {
            0..=3 => u64::from_le_bytes(c[i * 8..i * 8 + 8].try_into().unwrap_or([0; 8])).to_string(),
            4 => match c[32] {
                0 => "Throughput".into(),
                1 => "LowLatency".into(),
                m => format!("mode {m}"),
            },
            _ => String::from_utf8_lossy(&c[33..41]).trim_end_matches('\0').to_string(),
        }
    };
    let names = ["num_experts", "hidden", "top_k", "max_tokens_per_rank", "mode", "element type"];
    (0..names.len())
        .filter(|&i| field(a, i) != field(b, i))
        .map(|i| format!("member {ma}'s {} is {}, member {mb}'s {}", names[i], field(a, i), field(b, i)))
        .collect()
}

fn fingerprint<T: MoeFloat>(cfg: &MoeConfig, mode: MoeMode) -> u64 {
    let mut h = Fingerprint::new();
    h.bytes(b"ferroccl.moe.v1").usize(cfg.num_experts).usize(cfg.hidden).usize(cfg.top_k).usize(cfg.max_tokens_per_rank);
    h.usize(mode as usize).str(T::DTYPE.name());
    h.finish()
}

fn invalid(me: usize, call: &str, what: impl std::fmt::Display) -> Error {
    Error::invalid(format!("rank {me}: moe {call}: {what}"))
}

/// The member holding the most common fingerprint (ties: the lowest such member), and the
/// members whose fingerprint differs from it.
fn disagreeing(prints: &[u64]) -> (usize, Vec<usize>) {
    let count = |f: u64| prints.iter().filter(|&&g| g == f).count();
    let mut reference = 0;
    for (m, &f) in prints.iter().enumerate() {
        if count(f) > count(prints[reference]) {
            reference = m;
        }
    }
    (reference, (0..prints.len()).filter(|&m| prints[m] != prints[reference]).collect())
}

impl Communicator {
    /// Makes a [`Moe`] object for one layer shape (see the [`moe`](crate::moe) module):
    /// collective, every member calls it with the same `cfg`, `mode` and `T`. In
    /// [`MoeMode::LowLatency`] it allocates two windows per rank (dispatch:
    /// `size() × (56 + max_tokens_per_rank × (4 × (1 + 2 × top_k) + hidden × size_of::<T>()))`
    /// bytes; combine: `⌈56 × size() / 64⌉ × 64 + max_tokens_per_rank × top_k × hidden ×
    /// size_of::<T>()`)
    /// and exchanges their handles in its one allgather.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`], on every member alike after the one allgather: a shape
    /// that is wrong here (`num_experts` not a multiple of `size()`, a zero `hidden`,
    /// `top_k` or `num_experts`, `top_k > num_experts`) names the members that found it;
    /// members that passed another `cfg`, `mode` or `T` than most members are named (their
    /// fingerprints differ; ties: the lowest member's is the reference), with each field
    /// that differs and both values (`member 2's hidden is 5, member 0's 3`; every member's
    /// arguments are in the allgather); a member that could not allocate its windows is
    /// named. And
    /// as any collective.
    pub fn moe<T: MoeFloat>(&self, cfg: MoeConfig, mode: MoeMode) -> Result<Moe<'_, T>> {
        let (me, size) = (self.rank(), self.size());
        let shape =
            Shape { num_experts: cfg.num_experts, hidden: cfg.hidden, top_k: cfg.top_k, max_tokens: cfg.max_tokens_per_rank, ranks: size };
        let mut problem = shape.problem();
        let regions = match (shape.dispatch_bytes::<T>(shape.max_tokens), shape.ll_combine_layout::<T>()) {
            (Some(d), Some(c)) if d.checked_mul(size).is_some() => Some((d, c)),
            _ => None,
        };
        if problem.is_none() && regions.is_none() {
            problem = Some(format!("buffers for {} tokens of {} elements do not fit in memory", cfg.max_tokens_per_rank, cfg.hidden));
        }
        let mut mine = [0u8; SETUP_BYTES];
        mine[1..9].copy_from_slice(&fingerprint::<T>(&cfg, mode).to_le_bytes());
        mine[9..17].copy_from_slice(&signal::Signals::proposal(self).to_le_bytes());
        mine[CONFIG_AT..].copy_from_slice(&encode_config(&cfg, mode, T::DTYPE.name()));
        let mut windows = None;
        let mut failure = None;
        if let (None, MoeMode::LowLatency, Some((d, (crows, c)))) = (&problem, mode, regions) {
            match (self.alloc_window::<u8>(d * size), self.alloc_window::<u8>(c)) {
                (Ok(dw), Ok(cw)) => {
                    mine[17..17 + RemoteHandle::BYTES].copy_from_slice(&dw.handle().to_bytes());
                    mine[17 + RemoteHandle::BYTES..CONFIG_AT].copy_from_slice(&cw.handle().to_bytes());
                    windows = Some((dw, cw, d, crows));
                }
                (Err(e), _) | (_, Err(e)) => {
                    mine[0] = 2;
                    failure = Some(e);
                }
            }
        }
        if problem.is_some() {
            mine[0] = 1;
        }
        let mut all = vec![0u8; SETUP_BYTES * size];
        self.allgather_into(&mine, &mut all)?;
        let rows: Vec<&[u8]> = all.chunks(SETUP_BYTES).collect();
        let le = |b: &[u8]| u64::from_le_bytes(b.try_into().unwrap_or([0; 8]));
        let prints: Vec<u64> = rows.iter().map(|c| le(&c[1..9])).collect();
        let (reference, odd) = disagreeing(&prints);
        if !odd.is_empty() {
            let names: Vec<String> = odd.iter().map(|m| m.to_string()).collect();
            let values: Vec<String> = odd.iter().map(|&m| format!("{:#018x}", prints[m])).collect();
            let reference_cfg = &rows[reference][CONFIG_AT..];
            let diffs: Vec<String> =
                odd.iter().flat_map(|&m| config_differences(m, &rows[m][CONFIG_AT..], reference, reference_cfg)).collect();
            return Err(invalid(
                me,
                "setup",
                format!(
                    "members {} passed another config, mode or element type than member {reference}: {} (fingerprints {}, member {reference}'s {:#018x})",
                    names.join(", "),
                    if diffs.is_empty() { "no field differs in the exchange".to_string() } else { diffs.join("; ") },
                    values.join(", "),
                    prints[reference]
                ),
            ));
        }
        if let Some(p) = problem {
            return Err(invalid(me, "setup", format!("bad config: {p}")));
        }
        let rejected: Vec<String> = (0..size).filter(|&m| rows[m][0] == 1).map(|m| m.to_string()).collect();
        if !rejected.is_empty() {
            return Err(invalid(me, "setup", format!("members {} rejected the config (their errors say why)", rejected.join(", "))));
        }
        if let Some(e) = failure {
            return Err(invalid(me, "setup", format!("allocating this rank's windows: {e}")));
        }
        if let Some(m) = (0..size).find(|&m| rows[m][0] == 2) {
            return Err(invalid(me, "setup", format!("member {m} could not allocate its windows")));
        }
        let mut signals = signal::Signals::claim(self, rows.iter().map(|c| le(&c[9..17])).max().unwrap_or(0));
        let ll = match windows {
            Some((dispatch, combine, dregion, crows)) => {
                let mut peers = Vec::with_capacity(size);
                for r in &rows {
                    let d = RemoteHandle::from_bytes(&r[17..17 + RemoteHandle::BYTES])?;
                    let c = RemoteHandle::from_bytes(&r[17 + RemoteHandle::BYTES..CONFIG_AT])?;
                    peers.push((d, c));
                }
                signals.connect(self, &peers)?;
                Some(Ll { dispatch, combine, peers, dregion, crows })
            }
            None => None,
        };
        Ok(Moe {
            comm: self,
            shape,
            mode,
            object: OBJECTS.fetch_add(1, Ordering::Relaxed),
            signals,
            step: 0,
            state: State::Idle,
            ll,
            send: Vec::new(),
            head: Vec::new(),
            recv: Vec::new(),
            order: Vec::new(),
            route: Route::default(),
            weights: Vec::new(),
            live: Vec::new(),
            groups: Groups::default(),
            recv_at: Vec::new(),
            last_recv: vec![0; size],
            last_sent: vec![0; size],
            _t: PhantomData,
        })
    }
}

impl<'c, T: MoeFloat> Moe<'c, T> {
    /// The mode this object was made with.
    pub fn mode(&self) -> MoeMode {
        self.mode
    }

    /// Experts per rank: local expert `i` of rank `r` is expert `r × experts_per_rank + i`.
    pub fn experts_per_rank(&self) -> usize {
        self.shape.per_rank()
    }

    /// Dispatches are counted from 1; the last one sent (0: none yet).
    pub fn step(&self) -> u64 {
        self.step
    }

    fn me(&self) -> usize {
        self.comm.rank()
    }

    fn misuse(&self, call: &str, what: &str) -> Error {
        invalid(self.me(), call, what)
    }

    /// Dispatches `tokens` (`n × hidden`, row-major) to the ranks owning their experts
    /// (`topk_idx`, `n × top_k`) with their gate weights (`topk_weights`, `n × top_k`), and
    /// returns what this rank received: [`Moe::dispatch_send`] then
    /// [`PendingDispatch::recv`]. Collective: every member calls it, `n` may differ (and be
    /// 0).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] on every member, naming the rank and the problem, when a
    /// rank's input is bad: `tokens.len()` not a multiple of `hidden`, `topk_idx` or
    /// `topk_weights` not `n × top_k` long, `n > max_tokens_per_rank`, an expert index at
    /// or past `num_experts`, an expert listed twice in one token's top-k, a weight that is
    /// not finite. The rank with bad input still takes part in the exchange, marked bad, so
    /// the others fail at once. A dispatch while the last one was not combined is a local
    /// [`Error::InvalidArgument`] (nothing is sent). Otherwise as any collective.
    pub fn dispatch(&mut self, tokens: &[T], topk_idx: &[u32], topk_weights: &[f32]) -> Result<Dispatched<T>> {
        self.dispatch_send(tokens, topk_idx, topk_weights)?.recv()
    }

    /// Sends a dispatch and returns at once in [`MoeMode::LowLatency`] (the rows are in the
    /// destinations' windows; nothing waits for a peer): receive it later with
    /// [`PendingDispatch::recv`], e.g. after running the experts of another micro-batch's
    /// [`Moe`] object. In [`MoeMode::Throughput`] the whole exchange runs here (two
    /// collectives) and `recv` only hands over the result.
    ///
    /// Every rank must make its sends (`dispatch_send`, `combine_send`, and the blocking
    /// forms) of all its `Moe` objects on one fabric in the same order. Errors as
    /// [`Moe::dispatch`].
    pub fn dispatch_send<'a>(&'a mut self, tokens: &[T], topk_idx: &[u32], topk_weights: &[f32]) -> Result<PendingDispatch<'a, 'c, T>> {
        match self.state {
            State::Idle => {}
            State::Broken => return Err(self.misuse("dispatch", "an earlier step of this object failed; make a new one")),
            _ => {
                return Err(self.misuse("dispatch", "the last dispatch was not received and combined yet (dispatch and combine alternate)"))
            }
        }
        self.step += 1;
        let checked = route::check_dispatch(&self.shape, tokens.len(), topk_idx, topk_weights);
        let ready = match self.mode {
            MoeMode::Throughput => match self.throughput_dispatch(checked, tokens, topk_idx, topk_weights) {
                Ok(Ok(d)) => Some(d),
                Ok(Err(e)) => {
                    self.state = State::Idle;
                    return Err(e);
                }
                Err(e) => {
                    self.state = State::Broken;
                    return Err(e);
                }
            },
            MoeMode::LowLatency => {
                if let Err(e) = self.ll_dispatch_send(checked, tokens, topk_idx, topk_weights) {
                    self.state = State::Broken;
                    return Err(e);
                }
                None
            }
        };
        Ok(PendingDispatch { moe: self, ready })
    }

    /// The throughput dispatch: `Ok(Err(e))` when every member failed alike (bad input
    /// somewhere) and the object may go on, `Err(e)` when it may not.
    fn throughput_dispatch(
        &mut self,
        checked: std::result::Result<usize, Bad>,
        tokens: &[T],
        topk_idx: &[u32],
        topk_weights: &[f32],
    ) -> Result<Result<Dispatched<T>>> {
        let (me, size, shape, step) = (self.me(), self.comm.size(), self.shape, self.step);
        let n = *checked.as_ref().unwrap_or(&0);
        self.route_step(n, topk_idx, topk_weights);
        // Counts and statuses: 5 words per peer (bytes, status code, 3 details).
        self.send.clear();
        let mut words = vec![0u64; 5 * size];
        let mut send_counts = vec![0usize; size];
        let mut send_displs = vec![0usize; size];
        for d in 0..size {
            send_displs[d] = self.send.len();
            pack_dispatch_to(&mut self.send, step, &shape, d, &self.route, &checked, tokens);
            send_counts[d] = self.send.len() - send_displs[d];
            words[5 * d] = send_counts[d] as u64;
            if let Err(b) = &checked {
                words[5 * d + 1..5 * d + 5].copy_from_slice(&b.words());
            }
        }
        let mut got = vec![0u64; 5 * size];
        self.comm.alltoall(&words, &mut got)?;
        if let Err(b) = checked {
            return Ok(Err(invalid(me, "dispatch", b)));
        }
        let mut bad = Vec::new();
        for s in 0..size {
            let w = [got[5 * s + 1], got[5 * s + 2], got[5 * s + 3], got[5 * s + 4]];
            match Bad::from_words(w) {
                Ok(None) => {}
                Ok(Some(b)) => bad.push(format!("rank {s}'s input is bad: {b}")),
                Err(c) => bad.push(format!("rank {s} sent unknown status {c}")),
            }
        }
        if !bad.is_empty() {
            return Ok(Err(invalid(me, "dispatch", bad.join("; "))));
        }
        let recv_counts: Vec<usize> = (0..size).map(|s| got[5 * s] as usize).collect();
        let mut recv_displs = vec![0usize; size];
        let mut total = 0usize;
        for s in 0..size {
            recv_displs[s] = total;
            total = total.checked_add(recv_counts[s]).ok_or_else(|| invalid(me, "dispatch", "received sizes overflow"))?;
        }
        if self.recv.len() < total {
            self.recv.resize(total, 0);
        }
        self.comm.alltoallv(&self.send, &send_counts, &send_displs, &mut self.recv[..total], &recv_counts, &recv_displs)?;
        self.recv_at = (0..size).map(|s| (recv_displs[s], recv_counts[s])).collect();
        self.finish_dispatch(step, n).map(Ok)
    }

    /// Parses the dispatch messages of every source (`recv_at`, see
    /// [`Moe::with_received`]), checks their headers, groups the rows; the object goes to
    /// `Dispatched`.
    fn finish_dispatch(&mut self, seq: u64, n: usize) -> Result<Dispatched<T>> {
        self.with_received(Which::Dispatch, |moe, bytes| moe.finish_dispatch_in(bytes, seq, n))
    }

    fn finish_dispatch_in(&mut self, recv: &[u8], seq: u64, n: usize) -> Result<Dispatched<T>> {
        let (me, shape) = (self.me(), self.shape);
        let rb = shape.row_bytes::<T>();
        let mut received = Vec::with_capacity(self.recv_at.len());
        let mut bad = Vec::new();
        for (s, &at) in self.recv_at.iter().enumerate() {
            let Some((msg, h)) = message(recv, at, s, me, Kind::Dispatch, &mut bad)? else { continue };
            if h.seq != seq {
                return Err(invalid(
                    me,
                    "dispatch",
                    format!("rank {s}'s message is of step {}, not {seq} (signals used elsewhere?)", h.seq),
                ));
            }
            if h.count > shape.max_tokens {
                return Err(invalid(me, "dispatch", format!("rank {s} sent {} rows, above max_tokens_per_rank", h.count)));
            }
            let r = route::split_dispatch(&shape, rb, h.count, &msg[HEADER_BYTES..])
                .ok_or_else(|| invalid(me, "dispatch", format!("rank {s}'s message is shorter than its {} rows", h.count)))?;
            received.push(r);
        }
        if !bad.is_empty() {
            return Err(invalid(me, "dispatch", bad.join("; ")));
        }
        let (tokens, expert_offsets) =
            route::group_into::<T>(&shape, &received, &mut self.groups).map_err(|e| invalid(me, "dispatch", e))?;
        let rows = expert_offsets.last().copied().unwrap_or(0);
        self.last_recv.clone_from(&self.groups.counts);
        for (d, c) in self.last_sent.iter_mut().enumerate() {
            *c = self.route.tokens.get(d).map_or(0, Vec::len);
        }
        self.state = State::Dispatched;
        Ok(Dispatched { tokens, expert_offsets, handle: MoeHandle { object: self.object, step: self.step, n, rows } })
    }

    /// Routes this step's `n` checked tokens (none when the input was bad) into `route`
    /// and keeps their top-k weights.
    fn route_step(&mut self, n: usize, topk_idx: &[u32], topk_weights: &[f32]) {
        route::route_into(&self.shape, n, topk_idx, topk_weights, &mut self.route);
        self.weights.clear();
        self.weights.extend_from_slice(&topk_weights[..n * self.shape.top_k]);
        self.live.clear();
        self.live.extend(topk_idx[..n * self.shape.top_k].iter().map(|&e| e != MASKED));
    }

    /// The low-latency dispatch's sending half: every destination's region gets a message
    /// (zero rows, or a bad status, included). Where this rank maps the destination's
    /// window (and for its own), the header and metadata are packed here and the rows copied
    /// from `tokens` straight into the window; the others get the whole message packed
    /// here and written in one job.
    fn ll_dispatch_send(
        &mut self,
        checked: std::result::Result<usize, Bad>,
        tokens: &[T],
        topk_idx: &[u32],
        topk_weights: &[f32],
    ) -> Result<()> {
        let (me, size, shape) = (self.me(), self.comm.size(), self.shape);
        let n = *checked.as_ref().unwrap_or(&0);
        self.route_step(n, topk_idx, topk_weights);
        let ll = windows(&self.ll, me)?;
        let seq = self.signals.next();
        let h = shape.hidden;
        let at = me * ll.dregion;
        let mut head = std::mem::take(&mut self.head);
        self.send.clear();
        let mut items = Vec::new();
        for d in (0..size).filter(|&d| d != me).chain([me]) {
            head.clear();
            match &checked {
                Ok(_) => route::pack_dispatch_head(&mut head, seq, self.route.tokens[d].len(), &self.route.meta[d]),
                Err(b) => route::pack_header(&mut head, Kind::Dispatch, seq, 0, Some(b)),
            }
            let list: &[u32] = &self.route.tokens[d];
            let parts = std::iter::once((at, &head[..])).chain(row_parts(list, tokens, h, at + head.len()));
            if d == me {
                for (off, bytes) in parts {
                    ll.dispatch.write(off, bytes)?;
                }
            } else if !self.signals.put_parts(self.comm, Which::Dispatch, d, parts, seq)? {
                let start = self.send.len();
                self.send.extend_from_slice(&head);
                for (_, bytes) in row_parts(list, tokens, h, 0) {
                    self.send.extend_from_slice(bytes);
                }
                items.push((d, ll.peers[d].0, at, start..self.send.len()));
            }
        }
        self.head = head;
        self.signals.put_many(self.comm, Which::Dispatch, &items, &self.send, seq)?;
        if let Err(b) = checked {
            // The peers' writes of this step into this rank's window land before it returns
            // (and may drop the object): none is left in flight.
            self.ll_drain(Which::Dispatch, seq)?;
            return Err(invalid(me, "dispatch", b));
        }
        self.state = State::DispatchSent { seq, n };
        Ok(())
    }

    /// Points `recv_at` at each source's message in this rank's dispatch window (`bytes`,
    /// its contents, `region` bytes per source; every peer's signal of this step seen):
    /// read in place (see [`Moe::with_received`]), not copied out.
    fn ll_point_at(&mut self, bytes: &[u8], region: usize) {
        self.recv_at.clear();
        let size = self.comm.size();
        for s in 0..size {
            let head = bytes.get(s * region..s * region + HEADER_BYTES).unwrap_or(&[]);
            let count = route::parse_header(head, Kind::Dispatch).map(|h| if h.bad.is_some() { 0 } else { h.count }).unwrap_or(0);
            let len = self.shape.dispatch_bytes::<T>(count).filter(|&l| l <= region).unwrap_or(HEADER_BYTES);
            self.recv_at.push((s * region, len));
        }
    }

    /// Runs `f` on the bytes this step's `recv_at` points into: `recv` (throughput mode),
    /// or this rank's `which` window itself (low latency: its messages are parsed where
    /// the peers wrote them, a copy of every received row saved; the window's range lock
    /// is held while `f` runs, and no peer writes the window again before this rank's
    /// next send).
    fn with_received<R>(&mut self, which: Which, f: impl FnOnce(&mut Self, &[u8]) -> Result<R>) -> Result<R> {
        match self.mode {
            MoeMode::Throughput => {
                let recv = std::mem::take(&mut self.recv);
                let r = f(self, &recv);
                self.recv = recv;
                r
            }
            MoeMode::LowLatency => {
                let ll = self.ll.take().ok_or_else(|| no_windows(self.me()))?;
                let r = ll.window(which).with_bytes(|bytes| f(self, bytes));
                self.ll = Some(ll);
                r?
            }
        }
    }

    /// Sends the gate-weighted sums of `expert_out` (the rows of [`Dispatched::tokens`]
    /// after the local experts, same order) back to the tokens' origins and writes each
    /// token's `Σ_k w_k · y_{e_k}` into `out` (`n × hidden`, the dispatch's token order):
    /// [`Moe::combine_send`] then [`PendingCombine::recv`]. Collective.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] on every member, naming the rank and the problem, when
    /// `expert_out.len()` is not [`MoeHandle::num_rows`] × hidden, `out.len()` is not
    /// [`MoeHandle::num_tokens`] × hidden, or `handle` is not this object's last
    /// dispatch's. A combine without a received dispatch before it is a local
    /// [`Error::InvalidArgument`] (nothing is sent). Otherwise as any collective.
    pub fn combine(&mut self, expert_out: &[T], handle: &MoeHandle, out: &mut [T]) -> Result<()> {
        self.combine_send_checked(expert_out, handle, Some(out.len()))?.recv(out)
    }

    /// Sends a combine and returns at once in [`MoeMode::LowLatency`]; receive it with
    /// [`PendingCombine::recv`]. In [`MoeMode::Throughput`] the exchange runs here and
    /// `recv` only sums. `out`'s length is checked by `recv`, on this rank only (the
    /// blocking [`Moe::combine`] checks it before sending, on every rank). Errors as
    /// [`Moe::combine`]; the send order rule of [`Moe::dispatch_send`] applies.
    pub fn combine_send<'a>(&'a mut self, expert_out: &[T], handle: &'a MoeHandle) -> Result<PendingCombine<'a, 'c, T>> {
        self.combine_send_checked(expert_out, handle, None)
    }

    fn combine_send_checked<'a>(
        &'a mut self,
        expert_out: &[T],
        handle: &'a MoeHandle,
        out_len: Option<usize>,
    ) -> Result<PendingCombine<'a, 'c, T>> {
        match self.state {
            State::Dispatched => {}
            State::Broken => return Err(self.misuse("combine", "an earlier step of this object failed; make a new one")),
            _ => return Err(self.misuse("combine", "no received dispatch to combine (dispatch and combine alternate)")),
        }
        let (me, h) = (self.me(), self.shape.hidden);
        let bad = if handle.object != self.object || handle.step != self.step {
            Some(Bad::Handle)
        } else if expert_out.len() != handle.rows * h {
            Some(Bad::ExpertOutLen { len: expert_out.len() as u64, want: (handle.rows * h) as u64 })
        } else {
            out_len.filter(|&l| l != handle.n * h).map(|l| Bad::OutLen { len: l as u64, want: (handle.n * h) as u64 })
        };
        let sent = match self.mode {
            MoeMode::Throughput => self.throughput_combine(bad.as_ref(), expert_out),
            MoeMode::LowLatency => {
                let seq = self.signals.next();
                self.ll_combine_send(seq, bad.as_ref(), expert_out).map(|()| seq)
            }
        };
        let seq = match sent {
            Ok(seq) => seq,
            Err(e) => {
                self.state = State::Broken;
                return Err(e);
            }
        };
        if let Some(b) = bad {
            // Throughput: every rank saw the status and fails alike, the object goes on.
            // Low latency: the peers' writes of this step land before this rank returns.
            self.state = match self.mode {
                MoeMode::Throughput => State::Idle,
                MoeMode::LowLatency => {
                    self.state = State::Broken;
                    self.ll_drain(Which::Combine, seq)?;
                    State::Broken
                }
            };
            return Err(invalid(me, "combine", b));
        }
        self.state = State::CombineSent { seq };
        Ok(PendingCombine { moe: self, handle })
    }

    /// Waits for every peer's signal `seq`: its write of this step into this rank's
    /// window has landed (a rank that failed on its own input waits so before returning,
    /// so that no write is left in flight into windows it may drop).
    fn ll_drain(&self, which: Which, seq: u64) -> Result<()> {
        let w = windows(&self.ll, self.me())?.window(which);
        self.signals.wait_all(self.comm, w, which, seq)
    }

    /// The throughput combine's exchange: one message per source rank, its rows' partial
    /// sums (zeros, with the status, when `bad`), by `alltoallv`; `recv_at` then points at
    /// each destination's message in `recv`. Returns the step (the messages' sequence).
    fn throughput_combine(&mut self, bad: Option<&Bad>, expert_out: &[T]) -> Result<u64> {
        let (size, shape, seq) = (self.comm.size(), self.shape, self.step);
        let h = shape.hidden;
        // Message sizes come from this object's last dispatch, not from the handle (which
        // may be another object's: then the peers learn of it by the status).
        self.send.clear();
        let mut send_counts = vec![0usize; size];
        let mut send_displs = vec![0usize; size];
        let mut row = 0usize;
        let zero = vec![T::from_f32(0.0); h];
        for s in 0..size {
            send_displs[s] = self.send.len();
            let c = self.last_recv.get(s).copied().unwrap_or(0);
            route::pack_header(&mut self.send, Kind::Combine, seq, c, bad);
            match bad {
                Some(_) => (0..c).for_each(|_| self.send.extend_from_slice(ferroccl_kernels::as_bytes(&zero))),
                None => route::partial_sums(h, expert_out, &self.groups.slots, &self.groups.slot_at, row..row + c, &mut self.send),
            }
            row += c;
            send_counts[s] = self.send.len() - send_displs[s];
        }
        let recv_counts: Vec<usize> = self.last_sent.iter().map(|&c| HEADER_BYTES + c * shape.row_bytes::<T>()).collect();
        let recv_displs: Vec<usize> = recv_counts.iter().scan(0, |at, &c| Some(std::mem::replace(at, *at + c))).collect();
        let total = recv_counts.iter().sum();
        if self.recv.len() < total {
            self.recv.resize(total, 0);
        }
        self.comm.alltoallv(&self.send, &send_counts, &send_displs, &mut self.recv[..total], &recv_counts, &recv_displs)?;
        self.recv_at = (0..size).map(|d| (recv_displs[d], recv_counts.get(d).copied().unwrap_or(0))).collect();
        Ok(seq)
    }

    /// The low-latency combine's sending half: to each source rank, a header (at this
    /// rank's place in the header area of its combine window: the number of rows, or a
    /// bad status) and, unless `bad`, each of its tokens' expert outputs computed here,
    /// unweighted, copied from `expert_out` into the row of its (token, top-k slot) there:
    /// the origin weights and sums them. Mapped windows get the pieces directly; the
    /// others get them staged here and written in one job (one signal per rank, after its
    /// last piece).
    fn ll_combine_send(&mut self, seq: u64, bad: Option<&Bad>, expert_out: &[T]) -> Result<()> {
        let (me, size, shape) = (self.me(), self.comm.size(), self.shape);
        let ll = windows(&self.ll, me)?;
        let (h, at) = (shape.hidden, me * HEADER_BYTES);
        let broken = || Error::internal(format!("rank {me}: moe combine: a handle without the slots of its rows"));
        let mut head = std::mem::take(&mut self.head);
        self.send.clear();
        let mut items = Vec::new();
        let mut row = 0usize;
        for s in 0..size {
            let c = self.last_recv.get(s).copied().unwrap_or(0);
            let slots = match bad {
                Some(_) => 0..0,
                None => *self.groups.slot_at.get(row).ok_or_else(broken)?..*self.groups.slot_at.get(row + c).ok_or_else(broken)?,
            };
            row += c;
            head.clear();
            route::pack_header(&mut head, Kind::Combine, seq, slots.len(), bad);
            let pieces = std::iter::once((at, &head[..])).chain(slot_parts(&self.groups, slots.clone(), expert_out, h, ll.crows));
            if s == me {
                for (off, bytes) in pieces {
                    ll.combine.write(off, bytes)?;
                }
            } else if !self.signals.put_parts(self.comm, Which::Combine, s, pieces, seq)? {
                let peer = ll.peers[s].1;
                for (off, bytes) in std::iter::once((at, &head[..])).chain(slot_parts(&self.groups, slots, expert_out, h, ll.crows)) {
                    let start = self.send.len();
                    self.send.extend_from_slice(bytes);
                    items.push((s, peer, off, start..self.send.len()));
                }
            }
        }
        self.head = head;
        self.signals.put_many(self.comm, Which::Combine, &items, &self.send, seq)
    }

    /// The low-latency combine's receiving half: waits for every rank's signal `seq`, checks
    /// each one's header (the rows it wrote: as many as this rank's (token, slot) pairs on
    /// it), then sums each token's rows in top-k order, weighted, into `out`. `Ok(bad)`:
    /// the ranks whose input was bad.
    fn ll_combine_recv(&mut self, seq: u64, handle: &MoeHandle, out: &mut [T]) -> Result<Vec<String>> {
        let (me, size, shape) = (self.me(), self.comm.size(), self.shape);
        let ll = windows(&self.ll, me)?;
        self.signals.wait_all(self.comm, &ll.combine, Which::Combine, seq)?;
        let (h, k, rb) = (shape.hidden, shape.top_k, shape.row_bytes::<T>());
        let (n, crows) = (handle.n, ll.crows);
        ll.combine.with_bytes(|bytes| {
            let mut bad = Vec::new();
            for d in 0..size {
                let Some((_, hd)) = message(bytes, (d * HEADER_BYTES, HEADER_BYTES), d, me, Kind::Combine, &mut bad)? else { continue };
                let want = self.route.slots.get(d).copied().unwrap_or(0);
                if hd.seq != seq || hd.count != want {
                    return Err(invalid(
                        me,
                        "combine",
                        format!("rank {d} sent {} rows of step {}, want {want} of step {seq} (signals used elsewhere?)", hd.count, hd.seq),
                    ));
                }
            }
            if bad.is_empty() && out.len() == n * h {
                let rows = bytes
                    .get(crows..crows + n * k * rb)
                    .ok_or_else(|| Error::internal(format!("rank {me}: moe combine: {n} tokens past the combine window")))?;
                route::sum_slots::<T>(h, k, rows, (&self.weights, &self.live), out);
            }
            Ok(bad)
        })?
    }
}

/// The pieces of a low-latency combine to one origin: for each slot in `slots` (of
/// `handle`), its expert output row of `expert_out` and the byte offset of its (token,
/// top-k slot) row in the origin's combine window (rows from `crows`).
fn slot_parts<'t, T: MoeFloat>(
    g: &'t Groups,
    slots: std::ops::Range<usize>,
    expert_out: &'t [T],
    hidden: usize,
    crows: usize,
) -> impl Iterator<Item = (usize, &'t [u8])> + 't {
    let rb = hidden * std::mem::size_of::<T>();
    slots.map(move |i| {
        let at = g.slots[i].0 as usize;
        (crows + g.places[i] as usize * rb, ferroccl_kernels::as_bytes(&expert_out[at * hidden..(at + 1) * hidden]))
    })
}

impl<T: MoeFloat> PendingDispatch<'_, '_, T> {
    /// Waits for every rank's rows (low latency: each peer's signal, then its region of
    /// this rank's window) and returns them grouped by local expert. Errors as
    /// [`Moe::dispatch`]; after an error the object is unusable in low-latency mode.
    pub fn recv(self) -> Result<Dispatched<T>> {
        let moe = self.moe;
        if let Some(d) = self.ready {
            return Ok(d);
        }
        let (seq, n) = match std::mem::replace(&mut moe.state, State::Broken) {
            State::DispatchSent { seq, n } => (seq, n),
            _ => return Err(Error::internal(format!("rank {}: moe dispatch: a pending dispatch in another state", moe.me()))),
        };
        moe.ll_drain(Which::Dispatch, seq)?;
        let region = windows(&moe.ll, moe.me())?.dregion;
        moe.with_received(Which::Dispatch, |moe, bytes| {
            moe.ll_point_at(bytes, region);
            moe.finish_dispatch_in(bytes, seq, n)
        })
    }
}

impl<T: MoeFloat> PendingCombine<'_, '_, T> {
    /// Waits for every rank's partial sums (low latency: each peer's signal, then its
    /// region of this rank's combine window) and writes each token's sum into `out`
    /// (`n × hidden`, the dispatch's token order). Errors as [`Moe::combine`]; a wrong
    /// `out` length is found here, on this rank only.
    pub fn recv(self, out: &mut [T]) -> Result<()> {
        let (moe, handle) = (self.moe, self.handle);
        let me = moe.me();
        let seq = match std::mem::replace(&mut moe.state, State::Broken) {
            State::CombineSent { seq } => seq,
            _ => return Err(Error::internal(format!("rank {me}: moe combine: a pending combine in another state"))),
        };
        let want_len = handle.n * moe.shape.hidden;
        let bad = match moe.mode {
            MoeMode::LowLatency => moe.ll_combine_recv(seq, handle, out)?,
            MoeMode::Throughput => moe.throughput_combine_recv(seq, handle, out)?,
        };
        if !bad.is_empty() {
            // Throughput: every rank saw the status and fails alike, the object goes on.
            if moe.mode == MoeMode::Throughput {
                moe.state = State::Idle;
            }
            return Err(invalid(me, "combine", bad.join("; ")));
        }
        moe.state = State::Idle;
        if out.len() != want_len {
            return Err(invalid(me, "combine", Bad::OutLen { len: out.len() as u64, want: want_len as u64 }));
        }
        Ok(())
    }
}

impl<T: MoeFloat> Moe<'_, T> {
    /// The throughput combine's receiving half: checks each destination's message in
    /// `recv` and sums the rows of each token into `out` (see [`route::sum_rows`]).
    /// `Ok(bad)`: the ranks whose input was bad.
    fn throughput_combine_recv(&mut self, seq: u64, handle: &MoeHandle, out: &mut [T]) -> Result<Vec<String>> {
        let me = self.me();
        let (h, rb) = (self.shape.hidden, self.shape.row_bytes::<T>());
        let want_len = handle.n * h;
        self.with_received(Which::Combine, |moe, recv| {
            let mut bad = Vec::new();
            let mut rows: Vec<&[u8]> = Vec::with_capacity(moe.recv_at.len());
            for (d, &at) in moe.recv_at.iter().enumerate() {
                let Some((msg, hd)) = message(recv, at, d, me, Kind::Combine, &mut bad)? else {
                    rows.push(&[]);
                    continue;
                };
                let want = moe.route.tokens.get(d).map_or(0, Vec::len);
                if hd.seq != seq || hd.count != want || msg.len() < HEADER_BYTES + want * rb {
                    return Err(invalid(
                        me,
                        "combine",
                        format!("rank {d} sent {} rows of step {}, want {want} of step {seq} (signals used elsewhere?)", hd.count, hd.seq),
                    ));
                }
                rows.push(&msg[HEADER_BYTES..HEADER_BYTES + want * rb]);
            }
            if bad.is_empty() && out.len() == want_len {
                route::sum_rows::<T>(h, &moe.route.tokens, &rows, &mut moe.order, out);
            }
            Ok(bad)
        })
    }
}

/// Appends the dispatch message for destination `d`: its rows and metadata, or a header
/// alone with this rank's bad-input status.
fn pack_dispatch_to<T: MoeFloat>(
    out: &mut Vec<u8>,
    seq: u64,
    shape: &Shape,
    d: usize,
    routed: &Route,
    checked: &std::result::Result<usize, Bad>,
    tokens: &[T],
) {
    match checked {
        Ok(_) => route::pack_dispatch(out, seq, shape.hidden, &routed.tokens[d], &routed.meta[d], tokens),
        Err(b) => route::pack_header(out, Kind::Dispatch, seq, 0, Some(b)),
    }
}

/// The rows of `tokens` (`hidden` elements each) named by `list`, as (byte offset, bytes)
/// pieces of a message whose rows start at `base`.
fn row_parts<'t, T: MoeFloat>(
    list: &'t [u32],
    tokens: &'t [T],
    hidden: usize,
    base: usize,
) -> impl Iterator<Item = (usize, &'t [u8])> + 't {
    let rb = hidden * std::mem::size_of::<T>();
    list.iter()
        .enumerate()
        .map(move |(i, &t)| (base + i * rb, ferroccl_kernels::as_bytes(&tokens[t as usize * hidden..(t as usize + 1) * hidden])))
}

/// A low-latency object's windows (an internal error for a throughput object); a free
/// function over the field, so that the other fields stay borrowable.
fn windows(ll: &Option<Ll>, me: usize) -> Result<&Ll> {
    ll.as_ref().ok_or_else(|| no_windows(me))
}

fn no_windows(me: usize) -> Error {
    Error::internal(format!("rank {me}: moe: a low-latency object without windows"))
}

/// Source `s`'s message at `(at, len)` of `recv` and its header; a source whose input was
/// bad is added to `bad` and gives `None`.
fn message<'b>(
    recv: &'b [u8],
    (at, len): (usize, usize),
    s: usize,
    me: usize,
    kind: Kind,
    bad: &mut Vec<String>,
) -> Result<Option<(&'b [u8], route::Header)>> {
    let call = match kind {
        Kind::Dispatch => "dispatch",
        Kind::Combine => "combine",
    };
    let msg =
        recv.get(at..at + len).ok_or_else(|| Error::internal(format!("rank {me}: moe {call}: message {s} past the received bytes")))?;
    let h = route::parse_header(msg, kind).map_err(|e| invalid(me, call, format!("from rank {s}: {e}")))?;
    if let Some(b) = h.bad {
        bad.push(format!("rank {s}'s input is bad: {b}"));
        return Ok(None);
    }
    Ok(Some((msg, h)))
}
