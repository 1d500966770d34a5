//! Where a training step's time goes, on the thread that runs it: `lazarus bench train
//! --profile`.
//!
//! A step is cut into phases (forward, backward, gradient norm, AdamW) and, inside them, the
//! fused kernels' forward and backward passes. For each (phase, kernel) scope it adds up three
//! clocks: wall time, the CPU time of the calling thread, and the CPU time of the whole process.
//! The calling thread sleeps while the pool runs a parallel pass (rayon parks a thread from
//! outside the pool on a latch), so its CPU time is the step's *serial* work — what more cores
//! cannot shorten (Amdahl) — and the process's CPU over the wall time is how many cores were busy.
//! Time in a phase outside every kernel is candle's own ops and autograd bookkeeping.
//!
//! The profile is the calling thread's own: [`enable`] turns it on for that thread, whose scopes
//! alone are added up (a step runs on one thread; other threads' steps — tests side by side —
//! are not mixed in). Off, a scope costs a thread-local load and reads no clock.
//!
//! On a GPU ([`enable_gpu`]) each scope also records CUDA events on the device's stream around its
//! work: a phase synchronises with the device when it closes (only while profiling), and the
//! events give each phase and each kernel its GPU time. The launches and matrix products issued
//! are counted too ([`launches`]).

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

thread_local! {
    static ON: Cell<bool> = const { Cell::new(false) };
    static PHASE: Cell<&'static str> = const { Cell::new("") };
    static TOTALS: RefCell<BTreeMap<(&'static str, &'static str), Totals>> = const { RefCell::new(BTreeMap::new()) };
}

/// The scope a phase's own totals are kept under (its time outside kernels is this minus theirs).
pub const WHOLE_PHASE: &str = "";

/// Start (or stop) adding up this thread's scopes, clearing what was added so far.
pub fn enable(on: bool) {
    TOTALS.with(|t| t.borrow_mut().clear());
    ON.with(|o| o.set(on));
}

/// Clocks summed over the calls of one scope.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Totals {
    pub calls: u64,
    pub wall: Duration,
    /// CPU time of the thread that entered the scope: its serial work.
    pub thread_cpu: Duration,
    /// CPU time of every thread of the process while the scope ran.
    pub process_cpu: Duration,
    /// Device time between the scope's CUDA events (zero off a GPU).
    pub gpu: Duration,
}

impl Totals {
    pub fn plus(self, o: Totals) -> Totals {
        Totals {
            calls: self.calls + o.calls,
            wall: self.wall + o.wall,
            thread_cpu: self.thread_cpu + o.thread_cpu,
            process_cpu: self.process_cpu + o.process_cpu,
            gpu: self.gpu + o.gpu,
        }
    }

    /// What is left of `self` without `o` (its calls are kept).
    pub fn minus(self, o: Totals) -> Totals {
        Totals {
            calls: self.calls,
            wall: self.wall.saturating_sub(o.wall),
            thread_cpu: self.thread_cpu.saturating_sub(o.thread_cpu),
            process_cpu: self.process_cpu.saturating_sub(o.process_cpu),
            gpu: self.gpu.saturating_sub(o.gpu),
        }
    }
}

/// This thread's totals so far, by (phase, kernel); kernel [`WHOLE_PHASE`] holds the phase itself.
pub fn totals() -> Vec<((&'static str, &'static str), Totals)> {
    TOTALS.with(|t| t.borrow().iter().map(|(k, v)| (*k, *v)).collect())
}

fn clock(id: libc::clockid_t) -> Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the one timespec it is given.
    if unsafe { libc::clock_gettime(id, &mut ts) } == 0 {
        return Duration::new(ts.tv_sec.max(0) as u64, ts.tv_nsec.clamp(0, 999_999_999) as u32);
    }
    Duration::ZERO
}

/// An open scope; its clocks are added up when it is dropped. Not `Send`: it belongs to the
/// thread whose profile it adds to.
pub struct Scope {
    open: Option<Open>,
    #[cfg(feature = "cuda")]
    gpu: Option<gpu::Open>,
    _not_send: std::marker::PhantomData<*const ()>,
}

/// What an open scope of a profiling thread holds.
struct Open {
    key: (&'static str, &'static str),
    outer_phase: &'static str,
    wall: Instant,
    thread_cpu: Duration,
    process_cpu: Duration,
}

fn open(phase: Option<&'static str>, kernel: &'static str) -> Scope {
    let _not_send = std::marker::PhantomData;
    if !ON.with(|o| o.get()) {
        return Scope {
            open: None,
            #[cfg(feature = "cuda")]
            gpu: None,
            _not_send,
        };
    }
    let outer_phase = PHASE.with(|p| p.get());
    let key = match phase {
        Some(phase) => {
            PHASE.with(|p| p.set(phase));
            (phase, WHOLE_PHASE)
        }
        None => (outer_phase, kernel),
    };
    let open = Open {
        key,
        outer_phase,
        thread_cpu: clock(libc::CLOCK_THREAD_CPUTIME_ID),
        process_cpu: clock(libc::CLOCK_PROCESS_CPUTIME_ID),
        wall: Instant::now(),
    };
    #[cfg(feature = "cuda")]
    let gpu = gpu::open(open.key);
    Scope {
        open: Some(open),
        #[cfg(feature = "cuda")]
        gpu,
        _not_send,
    }
}

/// A phase of the step (forward, backward, …): the kernels run inside it are counted under it.
pub fn phase(name: &'static str) -> Scope {
    open(Some(name), WHOLE_PHASE)
}

/// One fused kernel's or GPU op's pass (`"attention.fwd"`), counted under the phase that runs it
/// (on a GPU between CUDA events too, once `enable_gpu` is on). Kernels run by the pool's threads
/// (an expert's FFN inside the grouped node) are not counted: the profile is the calling thread's.
pub fn kernel(name: &'static str) -> Scope {
    open(None, name)
}

impl Drop for Scope {
    fn drop(&mut self) {
        let Some(o) = self.open.take() else { return };
        // A phase on a GPU waits here for its work (and resolves its kernels' events); a kernel
        // leaves its events pending.
        #[cfg(feature = "cuda")]
        let gpu_time = self.gpu.take().map_or(Duration::ZERO, |g| gpu::close(g, o.key.1 == WHOLE_PHASE));
        #[cfg(not(feature = "cuda"))]
        let gpu_time = Duration::ZERO;
        let wall = o.wall.elapsed();
        let thread_cpu = clock(libc::CLOCK_THREAD_CPUTIME_ID).saturating_sub(o.thread_cpu);
        let process_cpu = clock(libc::CLOCK_PROCESS_CPUTIME_ID).saturating_sub(o.process_cpu);
        PHASE.with(|p| p.set(o.outer_phase));
        TOTALS.with(|t| {
            let mut totals = t.borrow_mut();
            let t = totals.entry(o.key).or_default();
            *t = t.plus(Totals { calls: 1, wall, thread_cpu, process_cpu, gpu: gpu_time });
        });
    }
}

/// Kernel launches and matrix products issued by this process so far (a GPU's; our kernels,
/// candle's and cuBLAS's calls): a step's count is the difference across it.
pub fn launches() -> (u64, u64) {
    #[cfg(feature = "cuda")]
    {
        let ours = GEMMS.load(std::sync::atomic::Ordering::Relaxed);
        (candle_core::cuda_backend::launch_count(), ours + candle_core::cuda_backend::gemm_count())
    }
    #[cfg(not(feature = "cuda"))]
    {
        (0, 0)
    }
}

/// Matrix products issued through Lazarus's own GPU ops (candle counts its own).
#[cfg(feature = "cuda")]
static GEMMS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Count a matrix product issued by Lazarus's GPU ops.
#[cfg(feature = "cuda")]
pub(crate) fn count_gemm() {
    GEMMS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

/// Start adding up this thread's scopes for steps on `device` (clearing what was added): on a
/// GPU its scopes record CUDA events too ([`enable_gpu`]).
pub fn enable_on(device: &candle_core::Device) {
    #[cfg(feature = "cuda")]
    enable_gpu(match device {
        candle_core::Device::Cuda(d) => Some(d.cuda_stream()),
        _ => None,
    });
    #[cfg(not(feature = "cuda"))]
    let _ = device;
    enable(true);
}

/// Profile this thread's steps on the GPU whose stream is `stream` (None: a CPU step): each
/// scope then records CUDA events around its work.
#[cfg(feature = "cuda")]
pub fn enable_gpu(stream: Option<std::sync::Arc<candle_core::cuda_backend::cudarc::driver::CudaStream>>) {
    gpu::STREAM.with(|s| *s.borrow_mut() = stream);
    gpu::PENDING.with(|p| p.borrow_mut().clear());
}

/// CUDA events of the profiled scopes: recorded on the profiled stream, resolved when a phase
/// closes.
#[cfg(feature = "cuda")]
mod gpu {
    use std::cell::RefCell;
    use std::sync::Arc;
    use std::time::Duration;

    use candle_core::cuda_backend::cudarc::driver::{sys, CudaEvent, CudaStream};

    type Key = (&'static str, &'static str);

    thread_local! {
        pub(super) static STREAM: RefCell<Option<Arc<CudaStream>>> = const { RefCell::new(None) };
        /// Kernel scopes closed since the phase opened: (key, start, end).
        pub(super) static PENDING: RefCell<Vec<(Key, CudaEvent, CudaEvent)>> = const { RefCell::new(Vec::new()) };
    }

    pub(super) struct Open {
        key: Key,
        start: CudaEvent,
    }

    fn event() -> Option<CudaEvent> {
        STREAM.with(|s| s.borrow().as_ref().and_then(|s| s.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).ok()))
    }

    pub(super) fn open(key: Key) -> Option<Open> {
        Some(Open { key, start: event()? })
    }

    fn ms(a: &CudaEvent, b: &CudaEvent) -> Duration {
        a.elapsed_ms(b).map_or(Duration::ZERO, |m| Duration::from_secs_f64(f64::from(m.max(0.0)) / 1e3))
    }

    /// Close a scope: a kernel's events wait in PENDING; a phase's end is waited for, and its own
    /// time and every pending kernel's are resolved (the kernels' added to the totals here).
    pub(super) fn close(o: Open, phase: bool) -> Duration {
        let Some(end) = event() else { return Duration::ZERO };
        if !phase {
            PENDING.with(|p| p.borrow_mut().push((o.key, o.start, end)));
            return Duration::ZERO;
        }
        let _ = end.synchronize();
        let kernels: Vec<(Key, CudaEvent, CudaEvent)> = PENDING.with(|p| std::mem::take(&mut *p.borrow_mut()));
        super::TOTALS.with(|t| {
            let mut totals = t.borrow_mut();
            for (key, s, e) in &kernels {
                let t = totals.entry(*key).or_default();
                t.gpu += ms(s, e);
            }
        });
        ms(&o.start, &end)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Busy for `d` of this thread's CPU time (however long a loaded machine takes to give it).
    fn spin(d: Duration) {
        let start = clock(libc::CLOCK_THREAD_CPUTIME_ID);
        while clock(libc::CLOCK_THREAD_CPUTIME_ID).saturating_sub(start) < d {
            std::hint::black_box(0u64);
        }
    }

    #[test]
    fn scopes_add_up_under_their_phase_and_serial_work_is_the_calling_threads_cpu() {
        enable(true);
        {
            let _p = phase("test-phase");
            spin(Duration::from_millis(20));
            {
                let _k = kernel("spin.fwd");
                spin(Duration::from_millis(30));
            }
            {
                // The calling thread sleeps: wall time, no serial work.
                let _k = kernel("sleep.fwd");
                std::thread::sleep(Duration::from_millis(30));
            }
        }
        {
            let _k = kernel("outside");
        }
        let t: BTreeMap<_, _> = totals().into_iter().collect();
        enable(false);
        let whole = t[&("test-phase", WHOLE_PHASE)];
        let spin_k = t[&("test-phase", "spin.fwd")];
        let sleep_k = t[&("test-phase", "sleep.fwd")];
        assert_eq!((whole.calls, spin_k.calls, sleep_k.calls), (1, 1, 1));
        assert!(whole.wall >= Duration::from_millis(80), "{whole:?}");
        assert!(whole.wall >= spin_k.wall + sleep_k.wall);
        assert!(spin_k.thread_cpu >= Duration::from_millis(30), "spinning is serial work: {spin_k:?}");
        assert!(sleep_k.thread_cpu < Duration::from_millis(10), "sleeping is not: {sleep_k:?}");
        assert!(whole.thread_cpu >= spin_k.thread_cpu + Duration::from_millis(20), "{whole:?}");
        assert!(t.contains_key(&("", "outside")), "a kernel outside every phase is kept under no phase");
        // Off: nothing is added.
        {
            let _p = phase("test-phase");
        }
        assert!(totals().is_empty());
        // Another thread's profile is its own.
        enable(true);
        std::thread::spawn(|| {
            let _p = phase("elsewhere");
        })
        .join()
        .unwrap();
        assert!(totals().is_empty());
        enable(false);
    }
}
