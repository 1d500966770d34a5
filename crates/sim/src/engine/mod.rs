//! The discrete-event simulation of one training job under one policy.
//!
//! Time advances from event to event: trace changes (node failures and joins), step boundaries
//! where a checkpoint or a rebalance is due, the end of a busy period (checkpoint, restart,
//! reconfiguration, rebalance), and the moment waiting joiners may be used. Between events the
//! job trains at a constant step time, so steps are counted, not simulated one by one.
//!
//! Every second of wall time lands in exactly one bucket of [`Breakdown`]; steps that a restart
//! rolls back move from `compute_s` to `lost_work_s`, as does the partial step a failure
//! interrupts.
//!
//! This module holds what every policy shares: the event loop, membership, training progress,
//! checkpoints, restarts and the time accounting. What a policy decides — which nodes it can use,
//! its configuration, when it checkpoints and rebalances, what it does on a failure or a join,
//! how its configuration stretches a step — is the trait `FailurePolicy` in `policy/`, one file per policy.

mod policy;
mod report;

use std::collections::HashSet;

use crate::cost::{CostModel, ModelSpec};
use crate::error::SimError;
use crate::loads::{LoadCursor, LoadModel};
use crate::mix::{FailureMix, Seen};
use crate::trace::{Change, Trace, MAX_NODES};
pub use policy::Policy;
use policy::{Ds, DsFt, FailurePolicy, Gemini, Lazarus, MoEvement, StaticEp, TorchFt};
use report::Tally;
pub use report::{Breakdown, PolicyReport, SeriesPoint};

/// One simulated job: cluster history, model, costs, loads.
#[derive(Debug, Clone)]
pub struct Scenario {
    pub trace: Trace,
    pub model: ModelSpec,
    pub cost: CostModel,
    pub loads: LoadModel,
    /// At most this many nodes are used (extra live nodes wait as spares).
    pub max_nodes: usize,
    pub duration_s: f64,
    /// Which removals of the trace come with a notice, and how long before.
    pub notices: Notices,
    /// The causes of the removals, and so how each is found out (None: every one by silence).
    pub mix: Option<FailureMix>,
    /// Seed of the causes' draws.
    pub seed: u64,
}

/// Preemption notices (a spot instance's two-minute warning, a host's planned maintenance): a
/// `share` of the trace's removals, drawn with `seed`, are told `lead_s` before they happen. A
/// node in use that gave notice is drained at the end of the step in flight — no time-out, no
/// step lost — if the policy can; one whose removal comes first fails as any other.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Notices {
    pub share: f64,
    pub lead_s: f64,
    pub seed: u64,
}

impl Default for Notices {
    /// None.
    fn default() -> Self {
        Notices { share: 0.0, lead_s: 120.0, seed: 0 }
    }
}

impl Notices {
    /// Whether the removal of `node` at `ms` was told beforehand (a pure function of the
    /// seed, the node and the time, so every policy sees the same notices).
    fn gives_notice(&self, node: &str, ms: u64) -> bool {
        if self.share <= 0.0 {
            return false;
        }
        let mut h = self.seed ^ ms.rotate_left(17);
        for b in node.bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
        lazarus_plan::rng::SplitMix64::new(h).uniform() < self.share
    }
}

impl Scenario {
    /// How the failure of `node` at `at_s` is found out: its cause's way ([`crate::mix`]), by
    /// silence without a mix.
    fn seen(&self, node: &str, at_s: f64) -> Seen {
        self.mix.as_ref().map_or(Seen::Silence, |m| m.cause_of(self.seed, node, (at_s * 1000.0).round() as u64).seen)
    }

    /// Seconds until a failure seen so is found out.
    fn detect_s(&self, seen: Seen) -> f64 {
        match seen {
            Seen::Exit => self.cost.exit_detect_s,
            Seen::Silence => self.cost.failure_timeout_s,
        }
    }

    /// Everything [`simulate`] needs bounded: the model, the costs, the loads against the model,
    /// the trace ([`Trace::validate`]), `max_nodes` (1 to [`MAX_NODES`]) and the duration (> 0,
    /// at most [`MAX_DURATION_S`]). The per-policy work bound ([`MAX_BOUNDARIES`]) is checked by
    /// `simulate`.
    pub fn validate(&self) -> Result<(), SimError> {
        self.model.validate()?;
        self.cost.validate()?;
        self.loads.validate(self.model.layers, self.model.experts)?;
        if self.max_nodes == 0 || self.max_nodes > MAX_NODES {
            return Err(SimError::invalid("max_nodes", self.max_nodes, format!("must be 1 to {MAX_NODES}")));
        }
        if !self.duration_s.is_finite() || self.duration_s <= 0.0 {
            return Err(SimError::invalid("duration", self.duration_s, "must be > 0 s"));
        }
        let n = &self.notices;
        if !(0.0..=1.0).contains(&n.share) {
            return Err(SimError::invalid("notices.share", n.share, "must be from 0 to 1"));
        }
        if !n.lead_s.is_finite() || !(0.0..=86_400.0).contains(&n.lead_s) {
            return Err(SimError::invalid("notices.lead_s", n.lead_s, "must be 0 to 86400 s"));
        }
        if self.duration_s > MAX_DURATION_S {
            return Err(SimError::invalid("duration", format!("{} s", self.duration_s), format!("at most {MAX_DURATION_S} s (30 days)")));
        }
        self.trace.validate()
    }

    /// Refuse a run whose checkpoint intervals and load epochs (and, with the drifting load
    /// generator, the loads it draws) exceed the bounds; `checkpoint_every` is the policy's.
    fn check_work(&self, checkpoint_every: u64) -> Result<(), SimError> {
        // Steps only ever take at least the balanced step time.
        let steps = self.duration_s / self.model.balanced_step_s;
        let epochs = steps / self.cost.rebalance_every as f64;
        let boundaries = steps / checkpoint_every as f64 + epochs;
        if boundaries > MAX_BOUNDARIES {
            return Err(SimError::invalid(
                "duration",
                format!("{} s", self.duration_s),
                format!(
                    "with {} s steps, checkpoints every {checkpoint_every} steps and load epochs every {} (rebalance_every) the run \
                     crosses up to {boundaries:.0} step boundaries, at most {MAX_BOUNDARIES:.0} are simulated: shorten the run or \
                     checkpoint and rebalance less often",
                    self.model.balanced_step_s, self.cost.rebalance_every
                ),
            ));
        }
        let draws = epochs * (self.model.layers * self.model.experts) as f64;
        if matches!(self.loads, LoadModel::Skewed { .. }) && draws > MAX_LOAD_DRAWS {
            return Err(SimError::invalid(
                "duration",
                format!("{} s", self.duration_s),
                format!(
                    "{epochs:.0} load epochs (rebalance_every {}) of {} layers × {} experts draw {draws:.0} loads, at most \
                     {MAX_LOAD_DRAWS:.0}: shorten the run or rebalance less often",
                    self.cost.rebalance_every, self.model.layers, self.model.experts
                ),
            ));
        }
        Ok(())
    }
}

/// What the job is doing instead of training; each kind is charged to its own bucket.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Busy {
    Checkpoint,
    Restart,
    Reconfig,
    Rebalance,
}

/// The parts of a busy period, in seconds.
#[derive(Debug, Clone, Copy, Default)]
struct BusyParts {
    detect: f64,
    own: f64,
    transfer: f64,
}

/// The job's last checkpoint: what a restart rolls back to.
#[derive(Debug, Default)]
struct LastCheckpoint {
    step: u64,
    samples: f64,
    /// Compute seconds since it (lost work if a restart rolls them back).
    compute_since_s: f64,
    /// A checkpoint due at the same step as a rebalance or scale-up, taken after it.
    pending: bool,
}

/// The state of one simulated job under policy `P`.
struct Run<'a, P: FailurePolicy> {
    s: &'a Scenario,
    /// The policy's name, for the report.
    policy: Policy,
    /// The policy's decisions.
    p: &'a P,
    now: f64,
    /// Live nodes in join order, with the time each may first be used.
    alive: Vec<(String, f64)>,
    used: Vec<String>,
    /// The policy's configuration over `used`; None while too few nodes are usable.
    config: Option<P::Config>,
    /// Step time of the current configuration and load epoch.
    step_s: Option<(u64, f64)>,
    step: u64,
    /// Seconds of the step in flight (lost if a failure interrupts it).
    partial_s: f64,
    samples: f64,
    /// The last checkpoint, and what a restart would roll back to it.
    ckpt: LastCheckpoint,
    busy: Option<(Busy, f64)>,
    /// What is left of the busy period's parts, charged in this order: finding out the failure
    /// that began it, its own work, the expert states it sends.
    busy_left: BusyParts,
    /// What the run counts and records as it goes, for its report.
    tally: Tally,
    /// Live nodes the policy dropped and will not take back until a restart (DS-FT after a
    /// failure: §6.2, "it does not use previously dropped nodes").
    retired: Vec<String>,
    /// Live nodes that gave notice: drained at the end of the step in flight, never used again.
    leaving: Vec<String>,
    /// How long the last failure took to be found out ([`Scenario::detect_s`]).
    detect_s: f64,
    /// The part of it the busy period the failure begins is charged to detection.
    detect_left: f64,
    loads: std::cell::RefCell<LoadCursor>,
}

/// What happens at an instant of the event list: the trace's change, or a notice of removal.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Happening {
    Trace(Change),
    Notice,
}

/// Longest simulated duration: 30 days.
pub const MAX_DURATION_S: f64 = 30.0 * 86_400.0;
/// Most step boundaries one run may cross where work is due or the loads change: checkpoint
/// intervals plus load epochs (`rebalance_every` steps), counted at the balanced step time.
pub const MAX_BOUNDARIES: f64 = 1e7;
/// Most values (load epochs × layers × experts) the drifting load generator may draw in a run.
pub const MAX_LOAD_DRAWS: f64 = (1u64 << 34) as f64;

/// Simulate `scenario` under `policy`.
pub fn simulate(scenario: &Scenario, policy: Policy) -> Result<PolicyReport, SimError> {
    scenario.validate()?;
    match policy {
        Policy::Lazarus => Run::new(scenario, policy, &Lazarus::new()).drive(),
        Policy::Ds => Run::new(scenario, policy, &StaticEp::new(scenario, Ds)).drive(),
        Policy::DsFt => Run::new(scenario, policy, &StaticEp::new(scenario, DsFt)).drive(),
        Policy::Gemini => Run::new(scenario, policy, &StaticEp::new(scenario, Gemini::new(scenario))).drive(),
        Policy::MoEvement => Run::new(scenario, policy, &StaticEp::new(scenario, MoEvement)).drive(),
        Policy::TorchFt => Run::new(scenario, policy, &StaticEp::new(scenario, TorchFt)).drive(),
    }
}

impl<'a, P: FailurePolicy> Run<'a, P> {
    fn new(s: &'a Scenario, policy: Policy, p: &'a P) -> Self {
        Run {
            s,
            policy,
            p,
            now: 0.0,
            alive: Vec::new(),
            used: Vec::new(),
            config: None,
            step_s: None,
            step: 0,
            partial_s: 0.0,
            samples: 0.0,
            ckpt: LastCheckpoint::default(),
            busy: None,
            busy_left: BusyParts::default(),
            tally: Tally::default(),
            retired: Vec::new(),
            leaving: Vec::new(),
            detect_s: s.cost.failure_timeout_s,
            detect_left: 0.0,
            loads: std::cell::RefCell::new(LoadCursor::new(s.loads.clone(), s.model.layers, s.model.experts)),
        }
    }

    /// The event loop, from time 0 to the scenario's duration.
    fn drive(mut self) -> Result<PolicyReport, SimError> {
        let scenario = self.s;
        scenario.check_work(self.checkpoint_every())?;
        let run = &mut self;
        // The trace's events and the notices before removals, grouped by time.
        let mut timed: Vec<(f64, Happening, String)> = Vec::new();
        for ev in &scenario.trace.events {
            let t = ev.ms as f64 / 1000.0;
            let told = (t - scenario.notices.lead_s).max(0.0);
            // A removal past the end may still be told within it.
            if ev.change == Change::Remove && told < scenario.duration_s && scenario.notices.gives_notice(&ev.node, ev.ms) {
                timed.push((told, Happening::Notice, ev.node.clone()));
            }
            if t < scenario.duration_s {
                timed.push((t, Happening::Trace(ev.change), ev.node.clone()));
            }
        }
        timed.sort_by(|a, b| a.0.total_cmp(&b.0));
        let mut groups: Vec<(f64, Vec<(Happening, String)>)> = Vec::new();
        for (t, what, node) in timed {
            match groups.last_mut() {
                Some((gt, v)) if *gt == t => v.push((what, node)),
                _ => groups.push((t, vec![(what, node)])),
            }
        }
        let mut gi = 0;
        // The nodes present at the start form the first configuration, free of charge.
        if let Some((t, v)) = groups.first() {
            if *t == 0.0 {
                for (c, n) in v {
                    match c {
                        Happening::Trace(c) => run.membership(*c, n, true),
                        Happening::Notice => run.leaving.push(n.clone()),
                    }
                }
                gi = 1;
            }
        }
        run.start_fresh()?;
        let end = scenario.duration_s;
        while run.now < end {
            let t_event = groups.get(gi).map_or(f64::INFINITY, |g| g.0);
            if let Some((kind, until)) = run.busy {
                let t = until.min(t_event).min(end);
                run.charge(kind, t - run.now);
                run.now = t;
                if t >= until && until <= t_event {
                    run.busy = None;
                    run.finish_busy(kind);
                } else if t == t_event {
                    let v = groups[gi].1.clone();
                    gi += 1;
                    run.apply_events(&v)?;
                }
                continue;
            }
            let t_scale = run.scale_up_time();
            if run.config.is_none() {
                let t = t_event.min(end).min(t_scale);
                run.tally.time.idle_s += t - run.now;
                run.now = t;
                if t == t_event {
                    let v = groups[gi].1.clone();
                    gi += 1;
                    run.apply_events(&v)?;
                } else if t == t_scale {
                    run.start_fresh_after_idle()?;
                }
                continue;
            }
            // Training: run to the next step boundary that matters, or the next event.
            let step_s = run.step_time()?;
            let to_boundary = run.steps_to_boundary();
            let t_boundary = run.now + to_boundary as f64 * step_s - run.partial_s;
            // Joiners are taken at the first step boundary after they are ready; nodes that gave
            // notice leave at the end of the step in flight.
            let t_scale_boundary = if t_scale.is_finite() {
                let wait = (t_scale - run.now).max(0.0) + run.partial_s;
                run.now + (wait / step_s).ceil() * step_s - run.partial_s
            } else {
                f64::INFINITY
            };
            let t_scale_boundary = if run.draining() { t_scale_boundary.min(run.step_end(step_s)) } else { t_scale_boundary };
            let t = t_event.min(end).min(t_boundary).min(t_scale_boundary);
            run.train_until(t, step_s);
            // At a checkpoint/rebalance boundary: joiners due by now are taken first (their
            // reconfiguration replans anyway) and the checkpoint follows it; otherwise the
            // boundary's own work. Events at the same instant are then taken by the busy branch
            // at zero elapsed time.
            if t == t_boundary {
                if t_scale_boundary <= t_boundary {
                    // A scale-up that relaunches from a checkpoint of its own clears this again.
                    run.ckpt.pending = run.step.is_multiple_of(run.checkpoint_every());
                    run.reshape()?;
                    if run.busy.is_none() && run.config.is_some() {
                        run.ckpt.pending = false;
                        run.at_boundary()?;
                    }
                } else {
                    run.at_boundary()?;
                }
            } else if t == t_event && t_event <= t_scale_boundary {
                let v = groups[gi].1.clone();
                gi += 1;
                run.apply_events(&v)?;
            } else if t == t_scale_boundary {
                run.reshape()?;
            }
        }
        // A step still running at the end never finished.
        run.tally.time.lost_work_s += run.partial_s;
        run.partial_s = 0.0;
        Ok(run.report())
    }

    fn cost(&self) -> &'a CostModel {
        &self.s.cost
    }

    /// `dt` seconds of the busy period of `kind`: its detection first, then its own work, then
    /// its transfers (a rebalance's count as the rebalance's).
    fn charge(&mut self, kind: Busy, dt: f64) {
        let left = &mut self.busy_left;
        let detect = dt.min(left.detect);
        left.detect -= detect;
        let own = (dt - detect).min(left.own);
        left.own -= own;
        let transfer = dt - detect - own;
        left.transfer = (left.transfer - transfer).max(0.0);
        let t = &mut self.tally.time;
        t.detect_s += detect;
        match kind {
            Busy::Checkpoint => t.checkpoint_s += own + transfer,
            Busy::Restart => t.restart_s += own + transfer,
            Busy::Reconfig => {
                t.reconfig_s += own;
                t.transfer_s += transfer;
            }
            Busy::Rebalance => t.rebalance_s += own + transfer,
        }
    }

    fn membership(&mut self, change: Change, node: &str, initial: bool) {
        match change {
            Change::Add => {
                let ready = if initial { 0.0 } else { self.now + self.cost().scale_up_wait_s };
                self.alive.push((node.to_string(), ready));
            }
            Change::Remove => {
                self.alive.retain(|(n, _)| n != node);
                self.retired.retain(|n| n != node);
                self.leaving.retain(|n| n != node);
            }
        }
    }

    /// Live nodes that may be used now, in join order, up to the cap.
    fn usable(&self) -> Vec<String> {
        self.alive
            .iter()
            .filter(|(n, ready)| *ready <= self.now && !self.retired.contains(n) && !self.leaving.contains(n))
            .map(|(n, _)| n.clone())
            .take(self.s.max_nodes)
            .collect()
    }

    /// `nodes` followed by the usable nodes not among them, up to the cap.
    fn with_joiners(&self, mut nodes: Vec<String>) -> Vec<String> {
        let mut have: HashSet<String> = nodes.iter().cloned().collect();
        for n in self.usable() {
            if nodes.len() < self.s.max_nodes && have.insert(n.clone()) {
                nodes.push(n);
            }
        }
        nodes
    }

    /// When waiting joiners would let the policy use more nodes (∞ if never).
    fn scale_up_time(&self) -> f64 {
        let in_use = self.used.len();
        let taken: HashSet<&str> = self.used.iter().chain(&self.retired).chain(&self.leaving).map(String::as_str).collect();
        let mut ready: Vec<f64> = self.alive.iter().filter(|(n, _)| !taken.contains(n.as_str())).map(|(_, r)| *r).collect();
        ready.sort_by(f64::total_cmp);
        for (k, &r) in ready.iter().enumerate() {
            let count = (in_use + k + 1).min(self.s.max_nodes);
            if self.nodes_usable(count) > in_use {
                // A running job may let them wait longer for a move to ride along (its
                // policy's rule, counted with every node standing by then).
                let standing = ready.iter().filter(|&&x| x <= r.max(self.now)).count();
                let deferral = if self.config.is_some() { self.p.join_deferral_s(self, standing, r) } else { 0.0 };
                return (r + deferral).max(self.now);
            }
        }
        f64::INFINITY
    }

    /// How many of `n` nodes the policy can use.
    fn nodes_usable(&self, n: usize) -> usize {
        self.p.nodes_usable(self.s, n)
    }

    fn checkpoint_every(&self) -> u64 {
        self.p.checkpoint_every(self.cost())
    }

    fn epoch(&self) -> u64 {
        self.step / self.cost().rebalance_every
    }

    /// The plan epoch: loads measured over the last finished epoch (the first at the start).
    fn plan_epoch(&self) -> u64 {
        self.epoch().saturating_sub(1)
    }

    fn loads(&self, epoch: u64) -> Vec<Vec<f64>> {
        self.loads.borrow_mut().at(epoch)
    }

    /// Seconds per step: the balanced step stretched by the policy's imbalance of its
    /// configuration under the current epoch's loads.
    fn step_time(&mut self) -> Result<f64, SimError> {
        let epoch = self.epoch();
        if let Some((e, s)) = self.step_s {
            if e == epoch {
                return Ok(s);
            }
        }
        let loads = self.loads(epoch);
        let imbalance = match self.config.as_ref() {
            Some(config) => self.p.imbalance(self.cost(), config, &loads),
            None => return Ok(f64::INFINITY),
        };
        let m = &self.s.model;
        let s = m.balanced_step_s * ((1.0 - m.expert_fraction) + m.expert_fraction * imbalance.max(1.0));
        self.step_s = Some((epoch, s));
        Ok(s)
    }

    fn samples_per_step(&self) -> f64 {
        match self.cost().global_batch {
            Some(b) => b as f64,
            None => (self.used.len() * self.cost().gpus_per_node * self.cost().samples_per_gpu) as f64,
        }
    }

    /// Whole steps until the next checkpoint or rebalance.
    fn steps_to_boundary(&self) -> u64 {
        let k = self.checkpoint_every();
        let mut next = (self.step / k + 1) * k;
        if let Some(r) = self.p.rebalance_every(self.cost()) {
            next = next.min((self.step / r + 1) * r);
        }
        next - self.step
    }

    fn train_until(&mut self, t: f64, step_s: f64) {
        let dt = (t - self.now).max(0.0);
        let total = self.partial_s + dt;
        let mut k = (total / step_s).floor();
        // Landing exactly on a boundary must count the step despite rounding.
        if (total / step_s - (k + 1.0)).abs() < 1e-9 {
            k += 1.0;
        }
        let kept = k * step_s;
        self.partial_s = (total - kept).max(0.0);
        let gained = k * self.samples_per_step();
        self.step += k as u64;
        self.samples += gained;
        self.tally.time.compute_s += kept;
        self.ckpt.compute_since_s += kept;
        if dt > 0.0 {
            self.tally.stretches.push((self.now, t, gained));
        }
        self.now = t;
    }

    fn at_boundary(&mut self) -> Result<(), SimError> {
        if let Some(r) = self.p.rebalance_every(self.cost()) {
            if self.step.is_multiple_of(r) {
                let p = self.p;
                p.rebalance(self)?;
            }
        }
        if self.step.is_multiple_of(self.checkpoint_every()) {
            if self.busy.is_some() {
                // Checkpoint right after the rebalance: both are due at this step.
                self.ckpt.pending = true;
            } else {
                self.begin(Busy::Checkpoint, self.p.checkpoint_s(self));
            }
        }
        Ok(())
    }

    fn begin(&mut self, kind: Busy, seconds: f64) {
        self.begin_with_transfer(kind, seconds, 0.0);
    }

    /// A busy period of `seconds`, the last `transfer_s` of them sending expert states; the first
    /// ones finding out the failure that began it, if one did.
    fn begin_with_transfer(&mut self, kind: Busy, seconds: f64, transfer_s: f64) {
        let detect = std::mem::take(&mut self.detect_left).min(seconds);
        let transfer = transfer_s.clamp(0.0, seconds - detect);
        self.busy_left = BusyParts { detect, own: seconds - detect - transfer, transfer };
        self.busy = Some((kind, self.now + seconds));
        self.note_nodes();
    }

    fn note_nodes(&mut self) {
        let n = if self.config.is_some() { self.used.len() } else { 0 };
        if self.tally.nodes_in_use.last().map(|x| x.1) != Some(n) {
            self.tally.nodes_in_use.push((self.now, n));
        }
    }

    fn finish_busy(&mut self, kind: Busy) {
        match kind {
            Busy::Checkpoint => {
                self.tally.checkpoints += 1;
                self.ckpt.step = self.step;
                self.ckpt.samples = self.samples;
                self.ckpt.compute_since_s = 0.0;
            }
            Busy::Rebalance | Busy::Reconfig if self.ckpt.pending => {
                self.ckpt.pending = false;
                self.begin(Busy::Checkpoint, self.p.checkpoint_s(self));
            }
            _ => {}
        }
    }

    /// A fresh configuration on the usable nodes (job start or restart); None if too few.
    fn fresh_config(&mut self) -> Result<(), SimError> {
        let usable = self.usable();
        let n = self.nodes_usable(usable.len());
        self.step_s = None;
        if n == 0 {
            self.config = None;
            self.used.clear();
            self.note_nodes();
            return Ok(());
        }
        self.used = usable[..n].to_vec();
        self.config = Some(self.p.fresh_config(self, n)?);
        self.note_nodes();
        Ok(())
    }

    fn start_fresh(&mut self) -> Result<(), SimError> {
        self.fresh_config()
    }

    /// Nodes came back after a stretch without a usable configuration: relaunch from the
    /// checkpoint (the restart that rolled back was already counted).
    fn start_fresh_after_idle(&mut self) -> Result<(), SimError> {
        self.fresh_config()?;
        if self.config.is_some() {
            // The policy's restart, less the time-out: nothing failed just now.
            let t = (self.p.restart_s(self) - self.detect_s).max(0.0);
            self.begin(Busy::Restart, t);
        }
        Ok(())
    }

    fn apply_events(&mut self, events: &[(Happening, String)]) -> Result<(), SimError> {
        let mut failed = Vec::new();
        for (what, n) in events {
            match what {
                // Told before it is even added (a short stay): it is never used.
                Happening::Notice => {
                    if !self.leaving.contains(n) {
                        self.leaving.push(n.clone());
                    }
                }
                Happening::Trace(c) => {
                    if *c == Change::Remove && self.used.contains(n) {
                        failed.push(n.clone());
                    }
                    self.membership(*c, n, false);
                }
            }
        }
        if failed.is_empty() {
            return Ok(());
        }
        self.tally.failures.push(self.now);
        // Found out when the last of them is (an exit at once, a silence by its time-out).
        let seen: Vec<Seen> = failed.iter().map(|n| self.s.seen(n, self.now)).collect();
        self.detect_s = seen.iter().map(|&s| self.s.detect_s(s)).fold(0.0, f64::max);
        if seen.iter().all(|&s| s == Seen::Exit) {
            self.tally.seen_by_exit += 1;
        }
        // The step in flight is abandoned everywhere; a checkpoint being written never completes.
        self.tally.time.lost_work_s += self.partial_s;
        self.partial_s = 0.0;
        self.busy = None;
        self.ckpt.pending = false;
        let survivors: Vec<String> = self.used.iter().filter(|n| !failed.contains(n)).cloned().collect();
        let p = self.p;
        self.detect_left = self.detect_s;
        let decided = p.on_failure(self, &failed, survivors);
        // (Unspent when the policy began nothing: the job is idle.)
        self.detect_left = 0.0;
        decided
    }

    /// Roll back to the last checkpoint and relaunch on the usable nodes.
    fn restart(&mut self) -> Result<(), SimError> {
        self.ckpt.pending = false;
        self.tally.time.lost_work_s += self.ckpt.compute_since_s;
        self.tally.time.compute_s -= self.ckpt.compute_since_s;
        self.ckpt.compute_since_s = 0.0;
        self.tally.rollbacks.push((self.now, self.samples - self.ckpt.samples));
        self.step = self.ckpt.step;
        self.samples = self.ckpt.samples;
        self.tally.restarts += 1;
        self.retired.clear();
        self.fresh_config()?;
        if self.config.is_some() {
            let t = self.p.restart_s(self);
            self.begin(Busy::Restart, t);
        }
        Ok(())
    }

    /// Move to `config` over `used` without a restart: a reconfiguration (`Busy::Reconfig`) or a
    /// rebalance (`Busy::Rebalance`) taking `seconds`, the last `transfer_s` of them sending
    /// expert states.
    fn switch(&mut self, used: Vec<String>, config: P::Config, kind: Busy, seconds: f64, transfer_s: f64) {
        self.used = used;
        self.config = Some(config);
        self.step_s = None;
        match kind {
            Busy::Rebalance => self.tally.rebalances += 1,
            _ => self.tally.reconfigurations += 1,
        }
        self.begin_with_transfer(kind, seconds, transfer_s);
    }

    /// Save a checkpoint at the current step and relaunch with `config` over `used`, taking
    /// `seconds`: nothing is rolled back, and that save is the checkpoint due at this step.
    fn relaunch_with_checkpoint(&mut self, used: Vec<String>, config: P::Config, seconds: f64) {
        self.ckpt.step = self.step;
        self.ckpt.samples = self.samples;
        self.ckpt.compute_since_s = 0.0;
        self.tally.checkpoints += 1;
        self.tally.restarts += 1;
        self.ckpt.pending = false;
        self.used = used;
        self.config = Some(config);
        self.step_s = None;
        self.begin(Busy::Restart, seconds);
    }

    /// Whether a node in use gave notice.
    fn draining(&self) -> bool {
        self.config.is_some() && self.used.iter().any(|n| self.leaving.contains(n))
    }

    /// When the step in flight ends (now, between steps).
    fn step_end(&self, step_s: f64) -> f64 {
        if self.partial_s > 0.0 {
            self.now + step_s - self.partial_s
        } else {
            self.now
        }
    }

    /// At a step boundary: drain the nodes in use that gave notice, else take waiting joiners.
    fn reshape(&mut self) -> Result<(), SimError> {
        let leaving: Vec<String> = self.used.iter().filter(|n| self.leaving.contains(n)).cloned().collect();
        if leaving.is_empty() {
            return self.scale_up();
        }
        self.tally.drains += 1;
        let staying: Vec<String> = self.used.iter().filter(|n| !leaving.contains(n)).cloned().collect();
        let p = self.p;
        p.on_notice(self, &leaving, staying)
    }

    /// Take waiting joiners at a step boundary.
    fn scale_up(&mut self) -> Result<(), SimError> {
        let mut nodes = self.with_joiners(self.used.clone());
        let usable = self.nodes_usable(nodes.len());
        if usable <= self.used.len() {
            return Ok(());
        }
        nodes.truncate(usable);
        let p = self.p;
        p.scale_up(self, nodes)
    }
}

#[cfg(test)]
mod tests;
