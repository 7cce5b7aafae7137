//! Running the sweep on one rank: buffers, timing, checking, and collecting the results on
//! rank 0.

use std::io::Write;
use std::time::Instant;

use ferroccl::{Communicator, ReduceOp};

use crate::args::{format_size, Options, Variants};
use crate::colls::{self, Coll, Layout};
use crate::data::{corrupt, count_wrong, Patterns, Val};
use crate::report;
use crate::results::{Cell, CollResult, Row};
use crate::Failure;

/// What a rank measured for one variant: time (us) and wrong elements.
#[derive(Clone, Copy, Debug, Default)]
struct Local {
    time_us: f64,
    wrong: u64,
}

/// Context of the sweep on this rank.
struct Ctx<'a, T> {
    comm: &'a Communicator,
    o: &'a Options,
    pats: &'a Patterns<T>,
    algo: &'a str,
}

fn coll_err(comm: &Communicator, coll: Coll, l: &Layout, variant: &str, e: ferroccl::Error) -> Failure {
    Failure::Collective { rank: comm.rank(), what: format!("{coll} {} B {variant}", l.bytes), source: Box::new(e) }
}

/// One out-of-place call.
fn call_oop<T: Val>(comm: &Communicator, coll: Coll, op: ReduceOp, root: usize, send: &[T], recv: &mut [T]) -> ferroccl::Result<()> {
    let (r, n) = (comm.rank(), comm.size());
    match coll {
        Coll::AllReduce => comm.allreduce_into(send, recv, op),
        Coll::AllGather => comm.allgather_into(send, recv),
        Coll::ReduceScatter => comm.reduce_scatter_into(send, recv, op),
        Coll::Reduce => comm.reduce_into(send, recv, op, root),
        Coll::AllToAll => comm.alltoall(send, recv),
        Coll::AllToAllV => {
            // Uniform counts: one block to and from every rank, in rank order.
            let block = send.len() / n.max(1);
            let counts = vec![block; n];
            let displs: Vec<usize> = (0..n).map(|p| p * block).collect();
            comm.alltoallv(send, &counts, &displs, recv, &counts, &displs)
        }
        Coll::AllGatherV => {
            // Uniform counts: one block from every rank, in rank order.
            let counts = vec![send.len(); n];
            let displs: Vec<usize> = (0..n).map(|p| p * send.len()).collect();
            comm.allgatherv(send, recv, &counts, &displs)
        }
        Coll::ReduceScatterV => comm.reduce_scatterv(send, recv, &vec![recv.len(); n], op),
        Coll::SendRecv => comm.sendrecv(send, (r + 1) % n, recv, (r + n - 1) % n),
        // No out-of-place form; never called (see Coll::has_out_of_place).
        Coll::Broadcast => comm.broadcast(recv, root),
    }
}

/// One in-place call.
fn call_ip<T: Val>(comm: &Communicator, coll: Coll, op: ReduceOp, root: usize, buf: &mut [T]) -> ferroccl::Result<()> {
    match coll {
        Coll::AllReduce => comm.allreduce(buf, op),
        Coll::AllGather => comm.allgather(buf),
        Coll::ReduceScatter => comm.reduce_scatter(buf, op),
        Coll::Broadcast => comm.broadcast(buf, root),
        Coll::Reduce => comm.reduce(buf, op, root),
        // No in-place form; never called (see Coll::has_in_place).
        Coll::AllToAll | Coll::AllToAllV | Coll::SendRecv | Coll::AllGatherV | Coll::ReduceScatterV => Ok(()),
    }
}

/// A value no correct result holds in the checked runs (sums of up to 16 ranks stay within
/// +-64): receive buffers start with it, so a call that writes nothing is caught.
fn sentinel<T: Val>() -> T {
    T::from_small(99)
}

impl<T: Val> Ctx<'_, T> {
    /// Fills the out-of-place buffers for a checked (or timed) call.
    fn fill_oop(&self, send: &mut [T], recv: &mut [T]) {
        self.pats.fill(self.comm.rank(), send, 0);
        recv.fill(sentinel());
    }

    /// Fills the in-place buffer.
    fn fill_ip(&self, coll: Coll, l: &Layout, buf: &mut [T]) {
        let r = self.comm.rank();
        match coll {
            Coll::AllGather => {
                buf.fill(sentinel());
                self.pats.fill(r, &mut buf[r * l.block..(r + 1) * l.block], 0);
            }
            _ => self.pats.fill(r, buf, 0),
        }
    }

    /// Counts wrong elements of an out-of-place result (after corrupting it if asked).
    fn check_oop(&self, coll: Coll, l: &Layout, recv: &mut [T]) -> u64 {
        let (r, n, root) = (self.comm.rank(), self.comm.size(), self.o.root);
        let p = self.pats;
        let checked: &mut [T] = match coll {
            Coll::Reduce if r != root => &mut [],
            _ => recv,
        };
        if self.o.corrupt_rank == Some(r) {
            corrupt(checked);
        }
        let wrong = match coll {
            Coll::AllReduce | Coll::Reduce => count_wrong(&p.reduced, checked, 0),
            Coll::AllGather | Coll::AllGatherV => {
                (0..n).map(|q| count_wrong(&p.inputs[q], &checked[q * l.block..(q + 1) * l.block], 0)).sum()
            }
            Coll::ReduceScatter | Coll::ReduceScatterV => count_wrong(&p.reduced, checked, r * l.block),
            Coll::AllToAll | Coll::AllToAllV => {
                (0..n).map(|q| count_wrong(&p.inputs[q], &checked[q * l.block..(q + 1) * l.block], r * l.block)).sum()
            }
            Coll::SendRecv => count_wrong(&p.inputs[(r + n - 1) % n], checked, 0),
            Coll::Broadcast => count_wrong(&p.inputs[root], checked, 0),
        };
        wrong as u64
    }

    /// Counts wrong elements of an in-place result (after corrupting it if asked).
    fn check_ip(&self, coll: Coll, l: &Layout, buf: &mut [T]) -> u64 {
        let (r, n, root) = (self.comm.rank(), self.comm.size(), self.o.root);
        let p = self.pats;
        let checked: &mut [T] = match coll {
            Coll::Reduce if r != root => &mut [],
            Coll::ReduceScatter => &mut buf[r * l.block..(r + 1) * l.block],
            _ => buf,
        };
        if self.o.corrupt_rank == Some(r) {
            corrupt(checked);
        }
        let wrong = match coll {
            Coll::AllReduce | Coll::Reduce => count_wrong(&p.reduced, checked, 0),
            Coll::AllGather => (0..n).map(|q| count_wrong(&p.inputs[q], &checked[q * l.block..(q + 1) * l.block], 0)).sum(),
            Coll::ReduceScatter => count_wrong(&p.reduced, checked, r * l.block),
            Coll::Broadcast => count_wrong(&p.inputs[root], checked, 0),
            Coll::AllToAll | Coll::AllToAllV | Coll::SendRecv | Coll::AllGatherV | Coll::ReduceScatterV => 0,
        };
        wrong as u64
    }

    /// Times `iters` calls after `warmup`, between barriers; returns microseconds per call.
    fn time(&self, mut call: impl FnMut() -> ferroccl::Result<()>) -> ferroccl::Result<f64> {
        for _ in 0..self.o.warmup {
            call()?;
        }
        self.comm.barrier()?;
        let t0 = Instant::now();
        for _ in 0..self.o.iters {
            call()?;
        }
        let us = t0.elapsed().as_secs_f64() * 1e6 / self.o.iters as f64;
        self.comm.barrier()?;
        Ok(us)
    }

    fn run_oop(&self, coll: Coll, l: &Layout, send: &mut [T], recv: &mut [T]) -> Result<Local, Failure> {
        let (comm, op, root) = (self.comm, self.o.op, self.o.root);
        let err = |e| coll_err(comm, coll, l, "out-of-place", e);
        self.fill_oop(send, recv);
        let time_us = self.time(|| call_oop(comm, coll, op, root, send, recv)).map_err(err)?;
        let mut wrong = 0;
        if self.o.check {
            self.fill_oop(send, recv);
            call_oop(comm, coll, op, root, send, recv).map_err(err)?;
            wrong = self.check_oop(coll, l, recv);
        }
        Ok(Local { time_us, wrong })
    }

    fn run_ip(&self, coll: Coll, l: &Layout, buf: &mut [T]) -> Result<Local, Failure> {
        let (comm, op, root) = (self.comm, self.o.op, self.o.root);
        let err = |e| coll_err(comm, coll, l, "in-place", e);
        self.fill_ip(coll, l, buf);
        let time_us = self.time(|| call_ip(comm, coll, op, root, buf)).map_err(err)?;
        let mut wrong = 0;
        if self.o.check {
            self.fill_ip(coll, l, buf);
            call_ip(comm, coll, op, root, buf).map_err(err)?;
            wrong = self.check_ip(coll, l, buf);
        }
        Ok(Local { time_us, wrong })
    }

    /// `--plan`, out of place (allgather, reduce_scatter): builds the plan once, times
    /// `plan.run()`, then refills it through `input_mut` / `output_mut` for the check.
    fn run_plan_oop(&self, coll: Coll, l: &Layout, send: &mut [T], recv: &mut [T]) -> Result<Local, Failure> {
        let (comm, op) = (self.comm, self.o.op);
        let err = |e| coll_err(comm, coll, l, "out-of-place plan", e);
        self.fill_oop(send, recv);
        // Only the collectives of Coll::plan_out_of_place get here.
        let mut plan = match coll {
            Coll::ReduceScatter => comm.plan(ferroccl::op::reduce_scatter_into(send, recv, op)),
            _ => comm.plan(ferroccl::op::allgather_into(send, recv)),
        }
        .map_err(err)?;
        let time_us = self.time(|| plan.run()).map_err(err)?;
        let mut wrong = 0;
        if self.o.check {
            if let Some(input) = plan.input_mut() {
                self.pats.fill(comm.rank(), input, 0);
            }
            plan.output_mut().fill(sentinel());
            plan.run().map_err(err)?;
            wrong = self.check_oop(coll, l, plan.output_mut());
        }
        Ok(Local { time_us, wrong })
    }

    /// `--plan`, in place (allreduce, broadcast): as [`Ctx::run_plan_oop`], the input
    /// rewritten through `output_mut` for the check.
    fn run_plan_ip(&self, coll: Coll, l: &Layout, buf: &mut [T]) -> Result<Local, Failure> {
        let (comm, op, root) = (self.comm, self.o.op, self.o.root);
        let err = |e| coll_err(comm, coll, l, "in-place plan", e);
        self.fill_ip(coll, l, buf);
        // Only the collectives of Coll::plan_in_place get here.
        let mut plan = match coll {
            Coll::Broadcast => comm.plan(ferroccl::op::broadcast(buf, root)),
            _ => comm.plan(ferroccl::op::allreduce(buf, op)),
        }
        .map_err(err)?;
        let time_us = self.time(|| plan.run()).map_err(err)?;
        let mut wrong = 0;
        if self.o.check {
            self.fill_ip(coll, l, plan.output_mut());
            plan.run().map_err(err)?;
            wrong = self.check_ip(coll, l, plan.output_mut());
        }
        Ok(Local { time_us, wrong })
    }

    /// Runs one row on this rank; rank 0 gets the row (times maxed, wrong summed over ranks).
    fn row(&self, coll: Coll, size: usize) -> Result<Option<Row>, Failure> {
        let comm = self.comm;
        let n = comm.size();
        let l = coll.layout(size, n, self.o.dtype);
        let plan = self.o.plan;
        let (has_oop, has_ip) =
            if plan { (coll.plan_out_of_place(), coll.plan_in_place()) } else { (coll.has_out_of_place(), coll.has_in_place()) };
        let do_oop = has_oop && self.o.variants != Variants::InPlaceOnly;
        let do_ip = has_ip && self.o.variants != Variants::OutOfPlaceOnly;
        let mut recv = vec![T::from_small(0); l.recv];
        let mut oop = None;
        if do_oop {
            let mut send = vec![T::from_small(0); l.send];
            oop =
                Some(if plan { self.run_plan_oop(coll, &l, &mut send, &mut recv)? } else { self.run_oop(coll, &l, &mut send, &mut recv)? });
        }
        let mut ip = None;
        if do_ip {
            // The in-place buffer is the larger of the two (send for reduce_scatter).
            let mut buf = if l.send > l.recv { vec![T::from_small(0); l.send] } else { recv };
            ip = Some(if plan { self.run_plan_ip(coll, &l, &mut buf)? } else { self.run_ip(coll, &l, &mut buf)? });
        }
        let mine = [
            oop.map_or(0.0, |c| c.time_us),
            oop.map_or(0.0, |c| c.wrong as f64),
            ip.map_or(0.0, |c| c.time_us),
            ip.map_or(0.0, |c| c.wrong as f64),
        ];
        let Some(all) = gather(comm, &mine).map_err(|e| Failure::Collective {
            rank: comm.rank(),
            what: "collecting times".into(),
            source: Box::new(e),
        })?
        else {
            return Ok(None);
        };
        let max = |k: usize| all.iter().map(|v| v[k]).fold(0.0, f64::max);
        let sum = |k: usize| all.iter().map(|v| v[k] as u64).sum::<u64>();
        let cell = |k: usize| {
            let time_us = max(k);
            Cell {
                time_us,
                algbw: colls::algbw(l.bytes, time_us),
                busbw: colls::busbw(coll, n, l.bytes, time_us),
                wrong: self.o.check.then(|| sum(k + 1)),
            }
        };
        Ok(Some(Row {
            size: l.bytes,
            count: l.count,
            dtype: self.o.dtype,
            op: coll.reduces().then_some(self.o.op),
            root: coll.rooted().then_some(self.o.root),
            algo: match coll.collective(self.o.root) {
                None => "p2p".to_string(),
                Some(c) if self.algo == "auto" => {
                    // alltoallv's count: the rank's total sent (the whole send buffer).
                    let per_rank = if coll.blocked() && coll != Coll::AllToAllV { l.count / self.comm.size().max(1) } else { l.count };
                    self.comm.algorithm_for(c, self.o.dtype, self.o.op, per_rank).to_string()
                }
                Some(_) => self.algo.to_string(),
            },
            oop: do_oop.then(|| cell(0)),
            ip: do_ip.then(|| cell(2)),
        }))
    }
}

/// Sends `mine` to rank 0; rank 0 returns every rank's values (its own first).
pub fn gather(comm: &Communicator, mine: &[f64; 4]) -> ferroccl::Result<Option<Vec<[f64; 4]>>> {
    if comm.rank() != 0 {
        comm.send(mine, 0)?;
        return Ok(None);
    }
    let mut all = vec![*mine];
    for q in 1..comm.size() {
        let mut v = [0f64; 4];
        comm.recv(&mut v, q)?;
        all.push(v);
    }
    Ok(Some(all))
}

/// Runs every collective of the sweep on this rank, printing rows on rank 0 as they come.
/// Returns the results on rank 0 (empty elsewhere).
pub fn sweep<T: Val>(comm: &Communicator, o: &Options, algo: &str) -> Result<Vec<CollResult>, Failure> {
    let pats = Patterns::<T>::new(comm.size(), o.op);
    let cx = Ctx { comm, o, pats: &pats, algo };
    let sizes = colls::sweep(o.min_bytes, o.max_bytes, o.factor);
    let mut results = Vec::new();
    for &coll in &o.colls {
        let mut rows = Vec::new();
        if comm.rank() == 0 {
            report::print_table_header(coll);
        }
        for (i, &size) in sizes.iter().enumerate() {
            if comm.rank() == 0 {
                eprintln!("ferroccl-perf: {coll} {} ({}/{})", format_size(size), i + 1, sizes.len());
            }
            if let Some(row) = cx.row(coll, size)? {
                report::print_row(&row);
                let _ = std::io::stdout().flush();
                rows.push(row);
            }
        }
        if comm.rank() == 0 {
            let res = CollResult { coll, rows };
            report::print_table_footer(&res, o);
            results.push(res);
        }
    }
    Ok(results)
}
