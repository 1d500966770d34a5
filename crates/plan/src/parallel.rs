//! Independent jobs (a model's layers, §4.1) over the machine's cores: contiguous chunks, the
//! first on the calling thread and one scoped thread for each other, results in the jobs' order —
//! so a result never depends on the core count.

/// `f` of every job, in order, on up to all cores (on the calling thread when there is one core
/// or one job); the first error in job order, if any.
pub fn map_in_order<T: Sync, R: Send, E: Send>(jobs: &[T], f: impl Fn(&T) -> Result<R, E> + Sync) -> Result<Vec<R>, E> {
    let threads = std::thread::available_parallelism().map_or(1, |t| t.get()).min(jobs.len());
    if threads <= 1 {
        return jobs.iter().map(f).collect();
    }
    let chunk = jobs.len().div_ceil(threads);
    let f = &f;
    // The first chunk on the calling thread (it would only wait), the others on threads of
    // their own.
    let mut chunks = jobs.chunks(chunk);
    let first = chunks.next().unwrap_or_default();
    let parts: Vec<Result<Vec<R>, E>> = std::thread::scope(|s| {
        let handles: Vec<_> = chunks.map(|part| s.spawn(move || part.iter().map(f).collect())).collect();
        let mine: Result<Vec<R>, E> = first.iter().map(f).collect();
        std::iter::once(mine).chain(handles.into_iter().map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))).collect()
    });
    let mut out = Vec::with_capacity(jobs.len());
    for p in parts {
        out.extend(p?);
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
}
