//! Buffers of out-of-band frames (snapshots), used again instead of freed. A snapshot round
//! moves tens of megabytes every step; in fresh buffers each frame's pages are faulted in and
//! zeroed by the kernel once on the sender and once on the receiver. Two pools keep them: the
//! copy thread takes a buffer and the write thread returns it once the frame is written, and a
//! receiver gives back a snapshot it has replaced, which the reader threads fill with the next.

use std::sync::{Arc, Mutex};

/// Most buffers a pool keeps, and most bytes (beyond either, given-back buffers are freed): a
/// round sends or receives a few dozen snapshots at most, and the pool holds at most one
/// round's buffers in a steady run (taken during the round, given back after it).
const MAX_BUFFERS: usize = 64;
const MAX_BYTES: usize = 1 << 30;
/// Smaller buffers are not worth keeping: their allocation is cheap.
const MIN_CAPACITY: usize = 64 << 10;

/// A shared set of empty buffers.
#[derive(Clone, Default)]
pub(super) struct BufferPool(Arc<Mutex<Vec<Vec<u8>>>>);

impl BufferPool {
    /// An empty buffer with room for `capacity` bytes: the smallest kept one that fits, if any.
    pub fn take(&self, capacity: usize) -> Option<Vec<u8>> {
        let mut kept = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let best = kept.iter().enumerate().filter(|(_, b)| b.capacity() >= capacity).min_by_key(|(_, b)| b.capacity()).map(|(i, _)| i)?;
        Some(kept.swap_remove(best))
    }

    /// Keep `buffer` (emptied) for a later frame, unless it is small or the pool is full.
    pub fn give(&self, mut buffer: Vec<u8>) {
        if buffer.capacity() < MIN_CAPACITY {
            return;
        }
        buffer.clear();
        let mut kept = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let bytes: usize = kept.iter().map(|b| b.capacity()).sum();
        if kept.len() < MAX_BUFFERS && bytes + buffer.capacity() <= MAX_BYTES {
            kept.push(buffer);
        }
    }

    /// Buffers kept now.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn takes_the_smallest_buffer_that_fits_and_keeps_a_bounded_number() {
        let pool = BufferPool::default();
        assert!(pool.take(1).is_none());
        pool.give(Vec::with_capacity(1 << 20));
        pool.give(Vec::with_capacity(4 << 20));
        pool.give(vec![7u8; 2 << 20]);
        pool.give(Vec::with_capacity(100)); // too small to keep
        assert_eq!(pool.len(), 3);
        let b = pool.take(1_500_000).expect("a buffer of 2 MiB fits");
        assert!(b.is_empty(), "given back emptied");
        assert_eq!(b.capacity(), 2 << 20, "the smallest that fits");
        assert!(pool.take(5 << 20).is_none(), "none fits");
        assert_eq!(pool.len(), 2);
        for _ in 0..2 * MAX_BUFFERS {
            pool.give(Vec::with_capacity(MIN_CAPACITY));
        }
        assert_eq!(pool.len(), MAX_BUFFERS);
        // And a bounded number of bytes: huge frames are not hoarded.
        let pool = BufferPool::default();
        pool.give(Vec::with_capacity(MAX_BYTES / 2 + 1));
        pool.give(Vec::with_capacity(MAX_BYTES / 2 + 1));
        assert_eq!(pool.len(), 1);
    }
}
