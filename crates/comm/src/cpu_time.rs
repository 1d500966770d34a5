//! CPU time as the kernel accounts it (user + system), for the snapshot tier's adaptive budget:
//! what the transport's out-of-band work costs, against what the whole process spends.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

fn clock(id: i32) -> Duration {
    #[cfg(unix)]
    {
        let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: clock_gettime writes the one timespec it is given.
        if unsafe { libc::clock_gettime(id, &mut ts) } == 0 {
            return Duration::new(ts.tv_sec.max(0) as u64, ts.tv_nsec.clamp(0, 999_999_999) as u32);
        }
    }
    let _ = id;
    Duration::ZERO
}

/// CPU time of the calling thread (zero where the platform has no such clock).
pub fn thread_cpu() -> Duration {
    #[cfg(unix)]
    return clock(libc::CLOCK_THREAD_CPUTIME_ID);
    #[cfg(not(unix))]
    return clock(0);
}

/// CPU time of this process, every thread of it (zero where the platform has no such clock).
pub fn process_cpu() -> Duration {
    #[cfg(unix)]
    return clock(libc::CLOCK_PROCESS_CPUTIME_ID);
    #[cfg(not(unix))]
    return clock(0);
}

/// CPU time spent by several threads on one kind of work, added up (nanoseconds).
#[derive(Debug, Clone, Default)]
pub(crate) struct CpuMeter(Arc<AtomicU64>);

impl CpuMeter {
    /// Run `f` on this thread and count the CPU time it took.
    pub(crate) fn measure<T>(&self, f: impl FnOnce() -> T) -> T {
        let start = thread_cpu();
        let out = f();
        let spent = thread_cpu().saturating_sub(start);
        self.0.fetch_add(u64::try_from(spent.as_nanos()).unwrap_or(u64::MAX), Ordering::Relaxed);
        out
    }

    pub(crate) fn total(&self) -> Duration {
        Duration::from_nanos(self.0.load(Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_meter_counts_the_cpu_its_work_takes_and_not_the_sleep() {
        let meter = CpuMeter::default();
        let spin = |ms| {
            let until = std::time::Instant::now() + Duration::from_millis(ms);
            let mut x = 0u64;
            while std::time::Instant::now() < until {
                x = x.wrapping_add(1);
            }
            x
        };
        meter.measure(|| spin(60));
        meter.measure(|| std::thread::sleep(Duration::from_millis(100)));
        let on_another = meter.clone();
        std::thread::spawn(move || on_another.measure(|| spin(60))).join().unwrap();
        let t = meter.total();
        // Two spins of 60 ms of wall time each: CPU at most that (a busy machine may give less,
        // but not none), and the 100 ms asleep not counted.
        assert!(t <= Duration::from_millis(125) && t > Duration::ZERO, "{t:?}");
        assert!(process_cpu() >= t);
    }
}
