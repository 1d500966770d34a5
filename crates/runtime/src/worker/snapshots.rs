//! The snapshot tier (MoEtion §4, PEC §3, DESIGN.md algorithm 6): after each committed step,
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
//! * Experts whose replicas sit on two or more nodes are skipped (Lazarus's own protection);
//!   MoEtion's selection over the same budget is computed beside it and its bytes reported.

use std::collections::BTreeMap;

use lazarus_comm::tags::{expert_transfer, TransferKind};
use lazarus_comm::{deadline_after, Transport};
use lazarus_plan::{nodes_holding, select_snapshots, SnapshotPolicy};
use serde::{Deserialize, Serialize};

use super::{Worker, WorkerStepReport};
use crate::error::RuntimeError;
use crate::expert_state::ExpertState;

/// How a job snapshots (sent to every worker in its job).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SnapshotSettings {
    /// Ranks of a node: ranks `q·G .. q·G+G` are node q of every plan.
    pub gpus_per_node: usize,
    /// Bytes per second of the link given to snapshots: each step's budget is this times the
    /// previous step's mean seconds (what the link carries while the next step computes).
    pub bandwidth: f64,
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

/// What one step's snapshots cost, the same on every rank.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct SnapshotStepStats {
    pub budget_bytes: u64,
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
    /// Tokens each expert processed over the steps this worker committed (for lost tokens).
    pub tokens: Vec<Vec<u64>>,
    /// Snapshots held for other nodes.
    pub store: BTreeMap<(usize, usize), HeldSnapshot>,
    /// Snapshots sent to this rank after the last step: (from, layer, expert, step).
    expected: Vec<(usize, usize, usize, u64)>,
}

impl SnapshotTier {
    /// A new epoch (a move or a rollback): nothing in flight, the ranking starts afresh.
    pub fn new_epoch(&mut self) {
        self.expected.clear();
        self.since.clear();
    }
}

impl Worker {
    /// Snapshot after this worker's steps, as `settings` says (None: never).
    pub fn set_snapshots(&mut self, settings: Option<SnapshotSettings>) {
        self.snapshots.settings = settings.filter(|s| s.gpus_per_node > 0 && s.bandwidth.is_finite() && s.bandwidth > 0.0);
    }

    /// Whether this worker takes snapshots (its job's settings say so).
    pub fn snapshots_on(&self) -> bool {
        self.snapshots.settings.is_some()
    }

    /// Snapshots this worker holds for other nodes: (layer, expert) → the step each is of and
    /// the tokens the expert has processed since (what restoring it would lose).
    pub fn held_snapshots(&self) -> Vec<(usize, usize, u64, u64)> {
        let t = &self.snapshots;
        t.store
            .iter()
            .map(|(&(l, e), s)| {
                let now = t.tokens.get(l).and_then(|x| x.get(e)).copied().unwrap_or(0);
                (l, e, s.step, now.saturating_sub(s.tokens_at))
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
                let _ = self.keep_snapshot(from, l, e, step, bytes);
            }
        }
    }

    /// Keep `bytes`, sent by rank `from`, as the snapshot of (layer, expert) after `step`, once
    /// they are checked to be that expert's state.
    fn keep_snapshot(&mut self, from: usize, l: usize, e: usize, step: u64, bytes: Vec<u8>) -> Result<(), RuntimeError> {
        ExpertState::check(&bytes, l, e, &self.trainer.model.expert_shapes())
            .map_err(|err| RuntimeError::Invalid { field: "snapshot", reason: format!("rank {from} sent layer {l} expert {e}: {err}") })?;
        let tokens_at = self.snapshots.tokens.get(l).and_then(|x| x.get(e)).copied().unwrap_or(0);
        self.snapshots.store.insert((l, e), HeldSnapshot { step, tokens_at, bytes });
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
            self.keep_snapshot(from, l, e, step, bytes)?;
        }
        // This step's tokens.
        let load = &r.report.expert_load;
        let tier = &mut self.snapshots;
        for acc in [&mut tier.since, &mut tier.tokens] {
            if acc.len() != load.len() || acc.iter().zip(load).any(|(a, l)| a.len() != l.len()) {
                *acc = load.iter().map(|l| vec![0; l.len()]).collect();
            }
            for (a, l) in acc.iter_mut().zip(load) {
                a.iter_mut().zip(l).for_each(|(a, &x)| *a += x);
            }
        }
        let bytes_per = ExpertState::encoded_len(&shapes) as u64;
        let layers = self.plan.layers().len();
        let per_layer = vec![bytes_per; layers];
        let budget = (settings.bandwidth * r.mean_step_s.max(0.0)).min(u64::MAX as f64 / 2.0) as u64;
        let node_of: Vec<usize> = (0..self.world).map(|q| q / g).collect();
        let held_on = nodes_holding(self.plan.layers(), &node_of);
        let ours = select_snapshots(&tier.since, &held_on, &per_layer, budget, SnapshotPolicy::Lazarus);
        let theirs = select_snapshots(&tier.since, &held_on, &per_layer, budget, SnapshotPolicy::Moetion);
        let at_risk = (0..layers).map(|l| held_on[l].iter().filter(|&&n| n < 2).count() as u64).sum::<u64>() * bytes_per;
        let stats = SnapshotStepStats {
            budget_bytes: budget,
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
                let bytes = self.encode_expert(l, e)?;
                t.send_out_of_band(to, expert_transfer(TransferKind::Snapshot, l, e)?, bytes, deadline)?;
            } else if to == self.rank {
                self.snapshots.expected.push((from, l, e, step));
            }
        }
        Ok(stats)
    }
}
