//! Workers on a GPU, in one process: two workers share one GPU (their model, experts and AdamW
//! state in its memory), train, and move their experts to each other and back five times. Every
//! step's loss is the single-GPU trainer's (1e-4 relative), and the GPU's memory in use after
//! each move is what it was after the first: moves leave nothing behind on the device. Skipped,
//! with the reason, where no GPU can be opened.

mod common;

use std::sync::{Arc, Barrier};
use std::time::Duration;

use lazarus_comm::{Group, TcpTransport, Transport};
use lazarus_model::{TrainConfig, Trainer};
use lazarus_plan::{Move, RankTransfer, ReplicaMap};
use lazarus_runtime::{DispatchMode, Reconfiguration, Worker, WorkerOptions};

const MOVES: u64 = 5;
const STEPS: u64 = 2 * (MOVES + 1);

fn config() -> TrainConfig {
    common::tiny_config(2, STEPS, 6, 21, (7, 30_000))
}

/// Experts 0 and 1 on rank `a`, 2 and 3 on the other, in every layer.
fn plan(epoch: u64, a: usize) -> ReplicaMap {
    let row = |e: usize| if (e < 2) == (a == 0) { vec![1, 0] } else { vec![0, 1] };
    ReplicaMap::new(epoch, vec![(0..4).map(row).collect(); config().model.moe_layers()]).unwrap()
}

#[test]
fn two_workers_on_one_gpu_swap_their_experts_five_times_without_growing_its_memory() {
    let gpu = match lazarus_model::device::parse("cuda:0") {
        Ok(d) => d,
        Err(e) => return eprintln!("skipped (no GPU): {e}"),
    };
    let mut reference = Trainer::new_on(config(), &gpu).unwrap();
    let want: Vec<f64> = (0..STEPS).map(|_| reference.step().unwrap().loss).collect();
    drop(reference);
    let layers = config().model.moe_layers();
    // Every move sends every expert to the other rank: in the move to epoch e, experts 0 and 1
    // leave rank (e − 1) mod 2.
    let transfers = move |epoch: usize| -> Vec<RankTransfer> {
        (0..layers)
            .flat_map(|layer| (0..4).map(move |expert| (layer, expert)))
            .map(|(layer, expert)| {
                let low = (epoch - 1) % 2;
                let from = if expert < 2 { low } else { 1 - low };
                RankTransfer { layer, expert, from, to: 1 - from }
            })
            .collect()
    };
    let mut transports: Vec<Vec<Option<TcpTransport>>> =
        (0..=MOVES).map(|epoch| TcpTransport::local_group(2, epoch).unwrap().into_iter().map(Some).collect()).collect();
    let barrier = Arc::new(Barrier::new(2));
    let handles: Vec<_> = (0..2)
        .map(|rank| {
            let mine: Vec<TcpTransport> = transports.iter_mut().map(|t| t[rank].take().unwrap()).collect();
            let (barrier, gpu) = (barrier.clone(), gpu.clone());
            std::thread::spawn(move || {
                let options =
                    WorkerOptions { plan: plan(0, 0), mode: DispatchMode::Balanced, timeout: Duration::from_secs(60), device: gpu.clone() };
                let mut w = Worker::new(config(), options, rank, 2, None).unwrap();
                let mut group = Group::world(2);
                let (mut losses, mut used) = (Vec::new(), Vec::new());
                for (epoch, mut t) in mine.into_iter().enumerate() {
                    if epoch > 0 {
                        let r = Reconfiguration {
                            rank,
                            world: 2,
                            change: Move::new(epoch as u64, plan(epoch as u64, epoch % 2), transfers(epoch)),
                        };
                        group = Group::world(2);
                        let moved = w.reconfigure(&r, &mut t as &mut dyn Transport, &mut group).unwrap();
                        assert_eq!(moved.experts_received, 2 * layers, "rank {rank} receives the other's experts");
                        gpu.synchronize().unwrap();
                        barrier.wait();
                        if rank == 0 {
                            used.push(lazarus_model::device::gpu_memory(&gpu).expect("the pool's counters").used);
                        }
                        barrier.wait();
                    }
                    for _ in 0..2 {
                        losses.push(w.step(&mut t, &mut group).unwrap().report.loss);
                    }
                }
                (losses, used)
            })
        })
        .collect();
    let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    for (rank, (losses, _)) in results.iter().enumerate() {
        assert_eq!(losses.len(), STEPS as usize);
        for (s, (a, b)) in losses.iter().zip(&want).enumerate() {
            assert!((a - b).abs() <= 1e-4 * b.abs(), "rank {rank}: step {} loss {a} vs one GPU {b}", s + 1);
        }
    }
    let used = &results[0].1;
    eprintln!("GPU memory in use after each move: {used:?}");
    assert_eq!(used.len(), MOVES as usize);
    let (first, worst) = (used[0], used.iter().copied().max().unwrap());
    assert!(worst <= first + (4 << 20), "memory in use grew across moves: {used:?}");
}
