//! The flexible token dispatcher's schedule (paper §4.2, Algorithm 1).
//!
//! Every rank all-gathers T[e][j] (tokens routed to expert e on rank j) and knows R[e][j]
//! (replicas of e on rank j). From these alone it computes the same integer matrix
//! D[e][src][dst] as every other rank, so send and receive sizes of the padding-free all-to-all
//! agree without another message.
//!
//! For each expert:
//! 1. Capacity: rank j should process t_e · R[e][j] / r_e tokens (line 4–6). We apportion t_e
//!    over the ranks by largest remainder, so integer capacities C_j sum to t_e and each is
//!    within one token of its ideal; a rank with k replicas gets k shares.
//! 2. Local tokens use local capacity first (line 7–8): D[e][j][j] = min(T[e][j], C_j).
//! 3. The excess X_i = T[e][i] − D[e][i][i] of each sender is split over the residual capacities
//!    P_j = C_j − D[e][j][j] in proportion (the paper's line 10, with its denominator Σ_{k≠i} P_k
//!    read as over the ranks other than the *sender*; since a rank with excess has no residual
//!    capacity, that is Σ_k P_k). The ideal X_i·P_j/ΣP is rounded to floor or ceil so that *both*
//!    every row sums to X_i (tokens are conserved) and every column to P_j (every replica gets
//!    exactly its capacity): floors first, then the remaining units are matched sender→receiver
//!    on cells with a fractional part, largest fractions first, completed by augmenting paths.
//!    Such a rounding always exists because the fractional matrix is a feasible flow.
//!
//! Files: this one holds the schedule ([`DispatchSchedule`]); `capacity` the per-rank
//! capacities (Algorithm 1's and the rank-balanced ones), `rounding` the exact integer rounding
//! of each expert's excess, `layout` one rank's send/receive buffers.

mod capacity;
mod layout;
mod rounding;
#[cfg(test)]
mod tests;

use capacity::apportion_into;
pub use capacity::{apportion, balanced_capacities};
pub use layout::RankLayout;
use rounding::{expert_routes, Scratch};

use serde::{Deserialize, Serialize};

use crate::error::PlanError;

/// Per-expert, per-rank token counts as all-gathered before dispatch: `tokens[e][rank]`.
pub type TokenCounts = Vec<Vec<u64>>;

/// One non-zero entry of D: `tokens` tokens routed to `expert` on `src` are processed on `dst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Route {
    pub expert: u32,
    pub src: u32,
    pub dst: u32,
    pub tokens: u64,
}

/// The integer matrix D[e][src][dst], stored sparsely in (expert, src, dst) order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DispatchSchedule {
    experts: usize,
    ranks: usize,
    routes: Vec<Route>,
    /// routes of expert e are `routes[start[e]..start[e + 1]]`.
    start: Vec<usize>,
}

impl DispatchSchedule {
    /// Compute D from the all-gathered token counts and the replica counts R[e][rank]
    /// (Algorithm 1: every replica of an expert takes an equal share of its tokens).
    pub fn compute(tokens: &[Vec<u64>], replicas: &[Vec<u32>]) -> Result<Self, PlanError> {
        Self::build(tokens, replicas, false)
    }

    /// Like [`DispatchSchedule::compute`], but an expert's tokens are shared over its holders so
    /// that the ranks' *total* loads are as even as the holder sets allow (see
    /// [`balanced_capacities`]), instead of equally per replica. With integer replica counts on
    /// few slots, per-replica shares leave a rank holding 3 of 9 replicas of a hot expert with
    /// 1.33× the mean work; this removes that. Everything after the capacities is Algorithm 1.
    pub fn compute_balanced(tokens: &[Vec<u64>], replicas: &[Vec<u32>]) -> Result<Self, PlanError> {
        Self::build(tokens, replicas, true)
    }

    /// D for deterministic training: each sender's tokens for an expert go *whole* to one
    /// holder — the sender itself if it holds the expert, else the holder with the fewest
    /// tokens so far (ties to the lowest rank), senders and experts taken in order. A block of
    /// rows then reaches an expert as it left its sender, whatever the plan, so the expert's
    /// products over it have the same bits on any number of workers. Balance is coarser than
    /// Algorithm 1's (by block, not by token).
    pub fn compute_whole(tokens: &[Vec<u64>], replicas: &[Vec<u32>]) -> Result<Self, PlanError> {
        Self::check(tokens, replicas)?;
        let experts = tokens.len();
        let ranks = tokens.first().map_or(0, Vec::len);
        let mut load = vec![0u64; ranks];
        let mut routes = Vec::new();
        let mut start = Vec::with_capacity(experts + 1);
        for e in 0..experts {
            start.push(routes.len());
            for src in (0..ranks).filter(|&s| tokens[e][s] > 0) {
                let dst = if replicas[e][src] > 0 {
                    src
                } else {
                    // A holder exists: `check` refuses tokens for an expert without one.
                    (0..ranks).filter(|&r| replicas[e][r] > 0).min_by_key(|&r| (load[r], r)).unwrap_or(src)
                };
                load[dst] += tokens[e][src];
                routes.push(Route { expert: e as u32, src: src as u32, dst: dst as u32, tokens: tokens[e][src] });
            }
        }
        start.push(routes.len());
        Ok(DispatchSchedule { experts, ranks, routes, start })
    }

    /// The inputs every schedule requires: one count per rank, no overflow, a holder for every
    /// expert with tokens.
    fn check(tokens: &[Vec<u64>], replicas: &[Vec<u32>]) -> Result<(), PlanError> {
        let experts = tokens.len();
        if replicas.len() != experts {
            return Err(PlanError::Length { field: "replicas", got: replicas.len(), expected: experts });
        }
        let ranks = tokens.first().map_or(0, Vec::len);
        for (e, (t, r)) in tokens.iter().zip(replicas).enumerate() {
            if t.len() != ranks {
                return Err(PlanError::Length { field: "tokens", got: t.len(), expected: ranks });
            }
            if r.len() != ranks {
                return Err(PlanError::Length { field: "replicas", got: r.len(), expected: ranks });
            }
            if t.iter().try_fold(0u64, |acc, &x| acc.checked_add(x)).is_none_or(|total| total > u64::MAX / 2) {
                return Err(PlanError::invalid("tokens", format!("expert {e}"), "token counts overflow"));
            }
            if r.iter().all(|&x| x == 0) && t.iter().any(|&x| x > 0) {
                return Err(PlanError::invalid("replicas", format!("expert {e}"), "tokens are routed to an expert that has no replica"));
            }
        }
        // Rank loads add up over experts (balancing, per-rank totals): bound the grand total too.
        if tokens.iter().flatten().try_fold(0u64, |acc, &x| acc.checked_add(x)).is_none_or(|total| total > u64::MAX / 2) {
            return Err(PlanError::invalid("tokens", "all experts", "token counts overflow"));
        }
        Ok(())
    }

    fn build(tokens: &[Vec<u64>], replicas: &[Vec<u32>], balanced: bool) -> Result<Self, PlanError> {
        Self::check(tokens, replicas)?;
        let experts = tokens.len();
        let ranks = tokens.first().map_or(0, Vec::len);
        let mut routes = Vec::with_capacity(experts * ranks * 2);
        let mut start = Vec::with_capacity(experts + 1);
        let mut scratch = Scratch::default();
        let caps = if balanced { Some(balanced_capacities(tokens, replicas)) } else { None };
        for e in 0..experts {
            start.push(routes.len());
            let total: u64 = tokens[e].iter().sum();
            scratch.cap.resize(ranks, 0);
            match &caps {
                Some(c) => scratch.cap.copy_from_slice(&c[e]),
                None => {
                    let Scratch { rems, cap, .. } = &mut scratch;
                    apportion_into(total, &replicas[e], rems, cap);
                }
            }
            expert_routes(e as u32, &tokens[e], &mut scratch, &mut routes);
        }
        start.push(routes.len());
        Ok(DispatchSchedule { experts, ranks, routes, start })
    }

    pub fn experts(&self) -> usize {
        self.experts
    }

    pub fn ranks(&self) -> usize {
        self.ranks
    }

    /// Non-zero entries of D for one expert, ordered by (src, dst).
    pub fn routes(&self, expert: usize) -> &[Route] {
        &self.routes[self.start[expert]..self.start[expert + 1]]
    }

    /// All non-zero entries, ordered by (expert, src, dst).
    pub fn all_routes(&self) -> &[Route] {
        &self.routes
    }

    /// D[e][src][dst].
    pub fn get(&self, expert: usize, src: usize, dst: usize) -> u64 {
        self.routes(expert).iter().find(|r| r.src as usize == src && r.dst as usize == dst).map_or(0, |r| r.tokens)
    }

    /// s_j of Algorithm 1 for sender `src`: tokens it sends to each rank (itself included).
    pub fn send_counts(&self, src: usize) -> Vec<u64> {
        let mut out = vec![0; self.ranks];
        self.routes.iter().filter(|r| r.src as usize == src).for_each(|r| out[r.dst as usize] += r.tokens);
        out
    }

    /// Tokens rank `dst` receives from each rank (itself included).
    pub fn recv_counts(&self, dst: usize) -> Vec<u64> {
        let mut out = vec![0; self.ranks];
        self.routes.iter().filter(|r| r.dst as usize == dst).for_each(|r| out[r.src as usize] += r.tokens);
        out
    }

    /// Tokens each rank processes in total (its expert compute load).
    pub fn processed_per_rank(&self) -> Vec<u64> {
        let mut out = vec![0; self.ranks];
        self.routes.iter().for_each(|r| out[r.dst as usize] += r.tokens);
        out
    }

    /// Dense D[e][src][dst], for tests and small diagnostics.
    pub fn dense(&self) -> Vec<Vec<Vec<u64>>> {
        let mut d = vec![vec![vec![0; self.ranks]; self.ranks]; self.experts];
        for r in &self.routes {
            d[r.expert as usize][r.src as usize][r.dst as usize] += r.tokens;
        }
        d
    }
}
