//! The snapshot tier (MoEtion §4, PEC §3; docs/architecture.md, snapshots): after each committed step,
//! the experts [`select_snapshots`] picks are copied — weights and AdamW state — into the memory
//! of a worker on *another* node, so that a failure that takes every replica of an expert can
//! restore it from there instead of rolling the whole job back.
//!
//! * Every rank computes the same selection from the step's global token counts and the plan,
//!   so senders and receivers agree without a message. The lowest rank holding an expert sends
//!   it to the rank with the same local index on the next node.
//! * A snapshot sent after step s is received after step s + 1: its bytes travel while the next
//!   step computes, and the receiver takes them from its inbox (the transport's reader threads
//!   already hold them) — the send overlaps the next step instead of stalling this one. A
//!   failure in between loses that one step's snapshots; the older ones are kept.
//! * Even the copy into the frame leaves the training thread: the transport's copy thread runs
//!   it ([`Worker::expert_encoder`]) while the next step computes, and the next commit, which
//!   changes the weights in place, first waits for it ([`CopyFence`]). Frame buffers are used
//!   again on both sides (a replaced snapshot's buffer goes back to the transport).
//! * Experts whose replicas sit on two or more nodes are skipped (Lazarus's own protection);
//!   MoEtion's selection over the same budget is computed beside it and its bytes reported.
//! * The budget is the given bandwidth times the mean step time, or by default what the last
//!   round's measured cost allows under that ceiling ([`SnapshotPace`]): the transport's CPU
//!   time on snapshot frames and whether it had them all on the wire in a step, summed by the
//!   step's all-reduce so every rank paces alike.

use std::collections::BTreeMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use lazarus_comm::tags::{expert_transfer, TransferKind};
use lazarus_comm::{deadline_after, Transport};
use lazarus_plan::{nodes_holding, select_snapshots, RoundCost, SnapshotPace, SnapshotPolicy};
use serde::{Deserialize, Serialize};

use super::{Worker, WorkerStepReport};
use crate::error::RuntimeError;
use crate::expert_state::ExpertState;

/// How a job snapshots (sent to every worker in its job).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SnapshotSettings {
    /// Ranks of a node: ranks `q·G .. q·G+G` are node q of every plan.
    pub gpus_per_node: usize,
    /// Bytes per second of the link given to snapshots: this times the previous step's mean
    /// seconds (what the link carries while the next step computes) is each step's budget, or
    /// with `adaptive` its ceiling.
    pub bandwidth: f64,
    /// Pace the budget by what the last round cost ([`SnapshotPace`]), `bandwidth` × the step
    /// its ceiling: the default when no bandwidth is given.
    #[serde(default)]
    pub adaptive: bool,
}

/// A snapshot this worker keeps for another node: an expert's encoded state after `step`.
#[derive(Debug, Clone)]
pub struct HeldSnapshot {
    pub step: u64,
    /// This worker's count of the expert's tokens ([`SnapshotTier::tokens`]) when it was taken:
    /// the tokens it has processed since are what a restore from it loses.
    pub tokens_at: u64,
    pub bytes: Vec<u8>,
}

/// A snapshot a worker keeps for another node, as it tells the controller (its home is the
/// planning crate, which the controller's decisions depend on alone).
pub use lazarus_plan::SnapshotHeld;

/// What one step's snapshots cost, the same on every rank.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct SnapshotStepStats {
    pub budget_bytes: u64,
    /// The link's bytes in a step time (bandwidth × the mean step): the budget itself with a
    /// given bandwidth, the adaptive budget's ceiling otherwise.
    #[serde(default)]
    pub cap_bytes: u64,
    /// Ranks that had not written all of the previous round's frames when this step's
    /// all-reduce began (one of the two signals the adaptive budget halves on).
    #[serde(default)]
    pub late_ranks: usize,
    /// The share of the workers' CPU time the previous round's frames took (copying, writing,
    /// reading): `snapshot_cpu_s` over `process_cpu_s`, both summed over the workers.
    #[serde(default)]
    pub cpu_share: f64,
    #[serde(default)]
    pub snapshot_cpu_s: f64,
    #[serde(default)]
    pub process_cpu_s: f64,
    /// Experts and bytes sent into other nodes' memory over the job this step.
    pub experts: usize,
    pub bytes: u64,
    /// Bytes MoEtion's selection (no expert skipped) sends with the same budget.
    pub moetion_bytes: u64,
    /// Bytes to snapshot every expert at risk (ours) / every expert (MoEtion) this step.
    pub at_risk_bytes: u64,
    pub all_bytes: u64,
}

/// A worker's part of the snapshot tier.
#[derive(Debug, Default)]
pub(crate) struct SnapshotTier {
    pub settings: Option<SnapshotSettings>,
    /// Tokens each expert processed since its last snapshot (or since this epoch began): the
    /// same on every rank of an epoch, reset by every move (a joiner has no history).
    since: Vec<Vec<u64>>,
    /// Tokens each expert processed over the steps this worker committed (for lost tokens),
    /// counted at every commit ([`SnapshotTier::count_committed`]).
    pub tokens: Vec<Vec<u64>>,
    /// The same before the last committed step, `counted`: a snapshot of the step before it,
    /// taken in after it, has lost that step's tokens.
    tokens_before: Vec<Vec<u64>>,
    counted: u64,
    /// Snapshots held for other nodes.
    pub store: BTreeMap<(usize, usize), HeldSnapshot>,
    /// Snapshots sent to this rank after the last step: (from, layer, expert, step).
    expected: Vec<(usize, usize, usize, u64)>,
    /// This worker's snapshot copies not yet taken.
    copies: Arc<CopyFence>,
    /// The adaptive budget (settings' `adaptive`), afresh each epoch.
    pace: SnapshotPace,
    /// The transport's out-of-band CPU time and the process's at the last step's all-reduce.
    cpu_mark: Option<(Duration, Duration)>,
}

/// Snapshot copies handed to the transport's copy thread and not yet done. They read the
/// expert's weights in place, so the optimizer's next update (which changes them in place)
/// waits for them: [`Worker::settle_snapshot_copies`]. A copy takes milliseconds and never
/// waits on the network, so the wait is all but always nil.
#[derive(Debug, Default)]
pub(crate) struct CopyFence {
    pending: Mutex<usize>,
    done: Condvar,
}

/// One copy of the fence's: done when dropped, whether it ran or was discarded (a transport
/// closed with copies still queued).
struct PendingCopy(Arc<CopyFence>);

impl PendingCopy {
    fn new(fence: &Arc<CopyFence>) -> Self {
        *fence.pending.lock().unwrap_or_else(|p| p.into_inner()) += 1;
        PendingCopy(fence.clone())
    }
}

impl Drop for PendingCopy {
    fn drop(&mut self) {
        let mut n = self.0.pending.lock().unwrap_or_else(|p| p.into_inner());
        *n = n.saturating_sub(1);
        self.0.done.notify_all();
    }
}

impl CopyFence {
    /// Wait until no copy is pending; false if `deadline` passed first.
    fn wait(&self, deadline: Instant) -> bool {
        let mut n = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        while *n > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            n = self.done.wait_timeout(n, left).unwrap_or_else(|p| p.into_inner()).0;
        }
        true
    }
}

/// `acc[l][e] += load[l][e]`, starting from zeroes when `acc` has another shape (a new model
/// after a rollback, or the first step).
fn add_load(acc: &mut Vec<Vec<u64>>, load: &[Vec<u64>]) {
    if acc.len() != load.len() || acc.iter().zip(load).any(|(a, l)| a.len() != l.len()) {
        *acc = load.iter().map(|l| vec![0; l.len()]).collect();
    }
    for (a, l) in acc.iter_mut().zip(load) {
        a.iter_mut().zip(l).for_each(|(a, &x)| *a += x);
    }
}

impl SnapshotTier {
    /// Committed `step`, whose global per-expert tokens were `load`.
    pub(crate) fn count_committed(&mut self, step: u64, load: &[Vec<u64>]) {
        if self.settings.is_none() {
            return;
        }
        self.tokens_before.clone_from(&self.tokens);
        add_load(&mut self.tokens, load);
        self.counted = step;
    }

    /// The expert's token count as of committed `step`: a snapshot arrives at most one
    /// committed step after the step it is of (sent after s, taken in after s + 1 or when
    /// s + 1 failed), so the count before the last step is as far back as it needs.
    fn tokens_as_of(&self, step: u64, layer: usize, expert: usize) -> u64 {
        let at = if step >= self.counted { &self.tokens } else { &self.tokens_before };
        at.get(layer).and_then(|x| x.get(expert)).copied().unwrap_or(0)
    }

    /// A new epoch (a move or a rollback): nothing in flight, the ranking starts afresh.
    pub fn new_epoch(&mut self) {
        self.expected.clear();
        self.since.clear();
        self.pace = SnapshotPace::default();
        self.cpu_mark = None;
    }

    /// This rank's terms of the last round's cost for the step's all-reduce
    /// ([`RoundCost::terms`]): whether frames of it are still to be written, and the CPU seconds
    /// its transport spent on snapshot frames and its process spent in all since the last call
    /// (zeroes with snapshots off, and on an epoch's first step: its transport is new, and the
    /// mark was reset with it in [`SnapshotTier::new_epoch`]).
    pub(crate) fn round_cost_here(&mut self, t: &dyn Transport) -> [f32; RoundCost::TERMS] {
        if self.settings.is_none() {
            return RoundCost::terms(false, 0.0, 0.0);
        }
        let now = (t.out_of_band_cpu(), lazarus_comm::cpu_time::process_cpu());
        let (snapshot, process) = match self.cpu_mark.replace(now) {
            Some((s, p)) => (now.0.saturating_sub(s), now.1.saturating_sub(p)),
            None => (Duration::ZERO, Duration::ZERO),
        };
        RoundCost::terms(t.out_of_band_backlog() > 0, snapshot.as_secs_f64(), process.as_secs_f64())
    }
}

impl Worker {
    /// Snapshot after this worker's steps, as `settings` says (None: never).
    pub fn set_snapshots(&mut self, settings: Option<SnapshotSettings>) {
        self.snapshots.settings = settings.filter(|s| s.gpus_per_node > 0 && s.bandwidth.is_finite() && s.bandwidth > 0.0);
    }

    /// Wait for this worker's snapshot copies still running (see [`CopyFence`]): before anything
    /// changes expert weights in place.
    pub(crate) fn settle_snapshot_copies(&self) -> Result<(), RuntimeError> {
        if self.snapshots.copies.wait(deadline_after(self.timeout)) {
            return Ok(());
        }
        Err(RuntimeError::Invalid {
            field: "snapshot",
            reason: format!("rank {}: snapshot copies still pending after {:?}", self.rank, self.timeout),
        })
    }

    /// Whether this worker takes snapshots (its job's settings say so).
    pub fn snapshots_on(&self) -> bool {
        self.snapshots.settings.is_some()
    }

    /// Snapshots this worker holds for other nodes: the step each is of, the tokens the expert
    /// has processed in the steps this worker committed since (what restoring it would lose),
    /// and its tokens in the step this worker holds uncommitted, if any (lost too if the
    /// controller commits that step: some rank did).
    pub fn held_snapshots(&self) -> Vec<SnapshotHeld> {
        let t = &self.snapshots;
        let held = self.held.as_ref().map(|p| p.expert_load());
        t.store
            .iter()
            .map(|(&(layer, expert), s)| {
                let now = t.tokens.get(layer).and_then(|x| x.get(expert)).copied().unwrap_or(0);
                SnapshotHeld {
                    layer,
                    expert,
                    step: s.step,
                    tokens_lost: now.saturating_sub(s.tokens_at),
                    held_step_tokens: held.and_then(|h| h.get(layer)).and_then(|x| x.get(expert)).copied().unwrap_or(0),
                }
            })
            .collect()
    }

    /// The state kept in a snapshot of (layer, expert), if this worker holds one.
    pub(crate) fn snapshot_state(&self, layer: usize, expert: usize) -> Result<Option<ExpertState>, RuntimeError> {
        match self.snapshots.store.get(&(layer, expert)) {
            Some(s) => Ok(Some(ExpertState::decode(&s.bytes, layer, expert, &self.trainer.model.expert_shapes())?)),
            None => Ok(None),
        }
    }

    /// The step in flight failed: keep the snapshots sent here after the last committed step
    /// that arrived before the failure (they are of that step: nothing of them is lost).
    pub fn keep_arrived_snapshots(&mut self, t: &mut dyn Transport) {
        for (from, l, e, step) in std::mem::take(&mut self.snapshots.expected) {
            let Ok(tag) = expert_transfer(TransferKind::Snapshot, l, e) else { continue };
            if let Some(bytes) = t.take_arrived(from, tag) {
                let _ = self.keep_snapshot(t, from, l, e, step, bytes);
            }
        }
    }

    /// Keep `bytes`, sent by rank `from`, as the snapshot of (layer, expert) after `step`, once
    /// they are checked to be that expert's state; the buffer of the snapshot it replaces goes
    /// back to the transport, which reads the next one into it.
    fn keep_snapshot(
        &mut self,
        t: &mut dyn Transport,
        from: usize,
        l: usize,
        e: usize,
        step: u64,
        bytes: Vec<u8>,
    ) -> Result<(), RuntimeError> {
        ExpertState::check(&bytes, l, e, &self.trainer.model.expert_shapes())
            .map_err(|err| RuntimeError::Invalid { field: "snapshot", reason: format!("rank {from} sent layer {l} expert {e}: {err}") })?;
        let tokens_at = self.snapshots.tokens_as_of(step, l, e);
        if let Some(old) = self.snapshots.store.insert((l, e), HeldSnapshot { step, tokens_at, bytes }) {
            t.recycle(old.bytes);
        }
        Ok(())
    }

    /// After committed step `r`: take in the snapshots sent here after the previous step, then
    /// send this step's. Every rank must call it after every step of an epoch (or none does).
    pub fn snapshot_round(&mut self, t: &mut dyn Transport, r: &WorkerStepReport) -> Result<SnapshotStepStats, RuntimeError> {
        let Some(settings) = self.snapshots.settings else { return Ok(SnapshotStepStats::default()) };
        let g = settings.gpus_per_node;
        let nodes = self.world / g;
        if nodes < 2 || !self.world.is_multiple_of(g) {
            return Ok(SnapshotStepStats::default());
        }
        let shapes = self.trainer.model.expert_shapes();
        let deadline = deadline_after(self.timeout);
        // What was sent here after the previous step: its bytes arrived while this one ran.
        for (from, l, e, step) in std::mem::take(&mut self.snapshots.expected) {
            let bytes = t.recv(from, expert_transfer(TransferKind::Snapshot, l, e)?, deadline)?;
            self.keep_snapshot(t, from, l, e, step, bytes)?;
        }
        // This step's tokens (the lost-token count took them at the commit).
        let load = &r.report.expert_load;
        let tier = &mut self.snapshots;
        add_load(&mut tier.since, load);
        let bytes_per = ExpertState::encoded_len(&shapes) as u64;
        let layers = self.plan.layer_count();
        let per_layer = vec![bytes_per; layers];
        let cap = (settings.bandwidth * r.mean_step_s.max(0.0)).min(u64::MAX as f64 / 2.0) as u64;
        let budget = match settings.adaptive {
            true => tier.pace.budget(&r.snapshot_cost, cap, bytes_per),
            false => cap,
        };
        let node_of: Vec<usize> = (0..self.world).map(|q| q / g).collect();
        let held_on = nodes_holding(&self.plan, &node_of);
        let ours = select_snapshots(&tier.since, &held_on, &per_layer, budget, SnapshotPolicy::Lazarus);
        let theirs = select_snapshots(&tier.since, &held_on, &per_layer, budget, SnapshotPolicy::Moetion);
        let at_risk = (0..layers).map(|l| held_on[l].iter().filter(|&&n| n < 2).count() as u64).sum::<u64>() * bytes_per;
        tier.pace.sent(ours.bytes);
        let stats = SnapshotStepStats {
            budget_bytes: budget,
            cap_bytes: cap,
            late_ranks: r.snapshot_cost.late_ranks,
            cpu_share: r.snapshot_cost.cpu_share(),
            snapshot_cpu_s: r.snapshot_cost.snapshot_cpu_s,
            process_cpu_s: r.snapshot_cost.process_cpu_s,
            experts: ours.experts.len(),
            bytes: ours.bytes,
            moetion_bytes: theirs.bytes,
            at_risk_bytes: at_risk,
            all_bytes: (layers * self.plan.experts()) as u64 * bytes_per,
        };
        let step = self.trainer.step;
        self.fault_point(super::FaultPoint::Snapshot, step);
        for &(l, e) in &ours.experts {
            self.snapshots.since[l][e] = 0;
            let Some(&from) = self.plan.holders(l, e).first() else { continue };
            let to = (from + g) % self.world;
            if from == self.rank {
                // The copy runs on the transport's thread; the next commit waits for it.
                let (len, copy) = self.expert_encoder(l, e)?;
                let pending = PendingCopy::new(&self.snapshots.copies);
                let encode: lazarus_comm::Encode = Box::new(move |out| {
                    let copied = copy(out); // consumed: it holds nothing of the expert now
                    drop(pending);
                    copied
                });
                t.send_out_of_band_encoded(to, expert_transfer(TransferKind::Snapshot, l, e)?, len, encode, deadline)?;
            } else if to == self.rank {
                self.snapshots.expected.push((from, l, e, step));
            }
        }
        Ok(stats)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_snapshot_taken_in_after_the_next_commit_has_lost_that_steps_tokens() {
        let mut tier =
            SnapshotTier { settings: Some(SnapshotSettings { gpus_per_node: 1, bandwidth: 1e9, adaptive: false }), ..Default::default() };
        tier.count_committed(11, &[vec![3, 5]]);
        assert_eq!((tier.tokens_as_of(11, 0, 1), tier.tokens_as_of(10, 0, 1)), (5, 0));
        tier.count_committed(12, &[vec![4, 7]]);
        // Taken in after step 12 (its snapshot round or a held step committed late): a
        // snapshot of step 11 counts from step 11's total, of step 12 from step 12's.
        assert_eq!(tier.tokens_as_of(11, 0, 1), 5);
        assert_eq!(tier.tokens_as_of(12, 0, 1), 12);
        assert_eq!(tier.tokens_as_of(12, 0, 0), 7);
        assert_eq!(tier.tokens_as_of(12, 3, 0), 0, "no such layer: nothing counted");
        // Another shape (a new model after a rollback): counting starts again.
        tier.count_committed(13, &[vec![1, 1, 1]]);
        assert_eq!(tier.tokens, vec![vec![1, 1, 1]]);
    }

    /// Survivors and joiners of a move must pace alike (or senders and receivers disagree on
    /// what is sent): a new epoch starts the pace and the CPU marks afresh, as a joiner has them.
    #[test]
    fn a_new_epoch_paces_afresh_as_a_joiner_does() {
        let mut tier =
            SnapshotTier { settings: Some(SnapshotSettings { gpus_per_node: 1, bandwidth: 1e9, adaptive: true }), ..Default::default() };
        let busy = RoundCost { late_ranks: 1, ..Default::default() };
        tier.pace.budget(&busy, 1000, 10);
        tier.pace.sent(600);
        tier.cpu_mark = Some((Duration::from_secs(1), Duration::from_secs(2)));
        tier.new_epoch();
        let joiner = SnapshotTier::default();
        assert_eq!((tier.pace, tier.cpu_mark), (joiner.pace, joiner.cpu_mark));
    }

    #[test]
    fn the_fence_waits_for_every_copy_run_or_dropped() {
        let fence = Arc::new(CopyFence::default());
        assert!(fence.wait(Instant::now()), "nothing pending: no wait");
        let (a, b) = (PendingCopy::new(&fence), PendingCopy::new(&fence));
        assert!(!fence.wait(Instant::now() + Duration::from_millis(30)), "two pending: the deadline passes");
        drop(a);
        assert!(!fence.wait(Instant::now() + Duration::from_millis(30)), "one still pending");
        // Done on another thread, as the transport's copy thread does.
        let started = Instant::now();
        let copier = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            drop(b);
        });
        assert!(fence.wait(Instant::now() + Duration::from_secs(10)));
        assert!(started.elapsed() >= Duration::from_millis(100), "returned before the copy was done");
        copier.join().unwrap();
    }
}
