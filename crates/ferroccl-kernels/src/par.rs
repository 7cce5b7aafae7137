//! Local reductions and copies on several threads, for a rank that owns spare cores (one
//! rank per host with many cores, as between hosts): the buffer is cut into one piece per
//! thread at element boundaries, the calling thread takes the first piece and a rayon pool
//! of its own (never rayon's global pool, which the application may use) the others. Every
//! element is computed exactly as the one-thread kernel computes it (the ops are
//! element-wise), so results are bit-identical whatever the thread count.

use crate::kernels::check_multiple;
use crate::{DType, KernelError, Kernels, ReduceOp};

/// Pieces are cut at multiples of this many bytes (a multiple of every element size, and
/// of a page: no two threads write the same cache line).
const PIECE_ALIGN: usize = 4096;

/// A pool of threads for local reductions and copies (see the module doc).
pub struct ParPool {
    pool: rayon::ThreadPool,
    threads: usize,
}

impl std::fmt::Debug for ParPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParPool").field("threads", &self.threads).finish()
    }
}

impl ParPool {
    /// A pool that runs each operation on `threads` threads (the caller's and
    /// `threads - 1` workers, named `ferroccl-reduce-N`).
    ///
    /// # Errors
    ///
    /// `threads < 2`, or the worker threads could not be started (the message says why).
    pub fn new(threads: usize) -> Result<ParPool, String> {
        if threads < 2 {
            return Err(format!("a pool of {threads} thread(s): one thread needs no pool"));
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads - 1)
            .thread_name(|i| format!("ferroccl-reduce-{i}"))
            .build()
            .map_err(|e| format!("cannot start {} reduction threads: {e}", threads - 1))?;
        Ok(ParPool { pool, threads })
    }

    /// Threads each operation runs on.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// The piece length for `len` bytes.
    fn piece(&self, len: usize) -> usize {
        len.div_ceil(self.threads).div_ceil(PIECE_ALIGN).max(1) * PIECE_ALIGN
    }

    /// Runs `f(offset, piece of out)` on every piece of `out`, in parallel; the first error
    /// wins.
    fn each<E: Send>(&self, out: &mut [u8], f: impl Fn(usize, &mut [u8]) -> Result<(), E> + Sync) -> Result<(), E> {
        let piece = self.piece(out.len());
        let mut pieces = out.chunks_mut(piece).enumerate();
        let first = pieces.next();
        let errors = std::sync::Mutex::new(None);
        self.pool.in_place_scope(|s| {
            for (i, p) in pieces {
                let (f, errors) = (&f, &errors);
                s.spawn(move |_| {
                    if let Err(e) = f(i * piece, p) {
                        errors.lock().unwrap_or_else(std::sync::PoisonError::into_inner).get_or_insert(e);
                    }
                });
            }
            if let Some((_, p)) = first {
                if let Err(e) = f(0, p) {
                    errors.lock().unwrap_or_else(std::sync::PoisonError::into_inner).get_or_insert(e);
                }
            }
        });
        match errors.into_inner().unwrap_or_else(std::sync::PoisonError::into_inner) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// [`Kernels::reduce_into_bytes`] on this pool's threads.
    ///
    /// # Errors
    ///
    /// As [`Kernels::reduce_into_bytes`].
    pub fn reduce_into_bytes(&self, k: Kernels, dtype: DType, op: ReduceOp, acc: &mut [u8], src: &[u8]) -> Result<(), KernelError> {
        if acc.len() != src.len() {
            return Err(KernelError::LengthMismatch { acc: acc.len(), src: src.len() });
        }
        check_multiple(dtype, acc.len())?;
        self.each(acc, |at, p| k.reduce_into_bytes(dtype, op, p, &src[at..at + p.len()]))
    }

    /// [`Kernels::reduce_many_bytes`] on this pool's threads.
    ///
    /// # Errors
    ///
    /// As [`Kernels::reduce_many_bytes`].
    pub fn reduce_many_bytes(&self, k: Kernels, dtype: DType, op: ReduceOp, srcs: &[&[u8]], out: &mut [u8]) -> Result<(), KernelError> {
        if srcs.is_empty() {
            return Err(KernelError::NoInputs);
        }
        if let Some((index, s)) = srcs.iter().enumerate().find(|(_, s)| s.len() != out.len()) {
            return Err(KernelError::SourceLengthMismatch { index, src: s.len(), out: out.len() });
        }
        check_multiple(dtype, out.len())?;
        self.each(out, |at, p| {
            let parts: Vec<&[u8]> = srcs.iter().map(|s| &s[at..at + p.len()]).collect();
            k.reduce_many_bytes(dtype, op, &parts, p)
        })
    }

    /// `dst.copy_from_slice(src)` on this pool's threads.
    ///
    /// # Errors
    ///
    /// The lengths differ.
    pub fn copy(&self, dst: &mut [u8], src: &[u8]) -> Result<(), KernelError> {
        if dst.len() != src.len() {
            return Err(KernelError::LengthMismatch { acc: dst.len(), src: src.len() });
        }
        self.each(dst, |at, p| {
            p.copy_from_slice(&src[at..at + p.len()]);
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(len: usize, seed: u64) -> Vec<u8> {
        let mut x = seed | 1;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 24) as u8
            })
            .collect()
    }

    /// Every dtype and op, lengths around the piece boundaries, 2 to 4 threads: the same
    /// bytes as the one-thread kernel.
    #[test]
    fn pieces_on_several_threads_equal_one_thread() {
        let k = Kernels::detected();
        for threads in 2..=4 {
            let pool = ParPool::new(threads).unwrap();
            for dtype in DType::ALL {
                let es = dtype.size();
                for elems in [1usize, 7, 1024, 4096 / es * threads + 3, 300_001 / es] {
                    let len = elems * es;
                    let srcs: Vec<Vec<u8>> = (0..3).map(|s| bytes(len, 11 + s)).collect();
                    let views: Vec<&[u8]> = srcs.iter().map(Vec::as_slice).collect();
                    for op in ReduceOp::ALL {
                        let mut want = vec![0u8; len];
                        let one = k.reduce_many_bytes(dtype, op, &views, &mut want);
                        let mut got = vec![0u8; len];
                        let par = pool.reduce_many_bytes(k, dtype, op, &views, &mut got);
                        assert_eq!(one.is_ok(), par.is_ok(), "{dtype:?} {op:?} {elems}");
                        assert_eq!(want, got, "reduce_many {dtype:?} {op:?} {elems} elements, {threads} threads");
                        let step = if op == ReduceOp::Avg { ReduceOp::Sum } else { op };
                        let (mut a, mut b) = (srcs[0].clone(), srcs[0].clone());
                        let one = k.reduce_into_bytes(dtype, step, &mut a, &srcs[1]);
                        let par = pool.reduce_into_bytes(k, dtype, step, &mut b, &srcs[1]);
                        assert_eq!(one.is_ok(), par.is_ok());
                        assert_eq!(a, b, "reduce_into {dtype:?} {step:?} {elems} elements, {threads} threads");
                    }
                    let mut c = vec![0u8; len];
                    pool.copy(&mut c, &srcs[2]).unwrap();
                    assert_eq!(c, srcs[2]);
                }
            }
        }
    }

    #[test]
    fn bad_arguments_are_errors() {
        let k = Kernels::detected();
        let pool = ParPool::new(2).unwrap();
        assert!(ParPool::new(1).is_err());
        let mut out = vec![0u8; 8];
        assert!(pool.reduce_many_bytes(k, DType::F32, ReduceOp::Sum, &[], &mut out).is_err());
        assert!(pool.reduce_many_bytes(k, DType::F32, ReduceOp::Sum, &[&[0u8; 4][..]], &mut out).is_err());
        assert!(pool.reduce_into_bytes(k, DType::F32, ReduceOp::Sum, &mut out, &[0u8; 4]).is_err());
        assert!(pool.reduce_into_bytes(k, DType::F32, ReduceOp::Sum, &mut out[..6], &[0u8; 6]).is_err());
        assert!(pool.copy(&mut out, &[0u8; 4]).is_err());
    }
}
