//! A loss on a cluster past the exact search's size: the running plan is repaired, not made
//! afresh, so what moves is about what the lost node held.

use super::*;

const NODES: usize = 20;
const GPUS: usize = 2;
const SLOTS: usize = 2;
const EXPERTS: usize = 16;

/// A running job of 20 nodes × 2 workers under `policy`, its load monitor fed the loads the
/// plan was made from.
fn job(policy: PlanPolicy, t0: Instant) -> Controller {
    let loads: Vec<Vec<f64>> = (0..2).map(|l| (0..EXPERTS).map(|e| ((e * 7 + l * 3) % EXPERTS + 1) as f64).collect()).collect();
    let plan = plan_model(&loads, ClusterShape::new(NODES, GPUS, SLOTS).unwrap(), &policy, None).unwrap();
    let spec = JobSpec { gpus_per_node: GPUS, slots_per_node: GPUS * SLOTS, policy, ..spec(EXPERTS, GPUS * SLOTS) };
    let workers: Vec<NodeId> = (0..(NODES * GPUS) as u64).collect();
    let mut c = Controller::new(spec, plan, workers.clone(), t0);
    start(&mut c, &workers, t0);
    let measured = loads.iter().map(|l| l.iter().map(|&x| x as u64).collect()).collect();
    c.decide(t0, Event::StepDone { epoch: 0, step: 1, steps: 1, loads: measured, seconds: 1.0, moved: None });
    c
}

/// Node 7 (workers 14 and 15) is lost; every survivor reports what it holds. The move, and what
/// each rank holds before it.
fn lose_node_7(c: &mut Controller, t0: Instant) -> (MoveDecision, Vec<Vec<Vec<usize>>>) {
    let before: BTreeMap<NodeId, Vec<Vec<usize>>> = c.ranks().iter().map(|&w| (w, c.planned_holdings(w).unwrap())).collect();
    c.decide(t0, Event::Exited { node: 14, status: "killed by signal 9".into() });
    let mut out = Vec::new();
    for (&w, holds) in before.iter().filter(|(w, _)| !(14..16).contains(*w)) {
        let report = StopReport { steps_done: 1, held: None, holds: holds.clone(), last: None, snapshots: vec![] };
        out = c.decide(t0, Event::StepFailed { node: w, epoch: 0, report });
    }
    let [Command::Reconfigure(m)] = &out[..] else { panic!("no expert lost every replica: {out:?}") };
    let held = m.ranks.iter().map(|w| before[w].clone()).collect();
    (m.clone(), held)
}

/// After the move's transfers every rank holds what the new plan places on it.
fn assert_complete(m: &MoveDecision, mut held: Vec<Vec<Vec<usize>>>) {
    for t in &m.change.transfers {
        assert!(held[t.from][t.layer].contains(&t.expert), "{t:?} from a rank without it");
        held[t.to][t.layer].push(t.expert);
    }
    for (r, h) in held.iter().enumerate() {
        for l in 0..m.change.plan.layer_count() {
            for e in 0..EXPERTS {
                assert!(m.change.plan.replicas_on(l, e, r) == 0 || h[l].contains(&e), "rank {r} lacks expert {e} of layer {l}");
            }
        }
    }
}

#[test]
fn a_node_lost_among_many_costs_about_what_it_held_not_a_new_layout() {
    let t0 = Instant::now();
    let repairing = PlanPolicy::trainer(NODES, None);
    assert!(repairing.keep_survivors);
    let (repaired, held) = lose_node_7(&mut job(repairing, t0), t0);
    assert_complete(&repaired, held);
    // The lost node held 2 layers × 4 slots; nothing else needs to move.
    let lost_held = 2 * GPUS * SLOTS;
    assert!(repaired.change.transfers.len() <= lost_held, "{} transfers: {:?}", repaired.change.transfers.len(), repaired.change.transfers);
    // Every survivor keeps its place: ranks in the running plan's order, node 7's left out.
    let expect: Vec<NodeId> = (0..(NODES * GPUS) as u64).filter(|w| !(14..16).contains(w)).collect();
    assert_eq!(repaired.ranks, expect);

    // The same loss planned afresh (the paper's way) moves far more.
    let afresh = PlanPolicy { keep_survivors: false, ..repairing };
    let (fresh, held) = lose_node_7(&mut job(afresh, t0), t0);
    assert_complete(&fresh, held);
    assert!(
        fresh.change.transfers.len() > 2 * repaired.change.transfers.len(),
        "afresh {} vs repaired {}",
        fresh.change.transfers.len(),
        repaired.change.transfers.len()
    );
}
