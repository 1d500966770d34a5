//! `train [--workers N] --deterministic`: the result of every step has the same bits in one
//! process, whatever the number of workers and whatever failed on the way — compared as bytes (the final
//! checkpoint's tensors) and as bits (every step's loss), never within a tolerance.

mod common;

use std::path::Path;

use common::{dir, lazarus, log, lone_holder, signal, spawn_lazarus, twin_holders, wait, wait_for_steps, worker_pids, DEEPSEEK_V3};

/// The tiny model, 12 sequences a step (1, 2, 3 and 4 workers all divide the batch
/// differently: 12, 6 + 6, 4 + 4 + 4, 3 × 4).
fn tiny() -> [&'static str; 16] {
    common::tiny_model("12")
}

/// Qwen2-MoE's blocks: q/k/v biases, one key/value head, a shared expert behind a sigmoid gate.
const QWEN2_MOE: &[&str] = &["--arch", "qwen2-moe", "--kv-heads", "1"];

/// Qwen3-MoE's blocks: query and key norms, one key/value head, heads wider than d_model /
/// heads, top-k weights renormalised.
const QWEN3_MOE: &[&str] = &["--arch", "qwen-moe", "--kv-heads", "1", "--head-dim", "12"];

/// The bytes of the newest checkpoint's tensors in `ck` (model, then optimizer state).
fn checkpoint_bytes(ck: &Path) -> Vec<u8> {
    let latest = std::fs::read_to_string(ck.join("latest")).unwrap();
    let at = ck.join(latest.trim());
    let mut bytes = std::fs::read(at.join("model.safetensors")).unwrap();
    bytes.extend(std::fs::read(at.join("optimizer.safetensors")).unwrap());
    bytes
}

/// Every step's loss, as bits, in step order (each step once).
fn loss_bits(path: &Path) -> Vec<(u64, u64)> {
    log(path).0.into_iter().map(|(s, l)| (s, l.to_bits())).collect()
}

/// `train --workers N --deterministic` (N = 0: in one process, no `--workers`) for `steps`
/// steps in `d/name`: its checkpoint's bytes and its losses' bits.
fn run(d: &Path, name: &str, workers: usize, steps: &str, extra: &[&str]) -> (Vec<u8>, Vec<(u64, u64)>) {
    let (path, ck) = (d.join(format!("{name}.jsonl")), d.join(format!("{name}-ck")));
    let w = workers.to_string();
    let mut args = vec!["train", "--deterministic", "--steps", steps, "--quiet"];
    if workers > 0 {
        args.extend(["--workers", &w]);
    }
    args.extend(["--json-log", path.to_str().unwrap(), "--checkpoint-dir", ck.to_str().unwrap()]);
    args.extend(tiny());
    args.extend(extra);
    let out = lazarus(&args);
    assert!(out.status.success(), "{name}: {}", String::from_utf8_lossy(&out.stderr));
    (checkpoint_bytes(&ck), loss_bits(&path))
}

#[test]
fn one_process_and_one_to_four_workers_train_the_same_bits() {
    let d = dir("deterministic-workers");
    let (want, want_losses) = run(&d, "one", 1, "50", &[]);
    assert_eq!(want_losses.len(), 50);
    for n in 0..=4 {
        if n == 1 {
            continue;
        }
        let (got, losses) = run(&d, &format!("w{n}"), n, "50", &[]);
        assert!(losses == want_losses, "{n} workers (0: one process): losses differ from one worker's: {losses:?} vs {want_losses:?}");
        assert!(got == want, "{n} workers (0: one process): the checkpoint's tensors differ from one worker's");
    }
    // Without --deterministic, 1 and 3 workers differ in their last bits (what this mode is for).
    let default = |n: &str, name: &str| {
        let ck = d.join(name);
        let mut args = vec!["train", "--workers", n, "--steps", "50", "--quiet", "--checkpoint-dir", ck.to_str().unwrap()];
        args.extend(tiny());
        assert!(lazarus(&args).status.success());
        checkpoint_bytes(&ck)
    };
    assert_ne!(default("1", "default-1"), default("3", "default-3"), "the default mode was expected to differ in its last bits");
}

/// Shards of three sequences (`--shard-sequences 3`: 4 a step): one process and 3 workers — 4
/// shards over 3 ranks, one of which runs a stand-in for its second pass — give the same bits.
#[test]
fn shards_of_several_sequences_give_the_same_bits_on_any_number_of_workers() {
    let d = dir("deterministic-shards");
    let (want, want_losses) = run(&d, "one", 0, "20", &["--shard-sequences", "3"]);
    let (got, losses) = run(&d, "three", 3, "20", &["--shard-sequences", "3"]);
    assert!(losses == want_losses, "3 workers: losses differ from one process's");
    assert!(got == want, "3 workers: the checkpoint's tensors differ from one process's");
    // Another shard size is another (still deterministic) computation.
    let (other, _) = run(&d, "sequence", 0, "20", &[]);
    assert!(other != want, "shards of one sequence gave the bits of shards of three");
}

/// A worker SIGKILLed from outside mid-run: the survivors move to a new plan, re-run the step,
/// and end with the bytes of a run that never failed.
#[test]
fn a_worker_killed_from_outside_leaves_the_bits_of_an_uninterrupted_run() {
    let d = dir("deterministic-kill");
    let (want, want_losses) = run(&d, "uninterrupted", 0, "40", &[]);
    let (path, ck) = (d.join("killed.jsonl"), d.join("killed-ck"));
    let mut args = vec!["train", "--workers", "4", "--deterministic", "--steps", "40"];
    args.extend(["--json-log", path.to_str().unwrap(), "--checkpoint-dir", ck.to_str().unwrap()]);
    args.extend(tiny());
    common::run_killing_one(&args, &path, (4, 2), 10, "the run after a worker's SIGKILL");
    let (_, moves) = log(&path);
    assert_eq!(moves.len(), 1, "one move: {moves:?}");
    assert_eq!(moves[0]["cause"].as_str(), Some("reconfigure"), "{moves:?}");
    assert!(loss_bits(&path) == want_losses, "every step once, with the uninterrupted run's loss bits");
    assert!(checkpoint_bytes(&ck) == want, "the final checkpoint's tensors are those of the uninterrupted run");
}

/// Workers killed at chosen phases (the fault hook: SIGKILL to itself) — in the forward pass of
/// step 8, just before the gradient all-reduce of step 16 — with room for every expert on two
/// workers: two moves, and the bytes of a run that never failed.
#[test]
fn workers_killed_in_forward_and_in_the_all_reduce_leave_the_same_bits() {
    let d = dir("deterministic-phases");
    let (want, want_losses) = run(&d, "uninterrupted", 0, "24", &[]);
    let (ck, got_losses) = faulty(&d, "phases", &["--steps", "24", "--slots-per-worker", "4"], "1:forward:8,3:all_reduce:16", 2);
    assert!(got_losses == want_losses, "every step once, with the uninterrupted run's loss bits");
    assert!(checkpoint_bytes(&ck) == want, "the final checkpoint's tensors are those of the uninterrupted run");
}

/// Both holders of an expert killed at the commit vote of step 13: the job rolls back to its
/// checkpoint of step 10 and re-runs the steps after it — ending with the bytes of a run that
/// never failed.
#[test]
fn a_rollback_leaves_the_same_bits() {
    rollback("deterministic-rollback", &[]);
}

/// The same with Qwen3-MoE's blocks, and with DeepSeek-V3's.
#[test]
fn qwen3_and_deepseek_v3_blocks_roll_back_to_the_same_bits() {
    rollback("deterministic-rollback-qwen3", QWEN3_MOE);
    rollback("deterministic-rollback-deepseek-v3", DEEPSEEK_V3);
}

fn rollback(name: &str, blocks: &[&str]) {
    let d = dir(name);
    let (want, want_losses) = run(&d, "uninterrupted", 0, "20", blocks);
    // The twins of this job's placement (the plan is deterministic).
    let mut probe = vec!["train", "--workers", "4", "--deterministic", "--steps", "1"];
    probe.extend(tiny());
    probe.extend(blocks);
    let out = lazarus(&probe);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let (a, b) = twin_holders(&String::from_utf8_lossy(&out.stderr));
    let faults = format!("{a}:vote:13,{b}:vote:13");
    let (ck, got_losses) = faulty(&d, "rollback", &[&["--steps", "20", "--checkpoint-every", "5"], blocks].concat(), &faults, 1);
    let (_, moves) = log(&d.join("rollback.jsonl"));
    assert_eq!(moves[0]["cause"].as_str(), Some("rollback"), "{moves:?}");
    assert!(got_losses == want_losses, "every step once, with the uninterrupted run's loss bits");
    assert!(checkpoint_bytes(&ck) == want, "the final checkpoint's tensors are those of the uninterrupted run");
}

/// `train --workers 4 --deterministic` with `LAZARUS_FAULT=faults`, run to its end with `moves`
/// moves: its checkpoint directory and its losses' bits.
fn faulty(d: &Path, name: &str, extra: &[&str], faults: &str, moves: usize) -> (std::path::PathBuf, Vec<(u64, u64)>) {
    let (path, ck) = (d.join(format!("{name}.jsonl")), d.join(format!("{name}-ck")));
    let mut args = vec!["train", "--workers", "4", "--deterministic"];
    args.extend(["--json-log", path.to_str().unwrap(), "--checkpoint-dir", ck.to_str().unwrap()]);
    args.extend(tiny());
    args.extend(extra);
    let (mut child, lines) = spawn_lazarus(&args, &[("LAZARUS_FAULT", faults)]);
    let _ = worker_pids(&lines, 4, |_| {});
    wait::job_success(&mut child, &lines, &path, format!("{name}: the run through its faults"));
    let (_, got) = log(&path);
    assert_eq!(got.len(), moves, "{name}: {got:?}");
    (ck, loss_bits(&path))
}

/// Under a controller and node agents: a node attaches to the running job (2 → 4 workers),
/// then the first node gives notice (SIGTERM to its agent) and leaves, handing over what only
/// it holds — and the job ends with the bytes of the same job in one process.
#[test]
fn a_join_and_a_drain_leave_the_same_bits() {
    join_and_drain("deterministic-agents", &[]);
}

/// The same with DeepSeek-V3's blocks: the joiner takes the routing bias and latent attention's
/// projections with the rest of the replicated state.
#[test]
fn deepseek_v3_blocks_join_and_drain_to_the_same_bits() {
    join_and_drain("deterministic-agents-deepseek-v3", DEEPSEEK_V3);
}

/// The same with Qwen2-MoE's blocks (the shared expert's gate among the replicated state).
#[test]
fn qwen2_moe_blocks_join_and_drain_to_the_same_bits() {
    join_and_drain("deterministic-agents-qwen2", QWEN2_MOE);
}

fn join_and_drain(name: &str, blocks: &[&str]) {
    use common::hosts::{start_agent_with_env, start_controller, wait_for_records};
    use std::time::Duration;
    let d = dir(name);
    let steps = "200";
    let (want, want_losses) = run(&d, "uninterrupted", 0, steps, blocks);
    let (path, ck, secret) = (d.join("agents.jsonl"), d.join("agents-ck"), d.join("secret"));
    let (log_s, ck_s, secret_s) = (path.to_str().unwrap(), ck.to_str().unwrap(), secret.to_str().unwrap());
    let mut args = vec!["--listen", "127.0.0.1:0", "--secret-file", secret_s, "--workers", "2", "--gpus-per-node", "2"];
    args.extend(["--max-workers", "4", "--join-wait", "0.2", "--lease", "0.5", "--rebalance-every", "0", "--deterministic"]);
    args.extend(tiny());
    args.extend(blocks);
    args.extend(["--steps", steps, "--json-log", log_s, "--checkpoint-dir", ck_s]);
    let (mut controller, ctl_lines, addr) = start_controller(&args, None);
    // Paced (every step 10 ms or more): the job outlasts a join and a drain on any machine.
    let agent = || start_agent_with_env(&addr, "2", &secret, None, "0", &common::paced(10));
    let mut first = agent();
    wait_for_steps(&path, 10);
    let _second = agent();
    let joined = wait_for_records(&path, 1);
    assert_eq!((joined[0]["cause"].as_str(), joined[0]["workers"].as_u64()), (Some("join"), Some(4)), "{}", joined[0]);
    signal(first.0.id() as i32, libc::SIGTERM);
    let drained = wait_for_records(&path, 2);
    assert_eq!((drained[1]["cause"].as_str(), drained[1]["workers"].as_u64()), (Some("drain"), Some(2)), "{}", drained[1]);
    wait::job_success(&mut controller, &ctl_lines, &path, "the job after a join and a drain");
    wait::success(&mut first.0, &first.1, "the drained agent", Duration::from_secs(30));
    let (_, moves) = log(&path);
    assert_eq!(moves.len(), 2, "a join and a drain, no rollback: {moves:?}");
    assert!(loss_bits(&path) == want_losses, "every step once, with the uninterrupted run's loss bits");
    assert!(checkpoint_bytes(&ck) == want, "the final checkpoint's tensors are those of the uninterrupted run");
}

/// The lone holder of some experts (5 workers of one slot) killed at the commit vote of step 13,
/// every expert snapshotted after every step: the experts it alone held come back from their
/// snapshots of step 12 in other workers' memory, no rollback, and the job ends with the bytes
/// of a run that never failed.
#[test]
fn a_restore_from_snapshots_leaves_the_same_bits() {
    restore("deterministic-snapshot", &[]);
}

/// The same with Qwen3-MoE's blocks, and with DeepSeek-V3's (the restored experts' routing
/// bias is the replicated state's, not the snapshot's).
#[test]
fn qwen3_and_deepseek_v3_blocks_restore_from_snapshots_to_the_same_bits() {
    restore("deterministic-snapshot-qwen3", QWEN3_MOE);
    restore("deterministic-snapshot-deepseek-v3", DEEPSEEK_V3);
}

fn restore(name: &str, blocks: &[&str]) {
    let d = dir(name);
    let (want, want_losses) = run(&d, "uninterrupted", 0, "20", blocks);
    let slots = ["--slots-per-worker", "1"];
    let mut probe = vec!["train", "--workers", "5", "--deterministic", "--steps", "1"];
    probe.extend(tiny());
    probe.extend(blocks);
    probe.extend(slots);
    let out = lazarus(&probe);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let victim = lone_holder(&String::from_utf8_lossy(&out.stderr));
    let path = d.join("snapshot.jsonl");
    let mut args = vec!["train", "--workers", "5", "--deterministic", "--steps", "20", "--snapshot-bandwidth", "625e6"];
    let ck = d.join("snapshot-ck");
    args.extend(["--json-log", path.to_str().unwrap(), "--checkpoint-dir", ck.to_str().unwrap(), "--checkpoint-every", "5"]);
    args.extend(tiny());
    args.extend(blocks);
    args.extend(slots);
    let faults = format!("{victim}:vote:13");
    let (mut child, lines) = spawn_lazarus(&args, &[("LAZARUS_FAULT", faults.as_str())]);
    let _ = worker_pids(&lines, 5, |_| {});
    wait::job_success(&mut child, &lines, &path, "the run through a lone holder's loss");
    let (_, moves) = log(&path);
    assert_eq!(moves.len(), 1, "{moves:?}");
    assert_eq!(moves[0]["cause"].as_str(), Some("reconfigure"), "no rollback: {moves:?}");
    let back = moves[0]["restored"].as_array().expect("experts restored from snapshots");
    assert!(!back.is_empty() && back.iter().all(|x| x["stale_steps"].as_u64() == Some(0)), "{back:?}");
    assert!(loss_bits(&path) == want_losses, "every step once, with the uninterrupted run's loss bits");
    assert!(checkpoint_bytes(&ck) == want, "the final checkpoint's tensors are those of the uninterrupted run");
}

/// A rebalance applied at a step boundary (3 workers, the plan weighed every 50 steps against
/// the loads measured): the experts move to the new plan and the job ends with the bytes of the
/// same job in one process, which never moved anything.
#[test]
fn a_rebalance_leaves_the_same_bits() {
    rebalance("deterministic-rebalance", &[]);
}

/// The same with DeepSeek-V3's blocks.
#[test]
fn deepseek_v3_blocks_rebalance_to_the_same_bits() {
    rebalance("deterministic-rebalance-deepseek-v3", DEEPSEEK_V3);
}

fn rebalance(name: &str, blocks: &[&str]) {
    let d = dir(name);
    let (want, want_losses) = run(&d, "uninterrupted", 0, "120", blocks);
    let rebalance = [&["--slots-per-worker", "2", "--max-imbalance", "inf", "--rebalance-every", "50"], blocks].concat();
    let (got, losses) = run(&d, "rebalanced", 3, "120", &rebalance);
    let (_, moves) = log(&d.join("rebalanced.jsonl"));
    assert!(!moves.is_empty() && moves.iter().all(|m| m["cause"] == "rebalance"), "a rebalance applied: {moves:?}");
    assert!(losses == want_losses, "every step once, with the uninterrupted run's loss bits");
    assert!(got == want, "the final checkpoint's tensors are those of the uninterrupted run");
}

/// Experts replicated over 4 workers (2 slots each for 4 experts: every expert on two workers)
/// and the same job in one process export the same Hugging Face files, byte for byte — a
/// Qwen2-MoE model with one key/value head, q/k/v biases and a gated shared expert.
#[test]
fn experts_replicated_over_four_workers_export_the_bytes_one_process_exports() {
    let d = dir("deterministic-export");
    let export = |workers: usize| -> Vec<(String, Vec<u8>)> {
        let (ck, hf) = (d.join(format!("w{workers}-ck")), d.join(format!("w{workers}-hf")));
        let w = workers.to_string();
        let mut args = vec!["train", "--deterministic", "--steps", "8", "--checkpoint-dir", ck.to_str().unwrap()];
        args.extend(tiny());
        args.extend(QWEN2_MOE);
        if workers > 0 {
            args.extend(["--workers", &w, "--slots-per-worker", "2"]);
        }
        let out = lazarus(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{workers} workers: {err}");
        if workers == 4 {
            let sets = common::placement_sets(&err);
            for e in 0..4 {
                let holders = sets.iter().filter(|s| s.trim_matches(['[', ']']).split(',').any(|x| x.trim() == e.to_string())).count();
                assert_eq!(holders, 2, "expert {e} on two workers: {sets:?}");
            }
        }
        let out = lazarus(&["export", "--checkpoint", ck.to_str().unwrap(), "--format", "hf", hf.to_str().unwrap()]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(&hf)
            .unwrap()
            .map(|e| e.unwrap())
            .map(|e| (e.file_name().to_string_lossy().into_owned(), std::fs::read(e.path()).unwrap()))
            .collect();
        files.sort();
        files
    };
    let (one, four) = (export(0), export(4));
    assert!(one.iter().any(|(n, _)| n.ends_with(".safetensors")), "{:?}", one.iter().map(|f| &f.0).collect::<Vec<_>>());
    assert_eq!(one.iter().map(|f| &f.0).collect::<Vec<_>>(), four.iter().map(|f| &f.0).collect::<Vec<_>>());
    for ((name, a), (_, b)) in one.iter().zip(&four) {
        assert!(a == b, "{name} differs between one process's export and four workers'");
    }
}

/// In one process, a deterministic run stopped at step 4 and resumed writes the bytes of the
/// uninterrupted run; what a deterministic step cannot run is refused by its flag.
#[test]
fn one_process_resumes_to_the_same_bits_and_refuses_what_it_cannot_run() {
    let d = dir("deterministic-one-process");
    let (want, want_losses) = run(&d, "straight", 0, "8", &[]);
    let ck = d.join("stopped-ck");
    let mut first = vec!["train", "--deterministic", "--steps", "4", "--quiet", "--checkpoint-dir", ck.to_str().unwrap()];
    first.extend(tiny());
    assert!(lazarus(&first).status.success());
    let path = d.join("resumed.jsonl");
    let resumed = ["train", "--resume", "--deterministic", "--steps", "8", "--quiet", "--checkpoint-dir", ck.to_str().unwrap()];
    let out = lazarus(&[&resumed[..], &["--json-log", path.to_str().unwrap()]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(checkpoint_bytes(&ck) == want, "the resumed run's tensors are the uninterrupted run's");
    assert_eq!(loss_bits(&path), want_losses[4..], "steps 5 to 8 with the uninterrupted run's loss bits");

    for (flag, value, says) in [
        ("--capacity-factor", "1.25", "--deterministic with --capacity-factor 1.25: deterministic steps are dropless"),
        ("--shard-sequences", "5", "invalid --shard-sequences: 5 (a divisor of --batch-size 12"),
    ] {
        let mut args = vec!["train", "--deterministic", "--steps", "2", "--no-save", flag, value];
        args.extend(tiny());
        let out = lazarus(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(says), "{flag} {value}: {err}");
        assert!(!err.contains("lazarus train ("), "refused before the run starts: {err}");
    }
}
