//! M->N weight sync: a [`RoutingTable`] replayed every sync over one-sided transfer plans
//! (issue 13; see `docs/reshard.md`).
//!
//! Every member of a communicator calls [`Communicator::weight_sync`] with the same two
//! layouts and the two groups' ranks. Once, at setup: every rank computes the routing
//! table itself (no communication); a **source** rank allocates its local buffer as a
//! window ([`Communicator::alloc_window`]: same-host readers copy it directly); a
//! **destination** rank allocates two buffers (front: the last complete version; back: the
//! one being filled) and builds one [`TransferPlan`](crate::TransferPlan) of reads of its
//! pieces per buffer (a column shard is one strided read); the sources' handles are
//! exchanged in one allgather, with a fingerprint of each member's arguments (members that
//! passed other layouts or groups are named in an error on every member, before any
//! transfer). Nothing is allocated, registered or exchanged per sync after that: a sync runs
//! plans and signal waits prepared at setup (`tests/weights_hot_path.rs`).
//!
//! Each sync of version `v` (strictly increasing, from 1):
//!
//! * a source writes the version into its buffer ([`WeightSync::with_buffer_mut`],
//!   [`WeightSync::with_tensor_mut`], which first wait until the destinations it feeds
//!   have pulled the last published version), then [`WeightSync::publish`]es it: its signal
//!   at every destination it feeds rises to `v`;
//! * a destination [`WeightSync::pull`]s it: it waits until every sender's signal has
//!   risen past the version it holds and checks that it is `v`, runs its plan into the
//!   back buffer, raises its signal at every sender to `v` (the acknowledgement that
//!   [`WeightSync::wait_consumed`] waits for), and only then makes the back buffer the
//!   front one. [`WeightSync::with_current`] and [`WeightSync::with_tensor`] read the front.
//!
//! A source never writes its buffer while a destination may still read the previous
//! version, and a destination never shows a buffer it has not finished reading: a pull that
//! fails (a sender dead, a deadline, a refusal) returns the error and leaves the front
//! buffer and its version as they were, so a reader never sees a torn version.
//!
//! ```no_run
//! use ferroccl::reshard::{ModelLayout, Placement, TensorLayout};
//! use ferroccl::{Communicator, DType, WeightRole};
//!
//! # fn sync(comm: &Communicator) -> ferroccl::Result<()> {
//! // Members 0 and 1 train (row shards), members 2, 3 and 4 serve (column shards).
//! let w = |p| TensorLayout::new("layer0.weight", DType::Bf16, [1024, 768], p);
//! let src = ModelLayout::new(2, vec![w(Placement::rows(&[512, 512]))]).expect("layout");
//! let dst = ModelLayout::new(3, vec![w(Placement::cols(&[256; 3]))]).expect("layout");
//! let mut ws = comm.weight_sync(&src, &[0, 1], &dst, &[2, 3, 4])?; // once
//! for version in 1..=10 {
//!     match ws.role() {
//!         WeightRole::Source(_) => {
//!             ws.with_tensor_mut("layer0.weight", |block| block.fill(version as u8))?;
//!             ws.publish(version)?;
//!         }
//!         WeightRole::Destination(_) => {
//!             ws.pull(version)?;
//!             ws.with_tensor("layer0.weight", |v, block| assert!(v == version && block[0] == version as u8))?;
//!         }
//!         WeightRole::None => {}
//!     }
//! }
//! # Ok(())
//! # }
//! ```
//!
//! Signals are one value per pair of ranks and slot (a signal from one rank at another only
//! rises). A weight sync agrees on a slot of its own at setup, so neither the public
//! signals ([`Communicator::signal`]) nor another sync (or MoE layer) between the same
//! ranks can pass for its versions; it also starts its versions above every signal any
//! member had seen on that slot at setup.

use std::collections::BTreeSet;

use ferroccl_kernels::{DType, Element};

use crate::comm::Communicator;
use crate::error::{Error, Op, Result};
use crate::reshard::{Fingerprint, ModelLayout, RoutingTable};
use crate::transfer::{OwnedPlan, Strided};
use crate::window::{RemoteHandle, Window};

/// What a member does in a [`WeightSync`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightRole {
    /// Rank `i` of the source (trainer) group.
    Source(usize),
    /// Rank `j` of the destination (inference) group.
    Destination(usize),
    /// In neither group: it took part in the setup only.
    None,
}

/// Where a tensor lies in a rank's local buffer: (name, first byte, bytes, element type).
type TensorSpan = (String, usize, usize, DType);

/// A member's side of an M->N weight sync; see the [module documentation](self).
#[derive(Debug)]
pub struct WeightSync<'c> {
    comm: &'c Communicator,
    table: RoutingTable,
    /// Added to every version on the wire: above every signal seen at setup.
    base: u64,
    /// The sync's own signal slot (agreed at setup).
    slot: u32,
    role: Role,
}

#[derive(Debug)]
enum Role {
    None,
    Source(Box<Source>),
    Destination(Box<Destination>),
}

#[derive(Debug)]
struct Source {
    index: usize,
    window: Window<'static>,
    len: usize,
    tensors: Vec<TensorSpan>,
    /// Raises this rank's signal at every destination (no transfer); `None` without any.
    publish: Option<OwnedPlan>,
    /// Waits for every destination's signal (their acknowledgements); `None` without any.
    acks: Option<OwnedPlan>,
    /// The last version published (0: none).
    published: u64,
    /// The last version every destination acknowledged.
    consumed: u64,
}

#[derive(Debug)]
struct Destination {
    index: usize,
    buffers: [Window<'static>; 2],
    len: usize,
    tensors: Vec<TensorSpan>,
    /// Communicator ranks of the sources this rank reads from.
    senders: Vec<usize>,
    /// The reads into `buffers[b]`; `None` when nothing comes to this rank.
    plans: [Option<OwnedPlan>; 2],
    /// Raises this rank's signal at every sender (the acknowledgement).
    ack: Option<OwnedPlan>,
    /// Waits for every sender's signal (their next version); `None` without any.
    published: Option<OwnedPlan>,
    /// Which buffer is the front one.
    front: usize,
    /// The version in the front buffer (0: none yet).
    version: u64,
}

/// Bytes each member contributes to the setup's allgather: a status byte (0: no window,
/// 1: a source's handle follows, 2: allocating failed here, 3: this member rejected its
/// arguments), the highest signal this member has
/// seen (u64, little endian), the fingerprint of its arguments (u64, little endian, see
/// [`fingerprint`]), a handle.
const SETUP_BYTES: usize = 1 + 8 + 8 + RemoteHandle::BYTES;
/// Where the handle starts in a member's setup bytes.
const HANDLE_AT: usize = 17;

/// The fingerprint of a weight sync's arguments: both layouts
/// ([`ModelLayout::fingerprint`]'s encoding) and both groups, so that members can check at
/// setup that they passed the same ones.
fn fingerprint(src: &ModelLayout, src_ranks: &[usize], dst: &ModelLayout, dst_ranks: &[usize]) -> u64 {
    let mut h = Fingerprint::new();
    h.bytes(b"ferroccl.weight_sync.v1");
    for (layout, ranks) in [(src, src_ranks), (dst, dst_ranks)] {
        layout.hash_into(&mut h);
        h.usize(ranks.len());
        for &r in ranks {
            h.usize(r);
        }
    }
    h.finish()
}

/// The members whose fingerprint differs from the one most members have (ties: the one of
/// the lowest member), as an error naming them; `None` when all agree.
#[cfg(test)]
fn disagreement(me: usize, prints: &[u64]) -> Option<Error> {
    disagreeing(prints).map(|(which, _, _)| invalid(me, which))
}

/// What [`disagreement`] says, the reference member and the odd ones.
fn disagreeing(prints: &[u64]) -> Option<(String, usize, Vec<usize>)> {
    let count = |f: u64| prints.iter().filter(|&&g| g == f).count();
    // The first member holding the most common fingerprint (the first one wins ties).
    let mut reference = 0;
    for (m, &f) in prints.iter().enumerate() {
        if count(f) > count(prints[reference]) {
            reference = m;
        }
    }
    let want = prints[reference];
    let odd: Vec<usize> = (0..prints.len()).filter(|&m| prints[m] != want).collect();
    let (&first, rest) = odd.split_first()?;
    let which = match rest.len() {
        0 => format!("member {first} passed other layouts or groups than member {reference} (fingerprint {:#018x}, member {reference}'s {want:#018x})", prints[first]),
        _ => {
            // At most `SHOWN` of them by name (a large communicator's message stays short).
            const SHOWN: usize = 8;
            let names: Vec<String> = odd.iter().take(SHOWN).map(|m| m.to_string()).collect();
            let values: Vec<String> = odd.iter().take(SHOWN).map(|&m| format!("{:#018x}", prints[m])).collect();
            let more = match odd.len().saturating_sub(SHOWN) {
                0 => String::new(),
                n => format!(" and {n} more"),
            };
            format!(
                "members {}{more} passed other layouts or groups than member {reference} (fingerprints {}, member {reference}'s {want:#018x})",
                names.join(", "),
                values.join(", ")
            )
        }
    };
    Some((which, reference, odd))
}

/// A weight sync's arguments as `key\tvalue` lines, in a fixed order: both groups, and per
/// layout its ranks, alignment, tensor names, and each tensor's dtype, shape and every
/// rank's resolved block (what [`fingerprint`] hashes), so that members whose fingerprints
/// differ can say what differs.
fn describe(src: &ModelLayout, src_ranks: &[usize], dst: &ModelLayout, dst_ranks: &[usize]) -> String {
    use std::fmt::Write as _;
    let mut d = String::new();
    for (side, layout, ranks) in [("source", src, src_ranks), ("destination", dst, dst_ranks)] {
        let _ = writeln!(d, "{side} group (members)\t{ranks:?}");
        let _ = writeln!(d, "{side} layout's ranks\t{}", layout.ranks());
        let _ = writeln!(d, "{side} layout's alignment\t{}", layout.align());
        let names: Vec<String> = layout.tensors().iter().map(|t| format!("`{}`", t.name())).collect();
        let _ = writeln!(d, "{side} layout's tensors\t{}", names.join(", "));
        for (i, t) in layout.tensors().iter().enumerate() {
            let _ = writeln!(d, "{side} tensor `{}`'s dtype\t{}", t.name(), t.dtype());
            let _ = writeln!(d, "{side} tensor `{}`'s shape\t{:?}", t.name(), t.shape());
            let blocks: Vec<String> =
                (0..layout.ranks()).map(|r| format!("rank {r} {}", layout.block(r, i).map_or("?".into(), |b| b.to_string()))).collect();
            let _ = writeln!(d, "{side} tensor `{}`'s sharding\t{}", t.name(), blocks.join(", "));
        }
    }
    d
}

/// The lines of two [`describe`]s that differ, by key (a key only one has: "none" for the
/// other), at most `max`: "member 3's destination tensor `w`'s sharding is ..., member 0's ...".
fn describe_differences(m: usize, mine: &str, r: usize, theirs: &str, max: usize) -> Vec<String> {
    let lines = |d: &str| -> Vec<(String, String)> {
        d.lines().filter_map(|l| l.split_once('\t')).map(|(k, v)| (k.to_string(), v.to_string())).collect()
    };
    let (a, b) = (lines(mine), lines(theirs));
    let get = |l: &[(String, String)], k: &str| l.iter().find(|(key, _)| key == k).map(|(_, v)| v.clone());
    let mut keys: Vec<&String> = b.iter().map(|(k, _)| k).collect();
    keys.extend(a.iter().map(|(k, _)| k).filter(|k| !b.iter().any(|(key, _)| key == *k)));
    keys.into_iter()
        .filter_map(|k| {
            let (x, y) = (get(&a, k), get(&b, k));
            (x != y)
                .then(|| format!("member {m}'s {k} is {}, member {r}'s {}", x.as_deref().unwrap_or("none"), y.as_deref().unwrap_or("none")))
        })
        .take(max)
        .collect()
}

fn invalid(me: usize, what: String) -> Error {
    Error::invalid(format!("rank {me}: weight_sync: {what}"))
}

/// The tensors of `rank`'s buffer in `layout`.
fn spans(layout: &ModelLayout, rank: usize) -> Vec<TensorSpan> {
    layout
        .tensors()
        .iter()
        .enumerate()
        .map(|(t, tl)| {
            let off = layout.offset(rank, t).unwrap_or(0);
            let len = layout.block(rank, t).map_or(0, |b| b.rows * b.cols * tl.dtype().size());
            (tl.name().to_string(), off, len, tl.dtype())
        })
        .collect()
}

/// Checks one group's ranks: as many as its layout has, in range, unique.
fn check_group(me: usize, size: usize, side: &str, ranks: &[usize], layout: &ModelLayout) -> Result<()> {
    if ranks.len() != layout.ranks() {
        return Err(invalid(me, format!("{} {side} ranks given, the {side} layout has {}", ranks.len(), layout.ranks())));
    }
    let mut seen = BTreeSet::new();
    for (i, &r) in ranks.iter().enumerate() {
        if r >= size {
            return Err(invalid(me, format!("{side} rank {i} is member {r}, out of range (communicator of {size} ranks)")));
        }
        if !seen.insert(r) {
            return Err(invalid(me, format!("member {r} is listed twice among the {side} ranks")));
        }
    }
    Ok(())
}

impl Communicator {
    /// Sets up an M->N weight sync (see the [`weights`](crate::weights) module): collective,
    /// every member calls it with the same arguments. `src_ranks[i]` is the member that is
    /// rank `i` of the `src` layout, `dst_ranks[j]` the member that is rank `j` of the `dst`
    /// layout; the groups are disjoint, and members in neither take part in the setup only.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] (on every member alike, after the setup's one allgather and
    /// before any transfer) when a group's length differs from its layout's ranks, a rank is
    /// out of range or listed twice, a member is in both groups, or the routing table cannot
    /// be computed (a [`ReshardError`](crate::reshard::ReshardError), naming the tensor): a
    /// member that finds this alone says so in the allgather, and the others fail naming
    /// it, never waiting for it; on every member,
    /// naming them, when members passed other layouts or groups than the others (the
    /// fingerprints of their arguments, [`ModelLayout::fingerprint`] and the groups, are
    /// compared in the setup's one allgather, before any transfer); on every member,
    /// naming it, when a member could not allocate its buffers; and as any collective.
    pub fn weight_sync(&self, src: &ModelLayout, src_ranks: &[usize], dst: &ModelLayout, dst_ranks: &[usize]) -> Result<WeightSync<'_>> {
        let (me, size) = (self.rank(), self.size());
        // A member whose own checks fail still takes part in the allgather (saying so), so
        // that the others fail at once too instead of waiting for it until the deadline.
        let checked = (|| {
            check_group(me, size, "source", src_ranks, src)?;
            check_group(me, size, "destination", dst_ranks, dst)?;
            if let Some(r) = src_ranks.iter().find(|r| dst_ranks.contains(r)) {
                return Err(invalid(me, format!("member {r} is in both the source and the destination group")));
            }
            RoutingTable::compute(src, dst).map_err(|e| invalid(me, e.to_string()))
        })();
        let (table, rejected) = match checked {
            Ok(t) => (Some(t), None),
            Err(e) => (None, Some(e)),
        };
        let (src_index, dst_index) = match rejected {
            Some(_) => (None, None),
            None => (src_ranks.iter().position(|&r| r == me), dst_ranks.iter().position(|&r| r == me)),
        };

        // The sync's own signal slot: no other object's (or the public) signals between
        // the same ranks can pass for its versions or acknowledgements.
        let slot = self.agree_signal_slots(1)?;
        // Buffers first, so that a failure here is reported to everyone by the allgather.
        let mut mine = [0u8; SETUP_BYTES];
        let highest = (0..size).map(|p| self.signal_value_on(p, slot)).max().unwrap_or(0);
        mine[1..9].copy_from_slice(&highest.to_le_bytes());
        mine[9..HANDLE_AT].copy_from_slice(&fingerprint(src, src_ranks, dst, dst_ranks).to_le_bytes());
        let mut failure = None;
        let mut src_window = None;
        let mut dst_windows = None;
        if let Some(i) = src_index {
            let len = src.buffer_len(i).unwrap_or(0);
            match self.alloc_window::<u8>(len.max(1)) {
                Ok(w) => {
                    mine[0] = 1;
                    mine[HANDLE_AT..].copy_from_slice(&w.handle().to_bytes());
                    src_window = Some((w, len));
                }
                Err(e) => failure = Some(e),
            }
        }
        if let Some(j) = dst_index {
            let len = dst.buffer_len(j).unwrap_or(0);
            match (self.alloc_window::<u8>(len.max(1)), self.alloc_window::<u8>(len.max(1))) {
                (Ok(a), Ok(b)) => dst_windows = Some(([a, b], len)),
                (Err(e), _) | (_, Err(e)) => failure = Some(e),
            }
        }
        if failure.is_some() {
            mine[0] = 2;
        }
        if rejected.is_some() {
            mine[0] = 3;
        }
        let mut all = vec![0u8; SETUP_BYTES * size];
        self.allgather_into(&mine, &mut all)?;
        let le = |b: &[u8]| u64::from_le_bytes(b.try_into().unwrap_or([0; 8]));
        let prints: Vec<u64> = all.chunks(SETUP_BYTES).map(|c| le(&c[9..HANDLE_AT])).collect();
        // Members whose arguments differ: every member (a rejected one too, so that nobody
        // waits for it) takes part in telling what differs.
        let mismatch = match disagreeing(&prints) {
            Some((which, reference, odd)) => {
                let mine = describe(src, src_ranks, dst, dst_ranks);
                Some(format!("{which}: {}", self.argument_differences(&mine, reference, &odd)?))
            }
            None => None,
        };
        let table = match (table, rejected) {
            (Some(t), None) => t,
            (_, Some(e)) => return Err(e),
            (None, None) => return Err(Error::internal(format!("rank {me}: weight_sync: no routing table and no error"))),
        };
        if let Some(which) = mismatch {
            return Err(invalid(me, which));
        }
        if let Some(r) = all.chunks(SETUP_BYTES).position(|c| c[0] == 3) {
            return Err(invalid(me, format!("member {r} rejected the arguments (its error says why)")));
        }
        if let Some(e) = failure {
            return Err(invalid(me, format!("allocating this rank's buffers: {e}")));
        }
        if let Some(r) = all.chunks(SETUP_BYTES).position(|c| c[0] == 2) {
            return Err(invalid(me, format!("member {r} could not allocate its buffers")));
        }
        let base = all.chunks(SETUP_BYTES).map(|c| le(&c[1..9])).max().unwrap_or(0);

        let role = if let (Some(i), Some((window, len))) = (src_index, src_window) {
            let dests: BTreeSet<usize> = table.pieces_from(i).map(|p| dst_ranks[p.dst_rank]).collect();
            let dests: Vec<usize> = dests.into_iter().collect();
            let (publish, acks) = match dests.is_empty() {
                true => (None, None),
                false => (
                    Some(dests.iter().fold(self.transfer_plan(), |b, &d| b.signal(d)).signal_slot(slot).build()?.into_owned()),
                    Some(OwnedPlan::signal_waits(
                        self,
                        &dests,
                        slot,
                        Op::other("weight sync: waiting for the destinations' acknowledgements"),
                    )?),
                ),
            };
            Role::Source(Box::new(Source { index: i, window, len, tensors: spans(src, i), publish, acks, published: 0, consumed: 0 }))
        } else if let (Some(j), Some((buffers, len))) = (dst_index, dst_windows) {
            let pieces = table.pieces_to(j);
            let mut handles = Vec::with_capacity(src_ranks.len());
            for &r in src_ranks {
                let c = &all[r * SETUP_BYTES..(r + 1) * SETUP_BYTES];
                if c[0] != 1 {
                    return Err(invalid(me, format!("member {r} sent no window handle")));
                }
                handles.push(RemoteHandle::from_bytes(&c[HANDLE_AT..])?);
            }
            let senders: BTreeSet<usize> = pieces.iter().map(|p| src_ranks[p.src_rank]).collect();
            let senders: Vec<usize> = senders.into_iter().collect();
            let plan_into = |w: &Window<'static>| -> Result<Option<OwnedPlan>> {
                if pieces.is_empty() {
                    return Ok(None);
                }
                let b = pieces.iter().fold(self.transfer_plan(), |b, p| {
                    let shape = Strided { rows: p.rows, row_len: p.row_bytes, from_stride: p.src_stride, to_stride: p.dst_stride };
                    b.read_strided::<u8>(&handles[p.src_rank], p.src_offset, w, p.dst_offset, shape)
                });
                Ok(Some(b.build()?.into_owned()))
            };
            let plans = [plan_into(&buffers[0])?, plan_into(&buffers[1])?];
            let (ack, published) = match senders.is_empty() {
                true => (None, None),
                false => (
                    Some(senders.iter().fold(self.transfer_plan(), |b, &s| b.signal(s)).signal_slot(slot).build()?.into_owned()),
                    Some(OwnedPlan::signal_waits(self, &senders, slot, Op::other("weight sync: waiting for the sources' next version"))?),
                ),
            };
            Role::Destination(Box::new(Destination {
                index: j,
                buffers,
                len,
                tensors: spans(dst, j),
                senders,
                plans,
                ack,
                published,
                front: 0,
                version: 0,
            }))
        } else {
            Role::None
        };
        Ok(WeightSync { comm: self, table, base, slot, role })
    }
}

impl Communicator {
    /// What differs between the arguments of the `odd` members and of the `reference`
    /// member (their [`describe`]s, `mine` being this member's): the reference and each of
    /// the first few odd members broadcast theirs (collective, on every member alike).
    fn argument_differences(&self, mine: &str, reference: usize, odd: &[usize]) -> Result<String> {
        const SHOWN: usize = 3;
        let share = |root: usize| -> Result<String> {
            let mut len = [if self.rank() == root { mine.len() as u64 } else { 0 }];
            self.broadcast(&mut len, root)?;
            let len =
                usize::try_from(len[0]).map_err(|_| Error::internal(format!("weight_sync: member {root}'s description is too long")))?;
            let mut bytes = if self.rank() == root { mine.as_bytes().to_vec() } else { vec![0u8; len] };
            self.broadcast(&mut bytes, root)?;
            Ok(String::from_utf8_lossy(&bytes).into_owned())
        };
        let theirs = share(reference)?;
        let mut said = Vec::new();
        for &m in odd.iter().take(SHOWN) {
            let d = describe_differences(m, &share(m)?, reference, &theirs, SHOWN);
            match d.is_empty() {
                true => said.push(format!("member {m}'s arguments describe alike, yet hash otherwise")),
                false => said.extend(d),
            }
        }
        Ok(said.join("; "))
    }
}

impl WeightSync<'_> {
    /// This member's role.
    pub fn role(&self) -> WeightRole {
        match &self.role {
            Role::None => WeightRole::None,
            Role::Source(s) => WeightRole::Source(s.index),
            Role::Destination(d) => WeightRole::Destination(d.index),
        }
    }

    /// The routing table every member computed.
    pub fn routing_table(&self) -> &RoutingTable {
        &self.table
    }

    fn me(&self) -> usize {
        self.comm.rank()
    }

    fn not(&self, call: &str, role: &str) -> Error {
        Error::invalid(format!("rank {}: WeightSync::{call}: this member is not a {role} rank", self.me()))
    }

    /// The wire value of version `v`.
    fn wire(&self, call: &str, v: u64) -> Result<u64> {
        self.base.checked_add(v).ok_or_else(|| Error::invalid(format!("rank {}: WeightSync::{call}: version {v} is too large", self.me())))
    }

    /// A source's buffer, for the trainer to write the next version into: waits (with the
    /// communicator's deadline) until every destination this rank feeds has pulled the last
    /// published version, then runs `f` on the whole buffer (this rank's blocks, laid out
    /// as [`ModelLayout::offset`] says).
    ///
    /// # Errors
    ///
    /// On a member that is not a source; as [`WeightSync::wait_consumed`].
    pub fn with_buffer_mut<R>(&mut self, f: impl FnOnce(&mut [u8]) -> R) -> Result<R> {
        self.buffer_mut("with_buffer_mut", None, f)
    }

    /// [`WeightSync::with_buffer_mut`] on one tensor's block (empty where this rank holds
    /// none of it).
    ///
    /// # Errors
    ///
    /// As [`WeightSync::with_buffer_mut`], and for a name the layout does not list.
    pub fn with_tensor_mut<R>(&mut self, name: &str, f: impl FnOnce(&mut [u8]) -> R) -> Result<R> {
        self.buffer_mut("with_tensor_mut", Some(name), f)
    }

    /// [`WeightSync::with_buffer_mut`] with the buffer as elements of `T`: every tensor
    /// of the layout must be of `T`'s dtype.
    ///
    /// # Errors
    ///
    /// As [`WeightSync::with_buffer_mut`], and, naming the tensor, when one is of another
    /// dtype than `T` (or the buffer does not start at a multiple of `T`'s alignment).
    pub fn with_buffer_mut_as<T: Element, R>(&mut self, f: impl FnOnce(&mut [T]) -> R) -> Result<R> {
        self.typed::<T>("with_buffer_mut_as", None)?;
        let me = self.me();
        self.buffer_mut("with_buffer_mut_as", None, |b| cast_mut(me, "with_buffer_mut_as", None, b).map(f))?
    }

    /// [`WeightSync::with_tensor_mut`] with the block as elements of `T`, the tensor's dtype
    /// (`bf16` for a [`DType::Bf16`] tensor, `f32` for [`DType::F32`], ...).
    ///
    /// # Errors
    ///
    /// As [`WeightSync::with_tensor_mut`], and, naming the tensor and both dtypes, when `T`
    /// is not of the tensor's dtype.
    pub fn with_tensor_mut_as<T: Element, R>(&mut self, name: &str, f: impl FnOnce(&mut [T]) -> R) -> Result<R> {
        self.typed::<T>("with_tensor_mut_as", Some(name))?;
        let me = self.me();
        self.buffer_mut("with_tensor_mut_as", Some(name), |b| cast_mut(me, "with_tensor_mut_as", Some(name), b).map(f))?
    }

    /// Checks that the tensor `name` (or every tensor) of this member's side is of `T`'s
    /// dtype; the error names the tensor and both dtypes.
    fn typed<T: Element>(&self, call: &str, name: Option<&str>) -> Result<()> {
        let tensors = match &self.role {
            Role::Source(s) => &s.tensors,
            Role::Destination(d) => &d.tensors,
            Role::None => return Ok(()), // the untyped call says what is wrong
        };
        let me = self.me();
        for t in tensors.iter().filter(|t| name.is_none_or(|n| n == t.0)) {
            if t.3 != T::DTYPE {
                return Err(Error::invalid(format!(
                    "rank {me}: WeightSync::{call}::<{}>: tensor `{}` is {}, not {}",
                    T::DTYPE,
                    t.0,
                    t.3,
                    T::DTYPE
                )));
            }
        }
        Ok(())
    }

    fn buffer_mut<R>(&mut self, call: &str, name: Option<&str>, f: impl FnOnce(&mut [u8]) -> R) -> Result<R> {
        let me = self.me();
        let Role::Source(s) = &self.role else {
            return Err(self.not(call, "source"));
        };
        let (off, len) = span(me, call, &s.tensors, s.len, name)?;
        let published = s.published;
        self.wait_consumed(published)?;
        let Role::Source(s) = &self.role else {
            return Err(self.not(call, "source"));
        };
        s.window.region().with_slice_mut(off, len, f).map_err(|e| Error::invalid(format!("rank {me}: WeightSync::{call}: {e}")))
    }

    /// Tells every destination this rank feeds that version `v` is in its buffer (its
    /// signal there rises to `v`). Waits first, as [`WeightSync::with_buffer_mut`] does,
    /// until the previous version was pulled. Returns once every signal is raised.
    ///
    /// # Errors
    ///
    /// On a member that is not a source, for a version 0 or not above the last one
    /// published; a dead destination or the deadline as any call.
    pub fn publish(&mut self, v: u64) -> Result<()> {
        let me = self.me();
        let wire = self.wire("publish", v)?;
        let Role::Source(s) = &self.role else {
            return Err(self.not("publish", "source"));
        };
        if v <= s.published {
            return Err(Error::invalid(format!(
                "rank {me}: WeightSync::publish({v}): versions must increase (version {} was published)",
                s.published
            )));
        }
        let previous = s.published;
        self.wait_consumed(previous)?;
        let comm = self.comm;
        let Role::Source(s) = &mut self.role else {
            return Err(self.not("publish", "source"));
        };
        if let Some(p) = &mut s.publish {
            p.run_with_signal(comm, wire)?;
        }
        s.published = v;
        Ok(())
    }

    /// Waits (with the communicator's deadline) until every destination this rank feeds has
    /// pulled version `v` (at most the last one published). Returns at once if they have.
    ///
    /// # Errors
    ///
    /// On a member that is not a source, for a version not yet published; a dead
    /// destination (named) or the deadline as any call.
    pub fn wait_consumed(&mut self, v: u64) -> Result<()> {
        let me = self.me();
        let wire = self.wire("wait_consumed", v)?;
        let comm = self.comm;
        let Role::Source(s) = &mut self.role else {
            return Err(self.not("wait_consumed", "source"));
        };
        if v > s.published {
            return Err(Error::invalid(format!(
                "rank {me}: WeightSync::wait_consumed({v}): the last version published is {}",
                s.published
            )));
        }
        if v <= s.consumed {
            return Ok(());
        }
        if let Some(w) = &mut s.acks {
            w.run_with_signal(comm, wire)?;
        }
        s.consumed = v;
        Ok(())
    }

    /// The last version published by this source (0: none).
    pub fn published(&self) -> u64 {
        match &self.role {
            Role::Source(s) => s.published,
            _ => 0,
        }
    }

    /// Pulls version `v` into this destination: waits (with the communicator's deadline)
    /// until every sender has published a version above the one held, checks that it is
    /// `v`, reads every piece into the back buffer, acknowledges `v` to every sender, and
    /// makes the back buffer the front one.
    ///
    /// # Errors
    ///
    /// On a member that is not a destination; for a version not above the one held; when
    /// a sender published another version than `v` (naming it; nothing was read); a dead
    /// sender (named), a refused read or the deadline as any call. On every error the
    /// front buffer and its version are as they were.
    pub fn pull(&mut self, v: u64) -> Result<()> {
        let me = self.me();
        let wire = self.wire("pull", v)?;
        let (comm, base, slot) = (self.comm, self.base, self.slot);
        let Role::Destination(d) = &mut self.role else {
            return Err(self.not("pull", "destination"));
        };
        if v <= d.version {
            return Err(Error::invalid(format!(
                "rank {me}: WeightSync::pull({v}): versions must increase (this rank holds version {})",
                d.version
            )));
        }
        // Every sender's signal at once (one prepared wait), then each one's value.
        if let Some(w) = &mut d.published {
            w.run_with_signal(comm, base + d.version + 1)?;
        }
        for &s in &d.senders {
            let got = comm.signal_value_on(s, slot);
            if got != wire {
                return Err(Error::invalid(format!(
                    "rank {me}: WeightSync::pull({v}): source member {s} published version {}",
                    got.saturating_sub(base)
                )));
            }
        }
        let back = 1 - d.front;
        if let Some(p) = &mut d.plans[back] {
            p.run_with_signal(comm, 0)?;
        }
        if let Some(a) = &mut d.ack {
            a.run_with_signal(comm, wire)?;
        }
        d.front = back;
        d.version = v;
        Ok(())
    }

    /// The version in this destination's front buffer (0: none yet, or not a destination).
    pub fn current_version(&self) -> u64 {
        match &self.role {
            Role::Destination(d) => d.version,
            _ => 0,
        }
    }

    /// Runs `f` on the last complete version: its number (0: none pulled yet, the buffer
    /// zeroed) and this destination's whole buffer.
    ///
    /// # Errors
    ///
    /// On a member that is not a destination.
    pub fn with_current<R>(&self, f: impl FnOnce(u64, &[u8]) -> R) -> Result<R> {
        self.front("with_current", None, f)
    }

    /// [`WeightSync::with_current`] on one tensor's block of the front buffer (empty where
    /// this rank holds none of it).
    ///
    /// # Errors
    ///
    /// On a member that is not a destination, for a name the layout does not list.
    pub fn with_tensor<R>(&self, name: &str, f: impl FnOnce(u64, &[u8]) -> R) -> Result<R> {
        self.front("with_tensor", Some(name), f)
    }

    /// [`WeightSync::with_current`] with the buffer as elements of `T`: every tensor of the
    /// layout must be of `T`'s dtype.
    ///
    /// # Errors
    ///
    /// As [`WeightSync::with_current`], and, naming the tensor, when one is of another dtype
    /// than `T`.
    pub fn with_current_as<T: Element, R>(&self, f: impl FnOnce(u64, &[T]) -> R) -> Result<R> {
        self.typed::<T>("with_current_as", None)?;
        let me = self.me();
        self.front("with_current_as", None, |v, b| cast(me, "with_current_as", None, b).map(|t| f(v, t)))?
    }

    /// [`WeightSync::with_tensor`] with the block as elements of `T`, the tensor's dtype:
    /// `ws.with_tensor_as::<bf16, _>("layer0.weight", |v, w| ...)`.
    ///
    /// # Errors
    ///
    /// As [`WeightSync::with_tensor`], and, naming the tensor and both dtypes, when `T` is
    /// not of the tensor's dtype.
    pub fn with_tensor_as<T: Element, R>(&self, name: &str, f: impl FnOnce(u64, &[T]) -> R) -> Result<R> {
        self.typed::<T>("with_tensor_as", Some(name))?;
        let me = self.me();
        self.front("with_tensor_as", Some(name), |v, b| cast(me, "with_tensor_as", Some(name), b).map(|t| f(v, t)))?
    }

    fn front<R>(&self, call: &str, name: Option<&str>, f: impl FnOnce(u64, &[u8]) -> R) -> Result<R> {
        let me = self.me();
        let Role::Destination(d) = &self.role else {
            return Err(self.not(call, "destination"));
        };
        let (off, len) = span(me, call, &d.tensors, d.len, name)?;
        let v = d.version;
        d.buffers[d.front]
            .region()
            .with_slice(off, len, |b| f(v, b))
            .map_err(|e| Error::invalid(format!("rank {me}: WeightSync::{call}: {e}")))
    }
}

/// The error of a block that cannot be seen as elements of `T` (its length or alignment).
fn cast_error<T: Element>(me: usize, call: &str, name: Option<&str>, len: usize, e: bytemuck::PodCastError) -> Error {
    let what = name.map_or_else(|| "the buffer".to_string(), |n| format!("tensor `{n}`"));
    Error::invalid(format!("rank {me}: WeightSync::{call}::<{}>: {what} ({len} bytes) cannot be seen as {}: {e:?}", T::DTYPE, T::DTYPE))
}

fn cast<'b, T: Element>(me: usize, call: &str, name: Option<&str>, b: &'b [u8]) -> Result<&'b [T]> {
    bytemuck::try_cast_slice(b).map_err(|e| cast_error::<T>(me, call, name, b.len(), e))
}

fn cast_mut<'b, T: Element>(me: usize, call: &str, name: Option<&str>, b: &'b mut [u8]) -> Result<&'b mut [T]> {
    let len = b.len();
    bytemuck::try_cast_slice_mut(b).map_err(|e| cast_error::<T>(me, call, name, len, e))
}

/// The byte range of tensor `name` (or the whole buffer) in a local buffer.
fn span(me: usize, call: &str, tensors: &[TensorSpan], len: usize, name: Option<&str>) -> Result<(usize, usize)> {
    match name {
        None => Ok((0, len)),
        Some(n) => tensors
            .iter()
            .find(|t| t.0 == n)
            .map(|t| (t.1, t.2))
            .ok_or_else(|| Error::invalid(format!("rank {me}: WeightSync::{call}: no tensor `{n}` in the layout"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reshard::{Placement, TensorLayout};
    use ferroccl_kernels::DType;

    fn message(prints: &[u64]) -> Option<String> {
        disagreement(0, prints).map(|e| e.to_string())
    }

    #[test]
    fn disagreeing_members_are_named_against_the_most_common_fingerprint() {
        assert_eq!(message(&[7, 7, 7]), None);
        assert_eq!(message(&[5]), None);
        let one = message(&[7, 7, 7, 9]).unwrap();
        assert!(one.contains("member 3 passed other layouts or groups than member 0 (fingerprint 0x0000000000000009"), "{one}");
        // Member 0 is the odd one: the others are the reference.
        let first = message(&[9, 7, 7]).unwrap();
        assert!(first.contains("member 0 passed other layouts or groups than member 1"), "{first}");
        let two = message(&[7, 8, 7, 9, 7]).unwrap();
        assert!(two.contains("members 1, 3 passed other layouts or groups than member 0"), "{two}");
        // Many: eight named, the rest counted.
        let mut many = vec![1u64; 20];
        many.extend([2u64; 11]);
        let many = message(&many).unwrap();
        assert!(many.contains("members 20, 21, 22, 23, 24, 25, 26, 27 and 3 more passed other layouts or groups than member 0"), "{many}");
        // A tie: the lowest member's fingerprint is the reference.
        let tie = message(&[4, 5]).unwrap();
        assert!(tie.contains("member 1 passed other layouts or groups than member 0"), "{tie}");
    }

    #[test]
    fn the_arguments_fingerprint_covers_both_layouts_and_both_groups() {
        let t = |p| TensorLayout::new("w", DType::F32, [8, 4], p);
        let src = ModelLayout::new(2, vec![t(Placement::rows(&[4, 4]))]).unwrap();
        let dst = ModelLayout::new(2, vec![t(Placement::cols(&[2, 2]))]).unwrap();
        let f = fingerprint(&src, &[0, 1], &dst, &[2, 3]);
        assert_eq!(f, fingerprint(&src, &[0, 1], &dst, &[2, 3]));
        let others = [
            fingerprint(&src, &[1, 0], &dst, &[2, 3]),
            fingerprint(&src, &[0, 1], &dst, &[3, 2]),
            fingerprint(&dst, &[0, 1], &src, &[2, 3]),
            fingerprint(&src, &[0, 1], &src, &[2, 3]),
            fingerprint(&src, &[0, 1], &dst, &[2, 4]),
        ];
        for (i, o) in others.iter().enumerate() {
            assert_ne!(f, *o, "change {i}");
        }
    }
}
