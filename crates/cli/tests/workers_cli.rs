//! `lazarus train --workers N` with real worker processes on loopback: the same losses as one
//! process, placement files, checkpoints that resume, and a worker killed with SIGKILL mid-step
//! — every other worker stops with `PeerLost` within 2 s, nothing hangs or panics.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{alive, dir, files, lazarus, spawn_lazarus, wait, worker_pids};

/// The tiny model of these tests.
fn tiny() -> [&'static str; 16] {
    common::tiny_model("5")
}

fn losses(path: &std::path::Path) -> Vec<f64> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"].as_f64().unwrap())
        .collect()
}

fn run(extra: &[&str], log: &std::path::Path) -> Output {
    let mut args = vec!["train", "--steps", "6", "--json-log", log.to_str().unwrap()];
    args.extend(tiny());
    args.extend(extra);
    let out = lazarus(&args);
    assert!(out.status.success(), "{extra:?}: {}", String::from_utf8_lossy(&out.stderr));
    out
}

#[test]
fn worker_processes_match_one_process_and_their_checkpoint_resumes() {
    let d = dir("match");
    let single = losses(&{
        let p = d.join("single.jsonl");
        run(&[], &p);
        p
    });
    assert_eq!(single.len(), 6);
    // Measured-load plan on 3 workers, with a checkpoint at the end.
    let ck = d.join("ck");
    let log3 = d.join("w3.jsonl");
    let out = run(&["--workers", "3", "--checkpoint-dir", ck.to_str().unwrap()], &log3);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("3 workers, lazarus dispatch") && stderr.contains("placement L1:"), "{stderr}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("checkpoint"), "the summary names the checkpoint");
    // What the MoE all-to-alls sent between the workers, every step and in the summary; the
    // single process sends nothing and logs no such field.
    let wire = |path: &std::path::Path| -> Vec<Option<u64>> {
        std::fs::read_to_string(path)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["moe_wire_bytes"].as_u64())
            .collect()
    };
    assert!(wire(&log3).iter().all(|b| b.is_some_and(|b| b > 0)), "{:?}", wire(&log3));
    assert!(wire(&d.join("single.jsonl")).iter().all(Option::is_none));
    assert!(stdout.contains("MoE all-to-all") && stdout.contains("MB/step between workers"), "{stdout}");
    // A placement file straight from `lazarus plan --json` (one node per worker), 2 workers.
    let loads = d.join("loads.json");
    std::fs::write(&loads, "[[40, 10, 10, 10], [10, 10, 10, 40]]").unwrap();
    let plan = lazarus(&["plan", "--loads-file", loads.to_str().unwrap(), "--nodes", "2", "--slots", "3", "--min-replicas", "1", "--json"]);
    assert!(plan.status.success(), "{}", String::from_utf8_lossy(&plan.stderr));
    let placement = d.join("placement.json");
    std::fs::write(&placement, &plan.stdout).unwrap();
    let log2 = d.join("w2.jsonl");
    run(&["--workers", "2", "--placement-file", placement.to_str().unwrap()], &log2);
    // Static expert parallelism on 2 workers.
    let log_ep = d.join("ep.jsonl");
    run(&["--workers", "2", "--static-ep"], &log_ep);
    // Their connections encrypted: the same training.
    let log_sealed = d.join("sealed.jsonl");
    run(&["--workers", "3", "--encrypt-data"], &log_sealed);
    for (name, path) in [("3 workers", &log3), ("placement file", &log2), ("static EP", &log_ep), ("encrypted", &log_sealed)] {
        let l = losses(path);
        assert_eq!(l.len(), single.len(), "{name}");
        for (s, (a, b)) in l.iter().zip(&single).enumerate() {
            assert!((a - b).abs() <= 1e-4 * b, "{name}: step {} loss {a} vs {b}", s + 1);
        }
    }
    // The workers' checkpoint resumes in one process and continues like an uninterrupted run.
    let log_more = d.join("more.jsonl");
    let mut args =
        vec!["train", "--resume", "--steps", "8", "--checkpoint-dir", ck.to_str().unwrap(), "--json-log", log_more.to_str().unwrap()];
    args.extend(tiny());
    let out = lazarus(&args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let long = d.join("long.jsonl");
    let mut args = vec!["train", "--steps", "8", "--json-log", long.to_str().unwrap()];
    args.extend(tiny());
    assert!(lazarus(&args).status.success());
    let (more, long) = (losses(&log_more), losses(&long));
    assert_eq!(more.len(), 2);
    for (a, b) in more.iter().zip(&long[6..]) {
        assert!((a - b).abs() <= 1e-4 * b, "resumed {a} vs uninterrupted {b}");
    }
}

/// A token once to each worker its top-2 choices are on (the holder combines), against a row per
/// (token, choice) (`LAZARUS_DISPATCH=per-slot`): the same training within 1e-4, and fewer bytes
/// between the workers in every step.
#[test]
fn a_token_once_per_worker_trains_as_a_row_per_slot_with_fewer_bytes() {
    let d = dir("distinct");
    let run_with = |name: &str, per_slot: bool| -> Vec<(f64, u64)> {
        let log = d.join(format!("{name}.jsonl"));
        let mut args = vec!["train", "--steps", "6", "--workers", "3", "--quiet", "--json-log", log.to_str().unwrap()];
        args.extend(tiny());
        let mut cmd = common::lazarus_command();
        cmd.args(&args).env_remove("LAZARUS_DISPATCH");
        if per_slot {
            cmd.env("LAZARUS_DISPATCH", "per-slot");
        }
        let out = cmd.output().unwrap();
        assert!(out.status.success(), "{name}: {}", String::from_utf8_lossy(&out.stderr));
        std::fs::read_to_string(&log)
            .unwrap()
            .lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                (v["loss"].as_f64().unwrap(), v["moe_wire_bytes"].as_u64().unwrap())
            })
            .collect()
    };
    let (once, per_slot) = (run_with("once", false), run_with("per-slot", true));
    assert_eq!((once.len(), per_slot.len()), (6, 6));
    for (step, (a, b)) in once.iter().zip(&per_slot).enumerate() {
        assert!((a.0 - b.0).abs() <= 1e-4 * b.0.abs(), "step {}: loss {} vs {}", step + 1, a.0, b.0);
        assert!(a.1 < b.1, "step {}: {} bytes against {} a row per slot", step + 1, a.1, b.1);
    }
}

#[test]
fn bad_worker_settings_are_named() {
    let d = dir("bad");
    let log = d.join("x.jsonl");
    let bad = d.join("bad.json");
    let plan = |experts: usize, layers: &str| {
        format!(
            r#"{{"format":"lazarus-plan/1","epoch":0,"shape":{{"nodes":2,"gpus_per_node":1,"slots_per_gpu":3}},"experts":{experts},"layers":[{layers}]}}"#
        )
    };
    std::fs::write(&bad, plan(4, r#"{"placement": [[0, 1, 2], [2, 3, 0]]}"#)).unwrap();
    let huge = d.join("huge.json");
    std::fs::write(&huge, plan(4, r#"{"placement": [[18446744073709551615, 0, 1], [0, 2, 3]]}"#)).unwrap();
    let five = d.join("five.json");
    let layer = r#"{"placement": [[0, 1, 2], [2, 3, 4]]}"#;
    std::fs::write(&five, plan(5, &[layer; 2].join(","))).unwrap();
    let trace3 = d.join("three.csv");
    std::fs::write(&trace3, "0,add,a\n0,add,b\n0,add,c\n").unwrap();
    let bare = d.join("bare.json");
    std::fs::write(&bare, "[[0, 1, 2], [2, 3, 0]]").unwrap();
    for (extra, expect) in [
        (vec!["--workers", "0"], "--workers"),
        (vec!["--workers", "3", "--placement-file", bad.to_str().unwrap()], "the plan has 2 ranks"),
        (vec!["--workers", "2", "--placement-file", bad.to_str().unwrap()], "MoE layers"),
        (vec!["--workers", "2", "--placement-file", huge.to_str().unwrap()], "expert 18446744073709551615"),
        (vec!["--workers", "2", "--placement-file", five.to_str().unwrap()], "the model has 4"),
        (vec!["--workers", "2", "--placement-file", bare.to_str().unwrap()], "as `lazarus plan` prints it in JSON"),
        (vec!["--workers", "9"], "batch_size"),
        (vec!["--workers", "2", "--capacity-factor", "1.0"], "capacity_factor"),
        (vec!["--workers", "2", "--max-imbalance", "0.9"], "--max-imbalance"),
        (vec!["--workers", "2", "--max-imbalance", "nan"], "--max-imbalance"),
        (vec!["--workers", "2", "--replay", "fail-every:1s"], "--replay needs --gpus-per-node"),
        (vec!["--workers", "4", "--gpus-per-node", "2", "--replay", "fail-every:soon"], "invalid --replay"),
        (vec!["--workers", "4", "--gpus-per-node", "2", "--replay", "poisson:1s"], "poisson:MTBF:REPAIR:DURATION"),
        (vec!["--workers", "4", "--gpus-per-node", "2", "--replay", "fail-every:1s", "--replay-scale", "0"], "--replay-scale"),
        (vec!["--workers", "4", "--gpus-per-node", "2", "--replay", trace3.to_str().unwrap()], "starts with 3 nodes"),
        (vec!["--workers", "4", "--gpus-per-node", "2", "--replay", "/nonexistent/trace.csv"], "trace"),
        (vec!["--workers", "2", "--recovery", "off", "--rebalance-every", "5"], "--rebalance-every needs live recovery"),
        (vec!["--workers", "2", "--deterministic", "--static-ep"], "--deterministic with --static-ep"),
        (vec!["--workers", "2", "--shard-sequences", "2"], "--shard-sequences needs --deterministic"),
        (vec!["--workers", "2", "--deterministic", "--shard-sequences", "3"], "invalid --shard-sequences: 3 (a divisor of --batch-size 5"),
        (vec!["--workers", "2", "--deterministic", "--shard-sequences", "0"], "invalid --shard-sequences: 0"),
        (vec!["--workers", "65"], "invalid --workers: 65 (expected 1 to 64 on one machine)"),
        (vec!["--workers", "4", "--gpus-per-node", "3"], "invalid --gpus-per-node: 3 (expected a divisor of --workers 4"),
    ] {
        let mut args = vec!["train", "--steps", "2", "--json-log", log.to_str().unwrap()];
        args.extend(tiny());
        args.extend(&extra);
        let out = lazarus(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{extra:?} should fail");
        assert!(stderr.contains(expect) && !stderr.contains("panicked"), "{extra:?}: {stderr}");
    }
}

#[test]
fn a_killed_worker_stops_every_other_worker_with_peer_lost_within_two_seconds() {
    let d = dir("kill");
    let log = d.join("log.jsonl");
    let mut args = vec![
        "train",
        "--workers",
        "3",
        "--steps",
        "100000",
        "--json-log",
        log.to_str().unwrap(),
        "--comm-timeout",
        "30",
        "--recovery",
        "off",
    ];
    args.extend(tiny());
    let mut child = common::lazarus_command().args(&args).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
    let (tx, rx) = mpsc::channel::<(Instant, String)>();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send((Instant::now(), line));
        }
    });
    // The workers' pids, then a few finished steps.
    let mut pids = [0i32; 3];
    let mut seen = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    while pids.contains(&0) {
        let (_, line) = rx.recv_timeout(deadline.saturating_duration_since(Instant::now())).expect("workers start");
        if let Some(rest) = line.strip_prefix("worker ") {
            if let (Some(rank), Some(pid)) = (rest.split(':').next(), rest.split("pid ").nth(1)) {
                let rank: usize = rank.parse().unwrap();
                pids[rank] = pid.split_whitespace().next().unwrap().parse().unwrap();
            }
        }
        seen.push(line);
    }
    while std::fs::read_to_string(&log).map_or(0, |s| s.lines().count()) < 3 {
        assert!(Instant::now() < deadline, "no steps: {seen:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    // SAFETY: sending a signal to a process this test started.
    let killed_at = Instant::now();
    assert_eq!(unsafe { libc::kill(pids[1], libc::SIGKILL) }, 0);
    let mut stopped = Vec::new();
    let mut lines = Vec::new();
    while let Ok((at, line)) = rx.recv_timeout(Duration::from_secs(60)) {
        for rank in [0usize, 2] {
            if line.starts_with(&format!("worker {rank}: stopped: peer_lost")) {
                stopped.push((rank, at.duration_since(killed_at)));
            }
        }
        lines.push(line);
    }
    let status = child.wait().unwrap();
    let text = lines.join("\n");
    assert!(!status.success(), "the run must fail: {text}");
    assert!(!text.contains("panicked"), "{text}");
    assert!(text.contains("worker 1: died (killed by signal 9)"), "{text}");
    assert_eq!(stopped.len(), 2, "both survivors report PeerLost: {text}");
    for (rank, after) in &stopped {
        eprintln!("worker {rank}: PeerLost reported {} ms after the kill", after.as_millis());
        assert!(*after < Duration::from_secs(2), "worker {rank} took {after:?}: {text}");
    }
}

/// Top-8 of 64 SwiGLU experts, the fine-grained routing of OLMoE and Qwen-MoE: every routed
/// row computed once, Lazarus's all-to-alls carry exactly the rows that move, static EP pads
/// behind the hot expert; ratios beyond experts / top-k and a top-k beyond 8 are refused.
#[test]
fn moe_layer_bench_at_top_8_of_64_experts() {
    let args = ["bench", "moe-layer", "--d-model", "32", "--d-ff", "16", "--tokens", "64", "--iters", "1", "--experts", "64"];
    let mut run = args.to_vec();
    run.extend(["--top-k", "8", "--expert-act", "swiglu", "--ratios", "1,8", "--systems", "lazarus,static-ep", "--json"]);
    let out = lazarus(&run);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!((v["top_k"].as_u64(), v["expert_act"].as_str()), (Some(8), Some("swiglu")));
    let results = v["results"].as_array().unwrap();
    assert_eq!(results.len(), 4);
    for r in results {
        let (system, ratio, wire) = (r["system"].as_str().unwrap(), r["ratio"].as_f64().unwrap(), r["wire_bytes_ratio"].as_f64().unwrap());
        match (system, ratio as u32) {
            // A token goes once to each rank its 8 choices are on, in all four exchanges (the
            // holder combines); a row per (token, choice) would be 1.
            ("lazarus", _) => assert!(wire > 0.0 && wire < 0.5, "{system} at {ratio}: {wire}"),
            ("static-ep", 1) => assert!((wire - 1.0).abs() < 1e-9, "{system} at {ratio}: {wire}"),
            ("static-ep", _) => assert!(wire > 1.5, "the hot expert pads every buffer: {wire}"),
            other => panic!("unexpected {other:?}"),
        }
        if system == "lazarus" {
            assert_eq!(r["expert_rows"].as_u64(), Some(4 * 64 * 8), "every (token, choice) row once");
        }
    }
    for (extra, named) in
        [(&["--top-k", "9"][..], "--top-k"), (&["--top-k", "8", "--ratios", "9"], "--ratios"), (&["--expert-act", "relu"], "--expert-act")]
    {
        let mut bad = args.to_vec();
        bad.extend(extra);
        let out = lazarus(&bad);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(named), "{err}");
    }
}

#[test]
fn moe_layer_bench_reports_both_systems_and_padding_free_wire_bytes() {
    let out =
        lazarus(&["bench", "moe-layer", "--d-model", "32", "--d-ff", "64", "--tokens", "64", "--iters", "1", "--ratios", "1,4", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let results = v["results"].as_array().unwrap();
    assert_eq!(results.len(), 10);
    let routed = 4 * 64; // 4 workers x 64 tokens, top-1
    for r in results {
        let (system, ratio, wire) = (r["system"].as_str().unwrap(), r["ratio"].as_f64().unwrap(), r["wire_bytes_ratio"].as_f64().unwrap());
        assert!(r["tokens_per_s"].as_f64().unwrap() > 0.0);
        match (system, ratio as u32) {
            ("lazarus" | "lazarus-unguarded" | "lazarus-per-replica", _) => {
                assert!((wire - 1.0).abs() < 1e-9, "lazarus sends no padding: {wire}")
            }
            ("static-ep" | "static-ep-skip-padding", 1) => assert!((wire - 1.0).abs() < 1e-9, "balanced loads need no padding: {wire}"),
            ("static-ep" | "static-ep-skip-padding", 4) => assert!(wire > 2.0, "a 4x hot expert pads every buffer: {wire}"),
            other => panic!("unexpected {other:?}"),
        }
        // The plan's predicted balance and fault tolerance are reported with it: at 4:1 the
        // guarded Lazarus plan idles nobody; static EP's single replicas survive no failure.
        let (imbalance, survives) = (r["imbalance"].as_f64().unwrap(), r["survives_one_failure"].as_f64().unwrap());
        match (system, ratio as u32) {
            ("lazarus", _) => assert!(imbalance <= 1.05 + 1e-9, "guarded: {imbalance}"),
            // Unguarded at 4:1 the fault-tolerant optimum leaves worker 0 only cold experts.
            ("lazarus-unguarded", 4) => assert!(imbalance > 1.1 && survives == 0.5, "{imbalance} {survives}"),
            // Worker 0 holds the hot expert (half the tokens) and one cold one (1/14): 16/7 × the mean.
            ("static-ep" | "static-ep-skip-padding", 4) => {
                assert!(survives == 0.0 && (imbalance - 16.0 / 7.0).abs() < 1e-9, "{survives} {imbalance}")
            }
            _ => {}
        }
        let rows = r["expert_rows"].as_u64().unwrap();
        match (system, ratio as u32) {
            // DeepSpeed's experts run on the whole capacity buffer: 8 experts x 4 sources x C,
            // C = the hot expert's 32 of a worker's 64 tokens.
            ("static-ep", 4) => assert_eq!(rows, 8 * 4 * 32, "padding rows are computed"),
            _ => assert_eq!(rows, routed, "{system} at {ratio}: every routed row once"),
        }
    }
    assert_eq!(v["max_imbalance"].as_f64(), Some(1.05));
    // What skew cost Lazarus: its 4:1 tokens/s over its 1:1.
    let lazarus_at = |k: f64| {
        results.iter().find(|r| r["system"] == "lazarus" && r["ratio"].as_f64() == Some(k)).unwrap()["tokens_per_s"].as_f64().unwrap()
    };
    // (Within 1e-12: serde_json reads a float back to within an ulp, not always to the bit.)
    let kept = v["lazarus_kept_under_skew"].as_f64().unwrap();
    assert!((kept - lazarus_at(4.0) / lazarus_at(1.0)).abs() <= 1e-12 * kept, "{kept}");
    // One system, more steps: the median step comes with its quartiles and the run's noise.
    let out = lazarus(&[
        "bench",
        "moe-layer",
        "--d-model",
        "32",
        "--d-ff",
        "64",
        "--tokens",
        "64",
        "--iters",
        "4",
        "--ratios",
        "1,4",
        "--systems",
        "lazarus,lazarus",
        "--json",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let results = v["results"].as_array().unwrap();
    assert_eq!(results.len(), 2, "lazarus once per ratio: {results:?}");
    for r in results {
        assert_eq!(r["system"], "lazarus");
        let (lo, mid, hi) = (
            r["tokens_per_s_quartiles"][0].as_f64().unwrap(),
            r["tokens_per_s"].as_f64().unwrap(),
            r["tokens_per_s_quartiles"][1].as_f64().unwrap(),
        );
        assert!(0.0 < lo && lo <= mid && mid <= hi, "{lo} {mid} {hi}");
        // Four steps: the interval of the median is their range, around the quartiles.
        let (clo, chi) = (r["tokens_per_s_ci95"][0].as_f64().unwrap(), r["tokens_per_s_ci95"][1].as_f64().unwrap());
        assert!(clo <= lo && hi <= chi, "{clo} {lo} {hi} {chi}");
    }
    assert!(v["lazarus_ci95_width"].as_f64().is_some_and(|x| x >= 0.0), "{}", v["lazarus_ci95_width"]);
    assert!(v["speedup"][0][1].is_null(), "no static EP run, no speedup: {}", v["speedup"]);
    let bad = lazarus(&["bench", "moe-layer", "--iters", "1001"]);
    assert!(!bad.status.success() && String::from_utf8_lossy(&bad.stderr).contains("--iters"));
    let bad = lazarus(&["bench", "moe-layer", "--systems", "lazarus,deepspeed"]);
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(!bad.status.success() && err.contains("--systems") && err.contains("deepspeed"), "{err}");
    let bad = lazarus(&["bench", "moe-layer", "--ratios", "9"]);
    assert!(!bad.status.success() && String::from_utf8_lossy(&bad.stderr).contains("--ratios"));
    let bad = lazarus(&["bench", "moe-layer", "--max-imbalance", "0.5"]);
    assert!(!bad.status.success() && String::from_utf8_lossy(&bad.stderr).contains("--max-imbalance"));
    for args in [["--cpus-per-worker", "0"], ["--cpus-per-worker", "nan"]] {
        let bad = lazarus(&["bench", "moe-layer", "--tokens", "8", args[0], args[1]]);
        let err = String::from_utf8_lossy(&bad.stderr);
        assert!(!bad.status.success() && err.contains("--cpus-per-worker"), "{args:?}: {err}");
    }
    // Sizes beyond the machine are refused before anything is allocated, naming the flags.
    let huge = lazarus(&["bench", "moe-layer", "--d-model", "100000", "--d-ff", "400000"]);
    let err = String::from_utf8_lossy(&huge.stderr);
    assert!(!huge.status.success() && err.contains("GiB") && err.contains("--d-model") && !err.contains("allocation"), "{err}");
    let zero = lazarus(&["bench", "moe-layer", "--tokens", "8", "--cores-per-worker", "0"]);
    let err = String::from_utf8_lossy(&zero.stderr);
    assert!(!zero.status.success() && err.contains("invalid --cores-per-worker: 0 (every worker needs at least one core)"), "{err}");
    // A shard list with an empty name says which.
    let empty = lazarus(&["train", "--data", "a.bin,,b.bin", "--data-format", "u16", "--steps", "1"]);
    let err = String::from_utf8_lossy(&empty.stderr);
    assert!(!empty.status.success() && err.contains("file 2 of 3 has an empty name"), "{err}");
    let both = lazarus(&["bench", "moe-layer", "--cores-per-worker", "1", "--cpus-per-worker", "0.5"]);
    assert!(!both.status.success() && String::from_utf8_lossy(&both.stderr).contains("cannot be used with"));
}

/// Start `train --workers 2` on the tiny model with `extra` flags; returns the launcher, its
/// stderr lines as they come, and the workers' pids once both are ready.
fn start_workers(extra: &[&str]) -> (std::process::Child, mpsc::Receiver<String>, Vec<i32>) {
    let mut args = vec!["train", "--workers", "2"];
    args.extend(tiny());
    args.extend(extra);
    let (child, rx) = spawn_lazarus(&args, &[]);
    let pids = worker_pids(&rx, 2, |_| {});
    (child, rx, pids)
}

fn lines_in(path: &std::path::Path) -> usize {
    std::fs::read_to_string(path).map_or(0, |s| s.lines().count())
}

/// SIGKILL ends the launcher at once and its workers with it; SIGTERM and SIGINT (a scheduler,
/// Ctrl-C) make every worker stop after the same step and write the final checkpoint, and the
/// launcher exits as that signal would (143, 130).
#[test]
fn workers_die_with_their_launcher_whatever_signal_ends_it() {
    for (signal, name) in [(libc::SIGKILL, "SIGKILL"), (libc::SIGTERM, "SIGTERM"), (libc::SIGINT, "SIGINT")] {
        let d = dir(&format!("orphans-{name}"));
        let [(log, log_s), (ck, ck_s)] = files(&d, ["log.jsonl", "ck"]);
        let (mut launcher, lines, pids) =
            start_workers(&["--steps", "100000", "--json-log", &log_s, "--checkpoint-dir", &ck_s, "--checkpoint-every", "2"]);
        let deadline = Instant::now() + Duration::from_secs(60);
        while lines_in(&log) < 3 {
            assert!(Instant::now() < deadline, "{name}: no steps");
            std::thread::sleep(Duration::from_millis(20));
        }
        // SAFETY: a signal to a process this test started.
        assert_eq!(unsafe { libc::kill(launcher.id() as i32, signal) }, 0);
        let (status, _) = wait::exit(&mut launcher, &lines, format!("the launcher after {name}"), Duration::from_secs(60));
        let killed = Instant::now();
        if signal != libc::SIGKILL {
            assert_eq!(status.code(), Some(128 + signal), "{name}: {status:?}");
            let logged = lines_in(&log);
            assert_eq!(std::fs::read_to_string(ck.join("latest")).unwrap(), format!("step-{logged:08}"), "{name}: the last step is saved");
        }
        while pids.iter().any(|&p| alive(p)) {
            assert!(killed.elapsed() < Duration::from_secs(5), "{name}: workers {pids:?} outlived their launcher");
            std::thread::sleep(Duration::from_millis(10));
        }
        eprintln!("{name}: the workers were gone {} ms after the launcher", killed.elapsed().as_millis());
        // Nothing trains or writes checkpoints on.
        let listing = |dir: &std::path::Path| -> Vec<String> {
            let mut v: Vec<String> = std::fs::read_dir(dir)
                .map(|r| r.map_while(Result::ok).map(|e| e.file_name().to_string_lossy().into_owned()).collect())
                .unwrap_or_default();
            v.sort();
            v
        };
        let before = listing(&ck);
        std::thread::sleep(Duration::from_millis(500));
        assert_eq!(listing(&ck), before, "{name}: checkpoints written after the launcher died");
    }
}

#[test]
fn a_paused_launcher_does_not_stop_training() {
    // Before: rank 0 blocked writing its step reports to the paused launcher's full pipe, and
    // rank 1 timed out after --comm-timeout. Paused for 10 s here, the workers go on (about
    // 40 tiny steps a second: several pipes full of reports), and every report arrives after.
    let d = dir("paused");
    let log = d.join("log.jsonl");
    let log_s = log.to_str().unwrap().to_string();
    let (mut launcher, lines, _pids) =
        start_workers(&["--steps", "600", "--comm-timeout", "2", "--json-log", &log_s, "--rebalance-every", "0"]);
    let deadline = Instant::now() + Duration::from_secs(60);
    while lines_in(&log) < 5 {
        assert!(Instant::now() < deadline, "no steps");
        std::thread::sleep(Duration::from_millis(20));
    }
    let pid = launcher.id() as i32;
    // SAFETY: signals to a process this test started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    std::thread::sleep(Duration::from_secs(10));
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    wait::job_success(&mut launcher, &lines, &log, "the run after its launcher's pause");
    let steps: Vec<u64> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, (1..=600).collect::<Vec<u64>>(), "every step reported once, in order");
}
