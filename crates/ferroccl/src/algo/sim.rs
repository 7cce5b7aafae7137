//! A deterministic in-memory simulator for the schedules of one collective call.
//!
//! [`run`] executes the `n` ranks' schedules the way the executor does, under the strictest
//! transfer semantics a transport may have:
//!
//! * each rank starts its steps in index order; a step starts once every step before it
//!   has started and its `deps` have completed (head-of-line, like the executor);
//! * local steps (`Reduce`, `ReduceMany`, `Copy`, `FinishAvg`) run with the kernels of
//!   `ferroccl-kernels` and complete at once;
//! * transfers are *synchronous* (rendezvous): the k-th `Send` from a to b and the k-th
//!   `Recv` on b from a complete together, once both have started; the data is copied then.
//!   A schedule that works so also works with eager (buffered) sends.
//!
//! It reports, instead of hanging or corrupting: a deadlock (no step can start or complete
//! while some remain, naming each rank's first blocked step), transfers that match with
//! different lengths, ranges out of bounds or not whole elements, zero-length transfers,
//! bad deps, kernel errors and *races*: a step started while a transfer still in flight
//! on the same rank writes what it reads or reads or writes what it writes.
//!
//! [`check_deps`] checks statically that every pair of conflicting steps is ordered by deps
//! (so an executor that runs local steps asynchronously is safe too).

use std::collections::VecDeque;
use std::fmt;

use ferroccl_kernels::{finish_avg_bytes, reduce_into_bytes, reduce_many_bytes, DType, KernelError, ReduceOp};

use super::{Action, Buf, Schedule, Slice};

/// Why a simulated call failed.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum SimError {
    /// No step can make progress while some remain: `(rank, first step not completed, op)`.
    Deadlock(Vec<(usize, usize, String)>),
    /// The k-th send from `from` to `to` and the k-th receive do not have the same length.
    LengthMismatch { from: usize, to: usize, send_step: usize, recv_step: usize, send_len: usize, recv_len: usize },
    /// A step is malformed (out of bounds, not whole elements, zero-length transfer, bad
    /// peer or dep, mismatched operand lengths).
    Invalid { rank: usize, step: usize, why: String },
    /// Step `step` started while step `other` (a transfer in flight) touched the same bytes.
    Race { rank: usize, step: usize, other: usize },
    /// Two steps conflict but no chain of deps orders them ([`check_deps`]).
    Unordered { rank: usize, first: usize, second: usize },
    /// A kernel refused a local step.
    Kernel { rank: usize, step: usize, err: KernelError },
    /// The call needs `n` schedules, inputs and outputs.
    Arity(String),
}

impl fmt::Display for SimError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SimError::Deadlock(blocked) => {
                f.write_str("deadlock:")?;
                for (rank, step, op) in blocked {
                    write!(f, " [rank {rank} step {step}: {op}]")?;
                }
                Ok(())
            }
            SimError::LengthMismatch { from, to, send_step, recv_step, send_len, recv_len } => {
                write!(f, "rank {from} step {send_step} sends {send_len} bytes to rank {to}, whose step {recv_step} receives {recv_len}")
            }
            SimError::Invalid { rank, step, why } => write!(f, "rank {rank} step {step}: {why}"),
            SimError::Race { rank, step, other } => {
                write!(f, "rank {rank}: step {step} started while step {other}, in flight, touches the same bytes")
            }
            SimError::Unordered { rank, first, second } => {
                write!(f, "rank {rank}: steps {first} and {second} conflict but no deps order them")
            }
            SimError::Kernel { rank, step, err } => write!(f, "rank {rank} step {step}: kernel: {err}"),
            SimError::Arity(why) => f.write_str(why),
        }
    }
}

impl std::error::Error for SimError {}

/// One rank's memory.
struct Mem {
    input: Vec<u8>,
    output: Vec<u8>,
    scratch: Vec<u8>,
    in_place: bool,
}

impl Mem {
    fn buf(&self, b: Buf) -> &Vec<u8> {
        match b {
            Buf::Input if !self.in_place => &self.input,
            Buf::Input | Buf::Output => &self.output,
            Buf::Scratch => &self.scratch,
        }
    }
    fn buf_mut(&mut self, b: Buf) -> &mut Vec<u8> {
        match b {
            Buf::Input if !self.in_place => &mut self.input,
            Buf::Input | Buf::Output => &mut self.output,
            Buf::Scratch => &mut self.scratch,
        }
    }
    fn read(&self, s: &Slice) -> Vec<u8> {
        self.buf(s.buf)[s.range.clone()].to_vec()
    }
    fn write(&mut self, s: &Slice, data: &[u8]) {
        self.buf_mut(s.buf)[s.range.clone()].copy_from_slice(data);
    }
}

/// The byte ranges a step reads and writes.
pub(crate) fn accesses(op: &Action) -> (Vec<&Slice>, Vec<&Slice>) {
    match op {
        Action::Send { src, .. } => (vec![src], vec![]),
        Action::Recv { dst, .. } | Action::Get { dst, .. } => (vec![], vec![dst]),
        Action::Put { src, .. } => (vec![src], vec![]),
        Action::Signal { .. } | Action::WaitSignal { .. } => (vec![], vec![]),
        Action::Reduce { dst, src } => (vec![dst, src], vec![dst]),
        Action::ReduceMany { dst, srcs } => (srcs.iter().collect(), vec![dst]),
        Action::Copy { dst, src } => (vec![src], vec![dst]),
        Action::FinishAvg { dst, .. } => (vec![dst], vec![dst]),
    }
}

/// A step's accesses with `Input` folded into `Output` for in-place calls: (buffer, range,
/// writes).
type Access = (Buf, usize, usize, bool);

fn access_list(op: &Action, in_place: bool) -> Vec<Access> {
    let (reads, writes) = accesses(op);
    let canon = |s: &Slice| if in_place && s.buf == Buf::Input { Buf::Output } else { s.buf };
    let r = reads.into_iter().map(|s| (canon(s), s.range.start, s.range.end, false));
    r.chain(writes.into_iter().map(|s| (canon(s), s.range.start, s.range.end, true))).filter(|a| a.1 < a.2).collect()
}

/// Whether two slices overlap, given whether `Input` aliases `Output`.
fn overlap(a: &Slice, b: &Slice, in_place: bool) -> bool {
    let canon = |s: &Slice| if in_place && s.buf == Buf::Input { Buf::Output } else { s.buf };
    canon(a) == canon(b) && a.range.start < b.range.end && b.range.start < a.range.end && !a.range.is_empty() && !b.range.is_empty()
}

/// Whether two steps conflict (one writes what the other reads or writes).
fn conflict(a: &[Access], b: &[Access]) -> bool {
    a.iter().any(|x| b.iter().any(|y| (x.3 || y.3) && x.0 == y.0 && x.1 < y.2 && y.1 < x.2))
}

/// Checks one step's shape against the buffers.
fn validate(rank: usize, step: usize, s: &Schedule, n: usize, elem: usize, lens: (usize, usize), in_place: bool) -> Result<(), SimError> {
    let bad = |why: String| Err(SimError::Invalid { rank, step, why });
    let st = &s.steps[step];
    if let Some(&d) = st.deps.iter().find(|&&d| d >= step) {
        return bad(format!("dep {d} is not an earlier step"));
    }
    let (reads, writes) = accesses(&st.op);
    for sl in reads.iter().chain(&writes) {
        let cap = match sl.buf {
            Buf::Input if in_place => return bad("an in-place schedule references Input".into()),
            Buf::Input => lens.0,
            Buf::Output => lens.1,
            Buf::Scratch => s.scratch_bytes,
        };
        if sl.range.start > sl.range.end || sl.range.end > cap {
            return bad(format!("{:?} {:?} out of bounds ({cap} bytes)", sl.buf, sl.range));
        }
        if sl.range.start % elem != 0 || sl.len() % elem != 0 {
            return bad(format!("{:?} {:?} is not whole {elem}-byte elements", sl.buf, sl.range));
        }
    }
    match &st.op {
        Action::Get { .. } | Action::Put { .. } | Action::Signal { .. } | Action::WaitSignal { .. } => {
            return bad("one-sided steps are not simulated".into())
        }
        Action::Send { peer, src: sl } | Action::Recv { peer, dst: sl } => {
            if *peer >= n || *peer == rank {
                return bad(format!("transfer with peer {peer}"));
            }
            if sl.len() == 0 {
                return bad("zero-length transfer".into());
            }
        }
        Action::Reduce { dst, src } | Action::Copy { dst, src } if dst.len() != src.len() => {
            return bad(format!("operands of {} and {} bytes", dst.len(), src.len()));
        }
        Action::Reduce { dst, src } | Action::Copy { dst, src } if overlap(dst, src, in_place) => {
            return bad("dst and src overlap".into());
        }
        Action::ReduceMany { dst, srcs } if srcs.is_empty() || srcs.iter().any(|s| s.len() != dst.len()) => {
            return bad("ReduceMany operands differ in length".into());
        }
        Action::ReduceMany { dst, srcs } if srcs.iter().any(|s| overlap(dst, s, in_place) && s.range != dst.range) => {
            return bad("ReduceMany dst partly overlaps a source".into());
        }
        Action::FinishAvg { n: 0, .. } => return bad("FinishAvg by 0".into()),
        _ => {}
    }
    Ok(())
}

/// Runs one collective call: `schedules[r]` on rank `r` with buffers `inputs[r]` and
/// `outputs[r]` (`Input` aliases `Output` when `in_place`; `inputs` are then ignored).
/// Scratch starts filled with `0xA5`. Returns every rank's output buffer.
///
/// # Errors
///
/// See [`SimError`].
pub(crate) fn run(
    schedules: &[Schedule],
    dtype: DType,
    op: ReduceOp,
    in_place: bool,
    inputs: Vec<Vec<u8>>,
    outputs: Vec<Vec<u8>>,
) -> Result<Vec<Vec<u8>>, SimError> {
    let n = schedules.len();
    if inputs.len() != n || outputs.len() != n {
        return Err(SimError::Arity(format!("{n} schedules, {} inputs, {} outputs", inputs.len(), outputs.len())));
    }
    let elem = dtype.size();
    let mut mem: Vec<Mem> = inputs
        .into_iter()
        .zip(outputs)
        .zip(schedules)
        .map(|((input, output), s)| Mem { input, output, scratch: vec![0xA5; s.scratch_bytes], in_place })
        .collect();
    for (r, s) in schedules.iter().enumerate() {
        let lens = (mem[r].input.len(), mem[r].output.len());
        for i in 0..s.steps.len() {
            validate(r, i, s, n, elem, lens, in_place)?;
        }
    }
    let acc: Vec<Vec<Vec<Access>>> = schedules.iter().map(|s| s.steps.iter().map(|st| access_list(&st.op, in_place)).collect()).collect();
    let mut next = vec![0usize; n];
    let mut done: Vec<Vec<bool>> = schedules.iter().map(|s| vec![false; s.steps.len()]).collect();
    let mut in_flight: Vec<Vec<usize>> = vec![Vec::new(); n];
    // Posted, unmatched sends and receives per (from, to).
    let mut sends: Vec<VecDeque<usize>> = vec![VecDeque::new(); n * n];
    let mut recvs: Vec<VecDeque<usize>> = vec![VecDeque::new(); n * n];
    loop {
        let mut progress = false;
        for r in 0..n {
            let steps = &schedules[r].steps;
            while next[r] < steps.len() && steps[next[r]].deps.iter().all(|&d| done[r][d]) {
                let i = next[r];
                next[r] += 1;
                progress = true;
                if let Some(&other) = in_flight[r].iter().find(|&&j| conflict(&acc[r][j], &acc[r][i])) {
                    return Err(SimError::Race { rank: r, step: i, other });
                }
                match &steps[i].op {
                    Action::Send { peer, .. } => {
                        sends[r * n + peer].push_back(i);
                        in_flight[r].push(i);
                    }
                    Action::Recv { peer, .. } => {
                        recvs[peer * n + r].push_back(i);
                        in_flight[r].push(i);
                    }
                    local => {
                        exec_local(&mut mem[r], local, dtype, op).map_err(|err| SimError::Kernel { rank: r, step: i, err })?;
                        done[r][i] = true;
                    }
                }
            }
        }
        for from in 0..n {
            for to in 0..n {
                let k = from * n + to;
                while !sends[k].is_empty() && !recvs[k].is_empty() {
                    let (si, ri) = (sends[k].pop_front().unwrap_or_default(), recvs[k].pop_front().unwrap_or_default());
                    let (Action::Send { src, .. }, Action::Recv { dst, .. }) = (&schedules[from].steps[si].op, &schedules[to].steps[ri].op)
                    else {
                        unreachable!("the queues hold only sends and receives")
                    };
                    if src.len() != dst.len() {
                        return Err(SimError::LengthMismatch {
                            from,
                            to,
                            send_step: si,
                            recv_step: ri,
                            send_len: src.len(),
                            recv_len: dst.len(),
                        });
                    }
                    let data = mem[from].read(src);
                    mem[to].write(dst, &data);
                    done[from][si] = true;
                    done[to][ri] = true;
                    in_flight[from].retain(|&j| j != si);
                    in_flight[to].retain(|&j| j != ri);
                    progress = true;
                }
            }
        }
        if done.iter().all(|d| d.iter().all(|&x| x)) {
            return Ok(mem.into_iter().map(|m| m.output).collect());
        }
        if !progress {
            let blocked = (0..n)
                .filter_map(|r| {
                    let i = done[r].iter().position(|&x| !x)?;
                    Some((r, i, format!("{:?}", schedules[r].steps[i].op)))
                })
                .collect();
            return Err(SimError::Deadlock(blocked));
        }
    }
}

fn exec_local(m: &mut Mem, op: &Action, dtype: DType, rop: ReduceOp) -> Result<(), KernelError> {
    match op {
        Action::Reduce { dst, src } => {
            let mut acc = m.read(dst);
            reduce_into_bytes(dtype, rop, &mut acc, &m.read(src))?;
            m.write(dst, &acc);
        }
        Action::ReduceMany { dst, srcs } => {
            let data: Vec<Vec<u8>> = srcs.iter().map(|s| m.read(s)).collect();
            let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
            let mut out = vec![0u8; dst.len()];
            reduce_many_bytes(dtype, rop, &refs, &mut out)?;
            m.write(dst, &out);
        }
        Action::Copy { dst, src } => {
            let data = m.read(src);
            m.write(dst, &data);
        }
        Action::FinishAvg { dst, n } => {
            let mut acc = m.read(dst);
            finish_avg_bytes(dtype, &mut acc, *n)?;
            m.write(dst, &acc);
        }
        Action::Send { .. }
        | Action::Recv { .. }
        | Action::Get { .. }
        | Action::Put { .. }
        | Action::Signal { .. }
        | Action::WaitSignal { .. } => unreachable!("transfers are not local"),
    }
    Ok(())
}

/// Checks that deps order every pair of conflicting steps of `s` (the later one must depend,
/// directly or through other steps, on the earlier one). Quadratic: for schedules of up to a
/// few thousand steps.
///
/// # Errors
///
/// [`SimError::Unordered`] naming the first such pair.
pub(crate) fn check_deps(rank: usize, s: &Schedule, in_place: bool) -> Result<(), SimError> {
    let len = s.steps.len();
    let acc: Vec<Vec<Access>> = s.steps.iter().map(|st| access_list(&st.op, in_place)).collect();
    let words = len.div_ceil(64);
    // reach[j]: bitset of the steps j transitively depends on.
    let mut reach = vec![0u64; len * words];
    for j in 0..len {
        for &d in &s.steps[j].deps {
            reach[j * words + d / 64] |= 1 << (d % 64);
            for w in 0..words {
                let bits = reach[d * words + w];
                reach[j * words + w] |= bits;
            }
        }
    }
    for j in 0..len {
        for i in 0..j {
            if reach[j * words + i / 64] & (1 << (i % 64)) == 0 && conflict(&acc[i], &acc[j]) {
                return Err(SimError::Unordered { rank, first: i, second: j });
            }
        }
    }
    Ok(())
}
