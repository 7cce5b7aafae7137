//! A global allocator that counts allocations, for tests that prove a path allocates
//! nothing (a persistent plan's hot path). It forwards to the system allocator.
//!
//! ```
//! use ferroccl_mem::alloc_count::{allocations, CountingAlloc};
//! // In a test binary: #[global_allocator] static A: CountingAlloc = CountingAlloc;
//! let before = allocations();
//! let _ = before.wrapping_add(1); // no allocation
//! # let _ = CountingAlloc;
//! ```

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};

static ALLOCS: AtomicU64 = AtomicU64::new(0);

/// Counts every allocation, zeroed allocation and reallocation of the process (when
/// installed with `#[global_allocator]`).
#[derive(Debug, Clone, Copy, Default)]
pub struct CountingAlloc;

/// Allocations (including reallocations) made so far through [`CountingAlloc`].
pub fn allocations() -> u64 {
    ALLOCS.load(Ordering::SeqCst)
}

// SAFETY: every method forwards to `System` with the caller's arguments unchanged, so
// `System`'s guarantees (and the caller's obligations) carry over; the counter is an
// atomic and never allocates.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: forwarded unchanged (see the impl's comment).
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: forwarded unchanged.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded unchanged.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: forwarded unchanged.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}
