//! Live recovery with real processes and real signals: `lazarus train --workers N` goes on
//! through a worker killed (SIGKILL) or hung (SIGSTOP) from outside, with the same losses as a
//! run that never failed, every step logged once, and a final checkpoint the single-process
//! trainer resumes; when both holders of an expert die it rolls back to the last checkpoint.

mod common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{dir, lazarus};
use serde_json::Value;

fn tiny() -> [&'static str; 16] {
    common::tiny_model("8")
}

/// The step lines and the reconfiguration lines of a `--json-log`.
fn log(path: &Path) -> (Vec<(u64, f64)>, Vec<Value>) {
    let mut steps = Vec::new();
    let mut reconf = Vec::new();
    for line in std::fs::read_to_string(path).unwrap().lines() {
        let v: Value = serde_json::from_str(line).unwrap();
        if v["event"] == "reconfiguration" {
            reconf.push(v);
        } else {
            steps.push((v["step"].as_u64().unwrap(), v["loss"].as_f64().unwrap()));
        }
    }
    (steps, reconf)
}

/// Start `train --workers N`; returns it, its stderr lines and the workers' pids once ready.
fn start(n: usize, extra: &[&str]) -> (Child, mpsc::Receiver<String>, Vec<i32>) {
    let workers = n.to_string();
    let mut args = vec!["train", "--workers", workers.as_str()];
    args.extend(tiny());
    args.extend(extra);
    let mut child = Command::new(env!("CARGO_BIN_EXE_lazarus")).args(&args).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
    let (tx, rx) = mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut pids = vec![0i32; n];
    let deadline = Instant::now() + Duration::from_secs(120);
    while pids.contains(&0) {
        let line = rx.recv_timeout(deadline.saturating_duration_since(Instant::now())).expect("workers start");
        if let Some(rest) = line.strip_prefix("worker ") {
            if let (Some(rank), Some(pid)) = (rest.split(':').next(), rest.split("pid ").nth(1)) {
                pids[rank.parse::<usize>().unwrap()] = pid.split_whitespace().next().unwrap().parse().unwrap();
            }
        }
    }
    (child, rx, pids)
}

fn wait_for_steps(path: &Path, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while std::fs::read_to_string(path).map_or(0, |s| s.lines().count()) < n {
        assert!(Instant::now() < deadline, "no progress");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn signal(pid: i32, sig: i32) {
    // SAFETY: a signal to a process this test started.
    assert_eq!(unsafe { libc::kill(pid, sig) }, 0);
}

/// The same run in one process: the losses to match.
fn uninterrupted(steps: &str, d: &Path) -> Vec<f64> {
    let path = d.join("reference.jsonl");
    let mut args = vec!["train", "--steps", steps, "--json-log", path.to_str().unwrap()];
    args.extend(tiny());
    let out = lazarus(&args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    log(&path).0.into_iter().map(|(_, l)| l).collect()
}

fn assert_same_losses(got: &[(u64, f64)], want: &[f64], what: &str) {
    let numbers: Vec<u64> = got.iter().map(|(s, _)| *s).collect();
    assert_eq!(numbers, (1..=want.len() as u64).collect::<Vec<_>>(), "{what}: every step logged exactly once");
    for ((s, a), b) in got.iter().zip(want) {
        assert!((a - b).abs() <= 1e-4 * b.abs(), "{what}: step {s} loss {a} vs uninterrupted {b}");
    }
}

#[test]
fn a_worker_killed_from_outside_does_not_stop_training() {
    let d = dir("recover-kill");
    let (path, ck) = (d.join("log.jsonl"), d.join("ck"));
    let (log_s, ck_s) = (path.to_str().unwrap().to_string(), ck.to_str().unwrap().to_string());
    let want = uninterrupted("60", &d);
    let (mut child, lines, pids) = start(4, &["--steps", "60", "--json-log", &log_s, "--checkpoint-dir", &ck_s]);
    wait_for_steps(&path, 10);
    signal(pids[2], libc::SIGKILL);
    let status = child.wait().unwrap();
    let text: Vec<String> = lines.try_iter().collect();
    assert!(status.success(), "the run goes on and finishes: {}", text.join("\n"));
    let (steps, reconf) = log(&path);
    assert_same_losses(&steps, &want, "4 workers, one killed");
    assert_eq!(reconf.len(), 1, "{reconf:?}");
    let r = &reconf[0];
    assert_eq!(r["lost"], serde_json::json!([2]));
    assert_eq!((r["cause"].as_str(), r["workers"].as_u64()), (Some("reconfigure"), Some(3)));
    let recovery_s = r["recovery_s"].as_f64().unwrap();
    assert!(recovery_s < 5.0, "recovery took {recovery_s} s");
    assert!(text.iter().any(|l| l.starts_with("reconfigured: epoch 1")), "{}", text.join("\n"));
    // The final checkpoint resumes in one process.
    let more = d.join("more.jsonl");
    let out = lazarus(&["train", "--resume", "--steps", "62", "--checkpoint-dir", &ck_s, "--json-log", more.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(log(&more).0.len(), 2);
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_hung_worker_is_found_out_within_the_lease_and_training_goes_on() {
    let d = dir("recover-stop");
    let path = d.join("log.jsonl");
    let log_s = path.to_str().unwrap().to_string();
    let want = uninterrupted("60", &d);
    let (mut child, lines, pids) = start(3, &["--steps", "60", "--json-log", &log_s, "--lease", "0.5", "--comm-timeout", "60"]);
    wait_for_steps(&path, 10);
    let stopped_at = Instant::now();
    signal(pids[1], libc::SIGSTOP);
    let status = child.wait().unwrap();
    let text: Vec<String> = lines.try_iter().collect();
    assert!(status.success(), "{}", text.join("\n"));
    assert!(text.iter().any(|l| l.contains("worker 1: no heartbeat for 500 ms")), "{}", text.join("\n"));
    let (steps, reconf) = log(&path);
    assert_same_losses(&steps, &want, "3 workers, one hung");
    let r = &reconf[0];
    assert_eq!(r["lost"], serde_json::json!([1]));
    // Found out by its silence, long before the 60 s collective deadline.
    assert!(r["recovery_s"].as_f64().unwrap() < 5.0 && stopped_at.elapsed() < Duration::from_secs(50), "{r}");
    let _ = std::fs::remove_dir_all(&d);
}
