//! Scale-up without a restart: two workers train; one of them is asked to pause, and both stop
//! after the same step (the request travels in that step's all-reduce); a third worker, standing
//! by with nothing of the job, joins: it takes the replicated state (non-expert weights, AdamW
//! moments, step, data cursor) from a peer and the expert states the scheduler's plan for three
//! nodes gives it from their holders. The run must match the single-process trainer step for
//! step (1e-4 relative) on every rank and end with the same parameters and data position.

mod common;
#[path = "common/moves.rs"]
mod moves;

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::time::Duration;

use lazarus_comm::{Group, TcpTransport, Transport};
use lazarus_model::Trainer;
use lazarus_plan::{plan_reconfiguration, Move, NodeState, RankTransfer};
use lazarus_runtime::{pause_signal, DispatchMode, Reconfiguration, Worker, WorkerOptions};
use moves::{config, plan_for, STEPS};

/// Rank 0 is asked to pause once it has committed this many steps; all stop one step later.
const ASK_AT: u64 = 3;

fn params(w: &Trainer) -> BTreeMap<String, Vec<f32>> {
    w.model
        .params()
        .iter()
        .filter(|(_, v)| v.elem_count() > 0)
        .map(|(n, v)| (n.to_string(), v.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect()
}

#[test]
fn a_worker_joins_at_a_pause_and_every_rank_goes_on_with_the_same_mathematics() {
    let mut reference = Trainer::new(config()).unwrap();
    let ref_losses: Vec<f64> = (0..STEPS).map(|_| reference.step().unwrap().loss).collect();

    let old = plan_for(2, None);
    let new = plan_for(3, Some(&old)).with_epoch(1);
    // The joiner holds nothing; the two old nodes what the old plan gave them.
    let mut live: Vec<NodeState> =
        (0..2).map(|r| NodeState { node: r as u64, experts: old.layers().iter().map(|p| p.nodes()[r].clone()).collect() }).collect();
    live.push(NodeState { node: 2, experts: vec![Vec::new(); old.layers().len()] });
    let rp = plan_reconfiguration(&live, new.layers(), &vec![1; new.layers().len()]).unwrap();
    assert!(rp.lost.is_empty());
    let new_rank = |p: u64| rp.plan_to_node.iter().position(|&n| n == p).unwrap();
    let transfers: Vec<RankTransfer> = rp
        .transfers
        .iter()
        .map(|t| RankTransfer { layer: t.layer, expert: t.expert, from: new_rank(t.from), to: new_rank(t.to) })
        .collect();
    let joiner = new_rank(2);
    assert!(transfers.iter().any(|t| t.to == joiner), "the joiner is given experts");
    let to = |node: u64| Reconfiguration {
        rank: new_rank(node),
        world: 3,
        change: Move { joining: vec![joiner], ..Move::new(1, new.replica_map(), transfers.clone()) },
    };
    let transports = TcpTransport::local_group(2, 0).unwrap();
    let mut fresh: Vec<Option<TcpTransport>> = TcpTransport::local_group(3, 1).unwrap().into_iter().map(Some).collect();
    let signal = pause_signal();
    let mut handles = Vec::new();
    for (rank, t) in transports.into_iter().enumerate() {
        let r = to(rank as u64);
        let next = fresh[r.rank].take().unwrap();
        let (signal, old) = (signal.clone(), old.clone());
        handles.push(std::thread::spawn(move || {
            let options = WorkerOptions {
                plan: old.replica_map(),
                mode: DispatchMode::Balanced,
                timeout: Duration::from_secs(20),
                device: candle_core::Device::Cpu,
            };
            let mut w = Worker::new(config(), options, rank, 2, None).unwrap();
            w.set_pause_signal(Some(signal.clone()));
            let (mut group, mut losses) = (Group::world(2), Vec::new());
            let mut transport: Box<dyn Transport> = Box::new(t);
            let mut next = Some(next);
            let mut paused_at = None;
            while !w.done() {
                if rank == 0 && w.steps_done() == ASK_AT {
                    signal.store(0, Ordering::Relaxed); // epoch 0: the current transport's
                }
                let s = w.step(transport.as_mut(), &mut group).unwrap();
                losses.push((s.report.step, s.report.loss));
                if s.pause {
                    assert!(paused_at.is_none(), "rank {rank}: one pause");
                    paused_at = Some(w.steps_done());
                    transport = Box::new(next.take().unwrap());
                    group = Group::world(3);
                    w.reconfigure(&r, transport.as_mut(), &mut group).unwrap();
                }
            }
            (losses, params(&w.trainer), w.trainer.sampler.cursor().windows, paused_at)
        }));
    }
    let r = to(2);
    let t = fresh[joiner].take().unwrap();
    handles.push(std::thread::spawn(move || {
        let mut w = Worker::standby(config(), DispatchMode::Balanced, Duration::from_secs(20), candle_core::Device::Cpu).unwrap();
        assert!(w.resident_experts().unwrap().iter().all(Vec::is_empty), "a worker standing by holds no expert");
        let mut transport: Box<dyn Transport> = Box::new(t);
        let mut group = Group::world(3);
        let moved = w.reconfigure(&r, transport.as_mut(), &mut group).unwrap();
        assert!(moved.bytes_received > 0);
        let joined_at = w.steps_done();
        let mut losses = Vec::new();
        while !w.done() {
            let s = w.step(transport.as_mut(), &mut group).unwrap();
            losses.push((s.report.step, s.report.loss));
        }
        // A snapshot's bytes, written straight from the tensors, are the expert's wire form.
        for (l, experts) in w.resident_experts().unwrap().iter().enumerate() {
            for &e in experts {
                assert_eq!(w.encode_expert(l, e).unwrap(), w.export_expert(l, e).unwrap().encode(), "layer {l} expert {e}");
            }
        }
        (losses, params(&w.trainer), w.trainer.sampler.cursor().windows, Some(joined_at))
    }));
    let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let ref_params = params(&reference);
    let mut covered = BTreeMap::new();
    for (i, (losses, held, windows, at)) in results.iter().enumerate() {
        assert_eq!(*at, Some(ASK_AT + 1), "worker {i}: every rank stops after the same step, and the joiner starts there");
        let first = if i == 2 { ASK_AT + 2 } else { 1 };
        assert_eq!(losses.iter().map(|l| l.0).collect::<Vec<_>>(), (first..=STEPS).collect::<Vec<_>>(), "worker {i}: every step once");
        for &(s, a) in losses {
            let b = ref_losses[s as usize - 1];
            assert!((a - b).abs() <= 1e-4 * b.abs(), "worker {i}: step {s} loss {a} vs single-process {b}");
        }
        assert_eq!(*windows, reference.sampler.cursor().windows, "worker {i}: the same windows of data");
        for (name, v) in held {
            let worst = v.iter().zip(&ref_params[name]).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
            assert!(worst <= 1e-4, "worker {i}: {name} differs by {worst}");
            covered.insert(name.clone(), ());
        }
    }
    assert_eq!(covered.len(), ref_params.len(), "every tensor is held by some worker");
}
