//! The `lazarus plan` / `lazarus prob` interface that scripts depend on, run as a real process.

mod common;

use common::lazarus;

use serde_json::Value;

fn json(args: &[&str]) -> Value {
    let out = lazarus(args);
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("valid JSON")
}

/// Runs a command that must fail and returns its error message.
fn fails(args: &[&str]) -> String {
    let out = lazarus(args);
    assert!(!out.status.success(), "{args:?} should fail");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn temp_file(name: &str, contents: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("lazarus-cli-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, contents).unwrap();
    path
}

#[test]
fn plan_json_has_the_documented_shape() {
    let file = json(&["plan", "--loads", "10,20,30,40", "--nodes", "5", "--slots", "4", "--json"]);
    assert_eq!(file["format"], "lazarus-plan/1");
    assert_eq!(file["epoch"], 0);
    assert_eq!(file["experts"], 4);
    assert_eq!(file["shape"], serde_json::json!({"nodes": 5, "gpus_per_node": 1, "slots_per_gpu": 4}));
    assert_eq!(file["layers"].as_array().unwrap().len(), 1);
    let v = &file["layers"][0];
    assert_eq!(v["strategy"], "lazarus");
    let replicas: Vec<u64> = v["replicas"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
    assert_eq!(replicas, vec![2, 4, 6, 8]);
    let placement = v["placement"].as_array().unwrap();
    assert_eq!(placement.len(), 5);
    assert!(placement.iter().all(|n| n.as_array().unwrap().len() == 4));
    let recovery = v["recovery"].as_array().unwrap();
    assert_eq!(recovery.len(), 5);
    for (k, r) in recovery.iter().enumerate() {
        assert_eq!(r["failed"], k as u64);
        assert_eq!(r["method"], "exact");
        let p = r["probability"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&p));
    }
    assert_eq!(recovery[0]["probability"], 1.0);
    assert_eq!(recovery[1]["probability"], 1.0);
}

#[test]
fn prob_reproduces_figure_4() {
    let v = json(&["prob", "--replicas", "2,5,6,7", "--nodes", "5", "--slots", "4", "--failed", "3", "--strategy", "mro", "--json"]);
    assert!((v["probability"].as_f64().unwrap() - 0.7).abs() < 1e-12);
    assert_eq!(v["method"], "exact");
}

#[test]
fn placement_file_round_trip() {
    let v = json(&["plan", "--replicas", "2,3,3,4", "--nodes", "4", "--slots", "3", "--json"]);
    let file = temp_file("placement.json", &v.to_string());
    let p = json(&["prob", "--placement-file", file.to_str().unwrap(), "--failed", "2", "--json"]);
    // The lazarus plan beats MRO's 2/3 on a small example (replicas [2,3,3,4], 4 nodes of 3 slots).
    assert!((p["probability"].as_f64().unwrap() - 5.0 / 6.0).abs() < 1e-12, "{p}");
    let mro = json(&["prob", "--replicas", "2,3,3,4", "--nodes", "4", "--slots", "3", "--failed", "2", "--strategy", "mro", "--json"]);
    assert!((mro["probability"].as_f64().unwrap() - 2.0 / 3.0).abs() < 1e-12);
}

#[test]
fn loads_file_plans_every_layer() {
    let file = temp_file("loads.json", "[[10, 20, 30, 40], [40, 30, 20, 10], [1, 1, 1, 1]]");
    let v = json(&["plan", "--loads-file", file.to_str().unwrap(), "--nodes", "5", "--slots", "4", "--json"]);
    let layers = v["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 3);
    assert_eq!(layers[1]["replicas"], serde_json::json!([8, 6, 4, 2]));
    assert_eq!(layers[2]["replicas"], serde_json::json!([5, 5, 5, 5]));
    // The whole model survives k failures only if every layer does: never more likely than any
    // one layer, and `prob` on the file agrees with the curve `plan` reported.
    let model = v["model_recovery"].as_array().unwrap();
    assert_eq!(model.len(), 5);
    for (k, m) in model.iter().enumerate() {
        let p = m["probability"].as_f64().unwrap();
        for l in layers {
            assert!(p <= l["recovery"][k]["probability"].as_f64().unwrap() + 1e-12);
        }
    }
    let path = temp_file("three-layers.json", &v.to_string());
    let whole = json(&["prob", "--placement-file", path.to_str().unwrap(), "--failed", "2", "--json"]);
    assert_eq!(whole["probability"], model[2]["probability"]);
    let one = json(&["prob", "--placement-file", path.to_str().unwrap(), "--failed", "2", "--layer", "1", "--json"]);
    assert_eq!(one["probability"], layers[1]["recovery"][2]["probability"]);
    let e = fails(&["prob", "--placement-file", path.to_str().unwrap(), "--failed", "2", "--layer", "3"]);
    assert!(e.contains("--layer") && e.contains("3 layers"), "{e}");
    let e = fails(&["prob", "--placement-file", path.to_str().unwrap(), "--failed", "2", "--nodes", "4"]);
    assert!(e.contains("--nodes") && e.contains("has 5"), "{e}");
}

#[test]
fn demo_runs_and_human_output_shows_the_plan() {
    let out = lazarus(&["plan", "--demo"]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("node map") && text.contains("recovery probability by strategy"), "{text}");
    let out = lazarus(&["plan", "--loads", "1,2,3", "--nodes", "3", "--gpus-per-node", "2", "--slots", "2"]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("node   0: ["));
}

#[test]
fn malformed_input_names_the_field_and_value() {
    let base = ["plan", "--nodes", "5", "--slots", "4"];
    let with = |extra: &[&str]| -> Vec<String> { base.iter().chain(extra).map(|s| s.to_string()).collect() };
    let run = |args: Vec<String>| fails(&args.iter().map(String::as_str).collect::<Vec<_>>());

    let e = run(with(&["--loads", "10,abc,30"]));
    assert!(e.contains("--loads") && e.contains("abc"), "{e}");
    let e = run(with(&["--loads", "10,-5,30"]));
    assert!(e.contains("loads") && e.contains("-5"), "{e}");
    let e = run(with(&["--loads", "10,NaN,30"]));
    assert!(e.contains("loads") && e.contains("NaN"), "{e}");
    let e = run(with(&["--loads", "1,2", "--strategy", "best"]));
    assert!(e.contains("strategy") && e.contains("best"), "{e}");
    let e = run(with(&["--replicas", "2,5,6"]));
    assert!(e.contains("replicas sum to 13") && e.contains("20"), "{e}");
    let e = fails(&["plan", "--loads", "1,2", "--nodes", "5", "--slots", "0"]);
    assert!(e.contains("slots") && e.contains('0'), "{e}");
    let e = fails(&["plan", "--loads", "1,2,3,4,5,6", "--nodes", "1", "--slots", "4"]);
    assert!(e.contains("cannot host") && e.contains('6'), "{e}");
    let e = fails(&["prob", "--replicas", "2,5,6,7", "--nodes", "5", "--slots", "4", "--failed", "6"]);
    assert!(e.contains("failed") && e.contains('6'), "{e}");
    let e = fails(&["plan", "--nodes", "5", "--slots", "4"]);
    assert!(e.contains("--loads"), "{e}");

    let bad = temp_file("bad.json", "[[1, 2], [3,");
    let e = fails(&["plan", "--loads-file", bad.to_str().unwrap(), "--nodes", "2", "--slots", "2"]);
    assert!(e.contains("loads-file") && e.contains("bad.json"), "{e}");
    let neg = temp_file("neg.json", "[[1, 2], [3, -4]]");
    let e = fails(&["plan", "--loads-file", neg.to_str().unwrap(), "--nodes", "2", "--slots", "2"]);
    assert!(e.contains("layer 1") && e.contains("-4"), "{e}");
    let plan = |nodes: &str| {
        format!(
            r#"{{"format":"lazarus-plan/1","epoch":0,"shape":{{"nodes":2,"gpus_per_node":1,"slots_per_gpu":3}},"experts":3,"layers":[{{"placement":{nodes}}}]}}"#
        )
    };
    let short = temp_file("short.json", &plan("[[0, 1, 2], [0, 1]]"));
    let e = fails(&["prob", "--placement-file", short.to_str().unwrap(), "--failed", "1"]);
    assert!(e.contains("node 1") && e.contains("2 entries"), "{e}");
    let missing = temp_file("missing.json", &plan("[[0, 2, 2], [0, 2, 0]]"));
    let e = fails(&["prob", "--placement-file", missing.to_str().unwrap(), "--failed", "1"]);
    assert!(e.contains("expert 1"), "{e}");
    let bare = temp_file("bare.json", "[[0, 1, 2], [0, 1, 2]]");
    let e = fails(&["prob", "--placement-file", bare.to_str().unwrap(), "--failed", "1"]);
    assert!(e.contains("placement-file") && e.contains("as `lazarus plan` prints it in JSON"), "{e}");
}

#[test]
fn max_imbalance_trades_recovery_for_a_busy_worker_and_reports_both() {
    let base = ["plan", "--loads", "8,0,0,0,0,0,0,0", "--nodes", "4", "--slots", "4", "--min-replicas", "1", "--json"];
    let plain = json(&base);
    let mut args = base.to_vec();
    args.extend(["--max-imbalance", "1.05"]);
    let guarded = json(&args);
    let (plain, guarded) = (plain["layers"][0].clone(), guarded["layers"][0].clone());
    let p1 = |v: &Value| v["recovery"][1]["probability"].as_f64().unwrap();
    let imb = |v: &Value| v["imbalance"].as_f64().unwrap();
    assert!((imb(&plain) - 4.0 / 3.0).abs() < 1e-9 && (p1(&plain) - 0.5).abs() < 1e-9, "{plain}");
    assert!((imb(&guarded) - 1.0).abs() < 1e-9 && (p1(&guarded) - 0.25).abs() < 1e-9, "{guarded}");
    for node in guarded["placement"].as_array().unwrap() {
        assert!(node.as_array().unwrap().contains(&Value::from(0)), "every worker holds the hot expert: {guarded}");
    }
    let e = fails(&["plan", "--loads", "1,2", "--nodes", "2", "--slots", "1", "--max-imbalance", "0.7"]);
    assert!(e.contains("--max-imbalance") && e.contains("0.7"), "{e}");
    let e = fails(&["plan", "--replicas", "1,1", "--nodes", "2", "--slots", "1", "--max-imbalance", "1.1"]);
    assert!(e.contains("--loads"), "{e}");
}

#[test]
fn sizes_beyond_the_planning_core_and_a_full_stdout_are_errors() {
    let e = fails(&["plan", "--loads", "1,2", "--nodes", "2", "--slots", "100000000"]);
    assert!(e.contains("slots") && e.contains("at most"), "{e}");
    let e = fails(&["plan", "--loads", "1,2", "--nodes", "100000", "--slots", "2"]);
    assert!(e.contains("nodes") && e.contains("100000"), "{e}");
    // Equal loads whose sum overflows get equal replicas.
    let v = json(&["plan", "--loads", "1e308,1e308,30,40", "--nodes", "5", "--slots", "4", "--json"]);
    let r = &v["layers"][0]["replicas"];
    assert_eq!(r[0], r[1], "{v}");
    // Output that cannot be written is an error naming stdout, not a panic.
    let full = std::fs::OpenOptions::new().write(true).open("/dev/full");
    if let Ok(full) = full {
        let out = common::lazarus_command()
            .args(["plan", "--loads", "1,2", "--nodes", "2", "--slots", "2", "--json"])
            .stdout(full)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains("stdout") && !err.contains("panicked"), "{err}");
    }
}
