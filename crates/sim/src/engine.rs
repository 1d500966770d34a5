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

use std::collections::BTreeMap;

use lazarus_plan::{plan_model, plan_reconfiguration, ClusterShape, ModelPlan, NodeState, Placement, PlanPolicy};
use serde::Serialize;

use crate::cost::{CostModel, ModelSpec};
use crate::error::SimError;
use crate::loads::{LoadCursor, LoadModel};
use crate::trace::{Change, Trace};

/// What the simulated system does about failures (§6.1 baselines).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Policy {
    /// Adaptive replicas and fault-tolerant placement; reconfigure while every expert keeps a
    /// replica, restart from the last checkpoint otherwise; rebalance periodically.
    Lazarus,
    /// DeepSpeed-MoE: static expert parallelism on a multiple of the EP size of nodes, frequent
    /// checkpoints to remote storage, restart on every failure.
    Ds,
    /// DeepSpeed-MoE with Lazarus's reconfiguration: reconfigure while a full copy of the experts
    /// survives among the nodes in use, restart otherwise.
    DsFt,
}

impl Policy {
    pub fn name(self) -> &'static str {
        match self {
            Policy::Lazarus => "lazarus",
            Policy::Ds => "ds",
            Policy::DsFt => "ds-ft",
        }
    }
}

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
}

/// Where the wall time went. The fields add up to the simulated duration.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Breakdown {
    /// Steps that count (not rolled back).
    pub compute_s: f64,
    pub checkpoint_s: f64,
    /// Relaunch and checkpoint loading (and the failure time-out before it).
    pub restart_s: f64,
    /// Steps later rolled back by a restart, and steps a failure interrupted.
    pub lost_work_s: f64,
    /// Failure time-out, group rebuild and state transfers of reconfigurations and scale-ups.
    pub reconfig_s: f64,
    pub rebalance_s: f64,
    /// No usable configuration (too few nodes).
    pub idle_s: f64,
}

impl Breakdown {
    pub fn total(&self) -> f64 {
        self.compute_s + self.checkpoint_s + self.restart_s + self.lost_work_s + self.reconfig_s + self.rebalance_s + self.idle_s
    }
}

/// One point of the throughput / progress curves.
#[derive(Debug, Clone, Serialize)]
pub struct SeriesPoint {
    pub t_s: f64,
    pub samples_per_s: f64,
    pub cumulative_samples: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct PolicyReport {
    pub policy: Policy,
    pub trained_samples: f64,
    pub avg_samples_per_s: f64,
    pub steps: u64,
    pub restarts: u64,
    pub reconfigurations: u64,
    pub rebalances: u64,
    pub checkpoints: u64,
    pub breakdown: Breakdown,
    /// Binned curves for plots.
    pub series: Vec<SeriesPoint>,
    /// Times (s) at which nodes in use failed.
    pub failures_s: Vec<f64>,
    /// (time s, nodes in use) at every configuration change (0 = none usable).
    pub nodes_in_use: Vec<(f64, usize)>,
}

#[derive(Debug, Clone)]
enum Config {
    /// The plan of every layer over `used` (plan node i = used[i]).
    Lazarus(ModelPlan),
    /// Static expert parallelism: groups of `ep_nodes` nodes, node i holds block i % ep_nodes.
    Ep { ep_nodes: usize, experts_per_node: usize },
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Busy {
    Checkpoint,
    Restart,
    Reconfig,
    Rebalance,
}

struct Run<'a> {
    s: &'a Scenario,
    policy: Policy,
    now: f64,
    /// Live nodes in join order, with the time each may first be used.
    alive: Vec<(String, f64)>,
    used: Vec<String>,
    config: Option<Config>,
    /// Step time of the current configuration and load epoch.
    step_s: Option<(u64, f64)>,
    step: u64,
    partial_s: f64,
    samples: f64,
    ckpt_step: u64,
    ckpt_samples: f64,
    compute_since_ckpt: f64,
    busy: Option<(Busy, f64)>,
    /// A checkpoint due at the same step as a rebalance or scale-up, taken after it.
    pending_checkpoint: bool,
    b: Breakdown,
    restarts: u64,
    reconfigurations: u64,
    rebalances: u64,
    checkpoints: u64,
    /// (t0, t1, samples completed) of every training stretch, for the curves.
    stretches: Vec<(f64, f64, f64)>,
    /// (t, samples rolled back).
    rollbacks: Vec<(f64, f64)>,
    failures: Vec<f64>,
    nodes_in_use: Vec<(f64, usize)>,
    /// DS-FT: live nodes it dropped when regrouping after a failure; it never takes them back
    /// (§6.2: "it does not use previously dropped nodes").
    retired: Vec<String>,
    loads: std::cell::RefCell<LoadCursor>,
}

/// Simulate `scenario` under `policy`.
pub fn simulate(scenario: &Scenario, policy: Policy) -> Result<PolicyReport, SimError> {
    scenario.model.validate()?;
    scenario.cost.validate()?;
    if scenario.max_nodes == 0 {
        return Err(SimError::invalid("max_nodes", 0, "must be ≥ 1"));
    }
    if !scenario.duration_s.is_finite() || scenario.duration_s <= 0.0 {
        return Err(SimError::invalid("duration", scenario.duration_s, "must be > 0 s"));
    }
    let mut run = Run {
        s: scenario,
        policy,
        now: 0.0,
        alive: Vec::new(),
        used: Vec::new(),
        config: None,
        step_s: None,
        step: 0,
        partial_s: 0.0,
        samples: 0.0,
        ckpt_step: 0,
        ckpt_samples: 0.0,
        compute_since_ckpt: 0.0,
        busy: None,
        pending_checkpoint: false,
        b: Breakdown::default(),
        restarts: 0,
        reconfigurations: 0,
        rebalances: 0,
        checkpoints: 0,
        stretches: Vec::new(),
        rollbacks: Vec::new(),
        failures: Vec::new(),
        nodes_in_use: Vec::new(),
        retired: Vec::new(),
        loads: std::cell::RefCell::new(LoadCursor::new(scenario.loads.clone(), scenario.model.layers, scenario.model.experts)),
    };
    // Group trace events by time.
    let mut groups: Vec<(f64, Vec<(Change, String)>)> = Vec::new();
    for ev in &scenario.trace.events {
        let t = ev.ms as f64 / 1000.0;
        if t >= scenario.duration_s {
            break;
        }
        match groups.last_mut() {
            Some((gt, v)) if *gt == t => v.push((ev.change, ev.node.clone())),
            _ => groups.push((t, vec![(ev.change, ev.node.clone())])),
        }
    }
    let mut gi = 0;
    // The nodes present at the start form the first configuration, free of charge.
    if let Some((t, v)) = groups.first() {
        if *t == 0.0 {
            for (c, n) in v {
                run.membership(*c, n, true);
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
            run.b.idle_s += t - run.now;
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
        // Joiners are taken at the first step boundary after they are ready.
        let t_scale_boundary = if t_scale.is_finite() {
            let wait = (t_scale - run.now).max(0.0) + run.partial_s;
            run.now + (wait / step_s).ceil() * step_s - run.partial_s
        } else {
            f64::INFINITY
        };
        let t = t_event.min(end).min(t_boundary).min(t_scale_boundary);
        run.train_until(t, step_s);
        // At a checkpoint/rebalance boundary: joiners due by now are taken first (their
        // reconfiguration replans anyway) and the checkpoint follows it; otherwise the boundary's
        // own work. Events at the same instant are then taken by the busy branch at zero
        // elapsed time.
        if t == t_boundary {
            if t_scale_boundary <= t_boundary {
                run.pending_checkpoint = run.policy != Policy::Ds && run.step.is_multiple_of(run.checkpoint_every());
                run.scale_up()?;
                if run.busy.is_none() {
                    run.pending_checkpoint = false;
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
            run.scale_up()?;
        }
    }
    // A step still running at the end never finished.
    run.b.lost_work_s += run.partial_s;
    run.partial_s = 0.0;
    Ok(run.report())
}

impl Run<'_> {
    fn cost(&self) -> &CostModel {
        &self.s.cost
    }

    fn charge(&mut self, kind: Busy, dt: f64) {
        match kind {
            Busy::Checkpoint => self.b.checkpoint_s += dt,
            Busy::Restart => self.b.restart_s += dt,
            Busy::Reconfig => self.b.reconfig_s += dt,
            Busy::Rebalance => self.b.rebalance_s += dt,
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
            }
        }
    }

    /// Live nodes that may be used now, in join order, up to the cap.
    fn usable(&self) -> Vec<String> {
        self.alive
            .iter()
            .filter(|(n, ready)| *ready <= self.now && !self.retired.contains(n))
            .map(|(n, _)| n.clone())
            .take(self.s.max_nodes)
            .collect()
    }

    /// When waiting joiners would let the policy use more nodes (∞ if never).
    fn scale_up_time(&self) -> f64 {
        let in_use = self.used.len();
        let mut ready: Vec<f64> =
            self.alive.iter().filter(|(n, _)| !self.used.contains(n) && !self.retired.contains(n)).map(|(_, r)| *r).collect();
        ready.sort_by(f64::total_cmp);
        for (k, &r) in ready.iter().enumerate() {
            let count = (in_use + k + 1).min(self.s.max_nodes);
            if self.nodes_usable(count) > in_use {
                return r.max(self.now);
            }
        }
        f64::INFINITY
    }

    /// How many of `n` nodes the policy can use.
    fn nodes_usable(&self, n: usize) -> usize {
        match self.policy {
            Policy::Lazarus => {
                if n * self.cost().gpus_per_node * self.cost().slots_per_gpu >= self.s.model.experts {
                    n
                } else {
                    0
                }
            }
            Policy::Ds | Policy::DsFt => {
                let ep = self.ep_nodes();
                (n / ep) * ep
            }
        }
    }

    /// Nodes per EP group of the static baselines: experts per GPU is the largest divisor of E
    /// that fits the slots (§6.1: GPT-S and GPT-L use 4 of 6 slots, GPT-M all 6).
    fn ep_nodes(&self) -> usize {
        let (e, slots, g) = (self.s.model.experts, self.cost().slots_per_gpu, self.cost().gpus_per_node);
        let per_gpu = (1..=slots.min(e)).rev().find(|s| e % s == 0).unwrap_or(1);
        (e / per_gpu).div_ceil(g)
    }

    fn experts_per_node(&self) -> usize {
        self.s.model.experts.div_ceil(self.ep_nodes())
    }

    fn epoch(&self) -> u64 {
        self.step / self.cost().rebalance_every
    }

    fn loads(&self, epoch: u64) -> Vec<Vec<f64>> {
        self.loads.borrow_mut().at(epoch)
    }

    /// Lazarus's plan for `n` nodes from the loads of `epoch`: the scheduler every other part
    /// of Lazarus uses (Eq. 1 allocation with floor f, lowered when slots run short;
    /// fault-tolerant placement, unguarded — the simulator models Algorithm 1's per-replica
    /// shares). Layers whose allocation is unchanged keep their placement.
    fn lazarus_plan(&self, n: usize, epoch: u64) -> Result<ModelPlan, SimError> {
        let c = self.cost();
        let shape = ClusterShape::new(n, c.gpus_per_node, c.slots_per_gpu)?;
        let previous = match &self.config {
            Some(Config::Lazarus(p)) => Some(p),
            _ => None,
        };
        Ok(plan_model(&self.loads(epoch), shape, &PlanPolicy::unguarded(c.min_replicas), previous)?)
    }

    /// Seconds per step: the balanced step stretched by the most loaded GPU of each layer
    /// (per-replica shares, Algorithm 1), averaged over layers.
    fn step_time(&mut self) -> Result<f64, SimError> {
        let epoch = self.epoch();
        if let Some((e, s)) = self.step_s {
            if e == epoch {
                return Ok(s);
            }
        }
        let loads = self.loads(epoch);
        let g = self.cost().gpus_per_node;
        let mut imbalance = 0.0;
        match self.config.as_ref() {
            Some(Config::Lazarus(plan)) => {
                for (p, l) in plan.layers().iter().zip(&loads) {
                    let r = p.replica_counts();
                    let mut worst = 0.0f64;
                    for node in 0..p.shape().nodes {
                        for gpu in 0..g {
                            let load: f64 = p.gpu(node, gpu).iter().map(|&e| l[e] / r[e] as f64).sum();
                            worst = worst.max(load);
                        }
                    }
                    imbalance += worst * p.shape().ranks() as f64;
                }
            }
            Some(Config::Ep { ep_nodes, experts_per_node }) => {
                let per_gpu = experts_per_node.div_ceil(g);
                let gpus = ep_nodes * g;
                for l in &loads {
                    let worst = l.chunks(per_gpu).map(|c| c.iter().sum::<f64>()).fold(0.0, f64::max);
                    imbalance += worst * gpus as f64;
                }
            }
            None => return Ok(f64::INFINITY),
        }
        imbalance /= loads.len().max(1) as f64;
        let m = &self.s.model;
        let s = m.balanced_step_s * ((1.0 - m.expert_fraction) + m.expert_fraction * imbalance.max(1.0));
        self.step_s = Some((epoch, s));
        Ok(s)
    }

    fn samples_per_step(&self) -> f64 {
        (self.used.len() * self.cost().gpus_per_node * self.cost().samples_per_gpu) as f64
    }

    fn checkpoint_every(&self) -> u64 {
        match self.policy {
            Policy::Ds => self.cost().checkpoint_every_ds,
            Policy::DsFt => self.cost().checkpoint_every_ds_ft,
            Policy::Lazarus => self.cost().checkpoint_every_lazarus,
        }
    }

    /// Whole steps until the next checkpoint or rebalance.
    fn steps_to_boundary(&self) -> u64 {
        let k = self.checkpoint_every();
        let mut next = (self.step / k + 1) * k;
        if self.policy == Policy::Lazarus {
            let r = self.cost().rebalance_every;
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
        self.b.compute_s += kept;
        self.compute_since_ckpt += kept;
        if dt > 0.0 {
            self.stretches.push((self.now, t, gained));
        }
        self.now = t;
    }

    fn at_boundary(&mut self) -> Result<(), SimError> {
        let ck = self.checkpoint_every();
        if self.policy == Policy::Lazarus && self.step.is_multiple_of(self.cost().rebalance_every) {
            self.rebalance()?;
            if self.step.is_multiple_of(ck) {
                // Checkpoint right after the rebalance: both are due at this step.
                self.pending_checkpoint = true;
            }
            return Ok(());
        }
        if self.step.is_multiple_of(ck) {
            self.begin(Busy::Checkpoint, self.cost().checkpoint_s(&self.s.model));
        }
        Ok(())
    }

    fn begin(&mut self, kind: Busy, seconds: f64) {
        self.busy = Some((kind, self.now + seconds));
        self.note_nodes();
    }

    fn note_nodes(&mut self) {
        let n = if self.config.is_some() { self.used.len() } else { 0 };
        if self.nodes_in_use.last().map(|x| x.1) != Some(n) {
            self.nodes_in_use.push((self.now, n));
        }
    }

    fn finish_busy(&mut self, kind: Busy) {
        match kind {
            Busy::Checkpoint => {
                self.checkpoints += 1;
                self.ckpt_step = self.step;
                self.ckpt_samples = self.samples;
                self.compute_since_ckpt = 0.0;
            }
            Busy::Rebalance | Busy::Reconfig if self.pending_checkpoint => {
                self.pending_checkpoint = false;
                self.begin(Busy::Checkpoint, self.cost().checkpoint_s(&self.s.model));
            }
            _ => {}
        }
    }
}

impl Run<'_> {
    /// The plan epoch: loads measured over the last finished epoch (the first at the start).
    fn plan_epoch(&self) -> u64 {
        self.epoch().saturating_sub(1)
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
        self.config = Some(match self.policy {
            Policy::Lazarus => Config::Lazarus(self.lazarus_plan(n, self.plan_epoch())?),
            Policy::Ds | Policy::DsFt => Config::Ep { ep_nodes: self.ep_nodes(), experts_per_node: self.experts_per_node() },
        });
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
            let c = self.cost();
            let t = c.restart_s + c.checkpoint_s(&self.s.model);
            self.begin(Busy::Restart, t);
        }
        Ok(())
    }

    fn apply_events(&mut self, events: &[(Change, String)]) -> Result<(), SimError> {
        let mut failed = Vec::new();
        for (c, n) in events {
            if *c == Change::Remove && self.used.contains(n) {
                failed.push(n.clone());
            }
            self.membership(*c, n, false);
        }
        if failed.is_empty() {
            return Ok(());
        }
        self.failures.push(self.now);
        // The step in flight is abandoned everywhere; a checkpoint being written never completes.
        self.b.lost_work_s += self.partial_s;
        self.partial_s = 0.0;
        self.busy = None;
        self.pending_checkpoint = false;
        let survivors: Vec<String> = self.used.iter().filter(|n| !failed.contains(n)).cloned().collect();
        match self.policy {
            Policy::Lazarus => {
                let recoverable = match &self.config {
                    Some(Config::Lazarus(plan)) if !survivors.is_empty() => {
                        let failed_nodes: Vec<usize> = (0..self.used.len()).filter(|&i| failed.contains(&self.used[i])).collect();
                        plan.survives(&failed_nodes)
                    }
                    _ => false,
                };
                if recoverable {
                    let mut nodes = survivors;
                    for n in self.usable() {
                        if !nodes.contains(&n) && nodes.len() < self.s.max_nodes {
                            nodes.push(n);
                        }
                    }
                    if self.nodes_usable(nodes.len()) == nodes.len() {
                        return self.reconfigure_lazarus(nodes, Busy::Reconfig, true);
                    }
                }
                self.restart()
            }
            Policy::Ds => self.restart(),
            Policy::DsFt => {
                let ep = self.ep_nodes();
                let full_copy = (0..ep).all(|b| (0..self.used.len()).any(|i| i % ep == b && !failed.contains(&self.used[i])));
                if full_copy && survivors.len() >= ep {
                    self.reconfigure_ep(survivors, true)
                } else {
                    self.restart()
                }
            }
        }
    }

    /// Roll back to the last checkpoint and relaunch on the usable nodes.
    fn restart(&mut self) -> Result<(), SimError> {
        self.b.lost_work_s += self.compute_since_ckpt;
        self.b.compute_s -= self.compute_since_ckpt;
        self.compute_since_ckpt = 0.0;
        self.rollbacks.push((self.now, self.samples - self.ckpt_samples));
        self.step = self.ckpt_step;
        self.samples = self.ckpt_samples;
        self.restarts += 1;
        self.retired.clear();
        self.fresh_config()?;
        if self.config.is_some() {
            let c = self.cost();
            let t = c.failure_timeout_s + c.restart_s + c.checkpoint_s(&self.s.model);
            self.begin(Busy::Restart, t);
        }
        Ok(())
    }

    /// Move Lazarus to a new plan on `nodes` (survivors first, then joiners): the live nodes are
    /// mapped onto the plan's nodes and the missing expert states fetched from live holders
    /// (`plan_reconfiguration`), the slowest link setting the transfer time.
    fn reconfigure_lazarus(&mut self, nodes: Vec<String>, kind: Busy, after_failure: bool) -> Result<(), SimError> {
        let n = nodes.len();
        let new = self.lazarus_plan(n, self.plan_epoch())?;
        let layers = new.layers().len();
        let bytes = self.s.model.expert_state_bytes;
        // Where each of the nodes sits in the current plan (None: it holds nothing).
        let old: &[Placement] = match &self.config {
            Some(Config::Lazarus(old)) => old.layers(),
            _ => &[],
        };
        let old_index: Vec<Option<usize>> =
            nodes.iter().map(|name| self.used.iter().position(|u| u == name).filter(|_| !old.is_empty())).collect();
        let (order, transfer_s) = if n * layers <= 4096 {
            let live: Vec<NodeState> = old_index
                .iter()
                .enumerate()
                .map(|(i, o)| NodeState {
                    node: i as u64,
                    experts: o.map(|o| old.iter().map(|p| p.nodes()[o].clone()).collect()).unwrap_or_default(),
                })
                .collect();
            let rp = plan_reconfiguration(&live, new.layers(), &vec![bytes as u64; layers])?;
            let mut sent: BTreeMap<u64, f64> = BTreeMap::new();
            let mut recv: BTreeMap<u64, f64> = BTreeMap::new();
            for t in &rp.transfers {
                *sent.entry(t.from).or_default() += t.bytes as f64;
                *recv.entry(t.to).or_default() += t.bytes as f64;
            }
            let worst = sent.values().chain(recv.values()).cloned().fold(0.0, f64::max);
            let order: Vec<String> = rp.plan_to_node.iter().map(|&p| nodes[p as usize].clone()).collect();
            (order, self.cost().transfer_s(worst))
        } else {
            // Large clusters: keep each node on its own index and count what it lacks (the exact
            // assignment is O(N³) per event).
            let mut worst = 0.0f64;
            // have[e] == stamp: the node holds expert e in the layer being looked at.
            let mut have = vec![0u32; self.s.model.experts];
            let mut stamp = 0u32;
            for (i, o) in old_index.iter().enumerate() {
                let mut need = 0usize;
                for (l, p) in new.layers().iter().enumerate() {
                    stamp += 1;
                    if let (Some(o), Some(was)) = (o, old.get(l)) {
                        was.nodes()[*o].iter().for_each(|&e| have[e] = stamp);
                    }
                    for &e in &p.nodes()[i] {
                        if have[e] != stamp {
                            need += 1;
                            have[e] = stamp;
                        }
                    }
                }
                worst = worst.max(need as f64 * bytes);
            }
            (nodes.clone(), self.cost().transfer_s(worst))
        };
        self.used = order;
        self.config = Some(Config::Lazarus(new));
        self.step_s = None;
        let c = self.cost();
        let fixed = match kind {
            Busy::Rebalance => c.rebalance_s,
            _ => c.group_rebuild_s + if after_failure { c.failure_timeout_s } else { 0.0 },
        };
        match kind {
            Busy::Rebalance => self.rebalances += 1,
            _ => self.reconfigurations += 1,
        }
        self.begin(kind, fixed + transfer_s);
        Ok(())
    }

    /// DS-FT: regroup `nodes` into complete EP groups; nodes whose expert block changes fetch it.
    fn reconfigure_ep(&mut self, nodes: Vec<String>, after_failure: bool) -> Result<(), SimError> {
        let ep = self.ep_nodes();
        let groups = nodes.len() / ep;
        if groups == 0 {
            return self.restart();
        }
        let block_of = |name: &String| self.used.iter().position(|u| u == name).map(|i| i % ep);
        let mut slots: Vec<Vec<String>> = vec![Vec::new(); ep];
        let mut movers: Vec<String> = Vec::new();
        for n in &nodes {
            match block_of(n) {
                Some(b) if slots[b].len() < groups => slots[b].push(n.clone()),
                _ => movers.push(n.clone()),
            }
        }
        let mut fetch = false;
        for slot in slots.iter_mut() {
            while slot.len() < groups {
                match movers.pop() {
                    Some(m) => {
                        slot.push(m);
                        fetch = true;
                    }
                    None => break,
                }
            }
        }
        let mut used = Vec::with_capacity(groups * ep);
        for g in 0..groups {
            for slot in &slots {
                if let Some(n) = slot.get(g) {
                    used.push(n.clone());
                }
            }
        }
        if used.len() != groups * ep {
            return self.restart();
        }
        if after_failure {
            self.retired.extend(nodes.iter().filter(|n| !used.contains(n)).cloned());
        }
        self.used = used;
        self.config = Some(Config::Ep { ep_nodes: ep, experts_per_node: self.experts_per_node() });
        self.step_s = None;
        self.reconfigurations += 1;
        let c = self.cost();
        let transfer = if fetch {
            c.transfer_s(self.experts_per_node() as f64 * self.s.model.layers as f64 * self.s.model.expert_state_bytes)
        } else {
            0.0
        };
        let t = c.group_rebuild_s + if after_failure { c.failure_timeout_s } else { 0.0 } + transfer;
        self.begin(Busy::Reconfig, t);
        Ok(())
    }

    fn rebalance(&mut self) -> Result<(), SimError> {
        let nodes = self.used.clone();
        self.reconfigure_lazarus(nodes, Busy::Rebalance, false)
    }

    /// Take waiting joiners at a step boundary.
    fn scale_up(&mut self) -> Result<(), SimError> {
        let mut nodes = self.used.clone();
        for n in self.usable() {
            if !nodes.contains(&n) && nodes.len() < self.s.max_nodes {
                nodes.push(n);
            }
        }
        let usable = self.nodes_usable(nodes.len());
        if usable <= self.used.len() {
            return Ok(());
        }
        nodes.truncate(usable);
        match self.policy {
            Policy::Lazarus => self.reconfigure_lazarus(nodes, Busy::Reconfig, false),
            Policy::DsFt => self.reconfigure_ep(nodes, false),
            Policy::Ds => {
                // Save, relaunch on more nodes, load: nothing is rolled back.
                self.ckpt_step = self.step;
                self.ckpt_samples = self.samples;
                self.compute_since_ckpt = 0.0;
                self.checkpoints += 1;
                self.restarts += 1;
                self.used = nodes;
                self.step_s = None;
                let c = self.cost();
                let t = 2.0 * c.checkpoint_s(&self.s.model) + c.restart_s;
                self.begin(Busy::Restart, t);
                Ok(())
            }
        }
    }

    fn report(&self) -> PolicyReport {
        let d = self.s.duration_s;
        let bins = 300usize;
        let width = d / bins as f64;
        let mut gross = vec![0.0f64; bins];
        for &(t0, t1, gained) in &self.stretches {
            if t1 <= t0 || gained == 0.0 {
                continue;
            }
            let rate = gained / (t1 - t0);
            let (b0, b1) = ((t0 / width) as usize, ((t1 / width).ceil() as usize).min(bins));
            for (b, g) in gross.iter_mut().enumerate().take(b1).skip(b0) {
                let (lo, hi) = (b as f64 * width, (b + 1) as f64 * width);
                let overlap = t1.min(hi) - t0.max(lo);
                if overlap > 0.0 {
                    *g += rate * overlap;
                }
            }
        }
        let mut series = Vec::with_capacity(bins);
        let (mut cum, mut rb) = (0.0, 0usize);
        for (b, g) in gross.iter().enumerate() {
            let t = (b + 1) as f64 * width;
            cum += g;
            while rb < self.rollbacks.len() && self.rollbacks[rb].0 <= t {
                cum -= self.rollbacks[rb].1;
                rb += 1;
            }
            series.push(SeriesPoint { t_s: t, samples_per_s: g / width, cumulative_samples: cum.max(0.0) });
        }
        PolicyReport {
            policy: self.policy,
            trained_samples: self.samples,
            avg_samples_per_s: self.samples / d,
            steps: self.step,
            restarts: self.restarts,
            reconfigurations: self.reconfigurations,
            rebalances: self.rebalances,
            checkpoints: self.checkpoints,
            breakdown: self.b.clone(),
            series,
            failures_s: self.failures.clone(),
            nodes_in_use: self.nodes_in_use.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scenario(model: &str, trace: Trace, minutes: f64) -> Scenario {
        Scenario {
            trace,
            model: ModelSpec::preset(model).unwrap(),
            cost: CostModel::default(),
            loads: LoadModel::default(),
            max_nodes: 10,
            duration_s: minutes * 60.0,
        }
    }

    fn all(s: &Scenario) -> Vec<PolicyReport> {
        [Policy::Lazarus, Policy::Ds, Policy::DsFt].iter().map(|&p| simulate(s, p).unwrap()).collect()
    }

    fn p3() -> Option<Trace> {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/traces/p3-trace.csv");
        match std::fs::read_to_string(path) {
            Ok(text) => Some(Trace::parse_bamboo(&text, "p3-trace.csv").unwrap()),
            Err(_) => {
                eprintln!("skipping the P3 spot trace: {path} is absent");
                None
            }
        }
    }

    #[test]
    fn the_breakdown_adds_up_to_the_wall_time() {
        let mut cases = vec![
            scenario("gpt-s", Trace::fail_every(10, 300_000, 5, 1), 30.0),
            scenario("gpt-l", Trace::fail_every(10, 300_000, 5, 1), 30.0),
            scenario("gpt-m", Trace::fail_at_once(10, 4, 600_000, 2), 30.0),
            scenario("gpt-l", Trace::poisson(10, 1_200_000.0, 300_000, 7_200_000, 3), 120.0),
        ];
        if let Some(t) = p3() {
            cases.push(scenario("gpt-l", t.window(0, 4_800_000), 80.0));
        }
        for s in &cases {
            for r in all(s) {
                let total = r.breakdown.total();
                assert!(
                    (total - s.duration_s).abs() < 1e-6 * s.duration_s,
                    "{:?}: {total} vs {} ({:?})",
                    r.policy,
                    s.duration_s,
                    r.breakdown
                );
                assert!(r.breakdown.compute_s >= -1e-6 && r.breakdown.lost_work_s >= 0.0);
                assert!(r.trained_samples >= 0.0);
            }
        }
    }

    #[test]
    fn ds_only_ever_trains_on_a_multiple_of_its_ep_size() {
        // GPT-L: 16 experts, 4 per GPU → EP groups of 4 nodes.
        let mut traces = vec![Trace::fail_every(10, 300_000, 5, 4), Trace::poisson(10, 900_000.0, 300_000, 5_400_000, 5)];
        if let Some(t) = p3() {
            traces.push(t.window(0, 4_800_000));
        }
        for t in traces {
            for p in [Policy::Ds, Policy::DsFt] {
                let r = simulate(&scenario("gpt-l", t.clone(), 90.0), p).unwrap();
                assert!(r.nodes_in_use.iter().all(|&(_, n)| n % 4 == 0), "{p:?}: {:?}", r.nodes_in_use);
                assert!(r.nodes_in_use.iter().any(|&(_, n)| n == 8), "{p:?} uses 8 of 10 nodes at the start");
            }
        }
    }

    #[test]
    fn lazarus_never_restarts_while_every_expert_keeps_a_replica() {
        // One failure at a time down to half the nodes, with a floor of 2 replicas: never a
        // lost expert, so never a restart; every failure is a reconfiguration.
        for model in ["gpt-s", "gpt-m", "gpt-l"] {
            let r = simulate(&scenario(model, Trace::fail_every(10, 300_000, 5, 6), 30.0), Policy::Lazarus).unwrap();
            assert_eq!(r.restarts, 0, "{model}");
            assert_eq!(r.reconfigurations, 5, "{model}");
            assert!(r.breakdown.lost_work_s > 0.0, "interrupted steps are lost work");
        }
        // Nine of ten nodes at once: some expert loses every replica, so it must restart.
        let r = simulate(&scenario("gpt-l", Trace::fail_at_once(10, 9, 600_000, 1), 20.0), Policy::Lazarus).unwrap();
        assert_eq!(r.restarts, 1);
    }

    #[test]
    fn lazarus_beats_ds_under_frequent_failures_and_uses_every_node() {
        let s = scenario("gpt-l", Trace::fail_every(10, 300_000, 5, 1), 30.0);
        let r = all(&s);
        assert!(r[0].trained_samples > 2.0 * r[1].trained_samples, "lazarus {} vs ds {}", r[0].trained_samples, r[1].trained_samples);
        assert!(r[0].trained_samples > r[2].trained_samples);
        assert_eq!(r[0].nodes_in_use.first().map(|x| x.1), Some(10));
        assert!(r[1].restarts >= 5, "ds restarts on every failure");
    }

    #[test]
    fn a_checkpoint_due_when_a_joiner_is_taken_is_still_taken() {
        // Checkpoint after every step, so the step boundary where a joiner is taken is always
        // also a checkpoint boundary. One node fails at 30 s (the checkpoint in flight is lost)
        // and the run ends during a checkpoint; a spare joins at 40 s. Every other step must
        // have its checkpoint, the scale-up's included.
        let mut text = String::new();
        for n in 0..10 {
            text.push_str(&format!("0,add,n{n}\n"));
        }
        text.push_str("30000,remove,n3\n40000,add,spare\n");
        let mut s = scenario("gpt-s", Trace::parse_bamboo(&text, "t").unwrap(), 2.0);
        s.cost.checkpoint_every_lazarus = 1;
        s.cost.scale_up_wait_s = 0.0;
        let r = simulate(&s, Policy::Lazarus).unwrap();
        assert_eq!(r.reconfigurations, 2, "the failure and the scale-up");
        assert!(r.checkpoints + 2 >= r.steps, "{} checkpoints for {} steps", r.checkpoints, r.steps);

        // Exact timing: 0.5 s steps (no imbalance), near-free checkpoints every 4 steps, no
        // rebalance. A spare joins at 3.7 s, so it is taken at the 4.0 s boundary — step 8, a
        // checkpoint step. That checkpoint must follow the scale-up: one per 4 steps, exactly.
        let mut text = String::new();
        for n in 0..4 {
            text.push_str(&format!("0,add,n{n}\n"));
        }
        text.push_str("3700,add,spare\n");
        let mut s = scenario("gpt-s", Trace::parse_bamboo(&text, "t").unwrap(), 0.5);
        s.model.expert_fraction = 0.0;
        s.model.params = 1e3;
        s.cost.checkpoint_every_lazarus = 4;
        s.cost.rebalance_every = 1_000_000;
        s.cost.scale_up_wait_s = 0.0;
        let r = simulate(&s, Policy::Lazarus).unwrap();
        assert_eq!(r.reconfigurations, 1);
        assert_eq!(r.checkpoints, r.steps / 4, "{} checkpoints for {} steps", r.checkpoints, r.steps);
    }

    #[test]
    fn bad_scenarios_are_rejected() {
        let mut s = scenario("gpt-s", Trace::fail_every(4, 60_000, 2, 1), 5.0);
        s.max_nodes = 0;
        assert!(simulate(&s, Policy::Lazarus).unwrap_err().to_string().contains("max_nodes"));
        assert!(ModelSpec::preset("gpt-xl").unwrap_err().to_string().contains("gpt-xl"));
        let mut s = scenario("gpt-s", Trace::fail_every(4, 60_000, 2, 1), 5.0);
        s.cost.storage_gbps = 0.0;
        assert!(simulate(&s, Policy::Ds).unwrap_err().to_string().contains("storage_gbps"));
    }
}
