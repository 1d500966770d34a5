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
