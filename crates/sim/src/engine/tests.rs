use super::*;
use lazarus_decide::JoinRule;
use std::time::Duration;

fn scenario(model: &str, trace: Trace, minutes: f64) -> Scenario {
    Scenario {
        trace,
        model: ModelSpec::preset(model).unwrap(),
        cost: CostModel::default(),
        loads: LoadModel::default(),
        max_nodes: 10,
        duration_s: minutes * 60.0,
        notices: Notices::default(),
        mix: None,
        seed: 0,
    }
}

fn all(s: &Scenario) -> Vec<PolicyReport> {
    Policy::ALL.iter().map(|&p| simulate(s, p).unwrap()).collect()
}

/// `n` nodes (n0, n1, …) at the start, then `changes` (Bamboo lines, `ms,add|remove,node`).
fn nodes_then(n: usize, changes: &str) -> Trace {
    let start: String = (0..n).map(|i| format!("0,add,n{i}\n")).collect();
    Trace::parse_bamboo(&(start + changes), "t").unwrap()
}

/// The EC2 P3 spot trace the repository carries (traces/).
fn p3() -> Option<Trace> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../traces/p3-trace.csv");
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    Some(Trace::parse_bamboo(&text, "p3-trace.csv").unwrap())
}

#[test]
fn the_breakdown_adds_up_to_the_wall_time() {
    let mut cases = vec![
        scenario("gpt-s", Trace::fail_every(10, 300_000, 5, 1).unwrap(), 30.0),
        scenario("gpt-l", Trace::fail_every(10, 300_000, 5, 1).unwrap(), 30.0),
        scenario("gpt-m", Trace::fail_at_once(10, 4, 600_000, 2).unwrap(), 30.0),
        scenario("gpt-l", Trace::poisson(10, 1_200_000.0, 300_000, 7_200_000, 3).unwrap(), 120.0),
    ];
    if let Some(t) = p3() {
        cases.push(scenario("gpt-l", t.window(0, 4_800_000), 80.0));
    }
    for s in &cases {
        for r in all(s) {
            let total = r.breakdown.total();
            assert!((total - s.duration_s).abs() < 1e-6 * s.duration_s, "{:?}: {total} vs {} ({:?})", r.policy, s.duration_s, r.breakdown);
            assert!(r.breakdown.compute_s >= -1e-6 && r.breakdown.lost_work_s >= 0.0);
            assert!(r.trained_samples >= 0.0);
        }
    }
}

#[test]
fn ds_only_ever_trains_on_a_multiple_of_its_ep_size() {
    // GPT-L: 16 experts, 4 per GPU → EP groups of 4 nodes.
    let mut traces = vec![Trace::fail_every(10, 300_000, 5, 4).unwrap(), Trace::poisson(10, 900_000.0, 300_000, 5_400_000, 5).unwrap()];
    if let Some(t) = p3() {
        traces.push(t.window(0, 4_800_000));
    }
    for t in traces {
        for p in [Policy::Ds, Policy::DsFt, Policy::Gemini, Policy::MoEvement, Policy::TorchFt] {
            let r = simulate(&scenario("gpt-l", t.clone(), 90.0), p).unwrap();
            assert!(r.nodes_in_use.iter().all(|&(_, n)| n % 4 == 0), "{p:?}: {:?}", r.nodes_in_use);
            assert!(r.nodes_in_use.iter().any(|&(_, n)| n == 8), "{p:?} uses 8 of 10 nodes at the start");
        }
    }
}

#[test]
fn lazarus_never_restarts_while_every_expert_keeps_a_replica() {
    // One failure at a time down to half the nodes, with a floor of 2 replicas: never a
    // lost expert, so never a restart; every failure is a reconfiguration.
    for model in ["gpt-s", "gpt-m", "gpt-l"] {
        let r = simulate(&scenario(model, Trace::fail_every(10, 300_000, 5, 6).unwrap(), 30.0), Policy::Lazarus).unwrap();
        assert_eq!(r.restarts, 0, "{model}");
        assert_eq!(r.reconfigurations, 5, "{model}");
        assert!(r.breakdown.lost_work_s > 0.0, "interrupted steps are lost work");
    }
    // Nine of ten nodes at once: some expert loses every replica, so it must restart.
    let r = simulate(&scenario("gpt-l", Trace::fail_at_once(10, 9, 600_000, 1).unwrap(), 20.0), Policy::Lazarus).unwrap();
    assert_eq!(r.restarts, 1);
}

#[test]
fn lazarus_beats_ds_under_frequent_failures_and_uses_every_node() {
    let s = scenario("gpt-l", Trace::fail_every(10, 300_000, 5, 1).unwrap(), 30.0);
    let r = all(&s);
    assert!(r[0].trained_samples > 2.0 * r[1].trained_samples, "lazarus {} vs ds {}", r[0].trained_samples, r[1].trained_samples);
    assert!(r[0].trained_samples > r[2].trained_samples);
    assert_eq!(r[0].nodes_in_use.first().map(|x| x.1), Some(10));
    assert!(r[1].restarts >= 5, "ds restarts on every failure");
}

/// `lazarus train` keeps its global batch whatever the workers: every step trains that many
/// samples, so with no failure the samples are the steps × the batch, at any node count.
#[test]
fn a_global_batch_trains_the_same_samples_a_step_on_any_number_of_nodes() {
    for nodes in [2, 5, 10] {
        let mut s = scenario("gpt-s", Trace::fail_every(nodes, 3_600_000, 0, 1).unwrap(), 10.0);
        s.cost.global_batch = Some(48);
        let r = simulate(&s, Policy::Lazarus).unwrap();
        assert!(r.steps > 0);
        assert_eq!(r.trained_samples, 48.0 * r.steps as f64, "{nodes} nodes");
    }
    let mut s = scenario("gpt-s", Trace::fail_every(4, 60_000, 2, 1).unwrap(), 5.0);
    s.cost.global_batch = Some(0);
    assert!(simulate(&s, Policy::Lazarus).unwrap_err().to_string().contains("global_batch"));
}

#[test]
fn a_checkpoint_due_when_a_joiner_is_taken_is_still_taken() {
    // Checkpoint after every step, so the step boundary where a joiner is taken is always
    // also a checkpoint boundary. One node fails at 30 s (the checkpoint in flight is lost)
    // and the run ends during a checkpoint; a spare joins at 40 s. Every other step must
    // have its checkpoint, the scale-up's included.
    let mut s = scenario("gpt-s", nodes_then(10, "30000,remove,n3\n40000,add,spare\n"), 2.0);
    s.cost.checkpoint_every_lazarus = 1;
    s.cost.scale_up_wait_s = 0.0;
    let r = simulate(&s, Policy::Lazarus).unwrap();
    assert_eq!(r.reconfigurations, 2, "the failure and the scale-up");
    assert!(r.checkpoints + 2 >= r.steps, "{} checkpoints for {} steps", r.checkpoints, r.steps);

    // Exact timing: 0.5 s steps (no imbalance), near-free checkpoints every 4 steps, no
    // rebalance. A spare joins at 3.7 s, so it is taken at the 4.0 s boundary — step 8, a
    // checkpoint step. That checkpoint must follow the scale-up: one per 4 steps, exactly.
    let mut s = scenario("gpt-s", nodes_then(4, "3700,add,spare\n"), 0.5);
    s.model.expert_fraction = 0.0;
    s.model.params = 1e3;
    s.cost.checkpoint_every_lazarus = 4;
    s.cost.rebalance_every = 1_000_000;
    s.cost.scale_up_wait_s = 0.0;
    let r = simulate(&s, Policy::Lazarus).unwrap();
    assert_eq!(r.reconfigurations, 1);
    assert_eq!(r.checkpoints, r.steps / 4, "{} checkpoints for {} steps", r.checkpoints, r.steps);
}

/// A node the trace removes and adds again comes back as new workers, and the controller
/// takes it in at a step boundary (it once stalled the simulation: the controller ignores
/// a worker id it has seen).
#[test]
fn a_node_that_comes_back_is_taken_in_again() {
    let mut s = scenario("gpt-s", nodes_then(4, "60000,remove,n1\n120000,add,n1\n240000,remove,n1\n300000,add,n1\n"), 10.0);
    s.cost.scale_up_wait_s = 0.0;
    let r = simulate(&s, Policy::Lazarus).unwrap();
    assert_eq!((r.restarts, r.reconfigurations), (0, 4), "two failures, two joins: {:?}", r.nodes_in_use);
    assert_eq!(r.nodes_in_use.last().map(|x| x.1), Some(4));
}

/// The simulated job rebalances by the controller's rule: only a move that repays itself
/// within the horizon is made.
#[test]
fn a_rebalance_is_made_only_when_it_repays_its_move() {
    let s = scenario("gpt-l", Trace::fail_every(10, 300_000, 5, 1).unwrap(), 30.0);
    let cheap = simulate(&s, Policy::Lazarus).unwrap();
    assert!(cheap.rebalances > 0, "some rebalance repays a 2 s pause: {:?}", cheap.breakdown);
    let mut dear = s.clone();
    dear.cost.rebalance_s = 1e5;
    let r = simulate(&dear, Policy::Lazarus).unwrap();
    assert_eq!((r.rebalances, r.breakdown.rebalance_s), (0, 0.0), "none repays a day's pause");
    assert_eq!(r.reconfigurations, cheap.reconfigurations);
}

#[test]
fn bad_scenarios_are_rejected() {
    let mut s = scenario("gpt-s", Trace::fail_every(4, 60_000, 2, 1).unwrap(), 5.0);
    s.max_nodes = 0;
    assert!(simulate(&s, Policy::Lazarus).unwrap_err().to_string().contains("max_nodes"));
    assert!(ModelSpec::preset("gpt-xl").unwrap_err().to_string().contains("gpt-xl"));
    let mut s = scenario("gpt-s", Trace::fail_every(4, 60_000, 2, 1).unwrap(), 5.0);
    s.cost.storage_gbps = 0.0;
    assert!(simulate(&s, Policy::Ds).unwrap_err().to_string().contains("storage_gbps"));
}

fn sim_err(f: impl FnOnce(&mut Scenario), policy: Policy) -> String {
    let mut s = scenario("gpt-l", Trace::fail_every(10, 300_000, 5, 1).unwrap(), 30.0);
    f(&mut s);
    simulate(&s, policy).unwrap_err().to_string()
}

#[test]
fn scenarios_are_bounded() {
    assert_eq!(sim_err(|s| s.max_nodes = 10_000_001, Policy::Lazarus), "invalid max_nodes: 10000001 (must be 1 to 10000)");
    let e = sim_err(|s| s.duration_s = 1e14 * 3600.0, Policy::Ds);
    assert!(e.starts_with("invalid duration: ") && e.contains("30 days"), "{e}");
    assert!(sim_err(|s| s.duration_s = f64::INFINITY, Policy::Ds).contains("must be > 0 s"));
    assert!(sim_err(|s| s.model.layers = 100_000_000, Policy::DsFt).contains("model.layers"));
    // A trace built by hand is held to what the parsers guarantee.
    assert!(sim_err(|s| s.trace = Trace::default(), Policy::Lazarus).contains("the trace holds no events"));
    let e = sim_err(|s| s.trace.events.swap(0, 10), Policy::Lazarus);
    assert!(e.contains("event 0 (300000 ms, Remove") && e.contains("removed while absent"), "{e}");
    // Loads that do not fit the model (a trace indexed past its end used to panic).
    let e = sim_err(|s| s.loads = LoadModel::Trace(vec![vec![vec![1.0; 16]; 2]]), Policy::Lazarus);
    assert!(e.contains("routing trace: entry 0 has 2 layers"), "{e}");
    assert!(sim_err(|s| s.loads = LoadModel::Trace(vec![]), Policy::Ds).contains("no entries"));
}

#[test]
fn runs_with_too_many_boundaries_are_refused() {
    // A month of 1 ms steps, checkpointing every step: 2.6·10^9 boundaries.
    let month = |s: &mut Scenario| {
        s.duration_s = MAX_DURATION_S;
        s.model.balanced_step_s = 1e-3;
        s.cost.checkpoint_every_ds = 1;
    };
    let e = sim_err(month, Policy::Ds);
    assert!(e.contains("step boundaries") && e.contains("checkpoints every 1 steps"), "{e}");
    // A month at the defaults is fine for the bound (DS: ~130 000 boundaries); the loads of a
    // huge model re-drawn every 4 steps are not.
    let mut s = scenario("gpt-l", Trace::fail_every(10, 300_000, 5, 1).unwrap(), 0.0);
    s.duration_s = MAX_DURATION_S;
    s.check_work(s.cost.checkpoint_every_ds).unwrap();
    let e = sim_err(
        |s| {
            s.duration_s = MAX_DURATION_S;
            (s.model.layers, s.model.experts, s.cost.rebalance_every) = (4096, 1024, 4);
        },
        Policy::Ds,
    );
    assert!(e.contains("load epochs") && e.contains("4096 layers × 1024 experts"), "{e}");
}

/// Gemini-style: a whole-job restart on every failure of a node in use, as DS, but from
/// checkpoints in peers' memory taken every few steps without a stall: far less time lost.
#[test]
fn gemini_restarts_on_every_failure_from_memory_and_loses_far_less_than_ds() {
    let s = scenario("gpt-l", Trace::fail_every(10, 300_000, 5, 1).unwrap(), 30.0);
    let (g, ds) = (simulate(&s, Policy::Gemini).unwrap(), simulate(&s, Policy::Ds).unwrap());
    assert!(g.restarts >= 3 && g.reconfigurations == 0, "restarts only: {} restarts", g.restarts);
    assert_eq!(g.breakdown.checkpoint_s, 0.0, "the copies to peers run beside training");
    assert!(g.checkpoints > 10 * ds.checkpoints, "{} in-memory checkpoints against DS's {}", g.checkpoints, ds.checkpoints);
    let wasted = |r: &PolicyReport| r.breakdown.lost_work_s + r.breakdown.restart_s;
    assert!(wasted(&g) < 0.6 * wasted(&ds), "gemini wastes {} s, ds {} s", wasted(&g), wasted(&ds));
    assert!(g.ettr > ds.ettr && g.trained_samples > ds.trained_samples);
}

/// MoEvement-style: after a failure the survivors regroup and the lost blocks come back from
/// snapshots — no restart while an EP group survives, and nothing lost but the steps in flight.
#[test]
fn moevement_restores_from_snapshots_without_a_rollback() {
    let s = scenario("gpt-l", Trace::fail_every(10, 300_000, 5, 1).unwrap(), 30.0);
    let (r, ds) = (simulate(&s, Policy::MoEvement).unwrap(), simulate(&s, Policy::Ds).unwrap());
    assert_eq!(r.restarts, 0);
    assert!(r.reconfigurations >= 3, "{} moves", r.reconfigurations);
    assert!(
        r.breakdown.lost_work_s < 0.1 * ds.breakdown.lost_work_s,
        "{} s lost against DS's {}",
        r.breakdown.lost_work_s,
        ds.breakdown.lost_work_s
    );
    // Not one EP group left (GPT-L: groups of 4 nodes, 3 survive): back to storage.
    let r = simulate(&scenario("gpt-l", Trace::fail_at_once(10, 7, 600_000, 1).unwrap(), 20.0), Policy::MoEvement).unwrap();
    assert_eq!(r.restarts, 1);
}

/// torchft-style: the failed node's replica group leaves the quorum, the other trains on, and
/// the group is back — with a spare in place of the lost node — at the next step boundary;
/// DS-FT, which never takes back the nodes it dropped, stays on one group.
#[test]
fn torchft_drops_the_failed_group_and_takes_it_back_whole() {
    let s = scenario("gpt-l", nodes_then(9, "300000,remove,n2\n"), 20.0);
    let in_use = |r: &PolicyReport| r.nodes_in_use.iter().map(|x| x.1).collect::<Vec<_>>();
    let r = simulate(&s, Policy::TorchFt).unwrap();
    assert_eq!(r.restarts, 0);
    assert_eq!(in_use(&r), [8, 4, 8], "GPT-L's EP groups are 4 nodes");
    assert!(r.breakdown.lost_work_s < 10.0 * s.model.balanced_step_s);
    let ft = simulate(&s, Policy::DsFt).unwrap();
    assert_eq!(in_use(&ft).last(), Some(&4), "{:?}", in_use(&ft));
}

/// Every removal told two minutes ahead: Lazarus drains each node at the end of a step — no
/// time-out, no step lost — where without notices each costs the time-out and the step in
/// flight; the baselines drain too (DS by a checkpoint and relaunch, no rollback), and every
/// breakdown still adds up.
#[test]
fn nodes_that_give_notice_are_drained_with_no_step_lost() {
    let told = |share: f64| {
        let mut s = scenario("gpt-l", Trace::fail_every(10, 300_000, 5, 1).unwrap(), 30.0);
        s.notices = Notices { share, lead_s: 120.0, seed: 3 };
        s
    };
    let (without, with) = (simulate(&told(0.0), Policy::Lazarus).unwrap(), simulate(&told(1.0), Policy::Lazarus).unwrap());
    assert_eq!((with.drains, with.restarts), (5, 0), "five nodes leave, each drained");
    // Only the step still running when the simulated time ends is lost.
    let step_s = told(1.0).model.balanced_step_s;
    assert!(
        with.breakdown.lost_work_s < 3.0 * step_s && with.breakdown.lost_work_s < without.breakdown.lost_work_s,
        "{} s lost",
        with.breakdown.lost_work_s
    );
    assert!(
        with.breakdown.detect_s == 0.0 && without.breakdown.detect_s > 0.0,
        "no time-out: {} s against {} s",
        with.breakdown.detect_s,
        without.breakdown.detect_s
    );
    assert!(with.ettr > without.ettr);
    for p in Policy::ALL {
        let r = simulate(&told(1.0), p).unwrap();
        assert!((r.breakdown.total() - 1800.0).abs() < 1e-6, "{p:?}");
        assert!(r.drains > 0, "{p:?} drains");
        if p == Policy::Ds {
            assert!(r.breakdown.lost_work_s < 3.0 * step_s, "DS saves and relaunches: nothing rolled back");
        }
    }
    // A drained node that comes back brings new workers, and is taken in again.
    let mut back = scenario("gpt-s", nodes_then(4, "300000,remove,n1\n420000,add,n1\n"), 15.0);
    back.notices = Notices { share: 1.0, lead_s: 60.0, seed: 0 };
    back.cost.scale_up_wait_s = 0.0;
    let r = simulate(&back, Policy::Lazarus).unwrap();
    let in_use: Vec<usize> = r.nodes_in_use.iter().map(|x| x.1).collect();
    assert_eq!((r.drains, r.restarts, in_use), (1, 0, vec![4, 3, 4]));
    // With a spare waiting, the drain takes it in: no rollback, four nodes in use again.
    let mut spare = scenario("gpt-s", nodes_then(5, "300000,remove,n1\n"), 10.0);
    spare.max_nodes = 4;
    spare.notices = Notices { share: 1.0, lead_s: 60.0, seed: 0 };
    let r = simulate(&spare, Policy::Lazarus).unwrap();
    assert_eq!((r.drains, r.restarts), (1, 0), "{:?}", r.nodes_in_use);
    assert_eq!(r.nodes_in_use.last().map(|x| x.1), Some(4));
    // Half of them told: the same draws for every policy, and some still fail.
    let half = simulate(&told(0.5), Policy::Lazarus).unwrap();
    assert!(half.drains > 0 && half.drains < 5, "{} drains", half.drains);
    assert!(Notices { share: 1.5, lead_s: 1.0, seed: 0 } != Notices::default());
    let mut bad = told(1.0);
    bad.notices.share = 1.5;
    assert!(simulate(&bad, Policy::Lazarus).unwrap_err().to_string().contains("notices.share"));
}

/// With a failure mix, a failure its process's exit gives away costs the exit's detection
/// instead of the time-out, for every policy alike; the same trace without a mix is found out by
/// silence throughout.
#[test]
fn failures_seen_by_an_exit_cost_less_than_those_found_by_a_time_out() {
    let silent = scenario("gpt-s", Trace::fail_every(10, 120_000, 5, 1).unwrap(), 12.0);
    let mixed = Scenario { mix: Some(crate::FailureMix::preset("llama3").unwrap()), seed: 4, ..silent.clone() };
    let (before, after) = (all(&silent), all(&mixed));
    let failures = before[0].failures_s.len() as u64;
    assert!(failures >= 4, "{failures}");
    let exits = after[0].failures_seen_by_exit;
    assert!(exits > 0 && exits < failures, "a mix of both ways among {failures} failures: {exits} by an exit");
    for (b, a) in before.iter().zip(&after) {
        assert_eq!(b.failures_seen_by_exit, 0, "{:?}: without a mix every failure is found out by silence", b.policy);
        // (A policy that uses fewer nodes meets fewer of the failures.)
        assert!(a.failures_seen_by_exit <= a.failures_s.len() as u64, "{:?}", a.policy);
        let waited = |r: &PolicyReport| r.breakdown.detect_s;
        assert!(waited(a) < waited(b), "{:?}: {} s waited with exits seen, {} s without", a.policy, waited(a), waited(b));
    }
    let lazarus = |r: &[PolicyReport]| r.iter().find(|r| r.policy == Policy::Lazarus).unwrap().breakdown.detect_s;
    let saved = lazarus(&before) - lazarus(&after);
    let expected = exits as f64 * (mixed.cost.failure_timeout_s - mixed.cost.exit_detect_s);
    assert!((saved - expected).abs() < 1e-6, "Lazarus saves the time-out less the exit's detection per exit: {saved} s, {expected} s");
}

/// With replicas short (a floor of one), a failure takes the only replica of some experts:
/// without snapshots the job rolls back to its checkpoint, with them the controller restores
/// those experts from the survivors' memory and goes on.
#[test]
fn snapshots_turn_the_rollbacks_of_experts_on_one_node_into_restores() {
    let mut s = scenario("gpt-s", Trace::fail_every(8, 300_000, 4, 0).unwrap(), 30.0);
    (s.max_nodes, s.cost.slots_per_gpu, s.cost.min_replicas) = (8, 2, 1);
    let without =
        simulate(&Scenario { cost: CostModel { snapshot_bandwidth: 0.0, ..s.cost.clone() }, ..s.clone() }, Policy::Lazarus).unwrap();
    let with = simulate(&s, Policy::Lazarus).unwrap();
    assert!(without.restarts > 0 && without.snapshot_restores == 0, "{} restarts without snapshots", without.restarts);
    assert!(
        with.snapshot_restores > 0 && with.restarts < without.restarts,
        "{} restores, {} restarts",
        with.snapshot_restores,
        with.restarts
    );
    assert!(with.experts_restored >= with.snapshot_restores && with.restored_stale_steps > 0);
    assert!(with.trained_samples > without.trained_samples, "{} against {}", with.trained_samples, without.trained_samples);
}

/// The step on a plan as the dispatcher spreads tokens: the balanced dispatcher's busiest GPU
/// (λ*) is never busier than the even split's, and both are at least the mean.
#[test]
fn the_balanced_dispatchers_step_is_never_longer_than_the_even_splits() {
    use super::policy::{FailurePolicy, Lazarus};
    let loads = vec![vec![0.5, 0.2, 0.1, 0.1, 0.05, 0.05]; 3];
    let shape = lazarus_plan::ClusterShape::new(4, 2, 2).unwrap();
    let plan = lazarus_plan::plan_model(&loads, shape, &lazarus_plan::PlanPolicy::unguarded(2), None).unwrap();
    let cost = |dispatch| CostModel { gpus_per_node: 2, slots_per_gpu: 2, dispatch, ..CostModel::default() };
    let balanced = Lazarus::new().imbalance(&cost(crate::Dispatch::Balanced), &plan, &loads);
    let even = Lazarus::new().imbalance(&cost(crate::Dispatch::EvenSplit), &plan, &loads);
    assert!((1.0..=even + 1e-9).contains(&balanced), "λ*/mean {balanced}, even split {even}");
}

/// Where moves come often (a failure in the first 2 minutes, against 30 s moves and one node
/// joining 7: 240 s of idling to cost one), a node that comes back waits for the next move the
/// job makes anyway (here a failure 30 s later) instead of a move of its own; with no move
/// before then, it is taken in on its own once its idling has cost a move.
#[test]
fn under_rent_or_buy_a_returning_node_rides_along_the_next_failure() {
    let run = |changes: &str, rule: JoinRule| {
        let mut s = scenario("gpt-s", nodes_then(8, changes), 10.0);
        (s.max_nodes, s.cost.scale_up_wait_s, s.cost.join_rule) = (8, 0.0, rule);
        (s.cost.rebalance_s, s.cost.group_rebuild_s) = (30.0, 30.0);
        let r = simulate(&s, Policy::Lazarus).unwrap();
        assert!((r.breakdown.total() - s.duration_s).abs() < 1e-6 * s.duration_s, "{:?}", r.breakdown);
        r
    };
    let repaid = JoinRule::WhenRepaid { at_most: Duration::from_secs(1800) };
    let two_failures = "60000,remove,n1\n120000,add,n1\n150000,remove,n2\n";
    let (wait, rent) = (run(two_failures, JoinRule::AfterWait), run(two_failures, repaid));
    assert_eq!((wait.restarts, wait.reconfigurations), (0, 3), "two failures and a join: {:?}", wait.nodes_in_use);
    assert_eq!((rent.restarts, rent.reconfigurations), (0, 2), "the join rode along: {:?}", rent.nodes_in_use);
    assert_eq!(rent.nodes_in_use.last().map(|x| x.1), Some(7));
    assert!(rent.ettr > wait.ettr, "{} vs {}", rent.ettr, wait.ettr);
    // Nothing to ride along: taken in once waiting cost a move, not at once.
    let one_failure = "60000,remove,n1\n120000,add,n1\n";
    let (wait, rent) = (run(one_failure, JoinRule::AfterWait), run(one_failure, repaid));
    let back = |r: &PolicyReport| r.nodes_in_use.iter().find(|&&(t, n)| t > 60.0 && n == 8).map(|x| x.0);
    let (at_once, later) = (back(&wait).unwrap(), back(&rent).unwrap());
    assert!(at_once < 125.0 && (360.0..375.0).contains(&later), "{at_once} {later}");
    assert_eq!(rent.reconfigurations, 2);
}
