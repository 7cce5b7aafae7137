//! M->N weight sync (`Communicator::weight_sync`): random layouts replayed over several
//! versions with every destination byte checked, versions published back to back while
//! destinations pull (never a torn version), bad arguments as errors on every member, and
//! an aborted source leaving the destination's last complete version in place.

use std::time::Duration;

use ferroccl::reshard::{ModelLayout, Placement, TensorLayout};
use ferroccl::{Communicator, DType, Error, Params, WeightRole, WeightSync};

use crate::harness::{all_ok, run_world, RankResult, Suite, Wire};

fn params(s: &Suite, rank: usize) -> Params {
    Params { timeout: Duration::from_secs(20), ..s.params(rank) }
}

/// The byte of version `v` at (tensor, global row, global column, byte of the element).
fn pattern(v: u64, t: usize, row: usize, col: usize, b: usize) -> u8 {
    (v.wrapping_mul(151) ^ (t as u64 * 71 + row as u64 * 29 + col as u64 * 7 + b as u64 * 3 + 1)) as u8
}

/// Writes version `v` of every block `rank` holds in `layout` into its buffer `buf`.
fn fill(layout: &ModelLayout, rank: usize, v: u64, buf: &mut [u8]) {
    for (t, tl) in layout.tensors().iter().enumerate() {
        let (Some(b), Some(off)) = (layout.block(rank, t), layout.offset(rank, t)) else { continue };
        let es = tl.dtype().size();
        for r in 0..b.rows {
            for c in 0..b.cols {
                for k in 0..es {
                    buf[off + (r * b.cols + c) * es + k] = pattern(v, t, b.row0 + r, b.col0 + c, k);
                }
            }
        }
    }
}

/// Checks that `buf` holds version `v` of every block `rank` holds in `layout`.
fn check(layout: &ModelLayout, rank: usize, v: u64, buf: &[u8]) -> Result<(), String> {
    for (t, tl) in layout.tensors().iter().enumerate() {
        let (Some(b), Some(off)) = (layout.block(rank, t), layout.offset(rank, t)) else { continue };
        let es = tl.dtype().size();
        for r in 0..b.rows {
            for c in 0..b.cols {
                for k in 0..es {
                    let (got, want) = (buf[off + (r * b.cols + c) * es + k], pattern(v, t, b.row0 + r, b.col0 + c, k));
                    if got != want {
                        return Err(format!(
                            "version {v}, tensor {} row {} col {} byte {k}: {got} (want {want})",
                            tl.name(),
                            b.row0 + r,
                            b.col0 + c
                        ));
                    }
                }
            }
        }
    }
    Ok(())
}

/// A small deterministic generator (xorshift).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// `extent` cut into `parts` sizes (zeros allowed) that add up to it.
fn split(rng: &mut Rng, extent: usize, parts: usize) -> Vec<usize> {
    let mut cuts: Vec<usize> = (0..parts - 1).map(|_| rng.below(extent + 1)).collect();
    cuts.sort_unstable();
    let mut out = Vec::with_capacity(parts);
    let mut prev = 0;
    for c in cuts {
        out.push(c - prev);
        prev = c;
    }
    out.push(extent - prev);
    out
}

fn placement(rng: &mut Rng, ranks: usize, shape: [usize; 2]) -> Placement {
    match rng.below(4) {
        0 => Placement::replicated(ranks),
        1 => Placement::rows(&split(rng, shape[0], ranks)),
        2 => Placement::cols(&split(rng, shape[1], ranks)),
        _ if ranks > 1 && ranks.is_multiple_of(2) => Placement::rows_replicated(&split(rng, shape[0], ranks / 2), 2),
        _ if ranks == 3 => Placement::rows_replicated(&split(rng, shape[0], 1), 3),
        _ => Placement::rows(&split(rng, shape[0], ranks)),
    }
}

/// A random pair of layouts over `m` and `n` ranks with the same 1-4 tensors.
fn layouts(rng: &mut Rng, m: usize, n: usize) -> (ModelLayout, ModelLayout) {
    let tensors = 1 + rng.below(4);
    let (mut src, mut dst) = (Vec::new(), Vec::new());
    for t in 0..tensors {
        let shape = [1 + rng.below(9), 1 + rng.below(9)];
        let dtype = [DType::F32, DType::Bf16, DType::U8][rng.below(3)];
        let name = format!("layer{t}.w");
        src.push(TensorLayout::new(name.clone(), dtype, shape, placement(rng, m, shape)));
        dst.push(TensorLayout::new(name, dtype, shape, placement(rng, n, shape)));
    }
    let align = [1, 8, 64][rng.below(3)];
    (ModelLayout::with_align(m, src, align).expect("source layout"), ModelLayout::with_align(n, dst, align).expect("destination layout"))
}

/// One job: `m` sources, `n` destinations and `extra` bystanders, interleaved over the
/// members by `seed`; `versions` syncs, every destination byte checked after each pull.
fn sync_case(s: &Suite, seed: u64, m: usize, n: usize, extra: usize, versions: &[u64]) -> Result<(), String> {
    sync_case_with(s, seed, m, n, extra, versions, false)
}

/// `noise`: before each version every member raises its public signal at every other
/// member far above any version (the sync's own signal slot must not see it).
fn sync_case_with(s: &Suite, seed: u64, m: usize, n: usize, extra: usize, versions: &[u64], noise: bool) -> Result<(), String> {
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let (src, dst) = layouts(&mut rng, m, n);
    let world = m + n + extra;
    // A permutation of the members: the first m are sources, the next n destinations.
    let mut order: Vec<usize> = (0..world).collect();
    for i in (1..world).rev() {
        order.swap(i, rng.below(i + 1));
    }
    let (src_ranks, dst_ranks) = (order[..m].to_vec(), order[m..m + n].to_vec());
    let res = run_world(
        world,
        |r| params(s, r),
        |comm| -> RankResult<()> {
            let me = comm.rank();
            let fail = |e: Error| format!("rank {me} (seed {seed}, {m} -> {n}): {e}");
            let mut ws = comm.weight_sync(&src, &src_ranks, &dst, &dst_ranks).map_err(fail)?;
            for &v in versions {
                if noise {
                    for p in (0..world).filter(|&p| p != me) {
                        comm.signal(p, (1 << 40) + v).map_err(fail)?;
                    }
                }
                match ws.role() {
                    WeightRole::Source(i) => {
                        ws.with_buffer_mut(|b| fill(&src, i, v, b)).map_err(fail)?;
                        ws.publish(v).map_err(fail)?;
                    }
                    WeightRole::Destination(j) => {
                        ws.pull(v).map_err(fail)?;
                        let checked =
                            ws.with_current(
                                |got, b| if got == v { check(&dst, j, v, b) } else { Err(format!("current() is version {got}")) },
                            );
                        checked.map_err(fail)?.map_err(|e| format!("rank {me} (seed {seed}, destination {j}): {e}"))?;
                        for (t, tl) in dst.tensors().iter().enumerate() {
                            let want = dst.block(j, t).map_or(0, |b| b.rows * b.cols * tl.dtype().size());
                            let got = ws.with_tensor(tl.name(), |_, b| b.len()).map_err(fail)?;
                            if got != want {
                                return Err(format!("rank {me}: tensor {}: {got} bytes, want {want}", tl.name()));
                            }
                        }
                    }
                    WeightRole::None => {}
                }
            }
            if let WeightRole::Source(_) = ws.role() {
                ws.wait_consumed(*versions.last().unwrap_or(&0)).map_err(fail)?;
            }
            drop(ws);
            comm.barrier().map_err(fail)?;
            comm.finalize().map_err(fail)
        },
    );
    all_ok(res).map(|_| ())
}

/// Random layouts (replicated, row, column and row-replicated shards of 1-4 small f32,
/// bf16 and u8 tensors) over M sources and N destinations, M and N in 1..=3, three syncs
/// each (versions 1, 2, 5), every destination byte checked after every pull; a bystander
/// member in some cases.
pub fn weight_sync_moves_random_layouts_exactly(s: &Suite) {
    let mut failures = Vec::new();
    let mut case = 0u64;
    for m in 1..=3 {
        for n in 1..=3 {
            case += 1;
            let extra = usize::from(case.is_multiple_of(4));
            if let Err(e) = sync_case(s, case, m, n, extra, &[1, 2, 5]) {
                failures.push(e);
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Sources publish 30 versions back to back (each waits only as the protocol makes it)
/// while destinations pull them, some slowly: every version a destination reports is
/// byte-exact for that version, and it is the one it asked for.
pub fn weight_sync_never_shows_a_torn_version(s: &Suite) {
    let versions: Vec<u64> = (1..=30).map(|v| v * 3).collect();
    sync_case(s, 1001, 2, 2, 0, &versions).unwrap();
    sync_case(s, 1002, 3, 1, 0, &versions[..10]).unwrap();
}

/// The public signals between the same ranks (raised far above every version before each
/// sync) do not pass for a sync's versions or acknowledgements: a sync has its own signal
/// slot.
pub fn weight_sync_ignores_the_public_signals(s: &Suite) {
    sync_case_with(s, 2001, 2, 2, 0, &[1, 2, 3], true).unwrap();
    sync_case_with(s, 2002, 1, 3, 1, &[4, 9], true).unwrap();
}

fn expect_err<T: std::fmt::Debug>(what: &str, r: ferroccl::Result<T>, needle: &str) -> Result<(), String> {
    match r {
        Err(Error::InvalidArgument(m)) if m.contains(needle) => Ok(()),
        other => Err(format!("{what}: {other:?} (want an invalid argument naming `{needle}`)")),
    }
}

fn one_tensor(ranks: usize) -> ModelLayout {
    ModelLayout::new(ranks, vec![TensorLayout::new("w", DType::F32, [4, 4], Placement::rows(&vec![4 / ranks; ranks]))]).unwrap()
}

/// Bad arguments are errors on every member, before any communication (so nobody hangs):
/// overlapping groups, wrong lengths, ranks out of range or twice; then versions that do
/// not increase, a pull of another version than the one published (naming the source),
/// calls of the other role or of no role; a second sync between the same ranks starts its
/// versions again; the communicator stays usable throughout.
pub fn weight_sync_bad_arguments_are_errors(s: &Suite) {
    let res = run_world(
        3,
        |r| params(s, r),
        |comm: Communicator| -> RankResult<()> {
            let me = comm.rank();
            let (one, two) = (one_tensor(1), one_tensor(2));
            let go = || -> Result<(), String> {
                expect_err("overlap", comm.weight_sync(&one, &[1], &two, &[1, 2]), "member 1 is in both")?;
                expect_err("short source list", comm.weight_sync(&two, &[0], &one, &[1]), "1 source ranks given")?;
                expect_err("long destination list", comm.weight_sync(&one, &[0], &one, &[1, 2]), "2 destination ranks given")?;
                expect_err("out of range", comm.weight_sync(&one, &[3], &one, &[1]), "out of range")?;
                expect_err("twice", comm.weight_sync(&one, &[0], &two, &[2, 2]), "listed twice")?;
                let other = ModelLayout::new(1, vec![TensorLayout::new("v", DType::F32, [4, 4], Placement::replicated(1))]).unwrap();
                expect_err("different tensors", comm.weight_sync(&one, &[0], &other, &[1]), "tensor `v`")?;
                comm.barrier().map_err(|e| e.to_string())?;

                // Source 0, destinations 1 and 2.
                let mut ws: WeightSync<'_> = comm.weight_sync(&one, &[0], &two, &[1, 2]).map_err(|e| e.to_string())?;
                match ws.role() {
                    WeightRole::Source(0) => {
                        expect_err("pull on a source", ws.pull(1), "not a destination")?;
                        expect_err("version 0", ws.publish(0), "versions must increase")?;
                        expect_err("wait for an unpublished version", ws.wait_consumed(1), "last version published is 0")?;
                        expect_err("unknown tensor", ws.with_tensor_mut("nope", |_| ()), "no tensor `nope`")?;
                        ws.with_buffer_mut(|b| fill(&one, 0, 2, b)).map_err(|e| e.to_string())?;
                        ws.publish(2).map_err(|e| e.to_string())?;
                        expect_err("same version again", ws.publish(2), "versions must increase")?;
                        ws.wait_consumed(2).map_err(|e| e.to_string())?;
                        ws.with_tensor_mut("w", |b| fill(&one, 0, 3, b)).map_err(|e| e.to_string())?;
                        expect_err("older version", ws.publish(1), "versions must increase")?;
                        ws.publish(3).map_err(|e| e.to_string())?;
                        ws.wait_consumed(3).map_err(|e| e.to_string())?;
                    }
                    WeightRole::Destination(j) => {
                        expect_err("publish on a destination", ws.publish(1), "not a source")?;
                        expect_err("version 0", ws.pull(0), "versions must increase")?;
                        // The source publishes 2: a pull of 1 names it and changes nothing.
                        expect_err("pull of another version", ws.pull(1), "source member 0 published version 2")?;
                        if ws.current_version() != 0 {
                            return Err("a failed pull changed the version".into());
                        }
                        ws.pull(2).map_err(|e| e.to_string())?;
                        ws.with_current(|v, b| if v == 2 { check(&two, j, 2, b) } else { Err(format!("version {v}")) })
                            .map_err(|e| e.to_string())??;
                        expect_err("same version again", ws.pull(2), "versions must increase")?;
                        ws.pull(3).map_err(|e| e.to_string())?;
                        ws.with_tensor("w", |v, b| if v == 3 { check(&two, j, 3, b) } else { Err(format!("version {v}")) })
                            .map_err(|e| e.to_string())??;
                    }
                    other => return Err(format!("role {other:?}")),
                }
                drop(ws);
                comm.barrier().map_err(|e| e.to_string())?;

                // A second sync between some of the same ranks (its versions start again
                // at 1), member 2 in neither group.
                let mut ws = comm.weight_sync(&one, &[1], &one, &[0]).map_err(|e| e.to_string())?;
                match ws.role() {
                    WeightRole::Source(0) => {
                        ws.with_tensor_mut("w", |b| fill(&one, 0, 1, b)).map_err(|e| e.to_string())?;
                        ws.publish(1).map_err(|e| e.to_string())?;
                        ws.wait_consumed(1).map_err(|e| e.to_string())?;
                    }
                    WeightRole::Destination(0) => {
                        ws.pull(1).map_err(|e| e.to_string())?;
                        ws.with_current(|v, b| if v == 1 { check(&one, 0, 1, b) } else { Err(format!("version {v}")) })
                            .map_err(|e| e.to_string())??;
                    }
                    WeightRole::None => {
                        expect_err("publish without a role", ws.publish(1), "not a source")?;
                        expect_err("pull without a role", ws.pull(1), "not a destination")?;
                        expect_err("read without a role", ws.with_current(|_, _| ()), "not a destination")?;
                        expect_err("write without a role", ws.with_buffer_mut(|_| ()), "not a source")?;
                    }
                    other => return Err(format!("role {other:?}")),
                }
                drop(ws);
                comm.barrier().map_err(|e| e.to_string())
            };
            go().map_err(|e| format!("rank {me}: {e}"))?;
            comm.finalize().map_err(|e| format!("rank {me}: finalize: {e}"))
        },
    );
    all_ok(res).unwrap();
}

/// A source that aborts after version 1, while writing version 2: the destination's pull
/// of 2 fails naming it, and its current version is still 1, byte-exact.
pub fn weight_sync_failure_keeps_the_last_version(s: &Suite) {
    let src = ModelLayout::new(1, vec![TensorLayout::new("w", DType::Bf16, [8, 6], Placement::replicated(1))]).unwrap();
    let dst = ModelLayout::new(1, vec![TensorLayout::new("w", DType::Bf16, [8, 6], Placement::cols(&[6]))]).unwrap();
    let res = run_world(
        2,
        |r| Params { timeout: Duration::from_secs(10), ..s.params(r) },
        |comm| -> RankResult<()> {
            let me = comm.rank();
            let mut ws = comm.weight_sync(&src, &[0], &dst, &[1]).map_err(|e| format!("rank {me}: {e}"))?;
            if me == 0 {
                ws.with_buffer_mut(|b| fill(&src, 0, 1, b)).map_err(|e| e.to_string())?;
                ws.publish(1).map_err(|e| e.to_string())?;
                ws.with_buffer_mut(|b| fill(&src, 0, 2, b)).map_err(|e| e.to_string())?;
                // The destination's pull of 1 is over (its acknowledgement answered).
                comm.barrier().map_err(|e| e.to_string())?;
                // Let the destination's side of the barrier finish too.
                std::thread::sleep(Duration::from_millis(300));
                comm.abort();
                return Ok(());
            }
            ws.pull(1).map_err(|e| format!("rank 1: pull 1: {e}"))?;
            comm.barrier().map_err(|e| format!("rank 1: barrier: {e}"))?;
            match ws.pull(2) {
                Err(Error::Aborted { by: Some(0), .. }) => {}
                Err(e) if e.to_string().contains("rank 0") => {}
                other => return Err(format!("rank 1: pull 2 after the source aborted: {other:?}")),
            }
            ws.with_current(|v, b| if v == 1 { check(&dst, 0, 1, b) } else { Err(format!("version {v} after the failure")) })
                .map_err(|e| e.to_string())?
        },
    );
    all_ok(res).unwrap();
}

/// A source that aborts right after publishing version 2 of a 2 MiB tensor (at once, or
/// after 1 or 5 ms), while the destination reads it: the pull either completes with
/// version 2 byte-exact, or fails naming the source and leaves version 1 in place,
/// byte-exact. Never a mix.
pub fn weight_sync_abort_during_a_pull_never_tears(s: &Suite) {
    let src = ModelLayout::new(1, vec![TensorLayout::new("w", DType::U8, [1024, 2048], Placement::replicated(1))]).unwrap();
    let dst = ModelLayout::new(1, vec![TensorLayout::new("w", DType::U8, [1024, 2048], Placement::cols(&[2048]))]).unwrap();
    for delay_ms in [0u64, 1, 5] {
        let res = run_world(
            2,
            |r| Params { timeout: Duration::from_secs(10), ..s.params(r) },
            |comm| -> RankResult<()> {
                let me = comm.rank();
                let mut ws = comm.weight_sync(&src, &[0], &dst, &[1]).map_err(|e| format!("rank {me}: {e}"))?;
                if me == 0 {
                    for v in [1, 2] {
                        ws.with_buffer_mut(|b| fill(&src, 0, v, b)).map_err(|e| e.to_string())?;
                        ws.publish(v).map_err(|e| e.to_string())?;
                    }
                    std::thread::sleep(Duration::from_millis(delay_ms));
                    comm.abort();
                    // Keep the window a while: the destination's error is the abort.
                    std::thread::sleep(Duration::from_millis(300));
                    return Ok(());
                }
                ws.pull(1).map_err(|e| format!("rank 1: pull 1: {e}"))?;
                let want = match ws.pull(2) {
                    Ok(()) => 2,
                    Err(Error::Aborted { by: Some(0), .. }) => 1,
                    Err(e) if e.to_string().contains("rank 0") => 1,
                    Err(e) => return Err(format!("rank 1: pull 2 while the source aborted: {e}")),
                };
                ws.with_current(|v, b| if v == want { check(&dst, 0, v, b) } else { Err(format!("version {v}, want {want}")) })
                    .map_err(|e| e.to_string())?
                    .map_err(|e| format!("rank 1, abort after {delay_ms} ms: {e}"))
            },
        );
        all_ok(res).unwrap();
    }
}

/// [`weight_sync_moves_random_layouts_exactly`] for the pairs it leaves out, M or N = 4
/// (M, N in 1..=4 between the two tests, M != N included): random layouts of 1-4 random
/// f32, bf16 and u8 tensors, two syncs each (versions 1, 4), every destination byte
/// checked after every pull; a bystander member in some cases. Over verbs (the emulated
/// VM is slow) only 1 -> 4 and 4 -> 1.
pub fn weight_sync_moves_random_layouts_exactly_up_to_four_by_four(s: &Suite) {
    let mut failures = Vec::new();
    let mut case = 100u64;
    for m in 1..=4 {
        for n in 1..=4 {
            if m < 4 && n < 4 {
                continue;
            }
            case += 1;
            if s.wire == Wire::Verbs && m + n > 5 {
                continue;
            }
            let extra = usize::from(case.is_multiple_of(3));
            if let Err(e) = sync_case(s, case, m, n, extra, &[1, 4]) {
                failures.push(e);
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Members that pass other arguments than the rest (here member 3 another destination
/// layout, then member 1 its source group in another order, then both) get, on every
/// member alike, an invalid argument naming them, from the setup's fingerprint check,
/// before any transfer; a member whose own checks fail is named by the others at once; the
/// communicator stays usable and a weight sync with agreeing arguments then works.
pub fn weight_sync_rejects_members_with_other_layouts(s: &Suite) {
    let tensor = |p| TensorLayout::new("w", DType::F32, [8, 4], p);
    let src = ModelLayout::new(2, vec![tensor(Placement::rows(&[4, 4]))]).unwrap();
    let dst = ModelLayout::new(2, vec![tensor(Placement::cols(&[2, 2]))]).unwrap();
    let other_dst = ModelLayout::new(2, vec![tensor(Placement::cols(&[1, 3]))]).unwrap();
    let res = run_world(
        4,
        |r| params(s, r),
        |comm: Communicator| -> RankResult<()> {
            let me = comm.rank();
            let expect = |what: &str, r: ferroccl::Result<WeightSync<'_>>, needle: &str| -> Result<(), String> {
                match r {
                    Err(Error::InvalidArgument(m)) if m.contains(needle) && m.contains("fingerprint") => Ok(()),
                    Err(e) => Err(format!("{what}: {e} (want an invalid argument naming `{needle}`)")),
                    Ok(_) => Err(format!("{what}: set up (want an invalid argument naming `{needle}`)")),
                }
            };
            let go = || -> Result<(), String> {
                let d = if me == 3 { &other_dst } else { &dst };
                expect(
                    "another layout",
                    comm.weight_sync(&src, &[0, 1], d, &[2, 3]),
                    "member 3 passed other layouts or groups than member 0",
                )?;
                // What differs, with both values, on every member: the tensor and its property.
                let sharding = "member 3's destination tensor `w`'s sharding is rank 0 rows 0..8 cols 0..1, rank 1 rows 0..8 cols 1..4, \
                                member 0's rank 0 rows 0..8 cols 0..2, rank 1 rows 0..8 cols 2..4";
                expect("another layout, what differs", comm.weight_sync(&src, &[0, 1], d, &[2, 3]), sharding)?;
                let g: &[usize] = if me == 1 { &[1, 0] } else { &[0, 1] };
                expect("another group", comm.weight_sync(&src, g, &dst, &[2, 3]), "member 1 passed other layouts or groups than member 0")?;
                let group = "member 1's source group (members) is [1, 0], member 0's [0, 1]";
                expect("another group, what differs", comm.weight_sync(&src, g, &dst, &[2, 3]), group)?;
                let d = if me == 3 { &other_dst } else { &dst };
                expect("both", comm.weight_sync(&src, g, d, &[2, 3]), "members 1, 3 passed other layouts or groups than member 0")?;
                expect("both, what differs (1)", comm.weight_sync(&src, g, d, &[2, 3]), group)?;
                expect("both, what differs (3)", comm.weight_sync(&src, g, d, &[2, 3]), sharding)?;
                // Another dtype on member 2.
                let bf = ModelLayout::new(2, vec![TensorLayout::new("w", DType::Bf16, [8, 4], Placement::rows(&[4, 4]))]).unwrap();
                let s2 = if me == 2 { &bf } else { &src };
                // Member 2's own check fails too (its source and destination dtypes differ): it
                // says so; the others say what differs.
                let dtype = if me == 2 {
                    "tensor `w`: dtype bf16 in the source layout"
                } else {
                    "member 2's source tensor `w`'s dtype is bf16, member 0's f32"
                };
                match comm.weight_sync(s2, &[0, 1], &dst, &[2, 3]) {
                    Err(Error::InvalidArgument(m)) if m.contains(dtype) => {}
                    other => return Err(format!("another dtype: {:?} (want `{dtype}`)", other.map(|_| ()))),
                }
                // A member whose own check fails (a destination group one short) still
                // takes part in the setup: it reports its own error, the others name it at
                // once (never waiting for it until the deadline).
                let dg: &[usize] = if me == 2 { &[2] } else { &[2, 3] };
                match comm.weight_sync(&src, &[0, 1], &dst, dg) {
                    Err(Error::InvalidArgument(m)) if me == 2 && m.contains("1 destination ranks given") => {}
                    Err(Error::InvalidArgument(m))
                        if me != 2
                            && m.contains("member 2 passed other layouts or groups")
                            && m.contains("member 2's destination group (members) is [2], member 0's [2, 3]") => {}
                    Err(e) => return Err(format!("a group one short on member 2: {e}")),
                    Ok(_) => return Err("a group one short on member 2: set up".into()),
                }
                comm.barrier().map_err(|e| format!("barrier: {e}"))?;

                let mut ws = comm.weight_sync(&src, &[0, 1], &dst, &[2, 3]).map_err(|e| format!("agreeing arguments: {e}"))?;
                match ws.role() {
                    WeightRole::Source(i) => {
                        ws.with_buffer_mut(|b| fill(&src, i, 1, b)).map_err(|e| e.to_string())?;
                        ws.publish(1).map_err(|e| e.to_string())?;
                        ws.wait_consumed(1).map_err(|e| e.to_string())?;
                    }
                    WeightRole::Destination(j) => {
                        ws.pull(1).map_err(|e| e.to_string())?;
                        ws.with_current(|v, b| if v == 1 { check(&dst, j, 1, b) } else { Err(format!("version {v}")) })
                            .map_err(|e| e.to_string())??;
                    }
                    WeightRole::None => return Err("no role".into()),
                }
                drop(ws);
                comm.barrier().map_err(|e| format!("barrier: {e}"))
            };
            go().map_err(|e| format!("rank {me}: {e}"))?;
            comm.finalize().map_err(|e| format!("rank {me}: finalize: {e}"))
        },
    );
    all_ok(res).unwrap();
}

/// A type of the program's own, derived through the re-exported `bytemuck` (no second copy).
#[derive(Clone, Copy, Debug, PartialEq, ferroccl::bytemuck::Pod, ferroccl::bytemuck::Zeroable)]
#[bytemuck(crate = "ferroccl::bytemuck")]
#[repr(C)]
struct Pair {
    a: u16,
    b: u16,
}

/// Typed views: a source writes a bf16 and an f32 tensor as elements
/// (`with_tensor_mut_as`), a destination reads them back as elements (`with_tensor_as`),
/// exactly; another element type is an invalid argument naming the tensor and both
/// dtypes, as is a whole-buffer view of a layout that mixes dtypes; the bytes stay
/// readable through `ferroccl::bytemuck`.
pub fn weight_sync_typed_views(s: &Suite) {
    use ferroccl::bf16;
    let layout = |ranks: usize| {
        ModelLayout::new(
            ranks,
            vec![
                TensorLayout::new("w.bf16", DType::Bf16, [4, 6], Placement::replicated(ranks)),
                TensorLayout::new("b.f32", DType::F32, [6, 1], Placement::replicated(ranks)),
            ],
        )
        .unwrap()
    };
    let all_f32 = ModelLayout::new(1, vec![TensorLayout::new("only", DType::F32, [3, 5], Placement::replicated(1))]).unwrap();
    let res = run_world(
        2,
        |r| params(s, r),
        |comm: Communicator| -> RankResult<()> {
            let me = comm.rank();
            let (src, dst) = (layout(1), layout(1));
            let go = || -> Result<(), String> {
                let mut ws = comm.weight_sync(&src, &[0], &dst, &[1]).map_err(|e| e.to_string())?;
                match ws.role() {
                    WeightRole::Source(_) => {
                        expect_err(
                            "f32 view of a bf16 tensor",
                            ws.with_tensor_mut_as::<f32, _>("w.bf16", |_| ()),
                            "tensor `w.bf16` is bf16, not f32",
                        )?;
                        expect_err(
                            "bf16 view of an f32 tensor",
                            ws.with_tensor_mut_as::<bf16, _>("b.f32", |_| ()),
                            "tensor `b.f32` is f32, not bf16",
                        )?;
                        expect_err("a mixed buffer", ws.with_buffer_mut_as::<bf16, _>(|_| ()), "tensor `b.f32` is f32, not bf16")?;
                        expect_err("unknown tensor", ws.with_tensor_mut_as::<f32, _>("nope", |_| ()), "no tensor `nope`")?;
                        let n = ws.with_tensor_mut_as::<bf16, _>("w.bf16", |w| {
                            w.iter_mut().enumerate().for_each(|(i, x)| *x = bf16::from_f32(i as f32 - 3.0));
                            w.len()
                        });
                        if n.map_err(|e| e.to_string())? != 24 {
                            return Err("w.bf16 is not 24 elements".into());
                        }
                        ws.with_tensor_mut_as::<f32, _>("b.f32", |b| b.iter_mut().enumerate().for_each(|(i, x)| *x = 0.5 * i as f32))
                            .map_err(|e| e.to_string())?;
                        ws.publish(1).map_err(|e| e.to_string())?;
                        ws.wait_consumed(1).map_err(|e| e.to_string())?;
                    }
                    WeightRole::Destination(_) => {
                        ws.pull(1).map_err(|e| e.to_string())?;
                        let w: Vec<bf16> = ws.with_tensor_as::<bf16, _>("w.bf16", |_, w| w.to_vec()).map_err(|e| e.to_string())?;
                        let want: Vec<bf16> = (0..24).map(|i| bf16::from_f32(i as f32 - 3.0)).collect();
                        if w != want {
                            return Err(format!("w.bf16: {w:?}"));
                        }
                        let b = ws.with_tensor_as::<f32, _>("b.f32", |v, b| (v, b.to_vec())).map_err(|e| e.to_string())?;
                        if b != (1, vec![0.0, 0.5, 1.0, 1.5, 2.0, 2.5]) {
                            return Err(format!("b.f32: {b:?}"));
                        }
                        expect_err(
                            "f32 view of a bf16 tensor",
                            ws.with_tensor_as::<f32, _>("w.bf16", |_, _| ()),
                            "tensor `w.bf16` is bf16, not f32",
                        )?;
                        expect_err("a mixed buffer", ws.with_current_as::<f32, _>(|_, _| ()), "tensor `w.bf16` is bf16, not f32")?;
                        // A program's own Pod type, through the re-exported bytemuck.
                        let pairs: Vec<Pair> = ws
                            .with_tensor("w.bf16", |_, b| b.chunks_exact(4).map(ferroccl::bytemuck::pod_read_unaligned::<Pair>).collect())
                            .map_err(|e| e.to_string())?;
                        if pairs.len() != 12 || pairs[3] != (Pair { a: want[6].to_bits(), b: want[7].to_bits() }) {
                            return Err(format!("pairs: {pairs:?}"));
                        }
                    }
                    WeightRole::None => return Err("no role".into()),
                }
                drop(ws);
                // A whole buffer of one dtype is a typed view of it.
                let mut ws = comm.weight_sync(&all_f32, &[0], &all_f32, &[1]).map_err(|e| e.to_string())?;
                match ws.role() {
                    WeightRole::Source(_) => {
                        ws.with_buffer_mut_as::<f32, _>(|b| b.fill(7.0)).map_err(|e| e.to_string())?;
                        ws.publish(1).map_err(|e| e.to_string())?;
                        ws.wait_consumed(1).map_err(|e| e.to_string())?;
                    }
                    _ => {
                        ws.pull(1).map_err(|e| e.to_string())?;
                        let ok =
                            ws.with_current_as::<f32, _>(|_, b| b.len() == 15 && b.iter().all(|&x| x == 7.0)).map_err(|e| e.to_string())?;
                        if !ok {
                            return Err("the f32 buffer is not 15 sevens".into());
                        }
                    }
                }
                drop(ws);
                comm.barrier().map_err(|e| e.to_string())
            };
            go().map_err(|e| format!("rank {me}: {e}"))?;
            comm.finalize().map_err(|e| format!("rank {me}: finalize: {e}"))
        },
    );
    all_ok(res).unwrap();
}
