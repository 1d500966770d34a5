//! One MoE layer across ranks (paper §4.2): route, all-gather the per-expert token counts,
//! compute the shared dispatch schedule, send every token slot's row to a replica with a
//! padding-free all-to-all, run the local experts, send results back and combine; backward
//! mirrors it and sums each expert's gradient over its holders.
//!
//! Files: this one holds the types; `packing` lays rows out in the all-to-all buffers;
//! `distinct` sends a token once to each rank its choices are on, in all four exchanges;
//! `forward` and `backward` are the two passes.

mod backward;
pub mod catch_up;
mod distinct;
mod forward;
mod packing;

use std::collections::BTreeMap;
use std::time::Duration;

use candle_core::{Tensor, Var};
use lazarus_model::config::Activation;
use lazarus_plan::RankLayout;

use crate::error::RuntimeError;

use distinct::Arrival;
use packing::{Local, Packing, Remote};

/// One physical copy of an expert (f32).
/// Default largest replica-gradient all-reduce bucket (bytes), as PyTorch DDP's: buckets are
/// what lets the all-reduce overlap the experts' backward; a bucket never splits an expert.
pub const DEFAULT_BUCKET_BYTES: usize = 25 << 20;

#[derive(Debug, Clone)]
pub struct ExpertWeights {
    /// The expert's parameters: [W1, b1, W2, b2], or [W1, W2] without FFN biases.
    vars: Vec<Var>,
    act: Activation,
}

impl ExpertWeights {
    /// An expert of `act` with these parameters (2 or 4 of them).
    pub fn new(vars: Vec<Var>, act: Activation) -> Result<Self, RuntimeError> {
        if vars.len() != 2 && vars.len() != 4 {
            return Err(RuntimeError::Invalid { field: "expert", reason: format!("{} tensors: an expert has 2 or 4", vars.len()) });
        }
        Ok(ExpertWeights { vars, act })
    }

    /// The parameters, in [`lazarus_model::MoeModel::expert_param_names`] order.
    pub fn vars(&self) -> &[Var] {
        &self.vars
    }

    /// y = the expert's FFN of x [n, d] (zero biases where the model has none).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor, RuntimeError> {
        let refs: Vec<&Tensor> = self.vars.iter().map(|v| v.as_tensor()).collect();
        let [w1, b1, w2, b2] = lazarus_model::ops::ffn_weights(&refs)?;
        Ok(lazarus_model::ops::expert_ffn(x, &w1, &b1, &w2, &b2, self.act)?)
    }
}

/// How tokens travel to the experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DispatchMode {
    /// Lazarus (Algorithm 1): any replica may serve a token, shares follow the replica counts,
    /// and the all-to-all carries exactly the rows that move (no padding).
    Flexible,
    /// As `Flexible`, but an expert's tokens are shared over its holders so that the ranks'
    /// total loads are even ([`lazarus_plan::DispatchSchedule::compute_balanced`]).
    Balanced,
    /// The static expert-parallel baseline (DeepSpeed-MoE): one replica per expert, and every
    /// buffer padded to `experts on the receiver × C` rows, C the largest number of tokens any
    /// rank routes to one expert (dropless). As in DeepSpeed, whose experts run on the whole
    /// `[ranks · C, d]` capacity buffer they receive, the padding rows are computed too (they
    /// get zero gradients, so results are unchanged).
    StaticPadded,
    /// As `StaticPadded` on the wire, but experts compute only the real rows: a stronger
    /// baseline than DeepSpeed (what a dropless grouped-GEMM implementation would do).
    StaticSkipPadding,
    /// Deterministic training (`--deterministic`): each rank's tokens for an expert go whole to
    /// one replica ([`lazarus_plan::DispatchSchedule::compute_whole`]), the expert computes each
    /// such block on its own, its gradients are exact sums ([`lazarus_comm::exact`]) summed over
    /// its holders by the caller, and the load-balancing loss is each rank's own (its shard's):
    /// nothing a rank computes depends on which ranks exist or where the replicas are.
    Deterministic,
}

impl DispatchMode {
    /// One replica per expert, buffers padded to the largest load.
    pub fn is_static(self) -> bool {
        matches!(self, DispatchMode::StaticPadded | DispatchMode::StaticSkipPadding)
    }

    /// Whether a token goes once to each rank its choices are on and the holder combines what
    /// it computed for it ([`distinct`]): not for the static baselines (their wire form is
    /// theirs) nor in deterministic steps (the holder's sums would make the bits depend on
    /// where the experts are).
    pub fn sums_on_holders(self) -> bool {
        matches!(self, DispatchMode::Flexible | DispatchMode::Balanced)
    }
}

/// Row positions inside the all-to-all buffers, shared by the four exchanges of a step.
#[derive(Debug, Clone)]

/// This rank's part of an MoE layer: the replicated router and the experts placed here.
pub struct DistributedMoe {
    pub gate: Var,
    /// The loss-free balancing's routing bias [E], shared with the model's parameter of it
    /// (None without it): it picks the top-k, the weights stay the router's
    /// ([`lazarus_model::routing::Router::choose`]).
    pub route_bias: Option<Var>,
    /// Experts with at least one replica on this rank.
    pub experts: BTreeMap<usize, ExpertWeights>,
    /// R[e][rank] of the current placement.
    pub replicas: Vec<Vec<u32>>,
    pub top_k: usize,
    /// How the router scores and picks, and weights a token's choices
    /// ([`lazarus_model::routing::Router`], from the model's configuration).
    pub router: lazarus_model::routing::Router,
    pub timeout: Duration,
    pub mode: DispatchMode,
    /// Largest replica-gradient all-reduce bucket ([`DEFAULT_BUCKET_BYTES`]).
    pub bucket_bytes: usize,
    /// Experts restored from a stale snapshot that catch up on the tokens they lost: the
    /// router gives each about [`catch_up::CATCH_UP_FRACTION`] more tokens ([`catch_up`]).
    pub catching_up: Vec<usize>,
}

/// What the forward pass keeps for backward.
pub struct MoeForward {
    /// The layer output for this rank's tokens [n, d].
    pub output: Tensor,
    /// Tokens routed to each expert from this rank.
    pub local_load: Vec<u64>,
    /// Tokens routed to each expert from all ranks (the load monitor's input).
    pub global_load: Vec<u64>,
    /// This rank's share of the Switch load-balancing loss, E · Σ_e f_e · Σ_{local t} P_e(t) / N
    /// with f_e the global assignment share and N the global token count: summed over the ranks
    /// it is the single-process layer's aux loss. In h's graph.
    pub aux: Tensor,
    /// Normalised combine weight of each of this rank's slots [n, k] (f32, detached).
    combine: Tensor,
    /// The same weights in h's graph: where a holder combined a token's slots, their gradient
    /// comes back from it ([`ExpertGrads::combine_grad`]) and enters the graph here.
    pub weights: Tensor,
    /// Token slots this rank dispatched to other ranks (padding excluded): a row per (token,
    /// choice) whose expert is elsewhere, what a slot-based dispatcher moves in each exchange.
    pub rows_sent: u64,
    layout: RankLayout,
    packing: Packing,
    /// The buffers that cross to other ranks (`packing` without this rank's own).
    remote: Remote,
    /// This rank's own slots, which stay on the device.
    local: Local,
    /// How each rank's dispatch buffer came (every later exchange with it follows).
    arrivals: Vec<Arrival>,
    /// Per rank whose tokens came once: the outputs of its slots here (buffer order, host).
    held_outputs: Vec<Vec<f32>>,
    /// Bytes this rank sent to other ranks in the forward all-to-alls.
    pub wire_bytes: u64,
    /// Rows this rank's experts computed (padding included when the mode computes it).
    pub expert_rows: u64,
    /// Per local expert: (expert, leaf input, output, its (first row, rows) block from each rank).
    expert_segments: Vec<ExpertSegment>,
    n: usize,
    d: usize,
}

/// One local expert's forward: (expert, leaf input, output, its (first row, rows) block from
/// each rank).
type ExpertSegment = (usize, Var, Tensor, Vec<(usize, usize)>);

/// The expert path's gradients on one rank.
pub struct ExpertGrads {
    /// Local experts: [w1, b1, w2, b2] summed over the expert's holders.
    pub experts: BTreeMap<usize, Vec<Tensor>>,
    /// [`DispatchMode::Deterministic`]: each local expert's gradients over each block of rows it
    /// computed here (its parameters one after the other), for the caller to add exactly and
    /// sum over the holders (`experts` is empty then).
    pub exact: BTreeMap<usize, Vec<Vec<f32>>>,
    /// d loss / d h through the experts [n, d].
    pub h_through_experts: Tensor,
    /// d loss / d w [n, k] (f32) of the slots whose holder combined them, zero elsewhere: the
    /// caller adds ⟨`MoeForward::weights`, this⟩ to the seed of the block's backward. None
    /// when no holder combined.
    pub combine_grad: Option<Tensor>,
    /// Bytes this rank sent to other ranks in the backward all-to-alls.
    pub wire_bytes: u64,
}

/// Gradients of one distributed MoE layer on one rank.
pub struct MoeGrads {
    /// Local experts: [w1, b1, w2, b2] summed over the expert's holders.
    pub experts: BTreeMap<usize, Vec<Tensor>>,
    /// The gate gradient summed over all ranks.
    pub gate: Tensor,
    /// d loss / d h through the experts (add the router path from `router`).
    pub h_through_experts: Tensor,
    /// The GradStore of the combine/router segment on this rank.
    pub router: candle_core::backprop::GradStore,
    /// Bytes this rank sent to other ranks in the backward all-to-alls (gradient all-reduces
    /// not included).
    pub wire_bytes: u64,
}
