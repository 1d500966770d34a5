//! Workers on a GPU with real processes and real signals: `lazarus train --workers N --device
//! cuda` puts every worker of the node on the GPU (several share one), reproduces the one-GPU
//! run's losses, goes on through a worker SIGKILLed from outside (its CUDA context gone with it)
//! without a rollback, and takes in a joining node and lets a draining one go. Skipped, with the
//! reason, where no GPU can be opened.

mod common;

use std::path::Path;
use std::time::Duration;

use common::hosts::{agent_pids, start_agent, start_controller, wait_for_records};
use common::{assert_same_losses, dir, files, lazarus, log, signal, wait, wait_for_steps};

/// Whether a GPU can be opened here (else why not, printed).
fn gpu() -> bool {
    match lazarus_model::device::parse("cuda:0") {
        Ok(_) => true,
        Err(e) => {
            eprintln!("skipped (no GPU): {e}");
            false
        }
    }
}

/// The test model's flags, on the GPU.
fn on_gpu() -> Vec<&'static str> {
    let mut a: Vec<&'static str> = common::tiny_model("8").to_vec();
    a.extend(["--device", "cuda"]);
    a
}

/// One process on the GPU for `steps`: its losses.
fn one_gpu(steps: &str, d: &Path) -> Vec<f64> {
    let path = d.join("one-gpu.jsonl");
    let mut args = vec!["train", "--steps", steps, "--json-log", path.to_str().unwrap()];
    args.extend(on_gpu());
    let out = lazarus(&args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    log(&path).0.into_iter().map(|(_, l)| l).collect()
}

#[test]
fn one_two_and_four_workers_sharing_a_gpu_reproduce_the_single_gpu_losses() {
    if !gpu() {
        return;
    }
    let d = dir("gpu-match");
    let want = one_gpu("50", &d);
    assert_eq!(want.len(), 50);
    for workers in ["1", "2", "4"] {
        let path = d.join(format!("w{workers}.jsonl"));
        let mut args = vec!["train", "--workers", workers, "--steps", "50", "--json-log", path.to_str().unwrap()];
        args.extend(on_gpu());
        let out = lazarus(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{workers} workers: {stderr}");
        let (steps, _) = log(&path);
        assert_same_losses(&steps, &want, &format!("{workers} workers on one GPU"));
    }
}

#[test]
fn a_gpu_worker_killed_from_outside_does_not_stop_training() {
    if !gpu() {
        return;
    }
    let d = dir("gpu-kill");
    let want = one_gpu("60", &d);
    let [(path, log_s), (ck, ck_s)] = files(&d, ["log.jsonl", "ck"]);
    let mut args = vec!["train", "--workers", "4", "--steps", "60", "--json-log", &log_s, "--checkpoint-dir", &ck_s];
    args.extend(on_gpu());
    common::run_killing_one(&args, &path, (4, 2), 10, "the run after a GPU worker's SIGKILL");
    let (steps, reconf) = log(&path);
    assert_same_losses(&steps, &want, "4 GPU workers, one killed");
    assert_eq!(reconf.len(), 1, "one move, no rollback: {reconf:?}");
    let r = &reconf[0];
    assert_eq!(r["lost"], serde_json::json!([2]));
    assert_eq!((r["cause"].as_str(), r["workers"].as_u64()), (Some("reconfigure"), Some(3)), "{r}");
    let recovery_s = r["recovery_s"].as_f64().unwrap();
    assert!(recovery_s < 5.0, "recovery took {recovery_s} s");
    assert!(r["gpu_used_bytes"].as_array().is_some_and(|a| !a.is_empty()), "the survivors report their GPU memory: {r}");
    // The GPU job's checkpoint resumes on the CPU.
    common::resumes_in_one_process(&ck, "62", &d);
}

/// A controller with GPU workers: a third node attaches (taken in at a step boundary), then a
/// node gives notice (SIGTERM to its agent) and is drained — two moves, no rollback, the losses
/// of one GPU.
#[test]
fn gpu_workers_take_in_a_joining_node_and_let_a_draining_one_go() {
    if !gpu() {
        return;
    }
    let d = dir("gpu-join-drain");
    let want = one_gpu("200", &d);
    let (path, ck, secret) = (d.join("log.jsonl"), d.join("ck"), d.join("secret"));
    let (log_s, ck_s, secret_s) =
        (path.to_str().unwrap().to_string(), ck.to_str().unwrap().to_string(), secret.to_str().unwrap().to_string());
    let mut args = vec!["--listen", "127.0.0.1:0", "--secret-file", &secret_s, "--workers", "2", "--slots-per-worker", "3"];
    args.extend(["--max-workers", "3", "--join-wait", "0.2", "--lease", "1", "--rebalance-every", "0"]);
    args.extend(on_gpu());
    args.extend(["--steps", "200", "--json-log", &log_s, "--checkpoint-dir", &ck_s]);
    let (mut controller, ctl_lines, addr) = start_controller(&args, None);
    let mut seen = Vec::new();
    let mut agents = Vec::new();
    for _ in 0..2 {
        agents.push(start_agent(&addr, "1", &secret, None));
        agent_pids(&ctl_lines, 1, &mut seen);
    }
    wait_for_steps(&path, 20);
    agents.push(start_agent(&addr, "1", &secret, None));
    let joined = wait_for_records(&path, 1);
    assert_eq!((joined[0]["cause"].as_str(), joined[0]["workers"].as_u64()), (Some("join"), Some(3)), "{}", joined[0]);
    wait_for_steps(&path, 60);
    signal(agents[0].0.id() as i32, libc::SIGTERM);
    let (drained, drained_lines) = &mut agents[0];
    wait::success(drained, drained_lines, "the drained agent", Duration::from_secs(60));
    wait::job_success(&mut controller, &ctl_lines, &path, "the job after a join and a drain");
    let (steps, records) = log(&path);
    assert_eq!(records.len(), 2, "a join and a drain, no rollback: {records:?}");
    assert_eq!((records[1]["cause"].as_str(), records[1]["workers"].as_u64()), (Some("drain"), Some(2)), "{}", records[1]);
    assert_same_losses(&steps, &want, "GPU workers: a join, then a drain");
}
