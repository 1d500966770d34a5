//! A job taken back by a new controller after its own was lost (the process killed, its host
//! gone): what a controller keeps so that another can go on with the job ([`JobState`], written
//! by the shell at every epoch change), and the controller a new process starts from it.
//!
//! The new controller knows the plan and who the ranks were; it does not know where each worker
//! stopped. So it starts **collecting**, exactly as after a loss: every member says where it
//! stopped (its agent replays the worker's last pause or failure report when it re-attaches),
//! and the recovery that follows — the step all commit to, the node mapping, the move — is the
//! one every other loss takes. Reports stamped with the epoch before the saved one are taken
//! too: the old controller may have been lost after it saved a move and before every worker
//! heard of it. A member that does not come back within the re-attach window is lost like any
//! silent node, and the move re-plans without it.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use lazarus_plan::ModelPlan;
use serde::{Deserialize, Serialize};

use super::{Controller, MoveCause, NodeId, Phase, StepRecord};

/// The takeover room's state: a job taken back by a new controller, until it runs again.
#[derive(Debug, Clone, Default)]
pub(crate) struct Takeover {
    /// Not moved yet: reports of the epoch before the saved one count.
    pub(crate) resuming: bool,
    /// Not running again yet: every move until it runs is the new controller's (losses found on
    /// the way included).
    pub(crate) taken_back: bool,
    /// Members not heard from yet: their leases run to the end of the re-attach window; once
    /// heard from, the usual lease.
    pub(crate) awaiting: BTreeSet<NodeId>,
}

impl Takeover {
    /// A job taken back with these ranks, none heard from yet.
    pub(crate) fn of(ranks: &[NodeId]) -> Self {
        Takeover { resuming: true, taken_back: true, awaiting: ranks.iter().copied().collect() }
    }

    /// `worker` was heard from: true the first time (its lease becomes the usual one).
    pub(crate) fn heard(&mut self, worker: NodeId) -> bool {
        self.awaiting.remove(&worker)
    }
}

/// What a controller keeps of a running job so that a new one can take it back: the shell writes
/// it (atomically) whenever the epoch changes. What it does not keep is reported again by the
/// workers: where each stopped, what it holds, its snapshots; the loads are measured anew.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobState {
    /// The job's first epoch (what a user is shown counts from here).
    pub first_epoch: u64,
    /// The epoch of the plan below (the newest the workers may have been told).
    pub epoch: u64,
    /// The placement of that epoch, as the plan file holds it (`lazarus-plan/1`).
    pub plan: String,
    /// The worker of each rank of that epoch.
    pub ranks: Vec<NodeId>,
    /// The node of every worker the job has had: (worker, node).
    pub node_of: Vec<(NodeId, u64)>,
    /// The step of the last checkpoint written.
    pub checkpoint: Option<u64>,
    /// The last step logged.
    pub last_step: u64,
    /// Moves made so far.
    pub reconfigurations: u64,
}

/// Why a saved job cannot be taken back: the field and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadJobState {
    pub field: &'static str,
    pub reason: String,
}

impl std::fmt::Display for BadJobState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.field, self.reason)
    }
}

impl<S: StepRecord> Controller<S> {
    /// What a new controller needs to take this job back (None: a job without a placement,
    /// which cannot be re-planned, so it is not resumed either).
    pub fn job_state(&self) -> Option<JobState> {
        let plan = self.plan.as_ref()?;
        Some(JobState {
            first_epoch: self.first_epoch,
            epoch: self.epoch,
            plan: plan.clone().with_epoch(self.epoch).to_json(),
            ranks: self.ranks.iter().copied().filter(|n| self.members.alive.contains(n)).collect(),
            node_of: self.members.node_of.iter().map(|(&w, &n)| (w, n)).collect(),
            checkpoint: self.checkpoint,
            last_step: self.last_step,
            reconfigurations: self.reconfigurations,
        })
    }

    /// The controller of a job taken back from `state` at `now`: it collects where every member
    /// stopped, waiting up to `rejoin_within` for each to be heard from (its agent re-attaching),
    /// then moves the job to the next epoch (`MoveCause::Controller`). `last_step` is the last
    /// step the log holds, if the shell knows better than the state (it is written per epoch).
    pub fn resumed(
        spec: super::JobSpec,
        state: JobState,
        last_step: Option<u64>,
        now: Instant,
        rejoin_within: Duration,
    ) -> Result<Self, BadJobState> {
        let bad = |field: &'static str, reason: String| BadJobState { field, reason };
        let plan = ModelPlan::from_json(&state.plan).map_err(|e| bad("plan", e.to_string()))?;
        check_state(&spec, &state, &plan).map_err(|(field, reason)| bad(field, reason))?;
        let plan = plan.with_epoch(state.epoch);
        let mut c = Self::with_plan(spec, Some(plan), state.epoch, state.ranks.clone(), now);
        c.first_epoch = state.first_epoch;
        c.members.node_of = state.node_of.iter().copied().collect();
        c.checkpoint = state.checkpoint;
        c.last_step = last_step.unwrap_or(state.last_step).max(state.checkpoint.unwrap_or(0));
        c.reconfigurations = state.reconfigurations;
        c.life.started = true;
        c.members.heard = state.ranks.iter().copied().collect();
        // Nobody was heard yet: every member's lease runs out at the end of the re-attach window
        // (at least a lease from now), as after a stall of the controller.
        let silent_until = (now + rejoin_within).checked_sub(c.spec.lease).unwrap_or(now).max(now);
        for n in &state.ranks {
            c.members.last_seen.insert(*n, silent_until);
        }
        c.takeover = Takeover::of(&state.ranks);
        c.phase = Phase::Collecting { reports: BTreeMap::new() };
        c.planned = Some(MoveCause::Controller);
        let epoch = c.job_epoch(c.epoch);
        c.note(format!(
            "epoch {epoch}: taken back by a new controller at step {}; waiting for every worker to say where it stopped",
            c.last_step
        ));
        Ok(c)
    }

    /// A member of a job taken back is heard from (`event`): from now on its lease is the usual
    /// one — the re-attach window was for finding it, not for losing it later.
    pub(super) fn heard_again(&mut self, now: Instant, event: &super::Event<S>) {
        if self.takeover.awaiting.is_empty() {
            return;
        }
        let Some(node) = super::membership::heard_from(event) else { return };
        if self.takeover.heard(node) {
            self.members.last_seen.insert(node, now);
            // A deadline moved earlier: the next look at the leases must not skip it.
            self.lease_may_end_at(now + self.lease_of(node));
        }
    }

    /// Whether this controller is taking a job back and has not moved it yet.
    pub fn resuming(&self) -> bool {
        self.takeover.resuming
    }
}

/// A saved job that fits the job spec: its ranks distinct and each on a known node, whole nodes,
/// and a plan of the job's shape with one rank per plan GPU.
fn check_state(spec: &super::JobSpec, state: &JobState, plan: &ModelPlan) -> Result<(), (&'static str, String)> {
    if state.ranks.is_empty() {
        return Err(("ranks", "no worker is left in the saved job".into()));
    }
    let mut seen = std::collections::BTreeSet::new();
    if let Some(dup) = state.ranks.iter().find(|&&n| !seen.insert(n)) {
        return Err(("ranks", format!("worker {dup} holds two ranks")));
    }
    let node_of: BTreeMap<NodeId, u64> = state.node_of.iter().copied().collect();
    if let Some(w) = state.ranks.iter().find(|w| !node_of.contains_key(w)) {
        return Err(("node_of", format!("worker {w} has no node")));
    }
    let g = spec.gpus_per_node.max(1);
    if !state.ranks.len().is_multiple_of(g) {
        return Err(("ranks", format!("{} workers are not whole nodes of {g}", state.ranks.len())));
    }
    if plan.shape().ranks() != state.ranks.len() || plan.shape().gpus_per_node != g {
        return Err((
            "plan",
            format!("{} nodes x {} GPUs for {} ranks of nodes of {g}", plan.shape().nodes, plan.shape().gpus_per_node, state.ranks.len()),
        ));
    }
    if plan.layers().len() != spec.layers || plan.experts() != spec.experts {
        return Err(("plan", format!("not a plan of this job's {} layers x {} experts", spec.layers, spec.experts)));
    }
    if state.epoch < state.first_epoch {
        return Err(("epoch", format!("{} before the job's first, {}", state.epoch, state.first_epoch)));
    }
    Ok(())
}
