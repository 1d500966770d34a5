//! Live recovery with real processes and real signals: `lazarus train --workers N` goes on
//! through a worker killed (SIGKILL) or hung (SIGSTOP) from outside, with the same losses as a
//! run that never failed, every step logged once, and a final checkpoint the single-process
//! trainer resumes; when both holders of an expert die it rolls back to the last checkpoint.

mod common;

use std::path::Path;
use std::process::{Child, Command};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{
    assert_same_losses, cursor, dir, files, lazarus, log, lone_holder, resumes_in_one_process, signal, spawn_lazarus, status_with_token,
    twin_holders, uninterrupted, uninterrupted_with_cursor, wait, wait_for_steps, worker_pids,
};
use serde_json::Value;

fn tiny() -> [&'static str; 16] {
    common::tiny_model("8")
}

/// Start `train --workers N`; returns it, its stderr lines and the workers' pids once ready.
fn start(n: usize, extra: &[&str]) -> (Child, mpsc::Receiver<String>, Vec<i32>) {
    start_with_faults(n, extra, "")
}

/// The same, with the fault-injection hook `LAZARUS_FAULT` set for the workers.
fn start_with_faults(n: usize, extra: &[&str], faults: &str) -> (Child, mpsc::Receiver<String>, Vec<i32>) {
    let workers = n.to_string();
    let mut args = vec!["train", "--workers", workers.as_str()];
    args.extend(tiny());
    args.extend(extra);
    let (child, rx) = spawn_lazarus(&args, &[("LAZARUS_FAULT", faults)]);
    let pids = worker_pids(&rx, n, |_| {});
    (child, rx, pids)
}

/// Run a job (whose `--json-log` is `log`) to its end, for as long as it logs steps; its stderr.
fn finish(mut child: Child, lines: mpsc::Receiver<String>, log: &Path) -> Vec<String> {
    wait::job_success(&mut child, &lines, log, "the run goes on and finishes")
}

#[test]
fn a_worker_killed_from_outside_does_not_stop_training() {
    let d = dir("recover-kill");
    let [(path, log_s), (ck, ck_s)] = files(&d, ["log.jsonl", "ck"]);
    let want = uninterrupted("60", &d);
    let (mut child, lines, pids) = start(4, &["--steps", "60", "--json-log", &log_s, "--checkpoint-dir", &ck_s]);
    wait_for_steps(&path, 10);
    signal(pids[2], libc::SIGKILL);
    let text = wait::job_success(&mut child, &lines, &path, "the run after a worker's SIGKILL");
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
    resumes_in_one_process(&ck, "62", &d);
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
    let text = wait::job_success(&mut child, &lines, &path, "the run after a worker's SIGSTOP");
    assert!(text.iter().any(|l| l.contains("worker 1: no heartbeat for 500 ms")), "{}", text.join("\n"));
    let (steps, reconf) = log(&path);
    assert_same_losses(&steps, &want, "3 workers, one hung");
    let r = &reconf[0];
    assert_eq!(r["lost"], serde_json::json!([1]));
    // Found out by its silence, long before the 60 s collective deadline.
    assert!(r["recovery_s"].as_f64().unwrap() < 5.0 && stopped_at.elapsed() < Duration::from_secs(50), "{r}");
}

/// Workers killed at chosen phases (the fault-injection hook: SIGKILL to itself) — one in the
/// forward pass of step 8, another just before the gradient all-reduce of step 16, with room
/// for every expert on two workers of each plan: the run completes on two workers with the uninterrupted losses, the same data consumed, and a
/// final checkpoint the single-process trainer resumes.
#[test]
fn workers_killed_in_forward_and_in_the_all_reduce_do_not_stop_training() {
    let d = dir("recover-phases");
    let (path, ck, tb) = (d.join("log.jsonl"), d.join("ck"), d.join("tb"));
    let (log_s, ck_s) = (path.to_str().unwrap().to_string(), ck.to_str().unwrap().to_string());
    let (want, want_cursor) = uninterrupted_with_cursor("24", &d);
    let (child, lines, _) = start_with_faults(
        4,
        &[
            "--steps",
            "24",
            "--json-log",
            &log_s,
            "--checkpoint-dir",
            &ck_s,
            "--slots-per-worker",
            "4",
            "--tensorboard",
            tb.to_str().unwrap(),
        ],
        "1:forward:8,3:all_reduce:16",
    );
    let text = finish(child, lines, &path);
    let (steps, reconf) = log(&path);
    assert_same_losses(&steps, &want, "4 workers, kills in forward and all-reduce");
    let lost: Vec<(Value, Value, Value)> = reconf.iter().map(|r| (r["lost"].clone(), r["step"].clone(), r["workers"].clone())).collect();
    assert_eq!(
        lost,
        vec![
            (serde_json::json!([1]), serde_json::json!(7), serde_json::json!(3)),
            (serde_json::json!([3]), serde_json::json!(15), serde_json::json!(2))
        ],
        "{}",
        text.join("\n")
    );
    assert_eq!(cursor(&ck), want_cursor, "the same data consumed, nothing lost or repeated");
    // TensorBoard's file has every step's loss, as logged, and each recovery's time.
    let [events] = &std::fs::read_dir(&tb).unwrap().flatten().map(|e| e.path()).collect::<Vec<_>>()[..] else { panic!("one event file") };
    let (_, scalars) = lazarus_tensorboard::read_events(events).unwrap();
    let series = |tag: &str| -> Vec<(i64, f32)> {
        scalars.iter().flat_map(|s| s.scalars.iter().filter(|x| x.tag == tag).map(move |x| (s.step, x.value))).collect()
    };
    let losses: Vec<(i64, f32)> = steps.iter().map(|&(s, l)| (s as i64, l as f32)).collect();
    assert_eq!(series("train/loss"), losses);
    let recoveries = series("moves/reconfigure_s");
    assert_eq!(recoveries.iter().map(|r| r.0).collect::<Vec<_>>(), vec![7, 15], "{recoveries:?}");
    assert!(recoveries.iter().all(|r| r.1 > 0.0 && r.1 < 30.0), "{recoveries:?}");
    assert_eq!(series("expert_load/layer0/expert0").len(), 24);
    // The run's report: both recoveries in its events, as a real browser shows it.
    let html = d.join("report.html");
    let out = lazarus(&["report", &ck_s, "--log", &log_s, "--out", html.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("24 steps, 0 evaluations, 2 moves"), "{}", String::from_utf8_lossy(&out.stdout));
    let page = std::fs::read_to_string(&html).unwrap();
    assert_eq!(page.matches("<td class=\"l\">reconfigure</td>").count(), 2);
    if let Some(chrome) = common::browser::chromium() {
        let shot = common::runs_dir().with_file_name("report-of-a-run-with-two-recoveries.png");
        let url = format!("file://{}", html.display());
        let loaded = common::browser::load(&chrome, &url, &d, Some((&shot, 1000, 2400)));
        assert!(loaded.console.is_empty(), "the page logged: {:?}", loaded.console);
        assert_eq!(loaded.dom.matches(">reconfigure</td>").count(), 2, "the browser's page has both recoveries");
        assert!(loaded.dom.contains("<svg") && loaded.dom.contains("MoE layer 1"), "the charts");
    }
    resumes_in_one_process(&ck, "26", &d);
}

/// A worker killed while the survivors of an earlier failure move to their new plan — during
/// its rendezvous (the others are told to give it up) or during the state transfers — the
/// move is planned again from what the survivors hold, and training goes on.
#[test]
fn a_worker_killed_during_the_rendezvous_or_the_state_transfer_of_a_recovery() {
    for phase in ["transfer", "rendezvous"] {
        let d = dir(&format!("recover-{phase}"));
        let [(path, log_s), (ck, ck_s)] = files(&d, ["log.jsonl", "ck"]);
        let (want, want_cursor) = uninterrupted_with_cursor("20", &d);
        // Worker 1 dies at the commit vote of step 8 (every survivor holds step 8 and drops it);
        // worker 2 dies in the move that follows, at 7 steps committed.
        let faults = format!("1:vote:8,2:{phase}:7");
        let (child, lines, _) = start_with_faults(4, &["--steps", "20", "--json-log", &log_s, "--checkpoint-dir", &ck_s], &faults);
        let text = finish(child, lines, &path);
        let (steps, reconf) = log(&path);
        assert_same_losses(&steps, &want, phase);
        assert_eq!(reconf.len(), 1, "{phase}: one recovery: {reconf:?}");
        let r = &reconf[0];
        let got = (r["lost"].clone(), r["epoch"].as_u64(), r["workers"].as_u64(), r["cause"].as_str());
        assert_eq!(got, (serde_json::json!([1, 2]), Some(2), Some(2), Some("reconfigure")), "{phase}: {}", text.join("\n"));
        // Nobody waited for a collective deadline (30 s): the move was called off at once.
        assert!(r["recovery_s"].as_f64().unwrap() < 5.0, "{phase}: {r}");
        assert_eq!(cursor(&ck), want_cursor, "{phase}");
        resumes_in_one_process(&ck, "22", &d);
    }
}

/// Both holders of an expert killed at once: every survivor rolls back to the last checkpoint
/// on its own, and the losses from there equal a run resumed from that checkpoint by hand;
/// the `--json-log` is cut back so every step appears once.
#[test]
fn both_holders_of_an_expert_killed_roll_back_to_the_last_checkpoint() {
    let d = dir("recover-rollback");
    let [(path, log_s), (ck, ck_s)] = files(&d, ["log.jsonl", "ck"]);
    // Find the twins of this job's placement (the plan is deterministic).
    let mut probe = vec!["train", "--workers", "4", "--steps", "1"];
    probe.extend(tiny());
    let out = lazarus(&probe);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let (a, b) = twin_holders(&String::from_utf8_lossy(&out.stderr));
    let faults = format!("{a}:vote:13,{b}:vote:13");
    let args = ["--steps", "20", "--json-log", &log_s, "--checkpoint-dir", &ck_s, "--checkpoint-every", "5"];
    let (child, lines, _) = start_with_faults(4, &args, &faults);
    let text = finish(child, lines, &path);
    let (steps, reconf) = log(&path);
    assert_eq!(reconf.len(), 1, "{reconf:?}");
    let r = &reconf[0];
    assert_eq!(
        (r["cause"].as_str(), r["step"].as_u64(), r["lost"].clone()),
        (Some("rollback"), Some(10), serde_json::json!([a, b])),
        "{}",
        text.join("\n")
    );
    // Epoch 1 when both deaths are seen before the survivors' move; epoch 2 when the second
    // holder, slower (a loaded machine: 22 ms), first took part in a move without the first
    // and died at the same vote when it ran step 13 again (that move never completed a step,
    // so its record is the rollback's).
    assert!(text.iter().any(|l| l.starts_with("rolled back: epoch 1,") || l.starts_with("rolled back: epoch 2,")), "{}", text.join("\n"));
    // By hand: the checkpoint of step 10, resumed in one process to step 20.
    let by_hand = d.join("by-hand");
    std::fs::create_dir_all(&by_hand).unwrap();
    let status = Command::new("cp").arg("-r").arg(ck.join("step-00000010")).arg(&by_hand).status().unwrap();
    assert!(status.success());
    std::fs::write(by_hand.join("latest"), "step-00000010").unwrap();
    let hand_log = d.join("hand.jsonl");
    let out = lazarus(&[
        "train",
        "--resume",
        "--steps",
        "20",
        "--checkpoint-dir",
        by_hand.to_str().unwrap(),
        "--json-log",
        hand_log.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let hand: Vec<(u64, f64)> = log(&hand_log).0;
    assert_eq!(hand.first().map(|h| h.0), Some(11));
    let numbers: Vec<u64> = steps.iter().map(|s| s.0).collect();
    assert_eq!(numbers, (1..=20).collect::<Vec<_>>(), "every step logged once after the rollback");
    for ((s, got), (_, want)) in steps[10..].iter().zip(&hand) {
        assert!((got - want).abs() <= 1e-4 * want.abs(), "step {s}: {got} after the rollback, {want} resumed by hand");
    }
    assert_eq!(cursor(&ck), cursor(&by_hand));
}

/// Too few survivors for one replica of every expert (2 workers of 2 slots, 4 experts, one
/// killed): the run stops at once with a clear reason naming the last checkpoint and the
/// command to go on from it — and that command goes on from it.
#[test]
fn too_few_survivors_stop_and_name_the_checkpoint_to_go_on_from() {
    let d = dir("recover-too-few");
    let [(path, log_s), (ck, ck_s)] = files(&d, ["log.jsonl", "ck"]);
    let args = ["--steps", "5000", "--json-log", &log_s, "--checkpoint-dir", &ck_s, "--checkpoint-every", "4", "--slots-per-worker", "2"];
    let (mut child, lines, pids) = start(2, &args);
    wait_for_steps(&path, 6);
    signal(pids[1], libc::SIGKILL);
    let begun = Instant::now();
    let (status, text) = wait::exit(&mut child, &lines, "a job that cannot go on", Duration::from_secs(60));
    let all = text.join("\n");
    assert!(!status.success(), "a job that cannot go on fails: {all}");
    assert!(begun.elapsed() < Duration::from_secs(30), "it stops at once, it does not hang");
    assert!(all.contains("the 1 surviving workers have 2 expert slots, fewer than the 4 experts of a layer"), "{all}");
    let want = format!("--checkpoint-dir {ck_s} --resume");
    assert!(all.contains(&want), "the reason says how to go on: {all}");
    let step: u64 = all
        .split("the last checkpoint is of step ")
        .nth(1)
        .and_then(|r| r.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("names the step: {all}"));
    assert!(step >= 4 && step.is_multiple_of(4), "{all}");
    // Nothing after the stop was saved as if consistent: `latest` is that checkpoint — or the
    // next one, when rank 0 wrote it in the instant before the loss and its report had not
    // reached the controller (the named step is the controller's newest; `--resume` takes the
    // newest on disk).
    let latest = std::fs::read_to_string(ck.join("latest")).unwrap();
    let step: u64 = latest.trim().trim_start_matches("step-").parse().unwrap();
    let named = all.split("the last checkpoint is of step ").nth(1).and_then(|r| r.split(|c: char| !c.is_ascii_digit()).next());
    let named: u64 = named.and_then(|n| n.parse().ok()).unwrap();
    assert!(step == named || step == named + 4, "latest {latest}, named {named}: {all}");
    // The command it names goes on from there, on two workers again.
    let more = d.join("more.jsonl");
    let steps = (step + 3).to_string();
    let mut again = vec!["train", "--workers", "2", "--slots-per-worker", "2", "--checkpoint-dir", &ck_s, "--resume", "--steps", &steps];
    let more_s = more.to_str().unwrap();
    again.extend(["--json-log", more_s]);
    let out = lazarus(&again);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let numbers: Vec<u64> = log(&more).0.iter().map(|s| s.0).collect();
    assert_eq!(numbers, vec![step + 1, step + 2, step + 3]);
}

/// Rebalancing from the load monitor: a job planned unbalanced on purpose (`--max-imbalance inf`
/// packs experts, §4.1) weighs a plan from the measured loads every 50 steps, applies the first
/// (its predicted gain repays its move), skips what would not pay, and trains on with the losses
/// and data of an uninterrupted run; every decision is a `rebalance` line in the log.
#[test]
fn a_rebalance_that_repays_its_move_is_applied_at_a_step_boundary_and_changes_no_loss() {
    let d = dir("recover-rebalance");
    let [(path, log_s), (ck, ck_s)] = files(&d, ["log.jsonl", "ck"]);
    let (want, want_cursor) = uninterrupted_with_cursor("150", &d);
    let args = [
        "--steps",
        "150",
        "--json-log",
        &log_s,
        "--checkpoint-dir",
        &ck_s,
        "--slots-per-worker",
        "2",
        "--max-imbalance",
        "inf",
        "--rebalance-every",
        "50",
    ];
    let (child, lines, _) = start(3, &args);
    let text = finish(child, lines, &path);
    let decisions: Vec<Value> = std::fs::read_to_string(&path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|v| v["event"] == "rebalance")
        .collect();
    let (seen, records) = log(&path);
    // Weighed at step 50; the job pauses after the step in flight when the request came, and
    // the next is weighed 50 steps after that move (at 150 the job ends: nothing to repay).
    let moved_at = records[0]["step"].as_u64().unwrap();
    assert!((50..=53).contains(&moved_at), "{}", records[0]);
    let steps: Vec<u64> = decisions.iter().map(|v| v["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, vec![50, moved_at + 50], "{decisions:?}");
    let first = &decisions[0];
    assert_eq!(first["decision"], "apply", "{first}");
    assert!(first["imbalance_after"].as_f64() < first["imbalance_before"].as_f64(), "{first}");
    assert!(first["gain_s"].as_f64() > first["cost_s"].as_f64(), "{first}");
    // The second may be shrunk to the layer that repays its move (the other can be worse off).
    let applied = decisions.iter().filter(|v| v["decision"] != "skip").count();
    assert_eq!(records.len(), applied, "one move per rebalance applied or shrunk: {records:?}");
    assert_eq!(records[0]["cause"], "rebalance", "{}", records[0]);
    assert_eq!(records[0]["lost"], serde_json::json!([]));
    assert!(text.iter().any(|l| l.starts_with("rebalance at step 50: apply")), "{}", text.join("\n"));
    assert_same_losses(&seen, &want, "3 workers rebalanced");
    assert_eq!(cursor(&ck), want_cursor, "the same windows of data");
}

/// `lazarus bench recovery --json`: five kills, one in each phase (forward, all-reduce, vote,
/// SIGKILL and SIGSTOP from outside), every one recovered, with its breakdown; a hang costs
/// about the lease, a death far less.
#[test]
fn bench_recovery_reports_every_kill_with_its_breakdown() {
    let mut args = vec!["bench", "recovery", "--kills", "5", "--lease", "0.5", "--json"];
    args.extend(tiny());
    let out = lazarus(&args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!((r["workers"].as_u64(), r["recovered"].as_u64()), (Some(4), Some(5)), "{r}");
    let kills = r["kills"].as_array().unwrap();
    let mut phases: Vec<&str> = kills.iter().map(|k| k["kill"]["phase"].as_str().unwrap()).collect();
    phases.sort_unstable();
    assert_eq!(phases, ["all_reduce", "forward", "hang", "outside", "vote"]);
    for k in kills {
        let rec = &k["record"];
        let total = rec["recovery_s"].as_f64().unwrap();
        let parts = ["detect_s", "plan_s", "rebuild_s", "transfer_s"].map(|f| rec[f].as_f64().unwrap());
        assert!(parts.iter().all(|&p| p >= 0.0) && parts.iter().sum::<f64>() <= total + 1e-6, "{k}");
        if k["kill"]["phase"] == "hang" {
            assert!((0.45..5.0).contains(&total), "a hang is found by the 0.5 s lease: {k}");
        }
    }
    assert!(r["recovery_s_median"].as_f64().unwrap() < 2.0 && r["step_s_median"].as_f64().unwrap() > 0.0, "{r}");
    let bad = lazarus(&["bench", "recovery", "--kills", "0"]);
    assert!(!bad.status.success() && String::from_utf8_lossy(&bad.stderr).contains("--kills"));
    let bad = lazarus(&["bench", "recovery", "--json-log", "x"]);
    assert!(!bad.status.success() && String::from_utf8_lossy(&bad.stderr).contains("--json-log"));
}

/// `lazarus status --controller ADDR` asks the running job's controller over gRPC: every
/// member alive at epoch 0, then after a kill the lost one, epoch 1 and what happened.
#[test]
fn status_shows_members_epoch_plan_and_recent_events() {
    let d = dir("recover-status");
    let path = d.join("log.jsonl");
    let log_s = path.to_str().unwrap().to_string();
    let mut args = vec!["train", "--workers", "3", "--steps", "100000", "--json-log", &log_s, "--rebalance-every", "0"];
    args.extend(tiny());
    let (mut child, rx) = spawn_lazarus(&args, &[]);
    let mut found = None;
    let pids = worker_pids(&rx, 3, |line| {
        if let Some(rest) = line.strip_prefix("controller status: LAZARUS_STATUS_TOKEN=") {
            if let Some((token, a)) = rest.split_once(" lazarus status --controller ") {
                found = Some((token.to_string(), a.to_string()));
            }
        }
    });
    let (token, addr) = found.unwrap();
    // The status is the job's: without its key, or with another, it is refused.
    let out = lazarus(&["status", "--controller", &addr]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("--secret-file"), "{out:?}");
    // The token is the status key and the controller's TLS key: another key is refused by the
    // controller, another TLS key by the client (not this job's controller).
    let (_, pin) = token.split_once('.').expect("key.pin");
    let out = status_with_token(&addr, &format!("0123456789abcdef0123456789abcdef.{pin}"), &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("does not prove the job's status key"), "{err}");
    let other_pin = format!("{}.{}", &token[..32], "ab".repeat(32));
    let out = status_with_token(&addr, &other_pin, &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("is not this job's controller"), "{err}");
    wait_for_steps(&path, 5);
    let ask = || {
        let out = status_with_token(&addr, &token, &["--json"]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice::<Value>(&out.stdout).unwrap()
    };
    let s = ask();
    assert_eq!((s["epoch"].as_u64(), s["phase"].as_str()), (Some(0), Some("running")), "{s}");
    assert_eq!(s["members"].as_array().unwrap().iter().filter(|m| m["alive"] == true).count(), 3, "{s}");
    assert_eq!(s["plan"]["format"], "lazarus-plan/1", "{s}");
    signal(pids[1], libc::SIGKILL);
    let deadline = Instant::now() + Duration::from_secs(60);
    let s = loop {
        let s = ask();
        if s["epoch"].as_u64() == Some(1) && s["phase"] == "running" {
            break s;
        }
        assert!(Instant::now() < deadline, "no reconfiguration seen: {s}");
        std::thread::sleep(Duration::from_millis(50));
    };
    let lost: Vec<u64> =
        s["members"].as_array().unwrap().iter().filter(|m| m["alive"] == false).map(|m| m["node"].as_u64().unwrap()).collect();
    assert_eq!(lost, vec![1], "{s}");
    assert!(s["recent"].as_array().unwrap().iter().any(|e| e.as_str().unwrap().contains("worker 1 lost")), "{s}");
    // Epochs as the header counts them, in the plan and the recent events alike.
    assert_eq!(s["plan"]["epoch"], 1, "{s}");
    let recent: Vec<&str> = s["recent"].as_array().unwrap().iter().filter_map(|e| e.as_str()).collect();
    assert!(
        recent.iter().any(|e| e.starts_with("epoch 0: worker 1 lost")) && recent.iter().any(|e| e.starts_with("epoch 1: ")),
        "{recent:?}"
    );
    // The human form names the same.
    let out = status_with_token(&addr, &token, &[]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("2 training, 1 lost"), "{text}");
    signal(child.id() as i32, libc::SIGKILL);
    let _ = child.wait();
    // Nobody there: a clear error, not a hang.
    let out = status_with_token(&addr, &token, &["--timeout", "2"]);
    assert!(
        !out.status.success() && String::from_utf8_lossy(&out.stderr).contains("cannot reach the controller"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let bad = status_with_token("nowhere", &token, &[]);
    assert!(!bad.status.success() && String::from_utf8_lossy(&bad.stderr).contains("--controller"));
}

/// The only holder of some expert killed, with snapshots on (a bandwidth that carries every
/// expert at risk each step): the expert comes back from the snapshot another node keeps — no
/// rollback. The worker died at the vote of step 13,
/// after every step-13 frame of the rank that snapshots its experts had arrived, so the step-12
/// snapshots had too (one ordered stream per pair): nothing is stale, no token is lost and the
/// losses are the uninterrupted run's. With --snapshot-bandwidth 0 the same kill rolls back.
#[test]
fn an_expert_whose_only_holder_is_killed_comes_back_from_a_snapshot_without_a_rollback() {
    let d = dir("recover-snapshot");
    let extra = ["--slots-per-worker", "1", "--steps", "20", "--checkpoint-every", "5"];
    // The reference, and the placement: 5 workers of one slot, 4 experts (one has two replicas).
    let reference = d.join("ref.jsonl");
    let ck0 = d.join("ck0");
    let mut args = vec!["train", "--workers", "5", "--json-log", reference.to_str().unwrap(), "--checkpoint-dir", ck0.to_str().unwrap()];
    args.extend(tiny());
    args.extend(extra);
    let out = lazarus(&args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let want: Vec<f64> = log(&reference).0.iter().map(|s| s.1).collect();
    let victim = lone_holder(&String::from_utf8_lossy(&out.stderr));
    for (bandwidth, restored) in [("625e6", true), ("0", false)] {
        let path = d.join(format!("log-{restored}.jsonl"));
        let ck = d.join(format!("ck-{restored}"));
        let (log_s, ck_s) = (path.to_str().unwrap().to_string(), ck.to_str().unwrap().to_string());
        let mut run = vec!["--json-log", log_s.as_str(), "--checkpoint-dir", ck_s.as_str()];
        run.extend(extra);
        run.extend(["--snapshot-bandwidth", bandwidth]);
        let (child, lines, _) = start_with_faults(5, &run, &format!("{victim}:vote:13"));
        let text = finish(child, lines, &path);
        let (steps, reconf) = log(&path);
        assert_eq!(reconf.len(), 1, "{reconf:?}");
        let r = &reconf[0];
        if restored {
            assert_eq!((r["cause"].as_str(), r["step"].as_u64()), (Some("reconfigure"), Some(12)), "{}", text.join("\n"));
            let back = r["restored"].as_array().expect("restored experts");
            assert!(!back.is_empty());
            for x in back {
                assert_eq!(
                    (x["from_step"].as_u64(), x["stale_steps"].as_u64(), x["tokens_lost"].as_u64()),
                    (Some(12), Some(0), Some(0)),
                    "{x}"
                );
            }
            assert_eq!(r["rollback_avoided_steps"].as_u64(), Some(2), "the checkpoint of step 10");
            assert!(text.iter().any(|l| l.starts_with("restored: layer ")), "{}", text.join("\n"));
            common::assert_same_losses(&steps, &want, "restored from snapshots");
            // The json log says what the snapshots cost, ours below MoEtion's selection.
            let lines: Vec<serde_json::Value> =
                std::fs::read_to_string(&path).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
            let snap: Vec<&serde_json::Value> = lines.iter().filter_map(|l| l.get("snapshot")).collect();
            assert!(snap.len() >= 18, "{snap:?}");
            assert!(snap
                .iter()
                .all(|s| s["bytes"].as_u64() <= s["moetion_bytes"].as_u64() && s["bytes"].as_u64() <= s["budget_bytes"].as_u64()));
            assert!(snap.iter().any(|s| s["bytes"].as_u64() > Some(0) && s["bytes"].as_u64() < s["moetion_bytes"].as_u64()), "{snap:?}");
        } else {
            assert_eq!((r["cause"].as_str(), r["step"].as_u64()), (Some("rollback"), Some(10)), "{}", text.join("\n"));
            assert!(r.get("restored").is_none());
        }
    }
    // Killed after committing step 12 but before sending its step-12 snapshots: the restored
    // experts are a step stale, their lost tokens counted; they catch up through the router and
    // the run ends close to the uninterrupted one.
    let path = d.join("log-stale.jsonl");
    let ck = d.join("ck-stale");
    let mut run = vec!["--json-log", path.to_str().unwrap(), "--checkpoint-dir", ck.to_str().unwrap(), "--snapshot-bandwidth", "625e6"];
    run.extend(extra);
    let (child, lines, _) = start_with_faults(5, &run, &format!("{victim}:snapshot:12"));
    let text = finish(child, lines, &path);
    let (steps, reconf) = log(&path);
    assert_eq!(reconf.len(), 1, "{reconf:?}");
    let back = reconf[0]["restored"].as_array().unwrap_or_else(|| panic!("{}", text.join("\n")));
    assert!(back.iter().all(|x| x["from_step"].as_u64() == Some(11) && x["stale_steps"].as_u64() == Some(1)), "{back:?}");
    assert!(back.iter().any(|x| x["tokens_lost"].as_u64() > Some(0)), "{back:?}");
    assert_eq!(steps.iter().map(|s| s.0).collect::<Vec<_>>(), (1..=20).collect::<Vec<_>>());
    let mean = |xs: &[f64]| xs.iter().sum::<f64>() / xs.len() as f64;
    let got: Vec<f64> = steps.iter().map(|s| s.1).collect();
    assert!(got[..12].iter().zip(&want).all(|(a, b)| (a - b).abs() <= 1e-4 * b.abs()), "identical before the failure");
    let (g, w) = (mean(&got[12..]), mean(&want[12..]));
    assert!((g - w).abs() <= 0.01 * w, "after the restore: mean loss {g} vs {w} uninterrupted");
    // The paced default (no bandwidth given): at least one expert a step, most tokens at risk
    // first, so by step 12 every expert at risk has a snapshot somewhere; the same kill restores
    // them (however stale) instead of rolling back, and the survivors, paced afresh in the new
    // epoch, agree on what to send after it (a disagreement leaves a receiver waiting: the run
    // would not finish).
    let path = d.join("log-paced.jsonl");
    let ck = d.join("ck-paced");
    let mut run = vec!["--json-log", path.to_str().unwrap(), "--checkpoint-dir", ck.to_str().unwrap()];
    run.extend(extra);
    let (child, lines, _) = start_with_faults(5, &run, &format!("{victim}:vote:13"));
    let text = finish(child, lines, &path);
    let (steps, reconf) = log(&path);
    assert_eq!(reconf.len(), 1, "{reconf:?}");
    assert_eq!(reconf[0]["cause"].as_str(), Some("reconfigure"), "{}", text.join("\n"));
    let back = reconf[0]["restored"].as_array().unwrap_or_else(|| panic!("{}", text.join("\n")));
    assert!(!back.is_empty() && back.iter().all(|x| x["from_step"].as_u64() <= Some(12)), "{back:?}");
    assert_eq!(steps.iter().map(|s| s.0).collect::<Vec<_>>(), (1..=20).collect::<Vec<_>>());
    let got: Vec<f64> = steps.iter().map(|s| s.1).collect();
    let (g, w) = (mean(&got[12..]), mean(&want[12..]));
    assert!((g - w).abs() <= 0.01 * w, "paced: mean loss {g} vs {w} uninterrupted");
}

/// With no bandwidth given, the snapshot budget paces itself by what the last round cost: every
/// step's budget in the json log is what `SnapshotPace` gives from the logged cost of the round
/// before (late ranks, share of the CPU) and the bytes it sent — one expert after the first step,
/// doubling while nothing is too big — never above the link's cap; and snapshots are taken.
#[test]
fn the_default_snapshot_budget_paces_itself_by_what_the_last_round_cost() {
    use lazarus_plan::{RoundCost, SnapshotPace};
    let d = dir("snapshot-pace");
    let path = d.join("log.jsonl");
    let mut args = vec!["train", "--workers", "4", "--slots-per-worker", "1", "--steps", "16", "--json-log", path.to_str().unwrap()];
    args.extend(tiny());
    let out = lazarus(&args);
    let text = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "{text}");
    // "... in 4 experts x 2 MoE layers ..." in the run's header.
    let number_before = |what: &str| -> u64 {
        text.split(what)
            .next()
            .and_then(|h| h.rsplit(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("the header names the{what}: {text}"))
    };
    let (experts, moe_layers) = (number_before(" experts x "), number_before(" MoE layers"));
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&path).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let snap: Vec<&serde_json::Value> = lines.iter().filter_map(|l| l.get("snapshot")).collect();
    assert_eq!(snap.len(), 15, "every step but the last snapshots");
    let field = |s: &serde_json::Value, k: &str| s[k].as_u64().unwrap_or_else(|| panic!("{k} in {s}"));
    let unit = field(snap[0], "all_bytes") / (moe_layers * experts);
    let mut pace = SnapshotPace::default();
    for (i, s) in snap.iter().enumerate() {
        let cost =
            RoundCost { late_ranks: field(s, "late_ranks") as usize, snapshot_cpu_s: s["cpu_share"].as_f64().unwrap(), process_cpu_s: 1.0 };
        let (budget, cap, bytes) = (field(s, "budget_bytes"), field(s, "cap_bytes"), field(s, "bytes"));
        assert_eq!(budget, pace.budget(&cost, cap, unit), "step {}: {s}", i + 1);
        assert!(bytes <= budget && budget <= cap, "step {}: {s}", i + 1);
        pace.sent(bytes);
    }
    assert_eq!((field(snap[0], "budget_bytes"), field(snap[1], "budget_bytes")), (0, unit), "no step time yet, then one expert");
    assert!(snap.iter().any(|s| field(s, "bytes") > 0), "{snap:?}");
    // The cost is measured, not assumed: frames through loopback take some CPU.
    assert!(snap.iter().any(|s| s["cpu_share"].as_f64() > Some(0.0) && s["snapshot_cpu_s"].as_f64() > Some(0.0)), "{snap:?}");
    let summary = String::from_utf8_lossy(&out.stdout);
    assert!(summary.contains("at risk") && summary.contains("of the workers' CPU"), "the summary says what snapshots cost: {summary}");
}

/// `--snapshot-ceiling` bounds the paced budget (a ceiling of 1 B/s leaves no room for any
/// expert: nothing is sent), and is checked: a ceiling of 0 or below, or one given beside a fixed
/// `--snapshot-bandwidth`, is refused with the flag named.
#[test]
fn the_snapshot_ceiling_bounds_the_paced_budget_and_is_checked() {
    let d = dir("snapshot-ceiling");
    let path = d.join("log.jsonl");
    let mut args = vec![
        "train",
        "--workers",
        "4",
        "--slots-per-worker",
        "1",
        "--steps",
        "6",
        "--snapshot-ceiling",
        "1",
        "--json-log",
        path.to_str().unwrap(),
    ];
    args.extend(tiny());
    let out = lazarus(&args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&path).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let snap: Vec<&serde_json::Value> = lines.iter().filter_map(|l| l.get("snapshot")).collect();
    assert_eq!(snap.len(), 5);
    assert!(snap.iter().all(|s| s["cap_bytes"].as_u64() == Some(0) && s["bytes"].as_u64() == Some(0)), "{snap:?}");
    assert!(snap.iter().any(|s| s["at_risk_bytes"].as_u64() > Some(0)), "{snap:?}");
    for (bad, says) in [
        (vec!["--snapshot-ceiling", "0"], "--snapshot-ceiling"),
        (vec!["--snapshot-ceiling=-5"], "--snapshot-ceiling"),
        (vec!["--snapshot-ceiling", "inf"], "--snapshot-ceiling"),
        (vec!["--snapshot-ceiling", "1e9", "--snapshot-bandwidth", "1e6"], "--snapshot-bandwidth"),
    ] {
        let mut args = vec!["train", "--workers", "2", "--steps", "2"];
        args.extend(tiny());
        args.extend(&bad);
        let out = lazarus(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(says), "{bad:?}: {err}");
    }
}

/// Mixtral's blocks (RMSNorm, rotary positions, SwiGLU experts without biases, whose state is
/// two tensors) and a shared expert on 4 worker processes: one killed from outside, the run goes
/// on with the losses of an uninterrupted single-process run of the same model, and its final
/// checkpoint resumes in one process.
#[test]
fn mixtral_blocks_with_a_shared_expert_survive_a_killed_worker() {
    let blocks = ["--arch", "mixtral", "--shared-experts", "1", "--steps", "30"];
    family_survives_a_killed_worker("mixtral", &blocks, "RMSNorm, rotary θ=1000000, SwiGLU, no biases, 1 shared expert");
}

/// The other families' options at once — Qwen3-MoE's attention (query and key norms, one
/// key/value head for the query heads, heads wider than d_model / heads, RMSNorm ε 1e-6),
/// DeepSeek-MoE's sigmoid router and shared expert, and loss-free balancing's routing bias (which
/// the survivors keep and move as the uninterrupted run does).
#[test]
fn qwen_and_deepseek_options_with_the_routing_bias_survive_a_killed_worker() {
    let blocks = [
        "--arch",
        "deepseek-moe",
        "--qk-norm",
        "true",
        "--kv-heads",
        "1",
        "--head-dim",
        "12",
        "--norm-eps",
        "1e-6",
        "--balance",
        "bias",
        "--bias-update-rate",
        "0.01",
        "--steps",
        "30",
    ];
    let described = "norm ε 0.000001, 1 key/value head, heads of 12, q/k norms, sigmoid router, 1 shared expert";
    family_survives_a_killed_worker("deepseek", &blocks, described);
}

/// DeepSeek-V3's blocks — a dense first block, latent attention (queries from their own
/// latent), group-limited routing scaled by 2.5, the routing bias — on 4 workers, one SIGKILLed.
#[test]
fn deepseek_v3_blocks_with_latent_attention_survive_a_killed_worker() {
    let blocks = [common::DEEPSEEK_V3, &["--steps", "30"]].concat();
    let described =
        "latent attention (keys and values 8, queries 12, rotary 4), sigmoid router, top-1 of 2 expert groups, routed weights ×2.5";
    family_survives_a_killed_worker("deepseek-v3", &blocks, described);
}

/// Qwen2-MoE's blocks (q/k/v biases, a gated shared expert, grouped-query attention) on 4
/// workers, one SIGKILLed.
#[test]
fn qwen2_moe_blocks_survive_a_killed_worker() {
    let blocks = ["--arch", "qwen2-moe", "--kv-heads", "1", "--steps", "30"];
    let described = "biases on q/k/v only, 1 key/value head, top-k weights unnormalised, 1 shared expert (gated)";
    family_survives_a_killed_worker("qwen2", &blocks, described);
}

/// A run of `blocks` on 4 workers, one SIGKILLed after step 8: every step once with the losses
/// of the uninterrupted run (whose first line names its blocks with `described`), one
/// reconfiguration, and its checkpoint resumes in one process.
fn family_survives_a_killed_worker(name: &str, blocks: &[&str], described: &str) {
    let d = dir(&format!("recover-{name}"));
    let reference = d.join("reference.jsonl");
    let mut args = vec!["train", "--json-log", reference.to_str().unwrap()];
    args.extend(tiny());
    args.extend(blocks);
    let out = lazarus(&args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains(described), "{}", String::from_utf8_lossy(&out.stderr));
    let want: Vec<f64> = log(&reference).0.into_iter().map(|(_, l)| l).collect();
    let [(path, log_s), (ck, ck_s)] = files(&d, ["log.jsonl", "ck"]);
    let mut extra = vec!["--json-log", log_s.as_str(), "--checkpoint-dir", ck_s.as_str()];
    extra.extend(blocks);
    let (child, lines, pids) = start(4, &extra);
    wait_for_steps(&path, 8);
    signal(pids[1], libc::SIGKILL);
    finish(child, lines, &path);
    let (steps, reconf) = log(&path);
    assert_same_losses(&steps, &want, &format!("{name} blocks on 4 workers, one killed"));
    assert_eq!(reconf.len(), 1, "{reconf:?}");
    assert_eq!(reconf[0]["lost"], serde_json::json!([1]));
    resumes_in_one_process(&ck, "32", &d);
}
