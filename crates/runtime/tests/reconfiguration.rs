//! Recovery without a restart: three workers train; one dies in the middle of a step; the two
//! survivors drop the step, move to a plan for two nodes made by the scheduler (fetching the
//! expert states — weights and AdamW moments — their new placement needs from each other, as
//! `plan_reconfiguration` assigns them), and run the same step again over the same global
//! batch. The run must match the single-process trainer step for step (1e-4 relative) and end
//! with the same parameters, having consumed exactly the same windows of data.

mod common;
#[path = "common/moves.rs"]
mod moves;

use std::collections::BTreeMap;
use std::time::Duration;

use lazarus_comm::{Group, TcpTransport, Transport};
use lazarus_model::Trainer;
use lazarus_plan::{plan_reconfiguration, ModelPlan, Move, NodeState, RankTransfer};
use lazarus_runtime::{DispatchMode, Reconfiguration, Worker, WorkerOptions};
use moves::{config, plan_for, STEPS};

/// Steps committed before rank `DEAD` dies in the next one.
const FAIL_AT: u64 = 3;
const DEAD: usize = 2;

/// What the controller will compute: the survivors (old ranks) mapped onto the new plan's nodes,
/// and the state transfers between them, in new ranks.
fn reconfiguration(old: &ModelPlan, survivors: &[usize]) -> (ModelPlan, Vec<(usize, usize)>, Vec<RankTransfer>) {
    assert!(old.survives(&[DEAD]), "the test needs a failure every expert survives");
    let new = plan_for(survivors.len(), Some(old)).with_epoch(1);
    let live: Vec<NodeState> = survivors
        .iter()
        .map(|&r| NodeState { node: r as u64, experts: old.layers().iter().map(|p| p.nodes()[r].clone()).collect() })
        .collect();
    let rp = plan_reconfiguration(&live, new.layers(), &vec![1; new.layers().len()]).unwrap();
    assert!(rp.lost.is_empty());
    // Old rank → new rank: physical node p takes plan node q.
    let new_rank: Vec<(usize, usize)> = rp.plan_to_node.iter().enumerate().map(|(q, &p)| (p as usize, q)).collect();
    let to_new = |p: u64| new_rank.iter().find(|(o, _)| *o == p as usize).unwrap().1;
    let transfers =
        rp.transfers.iter().map(|t| RankTransfer { layer: t.layer, expert: t.expert, from: to_new(t.from), to: to_new(t.to) }).collect();
    (new, new_rank, transfers)
}

#[test]
fn survivors_of_a_dead_worker_go_on_with_the_same_mathematics() {
    let mut reference = Trainer::new(config()).unwrap();
    let ref_losses: Vec<f64> = (0..STEPS).map(|_| reference.step().unwrap().loss).collect();

    let old = plan_for(3, None);
    let (new, new_rank, transfers) = reconfiguration(&old, &[0, 1]);
    assert!(!transfers.is_empty(), "the new plan should move some expert (the test wants transfers)");
    let transports = TcpTransport::local_group(3, 0).unwrap();
    let mut spares: Vec<Option<TcpTransport>> = TcpTransport::local_group(2, 1).unwrap().into_iter().map(Some).collect();
    let handles: Vec<_> = transports
        .into_iter()
        .enumerate()
        .map(|(rank, t)| {
            let options = WorkerOptions {
                plan: old.replica_map(),
                mode: DispatchMode::Balanced,
                timeout: Duration::from_secs(20),
                device: candle_core::Device::Cpu,
            };
            let next = new_rank.iter().find(|(o, _)| *o == rank).map(|&(_, q)| {
                let r = Reconfiguration { rank: q, world: 2, change: Move::new(1, new.replica_map(), transfers.clone()) };
                (r, spares[q].take().unwrap())
            });
            std::thread::spawn(move || {
                let mut w = Worker::new(config(), options, rank, 3, None).unwrap();
                let mut group = Group::world(3);
                let mut losses = Vec::new();
                let mut next = next;
                let mut transport: Box<dyn Transport> = Box::new(t);
                while !w.done() {
                    if w.steps_done() == FAIL_AT && rank == DEAD {
                        return None; // dies: its connections close with the thread
                    }
                    match w.step(transport.as_mut(), &mut group) {
                        Ok(r) => losses.push(r.report.loss),
                        Err(e) => {
                            // The dead rank committed the failure step, so every rank computed
                            // it; a survivor that heard of the loss from a peer before its own
                            // commit vote ended holds it, and commits it as the controller's
                            // `commit_to` tells it in a job.
                            if w.held_step() == Some(FAIL_AT) {
                                if let Some(r) = w.commit_held().unwrap() {
                                    losses.push(r.report.loss);
                                }
                            }
                            assert_eq!(w.steps_done(), FAIL_AT, "rank {rank}: {e}");
                            w.drop_held();
                            let (r, fresh) = next.take().expect("one failure");
                            transport = Box::new(fresh);
                            group = Group::world(r.world);
                            let moved = w.reconfigure(&r, transport.as_mut(), &mut group).unwrap();
                            eprintln!(
                                "rank {rank} -> {}: sent {} and received {} experts",
                                r.rank, moved.experts_sent, moved.experts_received
                            );
                        }
                    }
                }
                let held = w
                    .trainer
                    .model
                    .params()
                    .iter()
                    .filter(|(_, v)| v.elem_count() > 0)
                    .map(|(n, v)| (n.to_string(), v.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap()))
                    .collect::<BTreeMap<_, _>>();
                Some((losses, held, w.trainer.sampler.cursor().windows, w.rank()))
            })
        })
        .collect();
    let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert!(results[DEAD].is_none());
    let ref_params: BTreeMap<String, Vec<f32>> = reference
        .model
        .params()
        .iter()
        .map(|(n, v)| (n.to_string(), v.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect();
    let mut covered = BTreeMap::new();
    for (old_rank, r) in results.iter().enumerate() {
        let Some((losses, held, windows, new_rank)) = r else { continue };
        assert_eq!(losses.len(), STEPS as usize, "rank {old_rank}: every step once");
        for (s, (a, b)) in losses.iter().zip(&ref_losses).enumerate() {
            assert!((a - b).abs() <= 1e-4 * b.abs(), "rank {old_rank}: step {} loss {a} vs single-process {b}", s + 1);
        }
        assert_eq!(*windows, reference.sampler.cursor().windows, "the same windows of data, none skipped or repeated");
        for (name, v) in held {
            let worst = v.iter().zip(&ref_params[name]).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
            assert!(worst <= 1e-4, "rank {old_rank} (now {new_rank}): {name} differs by {worst}");
            covered.insert(name.clone(), ());
        }
    }
    assert_eq!(covered.len(), ref_params.len(), "every tensor is held by a survivor");
}
