//! `lazarus sim` as a real process: JSON shape, the plot, and clear errors for bad traces.

mod common;

use common::{dir, lazarus, written};

#[test]
fn json_report_has_every_policy_and_a_breakdown_that_adds_up() {
    let d = dir("json");
    let svg = d.join("out.svg");
    let out = lazarus(&["sim", "--fail-every", "5m", "--model", "gpt-l", "--duration", "30m", "--json", "--plot", svg.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let policies = v["policies"].as_array().unwrap();
    let names: Vec<&str> = policies.iter().map(|p| p["policy"].as_str().unwrap()).collect();
    assert_eq!(names, ["lazarus", "ds", "ds-ft", "gemini", "moevement", "torchft"]);
    for p in policies {
        for key in ["trained_samples", "avg_samples_per_s", "restarts", "reconfigurations"] {
            assert!(p[key].is_number(), "{key} in {p}");
        }
        let b = &p["breakdown"];
        let total: f64 =
            ["compute_s", "checkpoint_s", "restart_s", "lost_work_s", "detect_s", "reconfig_s", "transfer_s", "rebalance_s", "idle_s"]
                .iter()
                .map(|k| b[k].as_f64().unwrap())
                .sum();
        assert!((total - 1800.0).abs() < 1e-3, "{}: {total}", p["policy"]);
        let ettr = p["ettr"].as_f64().unwrap();
        assert!((ettr - b["compute_s"].as_f64().unwrap() / total).abs() < 1e-9 && ettr > 0.0 && ettr < 1.0, "{}: ETTR {ettr}", p["policy"]);
    }
    let ettr = |i: usize| policies[i]["ettr"].as_f64().unwrap();
    assert!(ettr(0) > ettr(1), "Lazarus loses less time than a restart per failure: {} against {}", ettr(0), ettr(1));
    assert_eq!(policies[0]["restarts"], 0, "single failures never cost Lazarus a restart");
    let lazarus = &policies[0]["breakdown"];
    let failures = policies[0]["failures"].as_f64().unwrap();
    assert_eq!(lazarus["detect_s"].as_f64().unwrap(), failures * 15.0, "each failure found out by the 15 s time-out");
    assert!(lazarus["transfer_s"].as_f64().unwrap() > 0.0, "the survivors fetch what the lost node held");
    assert!(policies[0]["trained_samples"].as_f64().unwrap() > policies[1]["trained_samples"].as_f64().unwrap());
    let svg = std::fs::read_to_string(&svg).unwrap();
    assert!(svg.starts_with("<svg") && svg.matches("<polyline").count() == 12, "two panels x six policies");
}

/// A trace is simulated whole by default (to its last event, not 30 minutes of it), and a
/// window in which nothing happens is said to be one.
#[test]
fn a_trace_is_simulated_whole_unless_told_otherwise() {
    let d = dir("whole");
    // Offsets in milliseconds: the last event at 90 minutes.
    let t = &written(&d, "t.csv", "0,add,a\n0,add,b\n0,add,c\n600000,remove,a\n5400000,remove,b\n");
    let run = |extra: &[&str]| {
        let mut a = vec!["sim", "--trace", t, "--max-nodes", "3", "--json"];
        a.extend(extra);
        let out = lazarus(&a);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        (v["duration_s"].as_f64().unwrap(), String::from_utf8_lossy(&out.stderr).to_string())
    };
    let (whole, said) = run(&[]);
    assert_eq!(whole, 5400.0, "to the last event");
    assert!(said.contains("simulating the whole trace, 90.0 min"), "{said}");
    assert_eq!(run(&["--duration", "20m"]).0, 1200.0);
    assert_eq!(run(&["--window", "0:30m"]).0, 1800.0);
    let (_, said) = run(&["--window", "100m:130m"]);
    assert!(said.contains("no event of the trace falls in --window 100m:130m: it ends at 90.0 min"), "{said}");
}

#[test]
fn bad_traces_and_flags_are_named() {
    let d = dir("bad");
    let out = lazarus(&["sim", "--trace", &written(&d, "t.csv", "0,add,a\n0,add,b\n60000,explode,a\n")]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("line 3") && err.contains("explode"), "{err}");
    let empty = d.join("empty.csv");
    std::fs::write(&empty, "# nothing\n").unwrap();
    let bad_loads = d.join("bad-loads.json");
    std::fs::write(&bad_loads, "[[1, 2]]").unwrap();
    for (args, expect) in [
        (vec!["sim"], "--fail-every"),
        (vec!["sim", "--fail-every", "5m", "--model", "gpt-xxl"], "gpt-xxl"),
        (vec!["sim", "--fail-every", "soon"], "--fail-every"),
        (vec!["sim", "--fail-every", "5m", "--window", "80m:10m"], "--window"),
        (vec!["sim", "--fail-every", "5m", "--policy", "magic"], "--policy"),
        (vec!["sim", "--fail-every", "5m", "--poisson-mtbf", "1h"], "only one"),
        // Sizes and durations beyond any bound are errors, not runs without end.
        (vec!["sim", "--fail-every", "5m", "--duration", "1e14h"], "1e14h"),
        (vec!["sim", "--fail-every", "5m", "--nodes", "10000000"], "10000000"),
        (vec!["sim", "--fail-every", "5m", "--layers", "100000000"], "100000000"),
        (vec!["sim", "--fail-every", "5m", "--duration", "10000h"], "30 days"),
        (vec!["sim", "--trace", "/dev/zero"], "--trace"),
        (vec!["sim", "--trace", empty.to_str().unwrap()], "no events"),
        (vec!["sim", "--fail-every", "5m", "--loads-trace", bad_loads.to_str().unwrap()], "bad-loads.json"),
    ] {
        let out = lazarus(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(expect) && !err.contains("panicked"), "{args:?}: {err}");
    }
}

#[test]
fn replays_the_p3_spot_trace() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../traces/p3-trace.csv");
    let out = lazarus(&["sim", "--trace", path, "--window", "0:80m", "--max-nodes", "10", "--model", "gpt-l", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let samples = |i: usize| v["policies"][i]["trained_samples"].as_f64().unwrap();
    assert!(samples(0) > samples(2) && samples(2) > samples(1), "lazarus > ds-ft > ds on the spot trace");
}

/// `--sweep`: the scenario once per value, every policy's ETTR at each, in JSON and a chart; a
/// failure every 30 minutes costs Lazarus less of its time than one every 2 minutes.
#[test]
fn a_sweep_compares_every_policy_at_every_value() {
    let d = dir("sweep");
    let svg = d.join("sweep.svg");
    let plot = svg.to_str().unwrap();
    let out = lazarus(&["sim", "--sweep", "fail-every=2m,30m", "--model", "gpt-l", "--duration", "1h", "--json", "--plot", plot]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["sweep"], "fail-every");
    let points = v["points"].as_array().unwrap();
    assert_eq!(points.iter().map(|p| p["value"].as_str().unwrap()).collect::<Vec<_>>(), ["2m", "30m"]);
    let ettr = |p: usize, policy: &str| {
        let ps = points[p]["policies"].as_array().unwrap();
        assert_eq!(ps.len(), 6, "every policy");
        ps.iter().find(|x| x["policy"] == policy).unwrap()["ettr"].as_f64().unwrap()
    };
    assert!(ettr(1, "lazarus") > ettr(0, "lazarus"), "{} at 30m against {} at 2m", ettr(1, "lazarus"), ettr(0, "lazarus"));
    assert!((0..2).all(|p| ettr(p, "ds") < ettr(p, "lazarus")), "a restart per failure costs DS more of its time");
    let svg = std::fs::read_to_string(&svg).unwrap();
    assert!(svg.starts_with("<svg") && svg.matches("<polyline").count() == 6, "a line per policy");
    let out = lazarus(&["sim", "--sweep", "floor=1,2"]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("no setting a sweep varies"));
}

/// Nodes that come back ride along the next failure's move (`--join-rule repaid`) where
/// failures come often (32 nodes, one every ~4 minutes): fewer moves, less time lost to them.
#[test]
fn joins_that_ride_along_make_fewer_moves() {
    let out = lazarus(&[
        "sim",
        "--poisson-mtbf",
        "2h",
        "--repair",
        "10m",
        "--nodes",
        "32",
        "--max-nodes",
        "32",
        "--duration",
        "2h",
        "--policy",
        "lazarus",
        "--sweep",
        "join-rule=wait,repaid",
        "--json",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let at = |i: usize, key: &str| v["points"][i]["policies"][0][key].as_f64().unwrap();
    assert_eq!((v["points"][0]["value"].as_str(), v["points"][1]["value"].as_str()), (Some("wait"), Some("repaid")));
    assert!(at(1, "reconfigurations") < at(0, "reconfigurations"), "{v}");
    assert!(at(1, "ettr") > at(0, "ettr"), "{v}");
    let out = lazarus(&["sim", "--fail-every", "5m", "--policy", "lazarus", "--join-rule", "repaid", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["cost"]["join_rule"], "repaid", "the report says which rule ran");
    let out = lazarus(&["sim", "--fail-every", "5m", "--sweep", "join-rule=wait,soon"]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("join-rule: \"soon\""));
}

/// A failure mix from a published report: each failure found out by an exit or a time-out, as
/// its cause is, said in the text and the JSON; a report's mix alone sets the rate too; with
/// experts on one node, the snapshot tier's restores are said.
#[test]
fn a_failure_mix_and_the_snapshot_tier_are_reported() {
    let out = lazarus(&[
        "sim",
        "--fail-every",
        "3m",
        "--nodes",
        "8",
        "--max-nodes",
        "8",
        "--duration",
        "30m",
        "--failure-mix",
        "llama3",
        "--json",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["failure_mix"]["name"], "llama3");
    assert_eq!(v["failure_mix"]["causes"].as_array().unwrap().len(), 18);
    for p in v["policies"].as_array().unwrap() {
        let (failures, exits) = (p["failures"].as_u64().unwrap(), p["failures_seen_by_exit"].as_u64().unwrap());
        assert!(failures > 0 && exits <= failures, "{p}");
    }
    let out = lazarus(&[
        "sim",
        "--fail-every",
        "5m",
        "--nodes",
        "8",
        "--max-nodes",
        "8",
        "--slots-per-gpu",
        "2",
        "--min-replicas",
        "1",
        "--duration",
        "30m",
        "--policy",
        "lazarus",
        "--failure-mix",
        "llama3",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("failures found out by an exit (llama3 mix; the rest by a time-out): lazarus "), "{text}");
    assert!(text.contains("experts from snapshots instead of a rollback"), "{text}");
    // The report's rate alone: 1,024 GPUs for a month meet about fifteen interruptions.
    let out = lazarus(&[
        "sim",
        "--failure-mix",
        "llama3",
        "--nodes",
        "128",
        "--max-nodes",
        "128",
        "--gpus-per-node",
        "8",
        "--duration",
        "720h",
        "--policy",
        "ds",
        "--json",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let failures = v["policies"][0]["failures"].as_u64().unwrap();
    assert!((5..=30).contains(&failures), "{failures} failures in a month of 1,024 GPUs at Llama 3's rate (about 14.5 expected)");
    let out = lazarus(&["sim", "--failure-mix", "meta", "--fail-every", "5m"]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("expected llama3"));
}
