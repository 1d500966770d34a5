//! SIGTERM (how a scheduler or a spot notice stops a process) and SIGINT (Ctrl-C) end a training
//! run at the next step boundary with a final checkpoint, instead of killing it mid-step with
//! nothing saved: the single-process trainer checks [`requested`] after each step; a launcher or
//! controller asks every worker to finish after the same step ([`crate::LauncherMessage::Finish`]).
//! A second signal ends the process at once.

use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};

static SEEN: AtomicUsize = AtomicUsize::new(0);
static FIRST: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_stop(sig: libc::c_int) {
    // Only atomics and _exit here: both are async-signal-safe.
    if SEEN.fetch_add(1, Ordering::SeqCst) == 0 {
        FIRST.store(sig, Ordering::SeqCst);
    } else {
        // SAFETY: _exit is async-signal-safe; the user asked twice.
        unsafe { libc::_exit(128 + sig) }
    }
}

/// From here on, SIGTERM and SIGINT are noted for [`requested`] instead of ending the process.
pub fn install() {
    // SAFETY: the handler only touches atomics and calls _exit.
    unsafe {
        libc::signal(libc::SIGTERM, on_stop as *const () as libc::sighandler_t);
        libc::signal(libc::SIGINT, on_stop as *const () as libc::sighandler_t);
    }
}

/// The first stop signal received, if any: its number and name.
pub fn requested() -> Option<(i32, &'static str)> {
    if SEEN.load(Ordering::SeqCst) == 0 {
        return None;
    }
    let sig = FIRST.load(Ordering::SeqCst);
    Some((sig, if sig == libc::SIGINT { "SIGINT" } else { "SIGTERM" }))
}
