//! The one place that decides how a kernel's work is spread over the cores.
//!
//! [`run_parallel`] is the only primitive: it runs a job on every work item on the rayon pool —
//! the same threads the GEMMs run on, so one step never starts a thread of its own and never
//! has two sets of threads fighting for the cores — and returns the results in item order; with
//! a single core it runs on the caller's thread. The kernels use the thin helpers on top of it:
//! - [`for_each_parallel`] for indexed jobs (attention's (batch, head) pairs),
//! - [`map_slices_parallel`] / [`zip_slices_parallel`] for elementwise passes over whole parts
//!   (GELU and its derivative, whose loops vectorize),
//! - [`rows_parallel`] for passes over independent rows (softmax),
//! - [`reduction_part_len`] + [`run_parallel`] where each part returns a partial sum (layer
//!   and RMS norms' weight gradients, the cross-entropy's loss), added over the parts in part
//!   order.
//!
//! Where parts return partial sums, the part sizes fix the summation order, so they are fixed
//! by the shape alone ([`reduction_part_len`]), never by the cores: a worker pinned to 4 of 16
//! cores computes the bits one on all 16 does (deterministic training relies on it). Changing
//! it or the thresholds changes the numerics.

/// Cores to spread a kernel over: `std::thread::available_parallelism()` (1 when unknown).
/// `RAYON_NUM_THREADS` is not read here; it sizes only the rayon pool that the GEMMs run on.
///
/// Read once per process and kept: `available_parallelism` asks the kernel for the affinity mask
/// and opens and reads the cgroup's CPU quota files on every call, and the kernels ask before
/// every parallel pass — a fifth of a step's serial work on the calling thread when it was not
/// kept (`perf`, 2 cores). A process's cores do not change under it here: workers are pinned
/// before they start.
pub fn threads() -> usize {
    static THREADS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *THREADS.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Elementwise passes over fewer elements run on the calling thread.
pub(super) const ELEMENTWISE_MIN: usize = 1 << 16;

/// Row-wise passes over fewer elements run on the calling thread.
pub(super) const ROWWISE_MIN: usize = 1 << 15;

/// Elements per part when `rows` rows of `width` elements are cut into contiguous parts of whole
/// rows, one part per core: ⌈rows / cores⌉ rows each, or a single part holding every row when
/// there are fewer than `min_len` elements or one core.
pub(super) fn part_len(rows: usize, width: usize, min_len: usize) -> usize {
    let threads = threads();
    let rows_per_part = if rows * width < min_len || threads == 1 { rows.max(1) } else { rows.div_ceil(threads).max(1) };
    rows_per_part * width
}

/// Elements per part of a reduction — a pass whose parts return partial sums, added in part
/// order: whole rows, about `min_len` elements a part (one part when that holds every row),
/// whatever the number of cores, so that the sums do not depend on it.
pub(super) fn reduction_part_len(rows: usize, width: usize, min_len: usize) -> usize {
    let rows_per_part = (min_len / width.max(1)).clamp(1, rows.max(1));
    rows_per_part * width
}

/// Run `job` on every item of `work` on the rayon pool (on the calling thread with one core or
/// one item); the results come back in item order. A panic in a job is resumed on the caller.
pub(super) fn run_parallel<W: Send, R: Send>(work: Vec<W>, job: impl Fn(W) -> R + Sync + Send) -> Vec<R> {
    if threads() <= 1 || work.len() <= 1 {
        return work.into_iter().map(job).collect();
    }
    use rayon::prelude::*;
    work.into_par_iter().map(job).collect()
}

/// Run `a` and `b` side by side on the rayon pool (one after the other with one core), as
/// [`rayon::join`]: from outside the pool the calling thread waits for both.
pub(super) fn join<A: Send, B: Send>(a: impl FnOnce() -> A + Send, b: impl FnOnce() -> B + Send) -> (A, B) {
    if threads() <= 1 {
        return (a(), b());
    }
    rayon::join(a, b)
}

/// Run `job(i)` for i in 0..count over the cores, `i` interleaved across threads.
pub(super) fn for_each_parallel(count: usize, job: impl Fn(usize) + Sync + Send) {
    run_parallel((0..count).collect(), job);
}

/// `f(out_part, in_part)` over matching parts of a new output and `input`, on all cores when the
/// slice has at least [`ELEMENTWISE_MIN`] elements (for elementwise kernels that work on whole
/// slices, so that their loops vectorize).
pub(super) fn map_slices_parallel<T: Copy + Send + Sync + Default>(input: &[T], f: impl Fn(&mut [T], &[T]) + Sync + Send) -> Vec<T> {
    let mut out = vec![T::default(); input.len()];
    zip_slices_parallel(&mut out, input, f);
    out
}

/// `f(out_part, other_part)` over matching parts of `out` (changed in place) and `other`, on all
/// cores when the slice has at least [`ELEMENTWISE_MIN`] elements (elementwise: the split never
/// changes a value).
pub(super) fn zip_slices_parallel<T: Copy + Send + Sync>(out: &mut [T], other: &[T], f: impl Fn(&mut [T], &[T]) + Sync + Send) {
    assert_eq!(out.len(), other.len());
    let part = part_len(out.len(), 1, ELEMENTWISE_MIN);
    run_parallel(out.chunks_mut(part).zip(other.chunks(part)).collect(), |(o, i)| f(o, i));
}

/// Run `f(rows_in, rows_out)` over blocks of whole rows of length `width`, on all cores when the
/// slice has at least `min_len` elements ([`ROWWISE_MIN`] for a pass about as cheap as a copy per
/// element; less where each element costs more, an `exp`).
pub(super) fn rows_parallel<T: Copy + Send + Sync + Default>(
    input: &[T],
    width: usize,
    min_len: usize,
    f: impl Fn(&[T], &mut [T]) + Sync + Send,
) -> Vec<T> {
    let mut out = vec![T::default(); input.len()];
    let part = part_len(input.len() / width.max(1), width, min_len);
    run_parallel(out.chunks_mut(part).zip(input.chunks(part)).collect(), |(o, i)| f(i, o));
    out
}

/// A raw pointer that may cross into the pool's threads, for jobs that each write a
/// disjoint set of elements of one buffer (attention: one (batch, head) block each).
#[derive(Clone, Copy)]
pub(super) struct SharedMut<T>(pub(super) *mut T);
// SAFETY: only used for disjoint writes, see the call sites.
unsafe impl<T> Send for SharedMut<T> {}
unsafe impl<T> Sync for SharedMut<T> {}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn every_item_runs_once_and_results_keep_item_order() {
        for count in [0, 1, 2, 3, 7, 64] {
            let calls = AtomicUsize::new(0);
            let out = run_parallel((0..count).collect(), |i: usize| {
                calls.fetch_add(1, Ordering::Relaxed);
                i * i
            });
            assert_eq!(out, (0..count).map(|i| i * i).collect::<Vec<_>>());
            assert_eq!(calls.load(Ordering::Relaxed), count);
            let seen: Vec<AtomicUsize> = (0..count).map(|_| AtomicUsize::new(0)).collect();
            for_each_parallel(count, |i| {
                seen[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(seen.iter().all(|s| s.load(Ordering::Relaxed) == 1));
        }
    }

    #[test]
    fn parts_are_whole_rows_one_per_core_above_the_threshold() {
        let cores = threads();
        assert_eq!(part_len(10, 3, 1 << 15), 30, "small: one part");
        assert_eq!(part_len(0, 3, 1 << 15), 3, "empty: one (empty) part");
        let (rows, width) = (1001usize, 64);
        let expected = if cores == 1 { rows } else { rows.div_ceil(cores) };
        assert_eq!(part_len(rows, width, 1 << 15), expected * width);
    }

    #[test]
    fn reduction_parts_are_fixed_by_the_shape_not_the_cores() {
        // About `min_len` elements of whole rows a part, one part when that holds every row.
        assert_eq!(reduction_part_len(1000, 64, 1 << 15), 512 * 64);
        assert_eq!(reduction_part_len(10, 64, 1 << 15), 10 * 64);
        assert_eq!(reduction_part_len(0, 64, 1 << 15), 64);
        assert_eq!(reduction_part_len(5, 1 << 16, 1 << 15), 1 << 16, "a row wider than a part is a part");
    }

    #[test]
    fn split_passes_equal_the_serial_pass() {
        let input: Vec<f64> = (0..(ELEMENTWISE_MIN + 13)).map(|i| (i as f64).sin()).collect();
        let mapped = map_slices_parallel(&input, |o, i| o.iter_mut().zip(i).for_each(|(o, &x)| *o = 2.0 * x + 1.0));
        assert!(mapped.iter().zip(&input).all(|(&m, &x)| m == 2.0 * x + 1.0));
        let width = 97;
        let rows = &input[..(ROWWISE_MIN / width + 5) * width];
        let cumulative = |i: &[f64], o: &mut [f64]| {
            for (r, o) in i.chunks(width).zip(o.chunks_mut(width)) {
                let mut acc = 0.0;
                for (o, &v) in o.iter_mut().zip(r) {
                    acc += v;
                    *o = acc;
                }
            }
        };
        let mut serial = vec![0.0; rows.len()];
        cumulative(rows, &mut serial);
        assert_eq!(rows_parallel(rows, width, ROWWISE_MIN, cumulative), serial);
        assert_eq!(rows_parallel(rows, width, 1, cumulative), serial);
    }
}
