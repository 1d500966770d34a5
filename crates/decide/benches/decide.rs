//! The controller's decisions at cluster scale: 1,024 nodes × 8 workers, 58 MoE layers × 256
//! experts (DeepSeek-V3's shape), 4 replica slots a GPU, skewed loads.
//!
//! * `decide_1024x8/heartbeat`: one heartbeat of a running job (what the controller does
//!   8,192 times a heartbeat period).
//! * `decide_1024x8/node_loss`: a node lost whole — its 8 workers' exits, then every survivor's
//!   report of where it stopped (8,184 of them), the last of which brings the move: from the
//!   first exit to the `Reconfigure` command. Goal < 100 ms.
//! * (once, printed) a rebalance weighed after the loads drifted: the step report that brings
//!   the weighing and its verdict.
//! * `decide_1024x8/join_64_nodes`: 64 new nodes (512 workers) join: the pause, then every
//!   member's report, the last of which brings the move that takes them in.
//!
//! `cargo bench -p lazarus-decide --bench decide`

use std::time::{Duration, Instant};

use criterion::{black_box, criterion_group, criterion_main, BatchSize, Criterion};
use lazarus_decide::{Command, Controller, Event, JobSpec, NodeId, OnLoss, StepRecord, StopReport};
use lazarus_plan::{plan_model, ClusterShape, PlanPolicy};

const NODES: usize = 1024;
const GPUS: usize = 8;
const SLOTS: usize = 4;
const LAYERS: usize = 58;
const EXPERTS: usize = 256;

/// Step reports are never handed to this controller.
#[derive(Debug, Clone, PartialEq)]
enum NoRecord {}

impl StepRecord for NoRecord {
    fn step(&self) -> u64 {
        match *self {}
    }

    fn is_sound(&self) -> bool {
        match *self {}
    }
}

/// Zipf(1.0)-like loads, the experts in a different order per layer.
fn skewed_loads(layer: usize) -> Vec<f64> {
    let mut order: Vec<usize> = (0..EXPERTS).collect();
    let mut x = 0x1a2a_0000u64 + layer as u64;
    for i in (1..EXPERTS).rev() {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        order.swap(i, ((x >> 33) as usize) % (i + 1));
    }
    order.iter().map(|&k| 1e6 / (k + 1) as f64).collect()
}

/// A running job: planned, its rendezvous done, a few steps trained.
fn running_job(now: Instant, rebalance_every: u64) -> Controller<NoRecord> {
    let loads: Vec<Vec<f64>> = (0..LAYERS).map(skewed_loads).collect();
    let shape = ClusterShape::new(NODES, GPUS, SLOTS).expect("a shape");
    let policy = PlanPolicy::trainer_default(NODES);
    let plan = plan_model(&loads, shape, &policy, None).expect("a plan");
    let spec = JobSpec {
        layers: LAYERS,
        experts: EXPERTS,
        slots_per_node: GPUS * SLOTS,
        gpus_per_node: GPUS,
        policy,
        // A DeepSeek-V3 expert's training state: 44 M parameters (7168 × 2048 × 3) as bf16
        // weights, f32 master weights and two f32 moments, 14 bytes each.
        expert_bytes: 616 << 20,
        lease: Duration::from_secs(3600),
        join_wait: Duration::ZERO,
        join_rule: lazarus_decide::JoinRule::AfterWait,
        rebalance_every,
        total_steps: 1_000_000,
        on_loss: OnLoss::Recover,
        start_within: Duration::MAX,
    };
    let ranks: Vec<NodeId> = (0..(NODES * GPUS) as u64).collect();
    let mut ctl = Controller::new(spec, plan, ranks.clone(), now);
    let epoch = ctl.epoch();
    for (i, &node) in ranks.iter().enumerate() {
        ctl.decide(now, Event::Listening { node, epoch, addr: format!("10.0.{}.{}:7000", i / 256, i % 256) });
    }
    for &node in &ranks {
        ctl.decide(now, Event::Ready { node, epoch });
    }
    assert!(ctl.running(), "the job runs");
    // The load monitor has seen the loads the plan was made from (as after a few steps).
    let measured: Vec<Vec<u64>> = loads.iter().map(|l| l.iter().map(|&x| x as u64).collect()).collect();
    // (A rebalance due now is weighed at once: the loads are the plan's, so it is skipped.)
    ctl.decide_inline(now, Event::StepDone { epoch, step: 1, steps: 1, loads: measured, seconds: 1.0, moved: None });
    ctl
}

/// The node lost: its workers.
const LOST: std::ops::Range<u64> = (37 * GPUS) as u64..(38 * GPUS) as u64;

/// What every survivor of the lost node will report: where it stopped and what it holds (the
/// workers' side, made before the clock starts).
fn reports(ctl: &Controller<NoRecord>) -> Vec<(NodeId, StopReport<NoRecord>)> {
    ctl.ranks()
        .iter()
        .copied()
        .filter(|w| !LOST.contains(w))
        .map(|w| {
            let holds = ctl.planned_holdings(w).unwrap_or_default();
            (w, StopReport { steps_done: 100, held: None, holds, last: None, snapshots: Vec::new() })
        })
        .collect()
}

/// Lose the node whole and let every survivor report: the commands of the last report.
fn lose_a_node(ctl: &mut Controller<NoRecord>, reports: Vec<(NodeId, StopReport<NoRecord>)>, now: Instant) -> Vec<Command<NoRecord>> {
    for w in LOST {
        ctl.decide(now, Event::Exited { node: w, status: "SIGKILL".into() });
    }
    let epoch = ctl.epoch();
    let mut last = Vec::new();
    for (w, report) in reports {
        last = ctl.decide(now, Event::StepFailed { node: w, epoch, report });
    }
    last
}

/// 64 new nodes' workers (ids after the job's).
fn joiners() -> Vec<Vec<NodeId>> {
    let first = (NODES * GPUS) as u64;
    (0..64u64).map(|n| (first + n * GPUS as u64..first + (n + 1) * GPUS as u64).collect()).collect()
}

/// 64 nodes join; once the controller pauses the job, every member reports where it stopped:
/// the commands of the last report.
fn join_64_nodes(ctl: &mut Controller<NoRecord>, reports: Vec<(NodeId, StopReport<NoRecord>)>, now: Instant) -> Vec<Command<NoRecord>> {
    let mut out = Vec::new();
    for workers in joiners() {
        out.extend(ctl.decide(now, Event::Joined { workers }));
    }
    out.extend(ctl.decide(now, Event::Tick));
    assert!(out.iter().any(|c| matches!(c, Command::Pause { .. })), "the joiners are taken in at once: {out:?}");
    let epoch = ctl.epoch();
    let mut last = Vec::new();
    for (w, report) in reports {
        last = ctl.decide(now, Event::StepFailed { node: w, epoch, report });
    }
    last
}

/// Every member's report of where it stopped (the workers' side, made before the clock starts).
fn all_reports(ctl: &Controller<NoRecord>) -> Vec<(NodeId, StopReport<NoRecord>)> {
    ctl.ranks()
        .iter()
        .map(|&w| {
            (
                w,
                StopReport {
                    steps_done: 100,
                    held: None,
                    holds: ctl.planned_holdings(w).unwrap_or_default(),
                    last: None,
                    snapshots: Vec::new(),
                },
            )
        })
        .collect()
}

/// One more survivor's report.
fn lose_a_node_report(ctl: &mut Controller<NoRecord>, (w, report): (NodeId, StopReport<NoRecord>), now: Instant) -> Vec<Command<NoRecord>> {
    let epoch = ctl.epoch();
    ctl.decide(now, Event::StepFailed { node: w, epoch, report })
}

fn bench(c: &mut Criterion) {
    let now = Instant::now();
    let job = running_job(now, 0);
    // Once, outside the timing: the loss is decided with a move.
    let said = reports(&job);
    // Once, outside criterion: where the time goes (every report but the last is bookkeeping;
    // the last one brings the new plan and its transfers).
    let mut probe = job.clone();
    let (others, last) = said.split_at(said.len() - 1);
    let t = Instant::now();
    lose_a_node(&mut probe, others.to_vec(), now);
    let before_last = t.elapsed();
    let out = lose_a_node_report(&mut probe, last[0].clone(), now);
    eprintln!(
        "a node loss: the exits and {} reports {:.1} ms, the last report (the decision) {:.1} ms",
        others.len(),
        before_last.as_secs_f64() * 1e3,
        (t.elapsed() - before_last).as_secs_f64() * 1e3
    );
    let Some(Command::Reconfigure(m)) = out.iter().find(|c| matches!(c, Command::Reconfigure(_))) else {
        panic!("a node loss brings a move")
    };
    // What each worker is sent of the move's plan: the map whole, or the change from the one
    // it has (the ranks renumbered, the experts whose holders changed).
    let whole = serde_json::to_vec(&m.change.plan).map_or(0, |v| v.len());
    let old_map = job.plan().expect("a plan").replica_map();
    let renumber: Vec<Option<usize>> = job.ranks().iter().map(|w| m.ranks.iter().position(|x| x == w)).collect();
    let change = old_map.change_to(&m.change.plan, renumber).expect("a change");
    let changed = serde_json::to_vec(&change).map_or(0, |v| v.len());
    eprintln!(
        "the move's replica map, as sent to each of its {} workers: {:.1} MB of JSON whole, {:.3} MB as the change from the map they have ({} experts changed)",
        m.ranks.len(),
        whole as f64 / 1e6,
        changed as f64 / 1e6,
        change.changed.len()
    );
    let replicas = (NODES - 1) * GPUS * SLOTS * LAYERS;
    eprintln!(
        "the move: {} expert states sent of {replicas} replicas ({:.2}%; the lost node held {})",
        m.change.transfers.len(),
        100.0 * m.change.transfers.len() as f64 / replicas as f64,
        GPUS * SLOTS * LAYERS
    );
    let everyone = all_reports(&job);
    let mut probe = job.clone();
    let t = Instant::now();
    let out = join_64_nodes(&mut probe, everyone.clone(), now);
    let Some(Command::Reconfigure(m)) = out.iter().find(|c| matches!(c, Command::Reconfigure(_))) else {
        panic!("a join brings a move: {out:?}")
    };
    eprintln!(
        "a join of 64 nodes: {:.1} ms from the joins to the move, {} expert states sent (the joiners' slots: {})",
        t.elapsed().as_secs_f64() * 1e3,
        m.change.transfers.len(),
        64 * GPUS * SLOTS * LAYERS
    );
    // What a worker is sent of a move: the replica map alone, as JSON (every rank needs all of
    // it to route tokens).
    let mut rebalancing = running_job(now, 1);
    // The loads drift: each layer's hottest experts become its coldest.
    let drifted: Vec<Vec<u64>> = (0..LAYERS).map(|l| skewed_loads(l).iter().rev().map(|&x| x as u64).collect()).collect();
    let epoch = rebalancing.epoch();
    let t = Instant::now();
    // (Weighed at once here: the controller's loop weighs it on a thread of its own.)
    let out = rebalancing.decide_inline(now, Event::StepDone { epoch, step: 2, steps: 1, loads: drifted, seconds: 1.0, moved: None });
    let verdict = out.iter().find_map(|c| match c {
        Command::Rebalance(d) => Some(format!(
            "{} (gain {:.1} s, cost {:.1} s; {} expert states to move, imbalance {:.3} → {:.3})",
            d.decision, d.gain_s, d.cost_s, d.transfers, d.imbalance_before, d.imbalance_after
        )),
        _ => None,
    });
    eprintln!("a rebalance weighed: {:.1} ms, {}", t.elapsed().as_secs_f64() * 1e3, verdict.unwrap_or_else(|| "none".into()));
    let mut g = c.benchmark_group("decide_1024x8");
    g.sample_size(10);
    g.bench_function("heartbeat", |b| {
        let mut ctl = job.clone();
        let mut node = 0u64;
        b.iter(|| {
            node = (node + 1) % (NODES * GPUS) as u64;
            black_box(ctl.decide(now, Event::Heartbeat { node }))
        })
    });
    g.bench_function("node_loss", |b| {
        b.iter_batched(|| (job.clone(), said.clone()), |(mut ctl, said)| black_box(lose_a_node(&mut ctl, said, now)), BatchSize::LargeInput)
    });
    g.bench_function("join_64_nodes", |b| {
        b.iter_batched(
            || (job.clone(), everyone.clone()),
            |(mut ctl, said)| black_box(join_64_nodes(&mut ctl, said, now)),
            BatchSize::LargeInput,
        )
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
