//! The cost model: every time the simulator charges comes from a parameter here, with defaults
//! from the paper's testbed (§6.1): 10 single-GPU nodes with 6 expert slots each, 100 Gbps
//! network, checkpoints to NFS over 10 Gbps, reconfiguration 20–40 s of which 10–20 s is the
//! NCCL time-out, per-GPU batch 4 × 1024 tokens, checkpoints every 50 (DS) / 250 (DS-FT,
//! Lazarus) steps, rebalancing every 200 steps.

use lazarus_decide::JoinRule;
use serde::{Serialize, Serializer};

use crate::error::SimError;

/// Most MoE layers a simulated model may have.
pub const MAX_LAYERS: usize = 4096;
/// Most experts per layer.
pub const MAX_EXPERTS: usize = 65_536;
/// Most layers × experts (4 Mi): every plan, load epoch and transfer count of the simulation is
/// then bounded.
pub const MAX_LAYER_EXPERTS: usize = 1 << 22;
/// Shortest balanced step time (1 ms), so that a run of bounded duration has a bounded number
/// of steps.
pub const MIN_STEP_S: f64 = 1e-3;
/// Largest state of one expert of one layer (1 TB): byte counts of whole reconfigurations then
/// fit 64-bit integers.
pub const MAX_EXPERT_STATE_BYTES: f64 = 1e12;
/// Most GPUs per node × slots per GPU ([`lazarus_plan::placement::MAX_SLOTS`]): with at most
/// `MAX_NODES` nodes, every slot count fits a `usize`.
pub const MAX_NODE_SLOTS: usize = lazarus_plan::placement::MAX_SLOTS;
/// Most samples per GPU per step.
pub const MAX_SAMPLES_PER_GPU: usize = 1 << 20;

/// A model of Table 1, plus the two numbers the paper gives only in prose (expert state size)
/// and the ones it does not give at all (step time, expert share), which are our assumptions.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelSpec {
    pub name: String,
    pub layers: usize,
    pub d_model: usize,
    pub experts: usize,
    pub params: f64,
    /// Weights + optimizer state of one expert of one layer, bytes (§6.3: 63 MB GPT-S, 112 MB GPT-L).
    pub expert_state_bytes: f64,
    /// Seconds per step when every GPU has the same expert load (assumed: 0.5 s GPT-S,
    /// 0.75 s GPT-M/L, consistent with the 2,926 and 1,996 steps in 30 min of Fig. 6).
    pub balanced_step_s: f64,
    /// Share of a balanced step spent in expert FFNs (assumed 0.5); the rest does not depend on
    /// the expert load.
    pub expert_fraction: f64,
}

impl ModelSpec {
    pub fn preset(name: &str) -> Result<Self, SimError> {
        let (layers, d_model, experts, params, state_mb, step) = match name {
            "gpt-s" => (12, 768, 8, 521e6, 63.0, 0.5),
            "gpt-m" => (12, 1024, 12, 1.3e9, 112.0, 0.75),
            "gpt-l" => (12, 1024, 16, 1.7e9, 112.0, 0.75),
            // DeepSeek-V3 (its technical report, 2024): 58 MoE layers of 61, 256 routed experts
            // of 3 × 7168 × 2048 weights each (16 bytes of state per weight: 705 MB), 671 B
            // parameters. Its step is our assumption: 4 sequences of 4,096 tokens per GPU at
            // the report's 1,543 tokens per GPU-second (14.8 T tokens in 2.664 M GPU-hours).
            "deepseek-v3" => (58, 7168, 256, 671e9, 3.0 * 7168.0 * 2048.0 * 16.0 / 1e6, 4.0 * 4096.0 / 1543.0),
            other => return Err(SimError::invalid("model", other, "expected gpt-s, gpt-m, gpt-l or deepseek-v3")),
        };
        Ok(ModelSpec {
            name: name.to_string(),
            layers,
            d_model,
            experts,
            params,
            expert_state_bytes: state_mb * 1e6,
            balanced_step_s: step,
            expert_fraction: 0.5,
        })
    }

    pub fn validate(&self) -> Result<(), SimError> {
        if self.layers == 0 || self.experts == 0 {
            return Err(SimError::invalid("model", format!("{} layers × {} experts", self.layers, self.experts), "both must be ≥ 1"));
        }
        if self.layers > MAX_LAYERS {
            return Err(SimError::invalid("model.layers", self.layers, format!("at most {MAX_LAYERS} MoE layers are supported")));
        }
        if self.experts > MAX_EXPERTS {
            return Err(SimError::invalid("model.experts", self.experts, format!("at most {MAX_EXPERTS} experts per layer are supported")));
        }
        if self.layers * self.experts > MAX_LAYER_EXPERTS {
            return Err(SimError::invalid(
                "model",
                format!("{} layers × {} experts", self.layers, self.experts),
                format!("at most {MAX_LAYER_EXPERTS} experts in all layers together are supported"),
            ));
        }
        for (field, v) in [
            ("model.params", self.params),
            ("model.expert_state_bytes", self.expert_state_bytes),
            ("model.balanced_step_s", self.balanced_step_s),
        ] {
            if !v.is_finite() || v <= 0.0 {
                return Err(SimError::invalid(field, v, "must be finite and > 0"));
            }
        }
        if self.expert_state_bytes > MAX_EXPERT_STATE_BYTES {
            return Err(SimError::invalid(
                "model.expert_state_bytes",
                self.expert_state_bytes,
                format!("at most {MAX_EXPERT_STATE_BYTES:e} bytes per expert are supported"),
            ));
        }
        if self.balanced_step_s < MIN_STEP_S {
            return Err(SimError::invalid("model.balanced_step_s", self.balanced_step_s, format!("must be ≥ {MIN_STEP_S} s")));
        }
        if !(0.0..=1.0).contains(&self.expert_fraction) {
            return Err(SimError::invalid("model.expert_fraction", self.expert_fraction, "must be in [0, 1]"));
        }
        Ok(())
    }
}

/// How Lazarus's dispatcher spreads an expert's tokens over its replicas, which sets how long a
/// step takes on a plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Dispatch {
    /// As our dispatcher does (`DispatchSchedule::compute_balanced`): the busiest GPU at its
    /// least, λ* — what the controller's rebalance weighs.
    Balanced,
    /// Evenly over the replicas (the per-replica shares of the paper's Algorithm 1).
    EvenSplit,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CostModel {
    pub gpus_per_node: usize,
    pub slots_per_gpu: usize,
    /// Sequences per GPU per step (the paper keeps the per-GPU batch, so throughput follows the
    /// number of GPUs in use).
    pub samples_per_gpu: usize,
    /// Sequences per step whatever the GPUs in use (`lazarus train` keeps its global batch);
    /// None: `samples_per_gpu` per GPU, the paper's way.
    pub global_batch: Option<usize>,
    pub network_gbps: f64,
    pub storage_gbps: f64,
    /// Bytes of checkpointed state per parameter (fp16 weights + fp32 master + two moments).
    pub bytes_per_param: f64,
    /// Waiting for the collective time-out after a failure found out by silence (paper: 10–20 s).
    pub failure_timeout_s: f64,
    /// Finding out a failure by its process's exit (a failure mix's [`crate::mix::Seen::Exit`]):
    /// the launcher on its host sees the exit and the survivors abort their collectives. Our
    /// agents take ~0.1 s on CPU workers (docs/results.md); 1 s allows for aborting NCCL
    /// communicators.
    pub exit_detect_s: f64,
    /// Rebuilding communication groups for a new configuration (paper: 5–15 s).
    pub group_rebuild_s: f64,
    /// Relaunching every process and initialising, before the checkpoint is read.
    pub restart_s: f64,
    /// Fixed cost of a periodic rebalance besides its state transfers (lazy, at a step
    /// boundary: no time-out to wait for).
    pub rebalance_s: f64,
    pub checkpoint_every_ds: u64,
    pub checkpoint_every_ds_ft: u64,
    pub checkpoint_every_lazarus: u64,
    pub rebalance_every: u64,
    /// Joined nodes are used only after this wait, to batch joins (§6.4: 2 minutes).
    pub scale_up_wait_s: f64,
    /// When Lazarus takes in nodes standing by after that wait: at once (the paper's), or with
    /// the next move it makes anyway unless waiting costs more than a move of their own
    /// ([`JoinRule::WhenRepaid`]).
    #[serde(serialize_with = "join_rule_name")]
    pub join_rule: JoinRule,
    /// Lazarus's fault-tolerance floor f (replicas per expert), lowered when slots run short.
    pub min_replicas: usize,
    /// How Lazarus's dispatcher spreads tokens over replicas.
    pub dispatch: Dispatch,
    /// Bytes per second of the links given to Lazarus's expert snapshots, the job's together
    /// (each step sends this times the step time; 0: no snapshot tier). Default: the workers'
    /// ceiling, 625e6 (5 Gb/s).
    pub snapshot_bandwidth: f64,
}

impl Default for CostModel {
    fn default() -> Self {
        CostModel {
            gpus_per_node: 1,
            slots_per_gpu: 6,
            samples_per_gpu: 4,
            global_batch: None,
            network_gbps: 100.0,
            storage_gbps: 10.0,
            bytes_per_param: 16.0,
            failure_timeout_s: 15.0,
            exit_detect_s: 1.0,
            group_rebuild_s: 10.0,
            restart_s: 60.0,
            rebalance_s: 2.0,
            checkpoint_every_ds: 50,
            checkpoint_every_ds_ft: 250,
            checkpoint_every_lazarus: 250,
            rebalance_every: 200,
            scale_up_wait_s: 120.0,
            join_rule: JoinRule::AfterWait,
            min_replicas: 2,
            dispatch: Dispatch::Balanced,
            snapshot_bandwidth: 625e6,
        }
    }
}

/// A join rule as the report names it: `wait` or `repaid`.
fn join_rule_name<S: Serializer>(rule: &JoinRule, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(match rule {
        JoinRule::AfterWait => "wait",
        JoinRule::WhenRepaid { .. } => "repaid",
    })
}

/// The first of `fields` that is 0, refused for `why`.
fn none_zero<T: Copy + Default + PartialEq + std::fmt::Display, const N: usize>(
    fields: [(&'static str, T); N],
    why: &str,
) -> Result<(), SimError> {
    match fields.into_iter().find(|&(_, v)| v == T::default()) {
        Some((field, v)) => Err(SimError::invalid(field, v, why)),
        None => Ok(()),
    }
}

impl CostModel {
    pub fn validate(&self) -> Result<(), SimError> {
        let counts = [
            ("gpus_per_node", self.gpus_per_node),
            ("slots_per_gpu", self.slots_per_gpu),
            ("samples_per_gpu", self.samples_per_gpu),
            // Every expert has a replica: a floor of 0 would mean nothing.
            ("min_replicas", self.min_replicas),
        ];
        none_zero(counts, "must be ≥ 1")?;
        if self.gpus_per_node.saturating_mul(self.slots_per_gpu) > MAX_NODE_SLOTS {
            return Err(SimError::invalid(
                "gpus_per_node × slots_per_gpu",
                format!("{} × {}", self.gpus_per_node, self.slots_per_gpu),
                format!("at most {MAX_NODE_SLOTS} replica slots per node are supported"),
            ));
        }
        if self.samples_per_gpu > MAX_SAMPLES_PER_GPU {
            return Err(SimError::invalid("samples_per_gpu", self.samples_per_gpu, format!("at most {MAX_SAMPLES_PER_GPU}")));
        }
        if let Some(b) = self.global_batch.filter(|&b| b == 0 || b > MAX_SAMPLES_PER_GPU) {
            return Err(SimError::invalid("global_batch", b, format!("must be 1 to {MAX_SAMPLES_PER_GPU}")));
        }
        for (field, v) in
            [("network_gbps", self.network_gbps), ("storage_gbps", self.storage_gbps), ("bytes_per_param", self.bytes_per_param)]
        {
            if !v.is_finite() || v <= 0.0 {
                return Err(SimError::invalid(field, v, "must be finite and > 0"));
            }
        }
        for (field, v) in [
            ("failure_timeout_s", self.failure_timeout_s),
            ("exit_detect_s", self.exit_detect_s),
            ("group_rebuild_s", self.group_rebuild_s),
            ("restart_s", self.restart_s),
            ("rebalance_s", self.rebalance_s),
            ("scale_up_wait_s", self.scale_up_wait_s),
            ("snapshot_bandwidth", self.snapshot_bandwidth),
        ] {
            if !v.is_finite() || v < 0.0 {
                return Err(SimError::invalid(field, v, "must be finite and ≥ 0"));
            }
        }
        let periods = [
            ("checkpoint_every_ds", self.checkpoint_every_ds),
            ("checkpoint_every_ds_ft", self.checkpoint_every_ds_ft),
            ("checkpoint_every_lazarus", self.checkpoint_every_lazarus),
            ("rebalance_every", self.rebalance_every),
        ];
        none_zero(periods, "must be ≥ 1 step")
    }

    /// Seconds to write (or read) the whole model state to (from) remote storage.
    pub fn checkpoint_s(&self, model: &ModelSpec) -> f64 {
        model.params * self.bytes_per_param * 8.0 / (self.storage_gbps * 1e9)
    }

    /// Seconds to move `bytes` over one node's network link.
    pub fn transfer_s(&self, bytes: f64) -> f64 {
        bytes * 8.0 / (self.network_gbps * 1e9)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model_err(f: impl FnOnce(&mut ModelSpec)) -> String {
        let mut m = ModelSpec::preset("gpt-s").unwrap();
        f(&mut m);
        m.validate().unwrap_err().to_string()
    }

    fn cost_err(f: impl FnOnce(&mut CostModel)) -> String {
        let mut c = CostModel::default();
        f(&mut c);
        c.validate().unwrap_err().to_string()
    }

    #[test]
    fn model_shapes_are_bounded() {
        assert_eq!(model_err(|m| m.layers = 100_000_000), "invalid model.layers: 100000000 (at most 4096 MoE layers are supported)");
        assert_eq!(model_err(|m| m.experts = 70_000), "invalid model.experts: 70000 (at most 65536 experts per layer are supported)");
        let e = model_err(|m| (m.layers, m.experts) = (4096, 2048));
        assert!(e.contains("4096 layers × 2048 experts") && e.contains("4194304"), "{e}");
        let mut m = ModelSpec::preset("gpt-s").unwrap();
        (m.layers, m.experts) = (64, 65_536);
        m.validate().unwrap();
        assert!(model_err(|m| m.balanced_step_s = 1e-9).contains("model.balanced_step_s"));
        assert!(model_err(|m| m.expert_state_bytes = 1e20).contains("model.expert_state_bytes"));
        assert!(model_err(|m| m.expert_fraction = f64::NAN).contains("model.expert_fraction"));
    }

    #[test]
    fn node_slots_and_batches_are_bounded() {
        let e = cost_err(|c| (c.gpus_per_node, c.slots_per_gpu) = (usize::MAX, 2));
        assert!(e.contains("gpus_per_node × slots_per_gpu") && e.contains(&usize::MAX.to_string()), "{e}");
        assert!(cost_err(|c| c.samples_per_gpu = usize::MAX).contains("samples_per_gpu"));
        CostModel { gpus_per_node: 8, slots_per_gpu: 52, ..CostModel::default() }.validate().unwrap();
    }
}
