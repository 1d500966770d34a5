//! Helper threads that stay awake between jobs.
//!
//! A decision at cluster scale makes thousands of short parallel passes (a 1,024-GPU simulated
//! day: ~8,500, under a millisecond each), with serial work between them. Starting a scoped
//! thread for each pass and joining it costs ~40 µs on a small VM, and so does waking a parked
//! thread (a futex round trip): a tenth of a pass. These helpers instead spin for a while after
//! each job (`SPIN`), so that a pass that follows soon after the last one is handed over
//! through one atomic store; a helper idle past that parks and is woken as usual.
//!
//! States of a helper's slot: `IDLE` → (the caller posts a job) `POSTED` → (the helper ran it)
//! `DONE` → (the caller took the result) `IDLE`. Invariants: only the caller that holds the
//! pool's lock posts; it waits for `DONE` before returning, so the job — which borrows from the
//! caller's stack — is never run after the borrow ends; a panic in a job is caught on the
//! helper and resumed on the caller.

use std::any::Any;
use std::cell::{Cell, UnsafeCell};
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU8, Ordering::SeqCst};
use std::sync::{Mutex, OnceLock, TryLockError};
use std::thread::Thread;
use std::time::{Duration, Instant};

/// How long a helper (and a caller waiting for one) spins before it parks.
const SPIN: Duration = Duration::from_millis(1);

const IDLE: u8 = 0;
const POSTED: u8 = 1;
const DONE: u8 = 2;

/// A job borrowed from the caller's stack, its lifetime erased (see the module's invariants).
type Job = *const (dyn Fn() + Sync);

struct Slot {
    state: AtomicU8,
    job: UnsafeCell<Option<Job>>,
    panic: UnsafeCell<Option<Box<dyn Any + Send>>>,
    /// The caller waiting for this slot (woken when its job is done).
    caller: UnsafeCell<Option<Thread>>,
    helper: OnceLock<Thread>,
}

// SAFETY: `job`, `panic` and `caller` are written by one side and read by the other only across
// the `state` handover (SeqCst stores and loads), never at once.
unsafe impl Sync for Slot {}
unsafe impl Send for Slot {}

/// The helpers: one fewer than the cores. `lock` admits one caller at a time; a caller that
/// finds it taken (another thread's pass, or a pass inside a helper's job) uses scoped threads.
pub(super) struct Pool {
    slots: Vec<&'static Slot>,
    lock: Mutex<()>,
}

thread_local! {
    /// Set on the helpers' threads: a pass inside a job never waits for the pool.
    static ON_HELPER: Cell<bool> = const { Cell::new(false) };
}

impl Pool {
    /// The process's pool for `cores` cores (the first call's count), started on first use.
    pub(super) fn get(cores: usize) -> &'static Pool {
        static POOL: OnceLock<Pool> = OnceLock::new();
        POOL.get_or_init(|| Pool::start(cores.saturating_sub(1)))
    }

    fn start(helpers: usize) -> Pool {
        let mut slots = Vec::new();
        for i in 0..helpers {
            let slot: &'static Slot = Box::leak(Box::new(Slot {
                state: AtomicU8::new(IDLE),
                job: UnsafeCell::new(None),
                panic: UnsafeCell::new(None),
                caller: UnsafeCell::new(None),
                helper: OnceLock::new(),
            }));
            let started = std::thread::Builder::new().name(format!("plan-helper-{i}")).spawn(move || serve(slot));
            match started {
                Ok(handle) => {
                    let _ = slot.helper.set(handle.thread().clone());
                    slots.push(slot);
                }
                // Where no thread can be started, fewer helpers (scoped threads or the caller
                // itself do the rest).
                Err(_) => break,
            }
        }
        Pool { slots, lock: Mutex::new(()) }
    }

    /// Helpers available now for one caller (none on a helper's own thread, or while another
    /// caller has them): run `jobs[0]` here and the others on helpers, in parallel; `None`
    /// (nothing run) when the pool cannot take them all.
    pub(super) fn run(&self, jobs: &[&(dyn Fn() + Sync)]) -> Option<()> {
        if jobs.len() > self.slots.len() + 1 || ON_HELPER.with(Cell::get) {
            return None;
        }
        let guard = match self.lock.try_lock() {
            Ok(g) => g,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => return None,
        };
        let me = std::thread::current();
        let posted = &self.slots[..jobs.len().saturating_sub(1)];
        for (slot, job) in posted.iter().zip(&jobs[1..]) {
            // SAFETY: the slot is IDLE (every earlier caller waited for DONE and reset it), so
            // its helper does not read these until the POSTED store below. The job's borrow is
            // erased here and outlives its use: this call waits for DONE before returning.
            unsafe {
                *slot.caller.get() = Some(me.clone());
                *slot.job.get() = Some(std::mem::transmute::<&(dyn Fn() + Sync), Job>(*job));
            }
            slot.state.store(POSTED, SeqCst);
            if let Some(h) = slot.helper.get() {
                h.unpark();
            }
        }
        // The first job here; a panic in it still waits for the helpers before it unwinds.
        let mine = catch_unwind(AssertUnwindSafe(|| jobs.first().map(|j| j())));
        let mut panic = mine.err();
        for slot in posted {
            wait_for(|| slot.state.load(SeqCst) == DONE);
            // SAFETY: DONE: the helper is finished with the slot.
            unsafe {
                *slot.job.get() = None;
                *slot.caller.get() = None;
                panic = panic.or((*slot.panic.get()).take());
            }
            slot.state.store(IDLE, SeqCst);
        }
        drop(guard);
        if let Some(p) = panic {
            resume_unwind(p);
        }
        Some(())
    }
}

/// Spin (for up to [`SPIN`]) and then park until `ready`.
fn wait_for(ready: impl Fn() -> bool) {
    let start = Instant::now();
    let mut spins = 0u32;
    while !ready() {
        spins = spins.wrapping_add(1);
        if !spins.is_multiple_of(64) {
            std::hint::spin_loop();
        } else if start.elapsed() < SPIN {
            // Another thread ready on this core (a value freed elsewhere) runs meanwhile.
            std::thread::yield_now();
        } else {
            // Woken by the other side's unpark after its store (or spuriously: look again).
            std::thread::park();
        }
    }
}

/// A helper's life: wait for a job, run it, say so.
fn serve(slot: &'static Slot) {
    ON_HELPER.with(|h| h.set(true));
    loop {
        wait_for(|| slot.state.load(SeqCst) == POSTED);
        // SAFETY: POSTED: the caller wrote the job and waits for DONE before touching the slot.
        let (job, caller) = unsafe { ((*slot.job.get()).expect("a posted job"), (*slot.caller.get()).clone()) };
        // SAFETY: the caller's borrow lasts until it sees DONE (module invariants).
        let ran = catch_unwind(AssertUnwindSafe(|| unsafe { (*job)() }));
        if let Err(p) = ran {
            // SAFETY: as above, the caller reads it only after DONE.
            unsafe { *slot.panic.get() = Some(p) };
        }
        slot.state.store(DONE, SeqCst);
        if let Some(c) = caller {
            c.unpark();
        }
    }
}
