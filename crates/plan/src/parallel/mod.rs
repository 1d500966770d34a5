//! Independent jobs (a model's layers, §4.1) over the machine's cores: contiguous chunks, the
//! first on the calling thread and one on each other core ([`pool`]'s helpers, or scoped
//! threads where those are busy), results in the jobs' order — so a result never depends on
//! the core count.

mod pool;

use std::sync::Mutex;

/// The machine's cores, read once (it reads cgroup files: not on every pass).
fn cores() -> usize {
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |t| t.get()))
}

/// A chunk's results, or its first error (None until it ran).
type ChunkResult<R, E> = Mutex<Option<Result<Vec<R>, E>>>;

/// `f` of every job, in order, on up to all cores (on the calling thread when there is one core
/// or one job); the first error in job order, if any.
pub fn map_in_order<T: Sync, R: Send, E: Send>(jobs: &[T], f: impl Fn(&T) -> Result<R, E> + Sync) -> Result<Vec<R>, E> {
    let threads = cores().min(jobs.len());
    if threads <= 1 {
        return jobs.iter().map(f).collect();
    }
    let chunk = jobs.len().div_ceil(threads);
    let f = &f;
    let parts: Vec<&[T]> = jobs.chunks(chunk).collect();
    // Each chunk's results, written by whichever thread ran it.
    let results: Vec<ChunkResult<R, E>> = parts.iter().map(|_| Mutex::new(None)).collect();
    let work: Vec<_> = parts
        .iter()
        .zip(&results)
        .map(|(part, out)| {
            move || {
                let r = part.iter().map(f).collect();
                *out.lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
            }
        })
        .collect();
    let work: Vec<&(dyn Fn() + Sync)> = work.iter().map(|w| w as &(dyn Fn() + Sync)).collect();
    if pool::Pool::get(cores()).run(&work).is_none() {
        // The helpers are busy: the first chunk here, the others on threads of their own.
        std::thread::scope(|s| {
            let handles: Vec<_> = work[1..].iter().map(|w| s.spawn(w)).collect();
            work[0]();
            for h in handles {
                h.join().unwrap_or_else(|e| std::panic::resume_unwind(e));
            }
        });
    }
    let mut out = Vec::with_capacity(jobs.len());
    for r in results {
        out.extend(r.into_inner().unwrap_or_else(|p| p.into_inner()).expect("every chunk ran")?);
    }
    Ok(out)
}

/// [`map_in_order`] when `parallel`, else on the calling thread: for jobs worth threads only
/// past some size.
pub fn map_in_order_if<T: Sync, R: Send, E: Send>(parallel: bool, jobs: &[T], f: impl Fn(&T) -> Result<R, E> + Sync) -> Result<Vec<R>, E> {
    if parallel {
        map_in_order(jobs, f)
    } else {
        jobs.iter().map(f).collect()
    }
}

/// Frees `x` on a thread of its own: a decision at cluster scale leaves behind millions of
/// small allocations (every worker's holdings after a node loss: ~20 ms of `free` on this 2-core
/// VM), and its commands should not wait for them. Small values are dropped here.
pub fn drop_elsewhere<T: Send + 'static>(x: T, large: bool) {
    if large {
        // Where no thread can be started, `x` is freed here, with the closure.
        let _ = std::thread::Builder::new().name("drop".into()).spawn(move || drop(x));
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn results_keep_the_jobs_order_and_the_first_error_wins() {
        let jobs: Vec<u32> = (0..37).collect();
        assert_eq!(super::map_in_order(&jobs, |&j| Ok::<_, ()>(j * 2)).unwrap(), jobs.iter().map(|j| j * 2).collect::<Vec<_>>());
        let err = super::map_in_order(&jobs, |&j| if j % 10 == 7 { Err(j) } else { Ok(j) }).unwrap_err();
        assert_eq!(err, 7);
    }

    /// Passes from several threads at once, and passes inside a pass's jobs, each get their
    /// own results (the helpers serve one caller; the others start threads of their own).
    #[test]
    fn passes_at_once_and_within_passes_keep_their_results() {
        std::thread::scope(|s| {
            for t in 0..4u64 {
                s.spawn(move || {
                    for round in 0..200u64 {
                        let jobs: Vec<u64> = (0..9).collect();
                        let got = super::map_in_order(&jobs, |&j| {
                            let inner: Vec<u64> = (0..3).collect();
                            let sum: u64 = super::map_in_order(&inner, |&k| Ok::<_, ()>(k + j)).unwrap().into_iter().sum();
                            Ok::<_, ()>(sum * 1000 + t * 100 + round % 100)
                        });
                        let want: Vec<u64> = jobs.iter().map(|&j| (3 * j + 3) * 1000 + t * 100 + round % 100).collect();
                        assert_eq!(got.unwrap(), want);
                    }
                });
            }
        });
    }

    /// A job's panic reaches the caller (whichever thread ran it), and the next pass works.
    #[test]
    fn a_panic_in_a_job_reaches_the_caller() {
        let jobs: Vec<u32> = (0..8).collect();
        for bad in [0, 7] {
            let caught =
                std::panic::catch_unwind(|| super::map_in_order(&jobs, |&j| if j == bad { panic!("job {j}") } else { Ok::<_, ()>(j) }));
            let message = caught.unwrap_err().downcast::<String>().map(|s| *s).unwrap_or_default();
            assert_eq!(message, format!("job {bad}"));
            assert_eq!(super::map_in_order(&jobs, |&j| Ok::<_, ()>(j)).unwrap(), jobs);
        }
    }
}
