//! A step that fails is dropped whole: a rank's connections are cut after its n-th send of a
//! step — in the forward dispatch, the backward, the gradient all-reduce or the commit vote —
//! and every rank must report the failure with its parameters, optimizer state, data cursor and
//! step counter bit-identical to before the step. Re-running the step on a new transport (the
//! next epoch) must then give exactly, bit for bit, what an uninterrupted run gives.

mod common;

use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use lazarus_comm::{CommError, Group, TcpTransport, Transport};
use lazarus_model::TrainConfig;
use lazarus_plan::ReplicaMap;
use lazarus_runtime::{DispatchMode, Worker, WorkerOptions};

const WORLD: usize = 3;
const STEPS: u64 = 5;
/// The step that fails (after this many committed steps).
const FAIL_AT: u64 = 2;

fn config() -> TrainConfig {
    common::tiny_config(2, STEPS, 6, 9, (4, 30_000))
}

/// Expert e on ranks e and e+1 (mod 3), expert 0 twice on rank 0.
fn plan() -> ReplicaMap {
    let layer: Vec<Vec<u32>> = (0..4)
        .map(|e| {
            let mut row = vec![0u32; WORLD];
            row[e % WORLD] += 1;
            row[(e + 1) % WORLD] += 1;
            if e == 0 {
                row[0] += 1;
            }
            row
        })
        .collect();
    ReplicaMap::new(0, vec![layer; 2]).unwrap()
}

/// A transport whose connections are cut (as a crash would) at its `limit`-th send.
struct CutAfter {
    inner: TcpTransport,
    sends: usize,
    limit: Option<usize>,
}

impl Transport for CutAfter {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world(&self) -> usize {
        self.inner.world()
    }
    fn epoch(&self) -> u64 {
        self.inner.epoch()
    }
    fn send(&mut self, peer: usize, tag: u64, payload: &[u8], deadline: Instant) -> Result<(), CommError> {
        self.sends += 1;
        if self.limit.is_some_and(|l| self.sends >= l) {
            self.inner.abort_connections();
            return Err(CommError::PeerLost { peer, reason: "connections cut by the test".into() });
        }
        self.inner.send(peer, tag, payload, deadline)
    }
    fn recv(&mut self, peer: usize, tag: u64, deadline: Instant) -> Result<Vec<u8>, CommError> {
        self.inner.recv(peer, tag, deadline)
    }
}

/// AdamW m, v (as bits) and step of one tensor.
type Moments = (Vec<u32>, Vec<u32>, u64);

/// Everything of a worker that must survive an abandoned step unchanged, bit for bit.
#[derive(PartialEq)]
struct Durable {
    step: u64,
    cursor: u64,
    params: Vec<(String, Vec<u32>)>,
    moments: Vec<Option<Moments>>,
}

/// The first difference between two states, named (the states are too large to print).
fn difference(a: &Durable, b: &Durable) -> Option<String> {
    if (a.step, a.cursor) != (b.step, b.cursor) {
        return Some(format!("step/cursor {}/{} vs {}/{}", a.step, a.cursor, b.step, b.cursor));
    }
    if let Some((x, _)) = a.params.iter().zip(&b.params).find(|(x, y)| x != y) {
        return Some(format!("parameter {}", x.0));
    }
    a.moments.iter().zip(&b.moments).position(|(x, y)| x != y).map(|i| format!("optimizer state of tensor {i}"))
}

fn durable(w: &Worker) -> Durable {
    let t = &w.trainer;
    let bits =
        |x: &candle_core::Tensor| -> Vec<u32> { x.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|f| f.to_bits()).collect() };
    Durable {
        step: t.step,
        cursor: t.sampler.cursor().windows,
        params: t.model.params().iter().map(|(n, v)| (n.to_string(), bits(v.as_tensor()))).collect(),
        moments: (0..t.optimizer.len()).map(|i| t.optimizer.state(i).ok().map(|s| (bits(&s.m), bits(&s.v), s.step))).collect(),
    }
}

fn options() -> WorkerOptions {
    WorkerOptions { plan: plan(), mode: DispatchMode::Balanced, timeout: Duration::from_secs(20), device: candle_core::Device::Cpu }
}

/// How one run went: each rank's per-step losses and final state, the sends rank `victim` made in
/// the failing step when nothing failed, and how many ranks committed a held step.
struct Outcome {
    losses: Vec<Vec<f64>>,
    states: Vec<Durable>,
    sends: usize,
    held_commits: usize,
}

/// Run every step on `WORLD` ranks; at step `FAIL_AT + 1`, rank `victim`'s connections are cut
/// at its `limit`-th send of the step (None: no failure). After a failure the ranks do what the
/// controller will: meet, take the furthest committed step (a rank behind it holds that step,
/// computed, and commits it; the others drop what they hold), and go on over the next epoch's
/// transport.
fn run(victim: usize, limit: Option<usize>) -> Outcome {
    let transports = TcpTransport::local_group(WORLD, 0).unwrap();
    let spares = TcpTransport::local_group(WORLD, 1).unwrap();
    let meeting = Arc::new((Barrier::new(WORLD), Mutex::new(vec![0u64; WORLD])));
    let handles: Vec<_> = transports
        .into_iter()
        .zip(spares)
        .enumerate()
        .map(|(rank, (inner, spare))| {
            let meeting = meeting.clone();
            std::thread::spawn(move || {
                let mut w = Worker::new(config(), options(), rank, WORLD, None).unwrap();
                let mut t = CutAfter { inner, sends: 0, limit: None };
                let mut spare = Some(spare);
                let mut group = Group::world(WORLD);
                let (mut losses, mut sends_in_step, mut held_commits) = (Vec::new(), 0, 0);
                while !w.done() {
                    let failing = w.steps_done() == FAIL_AT && spare.is_some();
                    if failing && rank == victim {
                        t.sends = 0;
                        t.limit = limit;
                    }
                    let before = durable(&w);
                    match w.step(&mut t, &mut group) {
                        Ok(r) => {
                            if failing {
                                sends_in_step = t.sends;
                            }
                            losses.push(r.report.loss);
                        }
                        Err(e) => {
                            assert!(limit.is_some(), "rank {rank}: unexpected failure {e}");
                            if let Some(d) = difference(&durable(&w), &before) {
                                panic!("rank {rank}: the failed step changed durable state: {d} ({e})");
                            }
                            let (barrier, done) = &*meeting;
                            done.lock().unwrap()[rank] = w.steps_done();
                            barrier.wait();
                            let furthest = *done.lock().unwrap().iter().max().unwrap();
                            if w.steps_done() < furthest {
                                assert_eq!(w.held_step(), Some(furthest), "rank {rank} is behind and must hold the step");
                                losses.push(w.commit_held().unwrap().unwrap().report.loss);
                                held_commits += 1;
                            } else {
                                w.drop_held();
                            }
                            assert_eq!(w.steps_done(), furthest);
                            barrier.wait();
                            // The next epoch's transport; the step re-runs on the same batch.
                            t = CutAfter { inner: spare.take().expect("one failure per run"), sends: 0, limit: None };
                            group = Group::world(WORLD);
                        }
                    }
                }
                (losses, durable(&w), sends_in_step, held_commits)
            })
        })
        .collect();
    let mut out = Outcome { losses: Vec::new(), states: Vec::new(), sends: 0, held_commits: 0 };
    for (rank, h) in handles.into_iter().enumerate() {
        let (l, d, s, c) = h.join().unwrap();
        out.losses.push(l);
        out.states.push(d);
        out.held_commits += c;
        if rank == victim {
            out.sends = s;
        }
    }
    out
}

#[test]
fn a_step_cut_anywhere_changes_nothing_and_its_re_run_is_bit_identical() {
    let clean = run(1, None);
    let sends = clean.sends;
    assert!(sends >= 6, "rank 1 sends {sends} messages per step");
    // Points across the step: the first dispatch, the middle of forward and backward, the last
    // sends (gradient all-reduce and the commit vote).
    let mut points = vec![1, 2, sends / 3, sends / 2, 2 * sends / 3, sends - 2, sends - 1, sends];
    points.sort_unstable();
    points.dedup();
    let mut raced = 0;
    for limit in points {
        let cut = run(1, Some(limit));
        assert_eq!(cut.losses, clean.losses, "cut at send {limit} of {sends}: the losses differ from an uninterrupted run");
        for (rank, (a, b)) in cut.states.iter().zip(&clean.states).enumerate() {
            if let Some(d) = difference(a, b) {
                panic!("cut at send {limit} of {sends}: rank {rank}'s final state differs from an uninterrupted run: {d}");
            }
        }
        raced += usize::from(cut.held_commits > 0);
    }
    // Cut in the commit vote, a rank that got every vote before it saw the loss commits while
    // the others hold the step (timing decides whether that happens here; the next test makes
    // it happen).
    eprintln!("cut points where a rank committed and others held the step: {raced}");
}

#[test]
fn a_held_step_committed_later_gives_the_same_state() {
    // Every rank computes the step; rank 0 commits at once, ranks 1 and 2 only after a further
    // exchange on the transport — as ranks do when the controller resolves a failed vote.
    let clean = run(1, None);
    let transports = TcpTransport::local_group(WORLD, 0).unwrap();
    let handles: Vec<_> = transports
        .into_iter()
        .enumerate()
        .map(|(rank, mut t)| {
            std::thread::spawn(move || {
                let mut w = Worker::new(config(), options(), rank, WORLD, None).unwrap();
                let mut group = Group::world(WORLD);
                let mut losses = Vec::new();
                while !w.done() {
                    let pending = w.compute(&mut t, &mut group).unwrap();
                    assert_eq!(pending.step(), w.steps_done() + 1);
                    if rank == 0 {
                        losses.push(w.commit(pending.clone()).unwrap().report.loss);
                        assert!(w.commit(pending).is_err(), "a step commits once");
                        lazarus_comm::barrier(&mut t, &mut group, Duration::from_secs(20)).unwrap();
                    } else {
                        lazarus_comm::barrier(&mut t, &mut group, Duration::from_secs(20)).unwrap();
                        losses.push(w.commit(pending).unwrap().report.loss);
                    }
                }
                (losses, durable(&w))
            })
        })
        .collect();
    for (rank, h) in handles.into_iter().enumerate() {
        let (losses, state) = h.join().unwrap();
        assert_eq!(losses, clean.losses[rank]);
        assert!(difference(&state, &clean.states[rank]).is_none(), "rank {rank}: {:?}", difference(&state, &clean.states[rank]));
    }
}
