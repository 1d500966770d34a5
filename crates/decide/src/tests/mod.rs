use proptest::prelude::*;

use super::*;
use lazarus_plan::{plan_model, ClusterShape};

/// A committed step's record as these tests keep it.
#[derive(Debug, Clone, PartialEq)]
struct Logged {
    step: u64,
    loss: f64,
    seconds: f64,
}

impl StepRecord for Logged {
    fn step(&self) -> u64 {
        self.step
    }

    fn is_sound(&self) -> bool {
        self.loss.is_finite() && self.seconds.is_finite() && self.seconds >= 0.0
    }
}

type Controller = super::Controller<Logged>;
type Event = super::Event<Logged>;
type Command = super::Command<Logged>;
type StopReport = super::StopReport<Logged>;

const SEC: Duration = Duration::from_secs(1);

fn spec(experts: usize, slots: usize) -> JobSpec {
    JobSpec {
        layers: 2,
        experts,
        slots_per_node: slots,
        gpus_per_node: 1,
        policy: PlanPolicy::trainer(4, None),
        expert_bytes: 1000,
        lease: SEC,
        join_wait: 2 * SEC,
        join_rule: JoinRule::AfterWait,
        rebalance_every: 0,
        total_steps: 1000,
        on_loss: OnLoss::Recover,
        start_within: 60 * SEC,
    }
}

/// Every worker of epoch 0 listens, then is ready: the job runs.
fn start(c: &mut Controller, workers: &[NodeId], t0: Instant) {
    for (i, &w) in workers.iter().enumerate() {
        c.decide(t0, Event::Listening { node: w, epoch: 0, addr: format!("a{i}") });
    }
    for &w in workers {
        c.decide(t0, Event::Ready { node: w, epoch: 0 });
    }
    assert!(c.running());
}

/// A running job of `n` nodes (ids 10, 11, …) with `experts` experts and `slots` slots a node.
/// What worker `node` says when it stops after `steps_done` steps: what its plan gave it, nothing
/// held, no snapshots.
fn stopped_at(steps_done: u64, c: &Controller, node: NodeId) -> StopReport {
    StopReport { steps_done, held: None, holds: c.planned_holdings(node).unwrap(), last: None, snapshots: vec![] }
}

/// Step `step` of epoch 0 done in 0.1 s, every expert of both layers as loaded as the others.
fn even_step(step: u64) -> Event {
    Event::StepDone { epoch: 0, step, steps: 1, loads: vec![vec![1, 1, 1, 1]; 2], seconds: 0.1, moved: None }
}

fn running(n: usize, experts: usize, slots: usize, t0: Instant) -> Controller {
    let loads = vec![(0..experts).map(|e| (e + 1) as f64).collect::<Vec<_>>(); 2];
    let plan = plan_model(&loads, ClusterShape::new(n, 1, slots).unwrap(), &PlanPolicy::trainer(n, None), None).unwrap();
    let nodes: Vec<NodeId> = (0..n as u64).map(|i| 10 + i).collect();
    let mut c = Controller::new(spec(experts, slots), plan, nodes.clone(), t0);
    for (i, &n) in nodes.iter().enumerate() {
        c.decide(t0, Event::Listening { node: n, epoch: 0, addr: format!("a{i}") });
    }
    for &n in &nodes {
        c.decide(t0, Event::Ready { node: n, epoch: 0 });
    }
    assert!(c.running());
    c
}

#[test]
fn the_rendezvous_sends_addresses_in_rank_order_then_resumes() {
    let t0 = Instant::now();
    let loads = vec![vec![1.0, 2.0, 3.0, 4.0]; 2];
    let plan = plan_model(&loads, ClusterShape::new(3, 1, 3).unwrap(), &PlanPolicy::trainer(3, None), None).unwrap();
    let mut c = Controller::new(spec(4, 3), plan, vec![7, 5, 9], t0);
    assert!(c.decide(t0, Event::Listening { node: 9, epoch: 0, addr: "c".into() }).is_empty());
    assert!(c.decide(t0, Event::Listening { node: 7, epoch: 1, addr: "x".into() }).is_empty(), "another epoch's rendezvous");
    assert!(c.decide(t0, Event::Listening { node: 7, epoch: 0, addr: "a".into() }).is_empty());
    let out = c.decide(t0, Event::Listening { node: 5, epoch: 0, addr: "b".into() });
    assert_eq!(out, vec![Command::Addresses { epoch: 0, addrs: vec!["a".into(), "b".into(), "c".into()] }]);
    c.decide(t0, Event::Ready { node: 7, epoch: 0 });
    c.decide(t0, Event::Ready { node: 9, epoch: 0 });
    assert_eq!(c.decide(t0, Event::Ready { node: 5, epoch: 0 }), vec![Command::Resume { epoch: 0 }]);
    assert!(c.running());
}

#[test]
fn a_dead_worker_moves_the_survivors_to_a_new_plan_at_the_furthest_step() {
    let t0 = Instant::now();
    let mut c = running(4, 4, 3, t0);
    c.decide(t0, Event::StepDone { epoch: 0, step: 5, steps: 1, loads: vec![vec![9, 1, 1, 1]; 2], seconds: 0.1, moved: None });
    // The survivors are told to cut their connections to it (rank 2 of epoch 0).
    assert_eq!(
        c.decide(t0, Event::Exited { node: 12, status: "killed by signal 9".into() }),
        vec![Command::Fence { epoch: 0, ranks: vec![2], nodes: vec![10, 11, 13] }]
    );
    // Survivors report: two failed computing step 6, one got past the vote's start and holds it.
    let r = |c: &Controller, node, steps_done, held| StopReport {
        steps_done,
        held,
        holds: c.planned_holdings(node).unwrap(),
        last: None,
        snapshots: vec![],
    };
    assert!(c.decide(t0, Event::StepFailed { node: 10, epoch: 0, report: r(&c, 10, 5, Some(6)) }).is_empty());
    assert!(c.decide(t0, Event::StepFailed { node: 11, epoch: 0, report: r(&c, 11, 6, None) }).is_empty());
    let out = c.decide(t0, Event::StepFailed { node: 13, epoch: 0, report: r(&c, 13, 5, Some(6)) });
    let [Command::Reconfigure(m)] = &out[..] else { panic!("{out:?}") };
    assert_eq!((m.change.epoch, m.commit_to), (1, 6));
    let mut ranks = m.ranks.clone();
    ranks.sort_unstable();
    assert_eq!(ranks, vec![10, 11, 13]);
    assert_eq!(m.change.plan.ranks(), 3);
    // Every transfer goes to a rank that now holds the expert from one that held it before.
    let old = running(4, 4, 3, t0);
    for t in &m.change.transfers {
        assert!(m.change.plan.replicas_on(t.layer, t.expert, t.to) > 0);
        let from_node = m.ranks[t.from];
        let old_rank = old.ranks().iter().position(|&n| n == from_node).unwrap();
        assert!(old.plan().unwrap().replica_map().replicas_on(t.layer, t.expert, old_rank) > 0, "{t:?}");
    }
    assert_eq!(c.epoch(), 1);
    // A report from the old epoch is stale now.
    let stale = StopReport { steps_done: 5, held: None, holds: vec![], last: None, snapshots: vec![] };
    assert!(c.decide(t0, Event::StepFailed { node: 10, epoch: 0, report: stale }).is_empty());
    assert!(!c.running());
    // The new epoch's rendezvous, then training again.
    for (i, &n) in m.ranks.iter().enumerate() {
        c.decide(t0, Event::Listening { node: n, epoch: 1, addr: format!("b{i}") });
    }
    for &n in &m.ranks {
        c.decide(t0, Event::Ready { node: n, epoch: 1 });
    }
    assert!(c.running());
}

/// Heartbeats of every member at `t`; what they made the controller do.
fn beat(c: &mut Controller, t: Instant) -> Vec<Command> {
    let members: Vec<NodeId> = c.alive().iter().copied().chain(c.standby()).collect();
    members.into_iter().flat_map(|n| c.decide(t, Event::Heartbeat { node: n })).collect()
}

#[test]
fn joiners_wait_then_every_rank_pauses_and_they_are_taken_in_with_the_job_state() {
    let t0 = Instant::now();
    let mut c = running(2, 4, 3, t0);
    c.decide(t0, Event::StepDone { epoch: 0, step: 4, steps: 1, loads: vec![vec![4, 3, 2, 1]; 2], seconds: 0.1, moved: None });
    assert!(c.decide(t0, Event::Joined { workers: vec![20] }).is_empty(), "taken in only after its wait");
    assert_eq!(c.standby().collect::<Vec<_>>(), vec![20]);
    assert_eq!((c.member_state(20), c.member_state(10)), (MemberState::Standby, MemberState::Member));
    // Before the wait is over: nothing; heartbeats keep everyone (the joiner too) alive.
    assert!(beat(&mut c, t0 + SEC).is_empty());
    assert!(c.decide(t0 + SEC, Event::Tick).is_empty());
    assert!(c.next_wake(t0 + SEC) <= t0 + 2 * SEC);
    let out = beat(&mut c, t0 + 2 * SEC);
    assert_eq!(out, vec![Command::Pause { epoch: 0, nodes: vec![10, 11] }], "once");
    // Both ranks stop after the same step and say so; the move takes the joiner in.
    let r = |c: &Controller, node| stopped_at(6, c, node);
    let t = t0 + 2 * SEC;
    assert!(c.decide(t, Event::StepFailed { node: 10, epoch: 0, report: r(&c, 10) }).is_empty());
    let out = c.decide(t, Event::StepFailed { node: 11, epoch: 0, report: r(&c, 11) });
    let [Command::Reconfigure(m)] = &out[..] else { panic!("{out:?}") };
    assert_eq!((m.change.epoch, m.commit_to, m.cause, m.ranks.len()), (1, 6, MoveCause::Join, 3));
    let joiner = m.ranks.iter().position(|&n| n == 20).unwrap();
    assert_eq!(m.change.joining, vec![joiner]);
    assert!(m.change.transfers.iter().any(|x| x.to == joiner), "the joiner is given experts");
    assert!(m.change.transfers.iter().all(|x| x.from != joiner), "and is no source");
    for l in 0..2 {
        for e in 0..4 {
            assert!((0..3).any(|q| m.change.plan.replicas_on(l, e, q) > 0), "every expert placed");
        }
    }
    assert!(c.alive().contains(&20) && c.standby().next().is_none());
    assert_eq!(c.member_state(20), MemberState::Member);
}

#[test]
fn when_every_node_is_lost_the_workers_waiting_to_join_carry_the_job_on_from_the_checkpoint() {
    let t0 = Instant::now();
    // Nodes of 4 slots: one can hold every expert.
    let mut c = running(2, 4, 4, t0);
    c.decide(t0, Event::Checkpointed { step: 25 });
    c.decide(t0, Event::Joined { workers: vec![20] });
    c.decide(t0, Event::Exited { node: 10, status: "killed".into() });
    let out = c.decide(t0, Event::Exited { node: 11, status: "killed".into() });
    let rollback = out.iter().find_map(|cmd| if let Command::Rollback { to, to_step } = cmd { Some((to, *to_step)) } else { None });
    let (to, to_step) = rollback.unwrap_or_else(|| panic!("{out:?}"));
    assert_eq!((to.ranks.clone(), to_step), (vec![20], Some(25)));
    assert!(!c.stopped() && c.alive().contains(&20));
    // With nobody waiting, it stops.
    let mut c = running(2, 4, 3, t0);
    c.decide(t0, Event::Exited { node: 10, status: "killed".into() });
    let out = c.decide(t0, Event::Exited { node: 11, status: "killed".into() });
    assert!(matches!(out.last(), Some(Command::Stop { reason: StopReason::EveryNodeLost })), "{out:?}");
}

#[test]
fn a_joiner_that_falls_silent_is_given_up_without_disturbing_the_job() {
    let t0 = Instant::now();
    let mut c = running(2, 4, 3, t0);
    c.decide(t0, Event::Joined { workers: vec![20] });
    c.decide(t0 + SEC / 2, Event::Heartbeat { node: 10 });
    c.decide(t0 + SEC / 2, Event::Heartbeat { node: 11 });
    let out = c.decide(t0 + SEC, Event::Tick);
    assert!(matches!(&out[..], [Command::Kill { node: 20, .. }]), "{out:?}");
    assert!(c.running() && c.standby().next().is_none());
    assert_eq!(c.epoch(), 0);
    // A joiner that exits is given up too, and a second report of it changes nothing.
    c.decide(t0 + SEC, Event::Joined { workers: vec![21] });
    assert!(c.decide(t0 + SEC, Event::Exited { node: 21, status: "exit 1".into() }).is_empty());
    assert!(c.decide(t0 + SEC, Event::Exited { node: 21, status: "exit 1".into() }).is_empty());
    assert!(c.running() && c.standby().next().is_none());
    // An id already used is not a new worker.
    c.decide(t0 + SEC, Event::Joined { workers: vec![10] });
    assert!(c.standby().next().is_none());
}

#[test]
fn a_failure_takes_the_waiting_joiners_in_at_once() {
    let t0 = Instant::now();
    let mut c = running(3, 4, 3, t0);
    c.decide(t0, Event::Joined { workers: vec![20] });
    c.decide(t0, Event::Exited { node: 12, status: "killed".into() });
    let r = |c: &Controller, node| stopped_at(3, c, node);
    c.decide(t0, Event::StepFailed { node: 10, epoch: 0, report: r(&c, 10) });
    let out = c.decide(t0, Event::StepFailed { node: 11, epoch: 0, report: r(&c, 11) });
    let [Command::Reconfigure(m)] = &out[..] else { panic!("{out:?}") };
    assert_eq!(m.cause, MoveCause::Failure);
    let mut ranks = m.ranks.clone();
    ranks.sort_unstable();
    assert_eq!(ranks, vec![10, 11, 20], "the joiner takes the lost worker's place");
    assert_eq!(m.change.joining, vec![m.ranks.iter().position(|&n| n == 20).unwrap()]);
}

/// A running job of 3 nodes planned for loads 1..4 that rebalances every 4 steps; `seconds` a
/// step and loads that made expert 0 the hottest by far.
fn drifted(seconds: f64, t0: Instant) -> (Controller, Vec<Command>) {
    let mut c = running(3, 4, 2, t0);
    c.spec.rebalance_every = 4;
    let mut out = Vec::new();
    for step in 1..=4 {
        out.extend(
            c.decide_inline(t0, Event::StepDone { epoch: 0, step, steps: 1, loads: vec![vec![97, 1, 1, 1]; 2], seconds, moved: None }),
        );
    }
    (c, out)
}

/// A stretch of steps told at once (the simulator's way) weighs the same rebalance as the
/// same steps told one by one (the workers' way).
#[test]
fn steps_told_at_once_weigh_the_same_rebalance_as_steps_told_one_by_one() {
    let t0 = Instant::now();
    let (_, one_by_one) = drifted(2.0, t0);
    let mut c = running(3, 4, 2, t0);
    c.spec.rebalance_every = 4;
    let three =
        c.decide_inline(t0, Event::StepDone { epoch: 0, step: 3, steps: 3, loads: vec![vec![291, 3, 3, 3]; 2], seconds: 6.0, moved: None });
    assert!(three.is_empty(), "3 of 4 steps: not yet weighed: {three:?}");
    let last =
        c.decide_inline(t0, Event::StepDone { epoch: 0, step: 4, steps: 1, loads: vec![vec![97, 1, 1, 1]; 2], seconds: 2.0, moved: None });
    assert_eq!(last, one_by_one);
}

#[test]
fn a_rebalance_that_repays_its_move_pauses_the_job_and_moves_it_to_the_measured_plan() {
    let t0 = Instant::now();
    let (mut c, out) = drifted(2.0, t0);
    let [Command::Rebalance(d), Command::Pause { epoch: 0, nodes }] = &out[..] else { panic!("{out:?}") };
    assert_eq!((d.decision, d.step, d.horizon_steps), (RebalanceVerdict::Apply, 4, 4), "{d:?}");
    assert!(d.imbalance_after < d.imbalance_before && d.gain_s > d.cost_s && d.transfers > 0, "{d:?}");
    assert_eq!(nodes, &vec![10, 11, 12]);
    let r = |c: &Controller, node| stopped_at(4, c, node);
    c.decide(t0, Event::StepFailed { node: 10, epoch: 0, report: r(&c, 10) });
    c.decide(t0, Event::StepFailed { node: 11, epoch: 0, report: r(&c, 11) });
    let out = c.decide(t0, Event::StepFailed { node: 12, epoch: 0, report: r(&c, 12) });
    let [Command::Reconfigure(m)] = &out[..] else { panic!("{out:?}") };
    assert_eq!((m.cause, m.commit_to, m.ranks.len(), m.change.transfers.len()), (MoveCause::Rebalance, 4, 3, d.transfers));
    // The hot expert has more replicas than before.
    let hot = |p: &lazarus_plan::ReplicaMap| (0..p.ranks()).map(|q| p.replicas_on(0, 0, q)).sum::<u32>();
    assert!(hot(&m.change.plan) > hot(&running(3, 4, 2, t0).plan().unwrap().replica_map()));
}

/// A loss right after a move, before a step of the new plan, plans from the loads measured
/// before it (one hot expert), not from even loads that would give it a quarter of its replicas.
#[test]
fn a_loss_before_the_new_plan_measured_anything_plans_from_the_loads_measured_before() {
    let t0 = Instant::now();
    let mut c = running(5, 4, 6, t0);
    c.decide(t0, Event::StepDone { epoch: 0, step: 5, steps: 1, loads: vec![vec![97, 1, 1, 1]; 2], seconds: 0.1, moved: None });
    let lose = |c: &mut Controller, node: NodeId, epoch: u64| {
        c.decide(t0, Event::Exited { node, status: "killed by signal 9".into() });
        let mut out = Vec::new();
        for n in c.ranks().to_vec().into_iter().filter(|&n| n != node) {
            out.extend(c.decide(t0, Event::StepFailed { node: n, epoch, report: stopped_at(5, c, n) }));
        }
        let [Command::Reconfigure(m)] = &out[..] else { panic!("{out:?}") };
        for (i, &n) in m.ranks.iter().enumerate() {
            c.decide(t0, Event::Listening { node: n, epoch: m.change.epoch, addr: format!("b{i}") });
        }
        for &n in &m.ranks {
            c.decide(t0, Event::Ready { node: n, epoch: m.change.epoch });
        }
        m.change.plan.clone()
    };
    let replicas = |p: &lazarus_plan::ReplicaMap, e: usize| (0..p.ranks()).map(|q| p.replicas_on(0, e, q)).sum::<u32>();
    let first = lose(&mut c, 14, 0);
    // Nothing is measured in epoch 1 before the next loss.
    let second = lose(&mut c, 13, 1);
    for plan in [&first, &second] {
        let (hot, cold) = (replicas(plan, 0), replicas(plan, 1));
        assert!(hot > cold + 1, "the hot expert keeps the most replicas: {hot} against {cold}");
    }
}

/// Popularity drifted in the first MoE layer only; the second's candidate differs a little and
/// gains next to nothing. With moves slow enough (10 MB/s) the first layer repays its move and
/// the second does not: the job moves the first layer only, and the second keeps its placement.
#[test]
fn a_rebalance_moves_only_the_layers_that_repay_their_move() {
    let t0 = Instant::now();
    let mut c = running(3, 4, 2, t0);
    c.spec.rebalance_every = 4;
    c.monitor.seconds_per_byte = 1e-7;
    let before = c.plan().unwrap().clone();
    let mut out = Vec::new();
    for step in 1..=4 {
        let loads = vec![vec![97, 1, 1, 1], vec![25, 25, 25, 25]];
        out.extend(c.decide_inline(t0, Event::StepDone { epoch: 0, step, steps: 1, loads, seconds: 2.0, moved: None }));
    }
    let [Command::Rebalance(d), Command::Pause { .. }] = &out[..] else { panic!("{out:?}") };
    assert_eq!((d.decision, d.layers.clone()), (RebalanceVerdict::Shrink, vec![0]), "{d:?}");
    assert!(d.gain_s - d.cost_s > d.full_gain_s - d.full_cost_s, "{d:?}");
    let r = |c: &Controller, node| stopped_at(4, c, node);
    c.decide(t0, Event::StepFailed { node: 10, epoch: 0, report: r(&c, 10) });
    c.decide(t0, Event::StepFailed { node: 11, epoch: 0, report: r(&c, 11) });
    let out = c.decide(t0, Event::StepFailed { node: 12, epoch: 0, report: r(&c, 12) });
    let [Command::Reconfigure(m)] = &out[..] else { panic!("{out:?}") };
    assert_eq!((m.cause, m.change.transfers.len()), (MoveCause::Rebalance, d.transfers));
    assert!(m.change.transfers.iter().all(|t| t.layer == 0), "{:?}", m.change.transfers);
    assert_eq!(c.plan().unwrap().layers()[1], before.layers()[1], "the second layer stays where it was");
    assert_ne!(c.plan().unwrap().layers()[0], before.layers()[0]);
}

#[test]
fn a_rebalance_that_would_not_repay_its_move_is_skipped_and_reported() {
    let t0 = Instant::now();
    // Steps of a microsecond: no plan saves enough in 4 steps to pay for moving experts.
    let (c, out) = drifted(1e-6, t0);
    let [Command::Rebalance(d)] = &out[..] else { panic!("{out:?}") };
    assert_eq!(d.decision, RebalanceVerdict::Skip, "{d:?}");
    assert!(d.gain_s < d.cost_s);
    assert!(c.running() && c.epoch() == 0);
    // The gain does not pay even the move's fixed part (50 ms): the move is not sized.
    assert!(d.not_sized && d.gain_s < 0.05 && d.cost_s == 0.05 && (d.transfers, d.transfer_bytes) == (0, 0), "{d:?}");
    assert!(d.imbalance_after < d.imbalance_before, "the candidate's imbalance is still said: {d:?}");
    // One that pays the fixed part but not its bytes (1 ms a byte) is sized, and says so.
    let mut c = running(3, 4, 2, t0);
    c.spec.rebalance_every = 4;
    c.monitor.seconds_per_byte = 1e-3;
    let out: Vec<Command> = (1..=4)
        .flat_map(|step| {
            c.decide_inline(t0, Event::StepDone { epoch: 0, step, steps: 1, loads: vec![vec![97, 1, 1, 1]; 2], seconds: 2.0, moved: None })
        })
        .collect();
    let [Command::Rebalance(d)] = &out[..] else { panic!("{out:?}") };
    assert_eq!(d.decision, RebalanceVerdict::Skip, "{d:?}");
    assert!(!d.not_sized && d.gain_s > 0.05 && d.transfers > 0 && d.cost_s == 0.05 + d.transfer_bytes as f64 * 1e-3, "{d:?}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    /// A weighing that skips without sizing the move decides what sizing it would have: the
    /// same verdict and layers, whatever the loads, step time and costs.
    #[test]
    fn skipping_without_sizing_decides_as_sizing_would(
        nodes in 2usize..6,
        loads in prop::collection::vec(0u64..100, 8),
        step_s in prop_oneof![Just(1e-6), 1e-3f64..10.0],
        fixed_s in 0.0f64..5.0,
        per_byte in prop_oneof![Just(0.0), 1e-9f64..1e-2],
    ) {
        let t0 = Instant::now();
        let mut c = running(nodes, 4, 3, t0);
        c.spec.rebalance_every = 1;
        (c.monitor.move_fixed_s, c.monitor.seconds_per_byte) = (fixed_s, per_byte);
        let loads = vec![loads[..4].to_vec(), loads[4..].to_vec()];
        c.monitor.record(&loads, 1, step_s);
        c.last_step = 1;
        let w = c.weighing_request().unwrap();
        let (quick, _) = w.decide_sizing(false).unwrap();
        let (sized, _) = w.decide_sizing(true).unwrap();
        prop_assert_eq!((quick.decision, &quick.layers), (sized.decision, &sized.layers));
        prop_assert_eq!(quick.imbalance_before, sized.imbalance_before);
        if quick.not_sized {
            prop_assert_eq!(quick.decision, RebalanceVerdict::Skip);
            prop_assert!(sized.gain_s - sized.cost_s <= 0.0);
        } else {
            prop_assert_eq!(quick, sized);
        }
    }
}

/// The commands of `steps` done at `epoch`, 2 s each, with two layers' loads all but on expert
/// 0 (a skew a rebalance repays).
fn skewed_steps(c: &mut Controller, t0: Instant, epoch: u64, steps: std::ops::RangeInclusive<u64>) -> Vec<Command> {
    let done = |step| Event::StepDone { epoch, step, steps: 1, loads: vec![vec![97, 1, 1, 1]; 2], seconds: 2.0, moved: None };
    steps.flat_map(|step| c.decide(t0, done(step))).collect()
}

/// The weighing runs beside the decisions: asked for once (no second while one is out, however
/// many steps pass), and its verdict acted on when it comes back — here the same verdict as
/// weighed at once.
#[test]
fn a_rebalance_is_weighed_beside_the_decisions_and_acted_on_when_its_verdict_comes_back() {
    let t0 = Instant::now();
    let (_, at_once) = drifted(2.0, t0);
    let mut c = running(3, 4, 2, t0);
    c.spec.rebalance_every = 4;
    let asked = skewed_steps(&mut c, t0, 0, 1..=12);
    let [Command::Weigh(request)] = &asked[..] else { panic!("one weighing asked for in 12 steps: {asked:?}") };
    assert_eq!((request.epoch, request.step), (0, 4));
    assert!(c.running(), "nothing paused while it is weighed");
    let out = c.decide(t0, Event::Weighed(request.weigh()));
    assert_eq!(out, at_once, "the verdict weighed beside equals the one weighed at once");
    assert!(matches!(&out[..], [Command::Rebalance(_), Command::Pause { .. }]), "{out:?}");
}

/// A verdict that comes back after the job moved (a worker lost meanwhile: a new epoch, other
/// ranks) is dropped, said so, and not applied; the next weighing is asked for as usual.
#[test]
fn a_weighing_whose_job_moved_meanwhile_is_dropped() {
    let t0 = Instant::now();
    let mut c = running(3, 4, 2, t0);
    c.spec.rebalance_every = 4;
    let asked = skewed_steps(&mut c, t0, 0, 1..=4);
    let [Command::Weigh(request)] = &asked[..] else { panic!("{asked:?}") };
    // Node 12 dies; the survivors say where they stopped; the job moves to epoch 1.
    c.decide(t0, Event::Exited { node: 12, status: "killed".into() });
    let r = |c: &Controller, node| stopped_at(4, c, node);
    c.decide(t0, Event::StepFailed { node: 10, epoch: 0, report: r(&c, 10) });
    let out = c.decide(t0, Event::StepFailed { node: 11, epoch: 0, report: r(&c, 11) });
    assert!(matches!(&out[..], [Command::Reconfigure(_)]), "{out:?}");
    let epoch = c.epoch();
    for node in [10, 11] {
        c.decide(t0, Event::Listening { node, epoch, addr: format!("a{node}") });
    }
    for node in [10, 11] {
        c.decide(t0, Event::Ready { node, epoch });
    }
    assert!(c.running() && epoch > 0);
    let out = c.decide(t0, Event::Weighed(request.weigh()));
    assert!(out.is_empty(), "a verdict for epoch 0 is not applied at epoch {epoch}: {out:?}");
    assert!(c.running(), "nothing paused");
    assert!(c.recent().any(|e| e.contains("dropped: the job moved meanwhile")), "{:?}", c.recent().collect::<Vec<_>>());
    // The next weighing is asked for after another 4 steps.
    let next = skewed_steps(&mut c, t0, epoch, 5..=8);
    assert!(matches!(&next[..], [Command::Weigh(w)] if w.epoch == epoch), "{next:?}");
}

#[test]
fn a_node_on_notice_hands_over_what_only_it_holds_then_leaves_without_a_rollback() {
    let t0 = Instant::now();
    let mut c = running(3, 4, 2, t0);
    let old = c.plan().unwrap().replica_map();
    assert_eq!(
        c.decide(t0, Event::Drain { workers: vec![11], reason: "SIGTERM".into() }),
        vec![Command::Pause { epoch: 0, nodes: vec![10, 11, 12] }]
    );
    assert_eq!(c.member_state(11), MemberState::Leaving);
    let r = |c: &Controller, node, epoch_steps| StopReport {
        steps_done: epoch_steps,
        held: None,
        holds: c.planned_holdings(node).unwrap(),
        last: None,
        snapshots: vec![],
    };
    c.decide(t0, Event::StepFailed { node: 10, epoch: 0, report: r(&c, 10, 7) });
    c.decide(t0, Event::StepFailed { node: 11, epoch: 0, report: r(&c, 11, 7) });
    let out = c.decide(t0, Event::StepFailed { node: 12, epoch: 0, report: r(&c, 12, 7) });
    let [Command::Reconfigure(m)] = &out[..] else { panic!("{out:?}") };
    // The leaver is the last rank, given nothing, and sends what only it held.
    assert_eq!((m.cause, m.change.hold, m.change.leaving.clone(), m.ranks[2]), (MoveCause::Drain, true, vec![2], 11));
    for l in 0..2 {
        for e in 0..4 {
            assert_eq!(m.change.plan.replicas_on(l, e, 2), 0);
            let only_leaver = old.replicas_on(l, e, 1) > 0 && old.replicas_on(l, e, 0) == 0 && old.replicas_on(l, e, 2) == 0;
            if only_leaver {
                assert!(m.change.transfers.iter().any(|t| t.layer == l && t.expert == e && t.from == 2), "layer {l} expert {e}: {m:?}");
            }
        }
    }
    // The move completes; the leaver goes — expected: no kill, no fence, no lost state.
    for (i, &n) in m.ranks.iter().enumerate() {
        c.decide(t0, Event::Listening { node: n, epoch: 1, addr: format!("b{i}") });
    }
    for &n in &m.ranks {
        c.decide(t0, Event::Ready { node: n, epoch: 1 });
    }
    assert!(c.decide(t0, Event::Exited { node: 11, status: "left".into() }).is_empty());
    // The others held after the move: they say so, and the job moves again, in place.
    let first = m.ranks[0];
    c.decide(t0, Event::StepFailed { node: first, epoch: 1, report: r(&c, first, 7) });
    let second = m.ranks[1];
    let out = c.decide(t0, Event::StepFailed { node: second, epoch: 1, report: r(&c, second, 7) });
    let [Command::Reconfigure(m2)] = &out[..] else { panic!("{out:?}") };
    assert_eq!((m2.cause, m2.change.hold, m2.commit_to, m2.ranks.len()), (MoveCause::Drain, false, 7, 2));
    assert!(m2.change.transfers.is_empty() && m2.change.leaving.is_empty(), "{m2:?}");
    assert!(!c.alive().contains(&11));
    assert_eq!(c.member_state(11), MemberState::Drained, "a worker that left on notice was not lost");
    assert_eq!((c.job_epoch(c.epoch()), c.reconfigurations()), (2, 1), "two epochs, one reconfiguration");
}

/// Rank 0 got through the commit vote of step 6 (and reported it: the log has it), then died;
/// the others' vote failed, so they hold step 6 uncommitted. It is done: they commit it, and
/// nothing runs (or is logged) twice.
#[test]
fn a_step_rank_0_reported_before_it_died_is_committed_by_the_survivors() {
    let t0 = Instant::now();
    let mut c = running(3, 4, 3, t0);
    c.decide(t0, even_step(6));
    c.decide(t0, Event::Exited { node: 10, status: "killed".into() });
    let r = |c: &Controller, node| StopReport {
        steps_done: 5,
        held: Some(6),
        holds: c.planned_holdings(node).unwrap(),
        last: None,
        snapshots: vec![],
    };
    c.decide(t0, Event::StepFailed { node: 11, epoch: 0, report: r(&c, 11) });
    let out = c.decide(t0, Event::StepFailed { node: 12, epoch: 0, report: r(&c, 12) });
    let [Command::Reconfigure(m)] = &out[..] else { panic!("{out:?}") };
    assert_eq!(m.commit_to, 6);
    // Without rank 0's report the step is re-run (nobody has logged it).
    let mut c = running(3, 4, 3, t0);
    c.decide(t0, even_step(5));
    c.decide(t0, Event::Exited { node: 10, status: "killed".into() });
    c.decide(t0, Event::StepFailed { node: 11, epoch: 0, report: r(&c, 11) });
    let out = c.decide(t0, Event::StepFailed { node: 12, epoch: 0, report: r(&c, 12) });
    let [Command::Reconfigure(m)] = &out[..] else { panic!("{out:?}") };
    assert_eq!(m.commit_to, 5);
}

/// Found by the soak: rank 0 stopped (SIGSTOP, a partition) after the commit vote of step 6,
/// before its report got out; the others committed step 6. It is done, and the log must have
/// it: the controller logs a survivor's copy of its report, once, before the move.
#[test]
fn a_step_the_survivors_committed_but_rank_0_never_reported_is_logged_from_their_copy() {
    let t0 = Instant::now();
    let mut c = running(3, 4, 3, t0);
    c.decide(t0, even_step(5));
    c.decide(t0, Event::Exited { node: 10, status: "no heartbeat".into() });
    let report = Logged { step: 6, loss: 2.5, seconds: 0.02 };
    let copy = Some(report.clone());
    let r = |c: &Controller, node, last: Option<Logged>| StopReport {
        steps_done: 6,
        held: None,
        holds: c.planned_holdings(node).unwrap(),
        last,
        snapshots: vec![],
    };
    c.decide(t0, Event::StepFailed { node: 11, epoch: 0, report: r(&c, 11, copy.clone()) });
    let out = c.decide(t0, Event::StepFailed { node: 12, epoch: 0, report: r(&c, 12, copy.clone()) });
    let [Command::LogStep(logged), Command::Reconfigure(m)] = &out[..] else { panic!("{out:?}") };
    assert_eq!((logged, m.commit_to, c.last_step()), (&report, 6, 6));
    // A copy of another step, one whose figures are not sound (a peer's word), or none: nothing
    // logged (the step re-runs, or is logged already).
    for copy in [Logged { step: 4, ..report }, Logged { loss: f64::NAN, ..report }, Logged { seconds: -1.0, ..report }] {
        let mut c = running(3, 4, 3, t0);
        c.decide(t0, even_step(5));
        c.decide(t0, Event::Exited { node: 10, status: "no heartbeat".into() });
        c.decide(t0, Event::StepFailed { node: 11, epoch: 0, report: r(&c, 11, Some(copy.clone())) });
        let out = c.decide(t0, Event::StepFailed { node: 12, epoch: 0, report: r(&c, 12, None) });
        assert!(matches!(&out[..], [Command::Reconfigure(_)]), "{copy:?}: {out:?}");
        assert_eq!(c.last_step(), 5);
    }
}

#[test]
fn a_silent_node_is_killed_at_its_lease_and_treated_as_lost() {
    let t0 = Instant::now();
    let mut c = running(3, 4, 3, t0);
    assert_eq!(c.deadline(), Some(t0 + SEC));
    c.decide(t0 + SEC / 2, Event::Heartbeat { node: 10 });
    c.decide(t0 + SEC / 2, Event::Heartbeat { node: 11 });
    assert!(c.decide(t0 + SEC / 2, Event::Tick).is_empty());
    let out = c.decide(t0 + SEC, Event::Tick);
    // Killed, and fenced off by the survivors: a hung rank must not hold their step until its
    // collective deadline.
    assert!(
        matches!(&out[..], [Command::Kill { node: 12, .. }, Command::Fence { ranks, nodes, .. }] if ranks == &[2] && nodes == &[10, 11]),
        "{out:?}"
    );
    // It failed when it fell silent, as far as anyone can tell: its record's clock starts there.
    assert!(matches!(&out[0], Command::Kill { silent_since: Some(t), .. } if *t == t0), "{out:?}");
    assert!(!c.alive().contains(&12));
    // A heartbeat from a lost node does not bring it back.
    c.decide(t0 + SEC, Event::Heartbeat { node: 12 });
    assert!(!c.alive().contains(&12));
}

/// At the job's start a worker that has not said a word yet may be waiting for its spec (a
/// thousand nodes' specs take seconds to send): it is given up only after
/// [`crate::membership::FIRST_WORD_WITHIN`]; once heard from, its lease holds.
#[test]
fn a_worker_of_the_start_has_time_for_its_spec_before_its_lease_counts() {
    let t0 = Instant::now();
    let loads = vec![(0..4).map(|e| (e + 1) as f64).collect::<Vec<_>>(); 2];
    let plan = plan_model(&loads, ClusterShape::new(3, 1, 3).unwrap(), &PlanPolicy::trainer(3, None), None).unwrap();
    let mut c = Controller::new(spec(4, 3), plan, vec![10, 11, 12], t0);
    let first_word = crate::membership::FIRST_WORD_WITHIN;
    assert_eq!(c.deadline(), Some(t0 + first_word));
    // (A look at the leases before anyone spoke: no lease ends before the first word's.)
    assert!(c.decide(t0 + SEC / 4, Event::Tick).is_empty());
    c.decide(t0 + SEC / 2, Event::Listening { node: 10, epoch: 0, addr: "a0".into() });
    c.decide(t0 + SEC / 2, Event::Listening { node: 11, epoch: 0, addr: "a1".into() });
    // Node 11 beats every 200 ms; node 10 spoke once, node 12 never.
    let mut lost = BTreeMap::new();
    let mut t = t0 + SEC / 2;
    while t < t0 + first_word + SEC {
        t += SEC / 5;
        for cmd in c.decide(t, Event::Heartbeat { node: 11 }) {
            if let Command::Kill { node, reason, .. } = cmd {
                lost.insert(node, (t.duration_since(t0), reason));
            }
        }
    }
    // Node 10's lease holds once it spoke: lost a lease after its word.
    let (at, why) = &lost[&10];
    assert!(*at >= SEC * 3 / 2 && *at < 2 * SEC && why.contains("1000 ms"), "{lost:?}");
    // Node 12, silent from the start, is given up at the first word's end, not at a lease.
    let (at, why) = &lost[&12];
    assert!(*at >= first_word && *at < first_word + SEC && why.contains(&first_word.as_millis().to_string()), "{lost:?}");
    assert!(!lost.contains_key(&11));
}

/// Heartbeats from healthy nodes do not hide a silent one: leases are checked on every event.
#[test]
fn a_silent_node_is_found_even_while_others_keep_talking() {
    let t0 = Instant::now();
    let mut c = running(3, 4, 3, t0);
    let mut killed = Vec::new();
    for i in 1..=8u32 {
        let now = t0 + SEC * i / 4;
        killed.extend(c.decide(now, Event::Heartbeat { node: 10 + (i % 2) as u64 }));
    }
    assert!(matches!(&killed[..], [Command::Kill { node: 12, .. }, Command::Fence { .. }]), "{killed:?}");
}

/// A controller that was itself stalled (its process paused for 10 s) heard nobody in that
/// time: it does not take every node for lost, it gives them their lease again; a node that
/// stays silent after is still found.
#[test]
fn a_stalled_controller_extends_the_leases_instead_of_losing_every_node() {
    let t0 = Instant::now();
    let mut c = running(3, 4, 3, t0);
    let back = t0 + 10 * SEC;
    assert!(c.decide(back, Event::Tick).is_empty(), "nobody is lost for the controller's own stall");
    assert_eq!(c.alive().len(), 3);
    let mut out = Vec::new();
    for i in 1..=4u32 {
        let now = back + SEC * i / 4;
        out.extend(c.decide(now, Event::Heartbeat { node: 10 }));
        out.extend(c.decide(now, Event::Heartbeat { node: 11 }));
    }
    assert!(matches!(&out[..], [Command::Kill { node: 12, .. }, Command::Fence { .. }]), "{out:?}");
}

/// The last checkpoint is the newest the job wrote, or — before it writes one — the one a
/// resumed job started from (not step 0: the log would be cut back to nothing).
#[test]
fn both_holders_of_an_expert_lost_rolls_back_to_the_last_checkpoint() {
    for written in [true, false] {
        both_holders_lost_roll_back_to_step_4(written);
    }
}

fn both_holders_lost_roll_back_to_step_4(written: bool) {
    let t0 = Instant::now();
    let mut c = if written {
        let mut c = running(4, 4, 2, t0);
        c.decide(t0, Event::Checkpointed { step: 4 });
        c
    } else {
        running(4, 4, 2, t0).with_checkpoint(Some(4))
    };
    assert_eq!(c.checkpoint(), Some(4));
    // Find two nodes whose loss takes every replica of some expert.
    let holders = c.plan().unwrap().layers()[0].holders();
    let pair: Vec<usize> = holders.iter().find(|h| h.len() == 2).map(|h| h.iter().collect()).expect("an expert on exactly two nodes");
    let (a, b) = (c.ranks()[pair[0]], c.ranks()[pair[1]]);
    c.decide(t0, Event::Exited { node: a, status: "x".into() });
    c.decide(t0, Event::Exited { node: b, status: "x".into() });
    let mut out = Vec::new();
    for n in c.alive().clone() {
        let holds = c.planned_holdings(n).unwrap();
        out = c.decide(
            t0,
            Event::StepFailed { node: n, epoch: 0, report: StopReport { steps_done: 7, held: None, holds, last: None, snapshots: vec![] } },
        );
    }
    let [Command::Rollback { to, to_step }] = &out[..] else { panic!("{out:?}") };
    assert_eq!(*to_step, Some(4));
    assert!(to.change.transfers.is_empty());
    assert_eq!(to.change.plan.ranks(), 2);
}

#[test]
fn too_few_slots_for_every_expert_stops_with_the_reason() {
    let t0 = Instant::now();
    let mut c = running(2, 4, 2, t0);
    c.decide(t0, Event::Checkpointed { step: 1 });
    c.decide(t0, Event::Exited { node: 11, status: "x".into() });
    let holds = c.planned_holdings(10).unwrap();
    let out = c.decide(
        t0,
        Event::StepFailed { node: 10, epoch: 0, report: StopReport { steps_done: 1, held: None, holds, last: None, snapshots: vec![] } },
    );
    let [Command::Stop { reason }] = &out[..] else { panic!("{out:?}") };
    assert_eq!(*reason, StopReason::TooFewSlots { workers: 1, slots: 2, experts: 4, checkpoint: Some(1) });
    let said = reason.to_string();
    assert!(said.contains("2 expert slots") && said.contains("4 experts"), "{said}");
    assert!(said.contains("the last checkpoint is of step 1"), "the user is told what to resume from: {said}");
    assert!(c.stopped());
    assert!(c.decide(t0, Event::Tick).is_empty());
}

/// A rank lost in the middle of a move: the survivors are told to give the rendezvous up, say
/// where they stopped with what they hold (their old experts and what they received before
/// the loss), and the next move plans from that, not from a plan nobody finished moving to.
#[test]
fn a_loss_during_a_move_calls_the_rendezvous_off_and_replans_from_what_survivors_hold() {
    let t0 = Instant::now();
    let mut c = running(4, 4, 3, t0);
    let before: BTreeMap<NodeId, Vec<Vec<usize>>> = c.ranks().iter().map(|&n| (n, c.planned_holdings(n).unwrap())).collect();
    c.decide(t0, Event::Exited { node: 13, status: "x".into() });
    let mut out = Vec::new();
    for n in [10, 11, 12] {
        out = c.decide(
            t0,
            Event::StepFailed {
                node: n,
                epoch: 0,
                report: StopReport { steps_done: 3, held: None, holds: before[&n].clone(), last: None, snapshots: vec![] },
            },
        );
    }
    let [Command::Reconfigure(m)] = &out[..] else { panic!("{out:?}") };
    assert_eq!(m.change.epoch, 1);
    // Two of the survivors listen; then the third dies before it does.
    c.decide(t0, Event::Listening { node: 10, epoch: 1, addr: "a".into() });
    c.decide(t0, Event::Listening { node: 11, epoch: 1, addr: "b".into() });
    let out = c.decide(t0, Event::Exited { node: 12, status: "x".into() });
    assert_eq!(out, vec![Command::Abandon { epoch: 1, nodes: vec![10, 11] }]);
    // Node 12's experts are gone unless 10 or 11 hold them: say 10 received everything it was
    // to fetch (it holds every expert), 11 nothing new.
    let all = vec![(0..4).collect::<Vec<usize>>(); 2];
    c.decide(
        t0,
        Event::StepFailed {
            node: 10,
            epoch: 1,
            report: StopReport { steps_done: 3, held: None, holds: all, last: None, snapshots: vec![] },
        },
    );
    let out = c.decide(
        t0,
        Event::StepFailed {
            node: 11,
            epoch: 1,
            report: StopReport { steps_done: 3, held: None, holds: before[&11].clone(), last: None, snapshots: vec![] },
        },
    );
    let [Command::Reconfigure(m)] = &out[..] else { panic!("with node 10 holding every expert nothing is lost: {out:?}") };
    assert_eq!((m.change.epoch, m.ranks.len(), m.commit_to), (2, 2, 3));
    for t in &m.change.transfers {
        assert_eq!(m.ranks[t.from], 10, "only node 10 can give what 11 lacks: {t:?}");
    }
}

/// A survivor's report is a peer's word: holdings out of range are dropped, not trusted.
#[test]
fn holdings_that_do_not_fit_the_job_are_not_trusted() {
    let t0 = Instant::now();
    let mut c = running(2, 4, 4, t0);
    c.decide(t0, Event::Exited { node: 11, status: "x".into() });
    // Node 10 claims experts 4..1000 and a third layer: it holds none of what the job has.
    let holds = vec![(4..1000).collect(), vec![usize::MAX], vec![0, 1, 2, 3]];
    let out = c.decide(
        t0,
        Event::StepFailed { node: 10, epoch: 0, report: StopReport { steps_done: 2, held: None, holds, last: None, snapshots: vec![] } },
    );
    assert!(matches!(&out[..], [Command::Rollback { .. }]), "{out:?}");
}

/// One random event for a job of nodes 10..10+n.
fn arb_event(n: u64) -> impl Strategy<Value = (u64, Event)> {
    // Ids past the first workers are those of joiners (some reuse an id already taken).
    let node = 10..10 + n + 4;
    prop_oneof![
        (0u64..3, 14u64..20).prop_map(|(dt, w)| (dt, Event::Joined { workers: vec![w] })),
        (0u64..3, 10u64..16).prop_map(|(dt, w)| (dt, Event::Drain { workers: vec![w], reason: "notice".into() })),
        (0u64..3, node.clone()).prop_map(|(dt, node)| (dt, Event::Heartbeat { node })),
        (0u64..3, node.clone()).prop_map(|(dt, node)| (dt, Event::Exited { node, status: "killed".into() })),
        (0u64..3, node.clone(), 0u64..4, 0u64..4)
            .prop_map(|(dt, node, epoch, i)| (dt, Event::Listening { node, epoch, addr: format!("a{i}") })),
        (0u64..3, node.clone(), 0u64..4).prop_map(|(dt, node, epoch)| (dt, Event::Ready { node, epoch })),
        (0u64..3, node.clone(), 0u64..4, 0u64..20, any::<bool>()).prop_map(|(dt, node, epoch, steps_done, held)| {
            (
                dt,
                Event::StepFailed {
                    node,
                    epoch,
                    report: StopReport { steps_done, held: held.then_some(steps_done + 1), holds: vec![], last: None, snapshots: vec![] },
                },
            )
        }),
        (0u64..3, 0u64..4, 0u64..20).prop_map(|(dt, epoch, step)| (
            dt,
            Event::StepDone { epoch, step, steps: 1, loads: vec![vec![1 + 20 * (step % 2), 2, 3, 4]; 2], seconds: 10.0, moved: None }
        )),
        (0u64..3, 0u64..20).prop_map(|(dt, step)| (dt, Event::Checkpointed { step })),
        (0u64..3, node.clone()).prop_map(|(dt, node)| (dt, Event::Done { node })),
        (0u64..3).prop_map(|dt| (dt, Event::StopRequested { why: "SIGTERM".into() })),
        (0u64..3).prop_map(|dt| (dt, Event::Tick)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]
    /// Over any sequence of deaths, joins, heartbeats, stale and out-of-order reports, finished
    /// workers and stop requests: epochs only grow; no move or rollback names a node that is
    /// lost; every plan hosts every expert (its replica map validates and has one rank per named
    /// node); a job without recovery never moves; once over, nothing more happens.
    #[test]
    fn the_decision_core_keeps_its_invariants(
        n in 2usize..6,
        slots in 2usize..4,
        rebalance_every in prop_oneof![Just(0u64), Just(2u64)],
        recover in prop_oneof![4 => Just(true), 1 => Just(false)],
        events in proptest::collection::vec(arb_event(6), 1..60),
    ) {
        let t0 = Instant::now();
        let mut c = running(n, 4, slots, t0);
        c.spec.rebalance_every = rebalance_every;
        if !recover {
            c.spec.on_loss = OnLoss::Stop { grace: 2 * SEC };
        }
        let mut now = t0;
        let mut epoch = c.epoch();
        // A weighing asked for comes back later, with other events between (every other one).
        let mut weighing: Option<Box<crate::Weighing>> = None;
        for (dt, ev) in events {
            now += SEC * dt as u32 / 2;
            let ev = match weighing.take() {
                Some(w) if dt % 2 == 0 => {
                    let out = c.decide(now, Event::Weighed(w.weigh()));
                    prop_assert!(out.iter().all(|c| matches!(c, Command::Rebalance(_) | Command::Pause { .. })), "{:?}", out);
                    if c.is_over() {
                        break;
                    }
                    ev
                }
                w => {
                    weighing = w;
                    ev
                }
            };
            // A survivor reports what its plan gave it (or, if it has no rank now, nothing).
            let ev = match ev {
                Event::StepFailed { node, epoch, mut report } => {
                    report.holds = c.planned_holdings(node).unwrap_or_default();
                    Event::StepFailed { node, epoch, report }
                }
                ev => ev,
            };
            let out = c.decide(now, ev);
            prop_assert!(c.standby().all(|w| !c.alive().contains(&w)), "a worker both stands by and is a member");
            prop_assert!(
                c.alive().iter().all(|&w| matches!(c.member_state(w), MemberState::Starting | MemberState::Member | MemberState::Leaving)),
                "a member is a member or leaving"
            );
            prop_assert!(c.epoch() >= epoch);
            epoch = c.epoch();
            for cmd in &out {
                match cmd {
                    Command::Reconfigure(m) | Command::Rollback { to: m, .. } => {
                        prop_assert!(recover, "a job without recovery moved");
                        prop_assert!(m.ranks.iter().all(|r| c.alive().contains(r)), "{:?} names a lost node", m.ranks);
                        prop_assert!(m.change.leaving.iter().all(|&r| r < m.ranks.len()));
                        prop_assert_eq!(m.change.plan.ranks(), m.ranks.len());
                        prop_assert!(serde_json::from_str::<lazarus_plan::ReplicaMap>(&serde_json::to_string(&m.change.plan).unwrap()).is_ok());
                        prop_assert_eq!(m.change.epoch, c.epoch());
                        // Joiners hold nothing: they are never a transfer's source.
                        prop_assert!(m.change.transfers.iter().all(|t| !m.change.joining.contains(&t.from)));
                        prop_assert!(m.change.joining.iter().all(|&r| r < m.ranks.len()));
                        for t in &m.change.transfers {
                            prop_assert!(t.from < m.ranks.len() && t.to < m.ranks.len() && t.from != t.to);
                        }
                        // The cause says which command it is: a rollback moves nothing.
                        let rollback = matches!(cmd, Command::Rollback { .. });
                        prop_assert_eq!(m.cause == MoveCause::Rollback, rollback);
                        prop_assert!(!rollback || (m.change.transfers.is_empty() && m.restored.is_empty()));
                    }
                    Command::Fence { epoch, ranks, nodes } => {
                        prop_assert!(*epoch <= c.epoch() && !ranks.is_empty());
                        prop_assert!(nodes.iter().all(|n| c.alive().contains(n)), "a fence told to a lost node: {:?}", nodes);
                    }
                    Command::Abandon { epoch, nodes } => {
                        // It names the rendezvous it calls off: the current epoch's, or the one
                        // the same decision replaces with a new plan (sent right after it).
                        prop_assert!(*epoch <= c.epoch());
                        prop_assert!(!nodes.is_empty(), "an abandon to nobody");
                        prop_assert!(nodes.iter().all(|n| c.alive().contains(n)));
                    }
                    Command::Addresses { epoch, addrs } => {
                        prop_assert_eq!(*epoch, c.epoch());
                        prop_assert_eq!(addrs.len(), c.ranks().len());
                    }
                    Command::Stop { .. } => prop_assert!(c.stopped()),
                    Command::Kill { node, .. } => prop_assert!(!c.alive().contains(node)),
                    Command::Resume { .. } => prop_assert!(c.running()),
                    Command::Rebalance(d) => prop_assert!(d.decision != RebalanceVerdict::Skip || d.layers.is_empty()),
                    Command::Weigh(w) => {
                        prop_assert!(recover && c.running(), "a weighing asked for by a job that cannot move");
                        prop_assert_eq!(w.epoch, c.epoch());
                        prop_assert!(weighing.is_none(), "a second weighing while one is out");
                        weighing = Some(w.clone());
                    }
                    Command::LogStep(s) => prop_assert_eq!(s.step, c.last_step()),
                    Command::Pause { epoch, nodes } => {
                        prop_assert!(recover, "a job without recovery paused to move");
                        prop_assert_eq!(*epoch, c.epoch());
                        prop_assert!(nodes.iter().all(|n| c.alive().contains(n)));
                    }
                    Command::Finish { epoch, nodes } => {
                        prop_assert_eq!(*epoch, c.epoch());
                        prop_assert_eq!(nodes.as_slice(), c.ranks());
                    }
                    Command::Complete => prop_assert!(c.completed() && c.ranks().iter().all(|r| c.alive().contains(r))),
                }
            }
            if c.is_over() {
                prop_assert!(c.decide(now, Event::Tick).is_empty());
                break;
            }
        }
    }
}

/// Nodes of two workers each (GPUs): a worker lost takes the other worker of its node with it,
/// the survivors are fenced off from both, and the new plan places whole nodes — after its
/// transfers every rank holds exactly what the new plan gives it.
#[test]
fn a_node_of_several_workers_is_lost_whole_and_replanned_whole() {
    let t0 = Instant::now();
    let loads = vec![vec![4.0, 3.0, 2.0, 1.0]; 2];
    let plan = plan_model(&loads, ClusterShape::new(3, 2, 2).unwrap(), &PlanPolicy::trainer(3, None), None).unwrap();
    let spec = JobSpec { gpus_per_node: 2, slots_per_node: 4, policy: PlanPolicy::trainer(3, None), ..spec(4, 4) };
    let workers: Vec<NodeId> = (10..16).collect();
    let c = &mut Controller::new(spec, plan, workers.clone(), t0);
    start(c, &workers, t0);
    let out = c.decide(t0, Event::Exited { node: 12, status: "killed by signal 9".into() });
    assert!(
        matches!(&out[..], [Command::Kill { node: 13, .. }, Command::Fence { ranks, nodes, .. }] if ranks == &[2, 3] && nodes == &[10, 11, 14, 15]),
        "{out:?}"
    );
    // Its healthy co-worker did not fall silent: it goes with the failure, which began now.
    assert!(matches!(&out[0], Command::Kill { silent_since: None, .. }), "{out:?}");
    let before: BTreeMap<NodeId, Vec<Vec<usize>>> = [10, 11, 14, 15].iter().map(|&w| (w, c.planned_holdings(w).unwrap())).collect();
    let mut out = Vec::new();
    for &w in &[10, 11, 14, 15] {
        let report = StopReport { steps_done: 4, held: None, holds: before[&w].clone(), last: None, snapshots: vec![] };
        out = c.decide(t0, Event::StepFailed { node: w, epoch: 0, report });
    }
    let [Command::Reconfigure(m)] = &out[..] else { panic!("every expert had a replica on another node: {out:?}") };
    assert_eq!(c.plan().unwrap().shape().gpus_per_node, 2);
    assert_eq!(m.change.plan.ranks(), 4);
    // Ranks 2q and 2q+1 are the two workers of one node.
    for q in 0..2 {
        assert_eq!(m.ranks[2 * q] / 2, m.ranks[2 * q + 1] / 2, "{:?}", m.ranks);
    }
    let mut held: Vec<Vec<Vec<usize>>> = m.ranks.iter().map(|w| before[w].clone()).collect();
    for t in &m.change.transfers {
        assert!(held[t.from][t.layer].contains(&t.expert), "{t:?} from a rank without it");
        held[t.to][t.layer].push(t.expert);
    }
    for (r, h) in held.iter().enumerate() {
        for l in 0..m.change.plan.layer_count() {
            for (e, row) in m.change.plan.dense_layer(l).iter().enumerate() {
                assert!(row[r] == 0 || h[l].contains(&e), "rank {r} lacks expert {e} of layer {l} after the move");
            }
        }
    }
}

#[test]
fn an_expert_that_lost_every_replica_comes_back_from_the_freshest_snapshot_instead_of_a_rollback() {
    let t0 = Instant::now();
    // 4 nodes of 2 slots, 6 experts: node 10 is the only holder of some experts.
    let mut c = running(4, 6, 2, t0);
    c.decide(t0, Event::Checkpointed { step: 2 });
    let holds: BTreeMap<NodeId, Vec<Vec<usize>>> = (10..14).map(|n| (n, c.planned_holdings(n).unwrap())).collect();
    let lost_node = 10;
    let only: Vec<(usize, usize)> = (0..2)
        .flat_map(|l| (0..6).map(move |e| (l, e)))
        .filter(|&(l, e)| holds.iter().all(|(&m, h)| h[l].contains(&e) == (m == lost_node)))
        .collect();
    assert!(!only.is_empty(), "some expert on node 10 only: {holds:?}");
    let survivors: Vec<NodeId> = (11..14).collect();
    // Two survivors keep snapshots of them: of step 5 (staler) and of step 6.
    let (old_keeper, keeper) = (survivors[0], survivors[1]);
    // Each expert had 10 tokens a step. `behind`: these survivors computed step 7 but hold it
    // uncommitted (their vote failed); the others committed it.
    let report = |n: NodeId, snapshots: Vec<SnapshotHeld>, behind: bool| StopReport {
        steps_done: if behind { 6 } else { 7 },
        held: behind.then_some(7),
        holds: holds[&n].clone(),
        last: None,
        snapshots,
    };
    let decide_all = |c: &mut Controller, with: bool, behind: &[NodeId]| {
        let mut out = c.decide(t0, Event::Exited { node: lost_node, status: "killed by signal 9".into() });
        for &n in &survivors {
            let step = if n == old_keeper { 5 } else { 6 };
            let done = if behind.contains(&n) { 6 } else { 7 };
            let snaps = match with && (n == old_keeper || n == keeper) {
                true => only
                    .iter()
                    .map(|&(layer, expert)| SnapshotHeld {
                        layer,
                        expert,
                        step,
                        tokens_lost: 10 * (done - step),
                        held_step_tokens: if behind.contains(&n) { 10 } else { 0 },
                    })
                    .collect(),
                false => vec![],
            };
            out.extend(c.decide(t0, Event::StepFailed { node: n, epoch: 0, report: report(n, snaps, behind.contains(&n)) }));
        }
        out
    };
    let restored = |out: &[Command]| {
        let Some(Command::Reconfigure(m)) = out.iter().find(|x| matches!(x, Command::Reconfigure(_))) else { panic!("{out:?}") };
        m.clone()
    };
    let want = |from_step: u64, stale_steps: u64, tokens_lost: u64| -> Vec<RestoredExpert> {
        only.iter().map(|&(layer, expert)| RestoredExpert { layer, expert, from_step, stale_steps, tokens_lost, holder: keeper }).collect()
    };
    let m = restored(&decide_all(&mut c, true, &[]));
    assert_eq!(m.restored, want(6, 1, 10), "the freshest snapshots");
    assert_eq!(m.rollback_avoided, 5, "a rollback to step 2 would have re-run 5 steps");
    // The keeper holds step 7 uncommitted while another survivor committed it: the move
    // commits it, so its tokens are lost too (found by CI: they were counted as none).
    let mut behind = running(4, 6, 2, t0);
    behind.decide(t0, Event::Checkpointed { step: 2 });
    assert_eq!(restored(&decide_all(&mut behind, true, &[keeper])).restored, want(6, 1, 10));
    // No survivor committed step 7: it is dropped, the step-6 snapshot is not stale.
    let mut none = running(4, 6, 2, t0);
    none.decide(t0, Event::Checkpointed { step: 2 });
    assert_eq!(restored(&decide_all(&mut none, true, &survivors)).restored, want(6, 0, 0));
    // Each is placed somewhere: sent from the keeper's rank, or kept there.
    let keeper_rank = m.ranks.iter().position(|&n| n == keeper).unwrap();
    for &(layer, expert) in &only {
        let placed: Vec<usize> = (0..m.ranks.len()).filter(|&q| m.change.plan.replicas_on(layer, expert, q) > 0).collect();
        assert!(!placed.is_empty());
        for q in placed.into_iter().filter(|&q| q != keeper_rank) {
            assert!(m.change.transfers.iter().any(|x| (x.layer, x.expert, x.to, x.from) == (layer, expert, q, keeper_rank)), "{m:?}");
        }
    }
    // Without snapshots: the rollback to the checkpoint.
    let mut c = running(4, 6, 2, t0);
    c.decide(t0, Event::Checkpointed { step: 2 });
    let out = decide_all(&mut c, false, &[]);
    assert!(out.iter().any(|x| matches!(x, Command::Rollback { to_step: Some(2), .. })), "{out:?}");
}

/// Found by the invariants' property test: every member of a rendezvous lost at once (joiners
/// whose leases ran out) while new joiners wait. No one is left to call the old rendezvous off,
/// so no abandon goes out (it would name the old epoch to nobody); the joiners get the new plan.
#[test]
fn a_rendezvous_that_lost_every_member_is_not_called_off_to_nobody() {
    let t0 = Instant::now();
    let mut c = running(2, 4, 2, t0);
    let mut now = t0;
    let failed = StopReport { steps_done: 0, held: None, holds: vec![], last: None, snapshots: vec![] };
    let events = vec![
        (1u64, Event::Ready { node: 12, epoch: 0 }),
        (0, Event::Joined { workers: vec![18] }),
        (2, Event::Joined { workers: vec![15] }),
        (1, Event::StepFailed { node: 12, epoch: 0, report: failed }),
        (0, Event::Joined { workers: vec![16] }),
        (1, Event::Joined { workers: vec![14] }),
    ];
    let mut last = Vec::new();
    for (dt, ev) in events {
        now += SEC * dt as u32 / 2;
        last = c.decide(now, ev);
    }
    assert_eq!(c.epoch(), 2);
    assert!(!last.iter().any(|cmd| matches!(cmd, Command::Abandon { .. })), "{last:?}");
    assert!(
        last.iter().any(|cmd| matches!(cmd, Command::Rollback { to, .. } if to.change.epoch == 2 && to.ranks == vec![16, 14])),
        "{last:?}"
    );
}

/// What a user reads counts epochs from the job's start, whatever number the job's first plan
/// carries (plans' epochs are unique across runs).
#[test]
fn notes_count_epochs_from_the_start_of_the_job() {
    let t0 = Instant::now();
    let loads = vec![vec![1.0, 2.0, 3.0, 4.0]; 2];
    let first = 1_795_696_379_753;
    let plan = plan_model(&loads, ClusterShape::new(3, 1, 3).unwrap(), &PlanPolicy::trainer(3, None), None).unwrap().with_epoch(first);
    let mut c = Controller::new(spec(4, 3), plan, vec![10, 11, 12], t0);
    for (i, n) in [10, 11, 12].into_iter().enumerate() {
        c.decide(t0, Event::Listening { node: n, epoch: first, addr: format!("a{i}") });
    }
    for n in [10, 11, 12] {
        c.decide(t0, Event::Ready { node: n, epoch: first });
    }
    c.decide(t0, Event::Exited { node: 12, status: "killed".into() });
    for n in [10, 11] {
        let report = StopReport { steps_done: 3, held: None, holds: c.planned_holdings(n).unwrap(), last: None, snapshots: vec![] };
        c.decide(t0, Event::StepFailed { node: n, epoch: first, report });
    }
    assert_eq!((c.epoch(), c.job_epoch(c.epoch())), (first + 1, 1));
    let notes: Vec<&String> = c.recent().collect();
    assert!(notes.iter().any(|n| n.starts_with("epoch 0: worker 12 lost")), "{notes:?}");
    assert!(notes.iter().any(|n| n.starts_with("epoch 1: reconfigure to 2 nodes")), "{notes:?}");
    assert!(notes.iter().all(|n| !n.contains(&first.to_string())), "{notes:?}");
}

mod at_scale;
mod joining;
mod lifecycle;
mod resume;
