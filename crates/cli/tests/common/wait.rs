//! Waiting for events, not for time. Each wait polls for the thing it needs (a line, a file, a
//! process's end, a step in a log) and, when it gives up, fails with a message that names what
//! it waited for, how long, and what it saw last — so a failure on a loaded machine says
//! whether the job was slow, stuck or wrong.
//!
//! Two kinds of deadline:
//! - a fixed one (`within`) for things that take a bounded amount of work whatever the job's
//!   length: a process starting, an agent attaching, a refusal;
//! - a deadline on *progress* (`stall`) for a training job: it fails only when the job logged no
//!   step for that long, so a long job on a slow machine is not taken for a hung one.
#![allow(dead_code)] // each test file uses part of it

use std::fmt::Display;
use std::path::Path;
use std::process::{Child, ExitStatus};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

/// How often a wait looks again.
const POLL: Duration = Duration::from_millis(20);

/// How long a training job may log no step before a wait calls it stuck. Generous: a step of
/// the tests' tiny model takes milliseconds, a recovery or a controller's takeover seconds.
pub const STALL: Duration = Duration::from_secs(90);

/// Poll `probe` until it gives `Ok`, for at most `within`; panic otherwise, naming `what` and
/// the state the last `Err` described.
pub fn until<T>(what: impl Display, within: Duration, mut probe: impl FnMut() -> Result<T, String>) -> T {
    let start = Instant::now();
    loop {
        let last = match probe() {
            Ok(v) => return v,
            Err(state) => state,
        };
        if start.elapsed() >= within {
            panic!("waited {:.1} s for {what}; it did not happen (last seen: {last})", within.as_secs_f64());
        }
        std::thread::sleep(POLL);
    }
}

/// [`until`] for a plain condition.
pub fn until_true(what: impl Display, within: Duration, mut cond: impl FnMut() -> bool) {
    until(what, within, || if cond() { Ok(()) } else { Err("not yet".into()) })
}

/// Read `lines` until one satisfies `want`, for at most `within`; every line read is kept in
/// `seen`. Panics naming `what` (and the lines seen) if none comes or the sender is gone.
pub fn line(lines: &Receiver<String>, what: impl Display, within: Duration, seen: &mut Vec<String>, want: impl Fn(&str) -> bool) -> String {
    let until = Instant::now() + within;
    loop {
        match lines.recv_timeout(until.saturating_duration_since(Instant::now())) {
            Ok(l) => {
                seen.push(l.clone());
                if want(&l) {
                    return l;
                }
            }
            Err(RecvTimeoutError::Timeout) => {
                panic!("waited {:.1} s for {what}; it was not said. Lines seen:\n{}", within.as_secs_f64(), tail(seen))
            }
            Err(RecvTimeoutError::Disconnected) => panic!("the process ended before {what}. Lines seen:\n{}", tail(seen)),
        }
    }
}

/// The lines of a `--json-log` so far (a line being written is not counted).
pub fn logged(path: &Path) -> usize {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.matches('\n').count()
}

/// Wait until the `--json-log` at `path` has `n` lines, while it keeps growing: fails when no
/// line was added for [`STALL`].
pub fn steps(path: &Path, n: usize) {
    let mut at = (logged(path), Instant::now());
    loop {
        let now = logged(path);
        if now >= n {
            return;
        }
        if now != at.0 {
            at = (now, Instant::now());
        }
        if at.1.elapsed() >= STALL {
            panic!("waited for {n} lines in {}: it has {now}, and none came for {:.0} s", path.display(), STALL.as_secs_f64());
        }
        std::thread::sleep(POLL);
    }
}

/// Wait for `child` to exit, for at most `within`; its status and every line it wrote. On time
/// out it is killed and the test fails, naming `what`.
pub fn exit(child: &mut Child, lines: &Receiver<String>, what: impl Display, within: Duration) -> (ExitStatus, Vec<String>) {
    let until = Instant::now() + within;
    exit_unless(child, lines, || {
        (Instant::now() >= until).then(|| format!("waited {:.1} s for {what} to exit; it was still running", within.as_secs_f64()))
    })
}

/// Wait for a training job's process (`child`, whose `--json-log` is `log`) to exit, for as
/// long as the job makes progress: it fails — killing the process and naming `what` — only
/// when no line was added to the log for [`STALL`]. Its status and every line it wrote.
pub fn job_exit(child: &mut Child, lines: &Receiver<String>, log: &Path, what: impl Display) -> (ExitStatus, Vec<String>) {
    let mut at = (logged(log), Instant::now());
    exit_unless(child, lines, || {
        let now = logged(log);
        if now != at.0 {
            at = (now, Instant::now());
        }
        (at.1.elapsed() >= STALL).then(|| {
            format!("{what}: the job logged nothing for {:.0} s (at line {now} of {}) and did not exit", STALL.as_secs_f64(), log.display())
        })
    })
}

/// Wait for `child` to exit while `give_up` has nothing to say; once it says why, the child is
/// killed and the test fails with that and the child's last lines.
fn exit_unless(child: &mut Child, lines: &Receiver<String>, mut give_up: impl FnMut() -> Option<String>) -> (ExitStatus, Vec<String>) {
    let mut text = Vec::new();
    loop {
        text.extend(lines.try_iter());
        if let Some(s) = child.try_wait().unwrap() {
            return (s, drain(lines, text));
        }
        if let Some(why) = give_up() {
            let _ = child.kill();
            let _ = child.wait();
            text.extend(lines.try_iter());
            panic!("{why} (killed). Its last lines:\n{}", tail(&text));
        }
        std::thread::sleep(POLL);
    }
}

/// [`job_exit`], and the job must have succeeded; its lines.
pub fn job_success(child: &mut Child, lines: &Receiver<String>, log: &Path, what: impl Display) -> Vec<String> {
    let (status, text) = job_exit(child, lines, log, &what);
    assert!(status.success(), "{what}: the job ended with {status}. Its last lines:\n{}", tail(&text));
    text
}

/// [`exit`], and the process must have succeeded; its lines.
pub fn success(child: &mut Child, lines: &Receiver<String>, what: impl Display, within: Duration) -> Vec<String> {
    let (status, text) = exit(child, lines, &what, within);
    assert!(status.success(), "{what}: ended with {status}. Its last lines:\n{}", tail(&text));
    text
}

/// [`exit`], and the process must have failed; its lines.
pub fn failure(child: &mut Child, lines: &Receiver<String>, what: impl Display, within: Duration) -> Vec<String> {
    let (status, text) = exit(child, lines, &what, within);
    assert!(!status.success(), "{what}: succeeded, where it should have failed. Its lines:\n{}", tail(&text));
    text
}

/// The lines a process wrote after it exited: its stderr is read by a thread that ends when the
/// pipe closes, so what is still in flight arrives within moments.
fn drain(lines: &Receiver<String>, mut text: Vec<String>) -> Vec<String> {
    let until = Instant::now() + Duration::from_secs(5);
    loop {
        match lines.recv_timeout(until.saturating_duration_since(Instant::now())) {
            Ok(l) => text.push(l),
            // Disconnected: the reader saw the pipe close — everything is in.
            Err(_) => return text,
        }
    }
}

/// The last 200 lines, for a failure message.
pub fn tail(text: &[String]) -> String {
    text[text.len().saturating_sub(200)..].join("\n")
}
