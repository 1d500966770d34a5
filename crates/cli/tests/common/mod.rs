//! Helpers shared by the CLI tests (each test file is its own crate and pulls this in).

use std::process::{Command, Output};

/// Run the `lazarus` binary built for these tests.
pub fn lazarus(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_lazarus")).args(args).output().expect("run lazarus")
}

/// A fresh, empty scratch directory for one test (the process id keeps test binaries apart).
#[allow(dead_code)] // not every test file writes files
pub fn dir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("lazarus-cli-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Flags of a model small enough for tests (2 blocks of d_model 32, 4 experts of d_ff 32,
/// 16-token sequences, a 20 kB synthetic corpus) with `batch` sequences a step.
#[allow(dead_code)] // not every test file trains
pub fn tiny_model(batch: &'static str) -> [&'static str; 16] {
    [
        "--d-model",
        "32",
        "--layers",
        "2",
        "--heads",
        "2",
        "--experts",
        "4",
        "--d-ff",
        "32",
        "--seq-len",
        "16",
        "--batch-size",
        batch,
        "--synthetic-bytes",
        "20000",
    ]
}

/// Start `lazarus train --workers N …` (`args`, with `env` set); returns it and its stderr
/// lines as they come (stdout is piped too: the summary is small).
#[allow(dead_code)] // only the tests of worker processes start them
pub fn spawn_lazarus(args: &[&str], env: &[(&str, &str)]) -> (std::process::Child, std::sync::mpsc::Receiver<String>) {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_lazarus"));
    cmd.args(args).envs(env.iter().copied()).stdout(Stdio::piped()).stderr(Stdio::piped());
    // A test run started in the background by a non-interactive shell inherits SIGINT and
    // SIGQUIT ignored; the tests that send them need the default disposition back.
    use std::os::unix::process::CommandExt;
    // SAFETY: only async-signal-safe calls (signal) between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            libc::signal(libc::SIGINT, libc::SIG_DFL);
            libc::signal(libc::SIGQUIT, libc::SIG_DFL);
            Ok(())
        });
    }
    let mut child = cmd.spawn().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    (child, rx)
}

/// Read `lines` until each of `n` workers has said `worker R: pid P ready`; their pids by rank.
/// Every line read is also handed to `seen`.
#[allow(dead_code)] // only the tests of worker processes start them
pub fn worker_pids(lines: &std::sync::mpsc::Receiver<String>, n: usize, mut seen: impl FnMut(&str)) -> Vec<i32> {
    use std::time::{Duration, Instant};
    let mut pids = vec![0i32; n];
    let deadline = Instant::now() + Duration::from_secs(120);
    while pids.contains(&0) {
        let line = lines.recv_timeout(deadline.saturating_duration_since(Instant::now())).expect("workers start");
        if let Some(rest) = line.strip_prefix("worker ") {
            if let (Some(rank), Some(pid)) = (rest.split(':').next(), rest.split("pid ").nth(1)) {
                pids[rank.parse::<usize>().unwrap()] = pid.split_whitespace().next().unwrap().parse().unwrap();
            }
        }
        seen(&line);
    }
    pids
}
