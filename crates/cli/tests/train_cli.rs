//! `lazarus train` as a real process: JSON log format, checkpoint + resume, config errors.

mod common;

use common::{dir, lazarus, log as log_of};

/// The tiny model of these tests.
fn tiny() -> [&'static str; 16] {
    common::tiny_model("2")
}

#[test]
fn json_log_checkpoint_and_resume() {
    let d = dir("resume");
    let log = d.join("log.jsonl");
    let ck = d.join("ck");
    let mut args = vec!["train", "--steps", "3", "--json-log", log.to_str().unwrap(), "--checkpoint-dir", ck.to_str().unwrap()];
    args.extend(tiny());
    let out = lazarus(&args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("summary") && stdout.contains("unigram entropy") && stdout.contains("checkpoint"), "{stdout}");
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&log).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 3);
    for (i, l) in lines.iter().enumerate() {
        assert_eq!(l["step"], i as u64 + 1);
        assert!(l["loss"].as_f64().unwrap() > 0.0);
        assert!(l["aux_loss"].as_f64().is_some());
        assert_eq!(l["tokens"], 32);
        assert!(l["tokens_per_s"].as_f64().unwrap() > 0.0);
        // Wall time since the start: positive, and it only grows.
        let elapsed = l["elapsed_s"].as_f64().unwrap();
        assert!(elapsed > 0.0 && (i == 0 || elapsed >= lines[i - 1]["elapsed_s"].as_f64().unwrap()), "{l}");
        let load = l["expert_load"].as_array().unwrap();
        assert_eq!(load.len(), 2);
        let total: u64 = load[0].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).sum();
        assert_eq!(total, 64, "top-2 over 32 tokens");
    }
    // Resume to step 5: the log grows by two lines and continues the step count.
    let out =
        lazarus(&["train", "--resume", "--steps", "5", "--checkpoint-dir", ck.to_str().unwrap(), "--json-log", log.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("resumed"));
    let steps: Vec<u64> = log_of(&log).0.iter().map(|s| s.0).collect();
    assert_eq!(steps, vec![1, 2, 3, 4, 5]);
    assert_eq!(std::fs::read_to_string(ck.join("latest")).unwrap(), "step-00000005");
    // The log is a routing trace the simulator replays (its layers and experts must match).
    let n_experts = lines[0]["expert_load"][0].as_array().unwrap().len().to_string();
    let trace = [
        "sim",
        "--fail-every",
        "5m",
        "--duration",
        "20m",
        "--layers",
        "2",
        "--experts",
        &n_experts,
        "--loads-trace",
        log.to_str().unwrap(),
        "--json",
    ];
    let out = lazarus(&trace);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["policies"].as_array().unwrap().len(), 6, "every policy");
    let mut wrong = trace.to_vec();
    wrong[8] = "3";
    let out = lazarus(&wrong);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("3 experts"), "{err}");
}

#[test]
fn toml_config_is_read_and_flags_override_it() {
    let d = dir("toml");
    let cfg = d.join("run.toml");
    std::fs::write(
        &cfg,
        "steps = 2\nbatch_size = 2\nseq_len = 16\n[model]\nd_model = 32\nn_layers = 1\nn_heads = 2\nn_experts = 4\nd_ff = 32\ntop_k = 1\n[data]\nkind = \"synthetic\"\nseed = 1\nbytes = 20000\n",
    )
    .unwrap();
    let log = d.join("log.jsonl");
    let out = lazarus(&["train", "--config", cfg.to_str().unwrap(), "--steps", "1", "--json-log", log.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = std::fs::read_to_string(&log).unwrap();
    assert_eq!(text.lines().count(), 1);
    let v: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    let total: u64 = v["expert_load"][0].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).sum();
    assert_eq!(total, 32, "top-1 from the config file");
}

#[test]
fn bad_settings_are_named() {
    let d = dir("bad");
    let cases: [(&[&str], &str); 6] = [
        (&["--top-k", "9"], "top_k"),
        (&["--heads", "3"], "n_heads"),
        (&["--lr", "-1"], "lr"),
        (&["--data-format", "u8", "--data", "x.bin"], "data-format"),
        (&["--grad-clip", "abc"], "grad-clip"),
        (&["--steps", "0"], "steps"),
    ];
    for (extra, field) in cases {
        let mut args = vec!["train"];
        args.extend(extra);
        // The tiny model's flags, minus those this case sets itself.
        for pair in tiny().chunks(2) {
            if !extra.contains(&pair[0]) {
                args.extend(pair);
            }
        }
        let out = lazarus(&args);
        assert!(!out.status.success(), "{extra:?} should fail");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(field), "{extra:?}: {err}");
    }
    let cfg = d.join("bad.toml");
    std::fs::write(&cfg, "[model]\nexperts = 8\n").unwrap();
    let out = lazarus(&["train", "--config", cfg.to_str().unwrap()]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("experts") && err.contains("bad.toml"), "{err}");
    // No run to go on with (none under an empty runs directory).
    let mut resume = common::lazarus_command();
    resume.env("LAZARUS_RUNS_DIR", d.join("no-runs")).args(["train", "--resume"]);
    let out = common::output_within(resume, "lazarus train --resume");
    assert!(String::from_utf8_lossy(&out.stderr).contains("--resume: no run under"), "{}", String::from_utf8_lossy(&out.stderr));
    let missing = d.join("nope.txt");
    let mut args = vec!["train", "--data", missing.to_str().unwrap()];
    args.extend(tiny());
    let out = lazarus(&args);
    assert!(String::from_utf8_lossy(&out.stderr).contains("nope.txt"));
}

/// Runs a `lazarus train` that must fail; its stderr.
fn train_fails(args: &[&str]) -> String {
    let mut all = vec!["train"];
    all.extend(args);
    let out = lazarus(&all);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{args:?} should fail: {err}");
    assert!(!err.contains("panicked"), "{args:?}: {err}");
    err
}

#[test]
fn no_flag_is_silently_ignored_and_bad_sizes_are_named_before_allocation() {
    let d = common::dir("ignored");
    let text_cfg = d.join("text.toml");
    let corpus = d.join("corpus.txt");
    std::fs::write(&corpus, "hello world ".repeat(100)).unwrap();
    std::fs::write(&text_cfg, format!("[data]\nkind = \"text\"\npath = {:?}\n", corpus.to_str().unwrap())).unwrap();
    let a_file = d.join("a-file");
    std::fs::write(&a_file, "x").unwrap();
    for (args, expect) in [
        (vec!["--static-ep"], "--static-ep needs --workers"),
        (vec!["--comm-timeout", "5"], "--comm-timeout needs --workers"),
        (vec!["--max-imbalance", "1.2"], "--max-imbalance needs --workers"),
        (vec!["--config", text_cfg.to_str().unwrap(), "--synthetic-bytes", "5000"], "--synthetic-bytes"),
        (vec!["--data", corpus.to_str().unwrap(), "--synthetic-bytes", "5000"], "--synthetic-bytes"),
        (vec!["--data-format", "u16"], "--data-format u16 needs --data"),
        (vec!["--checkpoint-every", "5", "--no-save"], "--checkpoint-every"),
        (vec!["--checkpoint-dir", a_file.to_str().unwrap()], "is not a directory"),
        (vec!["--experts", "100000000"], "n_experts"),
        (vec!["--d-model", "16384", "--heads", "1", "--d-ff", "131072"], "GiB"),
        (vec!["--synthetic-bytes", "100000000000"], "data.bytes"),
        (vec!["--data", "/dev/zero"], "not a regular file"),
        (vec!["--workers", "2", "--comm-timeout", "1e30"], "--comm-timeout"),
        (vec!["--workers", "2", "--profile-steps", "100000000000"], "--profile-steps"),
    ] {
        let e = train_fails(&args);
        assert!(e.contains(expect), "{args:?}: {e}");
    }
    // A log that cannot be written is named at the first step.
    let e = train_fails(&[
        "--steps",
        "2",
        "--json-log",
        "/dev/full",
        "--d-model",
        "16",
        "--layers",
        "1",
        "--heads",
        "2",
        "--experts",
        "2",
        "--d-ff",
        "16",
        "--seq-len",
        "8",
        "--batch-size",
        "2",
        "--synthetic-bytes",
        "3000",
    ]);
    assert!(e.contains("--json-log") && e.contains("/dev/full"), "{e}");
}

/// The long flags `lazarus ARGS --help` lists.
fn flags_of(args: &[&str]) -> Vec<String> {
    let mut all = args.to_vec();
    all.push("--help");
    let out = lazarus(&all);
    assert!(out.status.success());
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.trim_start().split([' ', ',', '=']).find(|w| w.starts_with("--")).map(String::from))
        .filter(|f| f != "--help")
        .collect()
}

/// Each benchmark's flags are its own: every flag of `train` that a benchmark does not list
/// (a run's length, checkpoints, logs, worker processes) is refused by it as unknown, not
/// accepted and ignored; and `bench train` refuses a `--config` that names a checkpoint
/// directory and a model too large for the machine, before building anything. Nothing is
/// written.
#[test]
fn benchmarks_take_only_their_own_flags() {
    let d = common::dir("bench-flags");
    let train = flags_of(&["train"]);
    for bench in [&["bench", "train"][..], &["bench", "recovery"][..]] {
        let own = flags_of(bench);
        for f in ["--checkpoint-dir", "--json-log", "--resume", "--overwrite-checkpoints", "--static-ep", "--placement-file"] {
            assert!(train.iter().any(|t| t == f) && !own.iter().any(|o| o == f), "{bench:?} lists {f}");
        }
        for flag in train.iter().filter(|t| !own.contains(t)) {
            let mut all = bench.to_vec();
            all.extend([flag.as_str(), "1"]);
            let out = lazarus(&all);
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success() && err.contains(&format!("unexpected argument '{flag}'")), "{bench:?} {flag}: {err}");
        }
    }
    let ck = d.join("ck");
    let cfg = d.join("with-ck.toml");
    std::fs::write(&cfg, format!("checkpoint_dir = {:?}\n", ck.to_str().unwrap())).unwrap();
    for (args, expect) in [
        (vec!["--config", cfg.to_str().unwrap()], "checkpoint_dir"),
        (vec!["--d-model", "16384", "--heads", "1", "--d-ff", "131072"], "GiB"),
    ] {
        let mut all = vec!["bench", "train", "--no-torch", "--iters", "1"];
        all.extend(&args);
        let out = lazarus(&all);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} should fail: {err}");
        assert!(err.contains(expect) && !err.contains("panicked"), "{args:?}: {err}");
    }
    assert!(!ck.exists(), "a refused bench wrote something");
}

#[test]
fn resuming_with_a_config_that_says_otherwise_is_an_error() {
    let d = common::dir("resume-config");
    let ck = d.join("ck");
    let mut args = vec!["train", "--steps", "2", "--checkpoint-dir", ck.to_str().unwrap()];
    args.extend(tiny());
    assert!(lazarus(&args).status.success());
    // A config that only names the directory (and raises the steps) is fine…
    let same = d.join("same.toml");
    std::fs::write(&same, format!("steps = 3\ncheckpoint_dir = {:?}\n", ck.to_str().unwrap())).unwrap();
    let out = lazarus(&["train", "--resume", "--config", same.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // …one that changes the model is not.
    let other = d.join("other.toml");
    std::fs::write(&other, format!("steps = 4\ncheckpoint_dir = {:?}\n[model]\nd_model = 64\n", ck.to_str().unwrap())).unwrap();
    let e = train_fails(&["--resume", "--config", other.to_str().unwrap()]);
    assert!(e.contains("model.d_model = 64") && e.contains("the checkpoint has 32"), "{e}");
    // Flags may repeat the run's settings (the same command line with --resume), not change them.
    let mut again = vec!["train", "--resume", "--steps", "4", "--checkpoint-dir", ck.to_str().unwrap()];
    again.extend(tiny());
    let out = lazarus(&again);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let e = train_fails(&["--resume", "--steps", "5", "--checkpoint-dir", ck.to_str().unwrap(), "--lr", "0.1"]);
    assert!(e.contains("lr = 0.1") && e.contains("the checkpoint has 0.002"), "{e}");
}

/// Checkpoints a user can trust: a diverging run stops with an error and
/// saves nothing diverged; a byte flipped in the newest checkpoint is found, and `--resume` goes
/// on from the newest intact one, saying which it passed over.
#[test]
fn a_diverging_run_stops_and_a_damaged_checkpoint_gives_way_to_an_intact_one() {
    let d = dir("trust");
    let ck = d.join("ck");
    let ck_s = ck.to_str().unwrap();
    let mut args =
        vec!["train", "--steps", "10", "--lr", "1e30", "--warmup-steps", "0", "--checkpoint-dir", ck_s, "--checkpoint-every", "1"];
    args.extend(tiny());
    let out = lazarus(&args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("training diverged at step"), "{err}");
    // The same with worker processes: every rank refuses the step, the job stops saying why.
    let mut workers = vec!["train", "--workers", "2", "--steps", "10", "--lr", "1e30", "--warmup-steps", "0"];
    workers.extend(tiny());
    let out = lazarus(&workers);
    let werr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && werr.contains("training diverged at step"), "{werr}");
    for entry in std::fs::read_dir(&ck).unwrap().flatten() {
        let manifest = entry.path().join("manifest.json");
        if manifest.exists() {
            // What was saved before the divergence is finite (it loads).
            let out = lazarus(&["train", "--steps", "10", "--checkpoint-dir", entry.path().to_str().unwrap(), "--resume"]);
            assert!(!String::from_utf8_lossy(&out.stderr).contains("damaged"), "{}", String::from_utf8_lossy(&out.stderr));
        }
    }
    let _ = std::fs::remove_dir_all(&ck);
    let mut args = vec!["train", "--steps", "4", "--checkpoint-dir", ck_s, "--checkpoint-every", "2"];
    args.extend(tiny());
    assert!(lazarus(&args).status.success());
    let newest = ck.join("step-00000004").join("model.safetensors");
    let mut bytes = std::fs::read(&newest).unwrap();
    let at = bytes.len() - 64;
    bytes[at] ^= 1;
    std::fs::write(&newest, bytes).unwrap();
    let mut args = vec!["train", "--steps", "6", "--checkpoint-dir", ck_s, "--resume"];
    args.extend(tiny());
    let out = lazarus(&args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("step-00000004") && err.contains("model.safetensors is damaged"), "{err}");
    assert!(err.contains("resuming from the newest intact checkpoint") && err.contains("step-00000002"), "{err}");
}

/// A fresh run does not silently replace another run's checkpoints; two runs do not write one
/// directory at once; and `--resume` logs the steps it redoes once.
#[test]
fn checkpoints_of_a_run_are_not_overwritten_and_a_resume_logs_each_step_once() {
    let d = dir("overwrite");
    let (ck, log) = (d.join("ck"), d.join("log.jsonl"));
    let (ck_s, log_s) = (ck.to_str().unwrap(), log.to_str().unwrap());
    let mut args = vec!["train", "--steps", "6", "--checkpoint-dir", ck_s, "--checkpoint-every", "2", "--json-log", log_s];
    args.extend(tiny());
    assert!(lazarus(&args).status.success());
    // A fresh run in the same directory: refused, naming the two ways on.
    let out = lazarus(&args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--resume") && err.contains("--overwrite-checkpoints"), "{err}");
    assert_eq!(std::fs::read_to_string(ck.join("latest")).unwrap(), "step-00000006", "nothing replaced");
    let mut both = args.clone();
    both.extend(["--resume", "--overwrite-checkpoints"]);
    assert!(String::from_utf8_lossy(&lazarus(&both).stderr).contains("give one of them"));
    // Resumed from step 4 (the final checkpoint of step 6 removed): steps 5 and 6 run again and
    // are logged once.
    std::fs::remove_dir_all(ck.join("step-00000006")).unwrap();
    std::fs::write(ck.join("latest"), "step-00000004").unwrap();
    let mut resume = args.clone();
    resume.push("--resume");
    let out = lazarus(&resume);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let steps: Vec<u64> = log_of(&log).0.iter().map(|s| s.0).collect();
    assert_eq!(steps, vec![1, 2, 3, 4, 5, 6]);
    // Asked to, a new run starts over them.
    let mut over = args.clone();
    over.push("--overwrite-checkpoints");
    assert!(lazarus(&over).status.success());
    // A second run while one holds the directory: refused, naming the holder.
    let mut long = vec!["train", "--steps", "100000", "--checkpoint-dir", ck_s, "--overwrite-checkpoints"];
    long.extend(tiny());
    let (mut first, _lines) = common::spawn_lazarus(&long, &[]);
    let lock = ck.join(".lock");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while std::fs::read_to_string(&lock).map_or(true, |s| s.trim() != first.id().to_string()) {
        assert!(std::time::Instant::now() < deadline, "the first run takes the lock");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let out = lazarus(&over);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains(&format!("another run (pid {})", first.id())), "{err}");
    let _ = first.kill();
    let _ = first.wait();
}

#[test]
fn only_the_newest_checkpoints_are_kept() {
    let d = dir("keep");
    let ck = d.join("ck");
    let mut args =
        vec!["train", "--steps", "5", "--checkpoint-dir", ck.to_str().unwrap(), "--checkpoint-every", "1", "--keep-checkpoints", "2"];
    args.extend(tiny());
    let out = lazarus(&args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let mut kept: Vec<String> = std::fs::read_dir(&ck)
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.starts_with("step-"))
        .collect();
    kept.sort();
    assert_eq!(kept, vec!["step-00000004", "step-00000005"]);
    let mut args = vec!["train", "--steps", "5", "--keep-checkpoints", "2", "--no-save"];
    args.extend(tiny());
    let out = lazarus(&args);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("--keep-checkpoints"));
}

/// A run started over another's checkpoints (--overwrite-checkpoints) keeps them, aside; when
/// its own newest is damaged and `latest` is gone, --resume goes back to its own older
/// checkpoint — never on with the other run.
#[test]
fn a_fallback_never_crosses_runs() {
    let d = dir("runs");
    let ck = d.join("ck");
    let ck_s = ck.to_str().unwrap();
    let run = |steps: &str, extra: &[&str]| {
        let mut args = vec!["train", "--steps", steps, "--checkpoint-dir", ck_s, "--checkpoint-every", "2", "--keep-checkpoints", "0"];
        args.extend(extra);
        args.extend(tiny());
        lazarus(&args)
    };
    let out = run("8", &[]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let out = run("4", &["--overwrite-checkpoints"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && err.contains("earlier run's checkpoints are kept in"), "{err}");
    let kept: Vec<_> = std::fs::read_dir(ck.join("previous-runs")).unwrap().flatten().collect();
    assert_eq!(kept.len(), 1);
    assert!(kept[0].path().join("step-00000008").join("manifest.json").is_file(), "the old run's newest is kept");
    // The new run's newest damaged, `latest` gone: back to its step 2, not on from the old 8.
    std::fs::write(ck.join("step-00000004").join("model.safetensors"), b"garbage").unwrap();
    std::fs::remove_file(ck.join("latest")).unwrap();
    let out = run("6", &["--resume"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("resumed from") && err.contains("at step 2"), "{err}");
    assert!(err.contains("newer checkpoint(s) of this run would be written over; kept in"), "the damaged step 4 is set aside: {err}");
}

/// `--resume --checkpoint-dir ck/step-N` — one process and two workers — goes on from step N
/// in the run's directory `ck`: the later checkpoints set aside, `latest` naming the new
/// ones, nothing written inside the checkpoint resumed from. (Before, the run wrote
/// `ck/step-N/step-M` and a `latest` inside the checkpoint, nested deeper each time.)
#[test]
fn a_resume_from_a_step_directory_goes_on_in_its_run() {
    for (name, extra) in [("one-process", &[][..]), ("workers", &["--workers", "2"][..])] {
        let d = dir(&format!("resume-step-dir-{name}"));
        let ck = d.join("ck");
        let run = |dir: &std::path::Path, steps: &str, resume: bool| {
            let mut args = vec!["train", "--steps", steps, "--checkpoint-dir", dir.to_str().unwrap(), "--checkpoint-every", "4"];
            args.extend(["--keep-checkpoints", "0"]);
            args.extend(extra);
            if resume {
                args.push("--resume");
            }
            args.extend(tiny());
            lazarus(&args)
        };
        let out = run(&ck, "8", false);
        assert!(out.status.success(), "{name}: {}", String::from_utf8_lossy(&out.stderr));
        let step4 = ck.join("step-00000004");
        let before: Vec<_> = std::fs::read_dir(&step4).unwrap().flatten().map(|e| e.file_name()).collect();
        // A new run there is refused: it is a checkpoint.
        let out = run(&step4, "12", false);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains("is a checkpoint, not a run's directory"), "{name}: {err}");
        let out = run(&step4, "12", true);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{name}: {err}");
        assert!(err.contains("newer checkpoint(s) of this run would be written over; kept in"), "{name}: step 8 set aside: {err}");
        let after: Vec<_> = std::fs::read_dir(&step4).unwrap().flatten().map(|e| e.file_name()).collect();
        assert_eq!(after, before, "{name}: nothing written inside the checkpoint resumed from");
        assert_eq!(std::fs::read_to_string(ck.join("latest")).unwrap().trim(), "step-00000012", "{name}");
        for step in ["step-00000004", "step-00000008", "step-00000012"] {
            assert!(ck.join(step).join("manifest.json").is_file(), "{name}: {step} in the run's directory");
        }
        let manifest: serde_json::Value = serde_json::from_slice(&std::fs::read(ck.join("step-00000012/manifest.json")).unwrap()).unwrap();
        let saved = manifest["extra"]["config"]["checkpoint_dir"].as_str().unwrap_or_default().to_string();
        assert_eq!(std::path::Path::new(&saved), ck, "{name}: the run's directory, in its saved settings");
    }
}

/// One process, and worker processes with and without recovery (the controller asks every
/// worker to finish after the same step): SIGTERM ends the run at a step boundary with the final
/// checkpoint, and `--resume` goes on from it.
#[test]
fn sigterm_ends_a_run_at_a_step_boundary_with_a_checkpoint() {
    for (name, extra) in [
        ("one-process", &[][..]),
        ("static-ep", &["--workers", "2", "--static-ep"][..]),
        ("recovery-off", &["--workers", "2", "--recovery", "off"][..]),
        ("recovery", &["--workers", "2"][..]),
    ] {
        let d = dir(&format!("sigterm-{name}"));
        let (ck, log) = (d.join("ck"), d.join("log.jsonl"));
        let (ck_s, log_s) = (ck.to_str().unwrap(), log.to_str().unwrap());
        let mut args = vec!["train", "--steps", "100000", "--checkpoint-dir", ck_s, "--json-log", log_s];
        args.extend(extra);
        args.extend(tiny());
        let logged = || std::fs::read_to_string(&log).map_or(0, |s| s.lines().count());
        let (mut child, lines) = common::spawn_lazarus(&args, &[]);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while logged() < 3 {
            assert!(std::time::Instant::now() < deadline, "{name}: the run logs its first steps");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        // SAFETY: a signal to our own child.
        unsafe {
            libc::kill(child.id() as i32, libc::SIGTERM);
        }
        let (status, stderr) =
            common::wait::exit(&mut child, &lines, format!("{name}: the run stopped by SIGTERM"), std::time::Duration::from_secs(30));
        assert_eq!(status.code(), Some(143), "{name}: exits as a SIGTERM would: {stderr:?}");
        let n = logged() as u64;
        assert!(stderr.iter().any(|l| l.contains("SIGTERM: stopped after step") && l.contains("written")), "{name}: {stderr:?}");
        assert_eq!(std::fs::read_to_string(ck.join("latest")).unwrap(), format!("step-{n:08}"), "{name}: the last logged step is saved");
        // --resume goes on from it, each step logged once.
        let to = (n + 2).to_string();
        let mut resume = vec!["train", "--resume", "--steps", &to, "--checkpoint-dir", ck_s, "--json-log", log_s];
        resume.extend(extra);
        resume.extend(tiny());
        let out = lazarus(&resume);
        assert!(out.status.success(), "{name}: {}", String::from_utf8_lossy(&out.stderr));
        let steps: Vec<u64> = log_of(&log).0.iter().map(|s| s.0).collect();
        assert_eq!(steps, (1..=n + 2).collect::<Vec<_>>(), "{name}");
    }
}

/// Held-out data: `train --eval-data` evaluates every `--eval-every` steps and at the end (a
/// line, a `--json-log` record, the summary's), and `lazarus eval` on the run's checkpoint
/// finds the same loss over the same windows; worker processes evaluate together to the same
/// losses.
#[test]
fn held_out_loss_during_training_and_of_a_checkpoint_agree() {
    let d = common::dir("eval");
    let (ck, log, held) = (d.join("ck"), d.join("log.jsonl"), d.join("held-out.txt"));
    std::fs::write(&held, "the quick brown fox jumps over the lazy dog; ".repeat(40)).unwrap();
    let (ck_s, log_s, held_s) = (ck.to_str().unwrap(), log.to_str().unwrap(), held.to_str().unwrap());
    let mut args = vec!["train", "--steps", "6", "--checkpoint-dir", ck_s, "--checkpoint-every", "3", "--json-log", log_s];
    args.extend(["--eval-data", held_s, "--eval-every", "2", "--eval-windows", "11"]);
    args.extend(tiny());
    let out = lazarus(&args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("eval            loss"), "{}", String::from_utf8_lossy(&out.stdout));
    let evals = |path: &std::path::Path| -> Vec<(u64, f64)> {
        std::fs::read_to_string(path)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .filter(|v| v["event"] == "eval")
            .map(|v| (v["step"].as_u64().unwrap(), v["loss"].as_f64().unwrap()))
            .collect()
    };
    let seen = evals(&log);
    assert_eq!(seen.iter().map(|e| e.0).collect::<Vec<_>>(), vec![2, 4, 6], "every 2 steps and at the end");
    assert!(seen.iter().all(|e| e.1.is_finite() && e.1 > 0.0));
    // The checkpoint's loss over the same 11 windows, by lazarus eval.
    let checkpoint_loss = |ck: &str| -> f64 {
        let out = lazarus(&["eval", "--checkpoint", ck, "--data", held_s, "--windows", "11", "--json"]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let e: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!((e["step"].as_u64(), e["windows"].as_u64()), (Some(6), Some(11)), "{e}");
        e["loss"].as_f64().unwrap()
    };
    let e = checkpoint_loss(ck_s);
    assert!((e - seen[2].1).abs() < 1e-6, "{e} vs {seen:?}");
    // Two worker processes: the same evaluations, each pass's windows shared out over them (11
    // windows in passes of 2: the last one leaves a worker without a window), the same loss as
    // their checkpoint's and, within the workers' float sums, as the single process's.
    let (ck3, log3) = (d.join("ck3"), d.join("w3.jsonl"));
    let mut args = vec!["train", "--steps", "6", "--workers", "2", "--checkpoint-dir", ck3.to_str().unwrap()];
    args.extend(["--json-log", log3.to_str().unwrap(), "--eval-data", held_s, "--eval-every", "2", "--eval-windows", "11"]);
    args.extend(tiny());
    let out = lazarus(&args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("eval            loss"), "{}", String::from_utf8_lossy(&out.stdout));
    let seen3 = evals(&log3);
    assert_eq!(seen3.iter().map(|e| e.0).collect::<Vec<_>>(), vec![2, 4, 6], "every 2 steps and at the end");
    for ((_, a), (_, b)) in seen3.iter().zip(&seen) {
        assert!((a - b).abs() <= 1e-4 * b, "workers {seen3:?} vs one process {seen:?}");
    }
    let e3 = checkpoint_loss(ck3.to_str().unwrap());
    assert!((e3 - seen3[2].1).abs() <= 1e-5 * e3, "{e3} vs {seen3:?}");
    // Refused: evaluation flags without held-out data, a data file too short.
    for (extra, want) in [
        (vec!["--eval-every", "2"], "--eval-every needs --eval-data"),
        (vec!["--eval-data", held_s, "--eval-every", "0"], "invalid --eval-every: 0"),
    ] {
        let mut a = vec!["train", "--steps", "1"];
        a.extend(extra.iter().copied());
        a.extend(tiny());
        let out = lazarus(&a);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(want), "{extra:?}: {err}");
    }
    // The workers' held-out tokens travel in their job's spec: bounded, and said so.
    let big = d.join("big.txt");
    std::fs::write(&big, "ab".repeat(5 << 19)).unwrap();
    let mut a = vec!["train", "--steps", "1", "--workers", "2", "--eval-data", big.to_str().unwrap(), "--eval-windows", "300000"];
    a.extend(tiny());
    let out = lazarus(&a);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("invalid --eval-windows: 300000") && err.contains("with --workers at most"), "{err}");
    let short = d.join("short.txt");
    std::fs::write(&short, "abc").unwrap();
    let out = lazarus(&["eval", "--checkpoint", ck_s, "--data", short.to_str().unwrap()]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("not one window"));
}

/// JSON-lines documents train and evaluate as text does; token shards whose ids pass the byte
/// vocabulary need `--vocab-size`, and without it the error names the token.
#[test]
fn json_lines_and_a_larger_vocabulary_train() {
    let d = common::dir("jsonl");
    let docs = d.join("docs.jsonl");
    let line = |i: usize| format!("{{\"text\": \"document {i}: the quick brown fox jumps over the lazy dog\", \"id\": {i}}}\n");
    std::fs::write(&docs, (0..200).map(line).collect::<String>()).unwrap();
    let docs_s = docs.to_str().unwrap();
    let mut args = vec!["train", "--steps", "3", "--data", docs_s, "--data-format", "jsonl", "--eval-data", docs_s];
    args.extend(&common::tiny_model("2")[..12]);
    let out = lazarus(&args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("(JSON lines)"), "{}", String::from_utf8_lossy(&out.stderr));
    // u16 shards with ids up to 999.
    let shard = d.join("a.bin");
    let ids: Vec<u8> = (0..4000u32).flat_map(|i| (((i * 37) % 1000) as u16).to_le_bytes()).collect();
    std::fs::write(&shard, ids).unwrap();
    let mut args = vec!["train", "--steps", "2", "--data", shard.to_str().unwrap(), "--data-format", "u16"];
    args.extend(&common::tiny_model("2")[..12]);
    let out = lazarus(&args);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("outside the vocabulary of 256"));
    args.extend(["--vocab-size", "1000"]);
    let out = lazarus(&args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// A model trained on a repeating text goes on with it: greedy generation after a prompt
/// continues the pattern (the model, not the prompt, decides: the continuation is longer than
/// the prompt), the same seed gives the same sampled text, and a bad request is named.
#[test]
fn generation_continues_what_the_model_learned() {
    let d = common::dir("generate");
    let (data, ck) = (d.join("d.txt"), d.join("ck"));
    std::fs::write(&data, "abcdefgh".repeat(3000)).unwrap();
    let (data_s, ck_s) = (data.to_str().unwrap(), ck.to_str().unwrap());
    let mut args = vec!["train", "--steps", "150", "--lr", "0.01", "--data", data_s, "--checkpoint-dir", ck_s];
    args.extend(&common::tiny_model("8")[..12]);
    assert!(lazarus(&args).status.success());
    let gen = |extra: &[&str]| {
        let mut a = vec!["generate", "--checkpoint", ck_s, "--prompt", "abcde", "--tokens", "20"];
        a.extend(extra);
        let out = lazarus(&a);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).trim_end().to_string()
    };
    assert_eq!(gen(&["--temperature", "0"]), "abcdefghabcdefghabcdefgha");
    assert_eq!(gen(&["--seed", "3", "--temperature", "2"]), gen(&["--seed", "3", "--temperature", "2"]));
    for (extra, want) in [
        (&["--prompt", ""][..], "invalid --prompt"),
        (&["--tokens", "0"][..], "invalid --tokens"),
        (&["--temperature", "-1"][..], "invalid --temperature"),
    ] {
        let mut a = vec!["generate", "--checkpoint", ck_s];
        a.extend(extra);
        if !a.contains(&"--prompt") {
            a.extend(["--prompt", "ab"]);
        }
        let out = lazarus(&a);
        assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains(want), "{extra:?}");
    }
}

/// A tokenizer made from the built-in corpus (`lazarus tokenizer`, nothing downloaded) sizes the
/// vocabulary and tokenizes the data for one process and for workers alike (the same losses),
/// for the held-out data of `lazarus eval` and for the prompts of `lazarus generate`; a
/// vocabulary too small for it, or token shards with it, are refused.
#[test]
fn a_subword_tokenizer_trains_evaluates_and_generates() {
    let d = common::dir("tokenizer");
    let tok = d.join("tokenizer.json");
    let tok_s = tok.to_str().unwrap();
    let out = lazarus(&["tokenizer", "--data", "synthetic", "--synthetic-bytes", "100000", "--vocab-size", "400", "--out", tok_s]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(!lazarus(&["tokenizer", "--data", "synthetic", "--out", tok_s]).status.success(), "never written over");
    let run = |extra: &[&str], log: &std::path::Path| {
        let mut a = vec!["train", "--steps", "4", "--tokenizer", tok_s, "--json-log", log.to_str().unwrap()];
        a.extend(tiny());
        a.extend(extra);
        let out = lazarus(&a);
        assert!(out.status.success(), "{extra:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stderr).to_string()
    };
    let ck = d.join("ck");
    let (one, two) = (d.join("one.jsonl"), d.join("two.jsonl"));
    run(&["--checkpoint-dir", ck.to_str().unwrap()], &one);
    run(&["--workers", "2"], &two);
    let losses = |p: &std::path::Path| common::log(p).0.into_iter().map(|(_, l)| l).collect::<Vec<f64>>();
    let (a, b) = (losses(&one), losses(&two));
    assert_eq!(a.len(), 4);
    // The first loss is about ln(vocabulary): the tokenizer's 400, not 256 bytes.
    assert!((a[0] - 400f64.ln()).abs() < 0.3, "{a:?}");
    for (x, y) in a.iter().zip(&b) {
        assert!((x - y).abs() <= 1e-4 * x, "one process {x} vs two workers {y}");
    }
    let held = d.join("held.txt");
    std::fs::write(&held, "the quick brown fox jumps over the lazy dog. ".repeat(50)).unwrap();
    let out = lazarus(&["eval", "--checkpoint", ck.to_str().unwrap(), "--data", held.to_str().unwrap(), "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let e: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(e["tokens"].as_u64().unwrap() < 2250, "subword tokens, fewer than the bytes: {e}");
    let out = lazarus(&["generate", "--checkpoint", ck.to_str().unwrap(), "--prompt", "the ", "--tokens", "5"]);
    assert!(out.status.success() && String::from_utf8_lossy(&out.stdout).starts_with("the "));
    let mut small = vec!["train", "--steps", "1", "--tokenizer", tok_s, "--vocab-size", "300"];
    small.extend(tiny());
    assert!(String::from_utf8_lossy(&lazarus(&small).stderr).contains("invalid --vocab-size: 300 (the tokenizer"));
    let shard = d.join("a.bin");
    std::fs::write(&shard, [1u8; 4000]).unwrap();
    let mut shards = vec!["train", "--steps", "1", "--tokenizer", tok_s, "--data", shard.to_str().unwrap(), "--data-format", "u16"];
    shards.extend(&tiny()[..12]);
    assert!(String::from_utf8_lossy(&lazarus(&shards).stderr).contains("take no tokenizer"));
}

/// JSON-lines data: the tokenizer learns from the documents' texts (by the file's name or
/// `--data-format jsonl`), not from the JSON around them, and warns when told to read such a file
/// as text; held-out text evaluates beside JSON-lines training data (`.txt`: its own format).
#[test]
fn json_lines_teach_the_tokenizer_their_texts_and_held_out_text_goes_beside_them() {
    let d = common::dir("jsonl-tokenizer");
    let (docs, held) = (d.join("docs.jsonl"), d.join("held.txt"));
    let words = ["the quick brown fox", "jumps over the lazy dog", "a stitch in time saves nine", "all that glitters is not gold"];
    let lines: Vec<String> = (0..400).map(|i| serde_json::json!({"text": words[i % 4], "id": i}).to_string()).collect();
    std::fs::write(&docs, lines.join("\n")).unwrap();
    std::fs::write(&held, words.join(". ").repeat(40)).unwrap();
    let learn = |out: &str, extra: &[&str]| -> (serde_json::Value, String) {
        let out = d.join(out);
        let mut a = vec!["tokenizer", "--data", docs.to_str().unwrap(), "--vocab-size", "400", "--out", out.to_str().unwrap()];
        a.extend(extra);
        let run = lazarus(&a);
        assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
        let t: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
        (t["model"]["vocab"].clone(), String::from_utf8_lossy(&run.stderr).to_string())
    };
    let (texts, quiet) = learn("texts.json", &[]);
    let (raw, warned) = learn("raw.json", &["--data-format", "text"]);
    assert!(raw.get("text").is_some() && texts.get("text").is_none(), "the JSON key is learned only from the raw lines");
    assert!(texts.get("quick").is_some() || texts.get("Ġquick").is_some(), "the documents' words are learned");
    assert!(warned.contains("look like JSON documents") && !quiet.contains("look like JSON"), "{warned}");
    assert!(std::fs::read_dir(&d).unwrap().all(|e| !e.unwrap().file_name().to_string_lossy().ends_with(".tmp")), "no scratch left");
    let tok = d.join("texts.json");
    let mut a = vec!["train", "--steps", "2", "--tokenizer", tok.to_str().unwrap(), "--data", docs.to_str().unwrap()];
    a.extend(["--data-format", "jsonl", "--eval-data", held.to_str().unwrap(), "--eval-windows", "4"]);
    a.extend(&tiny()[..12]);
    let out = lazarus(&a);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// A run with Mixtral's blocks exports as a Hugging Face directory whose held-out loss is the
/// checkpoint's; a new run starts from it (`--init-from`), its first step's loss below a fresh
/// model's; a model flag that contradicts the directory, a model that is not Mixtral's, a
/// directory that is not a model and an export over an existing one are refused, each named.
#[test]
fn export_to_hugging_face_and_init_from_it() {
    let d = common::dir("hf-export");
    let (ck, out_dir, held) = (d.join("ck"), d.join("hf"), d.join("held.txt"));
    std::fs::write(&held, "the quick brown fox jumps over the lazy dog; ".repeat(40)).unwrap();
    let (ck_s, out_s, held_s) = (ck.to_str().unwrap(), out_dir.to_str().unwrap(), held.to_str().unwrap());
    let mut args = vec!["train", "--steps", "12", "--checkpoint-dir", ck_s, "--arch", "mixtral"];
    args.extend(tiny());
    let out = lazarus(&args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let out = lazarus(&["export", "--checkpoint", ck_s, "--format", "hf", out_s]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("as a Hugging Face Mixtral model"));
    let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out_dir.join("config.json")).unwrap()).unwrap();
    assert_eq!((config["model_type"].as_str(), config["hidden_size"].as_u64()), (Some("mixtral"), Some(32)));
    let eval = |dir: &str| -> f64 {
        let out =
            lazarus(&["eval", "--checkpoint", dir, "--data", held_s, "--windows", "8", "--seq-len", "16", "--batch-size", "8", "--json"]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()["loss"].as_f64().unwrap()
    };
    assert_eq!(eval(ck_s), eval(out_s), "the export is the checkpoint's model");
    // Fine-tuning from it: the first step starts from the trained weights.
    let first_loss = |extra: &[&str]| -> f64 {
        let log = d.join(format!("log-{}.jsonl", extra.len()));
        let mut a = vec!["train", "--steps", "1", "--json-log", log.to_str().unwrap()];
        a.extend(tiny());
        a.extend(extra);
        let out = lazarus(&a);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        common::log(&log).0[0].1
    };
    let fresh = first_loss(&["--arch", "mixtral"]);
    let tuned = first_loss(&["--init-from", out_s]);
    assert!(tuned < fresh - 0.1, "from the export {tuned}, fresh {fresh}");
    for (extra, want) in [
        (vec!["--init-from", out_s, "--d-model", "64", "--heads", "2"], "--d-model 64"),
        (vec!["--init-from", out_s, "--experts", "8"], "--experts 8"),
        (vec!["--init-from", out_s, "--rope-theta", "5000"], "--rope-theta 5000"),
        (vec!["--init-from", d.to_str().unwrap()], "no config.json"),
        (vec!["--init-from", out_s, "--resume"], "--resume"),
    ] {
        let mut a = vec!["train", "--steps", "1"];
        a.extend(extra.iter().copied());
        let out = lazarus(&a);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(want), "{extra:?}: {err}");
    }
    let again = lazarus(&["export", "--checkpoint", ck_s, out_s]);
    assert!(!again.status.success() && String::from_utf8_lossy(&again.stderr).contains("already exists"));
    let gpt = d.join("gpt");
    let mut a = vec!["train", "--steps", "1", "--checkpoint-dir", gpt.to_str().unwrap()];
    a.extend(tiny());
    assert!(lazarus(&a).status.success());
    let out = lazarus(&["export", "--checkpoint", gpt.to_str().unwrap(), d.join("gpt-hf").to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("invalid norm") && err.contains("RMSNorm"), "{err}");
}

/// A model exported with its tokenizer trains on from the directory with that tokenizer, given
/// or not (the same first loss, near the trained model's, not ln 400 of a model reading bytes);
/// without a tokenizer.json beside it, text data is refused with what to give; a sharded copy
/// of the directory (an index and two files, as transformers writes past a size) trains the
/// same; a tensor of another architecture or a NaN weight in the directory is refused by name.
#[test]
fn init_from_a_model_with_its_tokenizer_sharded_or_not() {
    let d = common::dir("init-from-tokenizer");
    let (tok, ck, hf) = (d.join("tokenizer.json"), d.join("ck"), d.join("hf"));
    let (tok_s, ck_s, hf_s) = (tok.to_str().unwrap(), ck.to_str().unwrap(), hf.to_str().unwrap());
    let out = lazarus(&["tokenizer", "--data", "synthetic", "--synthetic-bytes", "100000", "--vocab-size", "400", "--out", tok_s]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let mut a = vec!["train", "--steps", "30", "--lr", "0.01", "--tokenizer", tok_s, "--checkpoint-dir", ck_s, "--arch", "mixtral"];
    a.extend(tiny());
    let out = lazarus(&a);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let out = lazarus(&["export", "--checkpoint", ck_s, "--format", "hf", hf_s]);
    assert!(out.status.success() && hf.join("tokenizer.json").is_file(), "{}", String::from_utf8_lossy(&out.stderr));
    let first_loss = |from: &std::path::Path, extra: &[&str]| -> Result<f64, String> {
        let log = d.join(format!("log-{}.jsonl", std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos()));
        let mut a = vec!["train", "--steps", "1", "--json-log", log.to_str().unwrap(), "--init-from", from.to_str().unwrap()];
        a.extend(&tiny()[..12]);
        a.extend(extra);
        let out = lazarus(&a);
        if !out.status.success() {
            return Err(String::from_utf8_lossy(&out.stderr).to_string());
        }
        Ok(common::log(&log).0[0].1)
    };
    let implied = first_loss(&hf, &[]).unwrap();
    let given = first_loss(&hf, &["--tokenizer", tok_s]).unwrap();
    assert_eq!(implied, given, "the directory's tokenizer is the one used");
    assert!(implied < 400f64.ln() - 0.5, "the trained model on its own tokens: {implied}");
    // The same directory, sharded: an index and two files.
    let sharded = d.join("sharded");
    std::fs::create_dir_all(&sharded).unwrap();
    for f in ["config.json", "tokenizer.json"] {
        std::fs::copy(hf.join(f), sharded.join(f)).unwrap();
    }
    let (names, bytes) = common::safetensors_split(&hf.join("model.safetensors"), 2);
    let mut map = serde_json::Map::new();
    for (i, (part, data)) in names.iter().zip(&bytes).enumerate() {
        let file = format!("model-{:05}-of-00002.safetensors", i + 1);
        std::fs::write(sharded.join(&file), data).unwrap();
        for n in part {
            map.insert(n.clone(), serde_json::json!(file));
        }
    }
    std::fs::write(sharded.join("model.safetensors.index.json"), serde_json::json!({"weight_map": map}).to_string()).unwrap();
    assert_eq!(first_loss(&sharded, &[]).unwrap(), implied, "a sharded directory is the same model");
    // No tokenizer beside a 400-token model: refused, saying what to give.
    std::fs::remove_file(sharded.join("tokenizer.json")).unwrap();
    let e = first_loss(&sharded, &[]).unwrap_err();
    assert!(e.contains("vocabulary of 400 tokens but no tokenizer.json") && e.contains("--tokenizer FILE"), "{e}");
}

/// A memory limit set on the process (`ulimit -v`, as batch systems set) is the bound the size
/// check uses: a run this machine could hold but the limit cannot is refused before anything is
/// allocated, naming the limit — not aborted by a failed allocation half-way.
#[test]
fn an_address_space_limit_bounds_the_size_check() {
    // About 9 GiB of weights, gradients and moments: within most machines, beyond the limit.
    let args = ["train", "--steps", "1", "--d-model", "1024", "--d-ff", "4096", "--experts", "16", "--layers", "4", "--heads", "8"];
    let out = common::lazarus_limited(&args, common::Limit::AddressSpace(3 << 30), "a run under a 3 GiB address-space limit");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("the address-space limit (RLIMIT_AS, ulimit -v) allows 3.0 GiB") && err.contains("--d-model"),
        "{err}"
    );
}

/// An export that runs out of space (here: a file-size limit, which fails a write as a full disk
/// does) leaves nothing behind — no temporary file, no weights without their configuration —
/// so the same command succeeds once there is room.
#[test]
fn an_export_that_runs_out_of_space_leaves_nothing_behind() {
    let d = common::dir("export-no-space");
    let (ck, out_dir) = (d.join("ck"), d.join("hf"));
    let mut a = vec!["train", "--steps", "2", "--checkpoint-dir", ck.to_str().unwrap(), "--arch", "mixtral"];
    a.extend(tiny());
    assert!(lazarus(&a).status.success());
    let export = ["export", "--checkpoint", ck.to_str().unwrap(), out_dir.to_str().unwrap()];
    let out = common::lazarus_limited(&export, common::Limit::FileSize(64 << 10), "an export without room");
    assert!(!out.status.success(), "the weights are larger than 64 KiB");
    assert!(!out_dir.exists(), "nothing left: {:?}", std::fs::read_dir(&out_dir).map(|r| r.count()));
    let out = lazarus(&export);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// A 20 MB document on one line is learned from and trained on under a 1.5 GiB address-space
/// limit: text goes to the tokenizer in pieces of at most 1 MiB. Whole, its encoding alone
/// took gigabytes (47 MB: 4.6 GB resident) and aborted under such a limit.
#[test]
fn a_document_of_20_mb_is_tokenized_in_bounded_memory() {
    let d = common::dir("big-document");
    let (doc, tok) = (d.join("doc.txt"), d.join("tokenizer.json"));
    let words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "alpha", "beta", "gamma", "delta"];
    let mut text = String::with_capacity(20_000_100);
    let mut x: u64 = 7;
    while text.len() < 20_000_000 {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        text.push_str(words[(x >> 33) as usize % words.len()]);
        text.push(' ');
    }
    std::fs::write(&doc, &text).unwrap();
    let limited = |args: &[&str], what: &str| {
        let out = common::lazarus_limited(args, common::Limit::AddressSpace(1536 << 20), what);
        assert!(out.status.success(), "{what}: {}", String::from_utf8_lossy(&out.stderr));
    };
    let (doc_s, tok_s) = (doc.to_str().unwrap(), tok.to_str().unwrap());
    limited(&["tokenizer", "--data", doc_s, "--vocab-size", "300", "--out", tok_s], "the tokenizer learning from it");
    let mut a = vec!["train", "--steps", "1", "--tokenizer", tok_s, "--data", doc_s];
    a.extend(&tiny()[..12]);
    limited(&a, "a step on it");
}

/// `latest` lost (a crash between writing a checkpoint and naming it, a careless `rm`) while the
/// run's checkpoints are intact: a requeued job (`--resume-if-any`) goes on from the newest of
/// them instead of starting over from step 0, and a fresh run is refused there as it is where
/// `latest` names one.
#[test]
fn resume_if_any_goes_on_from_the_newest_checkpoint_when_latest_is_missing() {
    let d = dir("resume-if-any-no-latest");
    let (ck, log) = (d.join("ck"), d.join("log.jsonl"));
    let (ck_s, log_s) = (ck.to_str().unwrap(), log.to_str().unwrap());
    let mut args = vec!["train", "--checkpoint-dir", ck_s, "--checkpoint-every", "2", "--json-log", log_s];
    args.extend(tiny());
    let mut first = args.clone();
    first.extend(["--steps", "6"]);
    assert!(lazarus(&first).status.success());
    std::fs::remove_file(ck.join("latest")).unwrap();
    // The same run again, without --resume: refused.
    let out = lazarus(&first);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("step-00000006 (no `latest`)") && err.contains("--resume"), "{err}");
    let mut again = args.clone();
    again.extend(["--steps", "8", "--resume-if-any"]);
    let out = lazarus(&again);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("holds a run (step-00000006 (no `latest`)): going on with it"), "{err}");
    let steps: Vec<u64> = log_of(&log).0.iter().map(|s| s.0).collect();
    assert_eq!(steps, (1..=8).collect::<Vec<u64>>(), "went on from step 6, each step logged once");
}

/// A run not told where keeps what it makes in a directory of its own, `runs/DATE-TIME/` in the
/// working directory: its checkpoint, the settings it ran with, its log and its tokenizer. The
/// summary names it; `eval` and `generate` take it; `--resume` goes on with the newest run;
/// its settings file starts a run like it in a new directory; a run that fails before it
/// trains leaves nothing behind; `--no-save` keeps nothing.
#[test]
fn a_run_keeps_its_model_in_a_directory_of_its_own() {
    let d = dir("run-dir");
    let tok = d.join("tokenizer.json");
    let out =
        lazarus(&["tokenizer", "--data", "synthetic", "--synthetic-bytes", "50000", "--vocab-size", "300", "--out", tok.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // From `d`, as a user runs it: no LAZARUS_RUNS_DIR, so runs/ under the working directory.
    let run = |args: &[&str]| {
        let mut cmd = common::lazarus_command();
        cmd.current_dir(&d).env_remove("LAZARUS_RUNS_DIR").args(args);
        let out = common::output_within(cmd, &format!("lazarus {}", args.join(" ")));
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        (out.status.success(), text)
    };
    let runs = || -> Vec<std::path::PathBuf> {
        let mut r: Vec<_> = std::fs::read_dir(d.join("runs")).map(|e| e.flatten().map(|e| e.path()).collect()).unwrap_or_default();
        r.sort();
        r
    };
    let train = |extra: &[&str]| {
        let mut a = vec!["train", "--steps", "3", "--tokenizer", tok.to_str().unwrap()];
        a.extend(tiny());
        a.extend(extra);
        run(&a)
    };
    let (ok, text) = train(&[]);
    assert!(ok, "{text}");
    let [first] = &runs()[..] else { panic!("one run directory: {:?}", runs()) };
    let name = first.file_name().unwrap().to_str().unwrap().to_string();
    assert!(name.len() == 15 && name.as_bytes()[8] == b'-' && name.replace('-', "").bytes().all(|b| b.is_ascii_digit()), "{name}");
    for kept in ["latest", "step-00000003", "config.toml", "log.jsonl", "tokenizer.json"] {
        assert!(first.join(kept).exists(), "{kept} in {}", first.display());
    }
    assert_eq!(log_of(&first.join("log.jsonl")).0.len(), 3);
    assert!(text.contains(&format!("checkpoint      runs/{name}/step-00000003")), "{text}");
    assert!(text.contains(&format!("lazarus generate --checkpoint runs/{name} ")), "{text}");
    let first_s = first.to_str().unwrap();
    let (ok, text) = run(&["generate", "--checkpoint", first_s, "--prompt", "the ", "--tokens", "4"]);
    assert!(ok && text.starts_with("the "), "{text}");
    let held = d.join("held.txt");
    std::fs::write(&held, "the quick brown fox jumps over the lazy dog. ".repeat(20)).unwrap();
    let (ok, text) = run(&["eval", "--checkpoint", first_s, "--data", held.to_str().unwrap()]);
    assert!(ok, "{text}");
    // --resume alone: the newest run, its log and checkpoints going on in its directory.
    let mut more = vec!["train", "--resume", "--steps", "5"];
    more.extend(tiny());
    let (ok, text) = run(&more);
    assert!(ok, "{text}");
    assert_eq!(runs().len(), 1, "no new directory for a resumed run");
    assert_eq!(log_of(&first.join("log.jsonl")).0.len(), 5);
    assert_eq!(std::fs::read_to_string(first.join("latest")).unwrap().trim(), "step-00000005");
    // The settings file starts a run like it, in a directory of its own.
    let (ok, text) = run(&["train", "--config", first.join("config.toml").to_str().unwrap()]);
    assert!(ok, "{text}");
    let now = runs();
    assert_eq!(now.len(), 2, "{now:?}");
    assert_eq!(log_of(&now[1].join("log.jsonl")).0.len(), 3, "the first run's 3 steps");
    // A run that fails once its directory is made (too large for this machine) leaves none.
    let (ok, text) = run(&["train", "--d-model", "16384", "--heads", "1", "--d-ff", "131072"]);
    assert!(!ok && text.contains("GiB"), "{text}");
    let (ok, text) = train(&["--no-save"]);
    assert!(ok && text.contains("nothing was saved"), "{text}");
    assert_eq!(runs().len(), 2, "neither a failed run nor --no-save kept a directory");
}

/// `lazarus train` of the tiny model on the Megatron datasets `data` (ids below 1,000).
fn train_megatron(data: &str, extra: &[&str]) -> std::process::Output {
    let mut args = vec!["train", "--data", data, "--data-format", "megatron", "--vocab-size", "1000"];
    args.extend(&common::tiny_model("2")[..12]);
    args.extend(extra);
    lazarus(&args)
}

/// Megatron indexed datasets (`.bin` + `.idx`, here by our writer) train a window at a time: a
/// run stopped and resumed reads the windows the uninterrupted run reads (the same losses), a
/// job of worker processes opens them too, and a malformed index is refused naming its byte.
#[test]
fn megatron_datasets_stream_resume_exactly_and_a_bad_index_is_named() {
    use lazarus_model::data::indexed::{write_indexed, TokenType};
    let d = dir("megatron");
    let tokens: Vec<u32> = (0..6000u32).map(|i| (i * 37 + i / 11) % 1000).collect();
    let docs = |part: &[u32]| part.chunks(123).map(<[u32]>::to_vec).collect::<Vec<_>>();
    write_indexed(&d.join("part-a"), &docs(&tokens[..2500]), TokenType::U16).unwrap();
    write_indexed(&d.join("part-b"), &docs(&tokens[2500..]), TokenType::I32).unwrap();
    let data = format!("{},{}", d.join("part-a").display(), d.join("part-b.idx").display());
    let train = |extra: &[&str]| train_megatron(&data, extra);
    let (whole, part, ck) = (d.join("whole.jsonl"), d.join("part.jsonl"), d.join("ck"));
    let out = train(&["--steps", "4", "--no-save", "--json-log", whole.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("2 Megatron dataset(s)"), "{}", String::from_utf8_lossy(&out.stderr));
    let out = train(&["--steps", "2", "--checkpoint-dir", ck.to_str().unwrap(), "--json-log", part.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let out =
        lazarus(&["train", "--resume", "--steps", "4", "--checkpoint-dir", ck.to_str().unwrap(), "--json-log", part.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let (a, b) = (log_of(&whole).0, log_of(&part).0);
    assert_eq!(a.iter().map(|s| s.0).collect::<Vec<_>>(), b.iter().map(|s| s.0).collect::<Vec<_>>());
    for ((step, x), (_, y)) in a.iter().zip(&b) {
        assert!((x - y).abs() <= 1e-5 * x.abs(), "step {step}: {x} uninterrupted, {y} resumed");
    }
    // Worker processes each open the datasets.
    let out = train(&["--steps", "2", "--no-save", "--workers", "2"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // An index cut short, and ids past the vocabulary.
    let idx = d.join("part-a.idx");
    let bytes = std::fs::read(&idx).unwrap();
    std::fs::write(&idx, &bytes[..bytes.len() - 3]).unwrap();
    let out = train(&["--steps", "1", "--no-save"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("part-a.idx") && err.contains("byte 18"), "{err}");
    std::fs::write(&idx, &bytes).unwrap();
    let mut args = vec!["train", "--data", &data, "--data-format", "megatron", "--vocab-size", "500", "--steps", "3", "--no-save"];
    args.extend(&common::tiny_model("2")[..12]);
    let out = lazarus(&args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("outside the vocabulary of 500") && err.contains(".bin"), "{err}");
}

/// `--data-weights` blends Megatron datasets: a run stopped and resumed draws the windows the
/// uninterrupted run draws; weights that do not fit the data are refused naming the flag.
#[test]
fn blended_megatron_datasets_resume_exactly_and_bad_weights_are_named() {
    use lazarus_model::data::indexed::{write_indexed, TokenType};
    let d = dir("megatron-blend");
    let docs = |n: u32, base: u32| (0..n).map(|i| (0..50).map(|t| (base + i * 7 + t) % 1000).collect()).collect::<Vec<Vec<u32>>>();
    write_indexed(&d.join("web"), &docs(60, 0), TokenType::U16).unwrap();
    write_indexed(&d.join("code"), &docs(20, 500), TokenType::U16).unwrap();
    let data = format!("{},{}", d.join("web").display(), d.join("code").display());
    let train = |extra: &[&str]| train_megatron(&data, extra);
    let (whole, part, ck) = (d.join("whole.jsonl"), d.join("part.jsonl"), d.join("ck"));
    let out = train(&["--data-weights", "3,1", "--steps", "4", "--no-save", "--json-log", whole.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("blended by weight"), "{}", String::from_utf8_lossy(&out.stderr));
    let out =
        train(&["--data-weights", "3,1", "--steps", "2", "--checkpoint-dir", ck.to_str().unwrap(), "--json-log", part.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let out =
        lazarus(&["train", "--resume", "--steps", "4", "--checkpoint-dir", ck.to_str().unwrap(), "--json-log", part.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let (a, b) = (log_of(&whole).0, log_of(&part).0);
    assert_eq!(a.len(), 4);
    for ((step, x), (_, y)) in a.iter().zip(&b) {
        assert!((x - y).abs() <= 1e-5 * x.abs(), "step {step}: {x} uninterrupted, {y} resumed");
    }
    for (weights, why) in [("3", "1 weights for 2 datasets"), ("3,0", "positive numbers"), ("3,x", "positive numbers")] {
        let out = train(&["--data-weights", weights, "--steps", "1", "--no-save"]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains("--data-weights") && err.contains(why), "{weights}: {err}");
    }
    let mut args = vec!["train", "--data-weights", "1,1", "--steps", "1", "--no-save"];
    args.extend(common::tiny_model("2"));
    let out = lazarus(&args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--data-weights blends Megatron datasets, Parquet or Arrow files"), "{err}");
}
